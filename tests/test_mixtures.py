"""Task mixtures (issue 23, second part): ``SamplerConfig.mixture/mixture_tag/mixture_policy/
task_thresholds``.

Every expected value comes from the issue's text, never from the code under test: quotas by the
largest-remainder method in exact rational arithmetic (equal remainders to the name sorting
first), exactly ``B`` groups oldest first overall, FIFO per task; ``wait`` waits for every
quota; ``borrow`` takes (1) what would be stale at the next step, (2) each task's allowance
``max(0, q_i + b_i)``, (3) the rest, oldest first, with balances summing to 0 within ``±4B``;
admission per task (``q_i(b)`` per tag, one producer FIFO per task); per-task thresholds in
every rule; the refusals; the per-task stats and metrics; the starvation warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import (
    LIMIT,
    assert_conserved,
    full_snapshot,
    patch_mixture_clock,
    resident_uids,
    settle,
    start_call,
    train_stats,
)
from stalebuf import ConfigError, ReplayBuffer, SamplerConfig, StalenessPolicy
from stalebuf.errors import BufferFullError

pytestmark = pytest.mark.anyio

PREFIX = "training"


# -- the reference: the issue's largest-remainder quotas ------------------------------------------


def reference_quotas(weights: Mapping[str, Any], batch_size: int) -> dict[str, int]:
    """Largest remainder on the normalised weights, exact fractions, ties to the name sorting first."""
    exact = {task: Fraction(weight) for task, weight in weights.items()}
    total = sum(exact.values())
    ideal = {task: batch_size * weight / total for task, weight in exact.items()}
    floors = {task: value.numerator // value.denominator for task, value in ideal.items()}
    left = batch_size - sum(floors.values())
    order = sorted(ideal, key=lambda task: (-(ideal[task] - floors[task]), task))
    return {task: floors[task] + (1 if task in order[:left] else 0) for task in weights}


def mixed(
    mixture: Mapping[str, Any],
    *,
    on_evict: Any = None,
    status_log_interval: float | None = None,
    **config: Any,
) -> ReplayBuffer:
    return ReplayBuffer(
        SamplerConfig(mixture=mixture, **config), on_evict=on_evict, status_log_interval=status_log_interval
    )


async def put(buf: ReplayBuffer, uid: str, task: str, step: int | None = None, **kwargs: Any) -> None:
    await buf.put_group(uid, ["x"], tags={"task": task}, global_steps=step, **kwargs)


def tasks_of(batch: Any) -> list[str]:
    return [group.tags["task"] for group in batch.groups]


# -- quotas ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "batch_size", "expected"),
    [
        ({"a": 1, "b": 1, "c": 1}, 4, {"a": 2, "b": 1, "c": 1}),  # tie: the name sorting first
        ({"c": 1, "b": 1, "a": 1}, 5, {"a": 2, "b": 2, "c": 1}),
        ({"math": 3, "code": 1}, 4, {"math": 3, "code": 1}),
        ({"math": 3, "code": 1}, 2, {"math": 1, "code": 1}),  # .5/.5: "code" sorts first
        ({"math": 0.75, "code": 0.25}, 6, {"math": 4, "code": 2}),  # 4.5/1.5: "code" first
        ({"a": 0.1, "b": 0.2, "c": 0.7}, 10, {"a": 1, "b": 2, "c": 7}),  # float weights, exactly
        ({"a": Fraction(1, 3), "b": Fraction(2, 3)}, 3, {"a": 1, "b": 2}),
        ({"x": 5, "y": 3, "z": 2}, 7, {"x": 4, "y": 2, "z": 1}),  # 3.5, 2.1, 1.4
    ],
)
def test_quotas_are_the_largest_remainder_on_the_weights(
    weights: dict[str, Any], batch_size: int, expected: dict[str, int]
) -> None:
    assert reference_quotas(weights, batch_size) == expected  # the reference, checked by hand
    policy = StalenessPolicy(SamplerConfig(mixture=weights))
    assert policy.task_quotas("train", batch_size) == expected


WEIGHTS = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d", "e"]),
    st.one_of(
        st.integers(1, 20),
        st.fractions(min_value=Fraction(1, 50), max_value=10),
        st.floats(min_value=0.01, max_value=10, allow_nan=False, allow_infinity=False),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(weights=WEIGHTS, batch_size=st.integers(1, 300))
def test_quotas_match_the_reference_for_any_weights(weights: dict[str, Any], batch_size: int) -> None:
    policy = StalenessPolicy(SamplerConfig(mixture=weights))
    quotas = policy.task_quotas("train", batch_size)
    assert quotas == reference_quotas(weights, batch_size)
    assert sum(quotas.values()) == batch_size
    total = sum(Fraction(weight) for weight in weights.values())
    for task, weight in weights.items():  # each share within 1/B of its weight
        assert abs(Fraction(quotas[task], batch_size) - Fraction(weight) / total) < Fraction(1, batch_size)


async def test_a_batch_takes_each_tasks_quota_oldest_first_and_lists_it_oldest_first_overall() -> None:
    buf = mixed({"a": 2, "b": 1}, max_off_policy_threshold=10)
    with anyio.fail_after(LIMIT):
        # admission order: b1@0 a1@1 a2@0 b2@0 a3@1 b3@1 a4@0
        for uid, task, step in (
            ("b1", "b", 0),
            ("a1", "a", 1),
            ("a2", "a", 0),
            ("b2", "b", 0),
            ("a3", "a", 1),
            ("b3", "b", 1),
            ("a4", "a", 0),
        ):
            await put(buf, uid, task, step)
        batch, metrics = await buf.sample(1, 3, timeout=0)
        # a's two oldest: a2@0, a4@0; b's oldest: b1@0; overall by (step, admission order)
        assert batch.uids == ["b1", "a2", "a4"]
        assert metrics[f"{PREFIX}/mixture/a/groups"] == 2
        assert metrics[f"{PREFIX}/mixture/b/groups"] == 1
        batch, _ = await buf.sample(1, 3, timeout=0)
        assert batch.uids == ["b2", "a1", "a3"]
        assert_conserved(buf)


# -- mixture_policy="wait" ------------------------------------------------------------------------


async def test_wait_waits_until_every_task_fills_its_quota_and_shows_the_shortage() -> None:
    buf = mixed({"a": 1, "b": 1}, max_off_policy_threshold=5)
    with anyio.fail_after(LIMIT):
        for i in range(3):
            await put(buf, f"a{i}", "a")
        tasks = train_stats(buf).tasks
        assert (tasks["a"].shortage, tasks["b"].shortage) == (0, 0)  # 0 before any sample
        with pytest.raises(TimeoutError):
            await buf.sample(0, 4, timeout=0)
        tasks = train_stats(buf).tasks
        assert (tasks["a"].shortage, tasks["b"].shortage) == (0, 2)
        assert (tasks["a"].resident, tasks["b"].resident) == (3, 0)
        async with anyio.create_task_group() as tg:
            sampler = await start_call(tg, lambda: buf.sample(0, 4))
            await put(buf, "b0", "b")
            await settle()
            assert not sampler.done
            await put(buf, "b1", "b")
            await settle()
            assert sampler.returned
        batch, _ = sampler.result
        assert batch.uids == ["a0", "a1", "b0", "b1"]
        tasks = train_stats(buf).tasks
        assert (tasks["a"].shortage, tasks["b"].shortage) == (1, 2)  # a holds a2; quota 2 each
        assert (tasks["a"].sampled, tasks["b"].sampled) == (2, 2)
        assert (tasks["a"].balance, tasks["b"].balance) == (0, 0)  # no balances under wait
        assert_conserved(buf)


async def test_a_task_that_never_produces_makes_wait_wait() -> None:
    buf = mixed({"a": 1, "b": 1})
    with anyio.fail_after(LIMIT):
        for i in range(10):
            await put(buf, f"a{i}", "a")
        with pytest.raises(TimeoutError):
            await buf.sample(0, 2, timeout=0.05)
        assert train_stats(buf).tasks["b"].shortage == 1


async def test_wait_blocked_by_a_tasks_shortage_for_three_intervals_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Defect (fixed on main meanwhile, b48c1fa): under ``wait`` a sample blocked by one task's
    shortage logged no starvation WARNING; only the borrow balance fired it."""
    buf = mixed({"apples": 1, "berries": 1}, status_log_interval=0.02)
    with anyio.fail_after(LIMIT), caplog.at_level(logging.INFO, logger="stalebuf"):
        await put(buf, "a0", "apples")
        with pytest.raises(TimeoutError):
            await buf.sample(0, 2, timeout=0.3)  # 15 intervals
        messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        starved = [line for line in messages if "starved" in line]
        assert len(starved) == 1, starved  # once per task per 60 s
        assert "'berries'" in starved[0]
        assert "'apples'" not in starved[0]
        assert "50" in starved[0]  # its target: 50%


