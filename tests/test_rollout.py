"""rollout() (issue 11) and the concurrent properties 1 (hard bound under wait) and 2 (no deadlock).

``async with buffer.rollout(uid) as group`` admits a group (waiting for a slot), marks it
RUNNING, and ends it with the block: FINISHED on a normal exit, FAILED when the body raises
(the error propagates); if the group is evicted while the body runs (in-flight eviction, or
close) the body is cancelled and the block exits quietly with ``group.evicted``. Every test runs
on asyncio and trio, every wait bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from _helpers import LIMIT, add_group, assert_conserved, make, resident_groups, settle
from stalebuf import (
    BatchNotReadyError,
    BufferClosedError,
    EvictionEvent,
    GroupEvictedError,
    ReplayBuffer,
    RolloutGroup,
    SamplerConfig,
    Status,
)

pytestmark = pytest.mark.anyio


class Boom(Exception):
    """The body's own error."""


def status_of(buf: ReplayBuffer, uid: str) -> Status:
    return resident_groups(buf)[uid].status


# -- the block's exits ---------------------------------------------------------------------------


async def test_a_body_that_returns_finishes_the_group() -> None:
    buf = make(admission_batch_size=2)
    with anyio.fail_after(LIMIT):
        async with buf.rollout("a", tags={"kind": "math"}) as group:
            assert isinstance(group, RolloutGroup)
            assert (group.uid, group.partition, group.global_steps, group.evicted) == ("a", "train", 0, False)
            assert status_of(buf, "a") is Status.RUNNING
            assert await group.put("x") == "a_0_0"
            assert group.put_nowait("y", session_id=1, index=2, tags={"r": 1}) == "a_1_2"
    assert not group.evicted
    view = resident_groups(buf)["a"]
    assert view.status is Status.FINISHED
    assert [t.key for t in view.trajectories] == ["a_0_0", "a_1_2"]
    assert dict(view.tags) == {"kind": "math"}
    batch, _ = buf.sample_nowait(0, 1)
    assert batch.payloads == ["x", "y"]


async def test_a_body_that_raises_fails_the_group_and_the_error_propagates() -> None:
    buf = make(admission_batch_size=2)
    groups: list[RolloutGroup] = []

    async def produce() -> None:
        async with buf.rollout("a") as group:
            groups.append(group)
            await group.put("x")
            raise Boom

    with anyio.fail_after(LIMIT), pytest.raises(Boom):
        await produce()
    assert status_of(buf, "a") is Status.FAILURE
    assert not groups[0].evicted


async def test_a_body_that_ends_the_group_itself_is_left_alone() -> None:
    buf = make(admission_batch_size=2)

    async def finish_then_raise() -> None:
        async with buf.rollout("b"):
            await buf.mark_finished("b")
            raise Boom

    with anyio.fail_after(LIMIT):
        async with buf.rollout("a"):
            await buf.mark_failed("a")
        with pytest.raises(Boom):
            await finish_then_raise()
    assert (status_of(buf, "a"), status_of(buf, "b")) == (Status.FAILURE, Status.FINISHED)


async def test_eviction_in_flight_cancels_the_body_and_the_block_exits_quietly() -> None:
    events: list[EvictionEvent] = []
    buf = make(
        admission_batch_size=2,
        max_off_policy_threshold=1,
        evict_stale_in_flight=True,
        on_evict=events.append,
    )
    reached: list[str] = []
    groups: dict[str, RolloutGroup] = {}

    async def produce(uid: str, step: int | None) -> None:
        async with buf.rollout(uid, global_steps=step) as group:
            groups[uid] = group
            await group.put(uid)
            if uid == "old":
                await anyio.sleep_forever()
            reached.append(f"{uid} body end")
        reached.append(f"{uid} after block")

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, "old", None)
            await settle()
            assert status_of(buf, "old") is Status.RUNNING
            with pytest.raises(BatchNotReadyError):
                buf.sample_nowait(2, 1)  # s = 3 > T: no later sample could return "old"
            await settle()
            add_group(buf, "fresh", 2)  # at the clock (admission refuses a step ahead of it)
            batch, _ = buf.sample_nowait(2, 1)
            assert batch.uids == ["fresh"]
            # T*S = 1 and sample(2) returned: step 2 is closed; step 3 opens with the clock.
            with pytest.raises(BatchNotReadyError):
                buf.sample_nowait(3, 1)
            tg.start_soon(produce, "new", 3)  # a body the eviction did not touch finishes
    assert reached == ["old after block", "new body end", "new after block"]
    assert groups["old"].evicted
    assert not groups["new"].evicted
    assert "old" not in buf
    assert status_of(buf, "new") is Status.FINISHED
    [event] = events
    assert event.reason == "stale"
    [evicted] = event.groups
    assert (evicted.uid, evicted.status, [t.payload for t in evicted.trajectories]) == (
        "old",
        Status.RUNNING,
        ["old"],
    )
    with pytest.raises(GroupEvictedError):
        groups["old"].put_nowait("late", session_id=1)
    assert_conserved(buf)


