"""Token admission (issue 24): reservations, settlement, the residency cap, the token queries,
the rule a ``sample`` call must follow, and what stats, metrics and checkpoints report.

Under ``admission_token_budget`` (``K``) or ``max_resident_tokens`` (``R``), both with
``max_tokens_per_group`` (``M``), an in-flight group reserves ``M`` at its tag and against the
residency cap, settles to its own tokens when it ends, and takes them with it when it leaves.
The waiting paths are in ``test_token_admission_waiting.py``; the model-based test in
``test_token_admission_model.py``.
"""

from __future__ import annotations

import pickle
from typing import Any

import anyio
import anyio.to_thread
import pytest

from _helpers import (
    assert_conserved,
    full_snapshot,
    make,
    refuses_token_group,
    train_stats,
    whitebox_sample,
)
from stalebuf import ReplayBuffer, SamplerConfig, StalenessPolicy
from stalebuf._token_rules import check_sample_budget
from stalebuf.errors import BufferFullError, ConfigError, FutureTagError

pytestmark = pytest.mark.anyio


def tokens_buffer(**config: Any) -> ReplayBuffer:
    """T=1, S=1, wait, K=100, M=60 unless overridden."""
    config.setdefault("max_off_policy_threshold", 1)
    config.setdefault("max_off_policy_strategy", "wait")
    config.setdefault("admission_token_budget", 100)
    config.setdefault("max_tokens_per_group", 60)
    return make(**config)


def ledger(buf: ReplayBuffer) -> tuple[int, int, int]:
    """``(resident_tokens, reserved_tokens, tokens)`` of the "train" partition."""
    stats = train_stats(buf)
    return stats.resident_tokens, stats.reserved_tokens, stats.tokens


