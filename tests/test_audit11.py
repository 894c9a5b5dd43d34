"""Audit of issue 11 (flow control) against its text: the defects an independent tester found.

Each test quotes the sentence of the issue it checks. Async tests run on asyncio and trio,
every wait bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import anyio
import pytest

from _helpers import EVICTED_UIDS_REMEMBERED, LIMIT, assert_conserved, make, settle, start_call
from _helpers import train_stats as train
from stalebuf import (
    BufferFullError,
    GroupEvictedError,
    ReplayBuffer,
    UnknownGroupError,
)

pytestmark = pytest.mark.anyio


async def test_producer_wait_seconds_counts_producers_still_blocked_at_the_sample() -> None:
    # "{prefix}/admission/producer_wait_seconds (total time producers spent blocked on admission
    # since the previous sample on the partition)": a producer blocked since before this sample
    # spent that time blocked, whether or not its wait has ended yet.
    buf = make(admission_batch_size=1, max_off_policy_threshold=2)
    buf.put_group_nowait("a", [1])
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.add_prompt("b"))
            await anyio.sleep(0.05)
            assert not waiting.done
            _, metrics = buf.sample_nowait(0, 1)  # frees the slot b waited for
            await settle()
            assert waiting.returned
    assert metrics["training/admission/producer_wait_seconds"] > 0


async def test_producer_wait_seconds_of_a_producer_waiting_across_samples_is_split_between_them() -> None:
    # Same sentence: the part of a long wait before a sample belongs to that sample, the rest to
    # the samples after it.
    buf = make(admission_batch_size=1, max_off_policy_threshold=3)
    buf.put_group_nowait("a0", [1], global_steps=0)
    buf.put_group_nowait("a1", [1], global_steps=1)
    buf.add_prompt_nowait("f", global_steps=5)  # holds tag 5's only slot
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.add_prompt("b", global_steps=5))
            await anyio.sleep(0.05)
            _, metrics0 = buf.sample_nowait(0, 1)
            await anyio.sleep(0.05)
            _, metrics1 = buf.sample_nowait(1, 1)
            assert not waiting.done
            tg.cancel_scope.cancel()
    assert metrics0["training/admission/producer_wait_seconds"] > 0
    assert metrics1["training/admission/producer_wait_seconds"] > 0
    assert train(buf).waiting_producers == 0
    assert "b" not in buf


async def test_a_producer_at_a_tag_closed_for_good_does_not_block_the_partition_forever() -> None:
    # "A producer that passes an explicit global_steps waits for a slot at that tag" and
    # property 2, "no deadlock": a tag older than last_sampled + 1 - T*S can never open again
    # (sample steps only grow), so waiting there is waiting forever.
    buf = make(admission_batch_size=2, max_off_policy_threshold=2, max_off_policy_strategy="wait")
    for g in range(3):
        buf.put_group_nowait(f"x{g}", [1])
        buf.sample_nowait(g, 1)
    assert buf.dispatch_step() == 2
    assert buf.free_slots() == 2
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            old = await start_call(tg, lambda: buf.add_prompt("old", global_steps=0))
            new = await start_call(tg, lambda: buf.add_prompt("new"))
            await settle()
            done = old.done, new.returned
            tg.cancel_scope.cancel()
    # Either the closed tag is refused at once, or at least it does not hold up the clock's tag.
    assert done[0] or done[1]


def test_a_restore_that_evicts_in_flight_groups_keeps_the_remembered_uids_bounded() -> None:
    # "The buffer remembers these uids in bounded memory (document the bound, e.g. the most recent
    # 65,536)": a restore with in_flight="evict" adds its evicted uids to the same memory.
    buf = make()
    for i in range(EVICTED_UIDS_REMEMBERED + 3):
        buf.add_prompt_nowait(f"g{i}", global_steps=0)
    restored = ReplayBuffer.restore(buf.checkpoint(), in_flight="evict").buffer
    with pytest.raises(UnknownGroupError) as oldest:
        restored.put_nowait("g0", 1)
    assert type(oldest.value) is UnknownGroupError  # forgotten: the oldest three are past the bound
    with pytest.raises(GroupEvictedError):
        restored.put_nowait(f"g{EVICTED_UIDS_REMEMBERED + 2}", 1)
    with pytest.raises(GroupEvictedError):
        restored.put_nowait("g3", 1)


# -- producer_wait_seconds in O(1): the ledger behind it --------------------------------------


def test_producer_waits_report_ended_and_ongoing_waits_once() -> None:
    from stalebuf._waiting import ProducerWaits, Waiter

    waits = ProducerWaits()
    a, b = Waiter(0, 0), Waiter(0, 0)
    waits.park(a, 10.0)
    waits.park(b, 12.0)
    assert waits.report(15.0) == (15 - 10) + (15 - 12)  # both still parked, counted up to now
    waits.leave(a, 16.0)  # 1 s more since the report
    assert waits.report(20.0) == 1.0 + (20 - 15)
    waits.leave(b, 21.0)
    assert waits.report(30.0) == 1.0
    assert waits.report(40.0) == 0.0  # nobody waits: nothing more, and nothing counted twice
    waits.park(a, 50.0)
    waits.leave(a, None)  # its loop is gone: nothing of it is counted
    assert waits.report(60.0) == 0.0
    assert (waits.parked, waits.starts) == (0, 0.0)


def test_producer_waits_never_report_a_negative_wait() -> None:
    # Successive trio runs have clocks with different offsets: a wait measured across them is
    # not a wait, and must not subtract from the others.
    from stalebuf._waiting import ProducerWaits, Waiter

    waits = ProducerWaits()
    a = Waiter(0, 0)
    waits.park(a, 1_000.0)
    assert waits.report(5.0) == 0.0
    waits.leave(a, 3.0)
    assert waits.report(10.0) == 0.0


def test_a_producer_parked_on_a_closed_loop_is_dropped_from_the_wait_count() -> None:
    import asyncio

    buf = make(max_off_policy_threshold=1, admission_batch_size=1)
    buf.put_group_nowait("r", [1])  # the slot at step 0 is taken
    loop = asyncio.new_event_loop()
    task = loop.create_task(buf.add_prompt("parked"))
    loop.run_until_complete(asyncio.sleep(0.01))  # it parks on the full partition
    assert buf.stats().total.waiting_producers == 1
    loop.close()  # closed under it: the waiter is abandoned
    del task
    part = buf._partitions["train"]
    assert buf.stats().total.waiting_producers == 0  # dropped as abandoned
    assert part.producer_waits.parked == 0
    batch, metrics = buf.sample_nowait(0, 1)
    assert batch.uids == ["r"]
    assert metrics["training/admission/producer_wait_seconds"] >= 0.0


async def test_a_closed_tag_is_refused_at_once_and_the_clock_tag_is_admitted() -> None:
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


async def test_a_waiting_producer_whose_tag_a_sample_closes_raises_and_frees_the_queue() -> None:
    # Tag 1 is full (b=1) while open; a sample at step 3 then closes it for good (s = 4 > 2 at
    # the next sample, 4): the producer waiting there raises instead of holding up the queue.
    buf = make(admission_batch_size=1, max_off_policy_threshold=2, max_off_policy_strategy="drop")
    buf.put_group_nowait("full", [1], global_steps=1)
    buf.put_group_nowait("ready", [1], global_steps=3)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.add_prompt("late", global_steps=1))
            behind = await start_call(tg, lambda: buf.add_prompt("next"))
            await settle()
            assert buf.stats().total.waiting_producers == 2
            batch, _ = await buf.sample(3, 1)  # evicts "full" as stale, returns "ready"
            assert batch.uids == ["ready"]
            await settle()
    assert isinstance(waiting.error, BufferFullError)
    assert "closed for good" in str(waiting.error)
    assert behind.returned
    assert "late" not in buf
    assert "next" in buf
    assert_conserved(buf)


async def test_a_closed_tag_says_so_even_while_producers_wait() -> None:
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
