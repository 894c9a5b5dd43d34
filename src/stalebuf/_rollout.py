"""``rollout()``: the structured-concurrency producer loop.

One ``async with`` admits a group (waiting for admission), marks it RUNNING, and ends it when
the block ends: FINISHED when the body returns, FAILED when it raises. If the group is evicted
while the body runs (stale in flight, or the buffer closes), the body is cancelled through an
anyio cancel scope and the block exits quietly, so a producer never keeps generating for a
group nobody can train.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from ._partition import OpenGroup
from .errors import BufferClosedError, GroupEvictedError

if TYPE_CHECKING:
    from ._producers import Producers

__all__ = ["RolloutGroup", "rollout"]


class RolloutGroup:
    """The group a ``rollout()`` block generates.

    Attributes:
        uid: the group's uid.
        partition: its partition.
        global_steps: its dispatch step (the tag admission gave it); also ``dispatch_step``.
        evicted: True once the group was evicted while the block ran (its body was cancelled).
    """

    __slots__ = ("_buffer", "evicted", "global_steps", "partition", "uid")

    def __init__(self, buffer: Producers, uid: str, partition: str, global_steps: int) -> None:
        self._buffer = buffer
        self.uid = uid
        self.partition = partition
        self.global_steps = global_steps
        self.evicted = False

    @property
    def dispatch_step(self) -> int:
        """The group's dispatch step (the same as ``global_steps``)."""
        return self.global_steps

    def put_nowait(
        self,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
    ) -> str:
        """Add one trajectory to the group and return its key (see ``ReplayBuffer.put_nowait``).

        Raises:
            The errors of ``ReplayBuffer.put_nowait`` (GroupEvictedError once it was evicted).
        """
        return self._buffer.put_nowait(self.uid, payload, session_id=session_id, index=index, tags=tags)

    async def put(
        self,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
    ) -> str:
        """Add one trajectory and return its key; the async twin of :meth:`put_nowait`."""
        return self.put_nowait(payload, session_id=session_id, index=index, tags=tags)


@asynccontextmanager
async def rollout(
    buffer: Producers,
    uid: str,
    *,
    global_steps: int | None,
    partition: str,
    tags: Mapping[str, Any] | None,
) -> AsyncIterator[RolloutGroup]:
    """Admit, run and end one group (see ``ReplayBuffer.rollout``)."""
    await buffer.add_prompt(uid, global_steps=global_steps, partition=partition, tags=tags)
    buffer.mark_running_nowait(uid)
    state = buffer._groups[uid]
    assert type(state) is OpenGroup  # just admitted and marked running, nothing ran since
    group = RolloutGroup(buffer, uid, partition, state.dispatch_step)
    with anyio.CancelScope() as scope:

        def evicted() -> None:
            group.evicted = True
            scope.cancel()

        if state.watchers is None:
            state.watchers = []
        state.watchers.append(evicted)
        try:
            yield group
        except BaseException as exc:
            if not group.evicted:
                _end(buffer, uid, finished=False)
                raise
            # It wrote after the eviction, before its cancellation arrived (perhaps from tasks
            # of its own, whose task group wraps the refusals): the same outcome as cancelled.
            rest = _without_refusals(exc)
            if rest is exc:
                raise
            if rest is not None:
                raise rest from None  # what is left (cancellations, other errors) goes on
        if not group.evicted:
            _end(buffer, uid, finished=True)


_REFUSALS = (GroupEvictedError, BufferClosedError)


def _without_refusals(exc: BaseException) -> BaseException | None:
    """Return ``exc`` without the refused writes in it: None if it is one, or an exception
    group of nothing else; the rest of a group that holds some; else ``exc`` itself."""
    if isinstance(exc, _REFUSALS):
        return None
    split = getattr(exc, "split", None) if hasattr(exc, "exceptions") else None
    if split is None:  # not an exception group (a builtin from 3.11, anyio's backport before)
        return exc
    refused, rest = split(_REFUSALS)
    return exc if refused is None else rest


def _end(buffer: Producers, uid: str, *, finished: bool) -> None:
    """Finish or fail ``uid`` if it is still in flight (the body may have ended it itself)."""
    if buffer._closed or type(buffer._groups.get(uid)) is not OpenGroup:
        return
    if finished:
        buffer.mark_finished_nowait(uid)
    else:
        buffer.mark_failed_nowait(uid)
