"""Producers on other threads (issue 10, item 10).

- Detect: once a buffer is bound to a running event loop, a call from another thread raises
  WrongThreadError before it changes anything (it used to succeed and lose the wake-up of a
  parked ``sample``, or raise after its change).
- Support: ``buffer.threadsafe()`` returns a handle whose producer methods run on the loop
  from any thread, block until they ran, return their result or raise their error, and wake
  a parked ``sample`` as a call on the loop would. A thread whose loop stops gets
  BufferClosedError, not a hang.

Threads are joined with timeouts and every wait is bounded; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import pytest

from _helpers import LIMIT, add_group, assert_conserved, full_snapshot, make, settle, start_call
from stalebuf import ReplayBuffer, SamplerConfig, Status, ThreadsafeProducer
from stalebuf.errors import (
    BatchNotReadyError,
    BufferClosedError,
    BufferFullError,
    DuplicateGroupError,
    DuplicateTrajectoryError,
    InvalidTransitionError,
    StalebufError,
    UnknownGroupError,
    WrongThreadError,
)

THREADS, GROUPS_PER_THREAD, BATCH = 8, 1000, 8


def outcome_of(fn: Callable[[], Any]) -> Any:
    """Return what ``fn()`` returned or the exception it raised."""
    try:
        return fn()
    except BaseException as exc:
        return exc


def in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a fresh thread (no event loop runs); return its outcome."""
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(outcome_of(fn)))
    thread.start()
    thread.join(LIMIT)
    assert not thread.is_alive(), "the thread hung"
    return outcome[0]


async def from_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a worker thread while the loop keeps running; return its outcome.

    Abandoned (not awaited) if the caller's ``fail_after`` expires, so a hang fails the test.
    """
    return await anyio.to_thread.run_sync(outcome_of, fn, abandon_on_cancel=True)


def test_wrong_thread_error_is_a_stalebuf_error_and_a_runtime_error() -> None:
    assert issubclass(WrongThreadError, StalebufError)
    assert issubclass(WrongThreadError, RuntimeError)


# -- detect: calls from another thread while a sample is parked --------------------------------


def parked_setup(buf: ReplayBuffer) -> None:
    add_group(buf, "pend", 0, status=Status.PENDING)
    add_group(buf, "run", 0, status=Status.RUNNING)
    add_group(buf, "fin", 0)


# Each entry: what a foreign thread calls, given the buffer and the bound backend's name.
FOREIGN_CALLS: dict[str, Callable[[ReplayBuffer, str], object]] = {
    "add_prompt_nowait": lambda buf, backend: buf.add_prompt_nowait("new", global_steps=0),
    "mark_running_nowait": lambda buf, backend: buf.mark_running_nowait("pend"),
    "put_nowait": lambda buf, backend: buf.put_nowait("run", "p", session_id=7),
    "mark_finished_nowait": lambda buf, backend: buf.mark_finished_nowait("run"),
    "mark_failed_nowait": lambda buf, backend: buf.mark_failed_nowait("pend"),
    "put_group_nowait": lambda buf, backend: buf.put_group_nowait("new", ["x"], global_steps=0),
    "sample_nowait": lambda buf, backend: buf.sample_nowait(0, 1),
    "sampleable_count": lambda buf, backend: buf.sampleable_count(0),
    "stats": lambda buf, backend: buf.stats(),
    "contains": lambda buf, backend: "fin" in buf,
    "close": lambda buf, backend: buf.close(),
    "threadsafe": lambda buf, backend: buf.threadsafe(),
    # the async methods, awaited on an event loop of the same backend in the foreign thread
    "add_prompt": lambda buf, backend: anyio.run(
        lambda: buf.add_prompt("new", global_steps=0), backend=backend
    ),
    "put_group": lambda buf, backend: anyio.run(
        lambda: buf.put_group("new", ["x"], global_steps=0), backend=backend
    ),
    "sample-timeout-0": lambda buf, backend: anyio.run(lambda: buf.sample(0, 1, timeout=0), backend=backend),
    "sample": lambda buf, backend: anyio.run(lambda: buf.sample(0, 1, timeout=LIMIT), backend=backend),
    "wait_for_sampleable": lambda buf, backend: anyio.run(
        lambda: buf.wait_for_sampleable(0, 5, timeout=LIMIT), backend=backend
    ),
    "explain_wait": lambda buf, backend: buf.explain_wait(),
    "aclose": lambda buf, backend: anyio.run(buf.aclose, backend=backend),
}


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(FOREIGN_CALLS))
async def test_a_call_from_another_thread_raises_wrong_thread_error_and_changes_nothing(
    name: str, anyio_backend: str
) -> None:
    """Regression: a foreign thread's put succeeded and the parked sample slept on."""
    with anyio.fail_after(LIMIT):
        buf = make()
        parked_setup(buf)
        results: list[list[str]] = []

        async def parked_sample() -> None:
            results.append((await buf.sample(0, 3))[0].uids)

        async with anyio.create_task_group() as tg:
            tg.start_soon(parked_sample)
            await settle()
            before = full_snapshot(buf)
            outcome = await from_thread(lambda: FOREIGN_CALLS[name](buf, anyio_backend))
            assert type(outcome) is WrongThreadError, f"{name} from another thread gave {outcome!r}"
            assert full_snapshot(buf) == before, f"{name} from another thread changed the buffer"
            # the loop's own thread may still do everything, and the parked sample is intact
            buf.mark_finished_nowait("run")
            buf.mark_finished_nowait("pend")
        assert results == [["pend", "run", "fin"]]
        assert_conserved(buf)


