"""``wait_for_sampleable``: a wait that takes nothing (verl's ``wait_for_sampleable``, #7373).

It returns once at least ``count`` groups are sampleable at ``global_steps`` (what
``sampleable_count`` counts: the drop and failure rules apply, the wait gate and the batch size do
not), wakes on the producer call (or the deadline cut) that makes it so, never delays or reorders
a ``sample``, and ends by timeout, cancellation or close like a parked ``sample``. Bad arguments
are typed errors that change nothing.

Each anyio test runs on asyncio and trio, bounded by ``anyio.fail_after``; none asserts on timing.
"""

from __future__ import annotations

import asyncio
import gc
import math
from typing import Any

import anyio
import pytest

from _helpers import (
    LIMIT,
    add_group,
    assert_conserved,
    full_snapshot,
    make,
    patch_deadline_clock,
    sampleable_waiters,
    settle,
    start_call,
)
from stalebuf import ReplayBuffer, SamplerConfig, StalenessPolicy, Status
from stalebuf.errors import BackendMismatchError, BatchNotReadyError, BufferClosedError, WrongThreadError

pytestmark = pytest.mark.anyio


# -- returning at once, and what counts ---------------------------------------------------------


async def test_enough_sampleable_returns_the_count_at_once_and_takes_nothing() -> None:
    buf = make()
    for uid in "abc":
        add_group(buf, uid, 0)
    before = full_snapshot(buf)
    with anyio.fail_after(LIMIT):
        assert await buf.wait_for_sampleable(0, 2) == 3
        assert await buf.wait_for_sampleable(0, 3, timeout=0) == 3
    assert full_snapshot(buf) == before


@pytest.mark.parametrize("strategy", ["drop", "wait"])
async def test_it_counts_what_sampleable_count_counts(strategy: str) -> None:
    """Under drop a stale group does not count (and is not evicted); under wait an in-flight
    group holding the wait gate does not stop it (``sampleable_count`` ignores the gate)."""
    buf = make(max_off_policy_threshold=1, max_off_policy_strategy=strategy)
    add_group(buf, "old", 0)  # s = 3 at g = 2: stale under drop
    add_group(buf, "new", 2)
    add_group(buf, "flying", 1, status=Status.RUNNING)  # s = 2 >= T at g = 2: holds the gate
    expected = buf.sampleable_count(2)
    assert expected == (1 if strategy == "drop" else 2)
    before = full_snapshot(buf)
    with anyio.fail_after(LIMIT):
        assert await buf.wait_for_sampleable(2, expected) == expected
        with pytest.raises(TimeoutError):
            await buf.wait_for_sampleable(2, expected + 1, timeout=0)
    assert full_snapshot(buf) == before  # nothing evicted, nothing created
    if strategy == "wait":
        with pytest.raises(BatchNotReadyError):  # the gate holds a sample of the same count
            buf.sample_nowait(2, expected)


async def test_failed_groups_count_only_where_a_sample_would_take_them() -> None:
    for failure_strategy, expected in (("sample", 1), ("evict", 0)):
        buf = make(failure_strategy=failure_strategy)
        add_group(buf, "f", 0, status=Status.FAILURE)
        assert buf.sampleable_count(0) == expected
        with anyio.fail_after(LIMIT):
            if expected:
                assert await buf.wait_for_sampleable(0, 1) == 1
            else:
                with pytest.raises(TimeoutError):
                    await buf.wait_for_sampleable(0, 1, timeout=0)


# -- wake-up --------------------------------------------------------------------------------------


async def test_it_wakes_on_the_exact_call_that_reaches_the_count() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.wait_for_sampleable(0, 2, partition="new"))
            assert sampleable_waiters(buf) == {"new": 1}
            assert "new" not in buf.stats().partitions  # waiting creates no partition
            add_group(buf, "a", 0, partition="new")
            add_group(buf, "b", 0, status=Status.RUNNING, partition="new")
            await buf.put("b", "more", session_id=7)
            await settle()
            assert not waiting.done
            await buf.put_group("c", [1], partition="other")  # another partition: no wake-up
            await settle()
            assert not waiting.done
            await buf.mark_finished("b")
            await settle()
            assert waiting.returned
    assert waiting.result == 2
    assert sampleable_waiters(buf) == {}
    assert buf.stats().partitions["new"].finished == 2  # it took nothing


