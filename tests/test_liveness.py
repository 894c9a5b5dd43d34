"""Liveness: nothing can leave a ``sample`` stuck, and no way out of one loses anything.

- a ``sample`` waiting on a group that never finishes always ends by timeout or cancellation
  (cancel scopes, ``asyncio.Task.cancel``), and the queue behind it keeps moving;
- ``close()`` in the middle of heavy traffic wakes every waiter with BufferClosedError and
  loses nothing already present;
- an ``on_evict`` callback that raises, closes the buffer or calls producers leaves the
  buffer consistent.

Every async test is bounded by ``anyio.fail_after``; none asserts on timing.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Iterable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from _helpers import assert_conserved, resident_keys
from stalebuf import Batch, EvictionEvent, Group, ReplayBuffer, SamplerConfig
from stalebuf.errors import BackendMismatchError, BufferClosedError, UnknownGroupError

LIMIT = 10  # seconds; a hang fails instead of stalling CI


def make(on_evict: Any = None, status_log_interval: float | None = None, **config: Any) -> ReplayBuffer:
    return ReplayBuffer(SamplerConfig(**config), on_evict=on_evict, status_log_interval=status_log_interval)


def add(
    buf: ReplayBuffer, uid: str, step: int, *, end: str = "finish", n: int = 2, partition: str = "train"
) -> None:
    """Add a group with ``n`` trajectories; end it with "finish", "fail", or leave it "running"."""
    buf.add_prompt_nowait(uid, global_steps=step, partition=partition)
    buf.mark_running_nowait(uid)
    for session in range(n):
        buf.put_nowait(uid, (uid, session), session_id=session)
    if end == "finish":
        buf.mark_finished_nowait(uid)
    elif end == "fail":
        buf.mark_failed_nowait(uid)


def keys_of(groups: Iterable[Group]) -> list[str]:
    return [t.key for g in groups for t in g.trajectories]


async def settle() -> None:
    await anyio.wait_all_tasks_blocked()


# -- a sample waiting on a group that never finishes ------------------------------------------


def never_ready(strategy: str, status_log_interval: float | None = None) -> ReplayBuffer:
    """A buffer whose ``sample(5, 2)`` can never return until "stuck" finishes.

    drop: one finished group and one that never finishes; wait: two finished groups, but
    "stuck" is in flight with s >= T.
    """
    buf = make(
        max_off_policy_threshold=2, max_off_policy_strategy=strategy, status_log_interval=status_log_interval
    )
    add(buf, "ready", 5)
    if strategy == "wait":
        add(buf, "ready2", 5)
    add(buf, "stuck", 0 if strategy == "wait" else 5, end="running")
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
        add(buf, "a", 0)
        add(buf, "b", 0)
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
        add(buf, "gated", 0, end="running")  # closes the wait gate of "train"
        add(buf, "f1", 0)
        add(buf, "v1", 0, partition="val")
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
            before = {uid: group.status for uid, group in buf._groups.items()}
            await buf.aclose()
        assert outcomes == ["closed"] * 5
        assert {uid: group.status for uid, group in buf._groups.items()} == before
        assert buf.stats().total.waiting_samplers == 0
        with pytest.raises(BufferClosedError):
            await buf.sample(3, 1, partition="val", timeout=0)
        assert_conserved(buf)


# -- on_evict that raises, closes or produces -----------------------------------------------------


class Boom(Exception):
    pass


@pytest.mark.anyio
async def test_raising_on_evict_fast_path_leaves_buffer_consistent() -> None:
    with anyio.fail_after(LIMIT):
        seen: list[EvictionEvent] = []

        def on_evict(event: EvictionEvent) -> None:
            seen.append(event)
            raise Boom(event.reason)

        buf = make(on_evict=on_evict, max_off_policy_threshold=1)
        add(buf, "old", 0)
        add(buf, "new1", 5)
        add(buf, "new2", 5)
        with pytest.raises(Boom):
            await buf.sample(5, 1)
        assert [g.uid for e in seen for g in e.groups] == ["old"]
        stats = buf.stats().total
        assert (stats.evicted_stale_groups, stats.sampled_groups, stats.finished) == (1, 0, 2)
        with pytest.raises(UnknownGroupError):
            buf.put_nowait("old", 1, session_id=9)
        assert_conserved(buf)
        batch, _ = await buf.sample(5, 2, timeout=0)  # nothing left to evict: no callback
        assert batch.uids == ["new1", "new2"]
        assert len(seen) == 1


@pytest.mark.anyio
async def test_raising_on_evict_in_a_waiter_passes_the_turn_on() -> None:
    """The head waiter's callback raises: it leaves the queue and the next waiter is served."""
    with anyio.fail_after(LIMIT):

        def on_evict(event: EvictionEvent) -> None:
            raise Boom(event.reason)

        buf = make(on_evict=on_evict, max_off_policy_threshold=1, failure_strategy="evict")
        results: list[Any] = []

        async def run(step: int, batch_size: int) -> None:
            try:
                results.append((await buf.sample(step, batch_size))[0].uids)
            except Boom as exc:
                results.append(f"boom:{exc}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 5, 1)
            await settle()
            tg.start_soon(run, 5, 1)
            await settle()
            add(buf, "bad", 5, end="fail")  # wakes the head, whose callback raises
            await settle()
            assert results == ["boom:failure"]
            add(buf, "good", 5)
        assert results == ["boom:failure", ["good"]]
        assert buf.stats().total.evicted_failure_groups == 1
        assert_conserved(buf)


@pytest.mark.anyio
async def test_on_evict_raising_for_both_reasons_reports_all_and_raises_the_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with anyio.fail_after(LIMIT):
        reasons: list[str] = []

        def on_evict(event: EvictionEvent) -> None:
            reasons.append(event.reason)
            raise Boom(event.reason)

        buf = make(on_evict=on_evict, max_off_policy_threshold=1, failure_strategy="evict")
        add(buf, "failed", 5, end="fail")
        add(buf, "stale", 0)
        add(buf, "fresh", 5)
        with caplog.at_level(logging.ERROR, logger="stalebuf"), pytest.raises(Boom, match="failure"):
            await buf.sample(5, 1)
        assert reasons == ["failure", "stale"]
        assert any("on_evict raised again" in r.getMessage() for r in caplog.records)
        stats = buf.stats().total
        assert (stats.evicted_failure_groups, stats.evicted_stale_groups, stats.finished) == (1, 1, 1)
        assert_conserved(buf)
        assert (await buf.sample(5, 1, timeout=0))[0].uids == ["fresh"]


def closing_buffer() -> ReplayBuffer:
    """A drop buffer whose on_evict closes it."""
    holder: list[ReplayBuffer] = []
    buf = make(on_evict=lambda event: holder[0].close(), max_off_policy_threshold=1)
    holder.append(buf)
    return buf


@pytest.mark.anyio
async def test_on_evict_that_closes_the_buffer_fast_path() -> None:
    with anyio.fail_after(LIMIT):
        buf = closing_buffer()
        add(buf, "stale", 0)
        add(buf, "fresh", 5)
        with pytest.raises(BufferClosedError):
            await buf.sample(5, 1)
        assert buf.closed
        assert buf.stats().total.evicted_stale_groups == 1
        assert set(buf._groups) == {"fresh"}, "close() inside on_evict lost or sampled a group"
        assert_conserved(buf)


@pytest.mark.anyio
async def test_on_evict_that_closes_the_buffer_from_a_parked_waiter() -> None:
    with anyio.fail_after(LIMIT):
        buf = closing_buffer()
        add(buf, "fresh", 5)
        outcomes: list[str] = []

        async def queued() -> None:
            try:
                await buf.sample(5, 2)
            except BufferClosedError:
                outcomes.append("closed")

        async with anyio.create_task_group() as tg:
            tg.start_soon(queued)
            await settle()
            tg.start_soon(queued)
            await settle()
            add(buf, "stale", 0)  # wakes the head: it evicts, the callback closes
        assert outcomes == ["closed", "closed"]
        assert set(buf._groups) == {"fresh"}
        assert buf.stats().total.waiting_samplers == 0
        assert_conserved(buf)


@pytest.mark.anyio
@pytest.mark.parametrize("parked", [False, True])
async def test_on_evict_may_refill_prompts_and_finish_fresh_groups(parked: bool) -> None:
    """The documented use: on_evict re-dispatches evicted prompts through the *_nowait producers."""
    with anyio.fail_after(LIMIT):
        refills: list[str] = []
        buf: ReplayBuffer

        def on_evict(event: EvictionEvent) -> None:
            for group in event.groups:
                uid = f"re{group.uid}"
                buf.add_prompt_nowait(uid, global_steps=event.global_steps, partition=event.partition)
                buf.put_nowait(uid, "again")
                buf.mark_finished_nowait(uid)  # a fresh group: s = 1
                refills.append(uid)

        buf = make(on_evict=on_evict, max_off_policy_threshold=1)
        if parked:
            results: list[list[str]] = []

            async def run() -> None:
                results.append((await buf.sample(4, 1))[0].uids)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await settle()
                assert buf.stats().total.waiting_samplers == 1
                add(buf, "stale", 0)  # wakes the parked sample, which evicts and refills
            uids = results[0]
        else:
            add(buf, "stale", 0)
            uids = (await buf.sample(4, 1))[0].uids
        assert refills == ["restale"]
        assert uids == ["restale"]
        assert_conserved(buf)
        assert buf.stats().total.admitted_groups == 2


@pytest.mark.anyio
async def test_on_evict_cannot_smuggle_a_stale_group_into_a_drop_batch() -> None:
    """Regression: _evaluate evicted once, then selected a group on_evict had just finished."""
    with anyio.fail_after(LIMIT):
        buf: ReplayBuffer

        def on_evict(event: EvictionEvent) -> None:
            if "late" in buf._groups:
                buf.mark_finished_nowait("late")  # in flight since step 0: s = 6 > T = 1

        buf = make(on_evict=on_evict, max_off_policy_threshold=1)
        add(buf, "late", 0, end="running")
        add(buf, "old", 0)
        add(buf, "fresh", 5)
        batch, _ = await buf.sample(5, 1)
        assert batch.staleness.max() <= 1, f"drop returned {batch.uids} with staleness {batch.staleness}"


@pytest.mark.anyio
async def test_group_failed_inside_on_evict_of_a_parked_sample_is_evicted() -> None:
    """Regression: a wake-up sent during the head's own evaluation was discarded."""
    with anyio.fail_after(LIMIT):
        seen: list[tuple[str, list[str]]] = []
        buf: ReplayBuffer

        def on_evict(event: EvictionEvent) -> None:
            seen.append((event.reason, [g.uid for g in event.groups]))
            if "sibling" in buf._groups:
                buf.mark_failed_nowait("sibling")  # e.g. abandon the rest of a failed batch

        buf = make(on_evict=on_evict, failure_strategy="evict")
        add(buf, "sibling", 0, end="running")
        async with anyio.create_task_group() as tg:
            tg.start_soon(buf.sample, 0, 2)
            await settle()
            add(buf, "first", 0, end="fail")  # wakes the parked sample: it evicts "first"
            await settle()
            try:
                assert seen == [("failure", ["first"]), ("failure", ["sibling"])], seen
                assert buf.stats().total.failure == 0
            finally:
                tg.cancel_scope.cancel()


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
    add(buf, "a", 0)
    assert anyio.run(take_now, backend=bound) == ["a"]