async def test_a_shielded_body_learns_of_the_eviction_on_its_next_write() -> None:
    buf = make(admission_batch_size=1, max_off_policy_threshold=1, evict_stale_in_flight=True)
    errors: list[BaseException] = []

    async def produce() -> None:
        async with buf.rollout("a") as group:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.02)  # the eviction lands here
                try:
                    await group.put("late")
                except GroupEvictedError as exc:
                    errors.append(exc)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            await settle()
            with pytest.raises(BatchNotReadyError):
                buf.sample_nowait(3, 1)  # evicts "a" while its body is shielded
    assert len(errors) == 1
    assert "in flight" in str(errors[0])
    assert buf.stats().total.evicted_in_flight_groups == 1


@pytest.mark.parametrize("how", ["in-flight eviction", "close"])
async def test_a_body_that_writes_before_the_cancellation_reaches_it_still_exits_quietly(how: str) -> None:
    """The body's generation completes (its await is done, the task is scheduled to resume) and,
    before it runs, the trainer evicts the group or closes the buffer. Cancellation only lands
    at the body's next checkpoint, so its next write runs first and is refused: the block must
    still exit without raising, with ``group.evicted`` set."""
    buf = make(admission_batch_size=1, max_off_policy_threshold=1, evict_stale_in_flight=True)
    generated = anyio.Event()
    outcome: list[object] = []

    async def produce() -> None:
        try:
            async with buf.rollout("a") as group:
                await generated.wait()
                await group.put("result")  # no checkpoint before this write
                outcome.append("wrote")
            outcome.append(group.evicted)
        except Exception as exc:
            outcome.append(exc)

    await _release_then_evict_or_close(buf, how, produce, generated)
    assert outcome == [True], f"the block raised or wrote instead of exiting quietly: {outcome}"


@pytest.mark.parametrize("writers", [2, 1])  # 1: the other session is still generating, and is cancelled
@pytest.mark.parametrize("how", ["in-flight eviction", "close"])
async def test_a_body_whose_child_task_writes_before_the_cancellation_reaches_it_still_exits_quietly(
    how: str, writers: int
) -> None:
    """As above, but the body generates its sessions in a task group of its own (the usual
    body): a session whose generation completed just before the eviction writes, is refused,
    and its task group wraps that refusal in an ExceptionGroup. The block must still exit
    quietly."""
    buf = make(admission_batch_size=1, max_off_policy_threshold=1, evict_stale_in_flight=True)
    generated = anyio.Event()
    outcome: list[object] = []

    async def session(group: Any, index: int) -> None:
        if index >= writers:
            await anyio.sleep_forever()
        await generated.wait()
        await group.put("result", session_id=index)  # no checkpoint before this write

    async def produce() -> None:
        try:
            async with buf.rollout("a") as group:
                async with anyio.create_task_group() as sessions:
                    for index in range(2):
                        sessions.start_soon(session, group, index)
                outcome.append("wrote")
            outcome.append(group.evicted)
        except BaseException as exc:  # an ExceptionGroup is what must not escape
            outcome.append(exc)

    await _release_then_evict_or_close(buf, how, produce, generated)
    assert outcome == [True], f"the block raised or wrote instead of exiting quietly: {outcome}"


async def _release_then_evict_or_close(
    buf: ReplayBuffer, how: str, produce: Callable[[], Awaitable[None]], generated: anyio.Event
) -> None:
    """Run ``produce`` until it parks, then set ``generated`` and, in the same step of the loop
    (before the producer resumes), evict its group in flight ("in-flight eviction") or close."""
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            await settle()
            generated.set()  # the producer may resume...
            if how == "close":  # ...but first, in the same step of the loop:
                buf.close()
            else:
                with pytest.raises(BatchNotReadyError):
                    buf.sample_nowait(2, 1)


