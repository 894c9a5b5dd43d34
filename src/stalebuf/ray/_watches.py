"""How a remote ``rollout()`` learns, without polling, that its group was evicted in flight or the
buffer closed.

Entering a remote rollout registers a callback on the in-flight group with
:meth:`ReplayBuffer.watch <stalebuf.ReplayBuffer.watch>`, as the local ``rollout()`` does: the
buffer calls it once on in-flight eviction and on ``close``. The client then parks one call,
``watch_rollout(token)``, in the actor's ``watch`` concurrency group. It returns "evicted" or
"closed" when the callback fires (the client then cancels the block's body), or "ended" once the
group was finished or failed through this actor, or its client abandoned it.

Everything here runs on the actor's home loop.
"""

from __future__ import annotations

import asyncio
import functools

from ..buffer import ReplayBuffer
from ._protocol import EndRollout

__all__ = ["RolloutWatches"]


class _Watch:
    """One entered rollout: its group, and the answer its ``watch_rollout`` call waits for."""

    __slots__ = ("answer", "token", "uid")

    def __init__(self, token: str, uid: str, answer: asyncio.Future[str]) -> None:
        self.token = token
        self.uid = uid
        self.answer = answer


class RolloutWatches:
    """The entered remote rollouts of one actor's buffer, by token and by group uid.

    A watch is forgotten when its ``watch_rollout`` call collected an eviction or close, or when
    the group ended through this actor. (One whose client died between entering and watching,
    and whose group was then evicted, stays until the actor ends: one small record.)
    """

    def __init__(self, buffer: ReplayBuffer) -> None:
        self._buffer = buffer
        self._by_token: dict[str, _Watch] = {}
        self._by_uid: dict[str, _Watch] = {}  # only groups still in flight

    def __len__(self) -> int:
        """The number of watches not yet forgotten."""
        return len(self._by_token)

    def __bool__(self) -> bool:
        """Whether any watch is held (checked on every producer call: it must be cheap)."""
        return bool(self._by_token)

    def open(self, token: str, uid: str) -> int:
        """Watch the in-flight group ``uid`` just entered under ``token``; return its dispatch step."""
        watch = _Watch(token, uid, asyncio.get_running_loop().create_future())
        # Just added and marked running, nothing ran since: this watches that very group.
        handle = self._buffer.watch(uid, functools.partial(self._fired, watch))
        self._by_token[token] = watch
        self._by_uid[uid] = watch
        return handle.dispatch_step

    def ended(self, uid: str) -> None:
        """The group ``uid`` was finished or failed through this actor: release its watch."""
        watch = self._by_uid.get(uid)
        if watch is not None:
            self._settle(watch, "ended", keep=False)

    def abandon(self, token: str) -> bool:
        """The rollout entered under ``token`` was cancelled on its client: fail the group if it
        is still in flight (nobody generates it any more) and release the watch.

        Returns whether a rollout was entered under ``token``.
        """
        watch = self._by_token.get(token)
        if watch is None:
            return False
        if self._by_uid.get(watch.uid) is watch:
            EndRollout(watch.uid, finished=False).apply(self._buffer)
        self._settle(watch, "ended", keep=False)
        return True

    async def watch(self, token: str) -> str:
        """Return "evicted" or "closed" when the group of ``token`` is evicted in flight or the
        buffer closes, or "ended" once it ended otherwise (at once if it already did)."""
        watch = self._by_token.get(token)
        if watch is None:
            return "ended"
        answer = await watch.answer
        if self._by_token.get(token) is watch:
            del self._by_token[token]
        return answer

    def _fired(self, watch: _Watch) -> None:
        """The buffer's callback, inside ``sample``'s eviction or ``close``: it must not raise."""
        self._settle(watch, "closed" if self._buffer.closed else "evicted", keep=True)

    def _settle(self, watch: _Watch, answer: str, *, keep: bool) -> None:
        if self._by_uid.get(watch.uid) is watch:
            del self._by_uid[watch.uid]
        if not keep and self._by_token.get(watch.token) is watch:
            del self._by_token[watch.token]
        if not watch.answer.done():
            watch.answer.set_result(answer)
