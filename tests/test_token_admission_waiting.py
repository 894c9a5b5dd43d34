"""Producers waiting for tokens (issue 24): wake-up on a settling reservation and on a group
leaving, FIFO, timeout, cancellation and close, on asyncio and trio, every wait bounded by
``anyio.fail_after``.

Under ``admission_token_budget`` (K=100 here) and ``max_tokens_per_group`` (M=60), a second
in-flight group does not fit step 0 while the first reserves 60: ``add_prompt`` parks (FIFO per
partition, as under group admission) until a refund leaves room for M.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
import pytest

from _helpers import LIMIT, full_snapshot, make, start_call, train_stats, whitebox_sample
from stalebuf import BufferClosedError, BufferFullError, ReplayBuffer, SamplerConfig, TagClosedError

pytestmark = pytest.mark.anyio


def tokens_buffer(**config: Any) -> ReplayBuffer:
    config.setdefault("max_off_policy_threshold", 2)
    config.setdefault("max_off_policy_strategy", "drop")
    config.setdefault("admission_token_budget", 100)
    config.setdefault("max_tokens_per_group", 60)
    return make(**config)


async def test_a_refund_admits_the_head_producer_at_once() -> None:
    buf = tokens_buffer()
    buf.add_prompt_nowait("a")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.add_prompt("b"))
            assert not waiting.done
            buf.put_nowait("a", 1, tokens=30)
            buf.mark_finished_nowait("a")  # settles to 30: 70 free >= 60
            await anyio.wait_all_tasks_blocked()
            assert waiting.returned
    stats = train_stats(buf)
    assert (stats.resident_tokens, stats.reserved_tokens, stats.waiting_producers) == (30, 60, 0)
    assert buf.free_tokens() == 10


async def test_a_settlement_that_refunds_too_little_leaves_the_producer_parked() -> None:
    buf = tokens_buffer()
    buf.add_prompt_nowait("a")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.add_prompt("b"))
            buf.put_nowait("a", 1, tokens=45)
            buf.mark_finished_nowait("a")  # 55 free < 60
            await anyio.wait_all_tasks_blocked()
            assert not waiting.done
            with pytest.raises(BufferFullError, match="producers are waiting"):
                buf.put_group_nowait("zero", [1])  # 0 tokens would fit, but it queues behind (FIFO)
            waiting.scope.cancel()
    assert train_stats(buf).waiting_producers == 0
    assert "b" not in buf


async def test_a_residency_refund_wakes_producers_in_order() -> None:
    buf = make(max_tokens_per_group=10, max_resident_tokens=30)
    for uid in "abc":
        buf.add_prompt_nowait(uid)  # 30 reserved: full
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            first = await start_call(tg, lambda: buf.add_prompt("first"))
            second = await start_call(tg, lambda: buf.put_group("second", [1, 2], tokens=[2, 3]))
            assert train_stats(buf).waiting_producers == 2
            buf.put_nowait("a", 1, tokens=5)
            buf.mark_finished_nowait("a")  # refunds 5: the head needs 10, the second 5 (FIFO: waits)
            await anyio.wait_all_tasks_blocked()
            assert not first.done
            assert not second.done
            buf.mark_finished_nowait("b")  # refunds 10: the head goes, then the second fits too
            await anyio.wait_all_tasks_blocked()
            assert first.returned
            assert second.returned
    stats = train_stats(buf)
    assert (stats.resident_tokens, stats.reserved_tokens) == (10, 20)
    assert buf.free_tokens() == 0
    batch, _ = buf.sample_nowait(0, 2)  # a and b leave: 5 + 0 refunded
    assert batch.uids == ["a", "b"]
    assert buf.free_tokens() == 5


async def test_a_batch_taken_wakes_a_producer_held_by_the_residency_cap() -> None:
    buf = make(max_tokens_per_group=10, max_resident_tokens=20)
    buf.put_group_nowait("a", [1], tokens=[10])
    buf.add_prompt_nowait("b")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.add_prompt("c"))
            assert not waiting.done
            batch, _ = buf.sample_nowait(0, 1)
            assert batch.uids == ["a"]
            await anyio.wait_all_tasks_blocked()
            assert waiting.returned


async def test_a_trainer_batch_under_token_admission_wakes_the_producer() -> None:
    buf = tokens_buffer()
    buf.put_group_nowait("a", [1], tokens=[60])
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.add_prompt("b"))
            assert not waiting.done
            assert whitebox_sample(buf, 1, 1) is not None  # the clock moves to 1: a fresh step
            await anyio.wait_all_tasks_blocked()
            assert waiting.returned
    assert buf.stats().partitions["train"].reserved_tokens == 60


async def test_a_timed_out_producer_adds_nothing() -> None:
    buf = tokens_buffer()
    buf.add_prompt_nowait("a")
    before = full_snapshot(buf)
    with anyio.fail_after(LIMIT):
        with anyio.move_on_after(0.05) as scope:
            await buf.add_prompt("b")
        assert scope.cancelled_caught
        with anyio.move_on_after(0.05) as scope:
            await buf.put_group("c", [1], tokens=[41])
        assert scope.cancelled_caught
    assert full_snapshot(buf) == before
    assert train_stats(buf).waiting_producers == 0
    handle = buf.threadsafe()
    with anyio.fail_after(LIMIT):
        with pytest.raises(TimeoutError):
            await anyio.to_thread.run_sync(lambda: handle.add_prompt("d", timeout=0.05))
    assert "d" not in buf


async def test_a_cancelled_head_passes_the_turn_on() -> None:
    buf = tokens_buffer()
    buf.add_prompt_nowait("a")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            head = await start_call(tg, lambda: buf.add_prompt("head"))
            small = await start_call(tg, lambda: buf.put_group("small", [1], tokens=[40]))
            assert not head.done
            assert not small.done  # FIFO: its 40 tokens would fit, but it queues behind the head
            head.scope.cancel()
            await anyio.wait_all_tasks_blocked()
            assert small.returned
    assert "head" not in buf
    assert buf.free_tokens() == 0


async def test_close_wakes_every_parked_producer() -> None:
    buf = tokens_buffer()
    buf.add_prompt_nowait("a")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            one = await start_call(tg, lambda: buf.add_prompt("one"))
            two = await start_call(tg, lambda: buf.put_group("two", [1], tokens=[50]))
            buf.close()
            await anyio.wait_all_tasks_blocked()
    assert isinstance(one.error, BufferClosedError)
    assert isinstance(two.error, BufferClosedError)


async def test_a_head_blocked_at_an_older_tag_makes_the_token_batch_ready() -> None:
    """Regression (a deadlock): producers queue FIFO per partition, so a producer parked at an
    older, open tag with too little room there holds up the clock-tagged producers behind it.
    The readiness rule asked only whether the clock's tag refused a group, so the sample waited
    for producers that could never come: T*S = 2, K = M = 10; ``x`` (tag 0) settles to 5, ``old``
    waits at tag 0 (5 < 10 free), ``new`` queues behind it, and ``sample(1)`` waited forever for
    10 tokens. The blocked head now counts as a refusal: the sample takes ``x``, tag 0 closes
    (``old`` gets TagClosedError) and ``new`` is admitted."""
    buf = make(
        max_off_policy_threshold=2,
        max_off_policy_strategy="wait",
        admission_token_budget=10,
        max_tokens_per_group=10,
    )
    buf.put_group_nowait("first", [1], tokens=[10])
    assert buf.sample_nowait(0, token_budget=10)[0].uids == ["first"]
    buf.add_prompt_nowait("x", global_steps=0)  # tag 0 is open at clock 0 (T*S = 2)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            sample = await start_call(tg, lambda: buf.sample(1, token_budget=10))  # the gate waits for x
            old = await start_call(tg, lambda: buf.add_prompt("old", global_steps=0))
            new = await start_call(tg, lambda: buf.add_prompt("new"))
            assert not sample.done
            assert not old.done
            assert not new.done
            buf.put_nowait("x", 1, tokens=5)
            buf.mark_finished_nowait("x")  # 5 free at tag 0: old still waits, new behind it
            await anyio.wait_all_tasks_blocked()
            assert sample.returned
            assert new.returned
    batch, metrics = sample.result
    assert batch.uids == ["x"]
    assert metrics["training/batch/tokens"] == 5
    assert isinstance(old.error, TagClosedError)
    assert train_stats(buf).waiting_producers == 0


async def test_a_head_that_parks_blocked_wakes_the_waiting_token_sample() -> None:
    """The blocked head is a change the parked sample must hear of: with nothing in flight and
    the sample short of tokens (tag 1 still has room), a producer parking at tag 0 with too
    little room there blocks every producer at the clock, so its parking re-asks the sample."""
    buf = make(
        max_off_policy_threshold=2,
        max_off_policy_strategy="wait",
        admission_token_budget=10,
        max_tokens_per_group=10,
    )
    buf.put_group_nowait("first", [1], tokens=[10])
    buf.sample_nowait(0, token_budget=10)
    buf.put_group_nowait("y", [1], global_steps=0, tokens=[5])  # tag 0: 5 free, open until a batch at 1
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            sample = await start_call(tg, lambda: buf.sample(1, token_budget=10))
            assert not sample.done  # 5 tokens, and tag 1 can take a reservation of 10
            old = await start_call(tg, lambda: buf.add_prompt("old", global_steps=0))
            await anyio.wait_all_tasks_blocked()
            assert sample.returned
    assert sample.result[0].uids == ["y"]
    assert isinstance(old.error, TagClosedError)


async def test_a_refused_token_sample_waits_for_the_groups_in_flight_it_could_train() -> None:
    """Defect (issue 24's rule as first written): a parked token sample returned the moment
    admission refused a clock-tagged group, though that group was in flight and trainable, so
    at T*S >= 2 every batch was whatever had finished when the gate opened (43% of K on average
    in the simulated default pipeline). It now waits for it, and returns when it ends."""
    buf = ReplayBuffer(
        SamplerConfig(
            max_off_policy_threshold=2,
            max_off_policy_strategy="wait",
            admission_token_budget=100,
            max_tokens_per_group=60,
        ),
        status_log_interval=None,
    )
    with anyio.fail_after(LIMIT):
        buf.add_prompt_nowait("a")
        buf.put_nowait("a", "x", tokens=30)
        buf.mark_finished_nowait("a")  # settles to 30: room 70, producers may add
        async with anyio.create_task_group() as tg:
            call = await start_call(tg, lambda: buf.sample(0, token_budget=100))
            assert not call.done, "30 < 100 tokens and admission has room: no batch yet"
            buf.add_prompt_nowait("b")  # room 10 < 60: refused from now on, but "b" is in flight
            await anyio.wait_all_tasks_blocked()
            assert not call.done, "returned at the refusal though 'b' could still join the batch"
            buf.put_nowait("b", "y", tokens=40)
            buf.mark_finished_nowait("b")  # nothing in flight, still refused: waiting cannot help
            await anyio.wait_all_tasks_blocked()
            assert call.returned
        batch, metrics = call.result
        assert batch.uids == ["a", "b"]
        assert metrics["training/batch/fill"] == 0.7