async def test_close_while_the_body_runs_cancels_it_and_the_group_stays() -> None:
    buf = make(admission_batch_size=1)
    reached: list[str] = []
    group: RolloutGroup | None = None

    async def produce() -> None:
        nonlocal group
        async with buf.rollout("a") as group:
            await group.put(1)
            await anyio.sleep_forever()
            reached.append("body end")
        reached.append("after block")

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            await settle()
            buf.close()
    assert reached == ["after block"]
    assert group is not None
    assert group.evicted
    assert status_of(buf, "a") is Status.RUNNING  # close keeps the groups, as they were
    with pytest.raises(BufferClosedError):
        async with buf.rollout("b"):
            pass


async def test_entering_waits_for_admission_and_is_tagged_when_admitted() -> None:
    buf = make(admission_batch_size=1)
    buf.add_prompt_nowait("a")
    entered: list[RolloutGroup] = []

    async def produce() -> None:
        async with buf.rollout("b") as group:
            entered.append(group)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            await settle()
            assert not entered
            assert buf.stats().total.waiting_producers == 1
            with pytest.raises(BatchNotReadyError):
                buf.sample_nowait(4, 1)  # the clock moves to 4: a fresh slot
    [group] = entered
    assert group.global_steps == 4 == resident_groups(buf)["b"].dispatch_step
    assert status_of(buf, "b") is Status.FINISHED
    with anyio.fail_after(LIMIT):
        async with buf.rollout("c", global_steps=1, partition="val") as group:
            assert (group.global_steps, group.partition) == (1, "val")


async def test_a_rollout_cancelled_while_waiting_to_enter_adds_nothing() -> None:
    buf = make(admission_batch_size=1)
    buf.add_prompt_nowait("a")

    async def produce() -> None:
        with anyio.fail_after(0.02):
            async with buf.rollout("b"):
                pytest.fail("entered without a slot")

    with anyio.fail_after(LIMIT), pytest.raises(TimeoutError):
        await produce()
    assert "b" not in buf
    assert buf.stats().total.waiting_producers == 0


@pytest.mark.parametrize("how", ["cancel scope", "fail_after"])
async def test_outer_cancellation_of_the_body_propagates(how: str) -> None:
    buf = make(admission_batch_size=2)
    reached: list[str] = []
    groups: list[RolloutGroup] = []

    async def produce_under_deadline() -> None:
        with anyio.fail_after(0.02):
            async with buf.rollout("a") as group:
                groups.append(group)
                await anyio.sleep_forever()
            reached.append("after block")

    with anyio.fail_after(LIMIT):
        if how == "cancel scope":
            with anyio.CancelScope() as outer:
                async with buf.rollout("a") as group:
                    groups.append(group)
                    outer.cancel()
                    await anyio.sleep_forever()
                reached.append("after block")  # must not run: the cancellation is not swallowed
            assert outer.cancelled_caught
        else:
            with pytest.raises(TimeoutError):
                await produce_under_deadline()
    assert reached == []
    assert not groups[0].evicted
    assert status_of(buf, "a") is Status.FAILURE  # a cancelled body did not finish its group


# -- properties 1 and 2, concurrently -----------------------------------------------------------

# (T, S, b, strategy): T*S from 1 to 4, drop with evict_stale_in_flight.
PROPERTY_CASES = [
    (1, 1, 1, "wait"),
    (1, 1, 3, "wait"),
    (2, 1, 2, "wait"),
    (1, 2, 2, "wait"),
    (3, 1, 1, "wait"),
    (2, 2, 2, "wait"),
    (1, 1, 2, "drop"),
    (2, 1, 2, "drop"),
    (1, 3, 1, "drop"),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("T", "S", "b", "strategy"), PROPERTY_CASES)