def test_after_its_loop_ended_the_buffer_may_move_to_another_thread() -> None:
    buf = make()

    async def bind() -> None:
        with pytest.raises(TimeoutError):
            await buf.sample(0, 1, timeout=0.001)

    asyncio.run(bind())
    assert in_thread(lambda: buf.put_group_nowait("moved", ["x"], global_steps=0)) == ["moved_0_0"]
    assert in_thread(lambda: buf.sampleable_count(0)) == 1


# -- support: the threadsafe() handle ---------------------------------------------------------------


def test_threadsafe_outside_a_running_loop_raises_wrong_thread_error() -> None:
    buf = make()
    with pytest.raises(WrongThreadError, match="threadsafe"):
        buf.threadsafe()
    assert type(in_thread(buf.threadsafe)) is WrongThreadError
    assert buf.stats().total.admitted_groups == 0


@pytest.mark.anyio
async def test_eight_threads_put_groups_through_the_handle_and_every_group_is_sampled_once() -> None:
    with anyio.fail_after(LIMIT * 3):
        buf = make()
        producer = buf.threadsafe()
        assert isinstance(producer, ThreadsafeProducer)
        total = THREADS * GROUPS_PER_THREAD
        sampled: list[str] = []
        keys_returned: list[list[str]] = []
        done: list[int] = []

        async def trainer() -> None:
            while len(sampled) < total:
                batch, _ = await buf.sample(0, BATCH)  # parks between batches: every wake-up is a thread's
                sampled.extend(batch.uids)

        def thread_producer(t: int) -> None:
            for i in range(GROUPS_PER_THREAD):
                keys_returned.append(producer.put_group(f"t{t}g{i}", [(t, i)], global_steps=0))
            done.append(t)

        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            await settle()
            assert buf.stats().total.waiting_samplers == 1
            async with anyio.create_task_group() as threads:
                for t in range(THREADS):
                    threads.start_soon(from_thread, lambda t=t: thread_producer(t))
        assert sorted(done) == list(range(THREADS)), "a producer thread failed"
        expected = {f"t{t}g{i}" for t in range(THREADS) for i in range(GROUPS_PER_THREAD)}
        counts = Counter(sampled)
        assert set(counts) == expected, "a group was lost"
        assert max(counts.values()) == 1, "a group was sampled twice"
        assert sorted(keys[0] for keys in keys_returned) == sorted(f"{uid}_0_0" for uid in expected)
        stats = buf.stats().total
        assert (stats.admitted_groups, stats.sampled_groups, stats.groups, stats.waiting_samplers) == (
            total,
            total,
            0,
            0,
        )
        assert_conserved(buf)


