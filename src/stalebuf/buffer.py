"""The replay buffer: producers move groups through their lifecycle, the trainer samples.

Everything that changes state is synchronous (the ``*_nowait`` methods and the
evaluation inside ``sample``), so on one event loop each call is atomic. ``sample``
is the only call that waits: it parks on a per-call signal (a :class:`~.partition.Waiter`)
that a producer sets only when the head waiter of that partition might now get its
batch (or has eviction work to do). A woken waiter re-checks everything itself; nothing
is handed to it before it runs, so a cancelled waiter can lose nothing, and when it
leaves the queue it passes the wake-up on to the next waiter.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import Any, Literal, TypeVar

import anyio
import anyio.lowlevel
from anyio.abc import AsyncBackend

from . import staleness
from ._validation import (
    check_batch_size,
    check_index,
    check_partition,
    check_step,
    check_tags,
    check_timeout,
    check_uid,
)
from .config import SamplerConfig
from .custom_sampler import load_custom_sampler
from .errors import (
    BackendMismatchError,
    BufferClosedError,
    ConfigError,
    DuplicateGroupError,
    DuplicateTrajectoryError,
    InvalidTransitionError,
    StalebufError,
    UnknownGroupError,
)
from .metrics import SampleMetrics
from .partition import EventWaiter, FutureWaiter, OpenGroup, PartitionIndex, Waiter
from .records import EMPTY_TAGS, Batch, EvictionEvent, Group, Status, new_batch, new_group, new_trajectory
from .stats import BufferStats, PartitionStats

__all__ = ["ReplayBuffer"]

logger = logging.getLogger("stalebuf")

_Self = TypeVar("_Self", bound="ReplayBuffer")
EvictCallback = Callable[[EvictionEvent], object]
GroupStatus = Literal["finished", "failed"]


class ReplayBuffer:
    """A staleness-aware buffer of trajectory groups for asynchronous RL.

    Construction is synchronous and needs no running event loop; the buffer binds to the
    async backend (asyncio or trio) of the first ``sample`` that waits, and must then be
    awaited only under that backend (any number of successive event loops of it is fine).
    It is not thread-safe: use it from one thread.

    Args:
        config: the sampler config; None means ``SamplerConfig()``.
        on_evict: called synchronously with one :class:`EvictionEvent` per reason per
            eviction round, inside ``sample``, after the buffer state is consistent. It may
            call the ``*_nowait`` producer methods (e.g. to refill prompts).
        status_log_interval: a ``sample`` blocked this many seconds logs one INFO line on
            the "stalebuf" logger, and again every interval after; None disables it.

    Raises:
        ConfigError: if ``config`` is not a SamplerConfig, ``on_evict`` is not callable, or
            ``status_log_interval`` is not None or a positive number.
    """

    def __init__(
        self,
        config: SamplerConfig | None = None,
        *,
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = 60.0,
    ) -> None:
        if config is None:
            config = SamplerConfig()
        elif not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or None, got {type(config).__name__}")
        if on_evict is not None and not callable(on_evict):
            raise ConfigError(f"on_evict must be callable or None, got {on_evict!r}")
        if inspect.iscoroutinefunction(on_evict):
            raise ConfigError("on_evict must be a plain (synchronous) callable; it is called inside sample")
        if status_log_interval is not None and (
            isinstance(status_log_interval, bool)
            or not isinstance(status_log_interval, (int, float))
            or not status_log_interval > 0
        ):
            raise ConfigError(
                f"status_log_interval must be None or a number of seconds > 0, got {status_log_interval!r}"
            )
        self._config = config
        self._threshold = config.max_off_policy_threshold
        self._sync_step = config.parameter_sync_step
        self._drop = config.max_off_policy_strategy == "drop"
        self._on_evict = on_evict
        self._status_log_interval = None if status_log_interval is None else float(status_log_interval)
        self._groups: dict[str, OpenGroup | Group] = {}
        self._partitions: dict[str, PartitionIndex] = {}
        self._next_seq = 0
        self._closed = False
        # Bound on the first wait (see the class docs): resolving anyio's backend costs more
        # than the whole wake-up path otherwise, so it is done once, not per event or clock read.
        self._backend: type[AsyncBackend] | None = None
        # On asyncio, waiters park on bare futures and status lines come from one loop timer.
        self._on_asyncio = False
        self._status_timer: asyncio.TimerHandle | None = None
        self._status_loop: asyncio.AbstractEventLoop | None = None
        # The default selection takes the index's front in O(B); an override of _select
        # sees every candidate, which costs O(N).
        self._default_select = type(self)._select is ReplayBuffer._select
        # How many times a sample evaluated a partition: lets tests and benchmarks prove that
        # an idle wait does no work, without overriding internals.
        self._evaluations = 0

    @classmethod
    def from_config(
        cls,
        config: SamplerConfig | Mapping[str, Any],
        *,
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = 60.0,
    ) -> ReplayBuffer:
        """Build a buffer from a config or verl-style mapping, honouring ``custom_sampler``.

        The class built is the one ``config.custom_sampler`` names (a ``ReplayBuffer``
        subclass) or else ``cls``; ``config.sampler_kwargs`` become extra keyword arguments.

        Raises:
            ConfigError: for an invalid config, a custom sampler that cannot be loaded or is
                not a ReplayBuffer subclass, or sampler_kwargs its constructor rejects.
        """
        if isinstance(config, Mapping):
            config = SamplerConfig.from_mapping(config)
        elif not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or a mapping, got {type(config).__name__}")
        target: type[ReplayBuffer] = cls
        if config.custom_sampler is not None:
            loaded = load_custom_sampler(config.custom_sampler)
            if not (isinstance(loaded, type) and issubclass(loaded, ReplayBuffer)):
                raise ConfigError(
                    f"custom_sampler {config.custom_sampler!r} must name a subclass of "
                    f"stalebuf.ReplayBuffer, got {loaded!r}"
                )
            target = loaded
        try:
            return target(
                config,
                on_evict=on_evict,
                status_log_interval=status_log_interval,
                **config.sampler_kwargs,
            )
        except TypeError as exc:
            raise ConfigError(
                f"{target.__qualname__} rejected sampler_kwargs {dict(config.sampler_kwargs)!r}: {exc}"
            ) from exc

    @property
    def config(self) -> SamplerConfig:
        """The sampler config this buffer was built with."""
        return self._config

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
            TypeError, ValueError: ``uid``, ``global_steps``, ``partition`` or ``tags`` is invalid.
            DuplicateGroupError: a group with this uid is in the buffer.
        """
        if self._closed:
            raise BufferClosedError("the buffer is closed")
        # The hot path: each check is inlined, the slow helpers only build the error.
        if type(uid) is not str or not uid or "_" in uid:
            check_uid(uid)
        if type(global_steps) is not int or global_steps < 0:
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
        """Admit a new PENDING group; the async twin of :meth:`add_prompt_nowait` (never waits).

        Raises:
            The same errors as :meth:`add_prompt_nowait`.
        """
        self.add_prompt_nowait(uid, global_steps=global_steps, partition=partition, tags=tags)

    def mark_running_nowait(self, uid: str) -> None:
        """Move group ``uid`` from PENDING to RUNNING.

        Raises:
            BufferClosedError: the buffer is closed.
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is not PENDING.
        """
        if self._closed:
            raise BufferClosedError("the buffer is closed")
        group = self._open_group(uid, "mark running")
        if group.status is not Status.PENDING:
            raise InvalidTransitionError(f"cannot mark group {uid!r} running: it is already running")
        group.status = Status.RUNNING
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
        """Add one trajectory to the PENDING or RUNNING group ``uid``; return its key.

        The key is ``f"{uid}_{session_id}_{index}"``.

        Raises:
            BufferClosedError: the buffer is closed.
            TypeError, ValueError: ``session_id``/``index`` is not an int >= 0, or ``tags`` is
                not a mapping.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is terminal (a late write).
            DuplicateTrajectoryError: the group already holds this ``(session_id, index)``.
        """
        if self._closed:
            raise BufferClosedError("the buffer is closed")
        # The hot path: each check is inlined, the slow helpers only build the error.
        if type(session_id) is not int or session_id < 0:
            check_index(session_id, "session_id")
        if type(index) is not int or index < 0:
            check_index(index, "index")
        frozen_tags = EMPTY_TAGS if tags is None else check_tags(tags)
        group = self._groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:
            raise self._not_open(uid, group, "put into")
        key = f"{uid}_{session_id}_{index}"
        trajectories = group.trajectories
        if key in trajectories:
            raise DuplicateTrajectoryError(
                f"group {uid!r} already holds session_id={session_id}, index={index} ({key!r})"
            )
        trajectories[key] = new_trajectory(key, session_id, index, frozen_tags, payload)
        part = group.partition
        part.trajectories += 1
        part.admitted_trajectories += 1
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
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is already terminal.
        """
        self._terminate(uid, Status.FINISHED)

    async def mark_finished(self, uid: str) -> None:
        """Mark a group FINISHED; the async twin of :meth:`mark_finished_nowait`.

        Raises:
            The same errors as :meth:`mark_finished_nowait`.
        """
        self._terminate(uid, Status.FINISHED)

    def mark_failed_nowait(self, uid: str) -> None:
        """Move group ``uid`` from PENDING or RUNNING to FAILURE.

        Under ``failure_strategy="sample"`` (or in an exempt partition) it becomes
        sampleable; under "evict" the next ``sample`` of its partition evicts it.

        Raises:
            BufferClosedError: the buffer is closed.
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is already terminal.
        """
        self._terminate(uid, Status.FAILURE)

    async def mark_failed(self, uid: str) -> None:
        """Mark a group FAILURE; the async twin of :meth:`mark_failed_nowait`.

        Raises:
            The same errors as :meth:`mark_failed_nowait`.
        """
        self._terminate(uid, Status.FAILURE)

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
        ``tags`` is ignored (group tags are set when a group is added).

        Raises:
            BufferClosedError: the buffer is closed.
            TypeError, ValueError: an argument is invalid, ``payloads`` is not a sequence, a
                per-trajectory sequence has another length than ``payloads``, or ``status`` is
                not "finished" or "failed".
            InvalidTransitionError: the group is already terminal (a late write).
            DuplicateGroupError: the group is in flight with another step or partition.
            DuplicateTrajectoryError: two payloads, or a payload and the group, share a key.
        """
        if self._closed:
            raise BufferClosedError("the buffer is closed")
        check_uid(uid)
        check_step(global_steps)
        check_partition(partition)
        group_tags = check_tags(tags)
        if status not in ("finished", "failed"):
            raise ValueError(f"status must be 'finished' or 'failed', got {status!r}")
        if isinstance(payloads, (str, bytes, Mapping)) or not isinstance(payloads, Collection):
            raise TypeError(f"payloads must hold one item per trajectory, got {type(payloads).__name__}")
        n = len(payloads)
        sessions = range(n) if session_ids is None else session_ids
        positions = (0,) * n if indices is None else indices
        for name, values in (
            ("session_ids", sessions),
            ("indices", positions),
            ("trajectory_tags", trajectory_tags),
        ):
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} items for {n} payloads")
        frozen = (EMPTY_TAGS,) * n if trajectory_tags is None else [check_tags(t) for t in trajectory_tags]
        if session_ids is None and indices is None:  # the common case: sessions 0..n-1, distinct
            keys = [f"{uid}_{session_id}_0" for session_id in sessions]
        else:
            keys = []
            for session_id, index in zip(sessions, positions, strict=True):
                check_index(session_id, "session_id")
                check_index(index, "index")
                keys.append(f"{uid}_{session_id}_{index}")
            if len(set(keys)) != n:
                duplicate = next(key for key in keys if keys.count(key) > 1)
                raise DuplicateTrajectoryError(f"put_group for {uid!r} names trajectory {duplicate!r} twice")
        group = self._groups.get(uid)
        if group is not None:
            group = self._open_group(uid, "put a group into")
            if group.global_steps != global_steps or group.partition.name != partition:
                raise DuplicateGroupError(
                    f"group {uid!r} is already in the buffer with global_steps={group.global_steps}, "
                    f"partition={group.partition.name!r}; put_group got global_steps={global_steps}, "
                    f"partition={partition!r}"
                )
            for key in keys:
                if key in group.trajectories:
                    raise DuplicateTrajectoryError(f"group {uid!r} already holds trajectory {key!r}")
        # Everything is valid: from here on nothing raises, so the group lands whole.
        if group is None:
            self.add_prompt_nowait(uid, global_steps=global_steps, partition=partition, tags=group_tags)
            group = self._open_group(uid, "put a group into")
        group.trajectories.update(
            (key, new_trajectory(key, session_id, index, frozen_tags, payload))
            for key, session_id, index, frozen_tags, payload in zip(
                keys, sessions, positions, frozen, payloads, strict=True
            )
        )
        part = group.partition
        part.trajectories += n
        part.admitted_trajectories += n
        self._terminate(uid, Status.FINISHED if status == "finished" else Status.FAILURE)
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
        return uid in self._groups

    # -- consumer ---------------------------------------------------------------------

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
                int >= 1, ``partition`` not a non-empty str, or ``timeout`` not None or >= 0.
            TimeoutError: ``timeout`` seconds passed first; no sampleable group was removed.
            BufferClosedError: the buffer is or gets closed.
            BackendMismatchError: it may wait (``timeout != 0``) and runs under another async
                backend than the one the buffer is bound to; nothing changed.
            Exception: whatever ``on_evict`` raised, after the buffer state is consistent.
        """
        # Inlined fast checks; the helpers run (and raise) only when a value looks wrong.
        if type(global_steps) is not int or global_steps < 0:
            check_step(global_steps)
        if type(batch_size) is not int or batch_size < 1:
            check_batch_size(batch_size)
        if timeout is not None:
            timeout = check_timeout(timeout)
        part = self._partitions.get(partition) if type(partition) is str else None
        if part is None:
            check_partition(partition)
        self._check_open()
        backend = self._backend
        if backend is not None and timeout != 0:
            # A call that may wait needs the bound backend: refuse another one before anything
            # changes. (One with timeout=0 never touches the backend, so any caller may check.)
            self._check_backend(backend)
        if part is None:
            part = self._partition(partition)
        accumulated = SampleMetrics()
        if not part.waiters:
            groups = self._evaluate(part, global_steps, batch_size, accumulated)
            if groups is not None:
                return self._result(part, global_steps, groups, accumulated, 0.0)
        if timeout == 0:
            raise TimeoutError(f"no batch of {batch_size} ready in partition {partition!r}")
        if backend is None:
            token = anyio.lowlevel.current_token()
            backend = self._backend = token.backend_class
            self._on_asyncio = isinstance(token.native_token, asyncio.AbstractEventLoop)
        # The backend is the running one: just bound, or checked on entry.
        started = backend.current_time()
        waiter: Waiter = (
            FutureWaiter(global_steps, batch_size, asyncio.get_running_loop())
            if self._on_asyncio
            else EventWaiter(global_steps, batch_size, backend)
        )
        interval = self._status_log_interval
        logged_by_timer = interval is not None and self._on_asyncio
        if logged_by_timer:
            waiter.started = started
            waiter.log_due = started + interval  # type: ignore[operator]
            self._ensure_status_timer()
        part.waiters.append(waiter)  # from here on, the finally below must remove it
        try:
            if timeout is None and (interval is None or logged_by_timer):
                groups = await self._park_until_batch(part, waiter, accumulated)  # no deadline
            else:
                groups = await self._wait_with_deadlines(
                    part, waiter, accumulated, started, timeout, backend, not logged_by_timer
                )
        finally:
            waiters = part.waiters
            if waiters and waiters[0] is waiter:
                waiters.popleft()
                self._wake_head(part)  # pass the turn on, whether we succeeded or not
            elif waiter in waiters:  # not there if dropped as abandoned (its loop was closed)
                waiters.remove(waiter)
        wait_seconds = backend.current_time() - started
        return self._result(part, global_steps, groups, accumulated, wait_seconds)

    def sampleable_count(self, global_steps: int, partition: str = "train") -> int:
        """Return how many groups ``sample`` could select from right now; changes nothing.

        Counts ready groups after the drop and failure rules at ``global_steps``; ignores the
        wait gate and the batch size.

        Raises:
            TypeError, ValueError: ``global_steps`` is not an int >= 0 or ``partition`` is not
                a non-empty str.
        """
        check_step(global_steps)
        check_partition(partition)
        part = self._partitions.get(partition)
        if part is None:
            return 0
        count = part.ready_count
        if self._drop and not part.exempt:
            name = part.name
            count -= part.count_ready_while(lambda p: self._is_stale(global_steps, p, name))
        return count

    def stats(self) -> BufferStats:
        """Return an immutable snapshot of per-partition and total counts (works after close)."""
        partitions = {name: part.stats() for name, part in sorted(self._partitions.items())}
        total = PartitionStats()
        for item in partitions.values():
            total = total + item
        return BufferStats(closed=self._closed, partitions=MappingProxyType(partitions), total=total)

    # -- closing ----------------------------------------------------------------------

    def close(self) -> None:
        """Close the buffer: blocked and later ``sample`` calls and producers raise
        BufferClosedError. Groups already present stay (visible in ``stats()``). Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        for part in self._partitions.values():
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

    # -- hooks for custom samplers ----------------------------------------------------

    def _is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        """Decide whether a terminal group dispatched at ``dispatch_step`` is dropped at
        ``global_steps`` (drop strategy only; never called for exempt partitions).

        Override to change the eviction decision. It must be monotone: if a group is stale,
        every group dispatched earlier must be stale too, because the buffer asks about the
        oldest groups first and stops at the first fresh one. Default: ``s > threshold``.
        """
        return staleness.exceeds_drop(global_steps, dispatch_step, self._threshold, self._sync_step)

    def _must_wait_for(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        """Decide whether an in-flight group dispatched at ``dispatch_step`` must finish before
        a sample at ``global_steps`` may return (wait strategy only; never for exempt partitions).

        Override to change the wait gate. It must be monotone like :meth:`_is_stale`; only the
        oldest in-flight group is asked. Default: ``s >= threshold``.
        """
        return staleness.blocks_wait(global_steps, dispatch_step, self._threshold, self._sync_step)

    def _select(
        self, candidates: Iterator[Group], batch_size: int, global_steps: int, partition: str
    ) -> Sequence[Group]:
        """Choose which ``batch_size`` groups to return from ``candidates``.

        ``candidates`` yields the sampleable groups oldest first (ascending dispatch step,
        ties in ``add_prompt`` order), lazily; there are at least ``batch_size`` of them.
        Return exactly ``batch_size`` distinct groups taken from it, in the order the batch
        should have. The default takes the first ``batch_size``. Overriding this hook costs
        O(N) per sample (the buffer must then remove arbitrary groups).
        """
        selected: list[Group] = []
        for group in candidates:
            selected.append(group)
            if len(selected) == batch_size:
                break
        return selected

    # -- internals --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("the buffer is closed")

    def _partition(self, name: str) -> PartitionIndex:
        part = self._partitions.get(name)
        if part is None:
            part = PartitionIndex(
                name,
                exempt=name in self._config.exempt_partitions,
                evict_failures=self._config.failure_strategy == "evict",
            )
            self._partitions[name] = part
        return part

    @staticmethod
    def _check_backend(backend: type[AsyncBackend]) -> None:
        """Raise BackendMismatchError unless ``backend`` is the one running this call."""
        try:
            backend.current_time()
        except RuntimeError as exc:
            raise BackendMismatchError(
                f"this buffer is bound to {backend.__name__}, the backend of its first waiting "
                "sample; await it only under that backend"
            ) from exc

    def _open_group(self, uid: str, action: str) -> OpenGroup:
        """Return the in-flight group ``uid`` or raise the error a write to it deserves."""
        group = self._groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:
            raise self._not_open(uid, group, action)
        return group

    @staticmethod
    def _not_open(uid: object, group: OpenGroup | Group | None, action: str) -> Exception:
        """Build the error for a write to ``uid``, which is not an in-flight group."""
        if type(uid) is not str:
            return TypeError(f"uid must be a str, got {type(uid).__name__}")
        if group is None:
            return UnknownGroupError(
                f"no group {uid!r} in the buffer (never added, or already sampled or evicted)"
            )
        return InvalidTransitionError(
            f"cannot {action} group {uid!r}: it is already {group.status.value} (a late write)"
        )

    def _terminate(self, uid: str, status: Status) -> None:
        if self._closed:
            raise BufferClosedError("the buffer is closed")
        group = self._groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:
            raise self._not_open(uid, group, "mark finished" if status is Status.FINISHED else "mark failed")
        part = group.partition
        record = new_group(
            uid, part.name, group.global_steps, status, group.tags, tuple(group.trajectories.values())
        )
        self._groups[uid] = record
        part.terminate(group, record)
        if part.waiters:
            self._wake_head(part)

    def _gate_open(self, part: PartitionIndex, global_steps: int) -> bool:
        """The wait gate: no in-flight group the sample at ``global_steps`` must wait for."""
        if self._drop or part.exempt:
            return True
        oldest = part.oldest_in_flight()
        return oldest is None or not self._must_wait_for(global_steps, oldest, part.name)

    def _has_work_for(self, part: PartitionIndex, waiter: Waiter) -> bool:
        """Whether evaluating for ``waiter`` could return a batch or evict something.

        A necessary condition only (eviction can still leave too few groups), but every
        wake-up it allows either returns a batch or evicts at least one group.
        """
        if part.failed or self._oldest_is_stale(part, waiter.global_steps):
            return True
        return part.ready_count >= waiter.batch_size and self._gate_open(part, waiter.global_steps)

    def _oldest_is_stale(self, part: PartitionIndex, global_steps: int) -> bool:
        """Whether the drop rule evicts the partition's oldest ready group at ``global_steps``.

        Stale groups are a prefix of the ready order, so this decides if there is any.
        """
        return bool(
            self._drop
            and part.ready_count
            and not part.exempt
            and self._is_stale(global_steps, part.ready_steps[0], part.name)
        )

    def _wake_head(self, part: PartitionIndex) -> None:
        waiters = part.waiters
        while waiters and not self._closed:
            head = waiters[0]
            if head.abandoned():  # its event loop was closed under it: it will never run
                waiters.popleft()
                continue
            if self._has_work_for(part, head):
                head.wake()
            return

    def _evaluate(
        self, part: PartitionIndex, global_steps: int, batch_size: int, metrics: SampleMetrics
    ) -> list[Group] | None:
        """Evict what must go, then take a batch if one may be returned; else None.

        Eviction repeats until a round evicts nothing, because ``on_evict`` may finish or
        fail groups (a stale one must not slip into the batch; a failed one must not wait
        for an unrelated wake-up). When this returns, no state change is left unexamined.
        """
        self._evaluations += 1
        name = part.name
        while part.failed or self._oldest_is_stale(part, global_steps):
            events: list[EvictionEvent] = []
            if part.failed:
                failed = part.take_failed()
                metrics.failed_groups += len(failed)
                events.append(self._evicted(part, "failure", failed, global_steps))
            if self._oldest_is_stale(part, global_steps):
                stale = part.take_stale(lambda p: self._is_stale(global_steps, p, name))
                metrics.add_dropped(stale, global_steps)
                events.append(self._evicted(part, "stale", stale, global_steps))
            self._emit(events)
            self._check_open()  # on_evict may have closed the buffer
        if part.ready_count < batch_size or not self._gate_open(part, global_steps):
            return None
        if self._default_select:
            groups = part.take_oldest(batch_size)
        else:
            groups = self._custom_selection(part, global_steps, batch_size)
        groups_by_uid = self._groups
        for group in groups:
            del groups_by_uid[group.uid]
        return groups

    def _custom_selection(self, part: PartitionIndex, global_steps: int, batch_size: int) -> list[Group]:
        chosen = list(self._select(part.iter_ready(), batch_size, global_steps, part.name))
        ready = {id(group) for group in part.iter_ready()}
        if (
            len(chosen) != batch_size
            or len({id(group) for group in chosen}) != batch_size
            or not all(id(group) in ready for group in chosen)
        ):
            raise StalebufError(
                f"{type(self).__qualname__}._select must return {batch_size} distinct groups "
                f"taken from its candidates, got {len(chosen)}"
            )
        part.take(chosen)
        return chosen

    def _evicted(
        self, part: PartitionIndex, reason: str, groups: list[Group], global_steps: int
    ) -> EvictionEvent:
        """Unregister evicted ``groups`` and return the event that reports them."""
        groups_by_uid = self._groups
        for group in groups:
            del groups_by_uid[group.uid]
        return EvictionEvent(part.name, reason, tuple(groups), global_steps)  # type: ignore[arg-type]

    def _emit(self, events: list[EvictionEvent]) -> None:
        """Call ``on_evict`` for every event; re-raise the first error after all were called."""
        callback = self._on_evict
        if callback is None:
            return
        error: Exception | None = None
        for event in events:
            try:
                callback(event)
            except Exception as exc:
                if error is None:
                    error = exc
                else:
                    logger.exception("on_evict raised again while reporting %s", event.reason)
        if error is not None:
            raise error

    async def _wait_with_deadlines(
        self,
        part: PartitionIndex,
        waiter: Waiter,
        metrics: SampleMetrics,
        started: float,
        timeout: float | None,
        backend: type[AsyncBackend],
        log_here: bool,
    ) -> list[Group]:
        """Wait for ``waiter``'s batch under a cancel scope: raise at the timeout and, if
        ``log_here``, log a status line every interval (where no loop timer does it).

        One scope covers a whole status interval, not each park. A default ``sample`` on
        asyncio never comes here, so its wake-up enters and leaves no scope (that costs
        about as much as the rest of the wake-up).
        """
        deadline = math.inf if timeout is None else started + timeout
        interval = self._status_log_interval
        next_log = started + interval if log_here and interval is not None else math.inf
        while True:
            with anyio.CancelScope(deadline=min(deadline, next_log)):
                return await self._park_until_batch(part, waiter, metrics)
            # Only our own deadline ends the scope quietly; outside cancellation propagates.
            if backend.current_time() >= deadline:
                raise TimeoutError(
                    f"no batch of {waiter.batch_size} in partition {part.name!r} within {timeout} s"
                )
            self._log_waiting(part, waiter, next_log - started)
            next_log += interval  # type: ignore[operator]

    async def _park_until_batch(
        self, part: PartitionIndex, waiter: Waiter, metrics: SampleMetrics
    ) -> list[Group]:
        """Park until woken, then re-check; repeat until this waiter gets its batch."""
        while True:
            await waiter.parked()
            self._check_open()
            if part.waiters[0] is waiter:
                groups = self._evaluate(part, waiter.global_steps, waiter.batch_size, metrics)
                if groups is not None:
                    return groups
            waiter.arm()

    def _ensure_status_timer(self) -> None:
        """Make sure the buffer's status timer runs on the current asyncio loop.

        One timer per buffer, not per wait: it fires when the earliest waiter is due a
        status line and stops when no sample waits, so a wait costs no timer of its own.
        """
        loop = asyncio.get_running_loop()
        if self._status_timer is None or self._status_loop is not loop:
            self._status_loop = loop
            self._status_timer = loop.call_at(loop.time() + self._status_log_interval, self._status_tick)  # type: ignore[operator]

    def _status_tick(self) -> None:
        """Log a line for every waiter that is due one, then sleep until the next is due."""
        loop, interval = self._status_loop, self._status_log_interval
        if loop is None or interval is None:  # unreachable: both are set before scheduling
            return
        now = loop.time()
        next_due = math.inf
        for part in self._partitions.values():
            for waiter in part.waiters:
                if waiter.log_due <= now:
                    self._log_waiting(part, waiter, waiter.log_due - waiter.started)
                    while waiter.log_due <= now:
                        waiter.log_due += interval
                next_due = min(next_due, waiter.log_due)
        self._status_timer = None if next_due == math.inf else loop.call_at(next_due, self._status_tick)

    def _log_waiting(self, part: PartitionIndex, waiter: Waiter, waited: float) -> None:
        logger.info(
            "sample(global_steps=%d, batch_size=%d) on partition %r has waited %.0f s: "
            "pending=%d running=%d finished=%d failure=%d ready=%d oldest_in_flight_step=%s",
            waiter.global_steps,
            waiter.batch_size,
            part.name,
            waited,
            part.pending,
            part.running,
            part.finished,
            part.failure,
            part.ready_count,
            part.oldest_in_flight(),
        )

    def _result(
        self,
        part: PartitionIndex,
        global_steps: int,
        groups: list[Group],
        metrics: SampleMetrics,
        wait_seconds: float,
    ) -> tuple[Batch, dict[str, float]]:
        batch = new_batch(part.name, global_steps, tuple(groups), self._sync_step)
        return batch, metrics.render(part.name, groups, global_steps, self._sync_step, wait_seconds)