async def test_a_consecutive_trainer_and_rollout_producers_never_exceed_T_and_never_deadlock(
    T: int, S: int, b: int, strategy: str, seed: int
) -> None:
    """A trainer calls sample(g, b) for g = 0, 1, 2, ...; more producers than slots loop
    ``async with buffer.rollout(...)`` with random latencies. Under wait no sampled group has
    s > T and nothing is dropped (property 1); under either strategy everyone finishes
    (property 2) and at most T*S*b groups are ever resident."""
    rng = random.Random(seed * 1000 + T * 100 + S * 10 + b)
    buf = make(
        max_off_policy_threshold=T,
        parameter_sync_step=S,
        max_off_policy_strategy=strategy,
        admission_batch_size=b,
        evict_stale_in_flight=strategy == "drop",
    )
    capacity = T * S * b
    assert buf.capacity() == capacity
    steps = 20
    seen: dict[str, Any] = {"max_staleness": 0.0, "max_resident": 0, "bodies": 0, "evicted": 0}

    def check_resident() -> None:
        resident = buf.stats().total.groups
        seen["max_resident"] = max(seen["max_resident"], resident)
        assert resident <= capacity

    async def worker(w: int) -> None:
        for n in range(10**6):
            try:
                async with buf.rollout(f"w{w}n{n}") as group:
                    check_resident()
                    seen["bodies"] += 1
                    await anyio.sleep(rng.random() * 0.003)
                    await group.put(n)
                    if rng.random() < 0.5:
                        await anyio.sleep(rng.random() * 0.003)
                seen["evicted"] += group.evicted
            except BufferClosedError:
                return

    async def trainer() -> None:
        for g in range(steps):
            batch, metrics = await buf.sample(g, b)
            check_resident()
            assert len(batch) == b
            seen["max_staleness"] = max(seen["max_staleness"], float(batch.staleness.max()))
            generation = metrics["training/off_policy/sampled_generation_steps/mean"]
            queue = metrics["training/off_policy/sampled_queue_steps/mean"]
            assert generation + queue == pytest.approx(g - sum(x.dispatch_step for x in batch) / b)
            await anyio.sleep(rng.random() * 0.003)  # training: producers run meanwhile
        await buf.aclose()

    with anyio.fail_after(4 * LIMIT):
        async with anyio.create_task_group() as tg:
            for w in range(capacity + 2):
                tg.start_soon(worker, w)
            tg.start_soon(trainer)
    stats = buf.stats().total
    assert stats.sampled_groups == steps * b
    assert seen["max_staleness"] <= T
    if strategy == "wait":
        assert stats.evicted_stale_groups == 0
        assert stats.evicted_in_flight_groups == 0
    assert stats.waiting_producers == 0
    assert stats.waiting_samplers == 0
    assert_conserved(buf)


async def test_a_block_ends_only_the_group_it_entered_with_not_a_later_one_under_its_uid() -> None:
    """Defect (issue 21, item 1): a body that ended its own group, which was then sampled, saw
    another producer admit a new group under the same uid; on exit the first block marked that
    *new* group FINISHED, so a half-generated group was trained and its producer's next put
    raised InvalidTransitionError. The block ends the group it entered with, by identity."""
    buf = make()
    entered = anyio.Event()
    leave = anyio.Event()

    async def first() -> None:
        async with buf.rollout("u") as group:
            await group.put("a")
            await buf.mark_finished("u")  # the body ends its own group (supported)
            entered.set()
            await leave.wait()

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await entered.wait()
            batch, _ = await buf.sample(0, 1)
            assert batch.uids == ["u"]
            await buf.add_prompt("u")  # another producer reuses the uid
            await buf.put("u", "half")
            leave.set()  # the first block exits now
    assert status_of(buf, "u") is Status.PENDING  # not finished by the first block's exit
    await buf.put("u", "rest", index=1)  # its producer goes on writing
    await buf.mark_finished("u")
    batch, _ = await buf.sample(1, 1)
    assert [t.payload for t in batch.groups[0].trajectories] == ["half", "rest"]
    assert_conserved(buf)


async def test_a_failing_block_fails_only_the_group_it_entered_with() -> None:
    """Defect (issue 21, item 1), failure side: a body that ended its group and raised after
    the uid was reused must not fail the new group."""
    buf = make()

    async def body() -> None:
        async with buf.rollout("u"):
            await buf.mark_finished("u")
            await buf.sample(0, 1)
            await buf.add_prompt("u")
            raise Boom

    with anyio.fail_after(LIMIT), pytest.raises(Boom):
        await body()
    assert status_of(buf, "u") is Status.PENDING
    assert_conserved(buf)


# -- under a journal's backpressure --------------------------------------------------------------


class StuckJournal:
    """A journaled buffer (admission: one group a step) whose writer cannot commit while
    another connection holds the file's write lock: after a change, its writer is behind."""

    def __init__(self, path: Path) -> None:
        config = SamplerConfig(max_off_policy_threshold=1, admission_batch_size=1)
        self.buf = ReplayBuffer(config, journal=path, journal_interval=0.001, journal_max_pending_bytes=1)
        self.lock = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=False)

    async def fall_behind(self) -> None:
        """Hold the write lock and make a change: the writer's queue is over the limit."""
        self.lock.execute("BEGIN IMMEDIATE")
        self.buf.put_group_nowait(f"other{random.random()}", [b"x" * 100], global_steps=0, partition="other")
        await self.behind()

    async def behind(self) -> None:
        """Return once the writer's queue is over the limit (another thread: polled)."""
        while True:
            if self.buf.stats().journal_pending_bytes > 1:
                return
            await anyio.sleep(0.002)

    def catch_up(self) -> None:
        self.lock.execute("ROLLBACK")

    async def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.lock.execute("ROLLBACK")
        self.lock.close()
        await self.buf.aclose()


