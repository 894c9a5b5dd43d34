"""How a remote ``rollout()`` learns, without polling, that its group was evicted in flight or the
buffer closed, and how its exit ends only the group it entered.

Entering a remote rollout registers a callback on the in-flight group with
:meth:`ReplayBuffer.watch <stalebuf.ReplayBuffer.watch>`, as the local ``rollout()`` does: the
buffer calls it once on in-flight eviction and on ``close``. The client then parks one call,
``watch_rollout(token)``, in the actor's ``watch`` concurrency group. It returns "evicted" or
"closed" when the callback fires (the client then cancels the block's body), or "ended" once the
group was finished or failed through this actor, or its client abandoned it.

The handle ``watch`` returns names that very group (by identity), and the block's exit names it by
the block's token: the actor ends it with :meth:`ReplayBuffer.end_watched
<stalebuf.ReplayBuffer.end_watched>`, so a block whose body ended its own group never ends a later
group that reuses the uid (nor does abandoning the block).

Everything here runs on the actor's home loop.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

from ..buffer import ReplayBuffer

if TYPE_CHECKING:
    from .._open_group import GroupWatch

__all__ = ["RolloutWatches"]

# How many eviction or close answers, already collected by a watch call, are kept for the block's
# end message: that message can cross the answer on the wire (the body returned just as the group
# was evicted), and must still hear "evicted". The window is one round trip, so the watch group's
# default slot count is plenty; older answers are dropped first.
_RECENT_ANSWERS = 4096


class _Watch:
    """One entered rollout: its group (by identity), and the answer its ``watch_rollout`` waits for."""

    __slots__ = ("answer", "group", "token")

    def __init__(self, token: str, group: GroupWatch, answer: asyncio.Future[str]) -> None:
        self.token = token
        self.group = group
        self.answer = answer


class RolloutWatches:
    """The entered remote rollouts of one actor's buffer, by token and by group uid.

    A watch is forgotten when its ``watch_rollout`` call collected an eviction or close, or when
    the group ended through this actor (the block's exit, another producer call, abandoning).
    (One whose client died between entering and watching, and whose group was then evicted,
    stays until the actor ends: one small record.)
    """

    def __init__(self, buffer: ReplayBuffer) -> None:
        self._buffer = buffer
        self._by_token: dict[str, _Watch] = {}
        self._by_uid: dict[str, _Watch] = {}  # only groups still in flight
        self._collected: dict[str, str] = {}  # token -> answer (see _RECENT_ANSWERS); oldest first

    def __len__(self) -> int:
        """The number of watches not yet forgotten."""
        return len(self._by_token)

    def __bool__(self) -> bool:
        """Whether any watch is held (checked on every producer call: it must be cheap)."""
        return bool(self._by_token)

    def open(self, token: str, uid: str) -> int:
        """Watch the in-flight group ``uid`` just entered under ``token``; return its dispatch step."""
        # Just added and marked running, nothing ran since: this watches that very group.
        group = self._buffer.watch(uid, functools.partial(self._fired, token))
        watch = _Watch(token, group, asyncio.get_running_loop().create_future())
        self._by_token[token] = watch
        self._by_uid[uid] = watch
        return group.dispatch_step

    def end(self, token: str, *, finished: bool) -> str:
        """The block entered under ``token`` exits: finish (or fail) the group it entered if that
        very group is still in flight, and release the watch. Returns "ended", or why not:
        "evicted" (in flight), "closed" (the buffer), "gone" (it ended otherwise: the body ended
        it itself, say). A later group that reuses the uid is never touched."""
        watch = self._by_token.get(token)
        if watch is None:  # its group ended through this actor, or its eviction was collected
            answer = self._collected.pop(token, "gone")
        elif self._buffer.end_watched(watch.group, finished=finished):
            answer = "ended"
        else:  # the watch fired (evicted; closed is below), or the group ended otherwise
            answer = watch.answer.result() if watch.answer.done() else "gone"
        if watch is not None:
            self._settle(watch, "ended", keep=False)
        # A closed buffer ends nothing (end_watched said so): the block hears why.
        return "closed" if self._buffer.closed else answer

    def ended(self, uid: str) -> None:
        """The group ``uid`` was finished or failed through this actor: release its watch."""
        watch = self._by_uid.get(uid)
        if watch is not None:
            self._settle(watch, "ended", keep=False)

    def abandon(self, token: str) -> bool:
        """The rollout entered under ``token`` was cancelled on its client: fail the group it
        entered if that very group is still in flight (nobody generates it any more) and
        release the watch.

        Returns whether a rollout under ``token`` was still watched.
        """
        watch = self._by_token.get(token)
        if watch is None:
            return False
        self._buffer.end_watched(watch.group, finished=False)
        self._settle(watch, "ended", keep=False)
        return True

    async def watch(self, token: str) -> str:
        """Return "evicted", "cut", "cut-evicted" or "closed" when the group of ``token`` is
        evicted in flight, cut at its deadline or the buffer closes, or "ended" once it ended
        otherwise (at once if it already did)."""
        watch = self._by_token.get(token)
        if watch is None:
            return "ended"
        answer = await watch.answer
        if self._by_token.get(token) is watch:  # it fired: nothing else forgets it
            del self._by_token[token]
            self._remember(token, answer)
        return answer

    def _fired(self, token: str) -> None:
        """The buffer's callback, inside ``sample``'s eviction or ``close``: it must not raise."""
        watch = self._by_token.get(token)
        if watch is not None:
            # "evicted" (stale in flight), "cut" or "cut-evicted" (at its deadline), "closed".
            answer = "closed" if self._buffer.closed else (watch.group.ending or "evicted")
            self._settle(watch, answer, keep=True)

    def _settle(self, watch: _Watch, answer: str, *, keep: bool) -> None:
        uid = watch.group.uid
        if self._by_uid.get(uid) is watch:
            del self._by_uid[uid]
        if not keep and self._by_token.get(watch.token) is watch:
            del self._by_token[watch.token]
        if not watch.answer.done():
            watch.answer.set_result(answer)

    def _remember(self, token: str, answer: str) -> None:
        """Keep a collected eviction or close answer for the block's end message, if it comes."""
        self._collected[token] = answer
        if len(self._collected) > _RECENT_ANSWERS:
            del self._collected[next(iter(self._collected))]
