"""Per-``sample`` metrics, with verl-compatible names."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .records import Group
from .staleness import age as staleness_age

__all__ = ["SampleMetrics", "metric_prefix"]


def metric_prefix(partition: str) -> str:
    """Return "training" for the "train" partition and "validation" for any other."""
    return "training" if partition == "train" else "validation"


_KEYS: dict[str, tuple[str, ...]] = {}


def _keys(prefix: str) -> tuple[str, ...]:
    keys = _KEYS.get(prefix)
    if keys is None:  # built once per prefix: f-strings on every sample add up
        dropped = f"{prefix}/off_policy/dropped_samples_staleness"
        sampled = f"{prefix}/off_policy/sampled_staleness"
        keys = _KEYS[prefix] = (
            f"{prefix}/off_policy/dropped_samples",
            f"{prefix}/off_policy/dropped_groups",
            f"{dropped}/mean",
            f"{dropped}/max",
            f"{dropped}/min",
            f"{prefix}/rollout_failure/evicted_groups",
            f"{sampled}/mean",
            f"{sampled}/max",
            f"{sampled}/min",
            f"{prefix}/off_policy/wait_seconds",
        )
    return keys


class SampleMetrics:
    """Accumulates what one ``sample`` call evicted, over all of its wake-ups.

    Staleness is tracked as integer ages ``g - p + 1`` and divided by the sync step
    only when the metrics are rendered, so sums stay exact. The counters start as class
    attributes, so a call that evicts nothing never pays for initialising them.
    """

    dropped_groups = 0
    dropped_samples = 0
    failed_groups = 0
    group_age_sum = 0
    group_age_max = 0
    group_age_min = 0
    sample_age_sum = 0
    sample_age_max = 0
    sample_age_min = 0

    def add_dropped(self, groups: Iterable[Group], global_steps: int) -> None:
        """Count groups evicted as stale at ``global_steps``."""
        for group in groups:
            age = staleness_age(global_steps, group.dispatch_step)
            n = len(group.trajectories)
            if self.dropped_groups == 0:
                self.group_age_max = self.group_age_min = age
            else:
                self.group_age_max = max(self.group_age_max, age)
                self.group_age_min = min(self.group_age_min, age)
            self.dropped_groups += 1
            self.group_age_sum += age
            if n:
                if self.dropped_samples == 0:
                    self.sample_age_max = self.sample_age_min = age
                else:
                    self.sample_age_max = max(self.sample_age_max, age)
                    self.sample_age_min = min(self.sample_age_min, age)
                self.dropped_samples += n
                self.sample_age_sum += age * n

    def render(
        self,
        partition: str,
        sampled: Sequence[Group],
        global_steps: int,
        sync_step: int,
        wait_seconds: float,
    ) -> dict[str, float]:
        """Return the metrics dict for a call that returned ``sampled`` at ``global_steps``."""
        (
            dropped_samples,
            dropped_groups,
            dropped_mean,
            dropped_max,
            dropped_min,
            failed_groups,
            sampled_mean,
            sampled_max,
            sampled_min,
            wait_key,
        ) = _keys(metric_prefix(partition))
        metrics: dict[str, float] = {}
        if self.dropped_groups:
            metrics[dropped_samples] = float(self.dropped_samples)
            metrics[dropped_groups] = float(self.dropped_groups)
            if self.dropped_samples:
                total, count = self.sample_age_sum, self.dropped_samples
                high, low = self.sample_age_max, self.sample_age_min
            else:  # only empty groups were dropped: report their staleness instead
                total, count = self.group_age_sum, self.dropped_groups
                high, low = self.group_age_max, self.group_age_min
            metrics[dropped_mean] = total / count / sync_step
            metrics[dropped_max] = high / sync_step
            metrics[dropped_min] = low / sync_step
        if self.failed_groups:
            metrics[failed_groups] = float(self.failed_groups)
        # Builtins over a list beat numpy's per-call overhead at batch sizes up to thousands.
        steps = [group.dispatch_step for group in sampled]
        origin = global_steps + 1
        metrics[sampled_mean] = (origin - sum(steps) / len(steps)) / sync_step
        metrics[sampled_max] = (origin - min(steps)) / sync_step
        metrics[sampled_min] = (origin - max(steps)) / sync_step
        metrics[wait_key] = float(wait_seconds)
        return metrics
