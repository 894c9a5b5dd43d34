"""Cancellation fuzz: ``sample`` calls cancelled at random moments lose nothing.

Samplers are cut short by every means there is (cancel scopes cancelled from another
task, ``move_on_after``, ``timeout=``, ``asyncio.Task.cancel``, ``asyncio.wait_for``), at
random moments, including in the same tick as the producer call that wakes them, while
producers keep creating groups. Afterwards:

- conservation holds and the counters agree with what the callers actually received, so no
  cancelled call removed a sampleable group;
- every trajectory is in exactly one place (returned once, evicted once, or still resident);
- a fresh sample obtains every group the cancelled calls did not take.

Every test is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from _helpers import assert_conserved, resident_uids
from stalebuf import Batch, EvictionEvent, ReplayBuffer, SamplerConfig

LIMIT = 20  # seconds; a hang fails instead of stalling CI
GROUPS = 1500  # admitted per fuzz run before producers stop


class Fuzz:
    """Producers, interrupted samplers and a step counter on one buffer, with a full ledger."""

    def __init__(self, seed: int, strategy: str, failure_strategy: str) -> None:
        self.rng = random.Random(seed)
        self.buf = ReplayBuffer(
            SamplerConfig(
                max_off_policy_threshold=2,
                max_off_policy_strategy=strategy,  # type: ignore[arg-type]
                failure_strategy=failure_strategy,  # type: ignore[arg-type]
            ),
            on_evict=self.on_evict,
            status_log_interval=None,
        )
        self.strategy = strategy
        self.step = 0
        self.next_uid = 0
        self.stop = False
        self.admitted: list[str] = []
        self.admitted_uids: list[str] = []
        self.sampled: list[str] = []
        self.sampled_uids: list[str] = []
        self.evicted: list[str] = []
        self.evicted_uids: list[str] = []
        self.outcomes: Counter[str] = Counter()
        self.sample_tasks: set[Any] = set()  # asyncio sample tasks in flight

    # -- bookkeeping -------------------------------------------------------------------

    def on_evict(self, event: EvictionEvent) -> None:
        for group in event.groups:
            self.evicted_uids.append(group.uid)
            self.evicted.extend(t.key for t in group.trajectories)

    def received(self, batch: Batch, batch_size: int, g: int) -> None:
        assert len(batch) == batch_size
        steps = [group.global_steps for group in batch.groups]
        assert steps == sorted(steps)
        if self.strategy == "drop" and batch.partition == "train":
            assert all(g - p + 1 <= 2 for p in steps), "drop returned s > T"
        self.sampled_uids.extend(batch.uids)
        self.sampled.extend(batch.keys)
        if batch.partition == "train":
            self.step = max(self.step, g + 1)

    def uid(self) -> str:
        self.next_uid += 1
        return f"f{self.next_uid}"

    # -- producers ---------------------------------------------------------------------

    def produce_now(self, partition: str) -> None:
        """A whole group in one synchronous step: it may wake a waiter in this very tick."""
        uid = self.uid()
        buf = self.buf
        buf.add_prompt_nowait(uid, global_steps=self.step, partition=partition)
        self.admitted_uids.append(uid)
        for session in range(self.rng.randint(1, 3)):
            self.admitted.append(buf.put_nowait(uid, session, session_id=session))
        buf.mark_finished_nowait(uid)

    async def producer(self) -> None:
        buf, rng = self.buf, self.rng
        while self.next_uid < GROUPS:
            uid = self.uid()
            partition = rng.choice(("train", "train", "val"))
            await buf.add_prompt(uid, global_steps=max(0, self.step - rng.randrange(2)), partition=partition)
            self.admitted_uids.append(uid)
            await anyio.sleep(rng.uniform(0, 0.001))
            await buf.mark_running(uid)
            for session in range(rng.randint(1, 4)):
                if rng.random() < 0.5:
                    await anyio.lowlevel.checkpoint()
                self.admitted.append(await buf.put(uid, session, session_id=session))
            await (buf.mark_failed(uid) if rng.random() < 0.1 else buf.mark_finished(uid))

    # -- the end -------------------------------------------------------------------------

    async def drain_and_check(self) -> None:
        """After all samplers are gone: a fresh sample takes everything; the ledger balances."""
        buf = self.buf
        assert buf.stats().total.waiting_samplers == 0
        assert buf.stats().total.sampled_groups == len(self.sampled_uids), (
            "the counters say more groups were sampled than the callers received: "
            "a cancelled sample removed groups"
        )
        assert_conserved(buf)
        for partition in ("train", "val"):
            g = self.step
            count = buf.sampleable_count(g, partition)
            try:  # even with nothing to take, the call evicts what must go
                batch, _ = await buf.sample(g, max(count, 1), partition=partition, timeout=0)
            except TimeoutError:
                assert count == 0
            else:
                self.received(batch, count, g)
        assert not resident_uids(buf), f"left behind: {sorted(resident_uids(buf))}"
        assert Counter(self.sampled) + Counter(self.evicted) == Counter(self.admitted)
        assert max(Counter(self.sampled).values(), default=1) == 1, "a trajectory was returned twice"
        assert max(Counter(self.sampled_uids).values(), default=1) == 1, "a group was returned twice"
        assert Counter(self.sampled_uids) + Counter(self.evicted_uids) == Counter(self.admitted_uids)
        assert_conserved(buf)


# -- anyio: cancel scopes, move_on_after, timeout= ---------------------------------------------

ANYIO_METHODS = ("scope", "move_on", "timeout", "race", "plain")


async def anyio_attempts(fuzz: Fuzz, partition: str, tg: anyio.abc.TaskGroup) -> None:
    rng, buf = fuzz.rng, fuzz.buf
    while not fuzz.stop:
        method = rng.choice(ANYIO_METHODS)
        batch_size = rng.randint(1, 6)
        g = fuzz.step
        timeout = rng.choice((0, 0.0005, 0.002)) if method == "timeout" else None
        scope = anyio.move_on_after(rng.uniform(0, 0.003)) if method == "move_on" else anyio.CancelScope()
        if method == "scope":

            async def killer(scope: anyio.CancelScope = scope) -> None:
                for _ in range(rng.randrange(6)):
                    await anyio.lowlevel.checkpoint()
                if rng.random() < 0.5:
                    await anyio.sleep(rng.uniform(0, 0.002))
                scope.cancel()

            tg.start_soon(killer)
        elif method == "race":

            async def racer(scope: anyio.CancelScope = scope) -> None:
                for _ in range(rng.randrange(4)):
                    await anyio.lowlevel.checkpoint()
                for _ in range(rng.randint(1, 6)):
                    fuzz.produce_now(partition)  # may wake the waiter...
                scope.cancel()  # ...which is cancelled in the same tick

            tg.start_soon(racer)
        with scope:
            try:
                batch, _ = await buf.sample(g, batch_size, partition=partition, timeout=timeout)
            except TimeoutError:
                fuzz.outcomes["timeout"] += 1
            else:
                fuzz.received(batch, batch_size, g)  # no checkpoint between return and record
                fuzz.outcomes["returned"] += 1
        if scope.cancelled_caught:
            fuzz.outcomes["cancelled"] += 1
        assert_conserved(buf)
        await anyio.lowlevel.checkpoint()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("seed", "strategy", "failure_strategy"),
    [(11, "drop", "sample"), (12, "wait", "evict"), (13, "drop", "evict"), (14, "wait", "sample")],
)
async def test_fuzz_cancel_scopes_and_timeouts(seed: int, strategy: str, failure_strategy: str) -> None:
    with anyio.fail_after(LIMIT):
        fuzz = Fuzz(seed, strategy, failure_strategy)
        async with anyio.create_task_group() as samplers:
            for partition in ("train", "train", "val", "val"):
                samplers.start_soon(anyio_attempts, fuzz, partition, samplers)
            async with anyio.create_task_group() as producers:
                for _ in range(12):
                    producers.start_soon(fuzz.producer)
            fuzz.stop = True  # the producers stopped after GROUPS groups
            samplers.cancel_scope.cancel()  # the last attempts are cancelled wherever they are
        assert fuzz.outcomes["cancelled"] + fuzz.outcomes["timeout"] > 0, fuzz.outcomes
        assert fuzz.outcomes["returned"] > 0, fuzz.outcomes
        await fuzz.drain_and_check()


# -- asyncio: Task.cancel and wait_for ---------------------------------------------------------

ASYNCIO_METHODS = ("task.cancel", "wait_for", "race", "plain")


async def asyncio_attempts(fuzz: Fuzz, partition: str) -> None:
    rng, buf = fuzz.rng, fuzz.buf

    async def call(g: int, batch_size: int) -> Batch:
        batch, _ = await buf.sample(g, batch_size, partition=partition)
        fuzz.received(batch, batch_size, g)  # recorded inside the task, before it can be cancelled
        return batch

    while not fuzz.stop:
        method = rng.choice(ASYNCIO_METHODS)
        g, batch_size = fuzz.step, rng.randint(1, 6)
        task = asyncio.ensure_future(call(g, batch_size))
        fuzz.sample_tasks.add(task)
        task.add_done_callback(fuzz.sample_tasks.discard)
        try:
            if method == "wait_for":
                await asyncio.wait_for(task, rng.uniform(0, 0.003))
            else:
                if method in ("task.cancel", "race"):
                    for _ in range(rng.randrange(5)):
                        await asyncio.sleep(0)
                    if rng.random() < 0.3:
                        await asyncio.sleep(rng.uniform(0, 0.002))
                    if method == "race":
                        for _ in range(rng.randint(1, 6)):
                            fuzz.produce_now(partition)  # wakes the task...
                    task.cancel()  # ...and cancels it in the same tick
                await task
            fuzz.outcomes["returned"] += 1
        except asyncio.TimeoutError:
            fuzz.outcomes["timeout"] += 1
        except asyncio.CancelledError:
            assert task.cancelled()  # this loop itself is never cancelled
            fuzz.outcomes["cancelled"] += 1
        assert_conserved(buf)
        await asyncio.sleep(0)


@pytest.mark.asyncio
@pytest.mark.parametrize(("seed", "strategy"), [(21, "drop"), (22, "wait")])
async def test_fuzz_asyncio_task_cancel(seed: int, strategy: str) -> None:
    with anyio.fail_after(LIMIT):
        fuzz = Fuzz(seed, strategy, "evict")
        samplers = [
            asyncio.ensure_future(asyncio_attempts(fuzz, p)) for p in ("train", "train", "val", "val")
        ]
        producers = [asyncio.ensure_future(fuzz.producer()) for _ in range(12)]
        await asyncio.gather(*producers)  # they stop after GROUPS groups
        fuzz.stop = True  # no loop starts another attempt...
        for task in list(fuzz.sample_tasks):
            task.cancel()  # ...and the calls still in flight are cancelled wherever they are
        await asyncio.gather(*samplers)
        assert fuzz.outcomes["cancelled"] + fuzz.outcomes["timeout"] > 0, fuzz.outcomes
        await fuzz.drain_and_check()


# -- deterministic cases -----------------------------------------------------------------------


def finished(buf: ReplayBuffer, uid: str, step: int, partition: str = "train") -> None:
    buf.add_prompt_nowait(uid, global_steps=step, partition=partition)
    buf.put_nowait(uid, uid)
    buf.mark_finished_nowait(uid)


Interrupt = Callable[[ReplayBuffer, anyio.abc.TaskGroup], Awaitable[Any]]


async def by_scope_cancel(buf: ReplayBuffer, tg: anyio.abc.TaskGroup) -> None:
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            await buf.sample(2, 4)

    tg.start_soon(run)
    await anyio.wait_all_tasks_blocked()
    assert buf.stats().total.waiting_samplers == 1
    scope.cancel()


async def by_move_on_after(buf: ReplayBuffer, tg: anyio.abc.TaskGroup) -> None:
    with anyio.move_on_after(0.01):
        await buf.sample(2, 4)


async def by_timeout(buf: ReplayBuffer, tg: anyio.abc.TaskGroup) -> None:
    with pytest.raises(TimeoutError):
        await buf.sample(2, 4, timeout=0.01)


@pytest.mark.anyio
@pytest.mark.parametrize("interrupt", [by_scope_cancel, by_move_on_after, by_timeout])
async def test_fresh_sample_gets_what_the_interrupted_one_did_not_take(interrupt: Interrupt) -> None:
    with anyio.fail_after(LIMIT):
        events: list[EvictionEvent] = []
        buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=2), on_evict=events.append)
        finished(buf, "stale", 0)  # evicted by the interrupted call, before it parks
        for uid in ("a", "b", "c"):
            finished(buf, uid, 1)
        finished(buf, "v", 0, partition="val")
        async with anyio.create_task_group() as tg:
            await interrupt(buf, tg)
        # the interrupted call's eviction stands, and was reported
        assert [g.uid for e in events for g in e.groups] == ["stale"]
        stats = buf.stats()
        assert (
            stats.total.evicted_stale_groups,
            stats.total.sampled_groups,
            stats.total.waiting_samplers,
        ) == (
            1,
            0,
            0,
        )
        batch, _ = await buf.sample(2, 3, timeout=0)
        assert batch.uids == ["a", "b", "c"]
        assert_conserved(buf)


@pytest.mark.anyio
async def test_scope_cancelled_in_the_tick_that_wakes_it() -> None:
    """Woken and cancelled in one tick, the call either returns the batch or takes nothing."""
    with anyio.fail_after(LIMIT):
        buf = ReplayBuffer(status_log_interval=None)
        got: list[tuple[str, list[str]]] = []
        scope = anyio.CancelScope()

        async def head() -> None:
            with scope:
                got.append(("head", (await buf.sample(0, 2))[0].uids))

        async def tail() -> None:
            got.append(("tail", (await buf.sample(0, 2))[0].uids))

        async with anyio.create_task_group() as tg:
            tg.start_soon(head)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(tail)
            await anyio.wait_all_tasks_blocked()
            finished(buf, "a", 0)
            finished(buf, "b", 0)  # wakes the head...
            scope.cancel()  # ...cancelled in the same tick
            await anyio.wait_all_tasks_blocked()
            if got == [("head", ["a", "b"])]:  # it returned before the cancellation could land
                finished(buf, "c", 0)
                finished(buf, "d", 0)
        assert got in ([("head", ["a", "b"]), ("tail", ["c", "d"])], [("tail", ["a", "b"])]), got
        assert buf.stats().total.sampled_groups == 2 * len(got)
        assert_conserved(buf)


@pytest.mark.asyncio
async def test_task_cancelled_in_the_tick_that_wakes_it_passes_the_batch_on() -> None:
    with anyio.fail_after(LIMIT):
        buf = ReplayBuffer(status_log_interval=None)
        head = asyncio.ensure_future(buf.sample(0, 2))
        await asyncio.sleep(0)
        tail = asyncio.ensure_future(buf.sample(0, 2))
        await asyncio.sleep(0)
        assert buf.stats().total.waiting_samplers == 2
        finished(buf, "a", 0)
        finished(buf, "b", 0)  # wakes the head...
        head.cancel()  # ...cancelled before it ran: it must take nothing
        with pytest.raises(asyncio.CancelledError):
            await head
        batch, _ = await tail
        assert batch.uids == ["a", "b"]
        assert buf.stats().total.sampled_groups == 2
        assert_conserved(buf)


@pytest.mark.asyncio
async def test_wait_for_timeout_takes_nothing() -> None:
    with anyio.fail_after(LIMIT):
        buf = ReplayBuffer(status_log_interval=None)
        finished(buf, "a", 0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(buf.sample(0, 2), 0.01)
        assert buf.stats().total.waiting_samplers == 0
        assert (await buf.sample(0, 1, timeout=0))[0].uids == ["a"]
