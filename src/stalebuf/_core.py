"""The buffer's private state and the steps its public methods share.

:class:`BufferCore` holds the groups, partitions, rules and binding of a buffer and does the
state changes: terminating a group and waking the head waiter, evaluating a partition
(evict, then gate and select), reporting evictions, leaving the waiting queue.
``ReplayBuffer`` is the public facade over it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from . import _evaluation as rules_of
from ._partition import OpenGroup, PartitionState
from ._status_log import StatusLog, log_waiting, logger, next_due
from ._validation import (
    check_batch_size,
    check_partition,
    check_status_log_interval,
    check_step,
    describe_typed,
)
from ._waiting import LoopBinding, Waiter, park, park_with_deadline
from .config import SamplerConfig
from .errors import (
    BufferClosedError,
    ConfigError,
    InvalidTransitionError,
    StalebufError,
    UnknownGroupError,
)
from .metrics import SampleMetrics
from .policy import StalenessPolicy, SubclassHooks
from .records import Batch, EvictionEvent, Group, Status, new_batch, new_group

__all__ = ["BufferCore", "EvictCallback"]

EvictCallback = Callable[[EvictionEvent], object]
_FINISHED, _FAILURE = Status.FINISHED, Status.FAILURE


class BufferCore:
    """State and shared steps of a replay buffer (see ``ReplayBuffer`` for the public API)."""

    _config: SamplerConfig
    _policy: StalenessPolicy
    _rules: StalenessPolicy
    _sync_step: int
    _on_evict: EvictCallback | None
    _groups: dict[str, OpenGroup | Group]
    _partitions: dict[str, PartitionState]
    _next_seq: int
    _closed: bool
    _binding: LoopBinding
    _status_interval: float | None
    _status_log: StatusLog | None
    _evaluations: int

    def __init__(
        self,
        config: SamplerConfig | None,
        policy: StalenessPolicy | None,
        on_evict: EvictCallback | None,
        status_log_interval: float | None,
    ) -> None:
        """Check the constructor's arguments (see ``ReplayBuffer``) and set up empty state."""
        if config is None:
            config = SamplerConfig() if policy is None else policy.config
        elif not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or None, got {type(config).__name__}")
        if policy is None:
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
        overridden = any(getattr(type(self), hook) is not getattr(BufferCore, hook) for hook in hooks)
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

    # -- checks -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("the buffer is closed")

    def _check_usable(self) -> None:
        """Raise unless a producer may change the buffer now: on the right thread, and open.

        Producers inline the cheap test (closed, or bound to another thread) and call this
        only when it holds: the common case costs one ``get_ident()`` comparison.
        """
        self._binding.check_thread()
        if self._closed:
            raise BufferClosedError("the buffer is closed")

    def _check_sample(
        self, global_steps: object, batch_size: object, partition: object
    ) -> PartitionState | None:
        """Validate a sample's arguments; return its partition (None if it does not exist yet)."""
        # Inlined fast checks; the helpers run (and raise) only when a value looks wrong.
        if type(global_steps) is not int or not 0 <= global_steps < 1 << 63:
            check_step(global_steps)
        if type(batch_size) is not int or not 1 <= batch_size < 1 << 63:
            check_batch_size(batch_size)
        part = self._partitions.get(partition) if type(partition) is str else None
        if part is None:
            check_partition(partition)
        self._binding.check_thread()
        self._check_open()
        return part

    def _open_group(self, uid: str, action: str) -> OpenGroup:
        """Return the in-flight group ``uid`` or raise the error a write to it deserves."""
        group = self._groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:
            if type(uid) is not str:
                raise TypeError(f"uid must be a str, got {type(uid).__name__}")
            if group is None:
                raise UnknownGroupError(
                    f"no group {uid!r} in the buffer (never added, or already sampled or evicted)"
                )
            raise InvalidTransitionError(
                f"cannot {action} group {uid!r}: it is already {group.status.value} (a late write)"
            )
        return group

    def _partition(self, name: str) -> PartitionState:
        part = self._partitions.get(name)
        if part is None:
            rules = self._rules
            exempt = rules.is_exempt(name)
            part = PartitionState(name, exempt=exempt, evict_failures=rules.evicts_failures(name))
            self._partitions[name] = part
        return part

    # -- producers ----------------------------------------------------------------------

    def _admit(self, uid: str, step: int, part: PartitionState, tags: Mapping[str, Any]) -> OpenGroup:
        """Register a new PENDING group (its arguments were checked)."""
        seq = self._next_seq
        self._next_seq = seq + 1
        group = self._groups[uid] = OpenGroup(uid, part, step, seq, tags)
        part.admit(step)
        return group

    def _terminate(self, group: OpenGroup, status: Status) -> None:
        part = group.partition
        record = new_group(
            group.uid, part.name, group.dispatch_step, status, group.tags, tuple(group.trajectories.values())
        )
        self._groups[group.uid] = record
        part.terminate(group, record)
        if part.waiters:
            self._wake_head(part)

    def _wake_head(self, part: PartitionState) -> None:
        """Wake the partition's head waiter if it may now get a batch or evict something.

        Runs on a producer's path after its state change: a policy hook that raises here must
        not turn the completed call into an error, so the error is logged and the waiter
        woken, to raise it from its own ``sample``.
        """
        if self._closed:
            return
        self._drop_abandoned(part)
        if not part.waiters:
            return
        head = part.waiters[0]
        try:
            wake = rules_of.has_work_for(self._rules, part, head)
        except Exception:
            logger.exception("a staleness policy hook raised while checking a waiting sample")
            wake = True
        if wake:
            head.wake()

    # -- sampling -----------------------------------------------------------------------

    def _evaluate(
        self, part: PartitionState, global_steps: int, batch_size: int, metrics: SampleMetrics
    ) -> list[Group] | None:
        """Evict what must go, then take a batch if one may be returned; else None.

        Eviction repeats until a round evicts nothing, because ``on_evict`` may finish or
        fail groups (a stale one must not slip into the batch; a failed one must not wait
        for an unrelated wake-up). Each step asks the rules first and changes state after.
        """
        self._evaluations += 1
        rules = self._rules
        readmitted_from, evicted_before = -1, frozenset[str]()
        while True:
            stale = rules_of.stale_steps(rules, part, global_steps)
            if not stale and not part.failed:
                break
            if evicted_before:
                self._check_not_readmitted(part, stale, readmitted_from, evicted_before)
            events: list[EvictionEvent] = []
            if part.failed:
                failed = part.take_failed()
                metrics.failed_groups += len(failed)
                events.append(self._evicted(part, "failure", failed, global_steps))
            if stale:
                dropped = part.take_stale(stale)
                metrics.add_dropped(dropped, global_steps)
                events.append(self._evicted(part, "stale", dropped, global_steps))
            readmitted_from = self._next_seq
            evicted_before = frozenset(group.uid for event in events for group in event.groups)
            self._emit(events)
            self._check_open()  # on_evict may have closed the buffer
        chosen, oldest = rules_of.choose_batch(rules, part, global_steps, batch_size)
        if chosen is None:
            return None
        groups = part.take_sampled(None if oldest else chosen, batch_size)
        groups_by_uid = self._groups
        for group in groups:
            del groups_by_uid[group.uid]
        return groups

    @staticmethod
    def _check_not_readmitted(
        part: PartitionState, stale: list[int], readmitted_from: int, evicted_before: frozenset[str]
    ) -> None:
        """Refuse a round that would evict exactly what ``on_evict`` re-admitted in the round
        before (same uids, added since): it would loop forever. They stay in the buffer."""
        buckets = part.ready.buckets
        entries = [entry for step in stale for entry in buckets[step].entries[buckets[step].head :]]
        entries += [(seq, group) for _, seq, group in part.failed]
        if all(seq >= readmitted_from and group.uid in evicted_before for seq, group in entries):
            raise StalebufError(
                f"on_evict re-admitted groups of partition {part.name!r} that are evicted again at once "
                "(stale at their dispatch step, or failed under failure_strategy='evict'), so sample "
                "would never finish; they stay in the buffer. Re-admit at the current step instead."
            )

    def _evicted(
        self, part: PartitionState, reason: str, groups: list[Group], global_steps: int
    ) -> EvictionEvent:
        """Unregister evicted ``groups`` and return the event that reports them."""
        groups_by_uid = self._groups
        for group in groups:
            del groups_by_uid[group.uid]
        return EvictionEvent(part.name, reason, tuple(groups), global_steps)  # type: ignore[arg-type]

    def _emit(self, events: list[EvictionEvent]) -> None:
        """Call ``on_evict`` for every event; re-raise the first error after all were called.

        BaseExceptions (KeyboardInterrupt, cancellation) too: every evicted group was counted,
        so every event is delivered before anything propagates.
        """
        callback = self._on_evict
        if callback is None:
            return
        error: BaseException | None = None
        for event in events:
            try:
                callback(event)
            except BaseException as exc:
                if error is None:
                    error = exc
                else:
                    logger.exception("on_evict raised again while reporting %s", event.reason)
        if error is not None:
            raise error

    def _result(
        self,
        part: PartitionState,
        global_steps: int,
        groups: list[Group],
        metrics: SampleMetrics,
        wait_seconds: float,
    ) -> tuple[Batch, dict[str, float]]:
        batch = new_batch(part.name, global_steps, tuple(groups), self._sync_step)
        return batch, metrics.render(part.name, groups, global_steps, self._sync_step, wait_seconds)

    # -- waiting ------------------------------------------------------------------------

    @staticmethod
    def _drop_abandoned(part: PartitionState) -> None:
        """Forget waiters whose event loop was closed under them: they will never run."""
        waiters = part.waiters
        if waiters and any(waiter.abandoned() for waiter in waiters):
            part.waiters = type(waiters)(waiter for waiter in waiters if not waiter.abandoned())

    def _has_live_waiter(self, part: PartitionState) -> bool:
        if not part.waiters:
            return False
        self._drop_abandoned(part)
        return bool(part.waiters)

    def _leave(self, part: PartitionState, waiter: Waiter) -> None:
        """Take ``waiter`` out of its queue; if it was the head, pass the turn on."""
        waiters = part.waiters
        if waiters and waiters[0] is waiter:
            waiters.popleft()
            self._wake_head(part)  # whether we succeeded or not
        elif waiter in waiters:  # not there if dropped as abandoned
            waiters.remove(waiter)

    async def _wait_for_batch(
        self,
        part: PartitionState,
        global_steps: int,
        batch_size: int,
        timeout: float | None,
        metrics: SampleMetrics,
    ) -> tuple[list[Group], float]:
        """Park in ``part``'s queue until a batch may be taken; return it and the seconds waited.

        Raises:
            TimeoutError: ``timeout`` passed first.
            BufferClosedError: the buffer was closed meanwhile.
        """
        binding = self._binding
        backend = binding.bind()
        started = backend.current_time()
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
        return groups, backend.current_time() - started

    async def _park_with_deadlines(
        self,
        part: PartitionState,
        waiter: Waiter,
        attempt: Callable[[], list[Group] | None],
        started: float,
        timeout: float | None,
        timer_logs: bool,
    ) -> list[Group]:
        """Park under a deadline: raise TimeoutError at ``timeout`` and, where no loop timer
        does it, log a status line every interval."""
        backend = self._binding.backend
        assert backend is not None  # bound before any wait
        interval = self._status_interval
        deadline = math.inf if timeout is None else started + timeout
        next_log = math.inf if timer_logs or interval is None else started + interval

        def log_line(now: float) -> float:
            nonlocal next_log
            log_waiting(part, waiter, next_log - started)
            next_log = next_due(next_log, now, interval)  # type: ignore[arg-type]
            return next_log

        groups = await park_with_deadline(waiter, attempt, backend, deadline, log_line, next_log)
        if groups is None:
            raise TimeoutError(
                f"no batch of {waiter.batch_size} in partition {part.name!r} within {timeout} s"
            )
        return groups

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