# -- the config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"admission_token_budget": 100}, "needs max_tokens_per_group"),
        ({"admission_token_budget": 100, "max_tokens_per_group": 101}, "must be <= admission_token_budget"),
        ({"admission_token_budget": 100, "max_tokens_per_group": 10, "admission_batch_size": 4}, "exclusive"),
        (
            {"admission_token_budget": 100, "max_tokens_per_group": 10, "max_off_policy_threshold": None},
            "needs a max_off_policy_threshold",
        ),
        ({"max_resident_tokens": 100}, "max_resident_tokens needs max_tokens_per_group"),
        ({"max_resident_tokens": 9, "max_tokens_per_group": 10}, "must be >= max_tokens_per_group"),
        (
            {"admission_token_budget": 100, "max_tokens_per_group": 10, "mixture": {"a": 1, "b": 1}},
            "cannot be used with a task mixture",
        ),
        (
            {"max_resident_tokens": 100, "max_tokens_per_group": 10, "mixture": {"a": 1, "b": 1}},
            "per-task token quotas",
        ),
        (
            {"admission_token_budget": 0, "max_tokens_per_group": 1},
            "admission_token_budget must be an int >= 1",
        ),
        ({"max_tokens_per_group": True}, "max_tokens_per_group must be an int >= 1"),
        ({"max_resident_tokens": 2.5, "max_tokens_per_group": 1}, "max_resident_tokens must be an int >= 1"),
    ],
)
def test_a_config_that_cannot_work_is_refused(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SamplerConfig(**fields)
    with pytest.raises(ConfigError, match=match):
        SamplerConfig.from_mapping(fields)


def test_the_token_fields_load_from_a_mapping_and_round_trip() -> None:
    fields = {"admission_token_budget": 4096, "max_tokens_per_group": 1024, "max_resident_tokens": 10_000}
    config = SamplerConfig.from_mapping(fields)
    assert (config.admission_token_budget, config.max_tokens_per_group, config.max_resident_tokens) == (
        4096,
        1024,
        10_000,
    )
    assert pickle.loads(pickle.dumps(config)) == config
    assert SamplerConfig().admission_token_budget is None  # off by default
    SamplerConfig(max_tokens_per_group=8, mixture={"a": 1, "b": 1})  # M alone bounds groups only: fine


def test_a_policy_that_counts_groups_is_refused_under_a_token_budget() -> None:
    class Generous(StalenessPolicy):
        def admits(self, tag: int, resident_at_tag: int, last_sampled: int, cap: int, partition: str) -> bool:
            return True

    config = SamplerConfig(admission_token_budget=100, max_tokens_per_group=10)
    with pytest.raises(ConfigError, match="Generous overrides admits or admission_batch_size"):
        ReplayBuffer(config, policy=Generous(config))
    ReplayBuffer(SamplerConfig(max_resident_tokens=100, max_tokens_per_group=10), policy=Generous())


# -- the sample rule ------------------------------------------------------------------------------


def test_check_sample_budget_under_token_admission() -> None:
    config = SamplerConfig(admission_token_budget=100, max_tokens_per_group=10)
    check_sample_budget(config, None, 100)
    check_sample_budget(config, None, 250)
    with pytest.raises(
        ValueError, match=r"sample\(batch_size=4\) cannot be used under admission_token_budget"
    ):
        check_sample_budget(config, 4, None)
    with pytest.raises(ValueError, match="token_budget=99 is below admission_token_budget=100"):
        check_sample_budget(config, None, 99)
    check_sample_budget(config, 4, None, exempt=True)  # no admission on an exempt partition
    check_sample_budget(config, None, 1, exempt=True)


def test_check_sample_budget_under_group_admission_and_without() -> None:
    groups = SamplerConfig(admission_batch_size=4)
    check_sample_budget(groups, 4, None)
    with pytest.raises(
        ValueError, match=r"sample\(token_budget=100\) cannot be used under admission_batch_size"
    ):
        check_sample_budget(groups, None, 100)
    check_sample_budget(groups, None, 100, exempt=True)
    for free in (SamplerConfig(), SamplerConfig(max_resident_tokens=100, max_tokens_per_group=10)):
        check_sample_budget(free, 4, None)
        check_sample_budget(free, None, 7)


async def test_a_count_sample_under_token_admission_is_refused_with_nothing_changed() -> None:
    buf = tokens_buffer()
    buf.put_group_nowait("a", [1], tokens=[5])
    before = full_snapshot(buf)
    with pytest.raises(ValueError, match="admission counts tokens"):
        buf.sample_nowait(3, 1)
    with pytest.raises(ValueError, match="admission counts tokens"):
        await buf.sample(3, 1, timeout=0)
    with pytest.raises(ValueError, match="admission counts tokens"):
        await buf.sample(3, 1, partition="fresh", timeout=1)  # not even created
    assert full_snapshot(buf) == before
    assert buf.dispatch_step() == 0  # the clock did not move
    assert "fresh" not in buf.stats().partitions
    buf.put_group_nowait("v", [1], partition="val", tokens=[500])  # exempt: no cap, no M
    batch, _ = await buf.sample(0, 1, partition="val", timeout=0)
    assert batch.uids == ["v"]


# -- reservations and settlement ----------------------------------------------------------------


def test_an_in_flight_group_reserves_m_and_settles_to_its_tokens() -> None:
    buf = tokens_buffer()
    buf.add_prompt_nowait("a")
    assert ledger(buf) == (0, 60, 0)
    assert (buf.free_tokens(), buf.full()) == (40, True)  # 40 < M: no in-flight group fits
    with pytest.raises(BufferFullError, match="room for 40 more tokens at dispatch step 0"):
        buf.add_prompt_nowait("b")
    buf.put_nowait("a", 1, tokens=20)
    buf.put_nowait("a", 2, session_id=1, versions=[(0, 5)])
    assert ledger(buf) == (0, 60, 25)  # tokens put count in ``tokens``, the reservation stays M
    buf.mark_finished_nowait("a")
    assert ledger(buf) == (25, 0, 25)  # settled: 35 refunded at once
    assert (buf.free_tokens(), buf.full()) == (75, False)
    buf.add_prompt_nowait("b")
    assert ledger(buf) == (25, 60, 25)
    assert buf.free_tokens() == 15
    assert_conserved(buf)


def test_a_failed_group_settles_too_and_leaves_with_its_tokens() -> None:
    buf = tokens_buffer(max_off_policy_threshold=2, failure_strategy="evict")
    buf.add_prompt_nowait("a")
    buf.put_nowait("a", 1, tokens=7)
    buf.mark_failed_nowait("a")
    assert ledger(buf) == (7, 0, 7)
    whitebox_sample(buf, 0, 1)  # evicts it as failed (no batch: nothing is ready)
    assert ledger(buf) == (0, 0, 0)
    assert train_stats(buf).evicted_tokens == 7
    assert buf.free_tokens() == 100


def test_a_group_written_terminal_counts_its_own_tokens() -> None:
    buf = tokens_buffer()
    buf.put_group_nowait("a", [1, 2], tokens=[30, 30])  # 60 <= M
    buf.put_group_nowait("b", [1], tokens=[40])  # 100 at step 0 now: exactly K
    assert ledger(buf) == (100, 0, 100)
    assert buf.free_tokens() == 0
    with pytest.raises(BufferFullError):
        buf.put_group_nowait("c", [1], tokens=[1])
    buf.put_group_nowait("zero", [1])  # no tokens: counts 0, fits even a full step
    assert refuses_token_group(buf, 0)


def test_a_put_past_max_tokens_per_group_is_refused_with_nothing_changed() -> None:
    buf = tokens_buffer()
    buf.add_prompt_nowait("a")
    buf.put_nowait("a", 1, tokens=50)
    before = full_snapshot(buf)
    with pytest.raises(
        ValueError, match=r"would hold 61 tokens \(50 \+ 11\), more than max_tokens_per_group=60"
    ):
        buf.put_nowait("a", 2, session_id=1, tokens=11)
    with pytest.raises(ValueError, match="more than max_tokens_per_group"):
        buf.put_nowait("a", 2, session_id=1, versions=[(0, 6), (1, 5)])
    with pytest.raises(ValueError, match="more than max_tokens_per_group"):
        buf.put_group_nowait("a", [2, 3], session_ids=[1, 2], tokens=[5, 6])  # into the in-flight group
    with pytest.raises(ValueError, match="more than max_tokens_per_group"):
        buf.put_group_nowait("new", [2, 3], tokens=[31, 30])
    with pytest.raises(ValueError, match="more than max_tokens_per_group"):
        buf.put_group_nowait("new", [2], partition="other", tokens=[61])  # a partition not created yet
    assert full_snapshot(buf) == before
    assert "other" not in buf.stats().partitions
    buf.put_nowait("a", 2, session_id=1, tokens=10)  # exactly M
    assert train_stats(buf).tokens == 60


def test_max_tokens_per_group_alone_bounds_groups_and_gates_nothing() -> None:
    buf = make(max_tokens_per_group=10)
    for uid in "abcdefgh":
        buf.add_prompt_nowait(uid)  # no cap: never full
    assert (buf.free_tokens(), buf.capacity_tokens(), buf.full()) == (None, None, False)
    with pytest.raises(ValueError, match="max_tokens_per_group=10"):
        buf.put_nowait("a", 1, tokens=11)
    buf.put_group_nowait("v", [1], partition="val", tokens=[1000])  # exempt: unbounded
    assert train_stats(buf).reserved_tokens == 0


def test_leaving_refunds_every_way() -> None:
    buf = ReplayBuffer(
        SamplerConfig(
            max_off_policy_threshold=2,
            evict_stale_in_flight=True,
            max_tokens_per_group=10,
            max_resident_tokens=40,
        ),
        filters=[lambda group: group.uid != "rejected"],
        status_log_interval=None,
    )
    buf.add_prompt_nowait("stale", global_steps=0)  # evicted in flight at the sample at 2
    buf.put_group_nowait("old", [1], global_steps=0, tokens=[3])  # evicted as stale
    buf.add_prompt_nowait("rejected", global_steps=1)
    buf.put_nowait("rejected", 1, tokens=4)
    buf.mark_finished_nowait("rejected")  # filtered: leaves at once
    assert ledger(buf) == (3, 10, 3)
    buf.put_group_nowait("kept", [1], global_steps=1, tokens=[5])
    assert ledger(buf) == (8, 10, 8)
    batch, _ = buf.sample_nowait(2, 1)  # evicts stale and old, returns kept
    assert batch.uids == ["kept"]
    assert ledger(buf) == (0, 0, 0)
    assert buf.free_tokens() == 40
    assert_conserved(buf)


# -- the residency cap ----------------------------------------------------------------------------


def test_the_residency_cap_alone_checks_no_tag() -> None:
    buf = make(max_tokens_per_group=10, max_resident_tokens=25)
    buf.add_prompt_nowait("a", global_steps=7)  # ahead of the clock: no tag rules here
    buf.add_prompt_nowait("b", global_steps=0)
    assert (buf.free_tokens(), buf.capacity_tokens()) == (5, 25)
    with pytest.raises(BufferFullError, match="needs 10"):
        buf.add_prompt_nowait("c")
    buf.put_group_nowait("d", [1], tokens=[5])  # fits exactly
    assert buf.free_tokens() == 0
    assert refuses_token_group(buf, 0)


def test_the_residency_cap_with_group_admission_applies_both() -> None:
    buf = make(
        max_off_policy_threshold=2, admission_batch_size=3, max_tokens_per_group=10, max_resident_tokens=25
    )
    buf.add_prompt_nowait("a")
    buf.add_prompt_nowait("b")
    # A slot is free at step 0 by count, but add_prompt would not admit a group there now.
    assert (buf.free_slots(), buf.free_tokens(), buf.full()) == (0, 5, True)
    with pytest.raises(BufferFullError, match="room for 5 more tokens"):
        buf.add_prompt_nowait("c")
    with pytest.raises(FutureTagError):
        buf.add_prompt_nowait("c", global_steps=1)
    assert buf.capacity_tokens() == 25
    assert buf.capacity() == 6


# -- the queries ----------------------------------------------------------------------------------


def test_capacity_tokens_is_the_smaller_bound() -> None:
    assert tokens_buffer(max_off_policy_threshold=3, parameter_sync_step=2).capacity_tokens() == 600
    assert tokens_buffer(max_off_policy_threshold=3, max_resident_tokens=250).capacity_tokens() == 250
    assert tokens_buffer(max_resident_tokens=900).capacity_tokens() == 100
    buf = tokens_buffer()
    assert (buf.capacity_tokens("val"), buf.free_tokens("val"), buf.full("val")) == (None, None, False)
    assert make().free_tokens() is None
    assert make().capacity_tokens() is None
    with pytest.raises(ValueError, match="partition"):
        buf.free_tokens("")
    with pytest.raises(TypeError):
        buf.capacity_tokens(3)  # type: ignore[arg-type]


def test_refuses_token_group_follows_reservations_and_settlement() -> None:
    buf = tokens_buffer(
        admission_token_budget=150, max_off_policy_threshold=2, max_off_policy_strategy="drop"
    )
    assert not refuses_token_group(buf, 0)  # not even created
    buf.add_prompt_nowait("a")
    assert not refuses_token_group(buf, 0)  # 90 left >= 60
    buf.add_prompt_nowait("b")
    assert refuses_token_group(buf, 0)  # 30 left
    assert not refuses_token_group(buf, 1)  # a fresh step
    buf.mark_finished_nowait("a")  # settles to 0: 90 left
    assert not refuses_token_group(buf, 0)
    assert whitebox_sample(buf, 1, 1) is not None  # takes a: step 0 closes (T*S = 2)
    assert refuses_token_group(buf, 0)
    assert not refuses_token_group(buf, 1)


async def test_the_thread_handle_answers_the_token_queries() -> None:
    buf = tokens_buffer()
    buf.add_prompt_nowait("a")
    handle = buf.threadsafe()
    answers = await anyio.to_thread.run_sync(
        lambda: (handle.free_tokens(), handle.capacity_tokens(), handle.full())
    )
    assert answers == (40, 100, True)


# -- stats, metrics, Prometheus, checkpoints ------------------------------------------------------


def test_a_batch_reports_the_token_admission_metrics() -> None:
    buf = tokens_buffer(max_off_policy_threshold=2, max_off_policy_strategy="drop")
    buf.put_group_nowait("a", [1], tokens=[10])
    buf.add_prompt_nowait("b")
    result = whitebox_sample(buf, 1, 1)
    assert result is not None
    metrics = result[1]
    assert metrics["training/admission/free_tokens"] == buf.free_tokens() == 100  # step 1: fresh
    assert metrics["training/admission/reserved_tokens"] == 60
    assert metrics["training/admission/producer_wait_seconds"] == 0.0
    assert "training/admission/free_slots" not in metrics
    plain = make(admission_batch_size=2)
    plain.put_group_nowait("a", [1])
    _, metrics = plain.sample_nowait(0, 1)
    assert "training/admission/free_tokens" not in metrics


def test_the_totals_add_the_token_fields() -> None:
    buf = make(max_tokens_per_group=10, max_resident_tokens=100)
    buf.add_prompt_nowait("a")
    buf.put_group_nowait("b", [1], tokens=[4])
    buf.add_prompt_nowait("c", partition="other")
    total = buf.stats().total
    assert (total.resident_tokens, total.reserved_tokens) == (4, 20)


def test_resident_tokens_without_a_ledger_counts_terminal_groups_only() -> None:
    buf = make()
    buf.add_prompt_nowait("a")
    buf.put_nowait("a", 1, tokens=9)
    buf.put_group_nowait("b", [1], tokens=[4])
    assert ledger(buf) == (4, 0, 13)


@pytest.mark.parametrize("mode", ["keep", "reissue", "resume", "evict"])
def test_a_restore_carries_the_reservations_exactly(mode: str) -> None:
    buf = tokens_buffer(max_off_policy_threshold=2, max_resident_tokens=150)
    buf.put_group_nowait("done", [1], tokens=[10])
    buf.add_prompt_nowait("flying")
    buf.mark_running_nowait("flying")
    buf.put_nowait("flying", 1, tokens=15)
    restored = ReplayBuffer.restore(buf.checkpoint(), in_flight=mode).buffer  # type: ignore[arg-type]
    if mode == "evict":
        assert ledger(restored) == (10, 0, 10)
        assert restored.free_tokens() == 90
    else:
        expected = (10, 60, 10 if mode == "reissue" else 25)
        assert ledger(restored) == expected
        assert (restored.free_tokens(), restored.full()) == (buf.free_tokens(), buf.full()) == (30, True)
    assert restored.capacity_tokens() == buf.capacity_tokens() == 150
    assert_conserved(restored)


@pytest.mark.parametrize("codec", [False, True])
async def test_a_checkpoint_file_keeps_the_token_fields_and_omits_them_when_unset(
    codec: bool, tmp_path: Any
) -> None:
    options: dict[str, Any] = {"payload_codec": (lambda p: repr(p).encode(), bytes.decode)} if codec else {}
    buf = tokens_buffer(max_resident_tokens=150)
    buf.put_group_nowait("done", [1], tokens=[10])
    buf.add_prompt_nowait("flying")
    await buf.save(tmp_path / "tokens.ckpt", **options)
    restored = ReplayBuffer.restore(tmp_path / "tokens.ckpt", in_flight="keep", **options).buffer
    assert restored.config == buf.config
    assert ledger(restored) == ledger(buf) == (10, 60, 10)
    plain = make(max_off_policy_threshold=2)
    await plain.save(tmp_path / "plain.ckpt", **options)
    assert b"max_tokens_per_group" not in (tmp_path / "plain.ckpt").read_bytes()  # older releases read it
    assert ReplayBuffer.restore(tmp_path / "plain.ckpt", **options).buffer.config == plain.config


def test_explain_wait_says_admission_is_full_for_want_of_tokens() -> None:
    buf = tokens_buffer()
    assert not buf.explain_wait().admission_full
    buf.add_prompt_nowait("a")  # 40 left < M
    assert buf.explain_wait().admission_full


def test_prometheus_exports_the_reserved_and_terminal_tokens() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")  # the prometheus extra
    CollectorRegistry, generate_latest = (
        prometheus_client.CollectorRegistry,
        prometheus_client.generate_latest,
    )

    from stalebuf.prometheus import register

    buf = tokens_buffer()
    buf.add_prompt_nowait("a")
    buf.put_group_nowait("b", [1], tokens=[7])
    registry = CollectorRegistry()
    register(buf, registry)
    text = generate_latest(registry).decode()
    assert 'stalebuf_reserved_tokens{partition="train"} 60.0' in text
    assert 'stalebuf_terminal_tokens{partition="train"} 7.0' in text
    assert 'stalebuf_resident_tokens{partition="train"} 7.0' in text
