"""The replay buffer: producers move groups through their lifecycle, the trainer samples.

Everything that changes state is synchronous (the ``*_nowait`` methods and the evaluation
inside ``sample``), so on one event loop each call is atomic. ``sample`` is the only call
that waits: validate, try :meth:`ReplayBuffer.sample_nowait`'s path, park on a per-call
signal, re-check. The rules live in :mod:`stalebuf.policy`, the indexes in ``_index.py`` and
``_partition.py``, the waiting in ``_waiting.py`` and ``_status_log.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Iterator, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import Any, Literal, TypeVar

import anyio.lowlevel

from ._core import BufferCore, EvictCallback
from ._custom_sampler import load_custom_sampler
from ._partition import OpenGroup, PartitionState
from ._status_log import StatusLog
from ._validation import (
    check_group_payloads,
    check_index,
    check_partition,
    check_status_log_interval,
    check_step,
    check_tags,
    check_timeout,
    check_uid,
    describe,
    describe_typed,
)
from ._waiting import LoopBinding, park
from .config import SamplerConfig
from .errors import (
    BatchNotReadyError,
    ConfigError,
    DuplicateGroupError,
    DuplicateTrajectoryError,
    InvalidTransitionError,
)
from .metrics import SampleMetrics
from .policy import StalenessPolicy, SubclassHooks
from .records import EMPTY_TAGS, Batch, Group, Status, new_trajectory
from .stats import BufferStats, PartitionStats

__all__ = ["ReplayBuffer"]

_Self = TypeVar("_Self", bound="ReplayBuffer")
#: What ``put_group(status=...)`` accepts: a terminal Status, its value, or "failed".
GroupStatus = Status | Literal["finished", "failure", "failed"]
_FINISHED, _FAILURE, _PENDING, _RUNNING = Status.FINISHED, Status.FAILURE, Status.PENDING, Status.RUNNING
_TERMINAL = {
    _FINISHED: _FINISHED,
    _FAILURE: _FAILURE,
    "finished": _FINISHED,
    "failure": _FAILURE,
    "failed": _FAILURE,
}
_UNSET: Any = object()


class ReplayBuffer(BufferCore):
    """A staleness-aware buffer of trajectory groups for asynchronous RL.

    Construction is synchronous and needs no running event loop. The first ``sample`` that
    waits binds the buffer to its async backend (asyncio or trio) and thread; it must then be
    awaited only under that backend (successive event loops of it are fine) and called only
    from that thread: producers on other threads use :meth:`threadsafe`.

    Args:
        config: the sampler config; None means ``SamplerConfig()``.
        policy: the rule book; None builds ``StalenessPolicy(config)``. Subclasses may instead
            override ``_is_stale``, ``_must_wait_for`` and ``_select`` (see :mod:`stalebuf.policy`).
        on_evict: called synchronously with one :class:`EvictionEvent` per reason per
            eviction round, inside ``sample``, after the buffer state is consistent. It may
            call the ``*_nowait`` producer methods (e.g. to refill prompts).
        status_log_interval: a ``sample`` blocked this many seconds logs one INFO line on
            the "stalebuf" logger, and again every interval after; None disables it.

    Raises:
        ConfigError: ``config`` is not a SamplerConfig or names a ``custom_sampler`` (build
            that with :meth:`from_config`), ``policy`` is not a StalenessPolicy, ``on_evict``
            is not a plain callable, or ``status_log_interval`` is not None or a number >= 0.001.
    """

    def __init__(
        self,
        config: SamplerConfig | None = None,
        *,
        policy: StalenessPolicy | None = None,
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = 60.0,
    ) -> None:
        if config is None:
            config = SamplerConfig() if policy is None else policy.config
        elif not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or None, got {type(config).__name__}")
        if policy is None:
            if config.custom_sampler is not None and type(self) is ReplayBuffer:
                raise ConfigError(
                    f"config names custom_sampler {config.custom_sampler!r}: build the buffer with "
                    "ReplayBuffer.from_config(config), which loads it"
                )
            policy = StalenessPolicy(config)
        elif not isinstance(policy, StalenessPolicy):
            raise ConfigError(f"policy must be a StalenessPolicy or None, got {type(policy).__name__}")
        if on_evict is not None and not callable(on_evict):
            raise ConfigError(f"on_evict must be callable or None, got {describe_typed(on_evict)}")
        if inspect.iscoroutinefunction(on_evict):
            raise ConfigError("on_evict must be a plain (synchronous) callable; it is called inside sample")
        interval = check_status_log_interval(status_log_interval)
        self._config = config
        self._policy = policy
        hooks = ("_is_stale", "_must_wait_for", "_select")
        overridden = any(getattr(type(self), hook) is not getattr(ReplayBuffer, hook) for hook in hooks)
        # The rules the buffer asks: the policy itself, or the subclass's hooks in front of it.
        self._rules = SubclassHooks(policy, self) if overridden else policy
        self._sync_step = config.parameter_sync_step
        self._on_evict = on_evict
        self._groups: dict[str, OpenGroup | Group] = {}
        self._partitions: dict[str, PartitionState] = {}
        self._next_seq = 0
        self._closed = False
        self._binding = LoopBinding()
        self._status_interval = interval
        self._status_log: StatusLog | None = None
        # How often a sample evaluated a partition: tests and benchmarks read it to prove an
        # idle wait does no work.
        self._evaluations = 0

    @classmethod
    def from_config(
        cls,
        config: SamplerConfig | Mapping[str, Any],
        *,
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = _UNSET,
    ) -> ReplayBuffer:
        """Build a buffer from a config or verl-style mapping, honouring ``custom_sampler``.

        ``custom_sampler`` may name a ``ReplayBuffer`` subclass, built as
        ``Cls(config, **config.sampler_kwargs)`` plus ``on_evict`` and ``status_log_interval``
        when given here (so its minimal constructor is ``__init__(self, config, **kwargs)``
        passing them on), or a :class:`~stalebuf.policy.StalenessPolicy` subclass, built as
        ``Cls(config, **config.sampler_kwargs)`` and given to ``cls``. Without one, ``cls``.

        Raises:
            ConfigError: for an invalid config, a custom sampler that cannot be loaded or is
                neither kind of subclass, or sampler_kwargs its constructor rejects.
        """
        if isinstance(config, Mapping):
            config = SamplerConfig.from_mapping(config)
        elif not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or a mapping, got {type(config).__name__}")
        options: dict[str, Any] = {} if on_evict is None else {"on_evict": on_evict}
        if status_log_interval is not _UNSET:
            options["status_log_interval"] = status_log_interval
        target: type[Any] = cls
        if config.custom_sampler is not None:
            target = load_custom_sampler(config.custom_sampler)  # type: ignore[assignment]
            if not (isinstance(target, type) and issubclass(target, (ReplayBuffer, StalenessPolicy))):
                raise ConfigError(
                    f"custom_sampler {config.custom_sampler!r} must name a subclass of "
                    f"stalebuf.ReplayBuffer or stalebuf.StalenessPolicy, got {type(target).__name__}"
                )
        kwargs = dict(config.sampler_kwargs)
        try:
            if issubclass(target, StalenessPolicy):
                return cls(config, policy=target(config, **kwargs), **options)
            return target(config, **kwargs, **options)  # type: ignore[no-any-return]
        except TypeError as exc:
            raise ConfigError(f"{target.__qualname__} rejected sampler_kwargs {kwargs!r}: {exc}") from exc

    @property
    def config(self) -> SamplerConfig:
        """The sampler config this buffer was built with."""
        return self._config

    @property
    def policy(self) -> StalenessPolicy:
        """The rule book this buffer asks (without a subclass's hook overrides)."""
        return self._policy

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    # -- producers --------------------------------------------------------------------

    def add_prompt_nowait(
        self,
        uid: str,
        *,
        global_steps: int,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new group ``uid`` dispatched at trainer step ``global_steps``, as PENDING.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: ``uid``, ``global_steps``, ``partition`` or ``tags`` is invalid.
            DuplicateGroupError: a group with this uid is in the buffer.
        """
        self._check_usable()
        # The hot path: each check is inlined, the slow helpers only build the error.
        if type(uid) is not str or not uid or "_" in uid:
            check_uid(uid)
        if type(global_steps) is not int or not 0 <= global_steps < 1 << 63:
            check_step(global_steps)
        part = self._partitions.get(partition) if type(partition) is str else None
        if part is None:
            check_partition(partition)
        frozen_tags = EMPTY_TAGS if tags is None else check_tags(tags)
        if uid in self._groups:
            raise DuplicateGroupError(f"a group with uid {uid!r} is already in the buffer")
        if part is None:
            part = self._partition(partition)
        seq = self._next_seq
        self._next_seq = seq + 1
        self._groups[uid] = OpenGroup(uid, part, global_steps, seq, frozen_tags)
        part.admit(global_steps)

    async def add_prompt(
        self,
        uid: str,
        *,
        global_steps: int,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new PENDING group; the async twin of :meth:`add_prompt_nowait`.

        Raises:
            The same errors as :meth:`add_prompt_nowait`.
        """
        self.add_prompt_nowait(uid, global_steps=global_steps, partition=partition, tags=tags)

    def mark_running_nowait(self, uid: str) -> None:
        """Move group ``uid`` from PENDING to RUNNING.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is not PENDING.
        """
        self._check_usable()
        group = self._open_group(uid, "mark running")
        if group.status is not _PENDING:
            raise InvalidTransitionError(f"cannot mark group {uid!r} running: it is already running")
        group.status = _RUNNING
        group.partition.start()

    async def mark_running(self, uid: str) -> None:
        """Move a group from PENDING to RUNNING; the async twin of :meth:`mark_running_nowait`.

        Raises:
            The same errors as :meth:`mark_running_nowait`.
        """
        self.mark_running_nowait(uid)

    def put_nowait(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
    ) -> str:
        """Add one trajectory to the PENDING or RUNNING group ``uid``; return its key,
        ``f"{uid}_{session_id}_{index}"``.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: ``session_id``/``index`` is not an int >= 0, or ``tags`` is
                not a mapping.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is terminal (a late write).
            DuplicateTrajectoryError: the group already holds this ``(session_id, index)``.
        """
        self._check_usable()
        if type(session_id) is not int or not 0 <= session_id < 1 << 63:
            check_index(session_id, "session_id")
        if type(index) is not int or not 0 <= index < 1 << 63:
            check_index(index, "index")
        frozen_tags = EMPTY_TAGS if tags is None else check_tags(tags)
        group = self._open_group(uid, "put into")
        key = f"{uid}_{session_id}_{index}"
        trajectories = group.trajectories
        if key in trajectories:
            raise DuplicateTrajectoryError(
                f"group {uid!r} already holds session_id={session_id}, index={index} ({key!r})"
            )
        trajectories[key] = new_trajectory(key, session_id, index, frozen_tags, payload)
        group.partition.add_trajectories(1)
        return key

    async def put(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
    ) -> str:
        """Add one trajectory and return its key; the async twin of :meth:`put_nowait`.

        Raises:
            The same errors as :meth:`put_nowait`.
        """
        return self.put_nowait(uid, payload, session_id=session_id, index=index, tags=tags)

    def mark_finished_nowait(self, uid: str) -> None:
        """Move group ``uid`` from PENDING or RUNNING to FINISHED; it becomes sampleable.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is already terminal.
        """
        self._check_usable()
        self._terminate(self._open_group(uid, "mark finished"), _FINISHED)

    async def mark_finished(self, uid: str) -> None:
        """Mark a group FINISHED; the async twin of :meth:`mark_finished_nowait`.

        Raises:
            The same errors as :meth:`mark_finished_nowait`.
        """
        self.mark_finished_nowait(uid)

    def mark_failed_nowait(self, uid: str) -> None:
        """Move group ``uid`` from PENDING or RUNNING to FAILURE.

        Under ``failure_strategy="sample"`` (or in an exempt partition) it becomes
        sampleable; under "evict" the next ``sample`` of its partition evicts it.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is already terminal.
        """
        self._check_usable()
        self._terminate(self._open_group(uid, "mark failed"), _FAILURE)

    async def mark_failed(self, uid: str) -> None:
        """Mark a group FAILURE; the async twin of :meth:`mark_failed_nowait`.

        Raises:
            The same errors as :meth:`mark_failed_nowait`.
        """
        self.mark_failed_nowait(uid)

    def put_group_nowait(
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
        """Add (if absent), fill and finish or fail a whole group in one call; return its keys.

        Does what ``add_prompt`` + one ``put`` per payload + ``mark_finished`` (or
        ``mark_failed``) would, all or nothing: everything is checked before anything changes.
        Trajectory ``i`` gets ``session_ids[i]`` (default ``i``), ``indices[i]`` (default 0)
        and ``trajectory_tags[i]``. If the group is already in flight, it must have the same
        ``global_steps`` and ``partition``, the payloads are added to what it holds, and
        ``tags`` is ignored (group tags are set when a group is added). ``status`` is
        ``Status.FINISHED`` or ``Status.FAILURE`` or their values ("failed" also works).

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: an argument is invalid, ``payloads`` is not a collection, a
                per-trajectory collection has another length than ``payloads``, or ``status``
                is not a terminal status.
            InvalidTransitionError: the group is already terminal (a late write).
            DuplicateGroupError: the group is in flight with another step or partition.
            DuplicateTrajectoryError: two payloads, or a payload and the group, share a key.
        """
        self._check_usable()
        check_uid(uid)
        check_step(global_steps)
        check_partition(partition)
        group_tags = check_tags(tags)
        terminal = _TERMINAL.get(status) if type(status) in (str, Status) else None
        if terminal is None:
            raise ValueError(
                f"status must be Status.FINISHED or Status.FAILURE (or its value), got {describe(status)}"
            )
        keys, rows = check_group_payloads(uid, payloads, trajectory_tags, session_ids, indices)
        group = self._groups.get(uid)
        if group is not None:
            group = self._open_group(uid, "put a group into")
            if group.dispatch_step != global_steps or group.partition.name != partition:
                raise DuplicateGroupError(
                    f"group {uid!r} is already in the buffer with global_steps={group.dispatch_step}, "
                    f"partition={group.partition.name!r}; put_group got global_steps={global_steps}, "
                    f"partition={partition!r}"
                )
            for key in keys:
                if key in group.trajectories:
                    raise DuplicateTrajectoryError(f"group {uid!r} already holds trajectory {key!r}")
        # Everything is valid: from here on nothing raises, so the group lands whole.
        if group is None:
            self.add_prompt_nowait(uid, global_steps=global_steps, partition=partition, tags=group_tags)
            group = self._groups[uid]
        assert type(group) is OpenGroup
        group.trajectories.update((row[0], new_trajectory(*row)) for row in rows)
        group.partition.add_trajectories(len(rows))
        self._terminate(group, terminal)
        return keys

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
        """Add, fill and finish a whole group; the async twin of :meth:`put_group_nowait`.

        Raises:
            The same errors as :meth:`put_group_nowait`.
        """
        return self.put_group_nowait(
            uid,
            payloads,
            global_steps=global_steps,
            partition=partition,
            tags=tags,
            trajectory_tags=trajectory_tags,
            session_ids=session_ids,
            indices=indices,
            status=status,
        )

    def __contains__(self, uid: object) -> bool:
        """Whether a group with this uid is in the buffer (in flight or terminal)."""
        return type(uid) is str and uid in self._groups

    # -- consumer ---------------------------------------------------------------------

    def sample_nowait(
        self, global_steps: int, batch_size: int, *, partition: str = "train"
    ) -> tuple[Batch, dict[str, float]]:
        """Remove and return ``batch_size`` whole groups, oldest first, if a batch may be
        returned now; the non-waiting core of :meth:`sample` (same rules and metrics).

        It first evicts what the config says to evict, reporting it to ``on_evict``. While a
        ``sample`` on the partition waits, it takes nothing (calls are served in order).

        Raises:
            BatchNotReadyError: no batch may be returned now; only evictions happened.
            TypeError, ValueError: an argument is invalid (see :meth:`sample`).
            BufferClosedError: the buffer is or gets closed.
            WrongThreadError: called from another thread than the bound loop's.
            StalebufError: the policy's ``select`` returned an invalid choice; nothing changed.
            Exception: whatever a policy hook or ``on_evict`` raised, with the buffer consistent.
        """
        part = self._check_sample(global_steps, batch_size, partition)
        if part is not None and not self._has_live_waiter(part):
            metrics = SampleMetrics()
            groups = self._evaluate(part, global_steps, batch_size, metrics)
            if groups is not None:
                return self._result(part, global_steps, groups, metrics, 0.0)
        raise BatchNotReadyError(f"no batch of {batch_size} may be returned from partition {partition!r} now")

    async def sample(
        self,
        global_steps: int,
        batch_size: int,
        *,
        partition: str = "train",
        timeout: float | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """Wait for, remove and return exactly ``batch_size`` whole groups, oldest first.

        Before selecting, evicts what the config says to evict (stale groups under "drop",
        failed groups under ``failure_strategy="evict"``), reporting them to ``on_evict``.
        Returns once ``batch_size`` groups are sampleable and, under "wait", no in-flight
        group of the partition has staleness >= threshold. Calls on one partition are served
        in arrival order: while an earlier call on the partition waits, a new call neither
        evicts nor takes anything and queues behind it. Otherwise it evaluates once before
        waiting, so ``timeout=0`` means "check once, don't wait".

        Returns:
            The batch and its metrics (see the README for the metric names).

        Raises:
            TypeError, ValueError: ``global_steps`` is not an int >= 0, ``batch_size`` not an
                int >= 1 (both below 2**63), ``partition`` not a non-empty str, or ``timeout``
                not None or a number >= 0.
            TimeoutError: ``timeout`` seconds passed first; no sampleable group was removed.
            BufferClosedError: the buffer is or gets closed.
            WrongThreadError: called from another thread than the bound loop's.
            BackendMismatchError: it may wait (``timeout != 0``) and runs under another async
                backend than the one the buffer is bound to; nothing changed.
            Exception: whatever a policy hook or ``on_evict`` raised, with the buffer consistent.
        """
        if timeout is not None:
            timeout = check_timeout(timeout)
        binding = self._binding
        if timeout != 0:
            # A call that may wait needs the bound backend: refuse another one before anything
            # changes. (One with timeout=0 never touches the backend, so any caller may check.)
            binding.check_backend()
        part = self._check_sample(global_steps, batch_size, partition)
        metrics = SampleMetrics()
        if part is not None and not self._has_live_waiter(part):
            groups = self._evaluate(part, global_steps, batch_size, metrics)
            if groups is not None:
                return self._result(part, global_steps, groups, metrics, 0.0)
        if timeout == 0:
            raise TimeoutError(f"no batch of {batch_size} ready in partition {partition!r}")
        backend = binding.bind()
        started = backend.current_time()
        if part is None:
            part = self._partition(partition)
        waiter = binding.new_waiter(global_steps, batch_size)
        interval = self._status_interval
        timer_logs = interval is not None and binding.on_asyncio
        if timer_logs:
            if self._status_log is None:
                self._status_log = StatusLog(interval, self._partitions.values())  # type: ignore[arg-type]
            self._status_log.watch(waiter, started)

        def attempt() -> list[Group] | None:
            self._check_open()
            if part.waiters[0] is not waiter:
                return None
            return self._evaluate(part, global_steps, batch_size, metrics)

        part.waiters.append(waiter)  # from here on, the finally below must remove it
        try:
            if timeout is None and (interval is None or timer_logs):
                groups = await park(waiter, attempt)  # no deadline: no cancel scope
            else:
                groups = await self._park_with_deadlines(part, waiter, attempt, started, timeout, timer_logs)
        finally:
            self._leave(part, waiter)
        return self._result(part, global_steps, groups, metrics, backend.current_time() - started)

    def sampleable_count(self, global_steps: int, partition: str = "train") -> int:
        """Return how many groups ``sample`` could select from right now; changes nothing.

        Counts ready groups after the drop and failure rules at ``global_steps``; ignores the
        wait gate and the batch size.

        Raises:
            TypeError, ValueError: ``global_steps`` is not an int >= 0 or ``partition`` is not
                a non-empty str.
            WrongThreadError: called from another thread than the bound loop's.
            Exception: whatever the policy's ``is_stale`` raised.
        """
        self._binding.check_thread()
        check_step(global_steps)
        check_partition(partition)
        part = self._partitions.get(partition)
        if part is None:
            return 0
        count = part.ready.count
        rules = self._rules
        if rules.drops and not part.exempt:
            name = part.name
            count -= part.ready.count_while(lambda step: rules.is_stale(global_steps, step, name))
        return count

    def stats(self) -> BufferStats:
        """Return an immutable snapshot of per-partition and total counts (works after close)."""
        for part in self._partitions.values():
            self._drop_abandoned(part)
        partitions = {name: part.stats() for name, part in sorted(self._partitions.items())}
        total = PartitionStats()
        for item in partitions.values():
            total = total + item
        return BufferStats(closed=self._closed, partitions=MappingProxyType(partitions), total=total)

    # -- closing ----------------------------------------------------------------------

    def close(self) -> None:
        """Close the buffer: blocked and later ``sample`` calls and producers raise
        BufferClosedError. Groups already present stay (visible in ``stats()``). Idempotent.

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
        """
        self._binding.check_thread()
        if self._closed:
            return
        self._closed = True
        for part in self._partitions.values():
            self._drop_abandoned(part)
            for waiter in part.waiters:
                waiter.wake()

    async def aclose(self) -> None:
        """Close the buffer (see :meth:`close`) and yield once to the scheduler."""
        self.close()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self: _Self) -> _Self:
        """Return the buffer; ``async with`` closes it on exit."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the buffer."""
        await self.aclose()

    # -- hooks for verl-style subclasses (see stalebuf.policy for the cost model) ------

    def _is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        """Whether a terminal group is dropped; defaults to ``policy.is_stale``. Must be monotone."""
        return self._policy.is_stale(global_steps, dispatch_step, partition)

    def _must_wait_for(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        """Whether an in-flight group blocks the sample; defaults to ``policy.must_wait_for``."""
        return self._policy.must_wait_for(global_steps, dispatch_step, partition)

    def _select(
        self, candidates: Iterator[Group], batch_size: int, global_steps: int, partition: str
    ) -> Sequence[Group]:
        """Choose the batch from ``candidates`` (oldest first, lazily); defaults to
        ``policy.select``, which takes the first ``batch_size`` in O(batch_size); any other
        choice costs O(N)."""
        return self._policy.select(candidates, batch_size, global_steps, partition)