async def test_put_group_fast_path_and_refills_wake_it() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.wait_for_sampleable(0, 2))
            buf.put_group_nowait("a", [1])
            await settle()
            assert not waiting.done
            buf.put_group_nowait("b", [1])
            await settle()
    assert waiting.result == 2


async def test_a_stale_arrival_does_not_wake_it_and_a_fresh_one_does() -> None:
    buf = make(max_off_policy_threshold=1, max_off_policy_strategy="drop")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.wait_for_sampleable(5, 1))
            buf.put_group_nowait("stale", [1], global_steps=0)
            await settle()
            assert not waiting.done
            buf.put_group_nowait("fresh", [1], global_steps=5)
            await settle()
    assert waiting.result == 1
    assert buf.sampleable_count(5) == 1


async def test_a_group_cut_at_its_deadline_wakes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A straggler cut by a sample's evaluation becomes sampleable without any producer call."""
    now = [0.0]
    patch_deadline_clock(monkeypatch, lambda: now[0])
    buf = make(group_deadline_seconds=10.0, group_quorum=1)
    buf.add_prompt_nowait("hung")
    buf.put_nowait("hung", "partial")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.wait_for_sampleable(0, 1))
            now[0] = 11.0
            with pytest.raises(BatchNotReadyError):
                buf.sample_nowait(0, 2)  # cuts "hung" (one trajectory: FINISHED), then is short
            await settle()
    assert waiting.result == 1
    assert buf.sampleable_count(0) == 1


async def test_several_waiters_each_wake_at_their_own_count() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            one = await start_call(tg, lambda: buf.wait_for_sampleable(0, 1))
            three = await start_call(tg, lambda: buf.wait_for_sampleable(0, 3))
            also_one = await start_call(tg, lambda: buf.wait_for_sampleable(0, 1))
            add_group(buf, "a", 0)
            await settle()
            assert (one.result, also_one.result, three.done) == (1, 1, False)
            add_group(buf, "b", 0)
            add_group(buf, "c", 0)
            await settle()
    assert three.result == 3


class RaisingIsStale(StalenessPolicy):
    """The default rules, but ``is_stale`` raises once ``armed``."""

    armed = False

    def is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        if self.armed:
            raise RuntimeError("is_stale raised")
        return super().is_stale(global_steps, dispatch_step, partition)


async def test_a_hook_that_raises_while_waking_it_is_raised_from_the_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = SamplerConfig(max_off_policy_threshold=1)
    policy = RaisingIsStale(config)
    buf = ReplayBuffer(config, policy=policy, status_log_interval=None)
    add_group(buf, "old", 0)  # stale at 5: the count asks the hook
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.wait_for_sampleable(5, 1))
            policy.armed = True
            buf.put_group_nowait("fresh", [1], global_steps=5)  # the producer's call succeeds
            await settle()
    assert isinstance(waiting.error, RuntimeError)
    assert "is_stale raised" in caplog.text
    assert sampleable_waiters(buf) == {}
    assert "fresh" in buf


# -- FIFO-neutral ----------------------------------------------------------------------------------


async def test_it_never_delays_or_reorders_a_sample() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.wait_for_sampleable(0, 3))
            assert buf.stats().total.waiting_samplers == 0  # not a sampler
            add_group(buf, "a", 0)
            batch, _ = buf.sample_nowait(0, 1)  # a parked wait does not make samples queue
            assert batch.uids == ["a"]
            first = await start_call(tg, lambda: buf.sample(0, 2))
            second = await start_call(tg, lambda: buf.sample(0, 1))
            add_group(buf, "b", 0)
            add_group(buf, "c", 0)
            await settle()
            assert first.result[0].uids == ["b", "c"]  # served in arrival order, as always
            assert not second.done
            add_group(buf, "d", 0)
            await settle()
            assert second.result[0].uids == ["d"]
            assert not waiting.done  # never 3 sampleable at once: it waits on
            waiting.scope.cancel()
    assert_conserved(buf)


