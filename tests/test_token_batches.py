"""Token batches (issue 24): ``sample(global_steps, token_budget=K)``.

The longest oldest-first prefix within ``K`` tokens (an oversized first group alone), readiness
(the gate, a group, ``K`` tokens sampleable), the metrics, the WARNING about groups of 0 tokens,
the refusals (a ``select`` override, a task mixture), and the waiting paths (wake-up, timeout,
cancellation, close) on asyncio and trio. The model-based test against a brute-force reference
is tests/test_token_batches_model.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import anyio
import pytest

from _helpers import (
    LIMIT,
    assert_conserved,
    evaluations,
    make,
    ready_tokens,
    ready_uids,
    resident_uids,
    start_call,
)
from samplers import AgeCapped, NewestFirst
from stalebuf import Group, ReplayBuffer, SamplerConfig, StalenessPolicy, Status
from stalebuf.errors import BatchNotReadyError, BufferClosedError, ConfigError

pytestmark = pytest.mark.anyio

BATCH_KEYS = ("training/batch/tokens", "training/batch/fill", "training/batch/oversized_groups")


async def put(buf: ReplayBuffer, uid: str, *tokens: int, step: int = 0, partition: str = "train") -> None:
    """A FINISHED group of one trajectory per entry of ``tokens``, dispatched at ``step``."""
    await buf.put_group(uid, list(tokens), global_steps=step, partition=partition, tokens=list(tokens))


def fill(metrics: dict[str, float], prefix: str = "training") -> list[float]:
    return [metrics[key.replace("training", prefix)] for key in BATCH_KEYS]


# -- the batch ----------------------------------------------------------------------------------


async def test_a_token_batch_is_the_longest_oldest_first_prefix_within_the_budget() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        await put(buf, "late", 10, step=1)  # newer: after every step-0 group
        for uid, tokens in (("a", 60), ("b", 40), ("z1", 0), ("z2", 0), ("c", 30)):
            await put(buf, uid, tokens)
        batch, metrics = await buf.sample(0, token_budget=100)
        # 60 + 40 = 100, and the groups of 0 tokens after it keep the total at 100: all go
        assert batch.uids == ["a", "b", "z1", "z2"]
        assert fill(metrics) == [100.0, 1.0, 0.0]
        batch, metrics = await buf.sample(0, token_budget=35)
        assert batch.uids == ["c"]  # 30, and "late" would make 40 > 35
        assert fill(metrics) == [30.0, 30 / 35, 0.0]
        assert ready_uids(buf) == ["late"]
        assert_conserved(buf)


async def test_a_group_alone_over_the_budget_is_returned_with_the_empty_groups_before_it() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        for uid, tokens in (("z1", 0), ("z2", 0), ("big", 500), ("small", 10)):
            await put(buf, uid, tokens)
        batch, metrics = await buf.sample(0, token_budget=100)
        assert batch.uids == ["z1", "z2", "big"]
        assert fill(metrics) == [500.0, 5.0, 1.0]
        assert ready_uids(buf) == ["small"]


async def test_tokens_are_the_sum_over_trajectories_and_versions_count_too() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        await buf.put_group("v", ["a", "b"], global_steps=0, versions=[[(0, 30), (1, 20)], [(0, 25)]])
        await buf.add_prompt("r", global_steps=0)
        await buf.put("r", "x", tokens=20)
        await buf.put("r", "y", session_id=1, versions=[(0, 5)])
        await buf.mark_finished("r")
        assert ready_tokens(buf) == (100, 100)
        batch, metrics = await buf.sample(0, token_budget=100)
        assert batch.uids == ["v", "r"]
        assert fill(metrics) == [100.0, 1.0, 0.0]
        assert ready_tokens(buf) == (0, 0)


async def test_the_count_batch_is_unchanged_and_takes_batch_size_positionally() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        for i in range(4):
            await put(buf, f"g{i}", 10)
        batch, metrics = await buf.sample(0, 2)
        assert batch.uids == ["g0", "g1"]
        assert not any(key.startswith("training/batch/") for key in metrics)
        batch, _ = buf.sample_nowait(0, batch_size=1)
        assert batch.uids == ["g2"]
        assert ready_tokens(buf) == (10, 10)


async def test_readiness_needs_the_budget_of_sampleable_tokens() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        await put(buf, "a", 60)
        with pytest.raises(BatchNotReadyError, match="100 tokens"):
            buf.sample_nowait(0, token_budget=100)
        await put(buf, "b", 30)
        with pytest.raises(TimeoutError, match="100 tokens"):
            await buf.sample(0, token_budget=100, timeout=0)
        await put(buf, "c", 20)  # 110 >= 100: ready; the prefix within 100 is a + b
        batch, metrics = buf.sample_nowait(0, token_budget=100)
        assert batch.uids == ["a", "b"]
        assert fill(metrics) == [90.0, 0.9, 0.0]


async def test_under_wait_the_gate_holds_a_token_batch_as_it_holds_a_count() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=1, max_off_policy_strategy="wait")
        await buf.add_prompt("old", global_steps=0)
        await put(buf, "a", 500, step=1)
        # at step 1 the in-flight "old" has s = 2 >= T: the gate is closed, tokens or not
        with pytest.raises(BatchNotReadyError):
            buf.sample_nowait(1, token_budget=100)
        await buf.mark_failed("old")  # sampleable (failure_strategy="sample"), 0 tokens
        batch, metrics = buf.sample_nowait(1, token_budget=100)
        assert batch.uids == ["old", "a"]  # oldest first: the empty failed group, then the oversized one
        assert fill(metrics) == [500.0, 5.0, 1.0]


async def test_under_drop_stale_groups_are_evicted_first_and_their_tokens_do_not_count() -> None:
    with anyio.fail_after(LIMIT):
        events = []
        buf = make(max_off_policy_threshold=1, on_evict=events.append)
        await put(buf, "stale", 100, step=0)
        await put(buf, "fresh", 40, step=2)
        assert ready_tokens(buf) == (140, 140)
        with pytest.raises(BatchNotReadyError):
            buf.sample_nowait(2, token_budget=100)  # "stale" (s = 3 > 1) goes; 40 < 100
        assert [group.uid for event in events for group in event.groups] == ["stale"]
        assert ready_tokens(buf) == (40, 40)
        await put(buf, "more", 60, step=2)
        batch, metrics = buf.sample_nowait(2, token_budget=100)
        assert batch.uids == ["fresh", "more"]
        assert metrics["training/off_policy/sampled_staleness/max"] == 1.0


async def test_failed_groups_to_evict_never_count_as_ready_tokens() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4, failure_strategy="evict")
        await buf.put_group("bad", ["x"], global_steps=0, tokens=[80], status="failure")
        await buf.add_prompt("inflight", global_steps=0)
        await buf.put("inflight", "y", tokens=70)
        await buf.mark_failed("inflight")
        assert ready_tokens(buf) == (0, 0)
        await put(buf, "ok", 50)
        with pytest.raises(BatchNotReadyError):
            buf.sample_nowait(0, token_budget=100)
        assert resident_uids(buf) == ["ok"]


async def test_a_token_sample_on_an_exempt_partition_has_no_gate_and_no_eviction() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=1, max_off_policy_strategy="wait")
        await buf.add_prompt("held", global_steps=0, partition="val")
        await put(buf, "v", 50, partition="val")
        batch, metrics = await buf.sample(9, token_budget=50, partition="val")
        assert batch.uids == ["v"]
        assert fill(metrics, "validation") == [50.0, 1.0, 0.0]


async def test_groups_of_0_tokens_warn_once_per_partition(caplog: pytest.LogCaptureFixture) -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        caplog.set_level(logging.WARNING, logger="stalebuf")
        await put(buf, "full", 10)
        buf.sample_nowait(0, token_budget=10)
        assert not caplog.records  # no group of 0 tokens selected: no warning
        for round_ in range(2):
            await buf.put_group(f"bare{round_}", ["x"], global_steps=0)  # no tokens: 0
            await put(buf, f"t{round_}", 10)
            batch, _ = buf.sample_nowait(0, token_budget=10)
            assert batch.uids == [f"bare{round_}", f"t{round_}"]
        await buf.put_group("vbare", ["x"], global_steps=0, partition="val")
        await put(buf, "vt", 10, partition="val")
        buf.sample_nowait(0, token_budget=10, partition="val")
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 2  # one for "train", one for "val"
        assert "'train'" in warnings[0]
        assert "'val'" in warnings[1]
        assert all("tokens=" in message and "versions=" in message for message in warnings)


async def test_the_running_total_follows_every_way_a_ready_group_leaves() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=1, max_off_policy_strategy="mask")
        await buf.put_group("m", ["a"], global_steps=0, versions=[[(0, 10), (2, 10)]])  # tail fresh at 2
        await put(buf, "gone", 7, step=0)
        await put(buf, "kept", 5, step=2)
        assert ready_tokens(buf) == (32, 32)
        batch, _ = buf.sample_nowait(2, batch_size=1)  # "gone" (tail 0) is evicted, "m" sampled
        assert batch.uids == ["m"]
        assert ready_tokens(buf) == (5, 5)


# -- refusals -----------------------------------------------------------------------------------


class OwnSelect(StalenessPolicy):
    def select(
        self, candidates: Iterator[Group], batch_size: int, global_steps: int, partition: str
    ) -> Sequence[Group]:
        return list(candidates)[:batch_size]


async def test_a_policy_that_overrides_select_is_refused_and_nothing_changes() -> None:
    with anyio.fail_after(LIMIT):
        for buf, name in (
            (ReplayBuffer(policy=OwnSelect(), status_log_interval=None), "OwnSelect.select"),
            (NewestFirst(status_log_interval=None), "NewestFirst._select"),
        ):
            await put(buf, "a", 500, step=3)
            with pytest.raises(ConfigError, match=f"{name} overrides the selection.*token budget"):
                await buf.sample(5, token_budget=100)
            with pytest.raises(ConfigError, match=name):
                buf.sample_nowait(5, token_budget=100)
            assert ready_uids(buf) == ["a"]
            assert buf.dispatch_step() == 0  # the clock did not move to 5
            batch, _ = await buf.sample(5, 1)  # counts still work
            assert batch.uids == ["a"]


async def test_a_subclass_that_overrides_other_hooks_samples_by_tokens() -> None:
    with anyio.fail_after(LIMIT):
        buf = AgeCapped(SamplerConfig(max_off_policy_threshold=None), max_age=1, status_log_interval=None)
        await put(buf, "old", 40, step=0)
        await put(buf, "new", 40, step=2)
        batch, _ = await buf.sample(2, token_budget=40)  # AgeCapped drops "old" (2 - 0 > 1)
        assert batch.uids == ["new"]


async def test_a_task_mixture_is_refused_but_its_exempt_partitions_sample_by_tokens() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(mixture={"math": 1, "code": 1})
        await buf.put_group("m", ["x"], global_steps=0, tags={"task": "math"}, tokens=[50])
        for call in (
            lambda: buf.sample_nowait(0, token_budget=10),
            lambda: buf.sample_nowait(0, token_budget=10, partition="unused"),
        ):
            with pytest.raises(ConfigError, match=r"task mixture.*quotas are counts of groups"):
                call()
        assert ready_uids(buf) == []  # (a mixture's groups live in its task cells)
        assert buf.stats().partitions["train"].finished == 1
        await put(buf, "v", 50, partition="val")
        batch, _ = await buf.sample(0, token_budget=50, partition="val")
        assert batch.uids == ["v"]


# -- waiting ------------------------------------------------------------------------------------


async def test_a_parked_token_sample_wakes_only_once_its_tokens_arrive() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        async with anyio.create_task_group() as tg:
            call = await start_call(tg, lambda: buf.sample(0, token_budget=100))
            before = evaluations(buf)
            await put(buf, "a", 60)
            await put(buf, "b", 30)
            await anyio.wait_all_tasks_blocked()
            assert not call.done
            assert evaluations(buf) == before  # 90 < 100: never woken to evaluate in vain
            await put(buf, "c", 20)
            await anyio.wait_all_tasks_blocked()
            assert call.returned
            batch, metrics = call.result
            assert batch.uids == ["a", "b"]
            assert fill(metrics) == [90.0, 0.9, 0.0]
            assert metrics["training/off_policy/wait_seconds"] >= 0.0


async def test_a_parked_token_sample_times_out_having_taken_nothing() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        await put(buf, "a", 60)
        with pytest.raises(TimeoutError, match=r"no batch of 100 tokens in partition 'train' within 0\.05 s"):
            await buf.sample(0, token_budget=100, timeout=0.05)
        assert ready_uids(buf) == ["a"]


async def test_a_cancelled_token_sample_takes_nothing_and_passes_the_turn_on() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        async with anyio.create_task_group() as tg:
            first = await start_call(tg, lambda: buf.sample(0, token_budget=100))
            second = await start_call(tg, lambda: buf.sample(0, 1))
            await put(buf, "a", 60)
            await anyio.wait_all_tasks_blocked()
            assert not first.done
            assert not second.done
            first.scope.cancel()
            await anyio.wait_all_tasks_blocked()
            assert second.returned
            assert second.result[0].uids == ["a"]
            assert not first.done
        assert resident_uids(buf) == []


async def test_parked_samples_are_served_in_order_whatever_they_ask_for() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        async with anyio.create_task_group() as tg:
            by_count = await start_call(tg, lambda: buf.sample(0, 2))
            by_tokens = await start_call(tg, lambda: buf.sample(0, token_budget=50))
            for uid, tokens in (("a", 10), ("b", 10), ("c", 30), ("d", 20)):
                await put(buf, uid, tokens)
            await anyio.wait_all_tasks_blocked()
            assert by_count.result[0].uids == ["a", "b"]
            assert by_tokens.result[0].uids == ["c", "d"]


async def test_closing_wakes_a_parked_token_sample_with_buffer_closed_error() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        async with anyio.create_task_group() as tg:
            call = await start_call(tg, lambda: buf.sample(0, token_budget=100))
            buf.close()
            await anyio.wait_all_tasks_blocked()
            assert isinstance(call.error, BufferClosedError)
        with pytest.raises(BufferClosedError):
            await buf.sample(0, token_budget=100)


async def test_a_parked_token_sample_wakes_when_the_gate_opens() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=1, max_off_policy_strategy="wait")
        await buf.add_prompt("old", global_steps=0)
        await put(buf, "a", 100, step=1)
        async with anyio.create_task_group() as tg:
            call = await start_call(tg, lambda: buf.sample(1, token_budget=100))
            assert not call.done
            explained = buf.explain_wait()
            assert (explained.token_budget, explained.batch_size, explained.short_by_tokens) == (100, None, 0)
            assert explained.gate_held_by == "old"
            await buf.put("old", "x", tokens=5)
            await buf.mark_finished("old")
            await anyio.wait_all_tasks_blocked()
            assert call.result[0].uids == ["old"]  # 5, then "a" would make 105 > 100


async def test_explain_wait_says_how_many_tokens_a_token_sample_lacks() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        await put(buf, "a", 60)
        async with anyio.create_task_group() as tg:
            call = await start_call(tg, lambda: buf.sample(0, token_budget=100))
            explained = buf.explain_wait()
            assert (explained.token_budget, explained.short_by_tokens, explained.sampleable) == (100, 40, 1)
            assert "the batch of 100 tokens is short by 40 token(s)" in explained.reason
            call.scope.cancel()


async def test_a_straggler_cut_at_its_deadline_completes_a_waiting_token_batch() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4, group_deadline_seconds=0.05, group_quorum=1)
        await put(buf, "a", 60)
        await buf.add_prompt("slow", global_steps=0)
        await buf.put("slow", "x", tokens=40)
        batch, metrics = await buf.sample(0, token_budget=100)  # the cut makes "slow" finished
        assert batch.uids == ["a", "slow"]
        assert batch.groups[1].status is Status.FINISHED
        assert fill(metrics) == [100.0, 1.0, 0.0]


async def test_a_status_line_names_the_token_budget(caplog: pytest.LogCaptureFixture) -> None:
    with anyio.fail_after(LIMIT):
        buf = ReplayBuffer(SamplerConfig(), status_log_interval=0.01)
        caplog.set_level(logging.INFO, logger="stalebuf")
        with pytest.raises(TimeoutError):
            await buf.sample(0, token_budget=100, timeout=0.05)
        lines = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
        assert lines
        assert lines[0].startswith("sample(global_steps=0, token_budget=100) on partition 'train'")
        assert "short by 100 token(s)" in lines[0]


async def test_a_restored_buffer_keeps_the_ready_tokens_and_samples_by_tokens_alike() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=4)
        for uid, tokens in (("a", 60), ("b", 40), ("c", 30)):
            await put(buf, uid, tokens)
        await buf.put_group("v", ["x", "y"], global_steps=0, versions=[[(0, 5)], [(0, 15)]])
        await buf.add_prompt("flying", global_steps=0)
        await buf.put("flying", "z", tokens=70)
        for in_flight in ("keep", "reissue", "evict"):
            restored = ReplayBuffer.restore(
                buf.checkpoint(), in_flight=in_flight, status_log_interval=None
            ).buffer
            assert ready_tokens(restored) == (150, 150)  # the in-flight group's 70 are not ready
            batch, metrics = await restored.sample(0, token_budget=100)
            assert batch.uids == ["a", "b"]
            assert fill(metrics) == [100.0, 1.0, 0.0]
            assert ready_tokens(restored) == (50, 50)
