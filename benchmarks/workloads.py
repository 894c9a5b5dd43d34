"""Workloads shared by ``compare.py`` and the pytest-benchmark files.

Everything here drives the public API of :class:`stalebuf.ReplayBuffer` (the idle-cost
target also reads the buffer's internal evaluation counter, see :func:`evaluations`), or
one of the baselines the issue asks to compare against:

- :class:`PollingBuffer`, a minimal buffer with verl-like semantics: a dict of metadata
  that the trainer re-reads in full on every poll and sleeps ``poll_interval`` between;
- a bare ``asyncio.Queue`` (see :func:`queue_pipeline`).

Timings use ``time.perf_counter_ns``; nothing here asserts on a timing.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from stalebuf import ReplayBuffer, SamplerConfig

__all__ = [
    "BASE_STEP",
    "BIG_THRESHOLD",
    "GATE_STEP",
    "PER_STEP",
    "TRAJECTORIES_PER_GROUP",
    "Gated",
    "PollingBuffer",
    "Resident",
    "add_group_nowait",
    "add_polling_group",
    "drive",
    "evaluations",
    "gc_paused",
    "interleaved",
    "pipeline_stalebuf",
    "queue_pipeline",
    "settle",
]

#: Trajectories per group in every workload (the issue's "8 x put").
TRAJECTORIES_PER_GROUP = 8
#: Resident groups per dispatch step.
PER_STEP = 256
#: Resident groups are dispatched from this step on.
BASE_STEP = 10_000_000
#: Drop threshold of :class:`Resident`: no resident group is ever stale, one
#: dispatched at step 0 always is.
BIG_THRESHOLD = 1_000_000
#: Dispatch step of the in-flight and ready groups of :class:`Gated`.
GATE_STEP = 1_000

T = TypeVar("T")


# -- small helpers -----------------------------------------------------------------------


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic GC while building a large resident set (setup, never timed).

    On exit everything built so far is moved to the permanent generation
    (``gc.freeze``), so that no later timed call pays for a full collection of
    millions of setup objects. Call ``gc.unfreeze()`` once the set is discarded.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if was_enabled:
            gc.enable()


async def settle(condition: Callable[[], bool]) -> None:
    """Yield until ``condition`` holds, then a couple of times more (so a waiter is parked)."""
    while not condition():
        await anyio.lowlevel.checkpoint()
    for _ in range(2):
        await anyio.lowlevel.checkpoint()


async def interleaved(
    reference: Callable[[], Awaitable[int]], measured: Callable[[], Awaitable[int]], reps: int
) -> tuple[float, float]:
    """Time ``reference()`` then ``measured()``, ``reps`` times over (ABAB..., so that load
    from other processes hits both alike); return the medians (measured, reference)."""
    mine: list[int] = []
    theirs: list[int] = []
    for _ in range(reps):
        theirs.append(await reference())
        mine.append(await measured())
    return statistics.median(mine), statistics.median(theirs)


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that must complete without suspending (e.g. ``sample`` with a batch
    ready) and return its result, with no event loop in the timed region."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("the coroutine suspended; drive() only runs calls that complete at once")


def add_group_nowait(
    buf: ReplayBuffer,
    uid: str,
    global_steps: int,
    *,
    trajectories: int = TRAJECTORIES_PER_GROUP,
    finish: bool = True,
    partition: str = "train",
) -> None:
    """Run one group's producer lifecycle with the synchronous ``*_nowait`` calls."""
    buf.add_prompt_nowait(uid, global_steps=global_steps, partition=partition)
    buf.mark_running_nowait(uid)
    for session in range(trajectories):
        buf.put_nowait(uid, None, session_id=session)
    if finish:
        buf.mark_finished_nowait(uid)


def evaluations(buf: ReplayBuffer) -> int:
    """How many times ``sample`` calls on ``buf`` have evaluated a partition so far.

    Reads the consumer's ``evaluations``, an internal counter kept for exactly this: proving
    that a parked ``sample`` does no work while nothing it waits for changes.
    """
    evaluations: int = buf._ReplayBuffer__consumer.evaluations  # type: ignore[attr-defined]
    return evaluations


