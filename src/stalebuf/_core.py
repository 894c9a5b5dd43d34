"""The buffer's private state and the steps its public methods share.

:class:`BufferCore` holds the groups, partitions, rules, clocks and binding of a buffer, the
checks every public method shares, and the two state changes everything else builds on:
admitting a group and terminating it (which wakes the head waiting ``sample``). Admission
(``_admission.py``), sampling (``_sampling.py``) and the producers (``_producers.py``) build on
it, in that order; ``ReplayBuffer`` (``buffer.py``) is the public facade over them.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from threading import get_ident
from time import monotonic
from typing import Any

from . import _evaluation as rules_of
from ._partition import OpenGroup, PartitionState
from ._status_log import StatusLog, logger
from ._validation import (
    check_batch_size,
    check_partition,
    check_status_log_interval,
    check_step,
    describe,
    describe_typed,
)
from ._waiting import LoopBinding
from .config import SamplerConfig
from .errors import (
    BufferClosedError,
    ConfigError,
    GroupEvictedError,
    InvalidTransitionError,
    UnknownGroupError,
)
from .policy import StalenessPolicy, SubclassHooks
from .records import EvictionEvent, Group, Status
from .staleness import drop_span

__all__ = ["BufferCore", "EvictCallback"]

EvictCallback = Callable[[EvictionEvent], object]
_FINISHED, _FAILURE = Status.FINISHED, Status.FAILURE
_tuple_new = tuple.__new__


class BufferCore:
    """State and shared steps of a replay buffer (see ``ReplayBuffer`` for the public API)."""

    _config: SamplerConfig
    _policy: StalenessPolicy
    _rules: StalenessPolicy
    _plain_rules: bool
    _plain_admission: bool
    _admits_by_default: bool
    _stale_span: int
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
        # Types first: a policy of the wrong type must not be asked for its config.
        if policy is not None and not isinstance(policy, StalenessPolicy):
            raise ConfigError(f"policy must be a StalenessPolicy or None, got {type(policy).__name__}")
        if config is None:
            config = SamplerConfig() if policy is None else policy.config
        elif not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or None, got {type(config).__name__}")
        if policy is None:
            policy = StalenessPolicy(config)
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
        # Default rules are asked inline on the hot paths: the wake-up's, and put_group's.
        self._plain_rules = rules_of.asks_defaults(self._rules, ("is_stale", "must_wait_for", "select"))
        self._plain_admission = rules_of.asks_defaults(self._rules, ("admits", "is_stale"))
        # The default admits (the policy's, asked with the subclass's _is_stale if any): a tag the
        # monotone drop rule closes at the next sample then never opens again.
        self._admits_by_default = rules_of.asks_defaults(policy, ("admits",))
        # The default is_stale as one comparison: p < g + 1 - span (see staleness.drop_span).
        self._stale_span = drop_span(policy.threshold, policy.sync_step)
        # S as the policy has it: the rules and the staleness a batch reports must agree, even
        # for a policy built from another config than ``config``.
        self._sync_step = policy.sync_step
        self._on_evict = on_evict
        self._groups: dict[str, OpenGroup | Group] = {}
        self._partitions: dict[str, PartitionState] = {}
        self._next_seq = 0
        # The dispatch clock of each partition: the largest step a sample was called with.
        self._clocks: dict[str, int] = {}
        # uids evicted while in flight, most recent last, so a late producer learns why: None
        # for "stale", else the eviction's reason ("restart").
        self._evicted_in_flight: OrderedDict[str, str | None] = OrderedDict()
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
        thread = self._binding.thread
        if thread is not None and thread != get_ident():
            self._binding.check_thread()
        if self._closed:
            self._check_open()
        return part

    def _open_group(self, uid: str, action: str) -> OpenGroup:
        """Return the in-flight group ``uid`` or raise the error a write to it deserves."""
        group = self._groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:
            if type(uid) is not str:
                raise TypeError(f"uid must be a str, got {type(uid).__name__}")
            if group is None:
                if uid in self._evicted_in_flight:
                    how = "as stale" if self._evicted_in_flight[uid] is None else "by a restart"
                    raise GroupEvictedError(
                        f"group {describe(uid)} was evicted {how} while in flight: stop generating"
                    )
                raise UnknownGroupError(
                    f"no group {describe(uid)} in the buffer (never added, or already sampled or evicted)"
                )
            raise InvalidTransitionError(
                f"cannot {action} group {describe(uid)}: it is already {group.status.value} (a late write)"
            )
        return group

    def _partition(self, name: str) -> PartitionState:
        part = self._partitions.get(name)
        if part is None:
            rules = self._rules
            part = PartitionState(
                name,
                exempt=rules.is_exempt(name),
                evict_failures=rules.evicts_failures(name),
                evict_in_flight=rules.evicts_in_flight(name),
                cap=rules.admission_batch_size(name),
            )
            self._partitions[name] = part
        return part

    # -- producers ----------------------------------------------------------------------

    def _admit(self, uid: str, step: int, part: PartitionState, tags: Mapping[str, Any]) -> OpenGroup:
        """Register a new PENDING group (its arguments were checked, its slot granted)."""
        seq = self._next_seq
        self._next_seq = seq + 1
        group = self._groups[uid] = OpenGroup(uid, part, step, seq, tags, monotonic())
        part.admit(group)
        if self._evicted_in_flight:
            self._evicted_in_flight.pop(uid, None)  # a new group: forget the old eviction
        return group

    def _terminate(self, group: OpenGroup, status: Status) -> None:
        part = group.partition
        step = group.dispatch_step
        record = _tuple_new(  # records.new_group, without the call
            Group,
            (
                group.uid,
                part.name,
                step,
                status,
                group.tags,
                tuple(group.trajectories.values()),
                max(self._clocks.get(part.name, 0), step),  # not before its dispatch
                monotonic() - group.admitted_at,
            ),
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
        waiters = part.waiters
        if self._closed or not waiters:
            return
        head = waiters[0]
        if head.abandoned():  # its loop was closed under it: the next live waiter is the head
            part.drop_abandoned()
            if not waiters:
                return
            head = waiters[0]
        rules = self._rules
        if self._plain_rules and not part.failed and not part.evict_in_flight:
            # rules_of.has_work_for with the default rules asked inline (the common case).
            ready = part.ready
            steps = head.global_steps
            if (
                ready.count >= head.batch_size
                and (rules.drops or part.exempt or rules_of.gate_open(rules, part, steps))
            ) or (  # a batch may be returned, or the oldest group is stale (work to do)
                ready.count
                and rules.drops
                and not part.exempt
                and ready.steps[0] < steps + 1 - self._stale_span  # the oldest is stale
            ):
                head.wake()
            return
        try:
            wake = rules_of.has_work_for(rules, part, head)
        except Exception:
            logger.exception("a staleness policy hook raised while checking a waiting sample")
            wake = True
        if wake:
            head.wake()

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