async def test_wait_blocked_for_less_than_three_intervals_does_not_warn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    buf = mixed({"apples": 1, "berries": 1}, status_log_interval=1.0)
    with anyio.fail_after(LIMIT), caplog.at_level(logging.INFO, logger="stalebuf"):
        await put(buf, "a0", "apples")
        with pytest.raises(TimeoutError):
            await buf.sample(0, 2, timeout=0.5)  # half an interval
        assert not [r for r in caplog.records if "starved" in r.getMessage()]


async def test_the_status_line_of_a_blocked_sample_shows_the_shortage_per_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Defect (fixed on main meanwhile, b48c1fa): the status line of a blocked sample did not
    say which task was short of its quota."""
    buf = mixed({"apples": 1, "berries": 1}, status_log_interval=0.02)
    with anyio.fail_after(LIMIT), caplog.at_level(logging.INFO, logger="stalebuf"):
        await put(buf, "a0", "apples")
        with pytest.raises(TimeoutError):
            await buf.sample(0, 2, timeout=0.1)
        lines = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
        assert lines, "no status line at all"
        assert all("'berries'" in line for line in lines), lines
        assert not any("'apples'" in line for line in lines), lines


# -- mixture_policy="borrow" ----------------------------------------------------------------------


async def test_borrow_takes_each_group_from_its_own_task() -> None:
    """Defect: borrow labelled every group it merged across the tasks with the last task, so the
    first batch was removed from the wrong task's cell: a KeyError under admission, and without it
    a task with resident -1 and groups that could never be sampled."""
    for admission in (None, 2):
        buf = mixed({"a": 1, "b": 1}, mixture_policy="borrow", admission_batch_size=admission)
        with anyio.fail_after(LIMIT):
            await put(buf, "a1", "a")
            await put(buf, "b1", "b")
            batch, metrics = await buf.sample(0, 2, timeout=0)
            assert batch.uids == ["a1", "b1"]
            tasks = train_stats(buf).tasks
            assert (tasks["a"].resident, tasks["a"].sampled, tasks["a"].balance) == (0, 1, 0)
            assert (tasks["b"].resident, tasks["b"].sampled, tasks["b"].balance) == (0, 1, 0)
            assert metrics[f"{PREFIX}/mixture/a/groups"] == metrics[f"{PREFIX}/mixture/b/groups"] == 1
            await put(buf, "a2", "a")
            await put(buf, "b2", "b")
            batch, _ = await buf.sample(0, 2, timeout=0)
            assert batch.uids == ["a2", "b2"]
            assert_conserved(buf)


async def test_borrow_lends_a_shortfall_and_pays_it_back() -> None:
    buf = mixed({"a": 1, "b": 1}, mixture_policy="borrow", max_off_policy_threshold=10)
    with anyio.fail_after(LIMIT):
        for uid in ("a1", "a2", "a3"):
            await put(buf, uid, "a")
        # b has nothing: its quota 1 is filled from a (oldest first)
        batch, metrics = await buf.sample(0, 2, timeout=0)
        assert batch.uids == ["a1", "a2"]
        assert (metrics[f"{PREFIX}/mixture/a/balance"], metrics[f"{PREFIX}/mixture/b/balance"]) == (-1, 1)
        tasks = train_stats(buf).tasks
        assert (tasks["a"].balance, tasks["b"].balance) == (-1, 1)
        for uid in ("b1", "b2", "b3"):
            await put(buf, uid, "b")
        # allowances: a max(0, 1 - 1) = 0, b 1 + 1 = 2: b is paid back
        batch, metrics = await buf.sample(0, 2, timeout=0)
        assert batch.uids == ["b1", "b2"]
        assert (metrics[f"{PREFIX}/mixture/a/balance"], metrics[f"{PREFIX}/mixture/b/balance"]) == (0, 0)
        batch, _ = await buf.sample(0, 2, timeout=0)
        assert batch.uids == ["a3", "b3"]
        assert_conserved(buf)


async def test_borrow_never_trains_a_group_staler_than_t_the_issues_counterexample() -> None:
    """T=2, S=1, b=B=2, two equal tasks, wait, consecutive samples: after a lent to b, b's
    allowance of 2 would leave a's group tagged 1 for sample(3) at s=3 without step (1)."""
    buf = mixed(
        {"a": 1, "b": 1},
        mixture_policy="borrow",
        max_off_policy_threshold=2,
        admission_batch_size=2,
        max_off_policy_strategy="wait",
    )
    trained: list[tuple[str, int, int]] = []  # (uid, dispatch step, g)

    async def sample(g: int) -> list[str]:
        batch, _ = await buf.sample(g, 2, timeout=0)
        trained.extend((group.uid, group.dispatch_step, g) for group in batch.groups)
        return batch.uids

    with anyio.fail_after(LIMIT):
        await put(buf, "a1", "a")
        await put(buf, "b1", "b")
        assert await sample(0) == ["a1", "b1"]
        await put(buf, "a2", "a")  # tag 0
        with pytest.raises(TimeoutError):
            await sample(1)  # the clock moves to 1; one group only
        await put(buf, "a3", "a")  # tag 1
        assert await sample(1) == ["a2", "a3"]  # a lends one to b
        assert [t.balance for t in train_stats(buf).tasks.values()] == [-1, 1]
        buf.add_prompt_nowait("a4", tags={"task": "a"})  # tag 1, in flight
        buf.mark_running_nowait("a4")
        await put(buf, "b2", "b")  # tag 1
        with pytest.raises(TimeoutError):
            await sample(2)  # the gate: a4 is in flight at s = 2
        await put(buf, "b3", "b")  # tag 2
        buf.put_nowait("a4", "x")
        buf.mark_finished_nowait("a4")
        # a4 and b2 would be stale at step 3: both are taken now, whatever the allowances
        assert await sample(2) == ["a4", "b2"]
        await put(buf, "a5", "a")  # tag 2
        assert await sample(3) == ["b3", "a5"]
        for uid, step, g in trained:
            assert g - step + 1 <= 2, f"{uid} trained at s = {g - step + 1}"
        assert_conserved(buf)


