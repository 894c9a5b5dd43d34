"""Why a ``sample`` waits: ``explain_wait`` and the status line that says the same.

A new user's producers passed their own ``global_steps`` under admission control, all died on
TagClosedError, and the trainer's ``sample`` then hung with nothing but an INFO line nobody saw.
Now ``explain_wait(partition)`` names the cause (the batch is short by k groups, the wait gate is
held by a uid at a staleness, producers were refused for good, admission is full) and the status
line ends with the same reason, as a WARNING from the third interval of one call's wait on.

Each anyio test runs on asyncio and trio, bounded by ``anyio.fail_after``. The status-line tests
move virtual clocks (trio's MockClock, an asyncio loop whose time the test sets): no timing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
import attrs
import pytest
import trio
import trio.testing

from _helpers import LIMIT, add_group, full_snapshot, make, start_call
from stalebuf import ReplayBuffer, SamplerConfig, StalenessPolicy, Status, WaitExplanation
from stalebuf.errors import BatchNotReadyError, FutureTagError, TagClosedError, WrongThreadError

ESCALATED = ["INFO", "INFO", "WARNING", "WARNING"]  # the third line of one call's wait on


# -- explain_wait ---------------------------------------------------------------------------------


def test_with_no_sample_waiting_it_says_so_and_changes_nothing() -> None:
    buf = make()
    add_group(buf, "a", 0, status=Status.RUNNING)
    before = full_snapshot(buf)
    explanation = buf.explain_wait()
    assert explanation == WaitExplanation(
        partition="train", reason="no sample waits on partition 'train'", in_flight=1
    )
    assert buf.explain_wait("unused").reason == "no sample waits on partition 'unused'"
    assert full_snapshot(buf) == before
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        explanation.reason = "changed"  # type: ignore[misc]


@pytest.mark.anyio
async def test_a_short_batch_names_how_many_groups_are_missing() -> None:
    buf = make()
    add_group(buf, "a", 0)
    add_group(buf, "b", 0, status=Status.RUNNING)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            head = await start_call(tg, lambda: buf.sample(0, 3))
            await start_call(tg, lambda: buf.sample(0, 1))  # queued behind the head
            before = full_snapshot(buf)
            explanation = buf.explain_wait()
            assert full_snapshot(buf) == before
            tg.cancel_scope.cancel()
    assert not head.done
    assert (explanation.waiting_samplers, explanation.global_steps, explanation.batch_size) == (2, 0, 3)
    assert (explanation.sampleable, explanation.short_by, explanation.in_flight) == (1, 2, 1)
    assert explanation.gate_held_by is None
    assert explanation.waited_seconds >= 0.0
    assert "the batch is short by 2 group(s): 1 of 3 sampleable at global_steps=0, 1 in flight" in (
        explanation.reason
    )


@pytest.mark.anyio
async def test_a_held_wait_gate_names_the_group_and_its_staleness() -> None:
    buf = make(max_off_policy_threshold=1, max_off_policy_strategy="wait")
    add_group(buf, "ready", 3)
    add_group(buf, "old", 2, status=Status.RUNNING)  # s = 2 >= T at g = 3
    add_group(buf, "older", 2, status=Status.PENDING)  # admitted after "old": not the one named
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            await start_call(tg, lambda: buf.sample(3, 1))
            explanation = buf.explain_wait()
            tg.cancel_scope.cancel()
    assert (explanation.gate_held_by, explanation.gate_staleness, explanation.short_by) == ("old", 2.0, 0)
    assert explanation.reason == (
        "the wait gate is held by group 'old' (dispatched at step 2, still in flight, staleness 2 "
        "at global_steps=3)"
    )


@pytest.mark.anyio
async def test_producers_refused_at_a_closed_tag_are_the_reason_a_sample_hangs() -> None:
    """The new user's case: producers pass ``global_steps=0`` under admission; after the first
    batch every one of them gets TagClosedError and stops, and ``sample(1, 2)`` waits for good."""
    buf = make(admission_batch_size=2, max_off_policy_threshold=1, max_off_policy_strategy="wait")
    with anyio.fail_after(LIMIT):
        for uid in ("a", "b"):
            await buf.put_group(uid, [1], global_steps=0)
        await buf.sample(0, 2)
        for uid in ("c", "d"):  # two producers, each refused once, then gone
            with pytest.raises(TagClosedError):
                await buf.put_group(uid, [1], global_steps=0)
        async with anyio.create_task_group() as tg:
            await start_call(tg, lambda: buf.sample(1, 2))
            explanation = buf.explain_wait()
            tg.cancel_scope.cancel()
    assert (explanation.closed_tag_refusals, explanation.closed_tag, explanation.in_flight) == (2, 0, 0)
    assert explanation.reason.startswith(
        "nothing is in flight and 2 producer call(s) were refused for good since the last batch, the "
        "latest at dispatch step 0 (TagClosedError or FutureTagError)"
    )
    assert "global_steps=None" in explanation.reason
    assert "short by 2" in explanation.reason
    # Producers that dispatch at the clock are admitted; the next batch starts the count afresh.
    buf.put_group_nowait("e", [1])
    buf.put_group_nowait("f", [1])
    with anyio.fail_after(LIMIT):
        await buf.sample(1, 2)
    assert (buf.explain_wait().closed_tag_refusals, buf.explain_wait().closed_tag) == (0, None)


def test_a_future_tag_and_a_nowait_refusal_are_counted_too() -> None:
    buf = make(admission_batch_size=2)
    with pytest.raises(FutureTagError):
        buf.add_prompt_nowait("a", global_steps=5)
    assert (buf.explain_wait().closed_tag_refusals, buf.explain_wait().closed_tag) == (1, 5)
    buf.add_prompt_nowait("b")  # an admitted call is no refusal
    assert buf.explain_wait().closed_tag_refusals == 1


@pytest.mark.anyio
async def test_full_admission_and_waiting_producers_are_reported() -> None:
    buf = make(admission_batch_size=2, max_off_policy_threshold=2)
    buf.add_prompt_nowait("a")
    buf.add_prompt_nowait("b")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            await start_call(tg, lambda: buf.add_prompt("c"))  # no slot at step 0: it waits
            await start_call(tg, lambda: buf.sample(0, 3))  # more than admission can ever hold
            explanation = buf.explain_wait()
            tg.cancel_scope.cancel()
    assert (explanation.admission_full, explanation.waiting_producers, explanation.short_by) == (True, 1, 3)
    assert explanation.reason.endswith("; admission is full (1 producer call(s) waiting for a slot)")
    assert not make().explain_wait().admission_full  # never without admission control


@pytest.mark.anyio
async def test_a_sample_about_to_wake_is_said_to_be() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            await start_call(tg, lambda: buf.sample(0, 1))
            buf.put_group_nowait("a", [1])  # wakes it; it has not run yet
            explanation = buf.explain_wait()
    assert explanation.reason == "a batch may be taken now: the sample is about to wake"


@pytest.mark.parametrize(
    ("partition", "error"), [("", ValueError), (None, TypeError), (7, TypeError), ("\udcff", ValueError)]
)
def test_bad_partitions_are_typed_errors(partition: Any, error: type[Exception]) -> None:
    buf = make()
    before = full_snapshot(buf)
    with pytest.raises(error, match="partition"):
        buf.explain_wait(partition)
    assert full_snapshot(buf) == before


@pytest.mark.anyio
async def test_from_another_thread_it_raises_wrong_thread_error() -> None:
    buf = make()
    buf.threadsafe()  # binds the buffer to this loop

    def call() -> BaseException | None:
        try:
            buf.explain_wait()
        except BaseException as exc:
            return exc
        return None

    with anyio.fail_after(LIMIT):
        outcome = await anyio.to_thread.run_sync(call)
    assert type(outcome) is WrongThreadError


class RaisingWaitGate(StalenessPolicy):
    """The default rules, but ``must_wait_for`` raises once ``armed``."""

    armed = False

    def must_wait_for(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        if self.armed:
            raise RuntimeError("must_wait_for raised")
        return super().must_wait_for(global_steps, dispatch_step, partition)


def waiting_on_a_raising_gate() -> tuple[ReplayBuffer, RaisingWaitGate]:
    config = SamplerConfig(max_off_policy_threshold=1, max_off_policy_strategy="wait")
    policy = RaisingWaitGate(config)
    buf = ReplayBuffer(config, policy=policy, status_log_interval=1.0)
    add_group(buf, "old", 0, status=Status.RUNNING)
    return buf, policy


@pytest.mark.anyio
async def test_a_hook_that_raises_is_raised_from_explain_wait() -> None:
    buf, policy = waiting_on_a_raising_gate()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            await start_call(tg, lambda: buf.sample(3, 1))
            policy.armed = True
            with pytest.raises(RuntimeError, match="must_wait_for raised"):
                buf.explain_wait()
            tg.cancel_scope.cancel()


# -- the status line: the same reason, escalated ---------------------------------------------------


def stalebuf_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(record.levelname, record.getMessage()) for record in caplog.records if record.name == "stalebuf"]


def run_on_trio_clock(buf: ReplayBuffer, calls: list[Any], intervals: int) -> None:
    """Park ``calls`` (in order) on a trio run whose clock only moves when told, then move it one
    status interval (1 s) at a time, ``intervals`` times."""
    clock = trio.testing.MockClock()

    async def main() -> None:
        with anyio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                for call in calls:
                    nursery.start_soon(call)
                    await trio.testing.wait_all_tasks_blocked()
                for _ in range(intervals):
                    clock.jump(1.0)
                    await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock moves only when the test moves it."""

    now = 0.0

    def time(self) -> float:
        return self.now