# -- timeout, cancellation, close -------------------------------------------------------------------


async def test_timeout_raises_and_leaves_nothing_behind() -> None:
    buf = make()
    add_group(buf, "a", 0)
    before = full_snapshot(buf)
    with anyio.fail_after(LIMIT):
        with pytest.raises(TimeoutError, match="fewer than 2 groups"):
            await buf.wait_for_sampleable(0, 2, timeout=0.01)
        with pytest.raises(TimeoutError):
            await buf.wait_for_sampleable(0, 2, timeout=0)
    assert full_snapshot(buf) == before
    add_group(buf, "b", 0)
    with anyio.fail_after(LIMIT):
        assert await buf.wait_for_sampleable(0, 2, timeout=LIMIT) == 2


async def test_a_timed_wait_still_wakes_on_the_producer() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.wait_for_sampleable(0, 1, timeout=LIMIT))
            add_group(buf, "a", 0)
            await settle()
    assert waiting.result == 1


async def test_cancellation_leaves_nothing_behind() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.wait_for_sampleable(0, 1))
            timed = await start_call(tg, lambda: buf.wait_for_sampleable(0, 1, timeout=LIMIT))
            assert sampleable_waiters(buf) == {"train": 2}
            waiting.scope.cancel()
            timed.scope.cancel()
            await settle()
        assert not waiting.done
        assert not timed.done
        assert sampleable_waiters(buf) == {}
        add_group(buf, "a", 0)  # a wake-up with nobody parked is harmless
        assert await buf.wait_for_sampleable(0, 1) == 1


async def test_close_wakes_it_with_buffer_closed_error_and_a_closed_buffer_refuses_it() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.wait_for_sampleable(0, 1))
            timed = await start_call(tg, lambda: buf.wait_for_sampleable(0, 1, timeout=LIMIT))
            sampler = await start_call(tg, lambda: buf.sample(0, 1))
            buf.close()
            await settle()
        for call in (waiting, timed, sampler):  # the same error a parked sample gets
            assert type(call.error) is BufferClosedError, call.error
        assert sampleable_waiters(buf) == {}
        with pytest.raises(BufferClosedError):
            await buf.wait_for_sampleable(0, 1)
        with pytest.raises(BufferClosedError):
            await buf.wait_for_sampleable(0, 1, timeout=0)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_task_cancel_right_after_the_wake_up_leaves_nothing_behind() -> None:
    buf = make()
    with anyio.fail_after(LIMIT):
        task = asyncio.ensure_future(buf.wait_for_sampleable(0, 1))
        await settle()
        add_group(buf, "a", 0)  # wakes it ...
        task.cancel()  # ... and it is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await task
    assert sampleable_waiters(buf) == {}
    assert buf.sampleable_count(0) == 1


# -- bad arguments, threads, backends ---------------------------------------------------------------

BAD_ARGUMENTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"count": 0}, ValueError, "count"),
    ({"count": -1}, ValueError, "count"),
    ({"count": 2**63}, ValueError, "count"),
    ({"count": True}, TypeError, "count"),
    ({"count": 1.0}, TypeError, "count"),
    ({"count": "2"}, TypeError, "count"),
    ({"count": None}, TypeError, "count"),
    ({"global_steps": -1}, ValueError, "global_steps"),
    ({"global_steps": 2**63}, ValueError, "global_steps"),
    ({"global_steps": False}, TypeError, "global_steps"),
    ({"global_steps": 1.5}, TypeError, "global_steps"),
    ({"partition": ""}, ValueError, "partition"),
    ({"partition": None}, TypeError, "partition"),
    ({"partition": "\udcff"}, ValueError, "partition"),
    ({"timeout": -1}, ValueError, "timeout"),
    ({"timeout": math.nan}, ValueError, "timeout"),
    ({"timeout": "1"}, ValueError, "timeout"),
    ({"timeout": True}, ValueError, "timeout"),
]