@pytest.mark.anyio
async def test_every_handle_method_runs_on_the_loop_and_wakes_the_parked_sample() -> None:
    with anyio.fail_after(LIMIT):
        buf = make(failure_strategy="sample")
        producer = buf.threadsafe()
        results: list[list[str]] = []

        async def parked_sample() -> None:
            results.append((await buf.sample(0, 2))[0].uids)

        def lifecycle() -> list[str]:
            keys = []
            for uid, end in (("a", producer.mark_finished), ("b", producer.mark_failed)):
                producer.add_prompt(uid, global_steps=0, tags={"via": "thread"})
                producer.mark_running(uid)
                keys.append(producer.put(uid, f"{uid}-payload", session_id=1, index=2))
                end(uid)  # the second one completes the batch: it must wake the sample
            return keys

        async with anyio.create_task_group() as tg:
            tg.start_soon(parked_sample)
            await settle()
            assert await from_thread(lifecycle) == ["a_1_2", "b_1_2"]
        assert results == [["a", "b"]]
        assert_conserved(buf)


@pytest.mark.anyio
async def test_errors_of_the_loop_side_call_reach_the_thread_with_their_own_type() -> None:
    with anyio.fail_after(LIMIT):
        buf = make()
        add_group(buf, "fin", 0)
        add_group(buf, "run", 0, status=Status.RUNNING)
        producer = buf.threadsafe()
        calls: list[tuple[Callable[[], object], type[Exception]]] = [
            (lambda: producer.add_prompt("fin", global_steps=0), DuplicateGroupError),
            (lambda: producer.add_prompt("new", global_steps=-1), ValueError),
            (lambda: producer.mark_running("ghost"), UnknownGroupError),
            (lambda: producer.mark_finished(7), TypeError),  # type: ignore[arg-type]
            (lambda: producer.put("fin", 1), InvalidTransitionError),
            (lambda: producer.put("run", 1, session_id=0), DuplicateTrajectoryError),
            (lambda: producer.put_group("new", "not a collection", global_steps=0), TypeError),
            (lambda: producer.mark_failed("fin"), InvalidTransitionError),
        ]
        for call, error in calls:
            before = full_snapshot(buf)
            outcome = await from_thread(call)
            assert type(outcome) is error, f"expected {error.__name__}, got {outcome!r}"
            assert full_snapshot(buf) == before
        buf.close()
        outcome = await from_thread(lambda: producer.put("run", 1, session_id=5))
        assert type(outcome) is BufferClosedError


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_handle_call_after_its_loop_ended_raises_buffer_closed_error(backend: str) -> None:
    buf = make()

    async def get_handle() -> ThreadsafeProducer:
        return buf.threadsafe()

    producer = anyio.run(get_handle, backend=backend)
    outcome = in_thread(lambda: producer.add_prompt("late", global_steps=0))
    assert type(outcome) is BufferClosedError
    assert "late" not in buf


