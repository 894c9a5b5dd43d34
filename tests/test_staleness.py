"""The staleness arithmetic: the bound the hot paths compare with inline agrees with the rule;
and no threshold at all (``max_off_policy_threshold=None``, verl's null) turns every rule off."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _helpers import add_group, make, sample_now
from stalebuf import ConfigError, ReplayBuffer, SamplerConfig, StalenessPolicy, Status
from stalebuf.staleness import NO_SPAN, blocks_wait, drop_span, exceeds_drop

steps = st.integers(0, 2**63 - 1)


@given(steps, steps, st.integers(1, 2**20), st.integers(1, 2**20))
def test_drop_span_gives_the_first_kept_dispatch_step(g: int, p: int, threshold: int, sync_step: int) -> None:
    p = min(p, g)
    assert exceeds_drop(g, p, threshold, sync_step) == (p < g + 1 - drop_span(threshold, sync_step))


def test_the_boundary_is_exact() -> None:
    for threshold, sync_step in [(1, 1), (2, 1), (1, 3), (3, 2)]:
        first_kept = 10 + 1 - drop_span(threshold, sync_step)
        assert not exceeds_drop(10, first_kept, threshold, sync_step)  # s == T: kept
        assert exceeds_drop(10, first_kept - 1, threshold, sync_step)  # one step older: dropped


# -- no threshold -------------------------------------------------------------------------------


@given(steps, steps, st.integers(1, 2**20))
def test_no_threshold_never_drops_nor_blocks(g: int, p: int, sync_step: int) -> None:
    p = min(p, g)
    assert not exceeds_drop(g, p, None, sync_step)
    assert not blocks_wait(g, p, None, sync_step)
    assert drop_span(None, sync_step) == NO_SPAN
    assert not p < g + 1 - NO_SPAN  # the inline form of the drop rule agrees
    assert g - p + 1 < NO_SPAN  # and of the open gate


def test_no_threshold_drop_evicts_nothing() -> None:
    buf = make(max_off_policy_threshold=None, max_off_policy_strategy="drop", evict_stale_in_flight=True)
    add_group(buf, "ancient", 0)
    add_group(buf, "running", 0, status=Status.RUNNING)
    add_group(buf, "fresh", 2**62)
    assert buf.sampleable_count(2**62) == 2
    batch, metrics = sample_now(buf, 2**62, 2)
    assert batch.uids == ["ancient", "fresh"]  # oldest first, nothing dropped
    assert not any("dropped" in key or "evicted" in key for key in metrics)
    assert "running" in buf
    assert buf.stats().total.evicted_stale_groups == 0


def test_no_threshold_wait_gate_never_closes() -> None:
    """Under wait with T=1 the same buffer blocks: a group in flight since step 0 has s >= 1."""
    for threshold, opens in ((None, True), (1, False)):
        buf = make(max_off_policy_threshold=threshold, max_off_policy_strategy="wait")
        add_group(buf, "in-flight", 0, status=Status.PENDING)
        add_group(buf, "ready", 100)
        if opens:
            assert sample_now(buf, 100, 1)[0].uids == ["ready"]
        else:
            with pytest.raises(TimeoutError):
                sample_now(buf, 100, 1)


def test_no_threshold_policy_and_subclass_hooks() -> None:
    """A policy (and a verl-style subclass asking super()) answers "never stale" too."""
    config = SamplerConfig(max_off_policy_threshold=None, max_off_policy_strategy="wait")
    policy = StalenessPolicy(config)
    assert not policy.is_stale(10**6, 0, "train")
    assert not policy.must_wait_for(10**6, 0, "train")

    class Verl(ReplayBuffer):
        def _is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
            return super()._is_stale(global_steps, dispatch_step, partition)

    buf = Verl(SamplerConfig(max_off_policy_threshold=None), status_log_interval=None)
    add_group(buf, "ancient", 0)
    assert buf.sampleable_count(10**6) == 1
    assert sample_now(buf, 10**6, 1)[0].uids == ["ancient"]


def test_no_threshold_mask_masks_nothing() -> None:
    """Under mask, no token is stale without a threshold: nothing evicted, nothing masked."""
    buf = make(max_off_policy_threshold=None, max_off_policy_strategy="mask")
    buf.add_prompt_nowait("old", global_steps=0)
    buf.mark_running_nowait("old", version=0)
    buf.put_nowait("old", "completion", versions=[(0, 3), (5, 2)])
    buf.mark_finished_nowait("old")
    batch, metrics = sample_now(buf, 1000, 1)
    assert batch.uids == ["old"]
    assert metrics["training/off_policy/masked_tokens"] == 0.0
    assert not any("dropped" in key for key in metrics)


def test_no_threshold_has_no_admission() -> None:
    """Admission's bound is T*S*b: the config refuses it, and the buffer reports no capacity."""
    buf = make(max_off_policy_threshold=None)
    assert buf.capacity() is None
    assert buf.free_slots() is None
    with pytest.raises(ConfigError, match="admission_batch_size needs a max_off_policy_threshold"):
        make(max_off_policy_threshold=None, admission_batch_size=2)
