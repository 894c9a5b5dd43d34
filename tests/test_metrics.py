"""SampleMetrics against a plain loop: the aggregation of dropped groups, over several rounds;
and the metric namings (``SamplerConfig.metric_names``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _helpers import add_group, make, sample_now
from stalebuf import Group, Status
from stalebuf.config import METRIC_NAMINGS
from stalebuf.metrics import NAMINGS, VERL_09_NAMES, SampleMetrics, metric_name
from stalebuf.records import EMPTY_TAGS, new_group, new_trajectory

FIELDS = (
    "dropped_groups",
    "dropped_samples",
    "dropped_seconds",
    "group_age_sum",
    "group_age_max",
    "group_age_min",
    "sample_age_sum",
    "sample_age_max",
    "sample_age_min",
)


class LoopMetrics:
    """The straightforward per-group loop the aggregation must agree with, to the last bit."""

    def __init__(self) -> None:
        self.dropped_groups = self.dropped_samples = 0
        self.dropped_seconds = 0.0
        self.group_age_sum = self.group_age_max = self.group_age_min = 0
        self.sample_age_sum = self.sample_age_max = self.sample_age_min = 0

    def add_dropped(self, groups: list[Group], global_steps: int) -> None:
        for group in groups:
            age = global_steps - group.dispatch_step + 1
            n = len(group.trajectories)
            if self.dropped_groups == 0:
                self.group_age_max = self.group_age_min = age
            else:
                self.group_age_max = max(self.group_age_max, age)
                self.group_age_min = min(self.group_age_min, age)
            self.dropped_groups += 1
            self.group_age_sum += age
            self.dropped_seconds += group.generation_seconds
            if n:
                if self.dropped_samples == 0:
                    self.sample_age_max = self.sample_age_min = age
                else:
                    self.sample_age_max = max(self.sample_age_max, age)
                    self.sample_age_min = min(self.sample_age_min, age)
                self.dropped_samples += n
                self.sample_age_sum += age * n


def _group(i: int, step: int, size: int, seconds: float) -> Group:
    trajectories = tuple(new_trajectory(f"g{i}_{s}_0", s, 0, EMPTY_TAGS, None) for s in range(size))
    return new_group(f"g{i}", "train", step, Status.FINISHED, EMPTY_TAGS, trajectories, step, seconds)


rounds = st.lists(  # one list of (dispatch step, trajectories, seconds) per eviction round
    st.lists(
        st.tuples(
            st.integers(0, 2**62),
            st.integers(0, 3),
            st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
        ),
        max_size=6,
    ),
    max_size=4,
)


@given(rounds, st.integers(0, 2**62))
def test_add_dropped_agrees_with_a_loop_over_groups(
    rounds: list[list[tuple[int, int, float]]], g: int
) -> None:
    fast, loop = SampleMetrics(), LoopMetrics()
    i = 0
    for spec in rounds:
        groups = []
        for step, size, seconds in spec:
            groups.append(_group(i, min(step, g), size, seconds))
            i += 1
        fast.add_dropped(groups, g)
        loop.add_dropped(groups, g)
        assert [getattr(fast, name) for name in FIELDS] == [getattr(loop, name) for name in FIELDS]


# -- namings ------------------------------------------------------------------------------------


def _evicting_sample(naming: str) -> dict[str, float]:
    """A sample at step 10 (T=2) that drops two stale groups (2 and 1 trajectories, dispatched at
    steps 0 and 5) and evicts one failed group."""
    buf = make(max_off_policy_threshold=2, failure_strategy="evict", metric_names=naming)
    add_group(buf, "stale-a", 0, n=2)
    add_group(buf, "stale-b", 5, n=1)
    add_group(buf, "failed", 10, n=1, status=Status.FAILURE)
    add_group(buf, "fresh", 10)
    return sample_now(buf, 10, 1)[1]


def test_default_naming() -> None:
    metrics = _evicting_sample("default")
    assert metrics["training/off_policy/dropped_groups"] == 2.0
    assert metrics["training/off_policy/dropped_samples"] == 3.0
    # over trajectories: ages 11, 11 and 6
    assert metrics["training/off_policy/dropped_samples_staleness/mean"] == pytest.approx(28 / 3)
    assert metrics["training/rollout_failure/evicted_groups"] == 1.0
    assert not any("evicted_samples" in key for key in metrics)


def test_verl_naming_counts_groups_under_verl_main_names() -> None:
    """verl #7082's keys: off_policy/evicted_samples and rollout_failure/evicted_samples count
    groups, and the evicted staleness is taken over groups (ages 11 and 6)."""
    default, verl = _evicting_sample("default"), _evicting_sample("verl-0.9")
    assert verl["training/off_policy/evicted_samples"] == 2.0
    assert verl["training/rollout_failure/evicted_samples"] == 1.0
    assert verl["training/off_policy/evicted_samples_staleness/mean"] == 8.5
    assert verl["training/off_policy/evicted_samples_staleness/max"] == 11.0
    assert verl["training/off_policy/evicted_samples_staleness/min"] == 6.0
    renamed = {f"training/{key}" for key in VERL_09_NAMES}
    assert {key for key in default if key not in renamed} == {
        key for key in verl if "evicted_samples" not in key
    }
    assert len(verl) == len(default)


def test_verl_naming_table() -> None:
    """One table, applied to the default keys; the filters' count has verl's name in both."""
    assert set(NAMINGS) == set(METRIC_NAMINGS)
    assert metric_name("validation/rollout_failure/evicted_groups", "verl-0.9") == (
        "validation/rollout_failure/evicted_samples"
    )
    assert metric_name("training/filter_groups/evicted_samples", "verl-0.9") == (
        "training/filter_groups/evicted_samples"
    )
    assert metric_name("training/off_policy/wait_seconds", "verl-0.9") == "training/off_policy/wait_seconds"
    assert (
        metric_name("training/off_policy/dropped_groups", "default") == "training/off_policy/dropped_groups"
    )
    assert all(
        new.endswith("evicted_samples") or "evicted_samples_staleness/" in new
        for new in VERL_09_NAMES.values()
    )
