"""The waiting room: parked ``sample`` calls, the event loop they are bound to, and parking.

A waiter is a per-call signal. A producer sets it only when the head waiter of its partition
might now get a batch (or has eviction work); the woken call re-checks everything itself, so
nothing is handed to a waiter before it runs and a cancelled waiter can lose nothing. When a
waiter leaves the head of its queue, for any reason, it passes the wake-up on.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
from anyio.abc import AsyncBackend

from ._validation import describe
from .errors import BackendMismatchError, WrongThreadError

__all__ = [
    "EventWaiter",
    "FutureWaiter",
    "LoopBinding",
    "ProducerQueue",
    "ProducerWaits",
    "Waiter",
    "drop_abandoned",
    "park",
]

_T = TypeVar("_T")


class Waiter:
    """One blocked ``sample`` call, parked until a producer calls :meth:`wake`.

    Subclasses hold the backend's primitive; ``arm`` makes a fresh one before each park.
    ``global_steps`` and ``batch_size`` are a sample's arguments; a waiting producer's are the
    tag it asked for (-1: the clock's) and the tokens its group counts (-1: a reservation).
    """

    __slots__ = ("batch_size", "cut_at", "global_steps", "log_due", "now", "started", "token_budget")

    #: The running loop's clock (the backend's ``current_time``), for timing the wait.
    now: Callable[[], float]

    def __init__(self, global_steps: int, batch_size: int) -> None:
        self.global_steps = global_steps
        self.batch_size = batch_size
        # When it started waiting, in loop time (set when the status reporter logs for a
        # sample, or when a producer parks), and when its next status line is due.
        self.started = self.log_due = math.inf
        # A sample waiting on a partition with group deadlines: when (monotonic()) its timer
        # will cut the first straggler.
        self.cut_at = math.inf
        self.token_budget: int | None = None  # a sample by tokens: its budget (set by the caller)

    def wanted(self) -> str:
        """What the waiting call asks for, in words: ``"4"`` (groups) or ``"100 tokens"``."""
        budget = self.token_budget
        return str(self.batch_size) if budget is None else f"{budget} tokens"

    def timed_out(self, partition: str, timeout: float | None) -> TimeoutError:
        """The error of this sample, on ``partition``, when its ``timeout`` passed first."""
        where = describe(partition)
        return TimeoutError(f"no batch of {self.wanted()} in partition {where} within {timeout} s")

    def arm(self) -> None:
        """Prepare a fresh, unset signal for the next park."""
        raise NotImplementedError

    def wake(self) -> None:
        """Signal the waiter (idempotent; harmless if it was cancelled or its loop closed)."""
        raise NotImplementedError

    def rearm_if_cancelled(self) -> None:
        """Arm a fresh signal if the park that ended was cancelled with its signal."""

    def parked(self) -> Awaitable[object]:
        """Return what to await until :meth:`wake` is called."""
        raise NotImplementedError

    def abandoned(self) -> bool:
        """Whether the waiter can never run again (its event loop is closed)."""
        return False


class EventWaiter(Waiter):
    """Parks on an event of the bound backend: works on every anyio backend."""

    __slots__ = ("backend", "event")

    def __init__(self, global_steps: int, batch_size: int, backend: type[AsyncBackend]) -> None:
        super().__init__(global_steps, batch_size)
        self.backend = backend
        self.now = backend.current_time
        self.event = backend.create_event()

    def arm(self) -> None:
        self.event = self.backend.create_event()

    def wake(self) -> None:
        self.event.set()

    def parked(self) -> Awaitable[object]:
        return self.event.wait()


class FutureWaiter(Waiter):
    """Parks on a bare asyncio future: the asyncio fast path.

    An ``anyio.Event`` wraps an ``asyncio.Event``, which wraps futures; awaiting the future
    directly saves two coroutine hops and an allocation on every wake-up.
    """

    __slots__ = ("future", "loop")

    def __init__(self, global_steps: int, batch_size: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(global_steps, batch_size)
        self.loop = loop
        self.now = loop.time  # what anyio's current_time() returns on asyncio, in one call
        self.future: asyncio.Future[None] = loop.create_future()

    def arm(self) -> None:
        self.future = self.loop.create_future()

    def wake(self) -> None:
        future = self.future
        if not future.done():  # done: already woken, or cancelled with its task
            try:
                future.set_result(None)
            except RuntimeError:
                # Scheduling the waiting task failed: its loop was closed under it (an abandoned
                # waiter, which callers skip; the future is done, so it is never woken again).
                # Asked only here, not before every wake-up: it is the rare case.
                if not self.loop.is_closed():
                    raise

    def parked(self) -> Awaitable[object]:
        return self.future

    def rearm_if_cancelled(self) -> None:
        # Cancelling the task that awaits a bare future cancels the future too: awaiting it again
        # would raise CancelledError at once.
        if self.future.cancelled():
            self.arm()

    def abandoned(self) -> bool:
        return self.loop.is_closed()


class ProducerWaits:
    """How long a partition's producers were blocked on admission, reported per ``sample``.

    A report counts the waits that ended since the one before and, up to now, the waits still
    going on: in O(1), whatever the number of parked producers, from their count and the sum
    of their starts (each the later of its park and the last report).
    """

    __slots__ = ("ended", "parked", "reported_at", "starts")

    def __init__(self) -> None:
        self.ended = 0.0  # seconds of waits that ended since the last report
        self.parked = 0  # producers counted below: those in the partition's queue
        self.starts = 0.0  # the sum of their starts not yet reported
        self.reported_at = -math.inf  # loop time of the last report that counted a parked one

    def park(self, waiter: Waiter, now: float) -> None:
        """Count ``waiter``, which joins the queue at ``now`` (loop time)."""
        waiter.started = now
        self.parked += 1
        self.starts += now

    def leave(self, waiter: Waiter, now: float | None) -> None:
        """Stop counting ``waiter``, which left the queue at ``now`` (None: its loop is gone)."""
        start = max(waiter.started, self.reported_at)
        if now is not None:
            self.ended += max(0.0, now - start)  # (clocks of successive trio runs differ)
        self.parked -= 1
        if self.parked:
            self.starts -= start
        else:  # no float drift, and no clock of a finished run, once nobody waits
            self.starts, self.reported_at = 0.0, -math.inf

    def report(self, now: float | None) -> float:
        """Return the seconds producers were blocked since the last report, those still parked
        counted up to ``now`` (None: a clock that cannot be read here; they count later)."""
        seconds, self.ended = self.ended, 0.0
        if self.parked and now is not None:
            seconds += max(0.0, self.parked * now - self.starts)
            self.starts = self.parked * now
            self.reported_at = now
        return seconds


class ProducerQueue:
    """One partition's (or, under a task mixture, one task's) producers waiting for a slot
    (arrival order; only the head may be admitted) and the ledger of their waits."""

    __slots__ = ("producers", "waits")

    def __init__(self) -> None:
        self.producers: deque[Waiter] = deque()
        self.waits = ProducerWaits()  # for the admission/producer_wait_seconds metric

    def drop_abandoned(self, everywhere: bool = False) -> None:
        """Forget producers whose event loop was closed under them (the head only, O(1), unless
        ``everywhere``): they will never run, and their wait ends with their loop."""
        producers = self.producers
        if everywhere:
            if any(waiter.abandoned() for waiter in producers):
                for waiter in producers:
                    if waiter.abandoned():
                        self.waits.leave(waiter, None)
                live = [waiter for waiter in producers if not waiter.abandoned()]
                producers.clear()
                producers.extend(live)
            return
        while producers and producers[0].abandoned():
            self.waits.leave(producers.popleft(), None)


class LoopBinding:
    """The async backend and thread a buffer is bound to, once a ``sample`` has waited.

    Resolving anyio's backend costs more than the whole wake-up path, so it is done once, not
    per event or clock read. Successive event loops of the same backend are fine; calls from
    another thread than the bound loop's are refused (see :meth:`check_thread`).
    """

    __slots__ = ("backend", "loop_running", "on_asyncio", "thread")

    def __init__(self) -> None:
        self.backend: type[AsyncBackend] | None = None
        self.on_asyncio = False
        self.thread: int | None = None
        self.loop_running: Callable[[], bool] = _never

    def check_thread(self) -> None:
        """Raise WrongThreadError if bound to a running loop of another thread than the caller's.

        Once the bound loop has ended, the buffer is free to move to another thread.
        """
        thread = self.thread
        if thread is not None and thread != threading.get_ident():
            if self.loop_running():
                raise WrongThreadError(
                    "this buffer is bound to the event loop of another thread; call it from that "
                    "thread, or from other threads through the handle `buffer.threadsafe()` returns"
                )
            self.thread = None

    def check_backend(self) -> None:
        """Raise BackendMismatchError unless the running backend is the bound one (if any)."""
        backend = self.backend
        if backend is None:
            return
        try:
            backend.current_time()
        except RuntimeError as exc:
            raise BackendMismatchError(
                f"this buffer is bound to {backend.__name__}, the backend of its first waiting "
                "sample; await it only under that backend"
            ) from exc

    def bind(self) -> type[AsyncBackend]:
        """Bind to the running backend and thread (the first time) and return the backend."""
        backend = self.backend
        if backend is None:
            token = anyio.lowlevel.current_token()
            backend = self.backend = token.backend_class
            self.on_asyncio = isinstance(token.native_token, asyncio.AbstractEventLoop)
        self.thread = threading.get_ident()
        self.loop_running = _running_probe(self.on_asyncio)
        return backend

    def new_waiter(self, global_steps: int, batch_size: int) -> Waiter:
        """Return a waiter for the running loop of the bound backend."""
        if self.on_asyncio:
            return FutureWaiter(global_steps, batch_size, asyncio.get_running_loop())
        return EventWaiter(global_steps, batch_size, self.backend)  # type: ignore[arg-type]


def _never() -> bool:
    return False


def _running_probe(on_asyncio: bool) -> Callable[[], bool]:
    """Return a function telling, from any thread, whether the current event loop still runs."""
    if on_asyncio:
        loop = asyncio.get_running_loop()
        return lambda: loop.is_running() and not loop.is_closed()
    token: Any = anyio.lowlevel.current_token().native_token

    def trio_running() -> bool:
        try:
            token.run_sync_soon(_never)
        except Exception:  # trio.RunFinishedError: the run is over
            return False
        return True

    return trio_running


async def park(waiter: Waiter, attempt: Callable[[], _T | None]) -> _T:
    """Park until woken, then call ``attempt``; repeat until it returns something."""
    while True:
        await waiter.parked()
        result = attempt()
        if result is not None:
            return result
        waiter.arm()


async def park_with_deadline(
    waiter: Waiter,
    attempt: Callable[[], _T | None],
    backend: type[AsyncBackend],
    deadline: float,
    on_timer: Callable[[float], tuple[float, bool]] | None = None,
    next_call: float = math.inf,
) -> _T | None:
    """Like :func:`park`, but return None at ``deadline``; at ``next_call`` call
    ``on_timer(now)``, which returns the next time to call it and whether to call ``attempt``
    at once (how trio logs status lines, and how a sample wakes to cut a group at its deadline).

    One cancel scope covers a whole interval, not each park: entering and leaving a scope
    costs about as much as the rest of a wake-up.
    """
    while True:
        with anyio.CancelScope(deadline=min(deadline, next_call)):
            return await park(waiter, attempt)
        # Only our own deadline ends the scope quietly; outside cancellation propagates.
        now = backend.current_time()
        if now >= deadline:
            return None
        waiter.rearm_if_cancelled()  # the scope's cancellation may have cancelled the signal
        if on_timer is not None:
            next_call, retry = on_timer(now)
            if retry:
                result = attempt()
                if result is not None:
                    return result


def drop_abandoned(waiters: deque[Waiter], everywhere: bool = False) -> None:
    """Forget waiters whose event loop was closed under them: they will never run. Only the
    head is checked (O(1) on the hot paths) unless ``everywhere``."""
    if everywhere:
        if any(waiter.abandoned() for waiter in waiters):
            live = [waiter for waiter in waiters if not waiter.abandoned()]
            waiters.clear()
            waiters.extend(live)
        return
    while waiters and waiters[0].abandoned():
        waiters.popleft()
