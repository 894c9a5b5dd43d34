"""Admission control (issue 11): the per-step cap, the dispatch clock, and who is gated.

One deterministic test per rule of the issue's "Config", "The dispatch clock" and "Admission"
sections. Waiting producers (refunds, order, cancellation, idleness) are in
tests/test_admission_waiting.py, in-flight eviction in tests/test_in_flight.py, rollout() and
the concurrent properties 1 and 2 in tests/test_rollout.py, and the BufferFullError rows in
tests/test_bad_inputs.py. Async tests run on asyncio and trio, every wait bounded by
``anyio.fail_after``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import anyio
import pytest

from _helpers import (
    LIMIT,
    Background,
    add_group,
    admission_counts,
    assert_conserved,
    full_snapshot,
    make,
    settle,
    start_call,
    steps_of,
)
from _helpers import train_stats as train
from stalebuf import (
    BatchNotReadyError,
    BufferClosedError,
    BufferFullError,
    FutureTagError,
    ReplayBuffer,
    SamplerConfig,
    StalebufError,
    StalenessPolicy,
)

pytestmark = pytest.mark.anyio

# (T, S) pairs covering T*S = 1, 2, 3 both ways round.
FORMULA = [(1, 1), (2, 1), (1, 2), (3, 1), (1, 3)]


# -- the formula --------------------------------------------------------------------------------


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize(("T", "S"), FORMULA)
def test_capacity_is_T_S_b_and_each_dispatch_step_admits_b(T: int, S: int, b: int) -> None:
    buf = make(max_off_policy_threshold=T, parameter_sync_step=S, admission_batch_size=b)
    assert buf.capacity() == T * S * b
    for i in range(b):
        assert buf.free_slots() == b - i
        assert not buf.full()
        buf.add_prompt_nowait(f"a{i}")
    assert buf.free_slots() == 0
    assert buf.full()
    before = full_snapshot(buf)
    with pytest.raises(BufferFullError, match="dispatch step 0"):
        buf.add_prompt_nowait("over")
    with pytest.raises(BufferFullError):
        buf.put_group_nowait("over", [1])
    assert full_snapshot(buf) == before
    assert train(buf).capacity == T * S * b
    assert admission_counts(buf) == {0: b}
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(1, b)  # the clock moves on: b fresh slots at step 1
    assert buf.free_slots() == b
    for i in range(b):
        buf.put_group_nowait(f"n{i}", [i])
    assert buf.full()
    assert admission_counts(buf) == {0: b, 1: b}


@pytest.mark.parametrize("via", ["add_prompt", "put_group"])  # put_group's fast path inlines the rule
@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize(("T", "S"), FORMULA)
def test_after_sample_c_minus_1_exactly_the_last_T_S_steps_are_open(T: int, S: int, b: int, via: str) -> None:
    """With the previous sample returned at c-1 and the clock at c, the steps a group could still
    be trained at s <= T are c+1-T*S .. c, b groups each: T*S*b = capacity() in all."""
    c = 6
    buf = make(max_off_policy_threshold=T, parameter_sync_step=S, admission_batch_size=b)
    with pytest.raises(BatchNotReadyError):  # the clock to c-1: a step ahead of it is refused
        buf.sample_nowait(c - 1, 1)
    add_group(buf, "seed", c - 1)
    batch, _ = buf.sample_nowait(c - 1, 1)
    assert batch.uids == ["seed"]
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(c, 1)
    assert buf.dispatch_step() == c
    admitted = {}
    for tag in range(c + 1):  # (c + 1 and later: ahead of the clock, refused as FutureTagError)
        admitted[tag] = 0
        for i in range(b + 1):
            try:
                if via == "add_prompt":
                    buf.add_prompt_nowait(f"t{tag}x{i}", global_steps=tag)
                else:
                    buf.put_group_nowait(f"t{tag}x{i}", [tag], global_steps=tag)
            except BufferFullError:
                continue
            admitted[tag] += 1
    assert admitted == {tag: (b if tag >= c + 1 - T * S else 0) for tag in range(c + 1)}
    assert sum(admitted.values()) == buf.capacity() == train(buf).groups
    assert buf.full()
    assert_conserved(buf)


@pytest.mark.parametrize("b", [1, 4])
async def test_T_S_1_closes_step_c_once_sample_c_returned_until_sample_c_plus_1_is_called(b: int) -> None:
    buf = make(max_off_policy_threshold=1, max_off_policy_strategy="wait", admission_batch_size=b)
    for i in range(b):
        add_group(buf, f"a{i}", 0)
    with anyio.fail_after(LIMIT):
        batch, _ = await buf.sample(0, b)
        assert batch.uids == [f"a{i}" for i in range(b)]
        assert train(buf).groups == 0  # nothing resident, yet step 0 admits nothing more:
        assert buf.free_slots() == 0  # a group tagged 0 could only be trained at s >= 2
        assert buf.full()
        with pytest.raises(BufferFullError, match="dispatch step 0"):
            buf.add_prompt_nowait("late")
        async with anyio.create_task_group() as tg:
            late = await start_call(tg, lambda: buf.add_prompt("late"))
            assert not late.done
            assert train(buf).waiting_producers == 1
            sampler = Background(lambda: buf.sample(1, b))
            tg.start_soon(sampler.run)  # calling sample(1) reopens admission, at step 1
            await settle()
            assert late.returned
            assert steps_of(buf, "late") == [1]
            assert buf.free_slots() == b - 1
            buf.mark_finished_nowait("late")
            for i in range(1, b):
                await buf.put_group(f"b{i}", [i])
            await settle()
            assert sampler.returned
        assert buf.full()  # and sample(1) returned: step 1 closes in turn
    assert_conserved(buf)


def test_T_S_2_keeps_step_c_open_after_sample_c() -> None:
    buf = make(max_off_policy_threshold=2, admission_batch_size=1)
    add_group(buf, "a", 0)
    buf.sample_nowait(0, 1)
    assert buf.free_slots() == 1  # a group tagged 0 can still be trained at s = 2
    buf.add_prompt_nowait("b")
    assert steps_of(buf, "b") == [0]


# -- the dispatch clock -------------------------------------------------------------------------


@pytest.mark.parametrize("admission", [None, 2])
async def test_dispatch_step_is_the_largest_step_any_sample_on_the_partition_was_called_with(
    admission: int | None,
) -> None:
    buf = make(admission_batch_size=admission)
    assert (buf.dispatch_step(), buf.dispatch_step("val"), buf.dispatch_step("other")) == (0, 0, 0)
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(3, 1)
    assert buf.dispatch_step() == 3
    with anyio.fail_after(LIMIT):
        with pytest.raises(TimeoutError):
            await buf.sample(5, 1, timeout=0)
        assert buf.dispatch_step() == 5
        with pytest.raises(TimeoutError):
            await buf.sample(7, 1, timeout=0.01)  # one that later times out counts too
        assert buf.dispatch_step() == 7
        with pytest.raises(BatchNotReadyError):
            buf.sample_nowait(4, 1)  # an older step never moves the clock back
        assert buf.dispatch_step() == 7
        with pytest.raises(TimeoutError):
            await buf.sample(9, 1, partition="val", timeout=0)
        assert (buf.dispatch_step(), buf.dispatch_step("val"), buf.dispatch_step("other")) == (7, 9, 0)
        with pytest.raises(ValueError, match="batch_size"):
            await buf.sample(20, 0)  # rejected arguments change nothing
        assert buf.dispatch_step() == 7
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.sample(11, 1))
            assert buf.dispatch_step() == 11  # while it waits
            with pytest.raises(TimeoutError):
                await buf.sample(13, 1, timeout=0)  # queued behind it, takes nothing
            assert buf.dispatch_step() == 13
            waiting.scope.cancel()
        buf.close()
        with pytest.raises(BufferClosedError):
            await buf.sample(30, 1)
        assert buf.dispatch_step() == 13


@pytest.mark.parametrize("admission", [None, 8])
async def test_groups_without_global_steps_are_tagged_with_their_partitions_clock(
    admission: int | None,
) -> None:
    buf = make(admission_batch_size=admission)
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(4, 1)
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(2, 1, partition="val")
    with anyio.fail_after(LIMIT):
        buf.add_prompt_nowait("a")
        await buf.add_prompt("b")
        buf.put_group_nowait("c", [1])
        await buf.put_group("d", [1])
        async with buf.rollout("e") as group:
            assert group.global_steps == group.dispatch_step == 4
        buf.add_prompt_nowait("v", partition="val")  # exempt, but tagged by its own clock
        await buf.put_group("w", [1], partition="val")
        # An explicit int keeps working: any step without admission, at most the clock with it.
        explicit = 9 if admission is None else 3
        buf.add_prompt_nowait("x", global_steps=explicit)
        await buf.put_group("y", [1], global_steps=1)
    assert steps_of(buf, "a", "b", "c", "d", "e", "v", "w", "x", "y") == [4, 4, 4, 4, 4, 2, 2, explicit, 1]


async def test_finish_step_and_the_generation_queue_split_of_sampled_staleness() -> None:
    buf = make()  # without admission, which refuses a step ahead of the clock
    buf.add_prompt_nowait("a")  # dispatched at 0
    buf.add_prompt_nowait("b", global_steps=7)  # dispatched ahead of the clock
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(3, 2)
    buf.mark_finished_nowait("a")  # the clock reads 3
    buf.mark_finished_nowait("b")  # finish_step is never before the dispatch step
    batch, metrics = buf.sample_nowait(7, 2)
    assert batch.uids == ["a", "b"]
    assert [group.finish_step for group in batch] == [3, 7]
    generation = metrics["training/off_policy/sampled_generation_steps/mean"]
    queue = metrics["training/off_policy/sampled_queue_steps/mean"]
    assert generation == ((3 - 0) + (7 - 7)) / 2
    assert queue == 7 - (3 + 7) / 2
    assert generation + queue == 7 - (0 + 7) / 2  # g - p
    assert all(group.generation_seconds >= 0 for group in batch)
    assert metrics["training/off_policy/sampled_generation_seconds/mean"] >= 0


# -- who is never gated -----------------------------------------------------------------------


async def test_exempt_partitions_are_never_gated() -> None:
    buf = make(admission_batch_size=1, max_off_policy_threshold=1)
    assert (buf.capacity("val"), buf.free_slots("val"), buf.full("val")) == (None, None, False)
    with anyio.fail_after(LIMIT):
        for i in range(5):
            buf.add_prompt_nowait(f"v{i}", partition="val")
            await buf.add_prompt(f"w{i}", partition="val")
            await buf.put_group(f"x{i}", [i], partition="val")
    stats = buf.stats()
    assert stats.partitions["val"].groups == 15
    assert stats.partitions["val"].capacity is None
    assert admission_counts(buf, "val") is None


async def test_without_admission_nothing_is_gated_and_nothing_reports_a_bound() -> None:
    buf = make()
    assert (buf.capacity(), buf.free_slots(), buf.full()) == (None, None, False)
    for i in range(50):
        buf.add_prompt_nowait(f"a{i}")
    assert (buf.capacity(), buf.free_slots(), buf.full()) == (None, None, False)
    assert buf.stats().total.capacity is None
    add_group(buf, "r", 0)
    _, metrics = buf.sample_nowait(0, 1)
    assert not any("/admission/" in key for key in metrics)


async def test_put_group_on_a_group_already_admitted_never_waits() -> None:
    buf = make(admission_batch_size=2)
    buf.add_prompt_nowait("a")
    buf.add_prompt_nowait("b")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.add_prompt("c"))
            assert buf.full()
            assert buf.put_group_nowait("a", [1, 2]) == ["a_0_0", "a_1_0"]
            assert await buf.put_group("b", [3], status="failed") == ["b_0_0"]
            assert not waiting.done  # finishing frees no slot: the groups are still resident
            waiting.scope.cancel()
    assert [buf.stats().total.finished, buf.stats().total.failure] == [1, 1]


# -- metrics and stats ----------------------------------------------------------------------------


async def test_admission_metrics_free_slots_and_producer_wait_seconds() -> None:
    buf = make(admission_batch_size=2, max_off_policy_threshold=4)
    add_group(buf, "a", 0)
    _, metrics = buf.sample_nowait(0, 1)
    assert metrics["training/admission/free_slots"] == buf.free_slots() == 2
    assert metrics["training/admission/producer_wait_seconds"] == 0.0
    add_group(buf, "b", 0)
    buf.add_prompt_nowait("c")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.add_prompt("d"))
            await anyio.sleep(0.01)
            _, metrics = buf.sample_nowait(0, 1)  # takes b, admits d
            await settle()
            assert waiting.returned
    assert metrics["training/admission/free_slots"] == 0.0  # d is about to take the slot
    with pytest.raises(BatchNotReadyError):  # the clock to 1: admission refuses a step ahead of it
        buf.sample_nowait(1, 9)
    add_group(buf, "e", 1)
    _, metrics = buf.sample_nowait(1, 1)
    assert metrics["training/admission/producer_wait_seconds"] > 0  # d waited since the last sample
    assert metrics["training/admission/free_slots"] == buf.free_slots()
    add_group(buf, "f", 1)
    _, metrics = buf.sample_nowait(1, 1)
    assert metrics["training/admission/producer_wait_seconds"] == 0.0  # reset per sample


async def test_stats_report_capacity_and_waiting_producers_per_partition() -> None:
    config = SamplerConfig(admission_batch_size=3, max_off_policy_threshold=2, parameter_sync_step=2)
    buf = ReplayBuffer(config, status_log_interval=None)
    for i in range(3):
        buf.add_prompt_nowait(f"a{i}")
    buf.add_prompt_nowait("o", partition="other")
    buf.add_prompt_nowait("v", partition="val")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = [await start_call(tg, partial(buf.add_prompt, f"w{i}")) for i in range(2)]
            stats = buf.stats()
            assert stats.partitions["train"].capacity == 12
            assert stats.partitions["other"].capacity == 12
            assert stats.partitions["val"].capacity is None
            assert stats.total.capacity == 24
            assert stats.partitions["train"].waiting_producers == 2
            assert stats.total.waiting_producers == 2
            for producer in waiting:
                producer.scope.cancel()
    assert buf.stats().total.waiting_producers == 0


# -- the rule lives in the policy --------------------------------------------------------------------


class TwoStepsOnly(StalenessPolicy):
    """One group per step, and nothing admitted at step 2 or later."""

    def admission_batch_size(self, partition: str) -> int | None:
        return None if self.is_exempt(partition) else 1

    def admits(self, tag: int, resident_at_tag: int, last_sampled: int, cap: int, partition: str) -> bool:
        return tag < 2 and super().admits(tag, resident_at_tag, last_sampled, cap, partition)


class SelectHook(ReplayBuffer):
    """A verl-style subclass: overriding a protected hook puts the hooks in front of the policy."""

    def _select(self, candidates: Any, batch_size: int, global_steps: int, partition: str) -> Any:
        return super()._select(candidates, batch_size, global_steps, partition)


@pytest.mark.parametrize("cls", [ReplayBuffer, SelectHook])
def test_the_buffer_asks_the_policy_for_the_admission_rule(cls: type[ReplayBuffer]) -> None:
    config = SamplerConfig(admission_batch_size=5)  # the policy answers b = 1 instead
    buf = cls(config, policy=TwoStepsOnly(config), status_log_interval=None)
    assert buf.capacity() == 8 * 1
    buf.add_prompt_nowait("a")
    with pytest.raises(BufferFullError):
        buf.add_prompt_nowait("b")
    with pytest.raises(BatchNotReadyError):  # the clock to 2: steps 1 and 2 are not ahead of it
        buf.sample_nowait(2, 1)
    buf.add_prompt_nowait("c", global_steps=1)
    with pytest.raises(BufferFullError) as refused:
        buf.add_prompt_nowait("d", global_steps=2)
    assert type(refused.value) is BufferFullError  # refused by the policy, not as a future step


def test_config_fields_are_accepted_from_a_mapping() -> None:
    config = SamplerConfig.from_mapping(
        {"admission_batch_size": 16, "evict_stale_in_flight": True, "max_off_policy_strategy": "drop"}
    )
    assert (config.admission_batch_size, config.evict_stale_in_flight) == (16, True)
    assert (SamplerConfig().admission_batch_size, SamplerConfig().evict_stale_in_flight) == (None, False)
    assert issubclass(BufferFullError, StalebufError)


# -- tags closed for good ------------------------------------------------------------------------


async def test_a_closed_tag_is_refused_at_once_and_the_clock_tag_is_admitted() -> None:
    """Defect: an explicit tag closed for good (stale at the next sample, so no slot there can
    ever open) made ``add_prompt``/``put_group`` wait forever instead of raising BufferFullError
    at once; the clock's own tag must still be admitted."""
    buf = make(admission_batch_size=2, max_off_policy_threshold=2, max_off_policy_strategy="wait")
    for g in range(3):
        buf.put_group_nowait(f"x{g}", [1])
        buf.sample_nowait(g, 1)  # last_sampled 2: tag 0 would be stale (s = 4 > 2) at sample 3
    with anyio.fail_after(LIMIT):
        with pytest.raises(BufferFullError, match="closed for good"):
            await buf.add_prompt("old", global_steps=0)
        with pytest.raises(BufferFullError, match="closed for good"):
            await buf.put_group("old", [1], global_steps=0)
        with pytest.raises(BufferFullError, match="closed for good"):
            buf.add_prompt_nowait("old", global_steps=0)
        await buf.add_prompt("new")  # the clock's tag (2) has free slots
    assert "old" not in buf
    assert buf.stats().total.waiting_producers == 0


