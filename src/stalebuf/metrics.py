"""Per-``sample`` metrics, with verl-compatible names."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .records import Group

__all__ = ["SampleMetrics", "metric_prefix"]


def metric_prefix(partition: str) -> str:
    """Return "training" for the "train" partition and "validation" for any other."""
    return "training" if partition == "train" else "validation"


class SampleMetrics:
    """Accumulates what one ``sample`` call evicted, over all of its wake-ups.

    Staleness is tracked as integer ages ``g - p + 1`` and divided by the sync step
    only when the metrics are rendered, so sums stay exact.
    """

    __slots__ = (
        "dropped_groups",
        "dropped_samples",
        "failed_groups",
        "group_age_max",
        "group_age_min",
        "group_age_sum",
        "sample_age_max",
        "sample_age_min",
        "sample_age_sum",
    )

    def __init__(self) -> None:
        self.dropped_groups = 0
        self.dropped_samples = 0
        self.failed_groups = 0
        self.group_age_sum = 0
        self.group_age_max = 0
        self.group_age_min = 0
        self.sample_age_sum = 0
        self.sample_age_max = 0
        self.sample_age_min = 0

    def add_dropped(self, groups: Iterable[Group], global_steps: int) -> None:
        """Count groups evicted as stale at ``global_steps``."""
        for group in groups:
            age = global_steps - group.global_steps + 1
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
        prefix = metric_prefix(partition)
        metrics: dict[str, float] = {}
        if self.dropped_groups:
            key = f"{prefix}/off_policy/dropped_samples_staleness"
            metrics[f"{prefix}/off_policy/dropped_samples"] = float(self.dropped_samples)
            metrics[f"{prefix}/off_policy/dropped_groups"] = float(self.dropped_groups)
            if self.dropped_samples:
                total, count = self.sample_age_sum, self.dropped_samples
                high, low = self.sample_age_max, self.sample_age_min
            else:  # only empty groups were dropped: report their staleness instead
                total, count = self.group_age_sum, self.dropped_groups
                high, low = self.group_age_max, self.group_age_min
            metrics[f"{key}/mean"] = total / count / sync_step
            metrics[f"{key}/max"] = high / sync_step
            metrics[f"{key}/min"] = low / sync_step
        if self.failed_groups:
            metrics[f"{prefix}/rollout_failure/evicted_groups"] = float(self.failed_groups)
        # Builtins over a list beat numpy's per-call overhead at batch sizes up to thousands.
        steps = [group.global_steps for group in sampled]
        origin = global_steps + 1
        metrics[f"{prefix}/off_policy/sampled_staleness/mean"] = (
            origin - sum(steps) / len(steps)
        ) / sync_step
        metrics[f"{prefix}/off_policy/sampled_staleness/max"] = (origin - min(steps)) / sync_step
        metrics[f"{prefix}/off_policy/sampled_staleness/min"] = (origin - max(steps)) / sync_step
        metrics[f"{prefix}/off_policy/wait_seconds"] = float(wait_seconds)
        return metrics
