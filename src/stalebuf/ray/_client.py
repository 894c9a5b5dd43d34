"""The client of a buffer hosted by a Ray actor: :class:`RemoteReplayBuffer`, and
:class:`RemoteRestoreResult`, what its ``restore`` returns.

This module owns what only a remote buffer has: starting an actor (the constructor,
``from_config``), attaching to one (``connect``, unpickling), restoring one from a checkpoint file
or recovering one from a journal (``restore``, ``recover``: the client builds the request, the
actor rebuilds the buffer), the actor's identity
(``handle``, ``name``, ``namespace``, ``payloads``), ``info``, ``kill`` and ``evictions``. The
methods RemoteReplayBuffer shares with ReplayBuffer it inherits from
:class:`~stalebuf.ray._buffer_calls.BufferCalls`, which owns the connection to the actor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import ray

from .._checkpoint_file import PayloadCodec
from ..checkpoint import NOT_GIVEN, InFlightMode, RestoreResult
from ..config import SamplerConfig
from ..errors import ConfigError
from ..filters import GroupFilter
from ._buffer_calls import BufferCalls
from ._connection import ActorConnection, connect_actor, start_actor
from ._events import EvictionStream
from ._options import PayloadMode, journal_request, recover_request, restore_request
from ._protocol import JournalRequest, RecoverRequest, RestoreRequest

__all__ = ["RemoteReplayBuffer", "RemoteRestoreResult"]

_Client = TypeVar("_Client", bound="RemoteReplayBuffer")
_PENDING_BYTES = 256 * 2**20  # journal_max_pending_bytes's default, as ReplayBuffer's


def _on(cls: type[_Client], connection: ActorConnection) -> _Client:
    """Return a client of class ``cls`` on ``connection``, for the alternative constructors and
    unpickling (``__init__`` starts an actor)."""
    client = cls.__new__(cls)
    BufferCalls.__init__(client, connection)
    return client


def _rebuilt(
    cls: type[RemoteReplayBuffer],
    request: RestoreRequest | RecoverRequest,
    journal: JournalRequest | None,
    **options: Any,
) -> RemoteRestoreResult:
    """Start a new actor that rebuilds its buffer as ``request`` says (with the class's ``options``);
    once it has (blocking), return its client and what it listed; raise what the rebuild raised."""
    connection = start_actor(
        None, False, on_evict=None, get_if_exists=False, restore=request, journal=journal, **options
    )
    return RemoteRestoreResult(_on(cls, connection), *connection.restored())


def _attached(*connection: Any) -> RemoteReplayBuffer:
    """Unpickle a client: a new connection to the same actor (see ``ActorConnection.pickled``)."""
    return _on(RemoteReplayBuffer, ActorConnection(*connection))


class RemoteReplayBuffer(BufferCalls):
    """A :class:`~stalebuf.ReplayBuffer` hosted by a Ray async actor, used through this client.

    The client has the buffer's async methods with the same names, signatures, results and
    errors (both satisfy :class:`stalebuf.protocol.AsyncReplayBuffer`), so going distributed
    is one line (``ReplayBuffer(config)`` -> ``RemoteReplayBuffer(config)``). Differences, all
    because a process boundary is crossed:

    - ``sampleable_count``, ``stats``, ``explain_wait``, ``dispatch_step``, ``capacity``,
      ``free_slots``, ``full``, ``add_prompt_nowait`` and ``put_group_nowait`` are coroutines
      here (sync on ReplayBuffer); the other ``*_nowait`` twins and ``checkpoint`` do not exist, and
      ``on_evict`` is replaced by :meth:`evictions`.
    - Admission waits happen in the actor (FIFO per partition, in the order the actor found no
      slot for them), each holding a slot of its ``admission`` concurrency group only while its
      client waits for the result; :meth:`rollout` parks one call per block in its ``watch``
      group, and the body is cancelled when that call reports an eviction or a close.
    - Payloads go to the Ray object store, not through the actor (see ``payloads``): sampled
      batches hold :class:`~stalebuf.ray.PayloadRef`\\ s; :func:`~stalebuf.ray.resolve` turns a
      batch into values in one call.
    - Producer calls made concurrently from one client (one event loop) are combined into one
      actor call while the previous one is in flight; each call still gets its own result or
      error, and the calls of one coroutine apply in the order it made them. A producer call
      cancelled before its actor call was sent is not applied; one cancelled later may be
      (``add_prompt`` and ``put_group`` are not if the actor hears of it first).
    - A dead or unreachable actor raises :class:`~stalebuf.errors.BufferUnavailableError`, and
      so does the first call to an actor that has not started within ``start_timeout``.
    - The client needs an asyncio event loop (Ray's async API is asyncio-only); use it from
      one loop at a time.

    The client is picklable: pass it to Ray tasks and actors, or attach by name with
    :meth:`connect`. The actor runs ``sample`` in Ray's default concurrency group (its
    ``max_concurrency`` slots, 1000 by default, bound the parked samplers) and producer,
    admission, watch, control and eviction calls in their own groups, so parked samplers never
    starve producers and parked producers never starve samplers, writes or control calls.

    Args:
        config: the sampler config; None means ``SamplerConfig()``. As with ReplayBuffer's
            constructor, ``custom_sampler`` is ignored here; use :meth:`from_config` for it.
        on_evict: must be None (a callable cannot cross processes); use :meth:`evictions`.
        status_log_interval: as for ReplayBuffer; the lines are logged in the actor's process.
        name: a Ray actor name, so that other processes can :meth:`connect`; None starts an
            anonymous actor.
        namespace: the Ray namespace of ``name``.
        get_if_exists: with a ``name``, attach to a live actor of that name instead of failing
            (the config and options are then ignored).
        actor_options: passed to ``ray.remote(...).options()``: e.g. ``num_cpus`` (default 0),
            ``resources``, ``max_concurrency`` (sampler slots, default 1000), ``lifetime``
            ("detached" outlives the driver), ``max_restarts`` (a restarted actor starts with an
            empty buffer), ``scheduling_strategy``, ``runtime_env``, ``concurrency_groups``
            (merged over the defaults ``producer``: 64, ``admission``: 1024, ``watch``: 4096,
            ``control``: 16, ``events``: 64).
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
        filters: group filters, as for ReplayBuffer; they run in the actor, so each must pickle
            (cloudpickle: a function, a lambda, a small class such as the built-ins of
            :mod:`stalebuf.filters`) and be importable there, and sees the group as the actor
            holds it (payloads as PayloadRefs unless ``payloads="inline"``; use tags to judge).
        journal: as for ReplayBuffer (checked here), a path on the actor's node (made absolute
            here). It holds payloads by value, fetched by the actor (see "Durability on Ray" in the
            docs: prefer ``payloads="actor"``). A file the actor refuses (a journal already:
            :meth:`recover` from it) makes every call raise CheckpointError.
        journal_interval: as for ReplayBuffer (checked here).
        journal_retention_steps: as for ReplayBuffer (checked here).
        journal_max_pending_bytes: as for ReplayBuffer (checked here).
        payload_codec: ``(encode, decode)`` for the journal's payload bytes (default: pickle); it
            runs in the actor, so it must pickle.

    Raises:
        ConfigError: for an invalid config or option, ``filters`` or a ``payload_codec`` that
            are not plain callables or do not pickle (refused before any actor starts), or an
            actor name already taken.
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
        filters: Sequence[GroupFilter] = (),
        journal: str | os.PathLike[str] | None = None,
        journal_interval: float = 1.0,
        journal_retention_steps: int = 4,
        journal_max_pending_bytes: int = _PENDING_BYTES,
        payload_codec: PayloadCodec | None = None,
    ) -> None:
        if config is not None and not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or None, got {type(config).__name__}")
        journaled = journal_request(
            journal,
            journal_interval,
            journal_retention_steps,
            journal_max_pending_bytes,
            payload_codec,
            payloads,
        )
        super().__init__(
            start_actor(
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
                filters=filters,
                journal=journaled,
            )
        )

    @classmethod
    def from_config(
        cls,
        config: SamplerConfig | Mapping[str, Any],
        *,
        on_evict: None = None,
        status_log_interval: float | None = NOT_GIVEN,
        name: str | None = None,
        namespace: str | None = None,
        get_if_exists: bool = False,
        actor_options: Mapping[str, Any] | None = None,
        payloads: PayloadMode = "producer",
        eviction_queue_size: int = 1024,
        keep_evicted_payloads: bool = False,
        start_timeout: float = 60.0,
        filters: Sequence[GroupFilter] = (),
        journal: str | os.PathLike[str] | None = None,
        journal_interval: float = 1.0,
        journal_retention_steps: int = 4,
        journal_max_pending_bytes: int = _PENDING_BYTES,
        payload_codec: PayloadCodec | None = None,
    ) -> RemoteReplayBuffer:
        """Start an actor whose buffer is ``ReplayBuffer.from_config(config)`` (honours
        ``custom_sampler``, loaded in the actor's process); the options (the journal's too) are as
        for the class, except that ``status_log_interval`` and ``filters`` are passed on only when
        given (a custom sampler's constructor need take neither), as ``ReplayBuffer.from_config`` does.

        Raises:
            ConfigError: for an invalid config or option here (``filters`` as for the class); a
                custom sampler the actor cannot load raises ConfigError from every call on the
                client.
        """
        if isinstance(config, Mapping):
            config = SamplerConfig.from_mapping(config)
        elif not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or a mapping, got {type(config).__name__}")
        journaled = journal_request(
            journal,
            journal_interval,
            journal_retention_steps,
            journal_max_pending_bytes,
            payload_codec,
            payloads,
        )
        connection = start_actor(
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
            filters=filters,
            journal=journaled,
        )
        return _on(cls, connection)

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
        return _on(cls, connect_actor(name, namespace, payloads, start_timeout))

    @classmethod
    def restore(
        cls,
        path: str | os.PathLike[str],
        *,
        in_flight: InFlightMode = "reissue",
        payload_codec: PayloadCodec | None = None,
        status_log_interval: float | None = NOT_GIVEN,
        name: str | None = None,
        namespace: str | None = None,
        actor_options: Mapping[str, Any] | None = None,
        payloads: PayloadMode = "producer",
        eviction_queue_size: int = 1024,
        keep_evicted_payloads: bool = False,
        start_timeout: float = 60.0,
        filters: Sequence[GroupFilter] = (),
        journal: str | os.PathLike[str] | None = None,
        journal_interval: float = 1.0,
        journal_retention_steps: int = 4,
        journal_max_pending_bytes: int = _PENDING_BYTES,
    ) -> RemoteRestoreResult:
        """Start a new actor whose buffer is ``ReplayBuffer.restore(path, ...)`` and return its
        client and the groups to reissue; blocks until the actor has restored (like :meth:`connect`).
        With ``journal``, it journals into that new file (``payload_codec`` encoding its payloads).

        The actor reads ``path`` (on its node; a relative one is made absolute here, against the
        caller's working directory). Unless ``payloads="inline"``, it stores each restored group's
        payloads in the object store (one object per group, owned by the actor), so sampled batches
        carry PayloadRefs as usual (and so do the prefixes an ``in_flight="resume"`` restore lists).
        Under ``in_flight="evict"`` the "restart" evictions are the first events of
        ``evictions(from_oldest=True)``. Filters are code, never in a checkpoint: pass them again as
        ``filters`` (picklable). The other options are as for the class (``status_log_interval``
        and ``filters`` passed on only when given, as for :meth:`from_config`).

        Raises:
            CheckpointError: the file is truncated, corrupt, foreign or newer, or needs (or must
                not have) a payload codec, or ``journal`` names a file that is not absent or empty;
                the actor is ended and nothing is built.
            ConfigError: an invalid option, ``in_flight``, ``payload_codec``, ``filters`` or
                journal argument; OSError: the file cannot be read (e.g. FileNotFoundError).
            BufferUnavailableError: the actor did not start within ``start_timeout``.
        """
        request = restore_request(path, in_flight, payload_codec, payloads)
        codec = request.payload_codec
        journaled = journal_request(
            journal, journal_interval, journal_retention_steps, journal_max_pending_bytes, codec, payloads
        )
        return _rebuilt(
            cls,
            request,
            journaled,
            status_log_interval=status_log_interval,
            name=name,
            namespace=namespace,
            actor_options=actor_options,
            payloads=payloads,
            eviction_queue_size=eviction_queue_size,
            keep_evicted_payloads=keep_evicted_payloads,
            start_timeout=start_timeout,
            filters=filters,
        )

    @classmethod
    def recover(
        cls,
        journal: str | os.PathLike[str],
        *,
        global_steps: int | None = None,
        partition: str = "train",
        in_flight: InFlightMode = "reissue",
        payload_codec: PayloadCodec | None = None,
        status_log_interval: float | None = NOT_GIVEN,
        name: str | None = None,
        namespace: str | None = None,
        actor_options: Mapping[str, Any] | None = None,
        payloads: PayloadMode = "producer",
        eviction_queue_size: int = 1024,
        keep_evicted_payloads: bool = False,
        start_timeout: float = 60.0,
        filters: Sequence[GroupFilter] = (),
        journal_interval: float = 1.0,
        journal_retention_steps: int = 4,
        journal_max_pending_bytes: int = _PENDING_BYTES,
    ) -> RemoteRestoreResult:
        """Start a new actor whose buffer is ``ReplayBuffer.recover(journal, ...)``, journaling on
        into the same file (on its node; made absolute here), and return its client, the groups to
        reissue, and the groups ``kept`` and ``dropped``; blocks until the actor has recovered.

        The arguments are as for ``ReplayBuffer.recover`` (``payload_codec``: the journal's), the
        options as for :meth:`restore`. Unless ``payloads="inline"``, the new actor stores each
        payload it reads in the object store (one object per trajectory, owned by the actor).

        Raises:
            CheckpointError: the file is not a stalebuf journal, is torn or foreign (left as it
                was), needs (or must not have) a payload codec, or holds no committed sample at
                ``global_steps`` (naming the oldest and newest recoverable steps); the journal is
                then unchanged, the actor is ended and nothing is built.
            ConfigError: an invalid argument or option; OSError: the file cannot be read.
            BufferUnavailableError: the actor did not start within ``start_timeout``.
        """
        journaled = journal_request(
            journal,
            journal_interval,
            journal_retention_steps,
            journal_max_pending_bytes,
            payload_codec,
            payloads,
        )
        return _rebuilt(
            cls,
            recover_request(journaled, global_steps, partition, in_flight),
            journaled,
            status_log_interval=status_log_interval,
            name=name,
            namespace=namespace,
            actor_options=actor_options,
            payloads=payloads,
            eviction_queue_size=eviction_queue_size,
            keep_evicted_payloads=keep_evicted_payloads,
            start_timeout=start_timeout,
            filters=filters,
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle as the actor handle plus options; queued calls and tasks stay behind."""
        return (_attached, self._connection.pickled())

    def __repr__(self) -> str:
        """Show the actor's name (or id) and the payload mode."""
        return f"<RemoteReplayBuffer actor {self._connection.where()} payloads={self.payloads!r}>"

    # -- the actor --------------------------------------------------------------------

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

    def kill(self) -> None:
        """End the actor now (``ray.kill``): every pending and later call of every client raises
        BufferUnavailableError. The buffer's contents are lost; payload objects live on while
        referenced elsewhere."""
        ray.kill(self._connection.handle, no_restart=True)

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

    # -- async with -------------------------------------------------------------------

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


class RemoteRestoreResult(RestoreResult["RemoteReplayBuffer"]):
    """What :meth:`RemoteReplayBuffer.restore` and :meth:`~RemoteReplayBuffer.recover` return: a
    :class:`~stalebuf.RestoreResult` whose ``buffer`` is the new actor's client; the payloads of
    ``reissue``, ``kept`` and ``dropped`` are PayloadRefs the actor stored (unless ``payloads="inline"``).
    """

    __slots__ = ()
