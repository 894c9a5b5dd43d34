"""Liveness: nothing can leave a ``sample`` stuck, and no way out of one loses anything.

- a ``sample`` waiting on a group that never finishes always ends by timeout or cancellation
  (cancel scopes, ``asyncio.Task.cancel``), and the queue behind it keeps moving;
- ``close()`` in the middle of heavy traffic wakes every waiter with BufferClosedError and
  loses nothing already present;
- a ``sample`` under the wrong async backend ends with BackendMismatchError and leaves no
  eviction, partition or waiter behind;
- a ``sample`` parked on an asyncio loop that was closed under it (misuse) blocks nothing:
  not ``close()``, not later samples, not the status log;
- the status log never spins: a stalled loop logs once per due time (on trio's and on a
  virtual asyncio clock), and intervals below 1 ms are refused.

``on_evict`` callbacks that raise, close the buffer or call producers: see test_on_evict.py.

Every async test is bounded by ``anyio.fail_after``; none asserts on timing.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
from collections import Counter
from collections.abc import Iterable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import trio
import trio.testing

from _helpers import (
    LIMIT,
    add_group,
    assert_conserved,
    make,
    resident_groups,
    resident_keys,
    settle,
    snapshot,
    status_timer_running,
)
from stalebuf import Batch, EvictionEvent, Group, ReplayBuffer, Status
from stalebuf.errors import BackendMismatchError, BufferClosedError, ConfigError


def keys_of(groups: Iterable[Group]) -> list[str]:
    return [t.key for g in groups for t in g.trajectories]


# -- a sample waiting on a group that never finishes ------------------------------------------


def never_ready(strategy: str, status_log_interval: float | None = None) -> ReplayBuffer:
    """A buffer whose ``sample(5, 2)`` can never return until "stuck" finishes.

    drop: one finished group and one that never finishes; wait: two finished groups, but
    "stuck" is in flight with s >= T.
    """
    buf = make(
        max_off_policy_threshold=2, max_off_policy_strategy=strategy, status_log_interval=status_log_interval
    )
    add_group(buf, "ready", 5)
    if strategy == "wait":
        add_group(buf, "ready2", 5)
    add_group(buf, "stuck", 0 if strategy == "wait" else 5, status=Status.RUNNING)
    return buf


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", ["drop", "wait"])
async def test_never_finishing_group_sample_ends_by_timeout(strategy: str) -> None:
    with anyio.fail_after(LIMIT):
        buf = never_ready(strategy)
        before = buf.stats()
        with pytest.raises(TimeoutError):
            await buf.sample(5, 2, timeout=0.02)
        assert buf.stats() == before, "a timed-out sample changed the buffer"
        buf.mark_finished_nowait("stuck")
        batch, _ = await buf.sample(5, 2, timeout=0)
        assert len(batch) == 2
        assert_conserved(buf)


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", ["drop", "wait"])
@pytest.mark.parametrize("how", ["move_on_after", "scope.cancel", "task_group.cancel"])
async def test_never_finishing_group_sample_ends_by_cancellation(strategy: str, how: str) -> None:
    with anyio.fail_after(LIMIT):
        buf = never_ready(strategy)
        before = buf.stats()
        ended: list[str] = []

        async def waiter(scope: anyio.CancelScope) -> None:
            with scope:
                await buf.sample(5, 2)
            ended.append("cancelled" if scope.cancelled_caught else "returned")

        if how == "move_on_after":
            with anyio.move_on_after(0.02) as scope:
                await buf.sample(5, 2)
            assert scope.cancelled_caught
        else:
            scope = anyio.CancelScope()
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter, scope)
                await settle()
                assert buf.stats().total.waiting_samplers == 1
                if how == "scope.cancel":
                    scope.cancel()
                else:
                    tg.cancel_scope.cancel()
            assert ended in (["cancelled"], [])
        assert buf.stats() == before, "a cancelled sample changed the buffer"
        buf.mark_finished_nowait("stuck")
        batch, _ = await buf.sample(5, 2, timeout=0)
        assert len(batch) == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("strategy", ["drop", "wait"])
async def test_never_finishing_group_sample_ends_by_task_cancel(strategy: str) -> None:
    with anyio.fail_after(LIMIT):
        buf = never_ready(strategy)
        before = buf.stats()
        task = asyncio.create_task(buf.sample(5, 2))
        for _ in range(3):
            await asyncio.sleep(0)
        assert buf.stats().total.waiting_samplers == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert buf.stats() == before
        buf.mark_finished_nowait("stuck")
        batch, _ = await buf.sample(5, 2, timeout=0)
        assert len(batch) == 2


@pytest.mark.anyio
@pytest.mark.parametrize("head_exit", ["timeout", "cancel"])
async def test_queue_behind_a_stuck_head_keeps_moving(head_exit: str) -> None:
    """The head waits for a batch that never comes; when it leaves, the next waiter is served."""
    with anyio.fail_after(LIMIT):
        buf = make()
        add_group(buf, "a", 0)
        add_group(buf, "b", 0)
        results: dict[str, Any] = {}

        async def run(name: str, batch_size: int, timeout: float | None, scope: anyio.CancelScope) -> None:
            with scope:
                try:
                    results[name] = (await buf.sample(0, batch_size, timeout=timeout))[0].uids
                except TimeoutError:
                    results[name] = "timeout"

        head_scope, tail_scope = anyio.CancelScope(), anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "head", 3, 0.05 if head_exit == "timeout" else None, head_scope)
            await settle()
            tg.start_soon(run, "tail", 2, None, tail_scope)
            await settle()
            if head_exit == "cancel":
                assert buf.stats().total.waiting_samplers == 2
                head_scope.cancel()
            # (with a timeout the head may already be gone on a slow machine: the result is the same)
        assert results.get("head", "cancelled") in ("timeout", "cancelled")
        assert results["tail"] == ["a", "b"]
        assert buf.stats().total.waiting_samplers == 0
        assert_conserved(buf)


@pytest.mark.anyio
async def test_status_logging_does_not_block_timeout_or_cancel(caplog: pytest.LogCaptureFixture) -> None:
    """With a short status-log interval the waiter wakes up to log, and still ends when told."""
    with anyio.fail_after(LIMIT):
        caplog.set_level(logging.INFO, logger="stalebuf")
        buf = never_ready("wait", status_log_interval=0.005)
        with pytest.raises(TimeoutError):
            await buf.sample(5, 2, timeout=0.05)
        logged = anyio.Event()

        class Signal(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "has waited" in record.getMessage():
                    logged.set()

        handler = Signal()
        logging.getLogger("stalebuf").addHandler(handler)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(buf.sample, 5, 2)
                await logged.wait()  # it has been through a logging wake-up at least once
                tg.cancel_scope.cancel()
        finally:
            logging.getLogger("stalebuf").removeHandler(handler)
        assert buf.stats().total.waiting_samplers == 0
        buf.mark_finished_nowait("stuck")
        assert len((await buf.sample(5, 2, timeout=0))[0]) == 2


# -- close() under heavy traffic ----------------------------------------------------------------


class Traffic:
    """Producers, samplers and a trainer step counter sharing one buffer, with full accounting."""

    def __init__(self, seed: int, strategy: str, failure_strategy: str) -> None:
        self.rng = random.Random(seed)
        self.buf = make(
            on_evict=self.on_evict,
            max_off_policy_threshold=2,
            max_off_policy_strategy=strategy,
            failure_strategy=failure_strategy,
        )
        self.step = 0
        self.next_uid = 0
        self.admitted: list[str] = []  # keys of successful puts
        self.sampled: list[str] = []
        self.evicted: list[str] = []
        self.closed_errors: Counter[str] = Counter()
        self.batches: list[Batch] = []
        self.enough: anyio.Event | None = None  # set once 300 groups were admitted

    def on_evict(self, event: EvictionEvent) -> None:
        self.evicted.extend(keys_of(event.groups))

    async def producer(self, partition: str) -> None:
        buf, rng = self.buf, self.rng
        try:
            while True:
                self.next_uid += 1
                uid = f"p{self.next_uid}"
                if self.next_uid == 300 and self.enough is not None:
                    self.enough.set()
                await buf.add_prompt(
                    uid, global_steps=max(0, self.step - rng.randrange(3)), partition=partition
                )
                await anyio.lowlevel.checkpoint()
                if rng.random() < 0.8:
                    await buf.mark_running(uid)
                for session in range(rng.randint(1, 4)):
                    await anyio.sleep(0 if rng.random() < 0.7 else 0.0005)
                    self.admitted.append(await buf.put(uid, session, session_id=session))
                await (buf.mark_failed(uid) if rng.random() < 0.1 else buf.mark_finished(uid))
        except BufferClosedError:
            self.closed_errors["producer"] += 1

    async def sampler(self, partition: str, batch_size: int) -> None:
        try:
            while True:
                batch, _ = await self.buf.sample(self.step, batch_size, partition=partition)
                self.batches.append(batch)
                self.sampled.extend(batch.keys)
                if partition == "train":
                    self.step += 1  # the trainer-like step counter
        except BufferClosedError:
            self.closed_errors["sampler"] += 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("seed", "strategy", "failure_strategy"),
    [(1, "drop", "sample"), (2, "wait", "evict"), (3, "drop", "evict")],
)
async def test_close_during_heavy_traffic_wakes_everyone_and_loses_nothing(
    seed: int, strategy: str, failure_strategy: str
) -> None:
    with anyio.fail_after(LIMIT):
        t = Traffic(seed, strategy, failure_strategy)
        t.enough = anyio.Event()
        producers, samplers = 16, 6
        async with anyio.create_task_group() as tg:
            for i in range(producers):
                tg.start_soon(t.producer, "train" if i % 4 else "val")
            for i in range(samplers):
                # more demand than supply, so that samplers are parked when close() comes
                tg.start_soon(t.sampler, "train" if i % 2 else "val", 4 + i)
            await t.enough.wait()
            waiting_at_close = t.buf.stats().total.waiting_samplers
            t.buf.close()
            resident_at_close = sorted(resident_keys(t.buf))
        # every sampler, parked (waiting_at_close of them) or not, ended with BufferClosedError
        assert t.closed_errors == {"producer": producers, "sampler": samplers}, waiting_at_close
        stats = t.buf.stats()
        assert stats.closed
        assert stats.total.waiting_samplers == 0
        # nothing already present was lost: close() took nothing, and everything is accounted for
        assert sorted(resident_keys(t.buf)) == resident_at_close
        accounted = Counter(t.sampled) + Counter(t.evicted) + Counter(resident_keys(t.buf))
        assert accounted == Counter(t.admitted), "a trajectory was lost or duplicated"
        assert_conserved(t.buf)
        assert len({uid for b in t.batches for uid in b.uids}) == sum(len(b) for b in t.batches)
        if strategy == "wait":
            assert stats.total.evicted_stale_groups == 0


@pytest.mark.anyio
async def test_close_wakes_every_parked_waiter_on_every_partition() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_strategy="wait", max_off_policy_threshold=1)
        add_group(buf, "gated", 0, status=Status.RUNNING)  # closes the wait gate of "train"
        add_group(buf, "f1", 0)
        add_group(buf, "v1", 0, partition="val")
        outcomes: list[str] = []

        async def run(partition: str, batch_size: int) -> None:
            try:
                await buf.sample(3, batch_size, partition=partition)
                outcomes.append("returned")
            except BufferClosedError:
                outcomes.append("closed")

        async with anyio.create_task_group() as tg:
            for partition, size in [("train", 1), ("train", 1), ("val", 2), ("val", 5), ("other", 1)]:
                tg.start_soon(run, partition, size)
            await settle()
            assert buf.stats().total.waiting_samplers == 5
            before = {uid: group.status for uid, group in resident_groups(buf).items()}
            await buf.aclose()
        assert outcomes == ["closed"] * 5
        assert {uid: group.status for uid, group in resident_groups(buf).items()} == before
        assert buf.stats().total.waiting_samplers == 0
        with pytest.raises(BufferClosedError):
            await buf.sample(3, 1, partition="val", timeout=0)
        assert_conserved(buf)


# -- a sample under the wrong async backend (misuse) ------------------------------------------
# It must end with BackendMismatchError and leave nothing behind: no eviction, no new
# partition, no queued waiter. Each test here is a regression of a defect found in review.


def _bind(buf: ReplayBuffer, backend: str) -> None:
    """Bind ``buf`` to ``backend`` with a sample that has to wait (then times out)."""

    async def wait_briefly() -> None:
        with anyio.fail_after(LIMIT), pytest.raises(TimeoutError):
            await buf.sample(0, 1, partition="bind", timeout=0.001)

    anyio.run(wait_briefly, backend=backend)


@pytest.mark.parametrize(("bound", "other"), [("asyncio", "trio"), ("trio", "asyncio")])
def test_backend_mismatch_evicts_nothing(bound: str, other: str) -> None:
    events: list[EvictionEvent] = []
    buf = make(on_evict=events.append, max_off_policy_threshold=1)
    _bind(buf, bound)
    add_group(buf, "old", 0)  # stale at g=5 (s = 6 > T = 1); one group is not a batch of 2
    before = snapshot(buf)

    async def sample_elsewhere() -> None:
        with anyio.fail_after(LIMIT):
            await buf.sample(5, 2)

    with pytest.raises(BackendMismatchError):
        anyio.run(sample_elsewhere, backend=other)
    assert events == [], "on_evict was called by a sample that then raised BackendMismatchError"
    assert snapshot(buf) == before


@pytest.mark.parametrize(("bound", "other"), [("asyncio", "trio"), ("trio", "asyncio")])
def test_backend_mismatch_creates_no_partition(bound: str, other: str) -> None:
    buf = ReplayBuffer(status_log_interval=None)
    _bind(buf, bound)
    before = snapshot(buf)

    async def sample_elsewhere() -> None:
        with anyio.fail_after(LIMIT):
            await buf.sample(0, 1, partition="fresh")

    with pytest.raises(BackendMismatchError):
        anyio.run(sample_elsewhere, backend=other)
    assert snapshot(buf) == before


@pytest.mark.parametrize(("bound", "other"), [("asyncio", "trio"), ("trio", "asyncio")])
def test_sample_under_the_wrong_backend_leaves_no_ghost_waiter(bound: str, other: str) -> None:
    """Regression: misuse (unsupported) left a ghost waiter that blocked the partition forever."""
    buf = make()

    async def wait_briefly() -> None:
        with anyio.fail_after(LIMIT):
            await buf.sample(0, 1, timeout=0.001)

    async def take_now() -> list[str]:
        with anyio.fail_after(LIMIT):
            return (await buf.sample(0, 1, timeout=0))[0].uids

    with pytest.raises(TimeoutError):
        anyio.run(wait_briefly, backend=bound)  # binds the buffer to `bound`
    with pytest.raises(BackendMismatchError, match=r"bound to \w+"):
        anyio.run(wait_briefly, backend=other)  # the misuse fails with a clear error
    assert buf.stats().total.waiting_samplers == 0, "a failed sample left its waiter queued"
    add_group(buf, "a", 0)
    assert anyio.run(take_now, backend=bound) == ["a"]


# -- a sample parked on an asyncio loop that was closed under it (issue 10, item 5) ----------------
# Misuse (manual loop management), but it must not block anything: close() skips such a
# waiter, a later sample is served past it, and the status log forgets it.


def abandon_sample(buf: ReplayBuffer, batch_size: int = 1, partition: str = "train") -> asyncio.Task[Any]:
    """Park ``sample(0, batch_size)`` on a fresh loop, then close that loop without cancelling it."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(buf.sample(0, batch_size, partition=partition))

    async def turns() -> None:
        for _ in range(10):  # the sample evaluates once, then parks
            await asyncio.sleep(0)

    loop.run_until_complete(turns())
    assert buf.stats().partitions[partition].waiting_samplers == 1
    loop.close()
    return task


