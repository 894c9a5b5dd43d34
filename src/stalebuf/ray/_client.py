"""The client of a buffer hosted by a Ray actor: the ReplayBuffer API, one process removed."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import attrs

from .._checkpoint_file import PayloadCodec
from .._validation import check_payload_codec
from ..buffer import GroupStatus
from ..checkpoint import NOT_GIVEN, InFlightMode, check_in_flight
from ..config import SamplerConfig
from ..errors import ConfigError
from ..records import Batch, Group
from ._client_base import ClientBase, add_prompt_op, plain_tags, put_group_op
from ._connection import ActorConnection, connect_actor, start_actor
from ._options import PayloadMode
from ._protocol import MarkFailed, MarkFinished, MarkRunning, Put, RestoreRequest

__all__ = ["RemoteReplayBuffer", "RemoteRestoreResult"]


def _attached(*connection: Any) -> RemoteReplayBuffer:
    """Unpickle a client: a new connection to the same actor (see ``ActorConnection.pickled``)."""
    self = RemoteReplayBuffer.__new__(RemoteReplayBuffer)
    self._connection = ActorConnection(*connection)
    return self


class RemoteReplayBuffer(ClientBase):
    """A :class:`~stalebuf.ReplayBuffer` hosted by a Ray async actor, used through this client.

    The client has the buffer's async methods with the same names, signatures, results and
    errors (both satisfy :class:`stalebuf.protocol.AsyncReplayBuffer`), so going distributed
    is one line (``ReplayBuffer(config)`` -> ``RemoteReplayBuffer(config)``). Differences, all
    because a process boundary is crossed:

    - ``sampleable_count``, ``stats``, ``dispatch_step``, ``capacity``, ``free_slots``,
      ``full``, ``add_prompt_nowait`` and ``put_group_nowait`` are coroutines here (sync on
      ReplayBuffer); the other ``*_nowait`` twins and ``checkpoint`` do not exist, and
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
        name, namespace: a Ray actor name (and namespace) so that other processes can
            :meth:`connect`; None starts an anonymous actor.
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
        status_log_interval: float | None = NOT_GIVEN,
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
        ``custom_sampler``, loaded in the actor's process); the options are as for the class,
        except that ``status_log_interval`` is passed on only when given (a custom sampler's
        constructor need not take it), as ``ReplayBuffer.from_config`` does.

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
    ) -> RemoteRestoreResult:
        """Start a new actor whose buffer is ``ReplayBuffer.restore(path, ...)`` and return its
        client and the groups to reissue; blocks until the actor has restored (like :meth:`connect`).

        The actor reads ``path`` (on its node; a relative one is made absolute here, against the
        caller's working directory). Unless ``payloads="inline"``, it stores each
        restored group's payloads in the object store (one object per group, owned by the
        actor), so sampled batches carry PayloadRefs as usual. Under ``in_flight="evict"`` the
        "restart" evictions are the first events of ``evictions(from_oldest=True)``. The other
        options are as for the class (``status_log_interval`` passed on only when given, as for
        :meth:`from_config`).

        Raises:
            CheckpointError: the file is truncated, corrupt, foreign or newer, or needs (or must
                not have) a payload codec; the actor is ended and nothing is built.
            ConfigError: an invalid option, ``in_flight``, or ``payload_codec``; OSError: the
                file cannot be read (e.g. FileNotFoundError).
            BufferUnavailableError: the actor did not start within ``start_timeout``.
        """
        codec = check_payload_codec(payload_codec)
        request = RestoreRequest(
            os.path.abspath(os.fspath(path)), check_in_flight(in_flight), codec, payloads != "inline"
        )
        self = cls.__new__(cls)
        self._connection = start_actor(
            None,
            False,
            on_evict=None,
            status_log_interval=status_log_interval,
            name=name,
            namespace=namespace,
            get_if_exists=False,
            actor_options=actor_options,
            payloads=payloads,
            eviction_queue_size=eviction_queue_size,
            keep_evicted_payloads=keep_evicted_payloads,
            start_timeout=start_timeout,
            restore=request,
        )
        return RemoteRestoreResult(self, self._connection.restored())

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle as the actor handle plus options; queued calls and tasks stay behind."""
        return (_attached, self._connection.pickled())

    def __repr__(self) -> str:
        """Show the actor's name (or id) and the payload mode."""
        return f"<RemoteReplayBuffer actor {self._connection.where()} payloads={self.payloads!r}>"

    # -- producers --------------------------------------------------------------------

    async def add_prompt(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new PENDING group, as :meth:`ReplayBuffer.add_prompt`: under admission control
        it waits in the actor (FIFO per partition) for a slot, and ``global_steps=None`` tags the
        group with the actor's dispatch clock when it is admitted.

        Cancelling it while it waits adds nothing; a group the actor admitted before the
        cancellation reached it stays, as for any producer call cancelled after it was sent.

        Raises:
            The same errors as ReplayBuffer.add_prompt; BufferUnavailableError when the actor
            is gone.
        """
        connection = self._connection
        await connection.admit(add_prompt_op(connection.new_token(), uid, global_steps, partition, tags))

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
        result: str = await self._connection.submit(Put(uid, payload, session_id, index, plain_tags(tags)))
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
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None = None,
        session_ids: Sequence[int] | None = None,
        indices: Sequence[int] | None = None,
        status: GroupStatus = "finished",
    ) -> list[str]:
        """Add (if absent), fill and finish or fail a whole group in one round trip; return its
        keys, as :meth:`ReplayBuffer.put_group` (all or nothing, in the actor). A new group waits
        in the actor for admission like :meth:`add_prompt`.

        Raises:
            The same errors as ReplayBuffer.put_group; BufferUnavailableError.
        """
        connection = self._connection
        op = put_group_op(
            connection.new_token(),
            uid,
            payloads,
            global_steps,
            partition,
            tags,
            trajectory_tags,
            session_ids,
            indices,
            status,
        )
        result: list[str] = await connection.admit(op)
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
            The same errors as ReplayBuffer.sample (TypeError and ValueError for bad arguments
            are raised by the client, before it contacts the actor); BufferUnavailableError when
            the actor is gone (also while waiting) or did not start within ``start_timeout``.
        """
        return await self._connection.sample(global_steps, batch_size, partition, timeout)

    # -- closing ----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the hosted buffer, as :meth:`ReplayBuffer.aclose` (for every client: parked and
        later ``sample`` calls and producers raise BufferClosedError; ``stats`` still works).
        The actor keeps running; :meth:`kill` ends it. Idempotent.

        Raises:
            BufferUnavailableError: the actor is gone.
        """
        await self._connection.call("close")

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


@attrs.frozen(eq=False)
class RemoteRestoreResult:
    """What :meth:`RemoteReplayBuffer.restore` returns.

    Attributes:
        buffer: the client of the new actor, which holds the restored buffer.
        reissue: under ``in_flight="reissue"``, the groups that were in flight at the checkpoint
            (uid, partition, dispatch step, tags; no trajectories), oldest first: they are in the
            buffer as PENDING, to be generated again under the same uid.
    """

    buffer: RemoteReplayBuffer
    reissue: tuple[Group, ...]

    def __iter__(self) -> Iterator[Any]:
        """Unpack as ``buffer, reissue = ...``, in that order."""
        return iter((self.buffer, self.reissue))