@pytest.fixture
async def stuck(tmp_path: Path) -> AsyncIterator[StuckJournal]:
    journal = StuckJournal(tmp_path / "journal.db")
    yield journal
    await journal.close()


async def admitted_while_behind(
    stuck: StuckJournal, produce: Callable[[], Awaitable[None]]
) -> anyio.abc.TaskGroup:
    """Fill admission, park ``produce`` on it, let the writer fall behind, then open a slot."""
    buf = stuck.buf
    buf.put_group_nowait("first", [b"f"], global_steps=0)
    await buf.flush()
    tasks = anyio.create_task_group()
    await tasks.__aenter__()
    tasks.start_soon(produce)
    await settle()
    assert buf.stats().total.waiting_producers == 1
    await stuck.fall_behind()
    await buf.sample(0, 1)
    with pytest.raises(TimeoutError):
        await buf.sample(1, 1, timeout=0)  # the clock moves to 1: a slot opens, the producer is admitted
    return tasks


async def test_a_rollout_admitted_while_the_journal_is_behind_waits_to_start(stuck: StuckJournal) -> None:
    """Defect: the block marked its just-admitted group RUNNING with ``mark_running_nowait``, which
    raised BufferFullError while the journal's writer was behind, so the block raised and left the
    group PENDING for good, holding its admission slot (and the wait gate)."""
    entered: list[RolloutGroup] = []

    async def produce() -> None:
        async with stuck.buf.rollout("r") as group:
            entered.append(group)

    with anyio.fail_after(LIMIT):
        tasks = await admitted_while_behind(stuck, produce)
        await settle()
        assert not entered
        assert status_of(stuck.buf, "r") is Status.PENDING  # admitted, waiting for the writer
        stuck.catch_up()
        await tasks.__aexit__(None, None, None)
    assert [group.uid for group in entered] == ["r"]
    assert status_of(stuck.buf, "r") is Status.FINISHED


async def test_a_rollout_cancelled_while_waiting_to_start_fails_its_group(stuck: StuckJournal) -> None:
    """An admitted group whose block is cancelled before it could start is FAILED, not left PENDING."""
    scope = anyio.CancelScope()

    async def produce() -> None:
        with scope:
            async with stuck.buf.rollout("r"):
                pytest.fail("entered while the journal's writer was behind")

    with anyio.fail_after(LIMIT):
        tasks = await admitted_while_behind(stuck, produce)
        await settle()
        scope.cancel()
        await tasks.__aexit__(None, None, None)
    assert status_of(stuck.buf, "r") is Status.FAILURE


async def test_a_rollout_closed_while_waiting_to_start_exits_quietly_evicted(stuck: StuckJournal) -> None:
    """``close()`` while the admitted block waits for the writer: the block exits quietly, evicted."""
    entered: list[RolloutGroup] = []

    async def produce() -> None:
        async with stuck.buf.rollout("r") as group:
            entered.append(group)
            await anyio.sleep_forever()

    with anyio.fail_after(LIMIT):
        tasks = await admitted_while_behind(stuck, produce)
        await settle()
        tasks.start_soon(stuck.buf.aclose)  # its final commit waits for the writer, in a thread
        await settle()
        stuck.catch_up()
        await tasks.__aexit__(None, None, None)
    [group] = entered
    assert group.evicted


async def test_group_put_waits_for_the_journals_writer_instead_of_raising(stuck: StuckJournal) -> None:
    """Defect: ``await group.put(...)`` ran ``put_nowait`` and raised BufferFullError while the
    journal's writer was behind; as ``ReplayBuffer.put``, it now waits."""
    keys: list[str] = []
    entered, behind = anyio.Event(), anyio.Event()

    async def produce() -> None:
        async with stuck.buf.rollout("r") as group:
            entered.set()
            await behind.wait()
            keys.append(await group.put(b"t"))

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(produce)
            await entered.wait()
            await stuck.fall_behind()
            behind.set()
            await settle()
            assert not keys
            stuck.catch_up()
    assert keys == ["r_0_0"]
    assert status_of(stuck.buf, "r") is Status.FINISHED