class Resident:
    """A drop-strategy buffer holding ``n`` resident FINISHED groups that can be topped up
    so that ``n`` stays ``n`` across measurements.

    Layout: ``per_step`` groups per dispatch step (``None``: all of them in one step), each
    with ``trajectories`` trajectories. Fresh groups are dispatched at the newest step
    (topped-up groups join the newest step until it holds ``per_step``); :meth:`add_stale`
    adds groups that a ``sample`` at :attr:`global_steps` evicts. The build runs with the
    cyclic GC paused and frozen (see :func:`gc_paused`); call :meth:`close` when done.
    """

    def __init__(
        self, n: int, *, per_step: int | None = PER_STEP, trajectories: int = TRAJECTORIES_PER_GROUP
    ) -> None:
        self.buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=BIG_THRESHOLD))
        self.n = n
        self.per_step = per_step
        self.trajectories = trajectories
        self._uid = 0
        self._top = BASE_STEP
        self._at_top = 0
        with gc_paused():
            self.refill(n)

    @property
    def global_steps(self) -> int:
        """The step to sample at: one past the newest dispatch step."""
        return self._top + 1

    def _next_uid(self, prefix: str) -> str:
        self._uid += 1
        return f"{prefix}{self._uid}"

    def refill(self, count: int) -> None:
        """Add ``count`` fresh finished groups at the newest dispatch steps."""
        buf = self.buf
        per_step = self.per_step
        for _ in range(count):
            if self._at_top == per_step:
                self._top += 1
                self._at_top = 0
            add_group_nowait(buf, self._next_uid("r"), self._top, trajectories=self.trajectories)
            self._at_top += 1

    def add_stale(self, k: int, *, distinct_steps: bool = False) -> None:
        """Add ``k`` finished groups that are stale at :attr:`global_steps`: all dispatched
        at step 0, or with ``distinct_steps`` at steps 0..k-1 (one group per step)."""
        buf = self.buf
        for i in range(k):
            step = i if distinct_steps else 0
            add_group_nowait(buf, self._next_uid("s"), step, trajectories=self.trajectories)

    def close(self) -> None:
        """Drop the buffer and let the GC see its objects again."""
        del self.buf
        gc.unfreeze()
        gc.collect()


