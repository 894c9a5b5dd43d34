"""``rollout()``: the structured-concurrency producer loop.

One ``async with`` admits a group (waiting for admission), marks it RUNNING, and ends it when
the block ends: FINISHED when the body returns, FAILED when it raises. If the group is evicted
while the body runs (stale in flight, or the buffer closes) or cut at its deadline, the body is
cancelled through an anyio cancel scope and the block exits quietly, so a producer never keeps
generating for a group nobody can train (or that was already ended for it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio

from ._open_group import GroupWatch
from .errors import BufferClosedError, GroupCutError, GroupEvictedError

__all__ = ["RolloutBuffer", "RolloutGroup", "rollout"]


class RolloutBuffer(Protocol):
    """What ``rollout()`` asks of a buffer (``ReplayBuffer`` has it)."""

    async def add_prompt(
        self, uid: str, *, global_steps: int | None, partition: str, tags: Mapping[str, Any] | None
    ) -> None: ...

    async def mark_running(self, uid: str, *, version: int | None = None) -> None: ...

    def put_nowait(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int,
        index: int,
        tags: Mapping[str, Any] | None,
        versions: Sequence[tuple[int, int]] | None = None,
        tokens: int | None = None,
    ) -> str: ...

    async def put(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int,
        index: int,
        tags: Mapping[str, Any] | None,
        versions: Sequence[tuple[int, int]] | None = None,
        tokens: int | None = None,
    ) -> str: ...

    def watch(self, uid: str, callback: Callable[[], object]) -> GroupWatch: ...

    def end_watched(self, watch: GroupWatch, *, finished: bool) -> bool: ...


class RolloutGroup:
    """The group a ``rollout()`` block generates.

    Attributes:
        uid: the group's uid.
        partition: its partition.
        global_steps: its dispatch step (the tag admission gave it); also ``dispatch_step``.
        evicted: True once the group was evicted while the block ran (its body was cancelled):
            in flight as stale, by ``close()``, or failed and evicted at its deadline.
        cut: True once the group was cut at its deadline (``group_deadline_seconds`` or
            ``group_deadline_factor``) while the block ran; its body was cancelled at the cut.
    """

    __slots__ = ("_buffer", "cut", "evicted", "global_steps", "partition", "uid")

    def __init__(self, buffer: RolloutBuffer, uid: str, partition: str, global_steps: int) -> None:
        self._buffer = buffer
        self.uid = uid
        self.partition = partition
        self.global_steps = global_steps
        self.evicted = False
        self.cut = False

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
        versions: Sequence[tuple[int, int]] | None = None,
        tokens: int | None = None,
    ) -> str:
        """Add one trajectory to the group and return its key (see ``ReplayBuffer.put_nowait``,
        whose ``versions`` and ``tokens`` these are).

        Raises:
            GroupEvictedError: the group was evicted in flight; and the other errors of
                ``ReplayBuffer.put_nowait``.
        """
        return self._buffer.put_nowait(
            self.uid, payload, session_id=session_id, index=index, tags=tags, versions=versions, tokens=tokens
        )

    async def put(
        self,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
        versions: Sequence[tuple[int, int]] | None = None,
        tokens: int | None = None,
    ) -> str:
        """Add one trajectory and return its key; the async twin of :meth:`put_nowait` (under a
        journal it waits while the journal's writer is behind, as ``ReplayBuffer.put`` does)."""
        return await self._buffer.put(
            self.uid, payload, session_id=session_id, index=index, tags=tags, versions=versions, tokens=tokens
        )


@asynccontextmanager
async def rollout(
    buffer: RolloutBuffer,
    uid: str,
    *,
    global_steps: int | None,
    partition: str,
    tags: Mapping[str, Any] | None,
    version: int | None = None,
) -> AsyncIterator[RolloutGroup]:
    """Admit, run and end one group (see ``ReplayBuffer.rollout``)."""
    await buffer.add_prompt(uid, global_steps=global_steps, partition=partition, tags=tags)
    with anyio.CancelScope() as scope:

        def evicted() -> None:
            ending = watch.ending
            group.cut = ending in ("cut", "cut-evicted")
            group.evicted = ending != "cut"  # stale in flight, closed, or cut and evicted
            scope.cancel()

        # Just admitted, nothing ran since: the watch is on this very group, and the block ends
        # only it (never a later group that reuses the uid).
        watch = buffer.watch(uid, evicted)
        group = RolloutGroup(buffer, uid, partition, watch.dispatch_step)
        await _start(buffer, watch, group, version)
        try:
            yield group
        except BaseException as exc:
            if not group.evicted and not group.cut:
                buffer.end_watched(watch, finished=False)
                raise
            # It wrote after the eviction, before its cancellation arrived (perhaps from tasks
            # of its own, whose task group wraps the refusals): the same outcome as cancelled.
            rest = _without_refusals(exc)
            if rest is exc:
                raise
            if rest is not None:
                raise rest from None  # what is left (cancellations, other errors) goes on
        if not group.evicted and not group.cut:
            buffer.end_watched(watch, finished=True)


async def _start(buffer: RolloutBuffer, watch: GroupWatch, group: RolloutGroup, version: int | None) -> None:
    """Mark the admitted ``group`` RUNNING, waiting while a journal's writer is behind (it holds an
    admission slot now: a refusal must not leak it). If that wait fails, the group is ended
    FAILED and the error raised; if the group is evicted or cut meanwhile, the block's body then
    starts cancelled and the block exits quietly, as for an eviction while the body runs."""
    try:
        await buffer.mark_running(group.uid, version=version)
    except BaseException:
        if not group.evicted and not group.cut:
            buffer.end_watched(watch, finished=False)
            raise


_REFUSALS = (GroupEvictedError, GroupCutError, BufferClosedError)


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
