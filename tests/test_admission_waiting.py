"""Waiting producers (issue 11): refunds on every exit path, FIFO, cancellation, idleness.

Under admission control ``add_prompt`` / ``put_group`` (and ``rollout()``) wait, FIFO per
partition, while the partition is full; the wait is cancellable and a cancelled wait adds
nothing; ``close()`` wakes them with BufferClosedError; every group leaving the buffer frees
its slot at once and wakes the head waiting producer, and an idle waiting producer runs no
code. Async tests run on asyncio and trio, every wait bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import asyncio
import math
import random
from functools import partial
from typing import Any

import anyio
import pytest

from _helpers import (
    LIMIT,
    ProducerWaits,
    RaisingAdmits,
    Waiter,
    add_group,
    admission_counts,
    assert_conserved,
    evaluations,
    full_snapshot,
    make,
    producer_ledger,
    settle,
    start_call,
    steps_of,
)
from _helpers import train_stats as train
from stalebuf import (
    BatchNotReadyError,
    BufferClosedError,
    BufferFullError,
    ReplayBuffer,
    SamplerConfig,
    StalenessPolicy,
    Status,
)

pytestmark = pytest.mark.anyio


async def test_a_producer_that_waited_is_tagged_when_admitted_not_when_it_called() -> None:
    buf = make(admission_batch_size=1)  # drop, T=8: nothing here is ever evicted
    buf.add_prompt_nowait("a")  # in flight at step 0: step 0 is full
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            first = await start_call(tg, lambda: buf.add_prompt("first"))
            second = await start_call(tg, lambda: buf.put_group("second", ["p"]))
            assert train(buf).waiting_producers == 2
            with pytest.raises(BatchNotReadyError):
                buf.sample_nowait(3, 1)
            await settle()
            assert first.returned
            assert not second.done
            with pytest.raises(BatchNotReadyError):
                buf.sample_nowait(5, 1)
            await settle()
            assert second.returned
    assert steps_of(buf, "a", "first", "second") == [0, 3, 5]
    assert train(buf).waiting_producers == 0


async def test_an_explicit_global_steps_waits_for_a_slot_at_that_step() -> None:
    buf = make(admission_batch_size=1, max_off_policy_strategy="wait")
    add_group(buf, "a", 0, status=Status.RUNNING)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            old = await start_call(tg, lambda: buf.add_prompt("old", global_steps=0))
            with pytest.raises(BatchNotReadyError):
                buf.sample_nowait(2, 1)  # fresh slots at step 2, but not at step 0
            await settle()
            assert not old.done
            buf.mark_finished_nowait("a")
            batch, _ = buf.sample_nowait(2, 1)  # frees the slot at step 0
            assert batch.uids == ["a"]
            await settle()
            assert old.returned
    assert steps_of(buf, "old") == [0]


# -- refunds -------------------------------------------------------------------------------------


def occupy(buf: ReplayBuffer, path: str) -> None:
    """Fill the only slot of step 0 with a group that ``path`` will make leave the buffer."""
    if path == "sampled":
        add_group(buf, "a", 0)
    elif path == "failure":
        add_group(buf, "a", 0, status=Status.FAILURE)
    elif path == "stale":
        add_group(buf, "a", 0)
    else:  # in flight
        add_group(buf, "a", 0, status=Status.RUNNING)


REFUND_CONFIGS: dict[str, dict[str, Any]] = {
    "sampled": {"max_off_policy_threshold": 8},
    "failure": {"failure_strategy": "evict"},
    "stale": {"max_off_policy_threshold": 1},
    "in flight": {"max_off_policy_threshold": 1, "evict_stale_in_flight": True},
}


@pytest.mark.parametrize("path", list(REFUND_CONFIGS))
async def test_a_group_leaving_frees_its_slot_at_once_and_wakes_the_waiting_producer(path: str) -> None:
    buf = make(admission_batch_size=1, **REFUND_CONFIGS[path])
    occupy(buf, path)
    assert buf.full()
    # Stale groups leave at a later step, so the producer asks for step 0 explicitly.
    requested = 0 if path in ("stale", "in flight") else None
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            producer = await start_call(tg, lambda: buf.add_prompt("p", global_steps=requested))
            assert not producer.done
            g = 0 if path in ("sampled", "failure") else 2
            try:
                batch, _ = buf.sample_nowait(g, 1)
                assert batch.uids == ["a"]
                assert path == "sampled"
            except BatchNotReadyError:
                assert path != "sampled"
            assert "a" not in buf
            stats = train(buf)
            assert stats.sampled_groups + stats.evicted_stale_groups + stats.evicted_failure_groups == 1
            await settle()
            assert producer.returned
    assert steps_of(buf, "p") == [0]
    assert admission_counts(buf) == {0: 1}
    assert train(buf).waiting_producers == 0
    assert_conserved(buf)


@pytest.mark.parametrize("path", ["failure", "stale"])
async def test_an_eviction_frees_its_slot_and_wakes_the_producer_even_when_on_evict_raises(path: str) -> None:
    """The groups left the buffer before on_evict ran (the error propagates from sample with the
    buffer consistent), so their slots are free: the head producer must not wait for an
    unrelated wake-up that may never come."""

    def on_evict(event: object) -> None:
        raise RuntimeError("on_evict failed")

    buf = make(admission_batch_size=1, on_evict=on_evict, **REFUND_CONFIGS[path])
    occupy(buf, path)
    requested = 0 if path == "stale" else None
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            producer = await start_call(tg, lambda: buf.add_prompt("p", global_steps=requested))
            with pytest.raises(RuntimeError, match="on_evict failed"):
                buf.sample_nowait(0 if path == "failure" else 2, 1)
            assert "a" not in buf
            await settle()
            admitted = producer.returned
            producer.scope.cancel()
    assert admitted, "the freed slot did not wake the waiting producer"
    assert steps_of(buf, "p") == [0]


async def test_close_wakes_every_waiting_producer_with_buffer_closed_error_and_adds_nothing() -> None:
    buf = make(admission_batch_size=1)
    buf.add_prompt_nowait("a")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            producers = [
                await start_call(tg, lambda: buf.add_prompt("p")),
                await start_call(tg, lambda: buf.put_group("q", [1])),
                await start_call(tg, lambda: buf.add_prompt("r", global_steps=0)),
            ]
            assert train(buf).waiting_producers == 3
            await buf.aclose()
    assert all(isinstance(p.error, BufferClosedError) for p in producers)
    assert train(buf).waiting_producers == 0
    assert train(buf).admitted_groups == 1
    assert not any(uid in buf for uid in ("p", "q", "r"))


# -- waiting producers: order, cancellation, queue-jumping ----------------------------------------


async def test_waiting_producers_are_admitted_in_arrival_order_one_per_freed_slot() -> None:
    buf = make(admission_batch_size=1)
    add_group(buf, "a", 0)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            p1 = await start_call(tg, lambda: buf.add_prompt("p1"))
            p2 = await start_call(tg, lambda: buf.put_group("p2", [1]))
            p3 = await start_call(tg, lambda: buf.add_prompt("p3"))
            producers = [p1, p2, p3]
            for i, uid in enumerate(["a", "p1", "p2"]):
                if uid == "p1":
                    buf.mark_finished_nowait("p1")
                batch, _ = buf.sample_nowait(0, 1)
                assert batch.uids == [uid]
                # The head is woken but has not run: nobody may jump the queue meanwhile.
                assert buf.free_slots() == 0
                with pytest.raises(BufferFullError, match="waiting"):
                    buf.add_prompt_nowait("jumper")
                with pytest.raises(BufferFullError):
                    buf.put_group_nowait("jumper", [1])
                await settle()
                assert [p.returned for p in producers] == [j <= i for j in range(3)]
                assert train(buf).waiting_producers == 2 - i
    assert "jumper" not in buf
    assert_conserved(buf)


@pytest.mark.parametrize("how", ["cancel scope", "fail_after"])
async def test_a_cancelled_waiting_producer_adds_nothing_and_passes_the_turn_on(how: str) -> None:
    buf = make(admission_batch_size=1)
    add_group(buf, "a", 0)
    with anyio.fail_after(LIMIT):
        if how == "fail_after":
            before = full_snapshot(buf)
            with pytest.raises(TimeoutError):
                with anyio.fail_after(0.02):
                    await buf.add_prompt("gone")
            assert full_snapshot(buf) == before
        async with anyio.create_task_group() as tg:
            first = await start_call(tg, lambda: buf.add_prompt("first"))
            second = await start_call(tg, lambda: buf.add_prompt("second"))
            first.scope.cancel()
            await settle()
            assert train(buf).waiting_producers == 1
            buf.sample_nowait(0, 1)
            await settle()
            assert second.returned
    assert not first.done
    assert "first" not in buf
    assert "gone" not in buf
    assert train(buf).admitted_groups == 2


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_a_woken_then_cancelled_producer_passes_the_slot_on(cancel_first: bool) -> None:
    buf = make(admission_batch_size=1)
    add_group(buf, "a", 0)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            first = await start_call(tg, lambda: buf.add_prompt("first"))
            second = await start_call(tg, lambda: buf.add_prompt("second"))
            if cancel_first:
                first.scope.cancel()  # the cancellation is pending when...
                buf.sample_nowait(0, 1)  # ...the freed slot wakes `first`
            else:
                buf.sample_nowait(0, 1)  # `first` is woken...
                first.scope.cancel()  # ...and cancelled before it runs
            await settle()
            second.scope.cancel()
    # Either the cancellation won (and `second` got the slot) or the wake-up completed
    # `first` first; never both, never neither, and never a slot lost.
    admitted = [uid for uid in ("first", "second") if uid in buf]
    assert len(admitted) == 1
    assert (first.returned, second.returned) == (admitted == ["first"], admitted == ["second"])
    if cancel_first:
        assert admitted == ["second"]
    assert train(buf).waiting_producers == 0
    assert admission_counts(buf) == {0: 1}


@pytest.mark.asyncio
async def test_asyncio_task_cancel_of_a_waiting_producer_adds_nothing() -> None:
    buf = make(admission_batch_size=1)
    add_group(buf, "a", 0)
    task = asyncio.ensure_future(buf.add_prompt("gone"))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(buf.put_group("second", [1]))
    await asyncio.sleep(0.01)
    assert train(buf).waiting_producers == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "gone" not in buf
    assert train(buf).waiting_producers == 1
    buf.sample_nowait(0, 1)  # the freed slot goes to the next in line
    await asyncio.wait_for(second, LIMIT)
    assert "second" in buf
    assert train(buf).admitted_groups == 2
    assert train(buf).waiting_producers == 0


async def test_a_sample_that_waited_frees_its_slots_for_waiting_producers_when_it_returns() -> None:
    buf = make(admission_batch_size=1, max_off_policy_strategy="wait", max_off_policy_threshold=2)
    add_group(buf, "a", 0)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            sampler = await start_call(tg, lambda: buf.sample(1, 2))  # takes "a" once a second is ready
            producer = await start_call(tg, lambda: buf.add_prompt("p", global_steps=1))
            assert not sampler.done
            assert producer.returned
            later = await start_call(tg, lambda: buf.add_prompt("q", global_steps=1))
            buf.mark_finished_nowait("p")
            await settle()
            assert sampler.returned  # took a and p, freeing step 1's slot
            assert later.returned
    assert steps_of(buf, "q") == [1]


# -- no periodic work ---------------------------------------------------------------------------


class CountingPolicy(StalenessPolicy):
    """Counts the admission questions asked about "train" (a woken producer asks at least one)."""

    asked = 0

    def admits(self, tag: int, resident_at_tag: int, last_sampled: int, cap: int, partition: str) -> bool:
        if partition == "train":
            self.asked += 1
        return super().admits(tag, resident_at_tag, last_sampled, cap, partition)


async def test_waiting_producers_run_no_code_while_nothing_relevant_happens() -> None:
    config = SamplerConfig(admission_batch_size=1, max_off_policy_strategy="wait")
    policy = CountingPolicy(config)
    buf = ReplayBuffer(config, policy=policy, status_log_interval=None)
    add_group(buf, "a", 0, status=Status.RUNNING)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            producers = [await start_call(tg, partial(buf.add_prompt, f"p{i}")) for i in range(3)]
            sampler = await start_call(tg, lambda: buf.sample(0, 2))
            asked, evaluated = policy.asked, evaluations(buf)
            await anyio.sleep(0.05)  # idle: no timer, no polling
            buf.put_nowait("a", 1, session_id=5)
            add_group(buf, "o", 0, partition="other")  # another partition's slots
            buf.add_prompt_nowait("v", partition="val")
            await settle()
            assert (policy.asked, evaluations(buf)) == (asked, evaluated)
            assert not any(p.done for p in producers)
            assert not sampler.done
            buf.mark_finished_nowait("a")  # wakes the sampler (1 ready of 2), not a producer
            await settle()
            assert policy.asked == asked
            for p in producers:
                p.scope.cancel()
            sampler.scope.cancel()
    assert train(buf).waiting_producers == 0


# -- producer_wait_seconds and the ledger behind it ---------------------------------------------

WAIT_METRIC = "training/admission/producer_wait_seconds"


def assert_ledger_matches_queue(buf: ReplayBuffer) -> None:
    """The wait ledger counts exactly the producers in the admission queue, with their starts."""
    counted, queued, starts, expected = producer_ledger(buf)
    assert counted == queued, f"the ledger counts {counted} producers, the queue holds {queued}"
    assert math.isclose(starts, expected, rel_tol=1e-9, abs_tol=1e-6), (starts, expected)


async def test_producer_wait_seconds_counts_producers_still_blocked_at_the_sample() -> None:
    """Defect (issue 11: "{prefix}/admission/producer_wait_seconds (total time producers spent
    blocked on admission since the previous sample on the partition)"): only waits that had
    ended were counted, though a producer blocked since before this sample spent that time
    blocked, whether or not its wait has ended yet."""
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
    assert metrics[WAIT_METRIC] > 0


async def test_producer_wait_seconds_of_a_producer_waiting_across_samples_is_split_between_them() -> None:
    """The same sentence for a wait that spans samples: the part of a long wait before a sample
    belongs to that sample, the rest to the samples after it (none of them reports 0)."""
    buf = make(admission_batch_size=2, max_off_policy_threshold=3)
    with pytest.raises(BatchNotReadyError):  # the clock to 1: steps 0 and 1 open, 2 slots each
        buf.sample_nowait(1, 1)
    buf.put_group_nowait("a0", [1], global_steps=0)
    buf.put_group_nowait("a1", [1], global_steps=0)
    buf.add_prompt_nowait("f", global_steps=1)  # f and g hold tag 1's slots while b waits there
    buf.add_prompt_nowait("g", global_steps=1)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.add_prompt("b", global_steps=1))
            await anyio.sleep(0.05)
            _, metrics0 = buf.sample_nowait(1, 1)  # a0 (its slot at tag 0 is not b's)
            await anyio.sleep(0.05)
            _, metrics1 = buf.sample_nowait(1, 1)  # a1
            assert not waiting.done
            tg.cancel_scope.cancel()
    assert metrics0[WAIT_METRIC] > 0
    assert metrics1[WAIT_METRIC] > 0
    assert train(buf).waiting_producers == 0
    assert "b" not in buf


def test_producer_waits_report_ended_and_ongoing_waits_once() -> None:
    """The O(1) ledger (a count and a sum of wait starts) reports ended and ongoing waits, each
    second once, and a waiter whose loop is gone adds nothing."""
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
    """Successive trio runs have clocks with different offsets: a wait measured across them is
    not a wait, and must not subtract from the others."""
    waits = ProducerWaits()
    a = Waiter(0, 0)
    waits.park(a, 1_000.0)
    assert waits.report(5.0) == 0.0
    waits.leave(a, 3.0)
    assert waits.report(10.0) == 0.0


def test_a_producer_parked_on_a_closed_loop_is_dropped_from_the_wait_count() -> None:
    """A producer parked on an asyncio loop that was closed under it (misuse) is abandoned: it
    leaves ``waiting_producers`` and the wait ledger when dropped, and the next sample's
    producer_wait_seconds stays >= 0."""
    buf = make(max_off_policy_threshold=1, admission_batch_size=1)
    buf.put_group_nowait("r", [1])  # the slot at step 0 is taken
    loop = asyncio.new_event_loop()
    task = loop.create_task(buf.add_prompt("parked"))
    loop.run_until_complete(asyncio.sleep(0.01))  # it parks on the full partition
    assert buf.stats().total.waiting_producers == 1
    loop.close()  # closed under it: the waiter is abandoned
    del task
    assert buf.stats().total.waiting_producers == 0  # dropped as abandoned
    assert producer_ledger(buf)[0] == 0  # and not counted by the ledger
    batch, metrics = buf.sample_nowait(0, 1)
    assert batch.uids == ["r"]
    assert metrics[WAIT_METRIC] >= 0.0


@pytest.mark.parametrize("seed", range(6))
async def test_the_wait_ledger_matches_the_producer_queue_on_every_path(seed: int) -> None:
    """Guards the ledger against drifting from the queue it summarises. Producers join and leave
    by admission, cancellation, a raising ``admits`` (armed and disarmed at random), a failing
    ``admit`` (a duplicate uid), a tag closed for good, and close(); after each step the ledger
    counts exactly the queue and the metric is >= 0."""
    rnd = random.Random(seed)
    policy = RaisingAdmits(SamplerConfig(admission_batch_size=1, max_off_policy_threshold=1))
    buf = ReplayBuffer(policy=policy, status_log_interval=None)
    scopes: list[anyio.CancelScope] = []
    outcomes: dict[str, int] = {}

    async def produce(uid: str, step: int | None) -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            try:
                await buf.add_prompt(uid, global_steps=step)
                outcome = "admitted"
            except Exception as exc:  # every refusal is fine here: only the ledger is checked
                outcome = type(exc).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    with anyio.fail_after(LIMIT * 3):
        async with anyio.create_task_group() as tg:
            g = 0
            for n in range(80):
                roll = rnd.random()
                if roll < 0.4:
                    uid = rnd.choice([f"u{n}", "dup"])
                    tg.start_soon(produce, uid, rnd.choice([None, g, max(g - 2, 0), g + 1]))
                elif roll < 0.47:
                    policy.armed = not policy.armed
                elif roll < 0.55 and scopes:
                    rnd.choice(scopes).cancel()
                else:
                    g += rnd.choice([0, 1])
                    try:
                        _, metrics = buf.sample_nowait(g, 1)
                    except Exception:  # BatchNotReadyError, or the armed hook: not what is checked
                        pass
                    else:
                        assert metrics[WAIT_METRIC] >= 0.0
                await settle()
                assert_ledger_matches_queue(buf)
            buf.close()
        assert_ledger_matches_queue(buf)
    assert producer_ledger(buf)[:2] == (0, 0)
    assert buf.stats().total.waiting_producers == 0
    assert sum(outcomes.values()) > 0


# -- a producer waiting at a tag closed for good ------------------------------------------------------


async def test_a_producer_at_a_tag_closed_for_good_does_not_block_the_partition_forever() -> None:
    """Defect (issue 11: "A producer that passes an explicit global_steps waits for a slot at
    that tag" and property 2, "no deadlock"): a tag older than last_sampled + 1 - T*S can never
    open again (sample steps only grow), yet a producer waited there forever at the head of the
    queue, holding up every producer behind it."""
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


async def test_a_waiting_producer_whose_tag_a_sample_closes_raises_and_frees_the_queue() -> None:
    """The same defect when the tag closes while the producer waits: tag 1 is full (b=1) while
    open; a sample at step 3 then closes it for good (s = 4 > 2 at the next sample, 4). The
    producer waiting there must raise instead of holding up the queue."""
    buf = make(admission_batch_size=1, max_off_policy_threshold=2, max_off_policy_strategy="drop")
    with pytest.raises(BatchNotReadyError):  # the clock to 2: a step ahead of it is refused
        buf.sample_nowait(2, 1)
    buf.put_group_nowait("full", [1], global_steps=1)
    buf.put_group_nowait("ready", [1], global_steps=2)
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
