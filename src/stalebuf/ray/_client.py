"""The client of a buffer hosted by a Ray actor: the ReplayBuffer API, one process removed."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from ..buffer import GroupStatus, ReplayBuffer
from ..config import SamplerConfig
from ..errors import BufferUnavailableError, ConfigError, StalebufError
from ..records import Batch, EvictionEvent
from ..stats import BufferStats
from ._actor import Op, Outcome, actor_class, pack_ops

__all__ = ["EvictionStream", "PayloadMode", "RemoteReplayBuffer"]

logger = logging.getLogger("stalebuf.ray")

#: Where payload values given to ``put``/``put_group`` go (see :class:`RemoteReplayBuffer`).
PayloadMode = Literal["producer", "actor", "inline"]
PAYLOAD_MODES: tuple[str, ...] = ("producer", "actor", "inline")

# At most this many producer operations travel in one actor call.
_MAX_OPS_PER_CALL = 1024
# How long a cancelled sample waits for its remote call's outcome before giving up.
_RECLAIM_SECONDS = 60.0
# Errors whose remote traceback adds nothing: raised on the client without chaining.
_PLAIN_ERRORS = (StalebufError, TypeError, ValueError, TimeoutError)


def _check_payload_mode(payloads: object) -> None:
    if payloads not in PAYLOAD_MODES:
        raise ConfigError(f"payloads must be one of {', '.join(map(repr, PAYLOAD_MODES))}; got {payloads!r}")


def _check_options(
    *,
    status_log_interval: float | None,
    payloads: object,
    eviction_queue_size: object,
    keep_evicted_payloads: object,
    on_evict: object,
    name: object,
    namespace: object,
    actor_options: object,
) -> None:
    if on_evict is not None:
        raise ConfigError(
            "on_evict cannot cross process boundaries; iterate `remote.evictions()` instead "
            "(an async iterator of EvictionEvents)"
        )
    ReplayBuffer(status_log_interval=status_log_interval)  # validates status_log_interval
    _check_payload_mode(payloads)
    if type(eviction_queue_size) is not int or eviction_queue_size < 1:
        raise ConfigError(f"eviction_queue_size must be an int >= 1, got {eviction_queue_size!r}")
    if type(keep_evicted_payloads) is not bool:
        raise ConfigError(f"keep_evicted_payloads must be a bool, got {keep_evicted_payloads!r}")
    if name is not None and (type(name) is not str or not name):
        raise ConfigError(f"name must be None or a non-empty str, got {name!r}")
    if namespace is not None and (type(namespace) is not str or not namespace or name is None):
        raise ConfigError(f"namespace must be None or a non-empty str given with a name, got {namespace!r}")
    if actor_options is not None and not isinstance(actor_options, Mapping):
        raise ConfigError(f"actor_options must be a mapping or None, got {type(actor_options).__name__}")


def _actor_options(
    name: str | None, namespace: str | None, get_if_exists: bool, actor_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    user = dict(actor_options or {})
    for key in ("name", "namespace", "get_if_exists"):
        if key in user:
            raise ConfigError(f"pass {key}= to RemoteReplayBuffer itself, not inside actor_options")
    user.pop("concurrency_groups", None)  # given to ray.remote, see actor_class
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000}
    options.update(user)
    if name is not None:
        options["name"] = name
        options["get_if_exists"] = get_if_exists
        if namespace is not None:
            options["namespace"] = namespace
    return options


def _translate(exc: BaseException, where: str) -> BaseException:
    """Map a Ray error to what the local buffer would raise (or BufferUnavailableError)."""
    if isinstance(exc, RayActorError):
        error = BufferUnavailableError(f"the buffer actor {where} is unavailable: {exc}")
        error.__cause__ = exc
        return error
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, BaseException):
            if not isinstance(cause, _PLAIN_ERRORS):
                cause.__cause__ = exc  # keep the remote traceback for unexpected errors
            return cause
    return exc


class _Pipeline:
    """Producer operations waiting to be sent, and the one task that sends them (per loop)."""

    __slots__ = ("loop", "queue", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: deque[tuple[Op, asyncio.Future[Outcome]]] = deque()
        self.task: asyncio.Task[None] | None = None


def _running_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "stalebuf.ray's RemoteReplayBuffer needs a running asyncio event loop "
            "(Ray's async API is asyncio-only)"
        ) from None


def _plain_tags(tags: object) -> object:
    return dict(tags) if isinstance(tags, Mapping) else tags


class RemoteReplayBuffer:
    """A :class:`~stalebuf.ReplayBuffer` hosted by a Ray async actor, used through this client.

    The client has the buffer's async methods with the same names, signatures, results and
    errors, so going distributed is one line (``ReplayBuffer(config)`` ->
    ``RemoteReplayBuffer(config)``). Differences, all because a process boundary is crossed:

    - ``sampleable_count`` and ``stats`` are coroutines here (sync on ReplayBuffer); the
      ``*_nowait`` twins do not exist, and ``on_evict`` is replaced by :meth:`evictions`.
    - Payloads go to the Ray object store, not through the actor (see ``payloads``): sampled
      batches hold :class:`~stalebuf.ray.PayloadRef`\\ s; :func:`~stalebuf.ray.resolve` turns a
      batch into values in one call.
    - :meth:`put_group` adds, fills and terminates a whole group in one round trip.
    - Producer calls made concurrently from one client (one event loop) are combined into one
      actor call while the previous one is in flight; each call still gets its own result or
      error, and the calls of one coroutine apply in the order it made them. A producer call
      cancelled before its actor call was sent is not applied; one cancelled later may be.
    - A dead or unreachable actor raises :class:`~stalebuf.errors.BufferUnavailableError`.
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
            empty buffer), ``scheduling_strategy``,
            ``runtime_env``, ``concurrency_groups`` (merged over the defaults ``producer``: 64,
            ``control``: 16, ``events``: 64).
        payloads: where payload values passed to ``put``/``put_group`` go. "producer" (default):
            the client ``ray.put``\\ s them (one object per actor call, shared by the groups of
            that call) and the producer process owns them: it must outlive their use by the
            trainer, or resolving raises ``ray.exceptions.OwnerDiedError`` (Ray >= 2.56 has no
            ``ray.put(_owner=...)`` to hand ownership over). "actor": the values travel with the
            call and the actor stores them, so they survive the producer (one extra copy).
            "inline": the actor keeps the values themselves (small payloads; sampled batches
            then carry values). Payloads that are None, a ``ray.ObjectRef`` or a PayloadRef are
            always kept as they are.
        eviction_queue_size: how many eviction events the actor keeps for :meth:`evictions`
            readers; when full the oldest is discarded (readers count it in
            ``EvictionStream.dropped``), so ``sample`` never blocks on slow readers.
        keep_evicted_payloads: keep payload references in queued eviction events; False
            (default) strips them so evicted payloads are freed at once.

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
    ) -> None:
        if config is not None and not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or None, got {type(config).__name__}")
        self._start(
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
        self._start(
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
        )
        return self

    @classmethod
    def connect(
        cls, name: str, namespace: str | None = None, *, payloads: PayloadMode = "producer"
    ) -> RemoteReplayBuffer:
        """Attach to the live buffer actor called ``name`` (in ``namespace``, default: the
        current one). Ray must be initialised (``ray.init(...)``, or inside a Ray worker).

        Raises:
            ConfigError: ``payloads`` is invalid.
            BufferUnavailableError: no live actor has that name.
        """
        if payloads not in PAYLOAD_MODES:
            raise ConfigError(
                f"payloads must be one of {', '.join(map(repr, PAYLOAD_MODES))}; got {payloads!r}"
            )
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError as exc:
            raise BufferUnavailableError(f"no buffer actor named {name!r}: {exc}") from exc
        return cls._attach(handle, name, namespace, payloads)

    @classmethod
    def _attach(
        cls, handle: Any, name: str | None, namespace: str | None, payloads: str
    ) -> RemoteReplayBuffer:
        self = cls.__new__(cls)
        self._setup(handle, name, namespace, payloads)
        return self

    def _start(
        self,
        config: SamplerConfig | None,
        use_factory: bool,
        *,
        on_evict: object,
        status_log_interval: float | None,
        name: str | None,
        namespace: str | None,
        get_if_exists: bool,
        actor_options: Mapping[str, Any] | None,
        payloads: str,
        eviction_queue_size: int,
        keep_evicted_payloads: bool,
    ) -> None:
        _check_options(
            status_log_interval=status_log_interval,
            payloads=payloads,
            eviction_queue_size=eviction_queue_size,
            keep_evicted_payloads=keep_evicted_payloads,
            on_evict=on_evict,
            name=name,
            namespace=namespace,
            actor_options=actor_options,
        )
        options = _actor_options(name, namespace, get_if_exists, actor_options)
        groups = (actor_options or {}).get("concurrency_groups") or {}
        if not isinstance(groups, Mapping):
            raise ConfigError(f"actor_options['concurrency_groups'] must be a mapping, got {groups!r}")
        try:
            handle = (
                actor_class(groups)
                .options(**options)
                .remote(config, use_factory, status_log_interval, eviction_queue_size, keep_evicted_payloads)
            )
        except (TypeError, ValueError) as exc:  # bad options, or the name is taken
            raise ConfigError(f"cannot start the buffer actor: {exc}") from exc
        self._setup(handle, name, namespace, payloads)

    def _setup(self, handle: Any, name: str | None, namespace: str | None, payloads: str) -> None:
        self._handle = handle
        self._name = name
        self._namespace = namespace
        self._payloads = payloads
        self._pipe: _Pipeline | None = None
        self._background: set[asyncio.Task[None]] = set()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle as the actor handle plus options; queued calls and tasks stay behind."""
        return (RemoteReplayBuffer._attach, (self._handle, self._name, self._namespace, self._payloads))

    def __repr__(self) -> str:
        """Show the actor's name (or id) and the payload mode."""
        return f"<RemoteReplayBuffer actor {self._where()} payloads={self._payloads!r}>"

    @property
    def handle(self) -> Any:
        """The Ray actor handle of the hosting actor."""
        return self._handle

    @property
    def name(self) -> str | None:
        """The actor's name, or None for an anonymous actor."""
        return self._name

    @property
    def namespace(self) -> str | None:
        """The namespace given at creation or connection (None: Ray's current one)."""
        return self._namespace

    @property
    def payloads(self) -> str:
        """The payload mode: "producer", "actor" or "inline"."""
        return self._payloads

    def _where(self) -> str:
        if self._name is not None:
            return repr(self._name)
        actor_id = getattr(self._handle, "_actor_id", None)
        return f"id={actor_id.hex()[:12]}" if actor_id is not None else "(anonymous)"

    async def _call(self, method: str, *args: Any) -> Any:
        """Call an actor method (not a producer operation) and return its translated result."""
        _running_loop()
        return await self._result(getattr(self._handle, method).remote(*args))

    async def _result(self, ref: Any) -> Any:
        try:
            return await ref
        except (RayActorError, RayTaskError) as exc:
            error = _translate(exc, self._where())
        raise error  # outside the except block: no "during handling" context

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
        await self._submit(("add", uid, global_steps, partition, _plain_tags(tags)))

    async def mark_running(self, uid: str) -> None:
        """Move a group from PENDING to RUNNING, as :meth:`ReplayBuffer.mark_running`.

        Raises:
            The same errors as ReplayBuffer.mark_running; BufferUnavailableError.
        """
        await self._submit(("run", uid))

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
        result: str = await self._submit(("put", uid, payload, session_id, index, _plain_tags(tags)))
        return result

    async def mark_finished(self, uid: str) -> None:
        """Mark a group FINISHED, as :meth:`ReplayBuffer.mark_finished`.

        Raises:
            The same errors as ReplayBuffer.mark_finished; BufferUnavailableError.
        """
        await self._submit(("fin", uid))

    async def mark_failed(self, uid: str) -> None:
        """Mark a group FAILURE, as :meth:`ReplayBuffer.mark_failed`.

        Raises:
            The same errors as ReplayBuffer.mark_failed; BufferUnavailableError.
        """
        await self._submit(("fail", uid))

    async def put_group(
        self,
        uid: str,
        payloads: Sequence[Any],
        *,
        global_steps: int,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None = None,
        session_ids: Sequence[int] | None = None,
        indices: Sequence[int] | None = None,
        status: GroupStatus = "finished",
    ) -> list[str]:
        """Upload a whole group and mark it terminal in one round trip; return its keys.

        In the actor, atomically: ``add_prompt`` (unless the group is already there, PENDING or
        RUNNING, when ``global_steps`` and ``partition`` must match it), one ``put`` per
        payload, then ``mark_finished`` (``status="finished"``) or ``mark_failed``
        (``status="failed"``). Trajectory ``i`` gets ``session_id=session_ids[i]`` (default
        ``i``), ``index=indices[i]`` (default 0) and ``tags=trajectory_tags[i]``. Everything is
        checked before anything changes: a failed call leaves the buffer as it was.

        Raises:
            TypeError, ValueError: an invalid argument, or sequences whose lengths differ from
                ``payloads``.
            DuplicateGroupError: the group is there with another ``global_steps`` or partition.
            DuplicateTrajectoryError: two payloads, or a payload and a trajectory already in
                the group, share a ``(session_id, index)``.
            InvalidTransitionError: the group is already terminal.
            BufferClosedError: the buffer is closed.
            BufferUnavailableError: the actor is gone.
        """
        if isinstance(payloads, (str, bytes)) or not isinstance(payloads, Sequence):
            raise TypeError(f"payloads must be a sequence, got {type(payloads).__name__}")
        op = (
            "group",
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
        result: list[str] = await self._submit(op)
        return result

    async def _submit(self, op: Op) -> Any:
        loop = _running_loop()
        pipe = self._pipe
        if pipe is None or pipe.loop is not loop:
            pipe = self._pipe = _Pipeline(loop)
        future: asyncio.Future[Outcome] = loop.create_future()
        pipe.queue.append((op, future))
        if pipe.task is None:
            pipe.task = loop.create_task(self._flush(pipe))
        ok, value = await future
        if ok:
            return value
        raise value

    async def _flush(self, pipe: _Pipeline) -> None:
        """Send queued operations, one actor call at a time, until the queue is empty."""
        queue = pipe.queue
        try:
            while queue:
                items: list[tuple[Op, asyncio.Future[Outcome]]] = []
                while queue and len(items) < _MAX_OPS_PER_CALL:
                    item = queue.popleft()
                    if not item[1].done():  # a caller cancelled before sending: not applied
                        items.append(item)
                if items:
                    await self._send(items)
        finally:
            pipe.task = None
            while queue:
                queue.popleft()[1].cancel()

    async def _send(self, items: list[tuple[Op, asyncio.Future[Outcome]]]) -> None:
        try:
            ops = [op for op, _ in items]
            if self._payloads == "producer":
                ops = pack_ops(ops)
            ref = self._handle.submit.remote(ops, self._payloads == "actor")
        except RayError as exc:
            self._fail(items, exc)
            return
        except Exception as exc:  # e.g. a payload that cannot be serialised
            if len(items) == 1:
                self._fail(items, exc)
            else:  # find the culprit: the others must not fail with it
                for item in items:
                    await self._send([item])
            return
        try:
            outcomes: list[Outcome] = await ref
        except asyncio.CancelledError as exc:  # the loop is shutting down: the ops may have applied
            self._fail(items, exc)
            raise
        except Exception as exc:
            self._fail(items, exc)
            return
        for (_, future), outcome in zip(items, outcomes, strict=True):
            if not future.done():
                future.set_result(outcome)

    def _fail(self, items: list[tuple[Op, asyncio.Future[Outcome]]], exc: BaseException) -> None:
        for i, (_, future) in enumerate(items):
            if future.done():
                continue
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
                continue
            error = _translate(exc, self._where())
            future.set_result((False, error if i == 0 else copy.copy(error)))

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
        applied in the actor, so a TimeoutError guarantees no group was taken. Cancelling the
        awaiting task cancels the remote call too; if it had already taken a batch, the groups
        are put back into the buffer (re-admitted, so counted twice in ``admitted_*``).

        Raises:
            The same errors as ReplayBuffer.sample; BufferUnavailableError when the actor is
            gone (also while waiting).
        """
        _running_loop()
        ref = self._handle.sample.remote(global_steps, batch_size, partition, timeout)
        try:
            result: tuple[Batch, dict[str, float]] = await self._result(ref)
        except asyncio.CancelledError:
            self._reclaim_later(ref)
            raise
        return result

    def _reclaim_later(self, ref: Any) -> None:
        try:
            ray.cancel(ref)
        except Exception:  # pragma: no cover - the call already ended
            logger.debug("ray.cancel of a cancelled sample failed", exc_info=True)
        task = asyncio.get_running_loop().create_task(self._reclaim(ref))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reclaim(self, ref: Any) -> None:
        """After a client-side cancel: put back the batch if the remote call had taken one."""
        try:
            batch, _ = await asyncio.wait_for(ref, _RECLAIM_SECONDS)
        except Exception:  # cancelled remotely before taking anything, or the actor is gone
            return
        try:
            lost = await self._handle.requeue.remote(batch)
        except Exception:
            logger.exception("a cancelled sample took %d group(s); putting them back failed", len(batch))
            return
        logger.warning(
            "sample was cancelled after it took %d group(s); put them back%s",
            len(batch),
            f" except {lost!r} (uid reused or buffer closed)" if lost else "",
        )

    async def sampleable_count(self, global_steps: int, partition: str = "train") -> int:
        """Return how many groups ``sample`` could select right now, as
        :meth:`ReplayBuffer.sampleable_count` (a coroutine here: it asks the actor).

        Raises:
            TypeError, ValueError: as ReplayBuffer.sampleable_count; BufferUnavailableError.
        """
        result: int = await self._call("sampleable_count", global_steps, partition)
        return result

    async def stats(self) -> BufferStats:
        """Return the buffer's :class:`~stalebuf.BufferStats`, as :meth:`ReplayBuffer.stats`
        (a coroutine here: it asks the actor).

        Raises:
            BufferUnavailableError: the actor is gone.
        """
        result: BufferStats = await self._call("stats")
        return result

    async def info(self) -> dict[str, Any]:
        """Return facts about the actor: ``config``, ``buffer_class``, ``closed``,
        ``eviction_queue_size``, ``evictions_emitted`` and ``evictions_overflowed``. Also a
        way to wait until the actor is up.

        Raises:
            ConfigError: the actor could not build its buffer (e.g. a bad custom sampler).
            BufferUnavailableError: the actor is gone or never started.
        """
        result: dict[str, Any] = await self._call("info")
        return result

    def evictions(
        self, *, from_oldest: bool = False, max_events: int = 256, poll_seconds: float = 10.0
    ) -> EvictionStream:
        """Return an async iterator of the buffer's :class:`~stalebuf.EvictionEvent`\\ s.

        It yields every event emitted from its first ``__anext__`` on (with ``from_oldest``,
        also the ones the actor still holds), and ends once the buffer is closed and every
        event was yielded. Each stream reads independently (several trainers can each have
        one). The actor keeps at most ``eviction_queue_size`` events; a reader that falls
        further behind loses the oldest, counted in :attr:`EvictionStream.dropped` and logged.
        Payload references are stripped unless the actor keeps them (``keep_evicted_payloads``).

        ``max_events`` bounds the events fetched per round trip; ``poll_seconds`` is how long
        one round trip waits in the actor for an event (the stream just asks again).
        """
        return EvictionStream(self, from_oldest=from_oldest, max_events=max_events, poll_seconds=poll_seconds)

    # -- closing ----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the hosted buffer, as :meth:`ReplayBuffer.aclose` (for every client: parked and
        later ``sample`` calls and producers raise BufferClosedError; ``stats`` still works).
        The actor keeps running; :meth:`kill` ends it. Idempotent.

        Raises:
            BufferUnavailableError: the actor is gone.
        """
        await self._call("close")

    def kill(self) -> None:
        """End the actor now (``ray.kill``): every pending and later call of every client raises
        BufferUnavailableError. The buffer's contents are lost; payload objects live on while
        referenced elsewhere."""
        ray.kill(self._handle, no_restart=True)

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


class EvictionStream:
    """An async iterator of the eviction events of a remote buffer (see
    :meth:`RemoteReplayBuffer.evictions`).

    Attributes:
        dropped: events this stream lost because the actor's queue overflowed before it read
            them.
    """

    def __init__(
        self, buffer: RemoteReplayBuffer, *, from_oldest: bool, max_events: int, poll_seconds: float
    ) -> None:
        if type(max_events) is not int or max_events < 1:
            raise ValueError(f"max_events must be an int >= 1, got {max_events!r}")
        if isinstance(poll_seconds, bool) or not isinstance(poll_seconds, (int, float)) or poll_seconds <= 0:
            raise ValueError(f"poll_seconds must be a number > 0, got {poll_seconds!r}")
        self._buffer = buffer
        self._from_oldest = from_oldest
        self._max_events = max_events
        self._poll_seconds = float(poll_seconds)
        self._cursor: int | None = None
        self._ready: deque[EvictionEvent] = deque()
        self._ended = False
        self.dropped = 0

    def __aiter__(self) -> EvictionStream:
        """Return the stream itself."""
        return self

    async def __anext__(self) -> EvictionEvent:
        """Return the next event, waiting for one.

        Raises:
            StopAsyncIteration: the buffer is closed and every event was yielded.
            BufferUnavailableError: the actor is gone.
        """
        buffer = self._buffer
        while not self._ready:
            if self._ended:
                raise StopAsyncIteration
            cursor, events, missed, closed = await buffer._call(
                "poll_evictions", self._cursor, self._from_oldest, self._max_events, self._poll_seconds
            )
            self._cursor = cursor
            self._ready.extend(events)
            self._ended = closed
            if missed:
                self.dropped += missed
                logger.warning(
                    "the eviction queue of %r overflowed: this reader lost %d event(s) (%d in all)",
                    buffer,
                    missed,
                    self.dropped,
                )
        return self._ready.popleft()