class SignallingLoop(asyncio.SelectorEventLoop):
    """Sets ``submitted`` once another thread has queued a call on it."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted = threading.Event()

    def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> asyncio.Handle:
        handle = super().call_soon_threadsafe(callback, *args, context=context)
        self.submitted.set()
        return handle


def test_a_thread_blocked_on_a_call_whose_loop_stops_gets_buffer_closed_error_not_a_hang() -> None:
    buf = make()
    loop = SignallingLoop()
    outcome: list[BaseException | str] = []
    worker: threading.Thread | None = None

    def add_late(producer: ThreadsafeProducer) -> None:
        try:
            producer.add_prompt("late", global_steps=0)
            outcome.append("ran")
        except BaseException as exc:
            outcome.append(exc)

    async def main() -> None:
        nonlocal worker
        worker = threading.Thread(target=add_late, args=(buf.threadsafe(),))
        worker.start()
        # Hold the loop until the call is queued, then stop it before it can run the call.
        assert loop.submitted.wait(LIMIT)
        loop.stop()
        await asyncio.sleep(0)

    task = loop.create_task(main())
    try:
        with pytest.raises(RuntimeError, match="stopped before Future completed"):
            loop.run_until_complete(task)
        assert worker is not None
        worker.join(LIMIT)
        assert not worker.is_alive(), "the thread hangs on a call its stopped loop will never run"
        assert len(outcome) == 1
        assert type(outcome[0]) is BufferClosedError
        # The queued call still sits in the loop: running the loop again must not perform it.
        loop.run_until_complete(task)
        assert "late" not in buf, "the thread was told the call failed, but it ran later"
    finally:
        loop.close()


# -- the handle's default dispatch step, and flow-control queries from other threads --------------


@pytest.mark.anyio
async def test_threadsafe_add_prompt_and_put_group_default_global_steps_like_their_nowait_twins() -> None:
    """Defect (issue 10, item 10): the handle's methods run the ``*_nowait`` operation, so they
    take what it takes, but the handle made ``global_steps`` a required argument where
    ``add_prompt_nowait(uid)`` and ``put_group_nowait(uid, payloads)`` default it to the dispatch
    clock."""
    buf = ReplayBuffer()
    producer = buf.threadsafe()

    def produce() -> list[str]:
        producer.add_prompt("a")
        producer.mark_finished("a")
        return producer.put_group("b", [1, 2])

    with anyio.fail_after(LIMIT):
        outcome = await from_thread(produce)
    assert outcome == ["b_0_0", "b_1_0"], outcome
    with anyio.fail_after(LIMIT):
        batch, _ = await buf.sample(0, 2)
    assert list(batch.uids) == ["a", "b"]


@pytest.mark.anyio
async def test_the_threadsafe_handle_tags_by_the_dispatch_clock_by_default() -> None:
    """Defect (issue 11): "add_prompt, add_prompt_nowait, put_group, put_group_nowait (and
    rollout()) take global_steps=None by default, meaning use dispatch_step(partition)", but the
    producer handle for other threads (same methods, same names) required it."""
    buf = make(admission_batch_size=2, max_off_policy_threshold=3)
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(4, 1)  # moves the clock to 4
    handle = buf.threadsafe()
    result: dict[str, Any] = {}

    def produce() -> None:
        try:
            handle.add_prompt("b")
            handle.put_group("c", [1])
        except BaseException as exc:
            result["error"] = exc

    with anyio.fail_after(LIMIT):
        await anyio.to_thread.run_sync(produce)
    assert "error" not in result, result.get("error")
    assert "b" in buf
    assert "c" in buf
    batch, _ = buf.sample_nowait(4, 1)
    assert batch.groups[0].uid == "c"
    assert batch.groups[0].dispatch_step == 4


@pytest.mark.anyio
@pytest.mark.parametrize("query", ["capacity", "free_slots", "full"])
async def test_flow_control_queries_from_another_thread_raise_wrong_thread_error(query: str) -> None:
    """Defect (issue 10, item 10): "once the buffer is bound to an event loop, any call from a
    thread other than the loop's raises WrongThreadError", but the flow-control queries ran;
    ``free_slots``/``full`` even drop abandoned producer waiters, i.e. changed the loop's queues
    from the foreign thread. (``dispatch_step`` reads one int and stays callable from any
    thread: the example server relies on it.)"""
    buf = ReplayBuffer(SamplerConfig(admission_batch_size=2))
    buf.threadsafe()  # binds the buffer to this loop
    with anyio.fail_after(LIMIT):
        outcome = await from_thread(lambda: getattr(buf, query)("train"))
    assert isinstance(outcome, WrongThreadError), outcome


# -- the handle's waiting calls: as queue.Queue.put, they block until admitted ----------------------


async def until(condition: Callable[[], bool]) -> None:
    """Let the loop run until ``condition()`` holds (a thread's call reached the loop); bounded by
    the caller's ``fail_after``."""
    while not condition():  # noqa: ASYNC110 - what it waits for happens on another thread
        await anyio.sleep(0.001)


def waiting_producers(buf: ReplayBuffer) -> int:
    return buf.stats().total.waiting_producers


def full_buffer() -> ReplayBuffer:
    """Admission with one slot per step, taken: a new group at step 0 must wait."""
    buf = make(admission_batch_size=1, max_off_policy_threshold=2)
    buf.put_group_nowait("first", [1])
    return buf


@pytest.mark.anyio
@pytest.mark.parametrize("method", ["put_group", "add_prompt"])
async def test_the_handle_blocks_until_admitted_then_returns(method: str) -> None:
    """Defect (issue 26, item 4): ``threadsafe().put_group`` never waited for admission (it ran
    ``put_group_nowait``) while ``buffer.put_group`` did; a thread producer now blocks as
    ``queue.Queue.put`` does, FIFO with the loop's own producers."""
    with anyio.fail_after(LIMIT):
        buf = full_buffer()
        handle = buf.threadsafe()
        call = {
            "put_group": lambda: handle.put_group("second", [1], generation_seconds=2.0),
            "add_prompt": lambda: handle.add_prompt("second"),
        }[method]
        async with anyio.create_task_group() as tg:
            loop_producer = await start_call(tg, lambda: buf.put_group("loop", [1]))  # queued first
            outcome: list[Any] = []

            async def thread_call() -> None:
                outcome.append(await from_thread(call))

            tg.start_soon(thread_call)
            await until(lambda: waiting_producers(buf) == 2)
            assert not outcome
            assert "second" not in buf
            await buf.sample(0, 1)  # frees step 0's slot ... and moves nothing else
            await buf.sample(1, 1)  # the loop's producer got it at step 1; this frees step 1
            await until(lambda: bool(outcome))
        assert loop_producer.returned
        assert not isinstance(outcome[0], BaseException), outcome[0]
        assert "second" in buf
        assert waiting_producers(buf) == 0
        if method == "put_group":
            assert outcome[0] == ["second_0_0"]
            assert buf.sample_nowait(2, 1)[0].groups[0].generation_seconds == 2.0
        assert_conserved(buf)


@pytest.mark.anyio
@pytest.mark.parametrize("timeout", [0, 0.01])
@pytest.mark.parametrize("method", ["put_group", "add_prompt"])
async def test_the_handle_times_out_with_nothing_added(method: str, timeout: float) -> None:
    with anyio.fail_after(LIMIT):
        buf = full_buffer()
        handle = buf.threadsafe()
        before = full_snapshot(buf)
        call = {
            "put_group": lambda: handle.put_group("late", [1], timeout=timeout),
            "add_prompt": lambda: handle.add_prompt("late", timeout=timeout),
        }[method]
        outcome = await from_thread(call)
        assert type(outcome) is TimeoutError, outcome
        assert full_snapshot(buf) == before
        await buf.sample(0, 1)  # a free slot now: the same call with a timeout succeeds at once
        assert not isinstance(await from_thread(call), BaseException)
        assert "late" in buf


@pytest.mark.anyio
async def test_the_handle_s_nowait_twins_raise_buffer_full_error() -> None:
    with anyio.fail_after(LIMIT):
        buf = full_buffer()
        handle = buf.threadsafe()
        before = full_snapshot(buf)
        for call in (
            lambda: handle.put_group_nowait("late", [1]),
            lambda: handle.add_prompt_nowait("late"),
        ):
            outcome = await from_thread(call)
            assert type(outcome) is BufferFullError, outcome
            assert full_snapshot(buf) == before
        assert await from_thread(lambda: handle.put_group_nowait("x", [1], partition="val")) == ["x_0_0"]


@pytest.mark.anyio
async def test_close_wakes_a_blocked_thread_with_buffer_closed_error() -> None:
    with anyio.fail_after(LIMIT):
        buf = full_buffer()
        handle = buf.threadsafe()
        outcome: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def thread_call() -> None:
                outcome.append(await from_thread(lambda: handle.put_group("late", [1])))

            tg.start_soon(thread_call)
            await until(lambda: waiting_producers(buf) == 1)
            buf.close()
        assert [type(item) for item in outcome] == [BufferClosedError]
        assert "late" not in buf


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_thread_blocked_when_its_loop_ends_gets_buffer_closed_error(backend: str) -> None:
    """The loop that would admit the thread's group ends (the thread cannot cancel its own call):
    the call is cancelled with the loop, and the thread learns it, rather than hanging."""
    buf = full_buffer()
    outcome: list[Any] = []
    worker: threading.Thread | None = None

    async def main() -> None:
        nonlocal worker
        handle = buf.threadsafe()
        worker = threading.Thread(
            target=lambda: outcome.append(outcome_of(lambda: handle.put_group("late", [1])))
        )
        worker.start()
        with anyio.fail_after(LIMIT):
            await until(lambda: waiting_producers(buf) == 1)
        # main returns with the call still waiting: the loop cancels it as it ends

    anyio.run(main, backend=backend)
    assert worker is not None
    worker.join(LIMIT)
    assert not worker.is_alive(), "the thread hangs on a call its ended loop will never complete"
    assert [type(item) for item in outcome] == [BufferClosedError]
    assert "late" not in buf


@pytest.mark.anyio
async def test_the_handle_waits_for_sampleable_groups() -> None:
    with anyio.fail_after(LIMIT):
        buf = make()
        handle = buf.threadsafe()
        outcome: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def thread_call() -> None:
                outcome.append(await from_thread(lambda: handle.wait_for_sampleable(0, 2)))

            tg.start_soon(thread_call)
            await anyio.sleep(0.01)  # (whether or not it parked yet, it counts when it runs)
            buf.put_group_nowait("a", [1])
            assert not outcome
            buf.put_group_nowait("b", [1])
            await until(lambda: bool(outcome))
        assert outcome == [2]
        assert buf.sampleable_count(0) == 2  # it took nothing
        assert type(await from_thread(lambda: handle.wait_for_sampleable(0, 3, timeout=0.01))) is TimeoutError
        assert type(await from_thread(lambda: handle.wait_for_sampleable(0, 0))) is ValueError


@pytest.mark.anyio
async def test_on_the_loop_s_own_thread_the_waiting_calls_refuse_and_the_others_run() -> None:
    buf = make()
    handle = buf.threadsafe()
    before = full_snapshot(buf)
    for call in (
        lambda: handle.put_group("a", [1]),
        lambda: handle.add_prompt("a"),
        lambda: handle.wait_for_sampleable(0, 1),
    ):
        with pytest.raises(WrongThreadError, match="await the buffer's method"):
            call()
    assert full_snapshot(buf) == before
    assert handle.put_group_nowait("a", [1], generation_seconds=1.5) == ["a_0_0"]
    handle.add_prompt_nowait("b")
    assert buf.stats().total.groups == 2


@pytest.mark.anyio
@pytest.mark.parametrize("timeout", [-1, "1", float("nan"), True])
async def test_a_bad_timeout_is_a_value_error_and_nothing_runs(timeout: Any) -> None:
    with anyio.fail_after(LIMIT):
        buf = make()
        handle = buf.threadsafe()
        for call in (
            lambda: handle.put_group("a", [1], timeout=timeout),
            lambda: handle.add_prompt("a", timeout=timeout),
        ):
            outcome = await from_thread(call)
            assert type(outcome) is ValueError, outcome
        assert "a" not in buf


# -- versions and tokens through the handle (issue 22) ---------------------------------------------


def test_the_handle_takes_every_parameter_its_buffer_twin_takes() -> None:
    """Each handle method runs the buffer method it mirrors: it has that method's parameters
    (names, kinds and defaults), so a parameter added to the buffer (as issue 22's ``versions``,
    ``tokens`` and ``version`` were, and issue 26's ``generation_seconds``) is not lost on other
    threads. The waiting ones (``add_prompt``, ``put_group``) mirror the async methods and add
    ``timeout`` last; the others mirror the ``*_nowait`` methods (the async ``mark_running``,
    ``put``... never wait either) and ``wait_for_sampleable`` the buffer's own."""
    buf = ReplayBuffer()
    twins = {
        "add_prompt": ("add_prompt", ["timeout"]),
        "put_group": ("put_group", ["timeout"]),
        "add_prompt_nowait": ("add_prompt_nowait", []),
        "put_group_nowait": ("put_group_nowait", []),
        "mark_running": ("mark_running_nowait", []),
        "put": ("put_nowait", []),
        "mark_finished": ("mark_finished_nowait", []),
        "mark_failed": ("mark_failed_nowait", []),
        "wait_for_sampleable": ("wait_for_sampleable", []),
    }
    for name, (twin_name, extra) in twins.items():
        handle = inspect.signature(getattr(ThreadsafeProducer, name)).parameters
        twin = inspect.signature(getattr(buf, twin_name)).parameters
        shape = [(p.name, p.kind, p.default) for p in twin.values()]
        shape += [(extra_name, inspect.Parameter.KEYWORD_ONLY, None) for extra_name in extra]
        assert [(p.name, p.kind, p.default) for p in handle.values() if p.name != "self"] == shape, name


@pytest.mark.anyio
async def test_a_thread_records_versions_tokens_and_start_versions_through_the_handle() -> None:
    """From another thread: a start version (``mark_running(version=)``), trajectories with
    versions or a token count, and a whole group with per-trajectory versions, tokens and a
    start version; the batch then holds each, and a sample parked for them is woken."""
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_threshold=2, max_off_policy_strategy="mask")
        producer = buf.threadsafe()
        results: list[Any] = []

        async def parked_sample() -> None:
            results.append((await buf.sample(3, 2))[0])

        def produce() -> None:
            producer.add_prompt("a", global_steps=0)
            producer.mark_running("a", version=2)
            producer.put("a", "a0", versions=[(2, 3), (3, 1)])
            producer.put("a", "a1", session_id=1, tokens=2)
            producer.mark_finished("a")
            producer.put_group("b", ["b0", "b1"], global_steps=0, versions=[[(1, 2)], None], tokens=[None, 3],
                               version=3)  # fmt: skip

        async with anyio.create_task_group() as tg:
            tg.start_soon(parked_sample)
            await settle()
            assert await from_thread(produce) is None
        (batch,) = results
        assert [(g.uid, g.start_version) for g in batch] == [("a", 2), ("b", 3)]
        assert [(t.key, t.versions, t.tokens) for t in batch.trajectories] == [
            ("a_0_0", ((2, 3), (3, 1)), 4),
            ("a_1_0", (), 2),
            ("b_0_0", ((1, 2),), 2),
            ("b_1_0", (), 3),
        ]
        # Tokens without versions count at their group's start version.
        assert batch.token_versions()[0].tolist() == [2, 2, 2, 3, 2, 2, 1, 1, 3, 3, 3]
        # At step 3 (T=2): version 1 has lag 3, masked; b_0_0 is all stale, kept out of the loss.
        assert batch.freshness_mask()[0].tolist() == [True] * 6 + [False, False] + [True] * 3
        assert batch.loss_excluded.tolist() == [False, False, True, False]