async def test_a_closed_tag_says_so_even_while_producers_wait() -> None:
    """Defect: while producers waited, ``add_prompt_nowait`` at a tag closed for good said
    "producers are waiting" instead of naming the closed tag (which no wait can ever open)."""
    buf = make(admission_batch_size=1, max_off_policy_threshold=2, max_off_policy_strategy="wait")
    for g in range(3):
        buf.put_group_nowait(f"x{g}", [1])
        buf.sample_nowait(g, 1)  # last_sampled 2: tag 0 is closed for good, the clock's tag is 2
    buf.put_group_nowait("full", [1])  # tag 2 full (b=1)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            await start_call(tg, lambda: buf.add_prompt("waiting"))
            assert buf.stats().total.waiting_producers == 1
            with pytest.raises(BufferFullError, match="closed for good"):
                buf.add_prompt_nowait("old", global_steps=0)
            with pytest.raises(BufferFullError, match="producers are waiting"):
                buf.add_prompt_nowait("new")
            tg.cancel_scope.cancel()


class StalePastOne(StalenessPolicy):
    """A custom ``is_stale``, monotone in both steps as the policy contract requires: stale once
    more than one step old."""

    def is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        return global_steps - dispatch_step > 1


async def test_a_tag_the_policy_calls_stale_at_the_next_sample_is_refused_for_good() -> None:
    """The policy contract: ``is_stale`` is monotone in ``global_steps`` too (a stale group stays
    stale), so a tag stale at the next sample never reopens and an explicit ``add_prompt`` there
    raises at once, with a custom ``is_stale`` as with the default one (no producer waits for a
    slot that can never open)."""
    config = SamplerConfig(admission_batch_size=1, max_off_policy_threshold=1)
    buf = ReplayBuffer(policy=StalePastOne(config), status_log_interval=None)
    with pytest.raises(BatchNotReadyError):  # the clock to 1: admission refuses a step ahead of it
        buf.sample_nowait(1, 1)
    add_group(buf, "a", 1)
    buf.sample_nowait(1, 1)  # last_sampled 1: tag 0 is stale at the next sample (2 - 0 > 1)
    with anyio.fail_after(LIMIT), pytest.raises(BufferFullError, match="closed for good"):
        await buf.add_prompt("late", global_steps=0)
    assert "late" not in buf
    assert buf.stats().total.waiting_producers == 0


