"""How :mod:`stalebuf.prometheus` reads ``stats()`` from a scrape thread, within a time bound.

A scrape runs in whatever thread asks the registry: the event loop's own (an async
``/metrics`` handler), a worker thread (a sync handler), or ``prometheus_client``'s HTTP
server thread. A local buffer's state belongs to its loop, so from another thread the read is
handed to that loop, as ``ReplayBuffer.threadsafe`` hands producer calls, and waited for at
most ``timeout`` seconds. A remote buffer's ``stats`` is a coroutine that asks the actor: it
runs on a private event loop under ``asyncio.wait_for``. Every failure is raised to the
collector, which turns it into ``up 0``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import anyio.lowlevel

from ._validation import describe_typed
from .buffer import ReplayBuffer
from .stats import BufferStats

__all__ = ["StatsReader", "stats_reader"]

#: Returns the buffer's stats now, or raises (TimeoutError when the bound passed first).
StatsReader = Callable[[], BufferStats]


def stats_reader(buffer: object, timeout: float) -> StatsReader:
    """Return a reader of ``buffer``'s stats for any thread, bounded by ``timeout`` seconds.

    Call it on the buffer's event loop thread, inside the running loop, if scrapes will come
    from other threads while that loop runs: it remembers the loop to hand reads to.

    Raises:
        TypeError: ``buffer`` is neither a ReplayBuffer nor has an ``async def stats()``.
    """
    if isinstance(buffer, ReplayBuffer):
        return _LocalReader(buffer, timeout)
    stats = getattr(buffer, "stats", None)
    if stats is not None and inspect.iscoroutinefunction(stats):
        return _AsyncReader(stats, timeout)
    raise TypeError(
        "stalebuf.prometheus needs a ReplayBuffer or a buffer with an `async def stats()` "
        f"(a RemoteReplayBuffer), got {describe_typed(buffer)}"
    )


class _LocalReader:
    """Reads a ReplayBuffer's stats directly, or on its loop when called from another thread."""

    def __init__(self, buffer: ReplayBuffer, timeout: float) -> None:
        self._buffer = buffer
        self._timeout = timeout
        self._submit: Callable[[Callable[[], object]], object] | None = None
        self._loop_alive: Callable[[], bool] = _always
        self._loop_thread = threading.get_ident()
        try:
            native: Any = anyio.lowlevel.current_token().native_token
        except RuntimeError:  # no event loop runs here: reads happen in the caller's thread
            return
        if isinstance(native, asyncio.AbstractEventLoop):
            self._submit = native.call_soon_threadsafe
            self._loop_alive = lambda: native.is_running() and not native.is_closed()
        else:  # trio's TrioToken: run_sync_soon raises once the run is over
            self._submit = native.run_sync_soon

    def __call__(self) -> BufferStats:
        submit = self._submit
        if submit is None or threading.get_ident() == self._loop_thread or not self._loop_alive():
            # Without a loop to hand it to, stats() itself refuses a thread it is not bound to.
            return self._buffer.stats()
        future: concurrent.futures.Future[BufferStats] = concurrent.futures.Future()

        def read() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the scrape gave up already
            try:
                future.set_result(self._buffer.stats())
            except BaseException as exc:  # raised in the scrape thread, never into the loop
                future.set_exception(exc)

        try:
            submit(read)
        except Exception:  # the loop is closed or the trio run is over: the buffer is free again
            return self._buffer.stats()
        try:
            return future.result(self._timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"the buffer's event loop did not run a stats() read within {self._timeout:g} s"
            ) from None


class _AsyncReader:
    """Runs an ``async def stats()`` (a remote buffer's) on a private event loop, bounded."""

    def __init__(self, stats: Callable[[], Coroutine[Any, Any, BufferStats]], timeout: float) -> None:
        self._stats = stats
        self._timeout = timeout

    def __call__(self) -> BufferStats:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: a scrape thread without a loop
            return asyncio.run(self._read())
        # A loop runs in this thread (an async /metrics handler) and asyncio.run cannot nest:
        # read on a helper thread; this loop is blocked for at most the timeout meanwhile.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stalebuf-scrape") as pool:
            return pool.submit(asyncio.run, self._read()).result()

    async def _read(self) -> BufferStats:
        try:
            stats = await asyncio.wait_for(self._stats(), self._timeout)
        except asyncio.TimeoutError:  # a distinct class before Python 3.11
            raise TimeoutError(f"the buffer's stats() did not answer within {self._timeout:g} s") from None
        if not isinstance(stats, BufferStats):
            raise TypeError(f"the buffer's stats() returned {describe_typed(stats)}, not BufferStats")
        return stats


def _always() -> bool:
    return True
