"""The actor's producers waiting for admission, each under the token its client chose.

A producer operation that adds a group (``add_prompt``, ``put_group``, a rollout's entry) is
applied at once when admission control has a slot for it. When it has none, the actor *parks*
it: a task on the home loop awaits the buffer's own waiting call, so the operation joins the
partition's FIFO of waiting producers, and the client collects the result with
``await_admission(token)``, a call in the ``admission`` concurrency group (the only slots a
parked producer holds; it holds one only while its client waits for the result). A client whose
call is cancelled sends ``abandon(token)``, and the ledger decides:

- the operation has not arrived yet (``abandon`` travels in another concurrency group and may
  overtake it): the token is remembered, and the operation is not applied when it arrives;
- it is parked and still waiting: its task is cancelled, and the buffer's wait adds nothing;
- it was admitted but its client never got the result: it stays admitted, like any producer call
  cancelled after it was sent (a rollout's entry is then failed, see ``_watches``).

Everything here runs on the actor's home loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from ..errors import StalebufError

__all__ = ["AdmissionAbandonedError", "AdmissionLedger"]

logger = logging.getLogger("stalebuf.ray")

# A parked operation whose result nobody collected is forgotten this long after it ended: only a
# client that died while its producer waited leaves one behind.
UNCOLLECTED_SECONDS = 600.0
# At most this many tokens abandoned before their operation arrived are remembered (one whose
# operation never arrives, e.g. it was applied at once, would otherwise stay forever).
MAX_EARLY_ABANDONS = 10_000


class AdmissionAbandonedError(StalebufError):
    """The client abandoned this operation before the actor could apply it (nobody reads it)."""


class AdmissionLedger:
    """Producer operations parked until admission control has a slot, by token."""

    def __init__(self) -> None:
        self._parked: dict[str, asyncio.Task[Any]] = {}
        self._ended: dict[str, float] = {}  # token -> when its task ended, oldest first
        self._abandoned_early: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self.parked = 0
        self.cancelled_waiting = 0
        self.abandoned_early = 0
        self.expired = 0

    def arrived(self, token: str) -> bool:
        """Return whether the operation under ``token`` may be applied (False, once, if its
        client abandoned it before it arrived)."""
        if token in self._abandoned_early:
            del self._abandoned_early[token]
            return False
        return True

    def park(self, token: str, admit: Coroutine[Any, Any, Any]) -> None:
        """Run ``admit`` (the waiting form of the operation) in a task of its own, under ``token``."""
        self._expire(time.monotonic())
        task = asyncio.get_running_loop().create_task(admit)
        self._parked[token] = task
        self.parked += 1
        task.add_done_callback(lambda _: self._task_ended(token, task))

    async def collect(self, token: str) -> Any:
        """Wait for the operation parked under ``token`` and return its result (or raise its error).

        Raises:
            AdmissionAbandonedError: nothing is parked under ``token`` (abandoned, or expired).
        """
        task = self._parked.get(token)
        if task is None:
            raise AdmissionAbandonedError(f"no producer operation is parked under {token!r}")
        # Only abandon() cancels the wait: a cancelled await_admission call (the actor exiting)
        # leaves it parked.
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._forget(token, task)

    def abandon(self, token: str) -> bool:
        """The client's call under ``token`` was cancelled: cancel its wait if it still waits.

        Returns whether anything was parked under ``token``. A task that is not done has not
        admitted anything (admission and the end of the task happen in one step of the loop).
        """
        task = self._parked.pop(token, None)
        if task is None:
            return False
        self._ended.pop(token, None)
        if not task.done():
            self.cancelled_waiting += 1
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            logger.info(
                "a producer call (%r) was admitted before its client cancelled it: it stays applied",
                token,
            )
        return True

    def remember_abandoned(self, token: str) -> None:
        """Remember ``token`` as abandoned before its operation arrived (see :meth:`arrived`)."""
        self.abandoned_early += 1
        early = self._abandoned_early
        early[token] = None
        if len(early) > MAX_EARLY_ABANDONS:
            del early[next(iter(early))]

    def counts(self) -> dict[str, int]:
        """Counters for ``info()``: operations waiting, results not yet collected, what abandons did."""
        return {
            "waiting": len(self._parked) - len(self._ended),
            "uncollected": len(self._ended),
            "parked": self.parked,
            "cancelled_waiting": self.cancelled_waiting,
            "abandoned_early": self.abandoned_early,
            "early_abandons_pending": len(self._abandoned_early),
            "expired": self.expired,
        }

    def _task_ended(self, token: str, task: asyncio.Task[Any]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved here: a result nobody collects must not be logged as lost
        if self._parked.get(token) is task:
            self._ended[token] = time.monotonic()

    def _forget(self, token: str, task: asyncio.Task[Any]) -> None:
        if self._parked.get(token) is task:
            del self._parked[token]
            self._ended.pop(token, None)

    def _expire(self, now: float) -> None:
        ended = self._ended
        while ended:
            token, when = next(iter(ended.items()))
            if now - when < UNCOLLECTED_SECONDS:
                return
            del ended[token]
            self._parked.pop(token, None)
            self.expired += 1
