"""The rule book: every staleness, wait, selection, failure and exemption decision.

The buffer asks only a :class:`StalenessPolicy`; it holds no rule of its own. Pass one as
``ReplayBuffer(config, policy=...)``, name a subclass in ``SamplerConfig.custom_sampler``,
or (as verl plugins do) subclass ``ReplayBuffer`` and override ``_is_stale``,
``_must_wait_for`` or ``_select``: those hooks are routed through the same rule book.

Cost model. The buffer asks :meth:`~StalenessPolicy.is_stale` and
:meth:`~StalenessPolicy.must_wait_for` about the oldest groups only, so both must be
*monotone* in the dispatch step (if a group is stale, every group dispatched earlier is
stale too). ``is_stale`` must also be monotone in ``global_steps`` (a group stale at one step
is stale at every later one): sample steps only grow, so the buffer evicts in-flight groups
no later sample could return, and refuses an explicit admission tag that can never reopen.
:meth:`~StalenessPolicy.select` reads its candidates lazily, oldest first:
taking the first ``batch_size`` of them (the default) costs O(batch_size); returning any
other groups makes the buffer remove them from anywhere in its index, which costs O(N) for
N ready groups in the partition.

The methods below are the rules as written; the buffer asks them through ``_rules.Rules``,
which answers ``is_stale``/``must_wait_for``/``select``/``admits`` inline when a policy leaves
them as they are (checked once, when a buffer is built): the same answers, without a Python
call per question. Override any of them and the buffer asks your method instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Protocol

from . import staleness
from ._quotas import normalised, quotas
from .config import SamplerConfig
from .errors import ConfigError
from .records import Group, Status

__all__ = [
    "RuleHooks",
    "StalenessPolicy",
    "SubclassHooks",
    "asks_defaults",
    "hook_label",
    "overridden_select",
    "select_label",
]


class StalenessPolicy:
    """The default rules, read from a :class:`~stalebuf.SamplerConfig`.

    - drop (``max_off_policy_strategy="drop"``): a terminal group is evicted when the
      staleness of its **head** (its oldest token's version; its dispatch step without
      versions) exceeds the threshold, ``s > T``;
    - wait: a ``sample`` may not return while an in-flight group's head has ``s >= T``;
    - mask: a terminal group is evicted only when its **tail** (its newest token's version) is
      stale: not one of its tokens could be trained; the others are returned with their stale
      tokens masked (a token of version ``v`` sampled at ``g`` is fresh iff ``g - v + 1 <=
      T*S``), and a trajectory all of whose tokens are stale is kept out of the loss;
    - failed groups are sampleable (``failure_strategy="sample"``) or evicted ("evict");
    - exempt partitions (``exempt_partitions``) have no eviction and no wait gate;
    - group deadlines (``group_deadline_seconds``/``group_deadline_factor``) cut a straggler,
      which is finished (``group_quorum``) or failed.

    Subclass it and override any method to change a rule; keep the monotonicity the module
    docs describe. A subclass named by ``custom_sampler`` is built as
    ``cls(config, **config.sampler_kwargs)``.

    Raises:
        ConfigError: if ``config`` is not a SamplerConfig.
    """

    def __init__(self, config: SamplerConfig | None = None) -> None:
        if config is None:
            config = SamplerConfig()
        elif not isinstance(config, SamplerConfig):
            raise ConfigError(f"config must be a SamplerConfig or None, got {type(config).__name__}")
        self.config = config
        self.threshold = config.max_off_policy_threshold
        self.sync_step = config.parameter_sync_step
        self.drops = config.max_off_policy_strategy == "drop"
        self.masks = config.max_off_policy_strategy == "mask"

    def is_exempt(self, partition: str) -> bool:
        """Whether ``partition`` is exempt: nothing in it is evicted and no wait gate applies.

        Asked once per partition, when it is first used.
        """
        return partition in self.config.exempt_partitions

    def evicts_failures(self, partition: str) -> bool:
        """Whether failed groups of (non-exempt) ``partition`` are evicted instead of sampled.

        Asked once per partition, when it is first used.
        """
        return self.config.failure_strategy == "evict"

    def admission_batch_size(self, partition: str) -> int | None:
        """The per-dispatch-step cap ``b`` of ``partition``'s admission control, or None for no
        admission control (always None for exempt partitions). Asked once per partition."""
        return None if self.is_exempt(partition) else self.config.admission_batch_size

    def evicts_in_flight(self, partition: str) -> bool:
        """Whether ``sample`` also evicts stale PENDING/RUNNING groups of ``partition`` (drop with
        ``evict_stale_in_flight``, never exempt partitions). Asked once per partition."""
        return self.drops and self.config.evict_stale_in_flight and not self.is_exempt(partition)

    def admits(self, tag: int, resident_at_tag: int, last_sampled: int, cap: int, partition: str) -> bool:
        """Whether one more group may be admitted at dispatch step ``tag``.

        ``resident_at_tag`` groups tagged ``tag`` are resident; ``last_sampled`` is the largest
        step a ``sample`` on the partition returned a batch at (-1 before any). Default: fewer
        than ``cap`` resident at the tag, and a group tagged ``tag`` could still be trained
        fresh enough by the next sample (not ``is_stale(last_sampled + 1, tag)``) — which, with
        ``T*S == 1``, closes tag ``c`` once ``sample(c)`` has returned.
        """
        return resident_at_tag < cap and not self.is_stale(last_sampled + 1, tag, partition)

    def group_deadline(self, partition: str, median_generation_seconds: float | None) -> float | None:
        """The deadline of ``partition``'s in-flight groups, in seconds from admission (or from a
        restore that kept or reissued them), or None: no deadline now. A group past it is cut
        when a ``sample`` evaluates the partition. ``median_generation_seconds`` is the rolling
        median generation time of the partition's last 256 groups seen in flight that finished
        uncut (None before 16 have). Default: never for exempt partitions; else
        ``group_deadline_seconds``, or ``group_deadline_factor`` times the median (none while
        the median is 0: groups that finish within one tick of a coarse clock measure 0 s, and
        a deadline of 0 would cut every group)."""
        config = self.config
        if self.is_exempt(partition):
            return None
        if config.group_deadline_seconds is not None:
            return float(config.group_deadline_seconds)
        if config.group_deadline_factor is not None and median_generation_seconds:
            return float(config.group_deadline_factor) * median_generation_seconds
        return None

    def cut_status(self, partition: str, trajectories: int) -> Status:
        """What a group cut at its deadline holding ``trajectories`` becomes: Status.FINISHED
        (trained with what it has) or Status.FAILURE (then ``failure_strategy`` applies).
        Default: FINISHED with at least ``group_quorum`` trajectories, else FAILURE."""
        quorum = self.config.group_quorum
        return Status.FINISHED if quorum is not None and trajectories >= quorum else Status.FAILURE

    def task_threshold(self, partition: str, task: str) -> int | None:
        """The threshold T of the groups of ``task`` in (non-exempt) ``partition`` under a task
        mixture. Default: ``task_thresholds[task]``, else ``max_off_policy_threshold``. Asked
        once per task, when its partition is first used."""
        return self.config.task_thresholds.get(task, self.threshold)

    def task_quotas(self, partition: str, batch_size: int) -> dict[str, int]:
        """How many of ``batch_size`` groups each task of the mixture contributes to a batch of
        (non-exempt) ``partition``, and how many each admits per dispatch step under admission
        control (``batch_size`` = ``admission_batch_size``). Default: the largest-remainder
        method on the normalised weights, in exact rational arithmetic, equal remainders to the
        task whose name sorts first; the quotas sum to ``batch_size``. Must not depend on
        anything but its arguments (a partition's quotas are cached per batch size)."""
        mixture = self.config.mixture
        if mixture is None:
            return {}
        return quotas(normalised(mixture), batch_size)

    def is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        """Whether a terminal group judged by version ``dispatch_step`` is evicted by a sample
        at ``global_steps`` (asked under "drop" about a group's head, under "mask" about its
        tail, and by the default ``admits`` about a dispatch step; never for exempt
        partitions). Without versions every group is judged by its dispatch step. Must be
        monotone in both steps (see the module docs). Default: ``s > threshold``."""
        return staleness.exceeds_drop(global_steps, dispatch_step, self.threshold, self.sync_step)

    def must_wait_for(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        """Whether an in-flight group whose head is ``dispatch_step`` (its oldest token's
        version, or its start version; its dispatch step without versions) must finish before
        a sample at ``global_steps`` may return (asked only under "wait", never for exempt
        partitions, and only about the oldest head in flight). Must be monotone. Default:
        ``s >= threshold``."""
        return staleness.blocks_wait(global_steps, dispatch_step, self.threshold, self.sync_step)

    def select(
        self, candidates: Iterator[Group], batch_size: int, global_steps: int, partition: str
    ) -> Sequence[Group]:
        """Choose the ``batch_size`` groups a sample returns, in batch order.

        ``candidates`` yields the sampleable groups oldest first (ascending dispatch step,
        ties in ``add_prompt`` order), lazily; there are at least ``batch_size``. Return
        exactly ``batch_size`` distinct groups taken from it. The default takes the first
        ``batch_size``: O(batch_size). Any other choice costs O(N) (see the module docs).
        """
        return list(islice(candidates, batch_size))


class RuleHooks(Protocol):
    """The protected hooks a ``ReplayBuffer`` subclass may override (verl-style plugins)."""

    def _is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool: ...

    def _must_wait_for(self, global_steps: int, dispatch_step: int, partition: str) -> bool: ...

    def _select(
        self, candidates: Iterator[Group], batch_size: int, global_steps: int, partition: str
    ) -> Sequence[Group]: ...


class SubclassHooks(StalenessPolicy):
    """The rule book of a ``ReplayBuffer`` subclass that overrides ``_is_stale``,
    ``_must_wait_for`` or ``_select``: those hooks answer, ``base`` answers the rest.

    (The buffer's default hooks call ``base``, so a hook calling ``super()`` reaches it.)
    """

    def __init__(self, base: StalenessPolicy, owner: RuleHooks) -> None:
        # Not StalenessPolicy.__init__: ``base`` may be a subclass with state of its own.
        self.config, self.threshold, self.sync_step, self.drops, self.masks = (
            base.config,
            base.threshold,
            base.sync_step,
            base.drops,
            base.masks,
        )
        self.base = base
        self.owner = owner

    def is_exempt(self, partition: str) -> bool:
        return self.base.is_exempt(partition)

    def evicts_failures(self, partition: str) -> bool:
        return self.base.evicts_failures(partition)

    def admission_batch_size(self, partition: str) -> int | None:
        return self.base.admission_batch_size(partition)

    def evicts_in_flight(self, partition: str) -> bool:
        return self.base.evicts_in_flight(partition)

    def group_deadline(self, partition: str, median_generation_seconds: float | None) -> float | None:
        return self.base.group_deadline(partition, median_generation_seconds)

    def cut_status(self, partition: str, trajectories: int) -> Status:
        return self.base.cut_status(partition, trajectories)

    def task_threshold(self, partition: str, task: str) -> int | None:
        return self.base.task_threshold(partition, task)

    def task_quotas(self, partition: str, batch_size: int) -> dict[str, int]:
        return self.base.task_quotas(partition, batch_size)

    def admits(self, tag: int, resident_at_tag: int, last_sampled: int, cap: int, partition: str) -> bool:
        if type(self.base).admits is not StalenessPolicy.admits:
            return self.base.admits(tag, resident_at_tag, last_sampled, cap, partition)
        # The default rule, asked through the subclass's own _is_stale.
        return StalenessPolicy.admits(self, tag, resident_at_tag, last_sampled, cap, partition)

    def is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        return self.owner._is_stale(global_steps, dispatch_step, partition)

    def must_wait_for(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        return self.owner._must_wait_for(global_steps, dispatch_step, partition)

    def select(
        self, candidates: Iterator[Group], batch_size: int, global_steps: int, partition: str
    ) -> Sequence[Group]:
        return self.owner._select(candidates, batch_size, global_steps, partition)


def asks_defaults(rules: StalenessPolicy, hooks: tuple[str, ...]) -> bool:
    """Whether ``rules`` answers every one of ``hooks`` (names of StalenessPolicy methods) with
    the default code, neither overridden nor replaced on the instance."""
    kind, own = type(rules), vars(rules)
    return all(getattr(kind, hook) is getattr(StalenessPolicy, hook) and hook not in own for hook in hooks)


def hook_label(rules: StalenessPolicy, hook: str) -> str:
    """Name the method ``rules`` runs for ``hook`` (a StalenessPolicy method), for error messages."""
    if isinstance(rules, SubclassHooks):
        rules = rules.base
    return f"{type(rules).__qualname__}.{hook}"


def select_label(rules: StalenessPolicy) -> str:
    """Name the selection hook that ``rules`` runs, for error messages."""
    if isinstance(rules, SubclassHooks):
        return f"{type(rules.owner).__qualname__}._select"
    return f"{type(rules).__qualname__}.select"


def overridden_select(rules: StalenessPolicy) -> str | None:
    """Name the selection ``rules`` runs when it is not the default rule (the oldest first): an
    overridden ``select``, or a ``ReplayBuffer`` subclass's own ``_select``; else None."""
    if isinstance(rules, SubclassHooks):
        # The buffer's own _select asks ``base``: only a subclass that defines one overrides it.
        if sum("_select" in vars(kind) for kind in type(rules.owner).__mro__) > 1:
            return select_label(rules)
        rules = rules.base
    return None if asks_defaults(rules, ("select",)) else hook_label(rules, "select")