def finalise(task: asyncio.Task[Any]) -> None:
    """Drop the abandoned task: its coroutine is closed here, and its cleanup must not fail."""
    del task
    gc.collect()


def test_close_wakes_live_waiters_past_one_whose_loop_was_closed() -> None:
    """Regression: close() raised 'Event loop is closed' part-way and never woke the rest."""
    buf = make()
    task = abandon_sample(buf, partition="abandoned")  # iterated first by close()
    outcomes: list[str] = []

    async def live_waiter() -> None:
        try:
            await buf.sample(0, 1, partition="live")
        except BufferClosedError:
            outcomes.append("closed")

    async def main() -> None:
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(live_waiter)
                await settle()
                buf.close()  # must not raise

    asyncio.run(main())
    assert outcomes == ["closed"]
    assert buf.stats().total.waiting_samplers == 0
    finalise(task)


@pytest.mark.parametrize("timeout", [0, LIMIT])
def test_a_later_sample_is_served_past_a_waiter_whose_loop_was_closed(timeout: float) -> None:
    buf = make()
    add_group(buf, "a", 0)
    task = abandon_sample(buf, batch_size=2)  # parks: one group is not a batch of two

    async def take() -> list[str]:
        with anyio.fail_after(LIMIT):
            return (await buf.sample(0, 1, timeout=timeout))[0].uids

    assert asyncio.run(take()) == ["a"], "the abandoned waiter still heads the queue"
    assert buf.stats().total.waiting_samplers == 0
    assert_conserved(buf)
    finalise(task)