# -- the policy's admission_batch_size answer (issue 21 item 8) and tags ahead of the clock (item 11) --


class AnswersCap(StalenessPolicy):
    """``admission_batch_size`` answers ``answer`` for every partition (the exempt ones too)."""

    answer: Any = None

    def admission_batch_size(self, partition: str) -> int | None:
        return self.answer  # type: ignore[no-any-return]


def answering(answer: object) -> ReplayBuffer:
    config = SamplerConfig(max_off_policy_threshold=2)
    policy = AnswersCap(config)
    policy.answer = answer
    return ReplayBuffer(config, policy=policy, status_log_interval=None)


def test_admission_batch_size_answers_are_checked_and_numpy_integers_accepted() -> None:
    """Item 8: 0, -1, NaN, "3", floats, bools and steps past 2**63 make producers wait forever or
    ``capacity()`` lie, so they are a StalebufError naming the hook (before anything is created);
    numpy's integers are ints."""
    import numpy as np

    for answer in (0, -1, 2**63, 3.0, np.float64(3.0), math.nan, "3", True, np.bool_(True), np.int64(-1)):
        buf = answering(answer)
        with pytest.raises(StalebufError, match=r"AnswersCap\.admission_batch_size\('train'\) must return"):
            buf.add_prompt_nowait("a")
        with pytest.raises(StalebufError, match="admission_batch_size"):
            buf.capacity()
        assert buf.stats().partitions == {}, type(answer)
    for answer, cap in ((np.int64(3), 3), (np.uint8(2), 2), (2**63 - 1, 2**63 - 1), (None, None)):
        buf = answering(answer)
        buf.add_prompt_nowait("a")
        capacity = buf.capacity()
        assert capacity == (None if cap is None else 2 * cap)
        assert capacity is None or type(capacity) is int


