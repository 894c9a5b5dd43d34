"""Per-``sample`` metrics, with verl-compatible names (and a few of our own).

Two namings (``SamplerConfig.metric_names``): "default", this library's keys, and "verl-0.9",
where the eviction counts take the names verl main reports since verl #7082. The second is one
table, :data:`VERL_09_NAMES`, applied to the default keys once per partition, not per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce
from itertools import repeat
from operator import add, attrgetter, mul
from typing import NamedTuple

from ._stored import stored_trajectories
from .records import Group
from .staleness import age as staleness_age

__all__ = ["NAMINGS", "VERL_09_NAMES", "SampleMetrics", "metric_name", "metric_prefix"]

#: verl main's name (``trainer/ppo/v1/replay_buffer.py``) for each default key that has one, both
#: after the partition's prefix ("training/", "validation/"). verl counts evicted *groups* under
#: ``evicted_samples`` and takes the evicted staleness over groups; so does the "verl-0.9" naming.
VERL_09_NAMES: dict[str, str] = {
    "off_policy/dropped_groups": "off_policy/evicted_samples",
    "off_policy/dropped_samples_staleness/mean": "off_policy/evicted_samples_staleness/mean",
    "off_policy/dropped_samples_staleness/max": "off_policy/evicted_samples_staleness/max",
    "off_policy/dropped_samples_staleness/min": "off_policy/evicted_samples_staleness/min",
    "rollout_failure/evicted_groups": "rollout_failure/evicted_samples",
    # (Groups a filter evicted are filter_groups/evicted_samples in both namings: verl's name.)
}
#: Each ``SamplerConfig.metric_names`` value: the renaming it applies to the default keys.
NAMINGS: dict[str, dict[str, str]] = {"default": {}, "verl-0.9": VERL_09_NAMES}


def metric_prefix(partition: str) -> str:
    """Return "training" for the "train" partition and "validation" for any other."""
    return "training" if partition == "train" else "validation"


def metric_name(key: str, naming: str) -> str:
    """Return what ``naming`` calls the default metric ``key`` (``"{prefix}/..."``).

    Raises:
        KeyError: ``naming`` is not one of :data:`NAMINGS`.
    """
    prefix, _, rest = key.partition("/")
    renamed = NAMINGS[naming].get(rest)
    return key if renamed is None else f"{prefix}/{renamed}"


class _Keys(NamedTuple):
    dropped_samples: str
    dropped_groups: str
    dropped_mean: str
    dropped_max: str
    dropped_min: str
    dropped_seconds: str
    evicted_in_flight: str
    failed_groups: str
    sampled_mean: str
    sampled_max: str
    sampled_min: str
    generation_steps: str
    queue_steps: str
    generation_seconds: str
    wait: str
    free_slots: str
    producer_wait: str
    # The dropped staleness over groups (verl's) instead of over trajectories.
    dropped_over_groups: bool


_KEYS: dict[tuple[str, str], _Keys] = {}
#: The keys by naming, then partition name: two dict lookups per sample instead of calls.
_PARTITION_KEYS: dict[str, dict[str, _Keys]] = {naming: {} for naming in NAMINGS}
_dispatch_step_of = attrgetter("dispatch_step")
_finish_step_of = attrgetter("finish_step")
_generation_seconds_of = attrgetter("generation_seconds")


def _keys(prefix: str, naming: str) -> _Keys:
    keys = _KEYS.get((prefix, naming))
    if keys is None:  # built once per prefix and naming: f-strings on every sample add up
        default = _default_keys(prefix)
        renamed = {
            field: metric_name(key, naming) for field, key in default._asdict().items() if type(key) is str
        }
        keys = _KEYS[prefix, naming] = default._replace(**renamed, dropped_over_groups=naming != "default")
    return keys


def _default_keys(prefix: str) -> _Keys:
    off = f"{prefix}/off_policy"
    return _Keys(
        dropped_samples=f"{off}/dropped_samples",
        dropped_groups=f"{off}/dropped_groups",
        dropped_mean=f"{off}/dropped_samples_staleness/mean",
        dropped_max=f"{off}/dropped_samples_staleness/max",
        dropped_min=f"{off}/dropped_samples_staleness/min",
        dropped_seconds=f"{off}/dropped_generation_seconds/mean",
        evicted_in_flight=f"{off}/evicted_in_flight_groups",
        failed_groups=f"{prefix}/rollout_failure/evicted_groups",
        sampled_mean=f"{off}/sampled_staleness/mean",
        sampled_max=f"{off}/sampled_staleness/max",
        sampled_min=f"{off}/sampled_staleness/min",
        generation_steps=f"{off}/sampled_generation_steps/mean",
        queue_steps=f"{off}/sampled_queue_steps/mean",
        generation_seconds=f"{off}/sampled_generation_seconds/mean",
        wait=f"{off}/wait_seconds",
        free_slots=f"{prefix}/admission/free_slots",
        producer_wait=f"{prefix}/admission/producer_wait_seconds",
        dropped_over_groups=False,
    )


class SampleMetrics:
    """Accumulates what one ``sample`` call evicted, over all of its wake-ups.

    Staleness is tracked as integer ages ``g - p + 1`` and divided by the sync step
    only when the metrics are rendered, so sums stay exact. The counters start as class
    attributes, so a call that evicts nothing never pays for initialising them.
    """

    dropped_groups = 0
    dropped_samples = 0
    dropped_seconds = 0.0
    in_flight_groups = 0
    failed_groups = 0
    group_age_sum = 0
    group_age_max = 0
    group_age_min = 0
    sample_age_sum = 0
    sample_age_max = 0
    sample_age_min = 0
    # Set when the batch is the oldest groups in order (ascending dispatch step), as the default
    # selection takes them: the first and last groups then hold the extreme steps.
    oldest_first = False
    # A sample by tokens: its budget (None for a count of groups), and once its batch is taken,
    # the batch's tokens and whether its one group alone was over the budget (0 or 1).
    token_budget: int | None = None
    batch_tokens = 0
    oversized_groups = 0

    def add_dropped(self, groups: Sequence[Group], global_steps: int) -> None:
        """Count groups evicted as stale at ``global_steps``."""
        if not groups:
            return
        # Aggregated with C-level maps, not a Python loop per group: drop eviction may hand over
        # thousands of groups at once.
        ages = list(map(staleness_age, repeat(global_steps), map(_dispatch_step_of, groups)))
        counts = list(map(len, map(stored_trajectories, groups)))  # records not built
        low, high = min(ages), max(ages)
        if self.dropped_groups:
            low, high = min(low, self.group_age_min), max(high, self.group_age_max)
        self.group_age_min, self.group_age_max = low, high
        self.dropped_groups += len(groups)
        self.group_age_sum += sum(ages)
        # Added one by one, in order, as a loop would: sum() of floats is compensated on 3.12+.
        self.dropped_seconds = reduce(add, map(_generation_seconds_of, groups), self.dropped_seconds)
        samples = sum(counts)
        if samples:
            held = [a for a, n in zip(ages, counts, strict=True) if n]
            low, high = min(held), max(held)
            if self.dropped_samples:
                low, high = min(low, self.sample_age_min), max(high, self.sample_age_max)
            self.sample_age_min, self.sample_age_max = low, high
            self.dropped_samples += samples
            self.sample_age_sum += sum(map(mul, ages, counts))

    def render(
        self,
        partition: str,
        sampled: Sequence[Group],
        global_steps: int,
        sync_step: int,
        wait_seconds: float,
        admission: tuple[float, float] | None = None,
        naming: str = "default",
    ) -> dict[str, float]:
        """Return the metrics dict for a call that returned ``sampled`` at ``global_steps``;
        ``admission`` is ``(free_slots, producer_wait_seconds)`` on a partition with admission;
        ``naming`` is the config's ``metric_names``.

        Raises:
            KeyError: ``naming`` is not one of :data:`NAMINGS`.
        """
        by_partition = _PARTITION_KEYS[naming]
        keys = by_partition.get(partition)
        if keys is None:
            keys = by_partition[partition] = _keys(metric_prefix(partition), naming)
        # Builtins over a list beat numpy's per-call overhead at batch sizes up to thousands.
        n = len(sampled)
        if self.oldest_first:
            low, high = sampled[0].dispatch_step, sampled[-1].dispatch_step
            dispatched = low * n if low == high else sum(map(_dispatch_step_of, sampled))
        else:
            steps = list(map(_dispatch_step_of, sampled))
            low, high, dispatched = min(steps), max(steps), sum(steps)
        stale_sum = dispatched  # the staleness counts a group dispatched after this step (a journal
        if high > global_steps:  # recovered at an earlier one) as fresh; the step counts do not
            steps = [min(step, global_steps) for step in map(_dispatch_step_of, sampled)]
            low, high, stale_sum = min(steps), max(steps), sum(steps)
        finished = sum(map(_finish_step_of, sampled))
        origin = global_steps + 1
        # One dict display: the common call evicted nothing, and this is all it returns. The means
        # divide exact int differences once (steps near 2**63 lose nothing in float64).
        metrics = {
            keys.sampled_mean: (origin * n - stale_sum) / (n * sync_step),
            keys.sampled_max: (origin - low) / sync_step,
            keys.sampled_min: (origin - high) / sync_step,
            keys.generation_steps: (finished - dispatched) / n,
            keys.queue_steps: (global_steps * n - finished) / n,
            keys.generation_seconds: sum(map(_generation_seconds_of, sampled)) / n,
            keys.wait: float(wait_seconds),
        }
        if self.dropped_groups or self.in_flight_groups or self.failed_groups:
            metrics = self._evictions(keys, sync_step) | metrics  # the eviction keys stay first
        if admission is not None:
            metrics[keys.free_slots] = float(admission[0])
            metrics[keys.producer_wait] = float(admission[1])
        return metrics

    def _evictions(self, keys: _Keys, sync_step: int) -> dict[str, float]:
        """The metrics of what the call evicted."""
        metrics: dict[str, float] = {}
        if self.dropped_groups:
            metrics[keys.dropped_samples] = float(self.dropped_samples)
            metrics[keys.dropped_groups] = float(self.dropped_groups)
            if self.dropped_samples and not keys.dropped_over_groups:
                total, count = self.sample_age_sum, self.dropped_samples
                high, low = self.sample_age_max, self.sample_age_min
            else:  # verl's naming, or only empty groups were dropped: over the groups
                total, count = self.group_age_sum, self.dropped_groups
                high, low = self.group_age_max, self.group_age_min
            metrics[keys.dropped_mean] = total / count / sync_step
            metrics[keys.dropped_max] = high / sync_step
            metrics[keys.dropped_min] = low / sync_step
            metrics[keys.dropped_seconds] = self.dropped_seconds / self.dropped_groups
        if self.in_flight_groups:
            metrics[keys.evicted_in_flight] = float(self.in_flight_groups)
        if self.failed_groups:
            metrics[keys.failed_groups] = float(self.failed_groups)
        return metrics