class Gated:
    """A wait-strategy buffer with ``n`` in-flight (RUNNING) groups, the oldest of which
    (dispatched at step 0) blocks the gate at :attr:`global_steps`, plus ``batch_size``
    ready groups: every ``sample(global_steps, batch_size)`` evaluation is blocked by the
    gate and nothing else."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.buf = ReplayBuffer(SamplerConfig(max_off_policy_strategy="wait", max_off_policy_threshold=8))
        self.n = n
        self.batch_size = batch_size
        self.global_steps = GATE_STEP
        buf = self.buf
        with gc_paused():
            buf.add_prompt_nowait("blocker", global_steps=0)
            buf.mark_running_nowait("blocker")
            for i in range(n - 1):
                uid = f"f{i}"
                buf.add_prompt_nowait(uid, global_steps=GATE_STEP + i // PER_STEP)
                buf.mark_running_nowait(uid)
            for i in range(batch_size):
                add_group_nowait(buf, f"r{i}", GATE_STEP)

    def close(self) -> None:
        """Drop the buffer and let the GC see its objects again."""
        del self.buf
        gc.unfreeze()
        gc.collect()


# -- the polling baseline ----------------------------------------------------------------


class PollingBuffer:
    """A minimal polling replay buffer with verl-like semantics, for comparison only.

    Producers write into ``meta`` (one dict of metadata per group) and ``data`` (payloads
    by trajectory key). ``sample`` re-reads all of ``meta`` on every poll (drops stale
    terminal groups, applies the wait gate, sorts the ready ones oldest first) and sleeps
    ``poll_interval`` seconds between polls. Staleness follows the same rules as
    stalebuf: drop when ``g - p + 1 > T * S``, wait while an in-flight ``g - p + 1 >= T * S``.
    """

    def __init__(
        self,
        poll_interval: float,
        *,
        threshold: int = 8,
        sync_step: int = 1,
        strategy: str = "drop",
    ) -> None:
        self.poll_interval = poll_interval
        self.limit = threshold * sync_step
        self.strategy = strategy
        self.meta: dict[str, dict[str, Any]] = {}
        self.data: dict[str, Any] = {}
        self.polls = 0  # full re-reads of ``meta``
        self.sleeping = 0  # samplers sleeping between polls

    # producers: plain dict writes (async, like the API they stand in for)
    def add_prompt_nowait(self, uid: str, *, global_steps: int) -> None:
        self.meta[uid] = {"status": "pending", "global_steps": global_steps, "keys": []}

    def mark_running_nowait(self, uid: str) -> None:
        self.meta[uid]["status"] = "running"

    def put_nowait(self, uid: str, payload: Any = None, *, session_id: int = 0, index: int = 0) -> str:
        key = f"{uid}_{session_id}_{index}"
        self.data[key] = payload
        self.meta[uid]["keys"].append(key)
        return key

    def mark_finished_nowait(self, uid: str) -> None:
        self.meta[uid]["status"] = "finished"

    async def add_prompt(self, uid: str, *, global_steps: int) -> None:
        self.add_prompt_nowait(uid, global_steps=global_steps)

    async def mark_running(self, uid: str) -> None:
        self.mark_running_nowait(uid)

    async def put(self, uid: str, payload: Any = None, *, session_id: int = 0, index: int = 0) -> str:
        return self.put_nowait(uid, payload, session_id=session_id, index=index)

    async def mark_finished(self, uid: str) -> None:
        self.mark_finished_nowait(uid)

    # trainer
    def poll(self, global_steps: int, batch_size: int) -> list[tuple[str, list[Any]]] | None:
        """One full re-read of the metadata; return a batch or None."""
        self.polls += 1
        limit = self.limit
        ready: list[tuple[int, str]] = []
        stale: list[str] = []
        oldest_in_flight: int | None = None
        for uid, meta in self.meta.items():
            step = meta["global_steps"]
            if meta["status"] == "finished":
                if self.strategy == "drop" and global_steps - step + 1 > limit:
                    stale.append(uid)
                else:
                    ready.append((step, uid))
            elif oldest_in_flight is None or step < oldest_in_flight:
                oldest_in_flight = step
        for uid in stale:
            self._remove(uid)
        if len(ready) < batch_size:
            return None
        if (
            self.strategy == "wait"
            and oldest_in_flight is not None
            and global_steps - oldest_in_flight + 1 >= limit
        ):
            return None
        ready.sort()
        return [(uid, self._remove(uid)) for _, uid in ready[:batch_size]]

    def _remove(self, uid: str) -> list[Any]:
        meta = self.meta.pop(uid)
        data = self.data
        return [data.pop(key) for key in meta["keys"]]

    async def sample(self, global_steps: int, batch_size: int) -> list[tuple[str, list[Any]]]:
        """Poll until a batch is ready, sleeping ``poll_interval`` between polls."""
        while True:
            batch = self.poll(global_steps, batch_size)
            if batch is not None:
                return batch
            self.sleeping += 1
            try:
                await anyio.sleep(self.poll_interval)
            finally:
                self.sleeping -= 1


def add_polling_group(
    buf: PollingBuffer,
    uid: str,
    global_steps: int,
    *,
    trajectories: int = TRAJECTORIES_PER_GROUP,
    finish: bool = True,
) -> None:
    """The polling baseline's twin of :func:`add_group_nowait`."""
    buf.add_prompt_nowait(uid, global_steps=global_steps)
    buf.mark_running_nowait(uid)
    for session in range(trajectories):
        buf.put_nowait(uid, None, session_id=session)
    if finish:
        buf.mark_finished_nowait(uid)


# -- P2: the producer path with a concurrent trainer -------------------------------------