def test_an_exempt_partition_is_never_gated_even_before_its_first_group() -> None:
    """Defect: the buffer ignores the policy's ``admission_batch_size`` answer for an exempt
    partition once the partition exists, but not before: ``capacity("val")`` and
    ``free_slots("val")`` reported a bound, and the first ``add_prompt`` there with a step ahead
    of the clock was refused as FutureTagError, while the same call a moment later was admitted.
    Exempt partitions are never gated: the answer for them does not count."""
    buf = answering(2)  # a policy that does not special-case exempt partitions
    assert (buf.capacity(), buf.free_slots()) == (4, 2)
    assert (buf.capacity("val"), buf.free_slots("val"), buf.full("val")) == (None, None, False)
    buf.add_prompt_nowait("v1", partition="val", global_steps=5)  # exempt: never refused
    buf.add_prompt_nowait("v2", partition="val", global_steps=5)
    assert (buf.capacity("val"), buf.free_slots("val")) == (None, None)


async def test_every_producer_refuses_a_step_ahead_of_the_clock_at_once() -> None:
    """Item 11: under admission, a step ahead of the dispatch clock is refused at once (never a
    wait that could not end) by ``add_prompt``, ``put_group`` (both paths), ``rollout()`` and the
    threadsafe handle, also while other producers wait; the clock's own step is admitted; exempt
    partitions are not gated."""
    buf = make(admission_batch_size=1, max_off_policy_threshold=2)
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(3, 1)  # the clock to 3
    with anyio.fail_after(LIMIT):
        await buf.add_prompt("at-clock", global_steps=3)  # the clock's own step: admitted
        async with anyio.create_task_group() as tg:
            queued = await start_call(tg, partial(buf.add_prompt, "queued"))  # step 3 is full: it waits
            assert buf.stats().total.waiting_producers == 1
            refusals: list[Any] = [
                partial(buf.add_prompt, "a", global_steps=4),
                partial(buf.put_group, "b", [1], global_steps=4),
                partial(buf.put_group, "c", [1], global_steps=4, session_ids=[3]),
            ]
            for call in refusals:
                with pytest.raises(FutureTagError, match="ahead of its dispatch clock 3"):
                    await call()
            with pytest.raises(FutureTagError):
                async with buf.rollout("d", global_steps=4):
                    raise AssertionError("entered")
            handle = buf.threadsafe()

            def from_a_thread() -> None:
                handle.add_prompt("e", global_steps=10**18)

            with pytest.raises(FutureTagError):
                await anyio.to_thread.run_sync(from_a_thread)
            buf.add_prompt_nowait("v", partition="val", global_steps=10**6)  # exempt: not gated
            assert not queued.done
            tg.cancel_scope.cancel()
    assert not [uid for uid in ("a", "b", "c", "d", "e") if uid in buf]
    assert_conserved(buf)
