"""The rule book as a buffer asks it: the policy's answers, with one fast path for the default.

:class:`Rules` is built once per buffer from its :class:`~stalebuf.policy.StalenessPolicy` (and
a verl-style subclass's ``_is_stale``/``_must_wait_for``/``_select`` hooks). Every question
the buffer asks about staleness, the wait gate, selection or admission goes through one of
its methods. When the policy leaves a rule as written, the method answers it inline with the
integer comparison of :mod:`stalebuf.staleness` (the same answer, without a Python call per
question); this module is the only place that does. Every method only *reads*: it may raise
(a policy hook's error), so the buffer asks first and changes state after.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._judged_index import JudgedEntry
from ._partition import BY_DISPATCH, BY_HEAD, BY_TAIL, PartitionState
from ._validation import describe, describe_typed, is_finite_number
from .config import SamplerConfig
from .errors import StalebufError
from .filters import GroupFilter, zero_variance
from .policy import RuleHooks, StalenessPolicy, SubclassHooks, asks_defaults, hook_label, select_label
from .records import Group, Status
from .staleness import drop_span

__all__ = ["NEEDS_RULES", "NO_BATCH", "OLDEST_BATCH", "Refusal", "Rules"]

_MISSING = object()

#: The readiness rule's admission input: ``refuses(part, global_steps)`` (see token_batch_ready).
Refusal = Callable[[PartitionState, int], bool]

#: :meth:`Rules.quick_verdict`'s answers.
NEEDS_RULES, NO_BATCH, OLDEST_BATCH = -1, 0, 1

# The default selection takes the first batch_size candidates: its answer needs no check.
_DEFAULT_SELECT = StalenessPolicy.select


class Rules:
    """One buffer's rule book: ``policy`` (the subclass's hooks in front of it, if any) plus
    the flags that say which rules are the defaults, asked once when the buffer is built.

    Attributes:
        base: the policy the buffer was given (``ReplayBuffer.policy``).
        policy: what the buffer asks: ``base``, or the subclass's hooks in front of it.
        config: the buffer's config (a checkpoint keeps it; the policy's may differ).
        threshold, sync_step, drops, masks: the policy's (S is the policy's: the rules and
            the staleness a batch reports must agree, even for a policy of another config).
        evicts: whether ``sample`` evicts stale ready groups (``drop`` or ``mask``).
        filters: the group filters run on every group that finishes (non-exempt partitions).
        judge: which version ready groups are judged by (``_partition.BY_*``): the head under
            ``drop``, the tail under ``mask``; under ``wait`` none is evicted as stale.
    """

    __slots__ = (
        "_quotas",
        "admits_by_default",
        "base",
        "borrows",
        "config",
        "drops",
        "evicts",
        "filters",
        "judge",
        "masks",
        "mixture_tag",
        "plain",
        "plain_admission",
        "policy",
        "span",
        "sync_step",
        "tasks",
        "threshold",
    )

    def __init__(
        self,
        base: StalenessPolicy,
        hooks: RuleHooks | None,
        config: SamplerConfig,
        filters: tuple[Callable[[Group], object], ...] = (),
    ) -> None:
        self.base = base
        # The group filters, in order: the config's filter_groups_metric (verl's DAPO filter)
        # first, then the buffer's own.
        metric = config.filter_groups_metric
        self.filters: tuple[GroupFilter, ...] = (
            filters if metric is None else (zero_variance(metric), *filters)
        )
        self.policy = base if hooks is None else SubclassHooks(base, hooks)
        self.config = config
        self.threshold = base.threshold
        self.sync_step = base.sync_step
        self.drops = base.drops
        self.masks = base.masks
        self.evicts = base.drops or base.masks
        self.judge = BY_TAIL if base.masks else BY_HEAD if base.drops else BY_DISPATCH
        # The default is_stale as one comparison: p < g + 1 - span (see staleness.drop_span).
        self.span = drop_span(base.threshold, base.sync_step)
        self.plain = asks_defaults(self.policy, ("is_stale", "must_wait_for", "select"))
        self.plain_admission = asks_defaults(self.policy, ("admits", "is_stale"))
        # The default admits (asked with a subclass's _is_stale, if any): a tag the monotone
        # drop rule closes at the next sample then never opens again.
        self.admits_by_default = asks_defaults(base, ("admits",))
        # The task mixture: its tasks (sorted), the tag naming a group's task, the policy
        # ("wait" or "borrow") and each partition's quotas by batch size (asked once each).
        mixture = config.mixture
        self.tasks: tuple[str, ...] = () if mixture is None else tuple(mixture)
        self.mixture_tag = config.mixture_tag
        self.borrows = config.mixture_policy == "borrow"
        self._quotas: dict[tuple[str, int], dict[str, int]] = {}

    # -- per partition, asked once ------------------------------------------------------

    def settings(self, name: str) -> tuple[bool, bool, bool, int | None, bool]:
        """Return ``(exempt, evicts_failures, evicts_in_flight, admission cap, deadlines)`` for a
        new partition ``name`` (deadlines: whether its groups may ever be cut).

        Raises:
            Exception: whatever a policy hook raised.
        """
        policy, config = self.policy, self.config
        exempt = bool(policy.is_exempt(name))
        # The policy's own group_deadline (``base``: a subclass's hooks in front of it always
        # define one, which only passes the question on).
        deadlines = not exempt and (
            config.group_deadline_seconds is not None
            or config.group_deadline_factor is not None
            or not asks_defaults(self.base, ("group_deadline",))
        )
        return (
            exempt,
            bool(policy.evicts_failures(name)),
            bool(policy.evicts_in_flight(name)),
            self.admission_cap(name, exempt),
            deadlines,
        )

    # -- task mixtures ------------------------------------------------------------------

    def task_of(self, tags: Mapping[str, Any]) -> str:
        """The task a new group with ``tags`` belongs to, under the mixture.

        Raises:
            ValueError: its tag ``mixture_tag`` is missing or names no task of the mixture.
        """
        tag = self.mixture_tag
        task = tags.get(tag, _MISSING)
        if task is _MISSING:
            raise ValueError(
                f"the group has no tag {describe(tag)}: under a task mixture every group of a non-exempt "
                f"partition names its task, one of {describe(list(self.tasks))}"
            )
        if type(task) is not str or task not in self.tasks:
            raise ValueError(
                f"the group's tag {describe(tag)} is {describe(task)}, not a task of the mixture "
                f"({describe(list(self.tasks))})"
            )
        return task

    def cell_settings(self, name: str, task: str, cap: int | None) -> tuple[int | None, int | None, int]:
        """``(admission cap, threshold, span)`` of ``task``'s cell in partition ``name``, whose
        own cap is ``cap`` (``q_task(cap)``: its quota of the per-step cap).

        Raises:
            StalebufError: the policy's ``task_threshold`` or ``task_quotas`` answered nonsense.
            Exception: whatever those hooks raised.
        """
        threshold = self.policy.task_threshold(name, task)
        if threshold is not None and (type(threshold) is not int or threshold < 1):
            raise StalebufError(
                f"{hook_label(self.policy, 'task_threshold')}({describe(name)}, {describe(task)}) must "
                f"return None or an int >= 1, got {describe_typed(threshold)}"
            )
        task_cap = None if cap is None else self.quotas(name, cap)[task]
        return task_cap, threshold, drop_span(threshold, self.sync_step)

    def quotas(self, name: str, batch_size: int) -> dict[str, int]:
        """Each task's quota of a batch of ``batch_size`` in partition ``name`` (cached).

        Raises:
            StalebufError: the policy's ``task_quotas`` did not answer one int >= 0 per task,
                summing to ``batch_size``.
            Exception: whatever the hook raised.
        """
        cached = self._quotas.get((name, batch_size))
        if cached is not None:
            return cached
        answer = self.policy.task_quotas(name, batch_size)
        if (
            not isinstance(answer, Mapping)
            or set(answer) != set(self.tasks)
            or not all(type(quota) is int and quota >= 0 for quota in answer.values())
            or sum(answer.values()) != batch_size
        ):
            raise StalebufError(
                f"{hook_label(self.policy, 'task_quotas')}({describe(name)}, {batch_size}) must return one "
                f"int >= 0 per task, summing to {batch_size}, got {describe_typed(answer)}"
            )
        quotas = self._quotas[name, batch_size] = dict(answer)
        return quotas

    def check_batch_quotas(self, name: str, batch_size: int, part: PartitionState | None) -> None:
        """Refuse a batch size that gives a task of partition ``name``'s mixture no group
        (``part``: the partition, None if unused).

        Raises:
            ValueError: some task's quota of ``batch_size`` is 0 (it would starve silently).
            StalebufError, Exception: what :meth:`quotas` (or ``is_exempt``) raises.
        """
        mixed = part.cells is not None if part is not None else not self.policy.is_exempt(name)
        if not mixed:
            return
        starved = [task for task, quota in self.quotas(name, batch_size).items() if not quota]
        if starved:
            raise ValueError(
                f"batch_size={batch_size} gives the task(s) {describe(starved)} of partition "
                f"{describe(name)} a quota of 0 (largest remainder on the mixture's weights): they would "
                "starve silently; use a larger batch"
            )

    def admission_cap(self, name: str, exempt: bool | None = None) -> int | None:
        """The per-dispatch-step cap ``b`` of partition ``name``, or None (no admission control).
        An exempt partition is never gated, whatever the policy answers (``exempt``: whether it
        is, if known; else the policy is asked).

        Raises:
            StalebufError: the policy's ``admission_batch_size`` answered something other than
                None or an int >= 1 (0, -1, NaN or "3" would make producers wait forever or
                ``capacity()`` lie).
            Exception: whatever that hook (or ``is_exempt``) raised.
        """
        if exempt is None:
            exempt = bool(self.policy.is_exempt(name))
        if exempt:
            return None
        cap = self.policy.admission_batch_size(name)
        if cap is None or (type(cap) is int and 1 <= cap < 1 << 63):
            return cap
        if isinstance(cap, numbers.Integral) and not isinstance(cap, bool) and 1 <= int(cap) < 1 << 63:
            return int(cap)  # numpy's integers, say
        raise StalebufError(
            f"{hook_label(self.policy, 'admission_batch_size')}({describe(name)}) must return None or an "
            f"int >= 1 (below 2**63), got {describe_typed(cap)}"
        )

    # -- deadlines ----------------------------------------------------------------------

    def deadline(self, part: PartitionState) -> float | None:
        """The deadline of ``part``'s in-flight groups in seconds (the policy's
        ``group_deadline``), or None for none now.

        Raises:
            StalebufError: the hook answered something other than None or a finite real number
                > 0 (numpy's numbers are real numbers).
            Exception: whatever the hook raised.
        """
        seconds = self.policy.group_deadline(part.name, part.median_generation())
        if seconds is None or (type(seconds) is float and 0 < seconds < math.inf):
            return seconds
        if is_finite_number(seconds) and seconds > 0:
            return float(seconds)
        if isinstance(seconds, numbers.Real) and not isinstance(seconds, bool):
            # numpy's floats and ints, a Fraction: a number of seconds all the same
            with contextlib.suppress(ArithmeticError, TypeError, ValueError):
                value = float(seconds)
                if 0 < value < math.inf:
                    return value
        raise StalebufError(
            f"{hook_label(self.policy, 'group_deadline')}({describe(part.name)}, ...) must return None "
            f"or a finite number > 0, got {describe_typed(seconds)}"
        )

    def cut_status(self, part: PartitionState, trajectories: int) -> Status:
        """What a group of ``part`` cut with ``trajectories`` becomes (FINISHED or FAILURE).

        Raises:
            StalebufError: the policy's ``cut_status`` answered another value.
            Exception: whatever the hook raised.
        """
        status = self.policy.cut_status(part.name, trajectories)
        if status is Status.FINISHED or status is Status.FAILURE:
            return status
        raise StalebufError(
            f"{hook_label(self.policy, 'cut_status')}({describe(part.name)}, {trajectories}) must return "
            f"Status.FINISHED or Status.FAILURE, got {describe_typed(status)}"
        )

    # -- drop -------------------------------------------------------------------------

    def is_stale(self, global_steps: int, dispatch_step: int, part: PartitionState) -> bool:
        """Whether a terminal group of ``part`` judged by version ``dispatch_step`` (its
        dispatch step without versions) is dropped at ``global_steps`` (``part.span``: its
        task's ``T*S``)."""
        if self.plain:
            return dispatch_step < global_steps + 1 - part.span
        return self.policy.is_stale(global_steps, dispatch_step, part.name)

    def stale_steps(self, part: PartitionState, global_steps: int) -> list[int]:
        """The dispatch steps, oldest first, whose ready groups the drop rule evicts now (none
        while the partition judges some group by another version: see :meth:`stale_judged`)."""
        if not self.evicts or part.exempt or not part.ready.count or part.judged is not None:
            return []
        if self.plain:
            return part.ready.steps_before(global_steps + 1 - part.span)
        policy, name = self.policy, part.name
        if not policy.is_stale(global_steps, part.ready.oldest_step(), name):
            return []
        return part.ready.stale_steps(lambda step: policy.is_stale(global_steps, step, name))

    def stale_judged(self, part: PartitionState, global_steps: int) -> list[JudgedEntry]:
        """The ready groups the rule evicts now, by the version each is judged by (its head
        under ``drop``, its tail under ``mask``), while the partition keeps a judged index."""
        judged = part.judged
        if judged is None or not self.evicts or part.exempt:
            return []
        if self.plain:
            cutoff = global_steps + 1 - part.span
            return judged.stale(cutoff.__gt__)
        policy, name = self.policy, part.name
        return judged.stale(lambda version: policy.is_stale(global_steps, version, name))

    def stale_in_flight_steps(self, part: PartitionState, global_steps: int) -> list[int]:
        """The heads, oldest first, of the in-flight groups no later sample could return (only
        with in-flight eviction): the drop rule already holds for them."""
        if not part.evict_in_flight:
            return []
        return part.in_flight.stale_steps(lambda step: self.is_stale(global_steps, step, part))

    def count_fresh(self, part: PartitionState, global_steps: int) -> int:
        """How many ready groups of ``part`` the drop rule keeps at ``global_steps``."""
        if not self.evicts or part.exempt:
            return part.ready.count
        if part.judged is not None:
            return part.ready.count - len(self.stale_judged(part, global_steps))
        return part.ready.count_fresh(lambda step: self.is_stale(global_steps, step, part))

    # -- the wait gate and selection ------------------------------------------------------

    def gate_open(self, part: PartitionState, global_steps: int) -> bool:
        """The wait gate: no in-flight group (by its head) the sample at ``global_steps`` must
        wait for."""
        if self.evicts or part.exempt:
            return True
        oldest = part.in_flight.oldest()
        if oldest is None:
            return True
        if self.plain:  # staleness.blocks_wait: age >= T*S
            return global_steps - oldest + 1 < part.span
        return not self.policy.must_wait_for(global_steps, oldest, part.name)

    def quick_verdict(self, part: PartitionState, global_steps: int, batch_size: int) -> int:
        """The common case of an evaluation, answered inline: :data:`NO_BATCH` or
        :data:`OLDEST_BATCH` when the default rules hold and nothing is to be evicted, else
        :data:`NEEDS_RULES` (ask :meth:`stale_steps` and :meth:`choose_batch`)."""
        if not self.plain or part.failed or part.evict_in_flight or part.judged is not None:
            return NEEDS_RULES
        ready = part.ready
        if self.evicts and not part.exempt and ready.count and ready.steps[0] < global_steps + 1 - part.span:
            return NEEDS_RULES  # the oldest is stale: eviction to do
        if ready.count < batch_size or not self.gate_open(part, global_steps):
            return NO_BATCH
        return OLDEST_BATCH

    def has_work_for(self, part: PartitionState, global_steps: int, batch_size: int) -> bool:
        """Whether evaluating a sample at ``global_steps`` could return a batch or evict
        something. A necessary condition only (eviction can still leave too few groups), but
        every wake-up it allows either returns a batch or evicts at least one group.

        Raises:
            Exception: whatever a policy hook raised.
        """
        ready = part.ready
        if self.plain and not part.failed and not part.evict_in_flight and part.judged is None:
            if ready.count >= batch_size and self.gate_open(part, global_steps):
                return True
            return bool(
                ready.count
                and self.evicts
                and not part.exempt
                and ready.steps[0] < global_steps + 1 - part.span  # the oldest is stale
            )
        if part.failed or (
            self.evicts
            and ready.count
            and not part.exempt
            and self.is_stale(global_steps, part.oldest_judged(), part)
        ):
            return True
        if part.evict_in_flight:
            oldest = part.in_flight.oldest()
            if oldest is not None and self.is_stale(global_steps, oldest, part):
                return True
        return ready.count >= batch_size and self.gate_open(part, global_steps)

    def token_batch_ready(
        self, part: PartitionState, global_steps: int, budget: int, refuses: Refusal
    ) -> bool:
        """The readiness rule of a sample of ``budget`` tokens, asked after eviction (the ready
        groups are then the sampleable ones): the wait gate is open, a group is sampleable, and
        their tokens reach ``budget``, or waiting cannot bring more: admission refuses a
        clock-tagged group at tag ``max(clock, global_steps)`` now (``refuses``) and no group
        this sample could still train is in flight. O(1), or O(in-flight steps) when short.

        Not at the refusal alone: producers fill the clock's step the moment it moves, so every
        sample took whatever had finished once the gate opened (43% of the budget on average at
        T=4; docs: Token budgets). Waiting only gets later (the bound holds) and cannot deadlock.

        Raises:
            Exception: whatever a policy hook raised.
        """
        if not part.ready.count or not self.gate_open(part, global_steps):
            return False
        if part.ready_tokens >= budget or not refuses(part, global_steps):
            return part.ready_tokens >= budget
        newest = max(part.in_flight.groups, default=None)  # trainable: head >= g + 1 - T*S
        return newest is None or newest < global_steps + 1 - part.span

    def choose_batch(
        self, part: PartitionState, global_steps: int, batch_size: int
    ) -> tuple[list[Group] | None, bool]:
        """Ask the policy which groups to return; return ``(chosen, oldest)``.

        ``chosen`` is None when no batch may be returned yet; ``oldest`` says the chosen groups
        are the ``batch_size`` oldest in order (so they can be taken in O(batch_size)).

        Raises:
            StalebufError: the policy returned something other than ``batch_size`` distinct
                groups from its candidates.
            Exception: whatever a policy hook raised.
        """
        ready = part.ready
        if ready.count < batch_size or not self.gate_open(part, global_steps):
            return None, False
        select = self.policy.select
        chosen = list(select(ready.iter_groups(), batch_size, global_steps, part.name))
        if (getattr(select, "__func__", None) is _DEFAULT_SELECT and len(chosen) == batch_size) or (
            len(chosen) == batch_size and ready.is_oldest(chosen)
        ):
            return chosen, True
        self._check_selection(chosen, ready.iter_groups(), batch_size)
        return chosen, False

    def _check_selection(self, chosen: list[Group], candidates: Iterable[Group], batch_size: int) -> None:
        ready = {id(group) for group in candidates}
        if (
            len(chosen) != batch_size
            or len({id(group) for group in chosen}) != batch_size
            or not all(id(group) in ready for group in chosen)
        ):
            raise StalebufError(
                f"{select_label(self.policy)} must return {batch_size} distinct groups "
                f"taken from its candidates, got {len(chosen)}"
            )

    # -- admission --------------------------------------------------------------------

    def admits(
        self, tag: int, resident_at_tag: int, last_sampled: int, cap: int, name: str, span: int
    ) -> bool:
        """Whether one more group may be admitted at dispatch step ``tag`` (the policy's
        ``admits``; the default inline: below the cap, and not stale at the next sample;
        ``span``: the ``T*S`` of the group's partition or task).

        Raises:
            Exception: whatever a policy hook raised.
        """
        if self.plain_admission:  # not is_stale(last_sampled + 1, tag)
            return resident_at_tag < cap and tag >= last_sampled + 2 - span
        return self.policy.admits(tag, resident_at_tag, last_sampled, cap, name)

    def closed_for_good(self, name: str, tag: int, last_sampled: int, span: int) -> bool:
        """Whether no slot at ``tag`` can ever open: the default admission rule refuses a tag
        that is stale at the next sample, and the drop rule is monotone while sample steps only
        grow. (A custom ``admits`` may reopen anything: never closed for good then.)

        Raises:
            Exception: whatever the policy's ``is_stale`` raised.
        """
        if not self.admits_by_default:
            return False
        if self.plain_admission:
            return tag < last_sampled + 2 - span
        return self.policy.is_stale(last_sampled + 1, tag, name)

    def capacity(self, cap: int | None, threshold: int | None = None) -> int | None:
        """The bound on resident groups under a per-step cap ``cap``: ``T * S * cap`` (``T``:
        ``threshold``, a task's, else the policy's; None without a threshold: no tag ever
        closes, so nothing bounds residency)."""
        if threshold is None:
            threshold = self.threshold
        if cap is None or threshold is None:
            return None
        return cap * threshold * self.sync_step