@pytest.mark.anyio
async def test_bad_versions_tokens_or_start_versions_from_a_thread_raise_there_and_change_nothing() -> None:
    with anyio.fail_after(LIMIT):
        buf = make()
        add_group(buf, "run", 0, status=Status.RUNNING)
        add_group(buf, "pend", 0, status=Status.PENDING)
        producer = buf.threadsafe()
        calls: list[tuple[Callable[[], object], type[Exception]]] = [
            (lambda: producer.mark_running("pend", version=-1), ValueError),
            (lambda: producer.mark_running("pend", version=True), TypeError),  # type: ignore[arg-type]
            (lambda: producer.put("run", 1, session_id=7, versions=[(0, 0)]), ValueError),
            (lambda: producer.put("run", 1, session_id=7, versions="ab"), TypeError),  # type: ignore[arg-type]
            (lambda: producer.put("run", 1, session_id=7, tokens=-2), ValueError),
            (lambda: producer.put("run", 1, session_id=7, versions=[(0, 2)], tokens=3), ValueError),
            (lambda: producer.put_group("new", [1, 2], global_steps=0, tokens=[1]), ValueError),
            (lambda: producer.put_group("new", [1], global_steps=0, versions=[[(-1, 1)]]), ValueError),
            (lambda: producer.put_group("new", [1], global_steps=0, version="3"), TypeError),  # type: ignore[arg-type]
        ]
        for call, error in calls:
            before = (full_snapshot(buf), [(g.uid, g.start_version) for g in buf.checkpoint().groups])
            outcome = await from_thread(call)
            assert type(outcome) is error, f"expected {error.__name__}, got {outcome!r}"
            assert (full_snapshot(buf), [(g.uid, g.start_version) for g in buf.checkpoint().groups]) == before
        assert "new" not in buf


