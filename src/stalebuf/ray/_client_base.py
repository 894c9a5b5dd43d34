"""Half of :class:`~stalebuf.ray.RemoteReplayBuffer`: names, queries, flow control, save, kill.

Kept apart from ``_client.py`` only for size: the methods here are documented as members of
RemoteReplayBuffer, which inherits them.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import ray

from .._checkpoint_file import PayloadCodec
from .._validation import materialise
from ..buffer import GroupStatus
from ..stats import BufferStats
from ._events import EvictionStream
from ._protocol import AddPrompt, PutGroup
from ._rollout import RemoteRolloutGroup, rollout

if TYPE_CHECKING:
    from ._connection import ActorConnection

__all__ = ["ClientBase", "add_prompt_op", "plain_tags", "put_group_op"]


def plain_tags(tags: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Return ``tags`` as a plain dict (a mappingproxy does not pickle); anything that is not a
    mapping goes as it is, for the actor to reject with the local buffer's error."""
    return dict(tags) if isinstance(tags, Mapping) else tags


def add_prompt_op(
    token: str | None, uid: str, global_steps: int | None, partition: str, tags: Mapping[str, Any] | None
) -> AddPrompt:
    """The ``add_prompt`` operation (with a token it may wait for admission)."""
    return AddPrompt(token, uid, global_steps, partition, plain_tags(tags))


def put_group_op(
    token: str | None,
    uid: str,
    payloads: Collection[Any],
    global_steps: int | None,
    partition: str,
    tags: Mapping[str, Any] | None,
    trajectory_tags: Sequence[Mapping[str, Any] | None] | None,
    session_ids: Sequence[int] | None,
    indices: Sequence[int] | None,
    status: GroupStatus,
) -> PutGroup:
    """The ``put_group`` operation (with a token a new group may wait for admission).

    Raises:
        TypeError: ``payloads`` is not a collection of per-trajectory items, or a per-trajectory
            collection cannot be iterated.
        ValueError: a per-trajectory collection's ``len()`` disagrees with what it yields.
    """
    if isinstance(payloads, (str, bytes, Mapping)) or not isinstance(payloads, Collection):
        raise TypeError(f"payloads must hold one item per trajectory, got {type(payloads).__name__}")
    # Copied as the local buffer copies them, so a collection that lies about its length or whose
    # iteration raises fails here with the local error, not with whatever it yielded in the actor.
    items = materialise("payloads", payloads)
    sessions = None if session_ids is None else list(materialise("session_ids", session_ids))
    positions = None if indices is None else list(materialise("indices", indices))
    per_tags = None if trajectory_tags is None else materialise("trajectory_tags", trajectory_tags)
    return PutGroup(
        token,
        uid,
        list(items),
        global_steps,
        partition,
        plain_tags(tags),
        None if per_tags is None else [plain_tags(t) for t in per_tags],
        sessions,
        positions,
        status,
    )


