"""Selection, staleness rules, failure strategies, exempt partitions and metrics."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from _helpers import (
    add_group,
    in_flight_heap_size,
    in_flight_step_count,
    make,
    oldest_in_flight,
    ready_steps,
    ready_uids,
    resident_groups,
    resident_uids,
    sample_now,
    snapshot,
    spent_slots,
)
from stalebuf import EvictionEvent, ReplayBuffer, SamplerConfig, StalenessPolicy, Status


def test_oldest_first_with_fifo_ties_across_finished_and_failed() -> None:
    buf = make()
    add_group(buf, "c", 2)
    add_group(buf, "a", 1, status=Status.RUNNING)
    add_group(buf, "b", 1, status=Status.FAILURE)
    add_group(buf, "d", 0, status=Status.RUNNING)
    add_group(buf, "e", 1)
    # finish in an order unlike add order: ties must still follow add_prompt order
    buf.mark_finished_nowait("d")
    buf.mark_finished_nowait("a")
    batch, _ = sample_now(buf, 2, 4)
    assert batch.uids == ["d", "a", "b", "e"]
    assert [g.status for g in batch.groups] == [
        Status.FINISHED,
        Status.FINISHED,
        Status.FAILURE,
        Status.FINISHED,
    ]


def test_whole_groups_exact_batch_and_surplus_stays() -> None:
    buf = make()
    for i in range(5):
        add_group(buf, f"g{i}", 0, n=i + 1)
    batch, _ = sample_now(buf, 0, 3)
    assert len(batch) == 3
    assert batch.uids == ["g0", "g1", "g2"]
    assert batch.keys == ["g0_0_0", "g1_0_0", "g1_1_0", "g2_0_0", "g2_1_0", "g2_2_0"]
    assert batch.payloads == [0, 0, 1, 0, 1, 2]
    assert len(batch.tags) == 6
    assert len(batch.trajectories) == 6
    assert [g.uid for g in batch] == batch.uids
    stats = buf.stats().partitions["train"]
    assert stats.finished == 2
    assert stats.trajectories == 4 + 5
    assert sorted(resident_uids(buf)) == ["g3", "g4"]


def test_not_enough_groups_returns_nothing() -> None:
    buf = make()
    add_group(buf, "a", 0)
    add_group(buf, "b", 0, status=Status.RUNNING)
    before = snapshot(buf)
    with pytest.raises(TimeoutError):
        sample_now(buf, 0, 2)
    assert snapshot(buf) == before


@pytest.mark.parametrize(("sync", "kept_age", "dropped_age"), [(1, 2, 3), (2, 4, 5), (3, 6, 7)])
def test_drop_boundary(sync: int, kept_age: int, dropped_age: int) -> None:
    # T = 2: s == T is kept, s > T is dropped; with sync S, s = age / S.
    buf = make(max_off_policy_threshold=2, parameter_sync_step=sync)
    g = 10
    add_group(buf, "old", g + 1 - dropped_age)
    add_group(buf, "edge", g + 1 - kept_age)
    assert buf.sampleable_count(g) == 1
    batch, metrics = sample_now(buf, g, 1)
    assert batch.uids == ["edge"]
    assert batch.staleness.tolist() == [2.0]
    assert metrics["training/off_policy/dropped_groups"] == 1.0
    assert metrics["training/off_policy/dropped_samples_staleness/max"] == dropped_age / sync
    stats = buf.stats().partitions["train"]
    assert (stats.evicted_stale_groups, stats.evicted_stale_trajectories) == (1, 2)


def test_drop_evicts_failed_groups_under_sample_strategy_and_ignores_in_flight() -> None:
    buf = make(max_off_policy_threshold=1)
    add_group(buf, "oldfail", 0, status=Status.FAILURE)
    add_group(buf, "oldrun", 0, status=Status.RUNNING)
    add_group(buf, "fresh", 5)
    batch, _ = sample_now(buf, 5, 1)
    assert batch.uids == ["fresh"]
    assert "oldfail" not in buf
    assert (
        resident_groups(buf)["oldrun"].status is Status.RUNNING
    )  # in-flight groups are not the drop's business


def test_evictions_stay_when_no_batch_is_returned() -> None:
    events: list[EvictionEvent] = []
    buf = make(max_off_policy_threshold=1, on_evict=events.append)
    add_group(buf, "a", 0)
    with pytest.raises(TimeoutError):
        sample_now(buf, 5, 1)
    assert "a" not in buf
    assert [(e.reason, [g.uid for g in e.groups], e.global_steps) for e in events] == [("stale", ["a"], 5)]
    assert buf.stats().total.evicted_stale_groups == 1


@pytest.mark.parametrize(("sync", "blocking_age", "free_age"), [(1, 2, 1), (2, 4, 3), (3, 6, 5)])
def test_wait_gate_boundary(sync: int, blocking_age: int, free_age: int) -> None:
    g = 10
    buf = make(max_off_policy_threshold=2, max_off_policy_strategy="wait", parameter_sync_step=sync)
    add_group(buf, "ready", g)
    add_group(buf, "inflight", g + 1 - free_age, status=Status.RUNNING)
    batch, _ = sample_now(buf, g, 1)  # s < T: the gate is open
    assert batch.uids == ["ready"]

    buf = make(max_off_policy_threshold=2, max_off_policy_strategy="wait", parameter_sync_step=sync)
    add_group(buf, "ready", g)
    add_group(buf, "inflight", g + 1 - blocking_age, status=Status.PENDING)
    before = snapshot(buf)
    with pytest.raises(TimeoutError):
        sample_now(buf, g, 1)  # s == T: blocked
    assert snapshot(buf) == before
    buf.mark_finished_nowait("inflight")
    batch, _ = sample_now(buf, g, 2)
    assert batch.uids == ["inflight", "ready"]


def test_wait_never_drops_a_very_stale_group() -> None:
    buf = make(max_off_policy_threshold=1, max_off_policy_strategy="wait")
    add_group(buf, "ancient", 0)
    assert buf.sampleable_count(1000) == 1
    batch, metrics = sample_now(buf, 1000, 1)
    assert batch.uids == ["ancient"]
    assert batch.staleness.tolist() == [1001.0]
    assert not any("dropped" in key for key in metrics)


def test_wait_gate_ignores_other_partitions() -> None:
    buf = make(max_off_policy_threshold=1, max_off_policy_strategy="wait")
    add_group(buf, "blocker", 0, status=Status.RUNNING, partition="other")
    add_group(buf, "a", 5)
    assert sample_now(buf, 5, 1)[0].uids == ["a"]


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_exempt_partition_never_evicts_and_never_waits(strategy: str) -> None:
    events: list[EvictionEvent] = []
    buf = make(
        max_off_policy_threshold=1,
        max_off_policy_strategy=strategy,
        failure_strategy="evict",
        on_evict=events.append,
    )
    add_group(buf, "old", 0, partition="val")
    add_group(buf, "failed", 0, status=Status.FAILURE, partition="val")
    add_group(buf, "stuck", 0, status=Status.RUNNING, partition="val")
    assert buf.sampleable_count(50, partition="val") == 2
    batch, metrics = sample_now(buf, 50, 2, partition="val")
    assert batch.uids == ["old", "failed"]
    assert events == []
    assert set(metrics) == {
        "validation/off_policy/sampled_staleness/mean",
        "validation/off_policy/sampled_staleness/max",
        "validation/off_policy/sampled_staleness/min",
        "validation/off_policy/sampled_generation_steps/mean",
        "validation/off_policy/sampled_queue_steps/mean",
        "validation/off_policy/sampled_generation_seconds/mean",
        "validation/off_policy/wait_seconds",
    }  # nothing dropped or evicted; the keys that are always there


def test_failure_strategy_evict_reports_failure_even_when_stale() -> None:
    events: list[EvictionEvent] = []
    buf = make(max_off_policy_threshold=1, failure_strategy="evict", on_evict=events.append)
    add_group(buf, "f1", 0, status=Status.FAILURE, n=3)
    add_group(buf, "s1", 0)
    add_group(buf, "f0", 5, status=Status.FAILURE)
    add_group(buf, "ok", 5)
    assert buf.sampleable_count(5) == 1  # failed groups never count; s1 is stale
    batch, metrics = sample_now(buf, 5, 1)
    assert batch.uids == ["ok"]
    reasons = {e.reason: [g.uid for g in e.groups] for e in events}
    assert reasons == {"failure": ["f1", "f0"], "stale": ["s1"]}
    assert metrics["training/rollout_failure/evicted_groups"] == 2.0
    assert metrics["training/off_policy/dropped_groups"] == 1.0  # only the stale one
    stats = buf.stats().partitions["train"]
    assert (stats.evicted_failure_groups, stats.evicted_failure_trajectories) == (2, 5)
    assert (stats.evicted_stale_groups, stats.evicted_stale_trajectories) == (1, 2)


def test_failure_strategy_evict_under_wait_strategy() -> None:
    events: list[EvictionEvent] = []
    buf = make(max_off_policy_strategy="wait", failure_strategy="evict", on_evict=events.append)
    add_group(buf, "f", 0, status=Status.FAILURE)
    with pytest.raises(TimeoutError):
        sample_now(buf, 0, 1)
    assert [e.reason for e in events] == ["failure"]
    assert "f" not in buf


def test_failure_strategy_sample_returns_failed_groups() -> None:
    buf = make(failure_strategy="sample")
    add_group(buf, "f", 0, status=Status.FAILURE)
    batch, metrics = sample_now(buf, 0, 1)
    assert batch.groups[0].status is Status.FAILURE
    assert "training/rollout_failure/evicted_groups" not in metrics


def test_metrics_values() -> None:
    buf = make(max_off_policy_threshold=2, parameter_sync_step=2)
    add_group(buf, "d1", 0, n=3)  # at g=6: age 7, s=3.5
    add_group(buf, "d2", 1, n=1)  # age 6, s=3.0
    add_group(buf, "k1", 3)  # age 4, s=2.0
    add_group(buf, "k2", 5)  # age 2, s=1.0
    batch, metrics = sample_now(buf, 6, 2)
    assert batch.uids == ["k1", "k2"]
    np.testing.assert_allclose(batch.staleness, [2.0, 1.0])
    assert metrics.pop("training/off_policy/sampled_generation_seconds/mean") >= 0.0  # wall clock
    assert metrics.pop("training/off_policy/dropped_generation_seconds/mean") >= 0.0
    assert metrics == pytest.approx(
        {
            "training/off_policy/dropped_samples": 4.0,
            "training/off_policy/dropped_groups": 2.0,
            "training/off_policy/dropped_samples_staleness/mean": (3 * 3.5 + 1 * 3.0) / 4,
            "training/off_policy/dropped_samples_staleness/max": 3.5,
            "training/off_policy/dropped_samples_staleness/min": 3.0,
            "training/off_policy/sampled_staleness/mean": 1.5,
            "training/off_policy/sampled_staleness/max": 2.0,
            "training/off_policy/sampled_staleness/min": 1.0,
            # no sample ran before: the clock was 0, so each finished at its own dispatch step
            "training/off_policy/sampled_generation_steps/mean": 0.0,
            "training/off_policy/sampled_queue_steps/mean": 6 - (3 + 5) / 2,
            "training/off_policy/wait_seconds": 0.0,
        }
    )
    assert all(type(v) is float for v in metrics.values())


def test_dropped_staleness_of_empty_groups_uses_groups() -> None:
    buf = make(max_off_policy_threshold=1)
    add_group(buf, "e1", 0, n=0)
    add_group(buf, "e2", 2, n=0)
    add_group(buf, "k", 9)
    _, metrics = sample_now(buf, 9, 1)
    assert metrics["training/off_policy/dropped_samples"] == 0.0
    assert metrics["training/off_policy/dropped_groups"] == 2.0
    assert metrics["training/off_policy/dropped_samples_staleness/mean"] == 9.0
    assert metrics["training/off_policy/dropped_samples_staleness/max"] == 10.0
    assert metrics["training/off_policy/dropped_samples_staleness/min"] == 8.0


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_the_largest_valid_steps_and_settings_work_end_to_end(strategy: str) -> None:
    """2**63 - 1 is accepted everywhere (issue 10, item 3 bounds values there, no lower)."""
    top = 2**63 - 1
    buf = make(max_off_policy_threshold=top, parameter_sync_step=top, max_off_policy_strategy=strategy)
    add_group(buf, "first", 0)
    buf.put_group_nowait("last", ["p"], global_steps=top, session_ids=[top], indices=[top])
    assert buf.sampleable_count(top) == 2
    batch, metrics = sample_now(buf, top, 2)
    assert batch.uids == ["first", "last"]
    assert batch.groups[1].trajectories[0].key == f"last_{top}_{top}"
    assert np.isfinite(batch.staleness).all()
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert buf.stats().total.sampled_groups == 2


def test_the_largest_step_drops_and_reports_finite_metrics() -> None:
    top = 2**63 - 1
    buf = make(max_off_policy_threshold=1)
    add_group(buf, "ancient", 0)
    add_group(buf, "now", top)
    batch, metrics = sample_now(buf, top, 1)
    assert batch.uids == ["now"]
    assert metrics["training/off_policy/dropped_groups"] == 1.0
    assert all(np.isfinite(v) for v in metrics.values()), metrics


def test_validation_prefix_for_other_partitions() -> None:
    buf = make()
    add_group(buf, "a", 0, partition="eval")
    _, metrics = sample_now(buf, 0, 1, partition="eval")
    assert "validation/off_policy/wait_seconds" in metrics


def test_sampleable_count_is_pure() -> None:
    buf = make(max_off_policy_threshold=1)
    add_group(buf, "old", 0)
    add_group(buf, "new", 4)
    add_group(buf, "run", 4, status=Status.RUNNING)
    before = snapshot(buf)
    assert buf.sampleable_count(4) == 1
    assert buf.sampleable_count(0) == 2
    assert buf.sampleable_count(4, partition="nothing-here") == 0
    assert snapshot(buf) == before
    assert "nothing-here" not in buf.stats().partitions


def test_sampleable_count_over_many_steps_matches_rule() -> None:
    buf = make(max_off_policy_threshold=3)
    steps = [7, 3, 9, 0, 5, 5, 1, 8, 2, 6, 4, 9]
    for i, p in enumerate(steps):
        add_group(buf, f"g{i}", p)
    for g in range(15):
        assert buf.sampleable_count(g) == sum(1 for p in steps if g - p + 1 <= 3)


@pytest.mark.parametrize(
    ("bad", "error"), [(0, ValueError), (-1, ValueError), (2.0, ValueError), (True, ValueError)]
)
def test_bad_batch_size(bad: object, error: type[Exception]) -> None:
    buf = make()
    add_group(buf, "a", 0)
    before = snapshot(buf)
    with pytest.raises(error, match="batch_size"):
        sample_now(buf, 0, bad)  # type: ignore[arg-type]
    assert snapshot(buf) == before


@pytest.mark.parametrize(("bad", "error"), [(-1, ValueError), (None, TypeError), (False, TypeError)])
def test_bad_global_steps(bad: object, error: type[Exception]) -> None:
    buf = make()
    with pytest.raises(error, match="global_steps"):
        sample_now(buf, bad, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "1", True])
def test_bad_timeout(bad: object) -> None:
    buf = make()

    async def run() -> None:
        await buf.sample(0, 1, timeout=bad)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="timeout"):
        anyio.run(run)


def test_batch_views_of_empty_payloads() -> None:
    buf = make()
    buf.add_prompt_nowait("x", global_steps=0)
    buf.mark_finished_nowait("x")
    batch, _ = sample_now(buf, 0, 1)
    assert batch.keys == []
    assert batch.payloads == []
    assert batch.staleness.dtype == np.float64


def test_in_flight_step_heap_stays_bounded_below_a_stuck_group() -> None:
    buf = make(max_off_policy_strategy="wait")
    add_group(buf, "stuck", 0, status=Status.RUNNING)
    for i in range(500):  # each step enters and leaves flight below the stuck group
        add_group(buf, f"g{i}", 1 + i % 3, status=Status.PENDING)
        buf.mark_failed_nowait(f"g{i}")
    assert oldest_in_flight(buf) == 0
    assert in_flight_heap_size(buf) <= 2 * in_flight_step_count(buf) + 9


def test_partly_taken_bucket_keeps_fifo_order_with_late_finishers() -> None:
    buf = make()
    for i in range(10):
        add_group(buf, f"g{i}", 0, status=Status.RUNNING)
    for i in (0, 1, 2, 5, 6, 7, 8, 9):  # g3 and g4 finish late
        buf.mark_finished_nowait(f"g{i}")
    assert sample_now(buf, 0, 3)[0].uids == ["g0", "g1", "g2"]
    assert all(group is None for group in spent_slots(buf, "train", 0))  # taken groups not kept
    buf.mark_finished_nowait("g4")
    buf.mark_finished_nowait("g3")
    assert sample_now(buf, 0, 4)[0].uids == ["g3", "g4", "g5", "g6"]
    assert sample_now(buf, 0, 3)[0].uids == ["g7", "g8", "g9"]
    assert ready_steps(buf) == []


def test_one_group_per_step_is_served_oldest_first() -> None:
    buf = make(max_off_policy_strategy="wait")
    steps = [9, 2, 7, 0, 5, 3, 8, 1, 6, 4]
    for p in steps:
        add_group(buf, f"s{p}", p)
    assert sample_now(buf, 9, 4)[0].uids == ["s0", "s1", "s2", "s3"]
    add_group(buf, "late1", 1)
    assert sample_now(buf, 9, 3)[0].uids == ["late1", "s4", "s5"]
    assert ready_uids(buf) == ["s6", "s7", "s8", "s9"]


# -- a policy built from another config sets the rules and the reported staleness -----------------


def test_a_policy_built_from_another_config_sets_the_rules_and_the_reported_staleness() -> None:
    """Defect: the policy answers every rule question, but the staleness a batch and its metrics
    report used the config's S while the rules used the policy's. Now both use the policy's."""
    config = SamplerConfig(max_off_policy_threshold=2, parameter_sync_step=2)
    other = StalenessPolicy(SamplerConfig(max_off_policy_threshold=8, parameter_sync_step=4))
    buf = ReplayBuffer(config, policy=other, status_log_interval=None)
    buf.put_group_nowait("a", [1], global_steps=0)
    batch, metrics = buf.sample_nowait(7, 1)  # s = 8/4 = 2 under the policy (8/2 = 4 > 2 under config)
    assert batch.uids == ["a"]
    assert batch.parameter_sync_step == 4
    assert list(batch.staleness) == [2.0]
    assert metrics["training/off_policy/sampled_staleness/mean"] == 2.0
    # The same config, or only the policy, is fine too.
    assert ReplayBuffer(config, policy=StalenessPolicy(config)).policy.config == config
    assert ReplayBuffer(policy=other).config == other.config
