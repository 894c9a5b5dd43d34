"""The actor's ledger of sample requests: where a cancelled remote ``sample`` is decided.

Each client ``sample`` carries a request id. The actor runs the buffer's ``sample`` for it in a
task of its own and keeps the batch it took until the client acknowledges receiving it. A
client whose ``sample`` is cancelled sends ``cancel_sample(id)`` instead, and the ledger decides:

- the request has not arrived yet (the cancel travels in another concurrency group and may
  overtake it): the id is remembered, and the request takes nothing when it arrives;
- the request is still waiting: its task is cancelled (the buffer's ``sample`` takes nothing
  when cancelled while it waits);
- the request took a batch the client has not acknowledged: the batch is put back, once (its
  record is gone after that, so a repeated cancel or a late acknowledgement does nothing).

A client only ever sends one of the two (acknowledge or cancel) per request. Everything here
runs on the actor's home loop, so each decision is atomic with respect to the buffer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..errors import StalebufError
from ..records import Batch

__all__ = ["SampleCancelledError", "SampleLedger", "SampleResult"]

logger = logging.getLogger("stalebuf.ray")

SampleResult = tuple[Batch, dict[str, float]]

# An unacknowledged batch is forgotten (counted as delivered) after this long: only a client
# that died between receiving a batch and acknowledging it leaves one behind, and keeping its
# payload references forever would pin their objects.
UNACKNOWLEDGED_SECONDS = 600.0
# At most this many ids of requests cancelled before they arrived are remembered. One whose
# request never arrives (it raised before the actor saw it) would otherwise stay forever.
MAX_EARLY_CANCELS = 10_000


class SampleCancelledError(StalebufError):
    """The client cancelled this sample request before it reached the actor (nobody reads it)."""


class SampleLedger:
    """Running and unacknowledged sample requests of one actor, and the cancel decision.

    Args:
        readmit: puts the groups of a batch back into the buffer (called on the home loop).
    """

    def __init__(self, readmit: Callable[[Batch], None]) -> None:
        self._readmit = readmit
        self._running: dict[str, asyncio.Task[SampleResult]] = {}
        self._unacknowledged: dict[str, tuple[float, Batch]] = {}  # in order of expiry
        self._cancelled_early: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self.requeued = 0
        self.cancelled_waiting = 0
        self.cancelled_early = 0
        self.expired = 0

    def start(
        self, request_id: str, sample: Callable[[], Coroutine[Any, Any, SampleResult]]
    ) -> asyncio.Task[SampleResult]:
        """Start ``sample()`` for this request in a task of its own and return the task.

        Raises:
            SampleCancelledError: the client cancelled the request before it arrived.
            StalebufError: the id is already in use.
        """
        if request_id in self._cancelled_early:
            del self._cancelled_early[request_id]
            raise SampleCancelledError(f"sample request {request_id!r} was cancelled before it arrived")
        if request_id in self._running or request_id in self._unacknowledged:
            raise StalebufError(f"sample request id {request_id!r} is already in use")
        task = asyncio.ensure_future(sample())
        self._running[request_id] = task
        return task

    def finish(self, request_id: str, task: asyncio.Task[SampleResult]) -> None:
        """Record how the request's task ended: a batch it took waits for acknowledgement."""
        if self._running.get(request_id) is not task:
            return  # cancelled meanwhile: cancel() decided already
        del self._running[request_id]
        if not task.done():  # the actor call itself was cancelled (actor exit, ray.cancel)
            task.add_done_callback(self._put_back_if_taken)
            return
        if task.cancelled() or task.exception() is not None:
            return
        now = time.monotonic()
        self._expire(now)
        self._unacknowledged[request_id] = (now + UNACKNOWLEDGED_SECONDS, task.result()[0])

    def acknowledge(self, request_id: str) -> None:
        """The client received the request's batch: forget it."""
        self._unacknowledged.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """The client's ``sample`` was cancelled: make sure the request takes nothing, or put
        back what it took (exactly once)."""
        entry = self._unacknowledged.pop(request_id, None)
        if entry is not None:
            self._put_back(entry[1])
            return
        task = self._running.pop(request_id, None)
        if task is None:
            self._remember_early_cancel(request_id)
        elif not task.done():
            self.cancelled_waiting += 1
            task.cancel()
            task.add_done_callback(self._put_back_if_taken)  # a cancel that came too late
        else:
            self._put_back_if_taken(task)

    def counts(self) -> dict[str, int]:
        """Counters for ``info()``: requests in each state, and what cancels did."""
        return {
            "running": len(self._running),
            "unacknowledged": len(self._unacknowledged),
            "early_cancels_pending": len(self._cancelled_early),
            "requeued": self.requeued,
            "cancelled_waiting": self.cancelled_waiting,
            "cancelled_early": self.cancelled_early,
            "expired": self.expired,
        }

    def _put_back_if_taken(self, task: asyncio.Task[SampleResult]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._put_back(task.result()[0])

    def _put_back(self, batch: Batch) -> None:
        self.requeued += 1
        self._readmit(batch)

    def _remember_early_cancel(self, request_id: str) -> None:
        self.cancelled_early += 1
        early = self._cancelled_early
        early[request_id] = None
        if len(early) > MAX_EARLY_CANCELS:
            del early[next(iter(early))]

    def _expire(self, now: float) -> None:
        pending = self._unacknowledged
        while pending:
            request_id, (deadline, batch) = next(iter(pending.items()))
            if deadline > now:
                return
            del pending[request_id]
            self.expired += 1
            logger.warning(
                "sample request %r took %d group(s) and was neither acknowledged nor cancelled "
                "within %g s (its client died?): forgetting it",
                request_id,
                len(batch),
                UNACKNOWLEDGED_SECONDS,
            )