# -- task mixtures and filters through the handle (issue 23) ---------------------------------------


def test_the_handles_flow_queries_take_the_parameters_of_the_buffers() -> None:
    """``capacity``, ``free_slots`` and ``full`` take ``task`` (and ``dispatch_step`` its
    partition) on the handle as on the buffer, with the same defaults."""
    buf = ReplayBuffer()
    for name in ("dispatch_step", "capacity", "free_slots", "full"):
        handle = inspect.signature(getattr(ThreadsafeProducer, name)).parameters
        twin = inspect.signature(getattr(buf, name)).parameters
        shape = [(p.name, p.kind, p.default) for p in twin.values()]
        assert [(p.name, p.kind, p.default) for p in handle.values() if p.name != "self"] == shape, name


@pytest.mark.anyio
async def test_a_thread_paces_each_task_by_its_own_slots_and_its_filtered_group_frees_one() -> None:
    """A thread producer under a mixture with admission reads each task's capacity and free
    slots through the handle; a group a filter rejects (in the call that finished it, run on the
    loop) frees its task's slot at once, reported to ``on_evict`` on the loop's thread."""
    events: list[tuple[str, list[str], bool]] = []
    config = SamplerConfig(max_off_policy_threshold=2, admission_batch_size=3, mixture={"a": 2, "b": 1})

    def on_evict(event: Any) -> None:
        events.append((event.reason, [group.uid for group in event.groups], threading.get_ident() == loop))

    buf = ReplayBuffer(
        config, filters=[lambda group: group.trajectories[0].payload != "bad"], on_evict=on_evict
    )
    loop = threading.get_ident()
    with anyio.fail_after(LIMIT):
        producer = buf.threadsafe()

        def produce() -> list[Any]:
            seen: list[Any] = [producer.capacity(task="a"), producer.capacity(task="b"), producer.capacity()]
            for i in range(3):  # a's quota of b=3 is 2 per step: a0's slot is freed when it is filtered
                producer.put_group(f"a{i}", ["bad" if i == 0 else "ok"], tags={"task": "a"})
            seen += [producer.free_slots(task="a"), producer.full(task="a"), producer.full()]
            seen.append(producer.free_slots(task="b"))
            producer.put_group("b0", ["ok"], tags={"task": "b"})
            seen += [producer.full(), producer.dispatch_step()]
            return seen

        outcome = await from_thread(produce)
    assert outcome == [4, 2, 6, 0, True, False, 1, True, 0]
    assert events == [("filtered", ["a0"], True)]
    stats = buf.stats().partitions["train"]
    assert (stats.evicted_filtered_groups, stats.tasks["a"].resident, stats.tasks["b"].resident) == (1, 2, 1)
    with anyio.fail_after(LIMIT):
        refused = await from_thread(lambda: producer.free_slots(task="c"))
    assert type(refused) is ValueError, refused
    assert "not a task" in str(refused)