def test_a_waiter_whose_loop_was_closed_is_not_counted_as_waiting() -> None:
    buf = make()
    task = abandon_sample(buf)
    assert buf.stats().total.waiting_samplers == 0
    finalise(task)


def test_no_status_lines_for_a_waiter_whose_loop_was_closed(caplog: pytest.LogCaptureFixture) -> None:
    """Regression: the abandoned waiter kept the status timer logging on the next loop, idle or not."""
    buf = make(status_log_interval=0.01)
    caplog.set_level(logging.INFO, logger="stalebuf")
    task = abandon_sample(buf, partition="abandoned")

    async def wait_elsewhere_then_idle() -> bool:
        with anyio.fail_after(LIMIT):
            with pytest.raises(TimeoutError):
                await buf.sample(0, 1, partition="live", timeout=0.05)
            await asyncio.sleep(0.05)  # nobody waits now: the timer fires at most once more and stops
            return status_timer_running(buf)

    caplog.clear()
    timer_still_running = asyncio.run(wait_elsewhere_then_idle())
    lines = [record.getMessage() for record in caplog.records if record.name == "stalebuf"]
    assert any("'live'" in line for line in lines), "the live waiter was not reported"
    assert not [line for line in lines if "'abandoned'" in line], "an abandoned waiter was reported"
    assert not timer_still_running, "the status timer kept running with no live waiter"
    finalise(task)