async def test_balances_are_capped_at_4b_and_still_sum_to_zero(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    patch_mixture_clock(monkeypatch, lambda: now[0])
    buf = mixed({"a": 1, "b": 1}, mixture_policy="borrow", max_off_policy_threshold=None)
    with anyio.fail_after(LIMIT), caplog.at_level(logging.WARNING, logger="stalebuf"):

        def warnings() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

        for step in range(12):
            await put(buf, f"x{step}", "a")
            await put(buf, f"y{step}", "a")
            _, metrics = await buf.sample(step, 2, timeout=0)
            balance = metrics[f"{PREFIX}/mixture/b/balance"]
            assert balance == min(step + 1, 8)  # +1 per batch, capped at 4 * B
            assert metrics[f"{PREFIX}/mixture/a/balance"] == -balance
            assert metrics[f"{PREFIX}/mixture/b/share"] == 0.0
            assert metrics[f"{PREFIX}/mixture/a/share"] == 1.0
            if step == 1:
                assert warnings() == []  # grown over 2 samples only
            if step == 2:
                (line,) = warnings()  # grown over 3 consecutive samples
                assert "'b'" in line
                assert "50" in line  # its target: 50%
            if step == 3:
                now[0] += 61.0
            if step == 4:
                assert len(warnings()) == 2  # once per task per 60 s
            if step == 9:
                now[0] += 61.0
        assert len(warnings()) == 2  # at the cap the balance no longer grows: no warning
        assert_conserved(buf)


async def test_the_clipped_amount_moves_to_balances_of_the_opposite_sign() -> None:
    buf = mixed({"a": 1, "b": 1, "c": 1}, mixture_policy="borrow", max_off_policy_threshold=None)
    with anyio.fail_after(LIMIT):
        for step in range(10):
            for i in range(3):
                await put(buf, f"a{step}-{i}", "a")
            _, metrics = await buf.sample(step, 3, timeout=0)
            balances = {task: metrics[f"{PREFIX}/mixture/{task}/balance"] for task in "abc"}
            assert sum(balances.values()) == 0
            assert all(abs(balance) <= 12 for balance in balances.values()), balances
            expected_a = max(-2 * (step + 1), -12)
            assert balances["a"] == expected_a
            assert balances["b"] + balances["c"] == -expected_a


async def test_borrow_converges_to_the_weights_when_every_task_produces_enough() -> None:
    """Each task produces its weight's share on average but in bursts; over a long run each
    task's share is within 1/B of its weight."""
    weights = {"a": 5, "b": 3, "c": 2}
    batch_size = 10
    buf = mixed(weights, mixture_policy="borrow", max_off_policy_threshold=None)
    bursts = {"a": [10, 0, 5], "b": [0, 9, 0], "c": [3, 0, 3]}  # per 3 steps: 15, 9, 6 = 3 batches
    taken = dict.fromkeys(weights, 0)
    with anyio.fail_after(LIMIT):
        uid = 0
        for step in range(300):
            for task, burst in bursts.items():
                for _ in range(burst[step % 3]):
                    uid += 1
                    await put(buf, f"g{uid}", task)
            batch, metrics = await buf.sample(step, batch_size, timeout=0)
            assert len(batch) == batch_size
            for task in tasks_of(batch):
                taken[task] += 1
            balances = [metrics[f"{PREFIX}/mixture/{task}/balance"] for task in weights]
            assert sum(balances) == 0
            assert max(map(abs, balances)) <= 4 * batch_size
        total = sum(taken.values())
        for task, weight in weights.items():
            assert abs(taken[task] / total - weight / 10) <= 1 / batch_size
        assert_conserved(buf)


# -- admission per task ---------------------------------------------------------------------------


async def test_capacity_free_slots_and_full_per_task() -> None:
    buf = mixed(
        {"math": 3, "code": 1},
        max_off_policy_threshold=2,
        admission_batch_size=4,
        task_thresholds={"code": 3},
    )
    with anyio.fail_after(LIMIT):
        assert buf.capacity(task="math") == 2 * 1 * 3  # T_math * S * q_math(4)
        assert buf.capacity(task="code") == 3 * 1 * 1
        assert buf.capacity() == 9  # summed over the tasks
        assert (buf.free_slots(task="math"), buf.free_slots(task="code"), buf.free_slots()) == (3, 1, 4)
        await put(buf, "c0", "code")
        assert buf.full(task="code")
        assert not buf.full(task="math")
        assert not buf.full()  # all of the tasks
        assert buf.free_slots() == 3
        for i in range(3):
            await put(buf, f"m{i}", "math")
        assert buf.full(task="math")
        assert buf.full()
        assert buf.free_slots() == 0
        assert train_stats(buf).capacity == 9


async def test_a_producer_waits_only_behind_producers_of_its_own_task() -> None:
    buf = mixed({"a": 1, "b": 1}, max_off_policy_threshold=2, admission_batch_size=2)
    with anyio.fail_after(LIMIT):
        await put(buf, "a0", "a")  # a's one slot at step 0
        async with anyio.create_task_group() as tg:
            waiting_a = await start_call(tg, lambda: buf.add_prompt("a1", tags={"task": "a"}))
            assert not waiting_a.done
            assert train_stats(buf).waiting_producers == 1
            # b is not blocked behind a's waiting producer
            buf.add_prompt_nowait("b0", tags={"task": "b"})
            assert buf.full(task="b")
            waiting_b = await start_call(tg, lambda: buf.add_prompt("b1", tags={"task": "b"}))
            assert train_stats(buf).waiting_producers == 2
            # b0 fails (sampleable) and is sampled with a0: each task's slot at step 0 frees
            buf.mark_failed_nowait("b0")
            batch, _ = await buf.sample(0, 2, timeout=0)
            assert batch.uids == ["a0", "b0"]
            await settle()
            assert waiting_a.returned
            assert waiting_b.returned
        assert set(resident_uids(buf)) == {"a1", "b1"}
        assert_conserved(buf)


async def test_a_freed_slot_of_one_task_does_not_admit_a_producer_of_another() -> None:
    buf = mixed(
        {"a": 1, "b": 1}, max_off_policy_threshold=2, admission_batch_size=2, failure_strategy="evict"
    )
    with anyio.fail_after(LIMIT):
        await put(buf, "a0", "a")
        buf.add_prompt_nowait("b0", tags={"task": "b"})
        async with anyio.create_task_group() as tg:
            waiting_a = await start_call(tg, lambda: buf.add_prompt("a1", tags={"task": "a"}))
            buf.mark_failed_nowait("b0")
            with pytest.raises(TimeoutError):
                await buf.sample(0, 2, timeout=0)  # evicts b0: b's slot is free, a's is not
            await settle()
            assert buf.free_slots(task="b") == 1
            assert buf.free_slots(task="a") == 0
            assert not waiting_a.done
            waiting_a.scope.cancel()
        assert resident_uids(buf) == ["a0"]


@pytest.mark.parametrize("policy", ["wait", "borrow"])
async def test_admission_paces_each_task_at_its_quota_of_b(policy: str) -> None:
    buf = mixed({"a": 3, "b": 1}, max_off_policy_threshold=1, admission_batch_size=4, mixture_policy=policy)
    for task, quota in (("a", 3), ("b", 1)):
        for i in range(quota):
            buf.add_prompt_nowait(f"{task}{i}", tags={"task": task})
        with pytest.raises(BufferFullError):
            buf.add_prompt_nowait(f"{task}-extra", tags={"task": task})
        with pytest.raises(BufferFullError):
            buf.put_group_nowait(f"{task}-extra", ["x"], tags={"task": task})
    assert train_stats(buf).tasks["a"].resident == 3
    assert train_stats(buf).tasks["b"].resident == 1


# -- per-task thresholds ----------------------------------------------------------------------------


async def test_task_thresholds_apply_to_the_drop_rule() -> None:
    events: list[Any] = []
    buf = mixed(
        {"math": 1, "code": 1},
        max_off_policy_threshold=1,
        task_thresholds={"code": 3},
        on_evict=events.append,
    )
    with anyio.fail_after(LIMIT):
        await put(buf, "m0", "math", 0)
        await put(buf, "c0", "code", 0)
        await put(buf, "m2", "math", 2)
        await put(buf, "c2", "code", 2)
        batch, _ = await buf.sample(2, 2, timeout=0)  # age 3: math (T=1) drops m0, code (T=3) keeps c0
        assert batch.uids == ["c0", "m2"]
        assert [group.uid for event in events for group in event.groups] == ["m0"]
        assert buf.sampleable_count(2, task="code") == 1
        assert buf.sampleable_count(2, task="math") == 0
        assert buf.sampleable_count(4, task="code") == 1  # c2: age 3 at step 4 still
        assert buf.sampleable_count(5, task="code") == 0
        assert buf.sampleable_count(2) == 1
        assert_conserved(buf)


async def test_task_thresholds_apply_to_the_wait_gate() -> None:
    buf = mixed(
        {"math": 1, "code": 1},
        max_off_policy_threshold=2,
        task_thresholds={"code": 4},
        max_off_policy_strategy="wait",
    )
    with anyio.fail_after(LIMIT):
        buf.add_prompt_nowait("c-open", global_steps=0, tags={"task": "code"})
        await put(buf, "m1", "math", 1)
        await put(buf, "c1", "code", 1)
        # the open code group has age 3 at step 2: below code's T=4, so the gate is open
        batch, _ = await buf.sample(2, 2, timeout=0)
        assert batch.uids == ["m1", "c1"]
        buf.add_prompt_nowait("m-open", global_steps=1, tags={"task": "math"})
        await put(buf, "m2", "math", 2)
        await put(buf, "c2", "code", 2)
        with pytest.raises(TimeoutError):  # age 2 >= math's T=2: the gate is closed
            await buf.sample(2, 2, timeout=0)


async def test_task_thresholds_apply_to_the_mask_of_the_batch() -> None:
    """Defect (fixed on main meanwhile, b48c1fa): under ``mask`` the batch masked every group's
    tokens with the global T, ignoring its task's own threshold (``loss_excluded``,
    ``freshness_mask``, ``masked_tokens``)."""
    buf = mixed(
        {"math": 1, "code": 1},
        max_off_policy_threshold=1,
        max_off_policy_strategy="mask",
        task_thresholds={"code": 3},
    )
    with anyio.fail_after(LIMIT):
        await buf.put_group("c", ["x"], tags={"task": "code"}, global_steps=0, versions=[[(0, 4)]])
        await buf.put_group("m", ["x"], tags={"task": "math"}, global_steps=1, versions=[[(1, 4)]])
        batch, metrics = await buf.sample(1, 2, timeout=0)
        assert batch.uids == ["c", "m"]  # kept: its tokens have age 2 <= code's T = 3
        assert batch.loss_excluded.tolist() == [False, False]
        assert batch.freshness_mask()[0].all()
        assert metrics[f"{PREFIX}/off_policy/masked_tokens"] == 0
        assert train_stats(buf).masked_tokens == 0


# -- refusals -----------------------------------------------------------------------------------------


async def invoke(call: Any) -> None:
    """Call ``call`` and await what it returns if that is awaitable."""
    result = call()
    if hasattr(result, "__await__"):
        await result


def _refusals(buf: ReplayBuffer, partition: str) -> list[tuple[str, Any]]:
    return [
        ("add_prompt_nowait-missing", lambda: buf.add_prompt_nowait("new", partition=partition)),
        (
            "add_prompt_nowait-unknown",
            lambda: buf.add_prompt_nowait("new", partition=partition, tags={"task": "art"}),
        ),
        (
            "add_prompt_nowait-not-str",
            lambda: buf.add_prompt_nowait("new", partition=partition, tags={"task": 1}),
        ),
        ("add_prompt-other-tag", lambda: buf.add_prompt("new", partition=partition, tags={"kind": "a"})),
        ("put_group-missing", lambda: buf.put_group("new", ["x"], partition=partition)),
        (
            "put_group_nowait-unknown",
            lambda: buf.put_group_nowait("new", ["x"], partition=partition, tags={"task": "z"}),
        ),
        (
            "put_group-failed-unknown",
            lambda: buf.put_group("new", ["x"], partition=partition, tags={"task": "A"}, status="failed"),
        ),
        (
            "put_group-tagged-missing",
            lambda: buf.put_group("new", ["x"], partition=partition, trajectory_tags=[{"task": "a"}]),
        ),
    ]


@pytest.mark.parametrize("admission", [None, 2])
@pytest.mark.parametrize("partition", ["train", "aux"])
async def test_a_group_without_a_task_of_the_mixture_is_refused_and_nothing_changes(
    partition: str, admission: int | None
) -> None:
    buf = mixed({"a": 1, "b": 1}, admission_batch_size=admission)
    with anyio.fail_after(LIMIT):
        await put(buf, "a0", "a")
        for name, call in _refusals(buf, partition):
            before = full_snapshot(buf)
            with pytest.raises(ValueError, match="task") as info:
                await invoke(call)
            assert type(info.value) is ValueError, name
            assert full_snapshot(buf) == before, name
            assert "aux" not in buf.stats().partitions, f"{name} created the partition"
        with pytest.raises(ValueError, match="task"):
            async with buf.rollout("new", partition=partition):
                pass
        assert "aux" not in buf.stats().partitions


async def test_an_exempt_partition_has_no_quotas_and_needs_no_task() -> None:
    buf = mixed({"a": 1, "b": 1, "c": 1}, admission_batch_size=3)
    with anyio.fail_after(LIMIT):
        await buf.put_group("v0", ["x"], partition="val")
        await buf.put_group("v1", ["x"], partition="val", tags={"task": "unknown"})
        batch, metrics = await buf.sample(0, 1, partition="val", timeout=0)  # B=1: quota 0 would be refused
        assert batch.uids == ["v0"]
        assert not any("/mixture/" in key for key in metrics)
        assert buf.stats().partitions["val"].tasks == {}
        assert buf.capacity("val") is None
        assert buf.free_slots("val") is None
        assert not buf.full("val")
        for call in (
            lambda: buf.capacity("val", task="a"),
            lambda: buf.free_slots("val", task="a"),
            lambda: buf.full("val", task="a"),
            lambda: buf.sampleable_count(0, "val", task="a"),
        ):
            with pytest.raises(ValueError, match="task"):
                call()


@pytest.mark.parametrize("batch_size", [1, 2])
async def test_a_batch_size_that_gives_a_task_no_group_is_refused(batch_size: int) -> None:
    buf = mixed({"a": 1, "b": 1, "c": 1})
    with anyio.fail_after(LIMIT):
        for task in "abc":
            await put(buf, f"{task}0", task)
        before = full_snapshot(buf)
        with pytest.raises(ValueError, match="'c'"):
            await buf.sample(0, batch_size, timeout=0)
        with pytest.raises(ValueError, match="'c'"):
            buf.sample_nowait(0, batch_size)
        with pytest.raises(ValueError, match="'c'"):
            await buf.sample(0, batch_size, partition="new", timeout=0)
        assert full_snapshot(buf) == before
        batch, _ = await buf.sample(0, 3, timeout=0)
        assert batch.uids == ["a0", "b0", "c0"]


def test_an_admission_batch_size_that_gives_a_task_no_slot_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'c'"):
        SamplerConfig(mixture={"a": 1, "b": 1, "c": 1}, admission_batch_size=2)
    with pytest.raises(ConfigError, match="'b'"):
        SamplerConfig(mixture={"a": 9, "b": 1}, admission_batch_size=4)  # 3.6 / 0.4: b gets 0
    with pytest.raises(ConfigError, match="'b'"):
        SamplerConfig(mixture={"a": 9, "b": 1}, admission_batch_size=5)  # 4.5 / 0.5: the tie goes to "a"
    assert SamplerConfig(mixture={"a": 9, "b": 1}, admission_batch_size=6).admission_batch_size == 6


# -- stats and metrics -----------------------------------------------------------------------------------


async def test_task_stats_count_every_status_and_what_was_sampled() -> None:
    buf = mixed({"a": 1, "b": 1}, failure_strategy="sample")
    with anyio.fail_after(LIMIT):
        buf.add_prompt_nowait("a-pend", tags={"task": "a"})
        buf.add_prompt_nowait("a-run", tags={"task": "a"})
        buf.mark_running_nowait("a-run")
        await put(buf, "a-fin", "a")
        await put(buf, "b-fail", "b", status="failed")
        await put(buf, "b-fin", "b")
        tasks = train_stats(buf).tasks
        assert (tasks["a"].resident, tasks["b"].resident) == (3, 2)
        assert (tasks["a"].sampled, tasks["b"].sampled) == (0, 0)
        batch, _ = await buf.sample(0, 2, timeout=0)
        assert batch.uids == ["a-fin", "b-fail"]
        tasks = train_stats(buf).tasks
        assert (tasks["a"].resident, tasks["b"].resident) == (2, 1)
        assert (tasks["a"].sampled, tasks["b"].sampled) == (1, 1)
        assert (tasks["a"].shortage, tasks["b"].shortage) == (1, 0)
        assert buf.sampleable_count(0, task="a") == 0
        assert buf.sampleable_count(0, task="b") == 1
        assert buf.sampleable_count(0) == 1
        assert_conserved(buf)


async def test_mixture_metrics_and_the_share_over_the_last_256_sampled_groups() -> None:
    buf = mixed({"a": 1, "b": 1}, mixture_policy="borrow", max_off_policy_threshold=None)
    with anyio.fail_after(LIMIT):
        for i in range(200):  # 200 batches of a only: 400 groups of a, b's balance capped at 8
            await put(buf, f"a{i}-0", "a")
            await put(buf, f"a{i}-1", "a")
            _, metrics = await buf.sample(i, 2, timeout=0)
        assert (metrics[f"{PREFIX}/mixture/a/share"], metrics[f"{PREFIX}/mixture/b/share"]) == (1.0, 0.0)
        for i in range(3):  # then b alone, paid back: its allowance is 1 + 8
            await put(buf, f"b{i}-0", "b")
            await put(buf, f"b{i}-1", "b")
            _, metrics = await buf.sample(200 + i, 2, timeout=0)
        # the last 256 sampled: the 6 groups of b and 250 of a
        assert metrics[f"{PREFIX}/mixture/b/share"] == 6 / 256
        assert metrics[f"{PREFIX}/mixture/a/share"] == 250 / 256
        assert metrics[f"{PREFIX}/mixture/a/groups"] == 0
        assert metrics[f"{PREFIX}/mixture/b/groups"] == 2
        assert metrics[f"{PREFIX}/mixture/b/balance"] == 5
        names = ("groups", "balance", "share")
        keys = {key for key in metrics if "/mixture/" in key}
        assert keys == {f"{PREFIX}/mixture/{task}/{name}" for task in "ab" for name in names}


async def test_the_balance_cap_is_4b_of_the_current_call() -> None:
    buf = mixed({"a": 1, "b": 1}, mixture_policy="borrow", max_off_policy_threshold=None)
    with anyio.fail_after(LIMIT):
        for step in range(6):  # B=4, b never produces: +2 a batch, capped at 16
            for i in range(4):
                await put(buf, f"a{step}-{i}", "a")
            _, metrics = await buf.sample(step, 4, timeout=0)
        assert metrics[f"{PREFIX}/mixture/b/balance"] == 12
        for i in range(2):
            await put(buf, f"late{i}", "a")
        _, metrics = await buf.sample(6, 2, timeout=0)  # B=2 now: the cap is 8
        balances = [metrics[f"{PREFIX}/mixture/{task}/balance"] for task in "ab"]
        assert balances == [-8, 8]
        assert [task.balance for task in train_stats(buf).tasks.values()] == [-8, 8]


async def test_task_thresholds_apply_to_in_flight_eviction() -> None:
    events: list[Any] = []
    buf = mixed(
        {"math": 1, "code": 1},
        max_off_policy_threshold=1,
        task_thresholds={"code": 3},
        admission_batch_size=2,
        evict_stale_in_flight=True,
        on_evict=events.append,
    )
    with anyio.fail_after(LIMIT):
        for uid, task in (("m0", "math"), ("c0", "code")):
            buf.add_prompt_nowait(uid, tags={"task": task})  # tagged 0
            buf.mark_running_nowait(uid)
        with pytest.raises(TimeoutError):
            await buf.sample(2, 2, timeout=0)  # age 3: over math's T=1, within code's T=3
        assert [group.uid for event in events for group in event.groups] == ["m0"]
        assert "c0" in buf
        assert train_stats(buf).evicted_in_flight_groups == 1
        buf.put_nowait("c0", "x")
        buf.mark_finished_nowait("c0")  # still fine: no GroupEvictedError
        assert_conserved(buf)
