"""The client of a buffer hosted by a Ray actor: the ReplayBuffer API, one process removed."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from types import TracebackType
from typing import Any

import ray

from ..buffer import GroupStatus
from ..config import SamplerConfig
from ..errors import ConfigError
from ..records import Batch
from ..stats import BufferStats
from ._connection import ActorConnection, connect_actor, start_actor
from ._events import EvictionStream
from ._options import PayloadMode
from ._protocol import AddPrompt, MarkFailed, MarkFinished, MarkRunning, Put, PutGroup

__all__ = ["RemoteReplayBuffer"]


def _plain_tags(tags: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    # A plain dict travels everywhere (a mappingproxy does not pickle); anything that is not a
    # mapping goes as it is, for the actor to reject with the local buffer's error.
    return dict(tags) if isinstance(tags, Mapping) else tags


def _attached(*connection: Any) -> RemoteReplayBuffer:
    """Unpickle a client: a new connection to the same actor (see ``ActorConnection.pickled``)."""
    self = RemoteReplayBuffer.__new__(RemoteReplayBuffer)
    self._connection = ActorConnection(*connection)
    return self


class RemoteReplayBuffer:
    """A :class:`~stalebuf.ReplayBuffer` hosted by a Ray async actor, used through this client.

    The client has the buffer's async methods with the same names, signatures, results and
    errors (both satisfy :class:`stalebuf.protocol.AsyncReplayBuffer`), so going distributed
    is one line (``ReplayBuffer(config)`` -> ``RemoteReplayBuffer(config)``). Differences, all
    because a process boundary is crossed:

    - ``sampleable_count`` and ``stats`` are coroutines here (sync on ReplayBuffer); the
      ``*_nowait`` twins do not exist, and ``on_evict`` is replaced by :meth:`evictions`.
    - Payloads go to the Ray object store, not through the actor (see ``payloads``): sampled
      batches hold :class:`~stalebuf.ray.PayloadRef`\\ s; :func:`~stalebuf.ray.resolve` turns a
      batch into values in one call.
    - Producer calls made concurrently from one client (one event loop) are combined into one
      actor call while the previous one is in flight; each call still gets its own result or
      error, and the calls of one coroutine apply in the order it made them. A producer call
      cancelled before its actor call was sent is not applied; one cancelled later may be.
    - A dead or unreachable actor raises :class:`~stalebuf.errors.BufferUnavailableError`, and
      so does the first call to an actor that has not started within ``start_timeout``.
    - The client needs an asyncio event loop (Ray's async API is asyncio-only); use it from
      one loop at a time.

    The client is picklable: pass it to Ray tasks and actors, or attach by name with
    :meth:`connect`. The actor runs ``sample`` in Ray's default concurrency group (its
    ``max_concurrency`` slots, 1000 by default, bound the parked samplers) and producer,
    control and eviction calls in their own groups, so parked samplers never starve producers.

    Args:
        config: the sampler config; None means ``SamplerConfig()``. As with ReplayBuffer's
            constructor, ``custom_sampler`` is ignored here; use :meth:`from_config` for it.
        on_evict: must be None (a callable cannot cross processes); use :meth:`evictions`.
        status_log_interval: as for ReplayBuffer; the lines are logged in the actor's process.
        name, namespace: a Ray actor name (and namespace) so that other processes can
            :meth:`connect`; None starts an anonymous actor.
        get_if_exists: with a ``name``, attach to a live actor of that name instead of failing
            (the config and options are then ignored).
        actor_options: passed to ``ray.remote(...).options()``: e.g. ``num_cpus`` (default 0),
            ``resources``, ``max_concurrency`` (sampler slots, default 1000), ``lifetime``
            ("detached" outlives the driver), ``max_restarts`` (a restarted actor starts with an
            empty buffer), ``scheduling_strategy``, ``runtime_env``, ``concurrency_groups``
            (merged over the defaults ``producer``: 64, ``control``: 16, ``events``: 64).
        payloads: where payload values passed to ``put``/``put_group`` go. "producer" (default):
            the client ``ray.put``\\ s them (one object per group, or per ``put``) and the
            producer process owns them: it must outlive their use by the trainer, or resolving
            raises ``ray.exceptions.OwnerDiedError`` (Ray >= 2.56 has no ``ray.put(_owner=...)``
            to hand ownership over). "actor": the values travel with the call and the actor
            stores them (also one object per group), so they survive the producer (one extra
            copy). "inline": the actor keeps the values themselves (small payloads; sampled
            batches then carry values). Payloads that are None, a ``ray.ObjectRef`` or a
            PayloadRef are always kept as they are.
        eviction_queue_size: how many eviction events the actor keeps for :meth:`evictions`
            readers; when full the oldest is discarded (readers count it in
            ``EvictionStream.dropped``), so ``sample`` never blocks on slow readers.
        keep_evicted_payloads: keep payload references in queued eviction events; False
            (default) strips them so evicted payloads are freed at once.
        start_timeout: seconds the actor has to start (Ray to place it and run its
            ``__init__``). A call made before it answered waits at most until then, and then
            raises BufferUnavailableError naming the likely reason (e.g. a resource no node has).

    Raises:
        ConfigError: for an invalid config or option, or an actor name already taken.
    """

    def __init__(
        self,
        config: SamplerConfig | None = None,
        *,
        on_evict: None = None,
        status_log_interval: float | None = 60.0,
        name: str | None = None,
        namespace: str | None = None,
        get_if_exists: bool = False,
        actor_options: Mapping[str, Any] | None = None,
        payloads: PayloadMode = "producer",
        eviction_queue_size: int = 1024,
        keep_evicted_payloads: bool = False,
        start_timeout: float = 60.0,
    ) -> None:
        if config is not None and not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or None, got {type(config).__name__}")
        self._connection = start_actor(
            config,
            False,
            on_evict=on_evict,
            status_log_interval=status_log_interval,
            name=name,
            namespace=namespace,
            get_if_exists=get_if_exists,
            actor_options=actor_options,
            payloads=payloads,
            eviction_queue_size=eviction_queue_size,
            keep_evicted_payloads=keep_evicted_payloads,
            start_timeout=start_timeout,
        )

    @classmethod
    def from_config(
        cls,
        config: SamplerConfig | Mapping[str, Any],
        *,
        on_evict: None = None,
        status_log_interval: float | None = 60.0,
        name: str | None = None,
        namespace: str | None = None,
        get_if_exists: bool = False,
        actor_options: Mapping[str, Any] | None = None,
        payloads: PayloadMode = "producer",
        eviction_queue_size: int = 1024,
        keep_evicted_payloads: bool = False,
        start_timeout: float = 60.0,
    ) -> RemoteReplayBuffer:
        """Start an actor whose buffer is ``ReplayBuffer.from_config(config)`` (honours
        ``custom_sampler``, loaded in the actor's process); the options are as for the class.

        Raises:
            ConfigError: for an invalid config or option here; a custom sampler the actor
                cannot load raises ConfigError from every call on the client.
        """
        if isinstance(config, Mapping):
            config = SamplerConfig.from_mapping(config)
        elif not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or a mapping, got {type(config).__name__}")
        self = cls.__new__(cls)
        self._connection = start_actor(
            config,
            True,
            on_evict=on_evict,
            status_log_interval=status_log_interval,
            name=name,
            namespace=namespace,
            get_if_exists=get_if_exists,
            actor_options=actor_options,
            payloads=payloads,
            eviction_queue_size=eviction_queue_size,
            keep_evicted_payloads=keep_evicted_payloads,
            start_timeout=start_timeout,
        )
        return self

    @classmethod
    def connect(
        cls,
        name: str,
        namespace: str | None = None,
        *,
        payloads: PayloadMode = "producer",
        start_timeout: float = 60.0,
    ) -> RemoteReplayBuffer:
        """Attach to the live buffer actor called ``name`` (in ``namespace``, default: the
        current one). Ray must be initialised (``ray.init(...)``, or inside a Ray worker).

        Blocks until the actor answers a ping: at once for a live actor, up to
        ``start_timeout`` seconds for one that is still starting.

        Raises:
            ConfigError: ``payloads`` or ``start_timeout`` is invalid.
            BufferUnavailableError: no actor has that name, it is dead (e.g. its process was
                killed), or it did not answer within ``start_timeout``.
        """
        self = cls.__new__(cls)
        self._connection = connect_actor(name, namespace, payloads, start_timeout)
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle as the actor handle plus options; queued calls and tasks stay behind."""
        return (_attached, self._connection.pickled())

    def __repr__(self) -> str:
        """Show the actor's name (or id) and the payload mode."""
        return f"<RemoteReplayBuffer actor {self._connection.where()} payloads={self.payloads!r}>"

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

    # -- producers --------------------------------------------------------------------

    async def add_prompt(
        self,
        uid: str,
        *,
        global_steps: int,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new PENDING group, as :meth:`ReplayBuffer.add_prompt`.

        Raises:
            The same errors as ReplayBuffer.add_prompt; BufferUnavailableError when the actor
            is gone.
        """
        await self._connection.submit(AddPrompt(uid, global_steps, partition, _plain_tags(tags)))

    async def mark_running(self, uid: str) -> None:
        """Move a group from PENDING to RUNNING, as :meth:`ReplayBuffer.mark_running`.

        Raises:
            The same errors as ReplayBuffer.mark_running; BufferUnavailableError.
        """
        await self._connection.submit(MarkRunning(uid))

    async def put(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
    ) -> str:
        """Add one trajectory and return its key, as :meth:`ReplayBuffer.put`.

        The payload is stored as the client's ``payloads`` mode says (by default in the object
        store, owned by this process); the buffer keeps a reference.

        Raises:
            The same errors as ReplayBuffer.put; BufferUnavailableError.
        """
        result: str = await self._connection.submit(Put(uid, payload, session_id, index, _plain_tags(tags)))
        return result

    async def mark_finished(self, uid: str) -> None:
        """Mark a group FINISHED, as :meth:`ReplayBuffer.mark_finished`.

        Raises:
            The same errors as ReplayBuffer.mark_finished; BufferUnavailableError.
        """
        await self._connection.submit(MarkFinished(uid))

    async def mark_failed(self, uid: str) -> None:
        """Mark a group FAILURE, as :meth:`ReplayBuffer.mark_failed`.

        Raises:
            The same errors as ReplayBuffer.mark_failed; BufferUnavailableError.
        """
        await self._connection.submit(MarkFailed(uid))

    async def put_group(
        self,
        uid: str,
        payloads: Collection[Any],
        *,
        global_steps: int,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None = None,
        session_ids: Sequence[int] | None = None,
        indices: Sequence[int] | None = None,
        status: GroupStatus = "finished",
    ) -> list[str]:
        """Add (if absent), fill and finish or fail a whole group in one round trip; return its
        keys, as :meth:`ReplayBuffer.put_group` (all or nothing, in the actor).

        Raises:
            The same errors as ReplayBuffer.put_group; BufferUnavailableError.
        """
        if isinstance(payloads, (str, bytes, Mapping)) or not isinstance(payloads, Collection):
            raise TypeError(f"payloads must hold one item per trajectory, got {type(payloads).__name__}")
        op = PutGroup(
            uid,
            list(payloads),
            global_steps,
            partition,
            _plain_tags(tags),
            None if trajectory_tags is None else [_plain_tags(t) for t in trajectory_tags],
            None if session_ids is None else list(session_ids),
            None if indices is None else list(indices),
            status,
        )
        result: list[str] = await self._connection.submit(op)
        return result

    # -- consumer ---------------------------------------------------------------------

    async def sample(
        self,
        global_steps: int,
        batch_size: int,
        *,
        partition: str = "train",
        timeout: float | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """Wait for, remove and return a batch of whole groups, as :meth:`ReplayBuffer.sample`.

        Payloads in the batch are PayloadRefs (or ObjectRefs given by producers, or values in
        "inline" mode); ``await stalebuf.ray.resolve(batch)`` fetches them. ``timeout`` is
        applied in the actor, so a TimeoutError guarantees no group was taken; before the
        actor has answered for the first time, it also bounds the wait for the actor to start
        (by at least 1 s: a live actor needs a round trip to say so). Cancelling is safe: the
        actor is told to cancel this very call, and if it had already taken a batch that never
        reached this client, it puts the groups back, exactly once (re-admitted, so counted
        once more in ``admitted_*``; a group whose uid was reused meanwhile, or any group once
        the buffer is closed, cannot go back and is logged by the actor).

        Raises:
            The same errors as ReplayBuffer.sample; BufferUnavailableError when the actor is
            gone (also while waiting) or did not start within ``start_timeout``.
        """
        return await self._connection.sample(global_steps, batch_size, partition, timeout)

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

    # -- closing ----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the hosted buffer, as :meth:`ReplayBuffer.aclose` (for every client: parked and
        later ``sample`` calls and producers raise BufferClosedError; ``stats`` still works).
        The actor keeps running; :meth:`kill` ends it. Idempotent.

        Raises:
            BufferUnavailableError: the actor is gone.
        """
        await self._connection.call("close")

    def kill(self) -> None:
        """End the actor now (``ray.kill``): every pending and later call of every client raises
        BufferUnavailableError. The buffer's contents are lost; payload objects live on while
        referenced elsewhere."""
        ray.kill(self._connection.handle, no_restart=True)

    async def __aenter__(self) -> RemoteReplayBuffer:
        """Return the client; ``async with`` closes the buffer on exit."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the buffer (the actor keeps running)."""
        await self.aclose()