async def pipeline_stalebuf(
    groups: int,
    *,
    producers: int = 4,
    batch_size: int = 64,
    yield_every: int = 1,
    buf: ReplayBuffer | None = None,
    put_group: bool = False,
) -> int:
    """Producers run add_prompt + mark_running + 8 x put + mark_finished per group (yielding
    to the loop after every ``yield_every`` groups) while a trainer samples ``batch_size``
    groups at a time. With ``put_group`` each group is one ``put_group`` call instead.

    Group ``i`` is dispatched at step ``i // batch_size`` and the trainer samples step ``s``
    at ``global_steps=s``, so nothing is stale. Returns the elapsed nanoseconds; runs on
    whatever backend it is awaited on.
    """
    buffer = ReplayBuffer() if buf is None else buf

    async def sample(step: int) -> int:
        batch, _metrics = await buffer.sample(step, batch_size)
        return len(batch)

    return await _pipeline(buffer, sample, groups, producers, batch_size, yield_every, put_group)


async def pipeline_polling(
    groups: int, poll_interval: float, *, producers: int = 4, batch_size: int = 64
) -> int:
    """:func:`pipeline_stalebuf` on the polling baseline; returns elapsed nanoseconds."""
    buffer = PollingBuffer(poll_interval)

    async def sample(step: int) -> int:
        return len(await buffer.sample(step, batch_size))

    return await _pipeline(buffer, sample, groups, producers, batch_size, 1, False)


async def _pipeline(
    buf: Any,
    sample: Callable[[int], Awaitable[int]],
    groups: int,
    producers: int,
    batch_size: int,
    yield_every: int,
    put_group: bool,
) -> int:
    """The producer/trainer pipeline shared by both buffers; ``sample(step)`` returns the
    number of groups it got. Returns the elapsed nanoseconds."""
    if groups % batch_size:
        raise ValueError("groups must be a multiple of batch_size")
    uids = [f"p{i}" for i in range(groups)]
    empty_payloads = [None] * TRAJECTORIES_PER_GROUP
    sampled = 0

    # Under admission control a step ahead of the trainer's clock is refused: producers dispatch
    # at the clock (and wait for its slots); without it they tag each group with its step.
    by_clock = getattr(buf, "capacity", lambda: None)() is not None

    async def producer(first: int) -> None:
        checkpoint = anyio.lowlevel.checkpoint
        for count, i in enumerate(range(first, groups, producers), start=1):
            uid = uids[i]
            step = None if by_clock else i // batch_size
            if put_group:
                await buf.put_group(uid, empty_payloads, global_steps=step)
            else:
                await buf.add_prompt(uid, global_steps=step)
                await buf.mark_running(uid)
                for session in range(TRAJECTORIES_PER_GROUP):
                    await buf.put(uid, None, session_id=session)
                await buf.mark_finished(uid)
            if count % yield_every == 0:
                await checkpoint()
        await checkpoint()

    async def trainer() -> None:
        nonlocal sampled
        for step in range(groups // batch_size):
            sampled += await sample(step)

    start = time.perf_counter_ns()
    async with anyio.create_task_group() as tg:
        tg.start_soon(trainer)
        for first in range(producers):
            tg.start_soon(producer, first)
    elapsed = time.perf_counter_ns() - start
    if sampled != groups:
        raise AssertionError(f"sampled {sampled} of {groups} groups")
    return elapsed


async def queue_pipeline(items: int, *, producers: int = 4, yield_every: int = 0) -> int:
    """``asyncio.Queue`` put+get of ``items`` items by ``producers`` tasks and one consumer.

    With ``yield_every=8`` each producer yields to the loop after every 8 puts, the same
    scheduling pattern as one group in :func:`pipeline_stalebuf`; with 0 the producers
    never yield (the queue's raw put+get cost). Returns elapsed nanoseconds. Needs the
    asyncio backend.
    """
    import asyncio

    queue: asyncio.Queue[int] = asyncio.Queue()
    received = 0

    async def producer(first: int) -> None:
        checkpoint = anyio.lowlevel.checkpoint
        put = queue.put
        for count, i in enumerate(range(first, items, producers), start=1):
            await put(i)
            if yield_every and count % yield_every == 0:
                await checkpoint()

    async def consumer() -> None:
        nonlocal received
        get = queue.get
        for _ in range(items):
            await get()
            received += 1

    start = time.perf_counter_ns()
    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        for first in range(producers):
            tg.start_soon(producer, first)
    elapsed = time.perf_counter_ns() - start
    if received != items:
        raise AssertionError(f"received {received} of {items} items")
    return elapsed
