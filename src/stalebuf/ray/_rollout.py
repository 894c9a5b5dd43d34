"""``RemoteReplayBuffer.rollout()``: the structured-concurrency producer loop, one process removed.

Entering waits for admission in the actor and marks the group RUNNING, in one operation
(``OpenRollout``). The block then parks one call in the actor, ``watch_rollout``, which returns
when the group is evicted in flight or the buffer closes: the body is then cancelled through an
anyio cancel scope, as in the local ``rollout()``, so a producer learns of the eviction without
polling. Leaving the block finishes (the body returned) or fails (the body raised) the group if it
is still in flight; a block cancelled from outside tells the actor without waiting, which fails
the group. Either way the actor is told the block's token, never the uid: it ends only the very
group the block entered, not a later group that reuses the uid once the body ended its own.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import BufferClosedError, GroupCutError, GroupEvictedError
from ._protocol import EndRollout, OpenRollout, put_op

if TYPE_CHECKING:
    from ._connection import ActorConnection

__all__ = ["RemoteRolloutGroup", "rollout"]

# What the actor answers when the group is no longer ours to end (see RolloutWatches.end).
_EVICTED = ("evicted", "closed", "cut", "cut-evicted")
# What a body raises when it writes to a group that was evicted, cut or whose buffer closed:
# the buffer's doing, so the block still exits quietly.
_EVICTION_ERRORS = (GroupEvictedError, GroupCutError, BufferClosedError)


class RemoteRolloutGroup:
    """The group a remote ``rollout()`` block generates (the remote twin of ``RolloutGroup``).

    Attributes:
        uid: the group's uid.
        partition: its partition.
        global_steps: its dispatch step (the tag the actor gave it at admission).
        evicted: True once the group was evicted (or the buffer closed, or it was failed and
            evicted at its deadline) while the block ran.
        cut: True once the group was cut at its deadline while the block ran (the actor
            enforces deadlines; the body is cancelled at the cut).
    """

    __slots__ = ("_connection", "cut", "evicted", "global_steps", "partition", "uid")

    def __init__(self, connection: ActorConnection, uid: str, partition: str, global_steps: int) -> None:
        self._connection = connection
        self.uid = uid
        self.partition = partition
        self.global_steps = global_steps
        self.evicted = False
        self.cut = False

    def __repr__(self) -> str:
        """Show the uid, partition, dispatch step and whether it was evicted."""
        return (
            f"<RemoteRolloutGroup {self.uid!r} partition={self.partition!r} "
            f"global_steps={self.global_steps} evicted={self.evicted} cut={self.cut}>"
        )

    @property
    def dispatch_step(self) -> int:
        """The group's dispatch step (the same as ``global_steps``)."""
        return self.global_steps

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
        """Add one trajectory to the group and return its key (see ``RemoteReplayBuffer.put``,
        whose ``versions`` and ``tokens`` these are).

        Raises:
            GroupEvictedError: the group was evicted in flight; and the other errors of
                ``RemoteReplayBuffer.put``.
        """
        op = put_op(self.uid, payload, session_id, index, tags, versions, tokens)
        key: str = await self._connection.submit(op)
        return key


class _Block:
    """Whether the block still runs: a watch answer that arrives after it ended changes nothing."""

    __slots__ = ("group", "running", "scope")

    def __init__(self, group: RemoteRolloutGroup, scope: anyio.CancelScope) -> None:
        self.group = group
        self.scope = scope
        self.running = True


@asynccontextmanager
async def rollout(
    connection: ActorConnection,
    uid: str,
    global_steps: int | None,
    partition: str,
    tags: Mapping[str, Any] | None,
    version: int | None = None,
) -> AsyncIterator[RemoteRolloutGroup]:
    """Admit, run and end one group in the actor (see ``RemoteReplayBuffer.rollout``); ``version``
    (checked): its start version."""
    token = connection.new_token()
    step: int = await connection.admit(OpenRollout(token, uid, global_steps, partition, tags, version))
    group = RemoteRolloutGroup(connection, uid, partition, step)
    watch = asyncio.ensure_future(connection.call("watch_rollout", token))
    with anyio.CancelScope() as scope:
        block = _Block(group, scope)
        watch.add_done_callback(functools.partial(_watched, block))
        try:
            yield group
        except BaseException as exc:
            if not await _quiet_after(connection, token, group, exc):
                raise
        else:
            if not _ended_by_buffer(group):  # else the buffer ended it as the body returned
                _heard(group, await _end(connection, token, finished=True))
        finally:
            block.running = False
            watch.cancel()  # the actor releases the watch itself once the group ended


def _watched(block: _Block, watch: asyncio.Future[str]) -> None:
    """The watch call returned: cancel the body if the group was evicted or the buffer closed."""
    if watch.cancelled():
        return
    error = watch.exception()  # retrieved: an actor that died is the body's next write's news
    if error is None and block.running and _heard(block.group, watch.result()):
        block.scope.cancel()


def _heard(group: RemoteRolloutGroup, answer: str) -> bool:
    """Record what the actor said of the group; return whether the buffer ended it (evicted,
    cut or closed) rather than the block."""
    if answer not in _EVICTED:
        return False
    group.cut = answer in ("cut", "cut-evicted")
    group.evicted = answer != "cut"
    return True


def _ended_by_buffer(group: RemoteRolloutGroup) -> bool:
    """Whether the buffer ended the group (evicted, cut or closed) while the block ran."""
    return group.evicted or group.cut


async def _quiet_after(
    connection: ActorConnection, token: str, group: RemoteRolloutGroup, exc: BaseException
) -> bool:
    """The body raised ``exc``: end the group as the local block would; return True when the
    block must exit quietly (the body failed because the group was evicted)."""
    if _ended_by_buffer(group):  # the scope's own cancellation (swallowed by it), or the body's reaction
        return isinstance(exc, _EVICTION_ERRORS)
    if not isinstance(exc, Exception):  # cancelled from outside: tell the actor, don't wait
        connection.abandon(token)
        return False
    if _heard(group, await _end(connection, token, finished=False)):
        return isinstance(exc, _EVICTION_ERRORS)  # the watch's answer is on its way: the body heard first
    return False


async def _end(connection: ActorConnection, token: str, *, finished: bool) -> str:
    """Finish or fail the group the block entered under ``token`` if that very group is still in
    flight (never a later one that reuses its uid); return the actor's answer."""
    try:
        answer: str = await connection.submit(EndRollout(token, finished))
    except BaseException:
        connection.abandon(token)  # it still fails the group if it is in flight
        raise
    return answer