# -- the status log under a stalled loop (issue 10, item 6) -----------------------------------------

STALL = 0.5004  # seconds: about 500 intervals of 1 ms, off any interval boundary


def status_lines(caplog: pytest.LogCaptureFixture) -> int:
    return len([record for record in caplog.records if record.name == "stalebuf"])


def test_a_stalled_trio_loop_logs_once_per_due_time_not_once_per_missed_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: after a stall, trio's status log caught up one interval per loop turn: a burst
    of ~500 lines for a 0.5 s stall (and a frozen loop for a 1e-12 s interval)."""
    buf = make(status_log_interval=0.001)
    caplog.set_level(logging.INFO, logger="stalebuf")
    clock = trio.testing.MockClock()  # time moves only when the test jumps it
    lines_per_stall: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: buf.sample(0, 1, timeout=LIMIT))
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(3):
                caplog.clear()
                clock.jump(STALL)
                await trio.testing.wait_all_tasks_blocked()
                lines_per_stall.append(status_lines(caplog))
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    assert lines_per_stall == [1, 1, 1]
    assert buf.stats().total.waiting_samplers == 0


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock moves only when the test moves it (a stall without sleeping)."""

    now = 0.0

    def time(self) -> float:
        return self.now


def test_a_stalled_asyncio_loop_logs_once_per_due_time(caplog: pytest.LogCaptureFixture) -> None:
    buf = make(status_log_interval=0.001)
    caplog.set_level(logging.INFO, logger="stalebuf")
    loop = VirtualTimeLoop()
    lines_per_stall: list[int] = []

    async def main() -> None:
        task = asyncio.ensure_future(buf.sample(0, 1))
        for _ in range(10):
            await asyncio.sleep(0)
        assert buf.stats().total.waiting_samplers == 1
        for _ in range(3):
            caplog.clear()
            loop.now += STALL
            for _ in range(10):  # the due timer runs within a turn or two
                await asyncio.sleep(0)
            lines_per_stall.append(status_lines(caplog))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert lines_per_stall == [1, 1, 1]
    assert buf.stats().total.waiting_samplers == 0


@pytest.mark.parametrize("interval", [1e-12, 0.0009])
def test_status_log_intervals_below_one_millisecond_are_refused(interval: float) -> None:
    with pytest.raises(ConfigError, match="status_log_interval"):
        ReplayBuffer(status_log_interval=interval)
    assert ReplayBuffer(status_log_interval=0.001).stats().total.waiting_samplers == 0  # the minimum is fine