def run_on_asyncio_clock(buf: ReplayBuffer, calls: list[Any], intervals: int) -> None:
    """As :func:`run_on_trio_clock`, on asyncio (where one loop timer logs every waiter)."""
    loop = VirtualTimeLoop()

    async def main() -> None:
        with anyio.fail_after(LIMIT * 10):  # (virtual seconds)
            tasks = []
            for call in calls:
                tasks.append(asyncio.ensure_future(call()))
                for _ in range(10):
                    await asyncio.sleep(0)
            for _ in range(intervals):
                loop.now += 1.0
                for _ in range(10):  # the due timer runs within a turn or two
                    await asyncio.sleep(0)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


RUNNERS = {"trio": run_on_trio_clock, "asyncio": run_on_asyncio_clock}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_status_line_says_why_and_escalates_to_a_warning_on_the_third_interval(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stalebuf")
    buf = make(status_log_interval=1.0)
    add_group(buf, "a", 0)
    RUNNERS[backend](buf, [lambda: buf.sample(0, 2)], 4)
    lines = stalebuf_lines(caplog)
    assert [level for level, _ in lines] == ESCALATED
    for (_, message), waited in zip(lines, (1, 2, 3, 4), strict=True):
        assert message.startswith(
            f"sample(global_steps=0, batch_size=2) on partition 'train' has waited {waited} s"
        )
        assert message.endswith(
            "waiting because the batch is short by 1 group(s): 1 of 2 sampleable at global_steps=0, "
            "0 in flight"
        )
    assert buf.stats().total.waiting_samplers == 0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_hung_trainer_of_the_refused_producers_gets_a_warning_that_names_them(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    buf = make(
        admission_batch_size=1,
        max_off_policy_threshold=1,
        max_off_policy_strategy="wait",
        status_log_interval=1.0,
    )
    buf.put_group_nowait("a", [1], global_steps=0)
    sample_now_or_fail(buf)
    with pytest.raises(TagClosedError):
        buf.put_group_nowait("b", [1], global_steps=0)
    caplog.set_level(logging.INFO, logger="stalebuf")
    RUNNERS[backend](buf, [lambda: buf.sample(1, 1)], 3)
    [*_, (level, message)] = stalebuf_lines(caplog)
    assert level == "WARNING"
    assert "nothing is in flight and 1 producer call(s) were refused for good" in message


def sample_now_or_fail(buf: ReplayBuffer) -> None:
    batch, _ = buf.sample_nowait(0, 1)
    assert batch.uids == ["a"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_queued_sample_s_line_names_the_samples_ahead_of_it(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stalebuf")
    buf = make(status_log_interval=1.0)
    RUNNERS[backend](buf, [lambda: buf.sample(0, 2), lambda: buf.sample(0, 1)], 1)
    messages = sorted(message for _, message in stalebuf_lines(caplog))
    assert len(messages) == 2
    assert messages[0].startswith("sample(global_steps=0, batch_size=1)")
    assert (
        "waiting because 1 earlier sample(s) on the partition go first, and the first waits because "
        "the batch is short by 2" in messages[0]
    )
    assert "waiting because the batch is short by 2 group(s)" in messages[1]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_hook_that_raises_explaining_still_logs_the_line(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stalebuf")
    buf, policy = waiting_on_a_raising_gate()
    add_group(buf, "ready", 3)
    RUNNERS[backend](buf, [lambda: buf.sample(3, 1), arm(policy)], 1)
    [(level, message)] = stalebuf_lines(caplog)
    assert level == "INFO"
    assert message.endswith(
        "waiting because (unknown: explaining it raised RuntimeError: must_wait_for raised)"
    )


def arm(policy: RaisingWaitGate) -> Any:
    """A call that arms ``policy`` and returns (after the sample parked)."""

    async def armed() -> None:
        policy.armed = True

    return armed


@pytest.mark.anyio
async def test_under_a_mixture_it_reads_every_task_s_cell() -> None:
    """Under a task mixture the groups live in each task's cell: in flight, sampleable and the
    group holding a wait gate are found there."""
    buf = make(mixture={"math": 1, "code": 1}, max_off_policy_threshold=1, max_off_policy_strategy="wait")
    buf.add_prompt_nowait("old", global_steps=0, tags={"task": "code"})
    buf.mark_running_nowait("old")
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(1, 2)  # moves the clock to 1
    buf.put_group_nowait("m1", [1], tags={"task": "math"})
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            await start_call(tg, lambda: buf.sample(1, 2))
            explanation = buf.explain_wait()
            tg.cancel_scope.cancel()
    assert (explanation.in_flight, explanation.sampleable, explanation.short_by) == (1, 1, 1)
    assert (explanation.gate_held_by, explanation.gate_staleness) == ("old", 2.0)