class ClientBase:
    """The actor's handle and names, the queries (counts, stats, eviction events, the dispatch
    clock), admission without waiting, ``rollout()``, ``save`` and ``kill`` of a remote buffer."""

    _connection: ActorConnection

    @property
    def handle(self) -> Any:
        """The Ray actor handle of the hosting actor."""
        return self._connection.handle

    @property
    def name(self) -> str | None:
        """The actor's name, or None for an anonymous actor."""
        return self._connection.name

    @property
    def namespace(self) -> str | None:
        """The namespace given at creation or connection (None: Ray's current one)."""
        return self._connection.namespace

    @property
    def payloads(self) -> str:
        """The payload mode: "producer", "actor" or "inline"."""
        return self._connection.payloads

    def kill(self) -> None:
        """End the actor now (``ray.kill``): every pending and later call of every client raises
        BufferUnavailableError. The buffer's contents are lost; payload objects live on while
        referenced elsewhere."""
        ray.kill(self._connection.handle, no_restart=True)

    async def sampleable_count(self, global_steps: int, partition: str = "train") -> int:
        """Return how many groups ``sample`` could select right now, as
        :meth:`ReplayBuffer.sampleable_count` (a coroutine here: it asks the actor).

        Raises:
            TypeError, ValueError: as ReplayBuffer.sampleable_count; BufferUnavailableError.
        """
        result: int = await self._connection.call("sampleable_count", global_steps, partition)
        return result

    async def stats(self) -> BufferStats:
        """Return the buffer's :class:`~stalebuf.BufferStats`, as :meth:`ReplayBuffer.stats`
        (a coroutine here: it asks the actor).

        Raises:
            BufferUnavailableError: the actor is gone.
        """
        result: BufferStats = await self._connection.call("stats")
        return result

    async def info(self) -> dict[str, Any]:
        """Return facts about the actor: ``config``, ``buffer_class``, ``closed``,
        ``eviction_queue_size``, ``evictions_emitted``, ``evictions_overflowed`` and
        ``sample_requests`` (counters of the cancel protocol). Also a way to wait until the
        actor is up.

        Raises:
            ConfigError: the actor could not build its buffer (e.g. a bad custom sampler).
            BufferUnavailableError: the actor is gone or did not start within ``start_timeout``.
        """
        result: dict[str, Any] = await self._connection.call("info")
        return result

    def evictions(
        self, *, from_oldest: bool = False, max_events: int = 256, poll_seconds: float = 10.0
    ) -> EvictionStream:
        """Return an async iterator of the buffer's :class:`~stalebuf.EvictionEvent`\\ s, the
        remote ``on_evict`` (see :class:`~stalebuf.ray.EvictionStream` for what it yields).

        Raises:
            ConfigError: ``max_events`` is not an int >= 1 or ``poll_seconds`` not a finite
                number > 0.
        """
        return EvictionStream(
            self._connection,
            repr(self),
            from_oldest=from_oldest,
            max_events=max_events,
            poll_seconds=poll_seconds,
        )

    async def add_prompt_nowait(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new PENDING group, as :meth:`ReplayBuffer.add_prompt_nowait`: a coroutine here
        (it asks the actor), but it never waits for admission.

        Raises:
            BufferFullError: admission control has no slot for it now; nothing changed.
            The other errors of ReplayBuffer.add_prompt_nowait; BufferUnavailableError.
        """
        await self._connection.submit(add_prompt_op(None, uid, global_steps, partition, tags))

    async def put_group_nowait(
        self,
        uid: str,
        payloads: Collection[Any],
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None = None,
        session_ids: Sequence[int] | None = None,
        indices: Sequence[int] | None = None,
        status: GroupStatus = "finished",
    ) -> list[str]:
        """Add (if absent), fill and end a whole group in one round trip, as
        :meth:`ReplayBuffer.put_group_nowait`: a coroutine here, but it never waits for admission.

        Raises:
            BufferFullError: the group is new and admission control has no slot for it now.
            The other errors of ReplayBuffer.put_group_nowait; BufferUnavailableError.
        """
        op = put_group_op(
            None, uid, payloads, global_steps, partition, tags, trajectory_tags, session_ids, indices, status
        )
        result: list[str] = await self._connection.submit(op)
        return result

    async def dispatch_step(self, partition: str = "train") -> int:
        """Return the actor's dispatch clock for ``partition``, as :meth:`ReplayBuffer.dispatch_step`
        (a coroutine here: it asks the actor).

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str; BufferUnavailableError.
        """
        result: int = await self._connection.call("flow", "dispatch_step", partition)
        return result

    async def capacity(self, partition: str = "train") -> int | None:
        """Return the bound on ``partition``'s resident groups, as :meth:`ReplayBuffer.capacity`
        (a coroutine here).

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str; BufferUnavailableError.
        """
        result: int | None = await self._connection.call("flow", "capacity", partition)
        return result

    async def free_slots(self, partition: str = "train") -> int | None:
        """Return how many groups ``add_prompt`` would admit now without waiting, as
        :meth:`ReplayBuffer.free_slots` (a coroutine here; the answer may be stale on arrival).

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str; BufferUnavailableError.
        """
        result: int | None = await self._connection.call("flow", "free_slots", partition)
        return result

    async def full(self, partition: str = "train") -> bool:
        """Return whether ``free_slots(partition) == 0``, as :meth:`ReplayBuffer.full` (a coroutine here).

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str; BufferUnavailableError.
        """
        result: bool = await self._connection.call("flow", "full", partition)
        return result

    def rollout(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> AbstractAsyncContextManager[RemoteRolloutGroup]:
        """Return an ``async with`` block that generates one group, as :meth:`ReplayBuffer.rollout`.

        Entering waits in the actor for admission, then the group is PENDING and marked RUNNING;
        ``await group.put(...)`` adds trajectories (there is no ``put_nowait`` remotely). When
        the body returns the group is FINISHED; when it raises, FAILED, and the error propagates.
        If the group is evicted while the body runs (in-flight eviction, or ``aclose()``), the
        actor answers a call the block parked there and the body is cancelled: the block exits
        without raising and ``group.evicted`` is True (also when the body's write was refused
        with GroupEvictedError or BufferClosedError first). A block cancelled from outside
        fails its group (the actor is told without waiting). Each entered block holds one slot
        of the actor's ``watch`` concurrency group.

        Raises:
            The errors of :meth:`add_prompt` (on entering).
        """
        return rollout(self._connection, uid, global_steps, partition, plain_tags(tags))

    async def save(self, path: str | os.PathLike[str], *, payload_codec: PayloadCodec | None = None) -> None:
        """Checkpoint the hosted buffer at once and write it to ``path``, as :meth:`ReplayBuffer.save`,
        from the actor: ``path`` is on the actor's node (a relative one is made absolute here,
        against the caller's working directory, as a local ``save`` would read it).

        Payloads held as object references (PayloadRefs, ObjectRefs) are fetched into the actor
        and stored by value: while it saves, the actor holds every resident payload in memory at
        once (numpy arrays on its node as zero-copy views, other objects as copies), on top of
        the buffer. ``payload_codec`` travels to the actor (it must pickle with cloudpickle).

        Raises:
            CheckpointError: a payload object is lost (e.g. its producer died), or with a codec a
                value JSON cannot hold; nothing is written.
            OSError: the file could not be written; BufferUnavailableError.
        """
        target = os.path.abspath(os.fspath(path))  # noqa: ASYNC240 - one getcwd(), no file I/O
        await self._connection.call("save", target, payload_codec)
