"""The waiting paths of sample(): wake-up, timeout, cancellation, close, order, idleness.

Each anyio test runs on asyncio and trio; every one is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import anyio
import pytest

from _helpers import LIMIT, add_group, evaluations, make, settle, snapshot, status_timer_running
from stalebuf import Batch, EvictionEvent, ReplayBuffer, SamplerConfig, Status
from stalebuf._waiting import FutureWaiter
from stalebuf.errors import BufferClosedError

pytestmark = pytest.mark.anyio


class Sampler:
    """Runs one sample() call in a task and records its outcome."""

    def __init__(self, buf: ReplayBuffer, g: int, b: int, **kwargs: Any) -> None:
        self.buf, self.g, self.b, self.kwargs = buf, g, b, kwargs
        self.result: tuple[Batch, dict[str, float]] | None = None
        self.error: BaseException | None = None
        self.scope = anyio.CancelScope()

    async def run(self) -> None:
        with self.scope:
            try:
                self.result = await self.buf.sample(self.g, self.b, **self.kwargs)
            except Exception as exc:
                self.error = exc

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def uids(self) -> list[str]:
        assert self.result is not None
        return self.result[0].uids


async def test_blocks_until_the_exact_call_that_completes_the_batch() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            sampler = Sampler(buf, 0, 2)
            tg.start_soon(sampler.run)
            await settle()
            assert buf.stats().total.waiting_samplers == 1
            add_group(buf, "a", 0)
            add_group(buf, "b", 0, status=Status.RUNNING)
            await buf.put("b", "more", session_id=5)
            await settle()
            assert not sampler.done
            await buf.mark_finished("b")
            await settle()
            assert sampler.done
    assert sampler.uids == ["a", "b"]
    assert sampler.result is not None
    assert sampler.result[1]["training/off_policy/wait_seconds"] > 0
    assert buf.stats().total.waiting_samplers == 0


async def test_wait_gate_opens_when_the_blocking_group_finishes() -> None:
    buf = make(max_off_policy_threshold=1, max_off_policy_strategy="wait")
    add_group(buf, "ready", 3)
    add_group(buf, "old", 2, status=Status.RUNNING)  # age 2 at g=3 >= T: blocks
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            sampler = Sampler(buf, 3, 1)
            tg.start_soon(sampler.run)
            await settle()
            assert not sampler.done
            await buf.mark_failed("old")
            await settle()
            assert sampler.done
    assert sampler.uids == ["old"]  # the failed group is the oldest, and sampleable


async def test_timeout_raises_and_leaves_state_intact() -> None:
    buf = make()
    add_group(buf, "a", 0)
    add_group(buf, "b", 0, status=Status.RUNNING)
    before = snapshot(buf)
    with anyio.fail_after(LIMIT), pytest.raises(TimeoutError):
        await buf.sample(0, 2, timeout=0.05)
    assert snapshot(buf) == before
    assert buf.stats().total.waiting_samplers == 0


async def test_timeout_zero_checks_once() -> None:
    buf = make()
    with pytest.raises(TimeoutError):
        await buf.sample(0, 1, timeout=0)
    add_group(buf, "a", 0)
    batch, _ = await buf.sample(0, 1, timeout=0)
    assert batch.uids == ["a"]


async def test_timeout_zero_behind_an_earlier_waiter_takes_nothing() -> None:
    buf = make()
    add_group(buf, "a", 0)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            first = Sampler(buf, 0, 2)
            tg.start_soon(first.run)
            await settle()
            with pytest.raises(TimeoutError):
                await buf.sample(0, 1, timeout=0)
            assert "a" in buf
            first.scope.cancel()


async def test_cancellation_leaves_state_intact_and_a_fresh_sample_gets_the_groups() -> None:
    buf = make()
    add_group(buf, "a", 0)
    before = snapshot(buf)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            sampler = Sampler(buf, 0, 2)
            tg.start_soon(sampler.run)
            await settle()
            sampler.scope.cancel()
        assert snapshot(buf) == before
        add_group(buf, "b", 0)
        batch, _ = await buf.sample(0, 2)
    assert batch.uids == ["a", "b"]


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_a_woken_then_cancelled_waiter_passes_its_wake_up_on(cancel_first: bool) -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            first, second = Sampler(buf, 0, 1), Sampler(buf, 0, 1)
            tg.start_soon(first.run)
            await settle()
            tg.start_soon(second.run)
            await settle()
            if cancel_first:
                first.scope.cancel()  # the cancellation is pending when...
                add_group(buf, "a", 0)  # ...the producer wakes `first`
            else:
                add_group(buf, "a", 0)  # `first` is woken...
                first.scope.cancel()  # ...and cancelled before it runs
            await settle()
            second.scope.cancel()
    # Either the cancellation won (and `second` got the group) or the wake-up had
    # already completed `first`; never both, never neither.
    winners = [s.uids for s in (first, second) if s.result is not None]
    assert winners == [["a"]]
    if cancel_first:
        assert second.result is not None
    assert buf.stats().total.sampled_groups == 1


async def test_close_wakes_every_waiter_and_keeps_groups() -> None:
    buf = make()
    add_group(buf, "a", 0)
    add_group(buf, "b", 0, status=Status.RUNNING)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            samplers = [Sampler(buf, 0, 2), Sampler(buf, 0, 1), Sampler(buf, 0, 3, partition="val")]
            for sampler in samplers:
                tg.start_soon(sampler.run)
                await settle()  # trio starts tasks in random order; keep arrival order fixed
            assert buf.stats().total.waiting_samplers == 3
            await buf.aclose()
    for sampler in samplers:
        assert isinstance(sampler.error, BufferClosedError)
    stats = buf.stats()
    assert stats.closed
    assert stats.total.waiting_samplers == 0
    assert (stats.total.finished, stats.total.running) == (1, 1)
    with pytest.raises(BufferClosedError):
        await buf.sample(0, 1)
    with pytest.raises(BufferClosedError):
        await buf.add_prompt("z", global_steps=0)


async def test_async_with_closes() -> None:
    async with make() as buf:
        add_group(buf, "a", 0)
    assert buf.closed


async def test_two_samplers_never_share_and_are_served_in_arrival_order() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            first, second = Sampler(buf, 0, 3), Sampler(buf, 0, 1)
            tg.start_soon(first.run)
            await settle()
            tg.start_soon(second.run)
            await settle()
            add_group(buf, "a", 0)
            await settle()
            assert not second.done  # a later call never jumps the queue
            add_group(buf, "b", 0)
            add_group(buf, "c", 0)
            add_group(buf, "d", 0)
            await settle()
            assert first.done
            assert second.done
    assert first.uids == ["a", "b", "c"]
    assert second.uids == ["d"]


async def test_the_next_waiter_is_served_from_surplus_at_once() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            samplers = [Sampler(buf, 0, 1) for _ in range(3)]
            for sampler in samplers:
                tg.start_soon(sampler.run)
                await settle()
            for uid in "abc":
                buf.add_prompt_nowait(uid, global_steps=0)
            for uid in "abc":
                buf.mark_finished_nowait(uid)
            await settle()
    assert [s.uids for s in samplers] == [["a"], ["b"], ["c"]]


async def test_partitions_do_not_block_each_other() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            blocked = Sampler(buf, 0, 5, partition="a")
            tg.start_soon(blocked.run)
            await settle()
            add_group(buf, "x", 0, partition="b")
            batch, _ = await buf.sample(0, 1, partition="b")
            assert batch.uids == ["x"]
            assert not blocked.done
            blocked.scope.cancel()


async def test_on_evict_refills_from_inside_sample() -> None:
    counter = iter(range(1000))

    def refill(event: EvictionEvent) -> None:
        for _ in event.groups:
            uid = f"refill{next(counter)}"
            buf.add_prompt_nowait(uid, global_steps=event.global_steps)
            buf.put_nowait(uid, "fresh")
            buf.mark_finished_nowait(uid)

    buf = make(max_off_policy_threshold=1, on_evict=refill)
    add_group(buf, "old1", 0)
    add_group(buf, "old2", 0)
    with anyio.fail_after(LIMIT):
        batch, metrics = await buf.sample(5, 2)
    assert batch.uids == ["refill0", "refill1"]
    assert metrics["training/off_policy/dropped_groups"] == 2.0


async def test_stale_group_wakes_the_waiter_so_the_refill_happens_now() -> None:
    events: list[EvictionEvent] = []
    buf = make(max_off_policy_threshold=1, on_evict=events.append)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            sampler = Sampler(buf, 5, 4)
            tg.start_soon(sampler.run)
            await settle()
            add_group(buf, "old", 0)  # not enough for a batch, but evictable
            await settle()
            assert [g.uid for e in events for g in e.groups] == ["old"]
            assert not sampler.done
            sampler.scope.cancel()
    assert buf.stats().total.evicted_stale_groups == 1


@pytest.mark.parametrize(("T", "S"), [(1, 1), (2, 1), (1, 3)])
@pytest.mark.parametrize("past", [0, 1])
async def test_a_group_just_past_the_threshold_wakes_the_waiter_and_one_at_it_does_not(
    T: int, S: int, past: int
) -> None:
    # The wake-up asks the default stale rule inline: s > T exactly (g - p + 1 > T*S), as
    # eviction does. ``past`` = 1 puts the group one dispatch step past that boundary.
    g = 10
    events: list[EvictionEvent] = []
    buf = make(max_off_policy_threshold=T, parameter_sync_step=S, on_evict=events.append)
    dispatch = g + 1 - T * S - past  # staleness T (kept) or T + 1/S (dropped)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            sampler = Sampler(buf, g, 4)
            tg.start_soon(sampler.run)
            await settle()
            before = evaluations(buf)
            add_group(buf, "edge", dispatch)
            await settle()
            evicted = [group.uid for event in events for group in event.groups]
            assert evicted == (["edge"] if past else [])
            assert evaluations(buf) - before == past  # woken only to evict
            assert not sampler.done
            sampler.scope.cancel()


async def test_failed_group_wakes_the_waiter_under_evict_strategy() -> None:
    def refill(event: EvictionEvent) -> None:
        buf.add_prompt_nowait("retry", global_steps=event.global_steps)
        buf.mark_finished_nowait("retry")

    buf = make(failure_strategy="evict", on_evict=refill)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            sampler = Sampler(buf, 0, 1)
            tg.start_soon(sampler.run)
            await settle()
            add_group(buf, "bad", 0, status=Status.FAILURE)
            await settle()
    assert sampler.uids == ["retry"]


async def test_on_evict_error_propagates_after_state_is_consistent() -> None:
    def explode(event: EvictionEvent) -> None:
        raise RuntimeError("callback failed")

    buf = make(max_off_policy_threshold=1, on_evict=explode)
    add_group(buf, "old", 0)
    add_group(buf, "new", 5)
    with anyio.fail_after(LIMIT), pytest.raises(RuntimeError, match="callback failed"):
        await buf.sample(5, 1)
    stats = buf.stats().total
    assert stats.evicted_stale_groups == 1
    assert stats.finished == 1
    assert stats.admitted_groups == stats.groups + stats.sampled_groups + stats.evicted_stale_groups
    batch, _ = await buf.sample(5, 1)  # the surviving group was not lost
    assert batch.uids == ["new"]


async def test_on_evict_closing_the_buffer_ends_sample() -> None:
    buf = make(max_off_policy_threshold=1, on_evict=lambda event: buf.close())
    add_group(buf, "old", 0)
    add_group(buf, "new", 5)
    with pytest.raises(BufferClosedError):
        await buf.sample(5, 1)
    assert "new" in buf


async def test_a_waiting_sample_does_no_work_while_producers_are_irrelevant() -> None:
    buf = ReplayBuffer(SamplerConfig(max_off_policy_strategy="wait", max_off_policy_threshold=4))
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            sampler = Sampler(buf, 0, 2)
            tg.start_soon(sampler.run)
            await settle()
            assert evaluations(buf) == 1  # the one evaluation before it first waits
            await anyio.sleep(0.05)  # idle: no timer, no polling
            for i in range(20):
                await buf.add_prompt(f"g{i}", global_steps=0)
                await buf.mark_running(f"g{i}")
                await buf.put(f"g{i}", i)
            add_group(buf, "other", 0, partition="elsewhere")
            await buf.mark_finished("g0")  # one ready group: still cannot make a batch of 2
            await settle()
            assert evaluations(buf) == 1
            await buf.mark_finished("g1")
            await settle()
            assert sampler.done
    assert evaluations(buf) == 2
    assert sampler.uids == ["g0", "g1"]


async def test_status_log_line_while_waiting(caplog: pytest.LogCaptureFixture) -> None:
    buf = make(status_log_interval=0.02)
    add_group(buf, "a", 0, status=Status.RUNNING)
    caplog.set_level(logging.INFO, logger="stalebuf")
    with anyio.fail_after(LIMIT), pytest.raises(TimeoutError):
        await buf.sample(0, 1, partition="train", timeout=0.1)
    lines = [r.getMessage() for r in caplog.records if r.name == "stalebuf"]
    assert lines, "expected a status line"
    assert "'train'" in lines[0]
    assert "running=1" in lines[0]
    assert "pending=0" in lines[0]


async def test_status_log_disabled() -> None:
    buf = make(status_log_interval=None)
    with anyio.fail_after(LIMIT), pytest.raises(TimeoutError):
        await buf.sample(0, 1, timeout=0.02)


@pytest.mark.parametrize("bad", [0, -1.0, True, "60"])
def test_bad_status_log_interval(bad: object) -> None:
    from stalebuf.errors import ConfigError

    with pytest.raises(ConfigError, match="status_log_interval"):
        ReplayBuffer(status_log_interval=bad)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_asyncio_task_cancel_is_safe() -> None:
    buf = make()
    add_group(buf, "a", 0)
    before = snapshot(buf)
    task = asyncio.ensure_future(buf.sample(0, 2))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert snapshot(buf) == before
    add_group(buf, "b", 0)
    batch, _ = await asyncio.wait_for(buf.sample(0, 2), LIMIT)
    assert batch.uids == ["a", "b"]


@pytest.mark.asyncio
async def test_asyncio_cancel_right_after_wake_up_loses_nothing() -> None:
    buf = make()
    first = asyncio.ensure_future(buf.sample(0, 1))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(buf.sample(0, 1))
    await asyncio.sleep(0.01)
    add_group(buf, "a", 0)  # wakes `first`
    first.cancel()  # Python 3.11's Condition.notify would lose this wake-up; we must not
    batch, _ = await asyncio.wait_for(second, LIMIT)
    assert batch.uids == ["a"]
    with pytest.raises(asyncio.CancelledError):
        await first


def test_coroutine_on_evict_is_rejected() -> None:
    from stalebuf.errors import ConfigError

    async def refill(event: EvictionEvent) -> None:
        pass

    with pytest.raises(ConfigError, match="synchronous"):
        ReplayBuffer(on_evict=refill)


async def test_status_line_does_not_wake_the_sampler(caplog: pytest.LogCaptureFixture) -> None:
    buf = ReplayBuffer(status_log_interval=0.01)
    caplog.set_level(logging.INFO, logger="stalebuf")
    with anyio.fail_after(LIMIT), pytest.raises(TimeoutError):
        await buf.sample(0, 1, timeout=0.2)  # room for two lines even on a stalled machine
    assert len([r for r in caplog.records if r.name == "stalebuf"]) >= 2  # one per interval
    assert evaluations(buf) == 1  # logging is a timer, not a wake-up that re-evaluates


def test_one_status_timer_serves_every_waiter_and_every_loop(caplog: pytest.LogCaptureFixture) -> None:
    buf = make(status_log_interval=0.01)
    caplog.set_level(logging.INFO, logger="stalebuf")
    timeouts: list[str] = []

    async def wait_in(partition: str) -> None:
        try:
            await buf.sample(0, 1, partition=partition, timeout=0.05)
        except TimeoutError:
            timeouts.append(partition)

    async def two_waiters() -> None:
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_in, "a")
                tg.start_soon(wait_in, "b")

    for _ in range(2):  # a second event loop must get a timer of its own
        caplog.clear()
        asyncio.run(two_waiters())
        lines = [r.getMessage() for r in caplog.records if r.name == "stalebuf"]
        assert any("'a'" in line for line in lines)
        assert any("'b'" in line for line in lines)
    assert sorted(timeouts) == ["a", "a", "b", "b"]
    assert buf.stats().total.waiting_samplers == 0


def test_a_waiter_whose_loop_was_closed_under_it_is_dropped_not_woken() -> None:
    """Misuse: a loop closed with a sample still parked. Producers must not fail on it, and
    the partition must not stay blocked behind a waiter that can never run."""
    buf = make()
    loop = asyncio.new_event_loop()
    task = loop.create_task(buf.sample(0, 1))
    loop.run_until_complete(asyncio.sleep(0.01))  # the sample parks
    assert buf.stats().total.waiting_samplers == 1
    loop.close()  # without cancelling the parked task
    add_group(buf, "a", 0)  # wakes nobody: the head is abandoned, and is dropped
    assert buf.stats().total.waiting_samplers == 0
    batch, _ = asyncio.run(buf.sample(0, 1))
    assert batch.uids == ["a"]
    del task
    gc.collect()  # the abandoned coroutine is finalised here: its cleanup must not fail
    assert buf.stats().total.waiting_samplers == 0


def test_waking_a_future_waiter_whose_loop_closed_neither_raises_nor_schedules() -> None:
    loop = asyncio.new_event_loop()
    waiter = FutureWaiter(0, 1, loop)
    woken: list[object] = []
    waiter.future.add_done_callback(woken.append)  # a parked task's future has its wake-up here
    loop.close()
    waiter.wake()  # set_result cannot schedule the callback: the waiter is abandoned
    waiter.wake()  # and stays quiet
    assert waiter.abandoned()
    assert waiter.future.done()
    assert woken == []


def test_a_scheduling_error_on_an_open_loop_is_not_taken_for_a_closed_loop() -> None:
    class RefusingLoop(asyncio.SelectorEventLoop):
        def call_soon(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("refused")

    loop = RefusingLoop()
    try:
        waiter = FutureWaiter(0, 1, loop)
        waiter.future.add_done_callback(lambda _: None)
        with pytest.raises(RuntimeError, match="refused"):
            waiter.wake()
    finally:
        loop.close()


def test_status_timer_stops_when_nobody_waits_and_restarts_for_the_next_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    buf = make(status_log_interval=0.01)
    caplog.set_level(logging.INFO, logger="stalebuf")

    async def two_waits_apart() -> list[int]:
        seen = []
        for _ in range(2):
            caplog.clear()
            with pytest.raises(TimeoutError):
                await buf.sample(0, 1, timeout=0.05)
            seen.append(len([r for r in caplog.records if r.name == "stalebuf"]))
            await asyncio.sleep(0.05)  # nobody waits: the timer fires once more and stops
            assert not status_timer_running(buf)
        return seen

    lines_per_wait = asyncio.run(two_waits_apart())
    assert all(lines >= 1 for lines in lines_per_wait), lines_per_wait
