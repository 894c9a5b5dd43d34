"""Per-sample metrics: SampleMetrics against a plain loop (the aggregation of dropped groups, over
several rounds); the metric namings (``SamplerConfig.metric_names``); and the producer's
``generation_seconds`` behind ``sampled_generation_seconds/mean``."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _helpers import LIMIT, add_group, full_snapshot, make, sample_now, start_call
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


# -- put_group(generation_seconds=): the producer's measure, for the length-bias metric -----------

GENERATION = "training/off_policy/sampled_generation_seconds/mean"


@pytest.mark.parametrize(
    "options",
    [
        {},  # the fast path: a new finished group of default keys
        {"session_ids": [4, 5]},  # the general path
        {"status": "failed"},
        {"global_steps": 0, "tags": {"k": 1}},
    ],
)
def test_put_group_generation_seconds_is_the_group_s_and_the_metric_s(options: dict[str, Any]) -> None:
    """Defect (issue 26, item 3): every group written in one call measured 0.0 s, so
    ``sampled_generation_seconds/mean`` was 0.0 on the path HTTP and Ray producers use."""
    buf = make(failure_strategy="sample")
    buf.put_group_nowait("a", [1, 2], generation_seconds=2.5, **options)
    buf.put_group_nowait("b", [1, 2], generation_seconds=Fraction(1, 2), **options)
    batch, metrics = buf.sample_nowait(0, 2)
    assert [group.generation_seconds for group in batch] == [2.5, 0.5]
    assert all(type(group.generation_seconds) is float for group in batch)
    assert metrics[GENERATION] == 1.5


def test_without_generation_seconds_a_one_call_group_measures_zero_and_an_in_flight_one_its_time() -> None:
    buf = make()
    buf.put_group_nowait("one-call", [1])
    buf.add_prompt_nowait("in-flight")
    buf.put_group_nowait("in-flight", [1])  # measured from its add_prompt
    buf.add_prompt_nowait("told")
    buf.put_group_nowait("told", [1], generation_seconds=np.float32(7.0))  # the producer's measure wins
    batch, _ = buf.sample_nowait(0, 3)
    one_call, in_flight, told = (group.generation_seconds for group in batch)
    assert (one_call, told) == (0.0, 7.0)
    assert in_flight >= 0.0


@pytest.mark.anyio
async def test_generation_seconds_survives_a_wait_for_admission_and_a_put_back() -> None:
    buf = make(admission_batch_size=1, max_off_policy_threshold=2)
    with anyio.fail_after(LIMIT):
        await buf.put_group("first", [1], generation_seconds=1.0)
        async with anyio.create_task_group() as tg:
            second = await start_call(tg, lambda: buf.put_group("second", [1], generation_seconds=3.0))
            assert not second.done  # no slot at step 0: it waits
            batch, _ = await buf.sample(0, 1)
        assert second.returned
        assert buf.put_back(batch.groups[0])
        batch, metrics = await buf.sample(1, 2)
    assert {group.uid: group.generation_seconds for group in batch} == {"first": 1.0, "second": 3.0}
    assert metrics[GENERATION] == 2.0


BAD_SECONDS: list[tuple[object, type[Exception]]] = [
    (-1.0, ValueError),
    (-1, ValueError),
    (math.nan, ValueError),
    (math.inf, ValueError),
    (10**400, ValueError),
    (True, TypeError),
    ("1", TypeError),
    (object(), TypeError),
    (1j, TypeError),
]


@pytest.mark.parametrize(("seconds", "error"), BAD_SECONDS)
@pytest.mark.parametrize("path", ["fast", "general", "in flight"])
def test_bad_generation_seconds_are_typed_errors_that_change_nothing(
    seconds: object, error: type[Exception], path: str
) -> None:
    buf = make()
    buf.put_group_nowait("warm", [1])  # the partition exists: the fast path is open
    if path == "in flight":
        buf.add_prompt_nowait("a")
    before = full_snapshot(buf)
    options: dict[str, Any] = {"session_ids": [3]} if path == "general" else {}
    with pytest.raises(error, match="generation_seconds"):
        buf.put_group_nowait("a", [1], generation_seconds=seconds, **options)  # type: ignore[arg-type]
    assert full_snapshot(buf) == before


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


@pytest.mark.parametrize("sync_step", [1, 2])
def test_a_group_dispatched_after_the_step_counts_as_fresh_in_the_metrics(sync_step: int) -> None:
    """Issue 25: a journal recovered at an earlier step holds groups dispatched after it (their
    behaviour policy is newer than the restored trainer). The staleness metrics count them as
    fresh, ``1 / S``; ``Batch.staleness`` keeps the true value, which may be <= 0."""
    buf = make(max_off_policy_threshold=4, parameter_sync_step=sync_step)
    buf.put_group_nowait("old", ["x"], global_steps=0)
    buf.put_group_nowait("newer", ["x"], global_steps=3)
    batch, metrics = buf.sample_nowait(1, 2)
    assert batch.staleness.tolist() == [2 / sync_step, -1 / sync_step]
    prefix = "training/off_policy/sampled_staleness"
    assert metrics[f"{prefix}/min"] == 1 / sync_step
    assert metrics[f"{prefix}/max"] == 2 / sync_step
    assert metrics[f"{prefix}/mean"] == 1.5 / sync_step