@pytest.mark.parametrize(("override", "error", "names"), BAD_ARGUMENTS)
async def test_bad_arguments_are_typed_errors_that_change_nothing(
    override: dict[str, Any], error: type[Exception], names: str
) -> None:
    buf = make()
    add_group(buf, "a", 0)
    before = full_snapshot(buf)
    arguments: dict[str, Any] = {"global_steps": 0, "count": 1, "partition": "train", "timeout": None}
    arguments.update(override)
    with anyio.fail_after(LIMIT), pytest.raises(error, match=names):
        await buf.wait_for_sampleable(
            arguments["global_steps"],
            arguments["count"],
            partition=arguments["partition"],
            timeout=arguments["timeout"],
        )
    assert full_snapshot(buf) == before


async def test_from_another_thread_it_raises_wrong_thread_error() -> None:
    buf = make()
    buf.threadsafe()  # binds the buffer to this loop
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            asyncio.run(buf.wait_for_sampleable(0, 1, timeout=0))
        except BaseException as exc:
            outcome.append(exc)

    with anyio.fail_after(LIMIT):
        await anyio.to_thread.run_sync(call)
    assert [type(exc) for exc in outcome] == [WrongThreadError]


@pytest.mark.parametrize(("bound", "other"), [("asyncio", "trio"), ("trio", "asyncio")])
def test_under_another_backend_it_raises_backend_mismatch_error(bound: str, other: str) -> None:
    buf = make()

    async def bind() -> None:
        buf.threadsafe()

    anyio.run(bind, backend=bound)

    async def wait() -> None:
        with anyio.fail_after(LIMIT):
            await buf.wait_for_sampleable(0, 1)

    with pytest.raises(BackendMismatchError):
        anyio.run(wait, backend=other)
    assert sampleable_waiters(buf) == {}


def test_a_waiter_whose_loop_was_closed_under_it_is_forgotten() -> None:
    """Misuse (a loop closed with the call parked): a later wake-up neither raises nor keeps it."""
    buf = make()
    loop = asyncio.new_event_loop()
    task = loop.create_task(buf.wait_for_sampleable(0, 1))
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()  # without cancelling the parked task
    assert sampleable_waiters(buf) == {"train": 1}
    add_group(buf, "a", 0)  # wakes nobody: the waiter is abandoned, and is dropped
    assert sampleable_waiters(buf) == {}
    buf.close()  # must not raise either
    del task
    gc.collect()  # the abandoned coroutine is finalised here: its cleanup must not fail
    assert sampleable_waiters(buf) == {}


# -- task mixtures -------------------------------------------------------------------------------


async def test_under_a_mixture_it_counts_every_task_s_groups_as_sampleable_count_does() -> None:
    """Under a task mixture the groups live in each task's cell: the count sums them all, as
    ``sampleable_count(task=None)`` does, and a group of either task wakes the call."""
    buf = make(mixture={"math": 3, "code": 1}, max_off_policy_threshold=2)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.wait_for_sampleable(0, 3))
            buf.put_group_nowait("m0", [1], tags={"task": "math"})
            buf.put_group_nowait("c0", [1], tags={"task": "code"})
            await settle()
            assert not waiting.done
            assert (buf.sampleable_count(0), buf.sampleable_count(0, task="code")) == (2, 1)
            buf.put_group_nowait("c1", [1], tags={"task": "code"})
            await settle()
    assert waiting.result == 3 == buf.sampleable_count(0)
    explanation = buf.explain_wait()
    assert (explanation.in_flight, explanation.waiting_samplers) == (0, 0)
