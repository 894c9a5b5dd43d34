"""SampleMetrics against a plain loop: the aggregation of dropped groups, over several rounds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stalebuf import Group, Status
from stalebuf.metrics import SampleMetrics
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
