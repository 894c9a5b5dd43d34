"""Producers on other threads: a handle whose calls run on the buffer's event loop.

Inference servers run engines and sync request handlers in worker threads. A buffer is not
thread-safe (its state and its waiters belong to one event loop), so a call from another
thread is handed to the loop (``call_soon_threadsafe`` on asyncio, the trio token's
``run_sync_soon`` on trio) and the thread blocks until it ran. The call then wakes a waiting
``sample`` exactly as a call on the loop would: at once. A call that may wait (for admission, or
for sampleable groups) runs in a task of its own on the loop (a trio system task on trio) under
the thread's ``timeout``, so the loop decides the timeout: a TimeoutError means nothing changed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import anyio
import anyio.lowlevel

from ._group_writes import GroupStatus
from ._validation import check_timeout
from ._waiting import LoopBinding
from .errors import BufferClosedError, WrongThreadError

__all__ = ["ThreadsafeProducer"]

_T = TypeVar("_T")


class ThreadedBuffer(Protocol):
    """The buffer methods a handle runs on the loop (``ReplayBuffer`` has them): the
    ``*_nowait`` producer methods, the waiting ones its blocking methods await, and the
    flow-control queries."""

    def add_prompt_nowait(
        self, uid: str, *, global_steps: int | None, partition: str, tags: Mapping[str, Any] | None
    ) -> None: ...

    async def add_prompt(
        self, uid: str, *, global_steps: int | None, partition: str, tags: Mapping[str, Any] | None
    ) -> None: ...

    def mark_running_nowait(self, uid: str, *, version: int | None) -> None: ...

    def put_nowait(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int,
        index: int,
        tags: Mapping[str, Any] | None,
        versions: Sequence[tuple[int, int]] | None,
        tokens: int | None,
    ) -> str: ...

    def mark_finished_nowait(self, uid: str) -> None: ...

    def mark_failed_nowait(self, uid: str) -> None: ...

    def put_group_nowait(
        self,
        uid: str,
        payloads: Collection[Any],
        *,
        global_steps: int | None,
        partition: str,
        tags: Mapping[str, Any] | None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None,
        session_ids: Sequence[int] | None,
        indices: Sequence[int] | None,
        status: GroupStatus,
        versions: Sequence[Sequence[tuple[int, int]] | None] | None,
        tokens: Sequence[int | None] | None,
        version: int | None,
        generation_seconds: float | None,
    ) -> list[str]: ...

    async def put_group(
        self,
        uid: str,
        payloads: Collection[Any],
        *,
        global_steps: int | None,
        partition: str,
        tags: Mapping[str, Any] | None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None,
        session_ids: Sequence[int] | None,
        indices: Sequence[int] | None,
        status: GroupStatus,
        versions: Sequence[Sequence[tuple[int, int]] | None] | None,
        tokens: Sequence[int | None] | None,
        version: int | None,
        generation_seconds: float | None,
    ) -> list[str]: ...

    async def wait_for_sampleable(
        self, global_steps: int, count: int, *, partition: str, timeout: float | None
    ) -> int: ...

    def dispatch_step(self, partition: str) -> int: ...

    def capacity(self, partition: str, task: str | None) -> int | None: ...

    def free_slots(self, partition: str, task: str | None) -> int | None: ...

    def full(self, partition: str, task: str | None) -> bool: ...

    def free_tokens(self, partition: str) -> int | None: ...

    def capacity_tokens(self, partition: str) -> int | None: ...


# How often a thread blocked on a call checks that the loop still runs (only while blocked,
# and only matters if the loop stops before running the call, or closes while it waits).
_LIVENESS_SECONDS = 0.25


class ThreadsafeProducer:
    """The producer methods of one buffer, callable from any thread (see ``ReplayBuffer.threadsafe``).

    Each method runs the buffer method of the same name on its event loop and blocks the
    calling thread until it returned, returning its result or raising its error, as
    ``queue.Queue`` does: ``add_prompt`` and ``put_group`` wait for admission (``timeout=``
    bounds the wait; TimeoutError then, with nothing added), their ``*_nowait`` twins raise
    BufferFullError instead, and ``wait_for_sampleable`` waits as the buffer's does. The other
    methods never wait (among them the flow-control queries ``dispatch_step``, ``capacity``,
    ``free_slots`` and ``full`` of each task under a mixture, ``free_tokens`` and
    ``capacity_tokens``). Called on the loop's own thread,
    the methods that never wait run the buffer's method directly; the waiting ones raise
    WrongThreadError (they would block the very loop that must admit them: await the buffer's
    own method there).
    """

    __slots__ = ("_buffer", "_loop_closed", "_loop_running", "_loop_thread", "_spawn", "_submit")

    def __init__(
        self, buffer: ThreadedBuffer, native_token: object, loop_running: Callable[[], bool]
    ) -> None:
        self._buffer = buffer
        self._loop_thread = threading.get_ident()
        self._loop_running = loop_running
        if isinstance(native_token, asyncio.AbstractEventLoop):
            self._submit: Callable[[Callable[[], object]], object] = native_token.call_soon_threadsafe
            self._spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], None] = _asyncio_spawner(
                native_token
            )
            self._loop_closed: Callable[[], bool] = native_token.is_closed  # a stopped loop may go on
        else:  # trio's TrioToken
            self._submit = native_token.run_sync_soon  # type: ignore[attr-defined]
            self._spawn = _trio_spawn
            self._loop_closed = lambda: not loop_running()  # a finished run never goes on

    @classmethod
    def bound_to(cls, buffer: ThreadedBuffer, binding: LoopBinding) -> ThreadsafeProducer:
        """Bind ``buffer`` (its loop ``binding``) to the running loop and return its handle.

        Raises:
            WrongThreadError: no event loop runs in this thread, or the buffer is bound to
                the loop of another thread.
            BackendMismatchError: the buffer is bound to another async backend.
        """
        binding.check_thread()
        binding.check_backend()
        try:
            token = anyio.lowlevel.current_token()
        except RuntimeError as exc:  # no async backend runs here (sniffio could not tell)
            raise WrongThreadError(
                "threadsafe() must be called inside the buffer's running event loop"
            ) from exc
        binding.bind()
        return cls(buffer, token.native_token, binding.loop_running)

    # -- calls that may wait ----------------------------------------------------------------

    def add_prompt(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Run ``add_prompt`` on the loop: under admission control, block until a slot is free
        (FIFO with the loop's own producers), at most ``timeout`` seconds (None: no bound).

        Raises:
            Exception: the errors of ``ReplayBuffer.add_prompt``.
            BufferClosedError: the loop stopped, or the buffer closed.
            TimeoutError: no slot within ``timeout`` seconds; nothing was added.
            ValueError: ``timeout`` is not None or a number >= 0 (nothing is run).
            WrongThreadError: called on the loop's own thread.
        """
        buffer = self._buffer
        self._wait(
            lambda: buffer.add_prompt(uid, global_steps=global_steps, partition=partition, tags=tags),
            check_timeout(timeout),
        )

    def put_group(
        self,
        uid: str,
        payloads: Collection[Any],
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None = None,
        session_ids: Sequence[int] | None = None,
        indices: Sequence[int] | None = None,
        status: GroupStatus = "finished",
        versions: Sequence[Sequence[tuple[int, int]] | None] | None = None,
        tokens: Sequence[int | None] | None = None,
        version: int | None = None,
        generation_seconds: float | None = None,
        timeout: float | None = None,
    ) -> list[str]:
        """Run ``put_group`` on the loop and return its keys: a new group blocks until admitted
        (at most ``timeout`` seconds; None: no bound), as ``queue.Queue.put`` does.

        Raises:
            Exception: the errors of ``ReplayBuffer.put_group``.
            BufferClosedError: the loop stopped, or the buffer closed.
            TimeoutError: no slot within ``timeout`` seconds; nothing was added.
            ValueError: ``timeout`` is not None or a number >= 0 (nothing is run).
            WrongThreadError: called on the loop's own thread.
        """
        buffer = self._buffer
        return self._wait(
            lambda: buffer.put_group(
                uid,
                payloads,
                global_steps=global_steps,
                partition=partition,
                tags=tags,
                trajectory_tags=trajectory_tags,
                session_ids=session_ids,
                indices=indices,
                status=status,
                versions=versions,
                tokens=tokens,
                version=version,
                generation_seconds=generation_seconds,
            ),
            check_timeout(timeout),
        )

    def wait_for_sampleable(
        self, global_steps: int, count: int, *, partition: str = "train", timeout: float | None = None
    ) -> int:
        """Run ``wait_for_sampleable`` on the loop: block until at least ``count`` groups are
        sampleable at ``global_steps``; return how many are.

        Raises:
            Exception: the errors of ``ReplayBuffer.wait_for_sampleable``.
            TimeoutError: fewer than ``count`` within ``timeout`` seconds.
            BufferClosedError: the loop stopped, or the buffer closed.
            WrongThreadError: called on the loop's own thread.
        """
        buffer = self._buffer
        return self._wait(
            lambda: buffer.wait_for_sampleable(global_steps, count, partition=partition, timeout=timeout),
            None,
        )

    # -- calls that never wait ----------------------------------------------------------------

    def add_prompt_nowait(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Run ``add_prompt_nowait`` on the loop (same errors, BufferFullError included, plus
        BufferClosedError if the loop stopped)."""
        self._run(
            self._buffer.add_prompt_nowait, uid, global_steps=global_steps, partition=partition, tags=tags
        )

    def mark_running(self, uid: str, *, version: int | None = None) -> None:
        """Run ``mark_running_nowait`` on the loop (same errors)."""
        self._run(self._buffer.mark_running_nowait, uid, version=version)

    def put(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
        versions: Sequence[tuple[int, int]] | None = None,
        tokens: int | None = None,
    ) -> str:
        """Run ``put_nowait`` on the loop and return its key (same errors)."""
        return self._run(
            self._buffer.put_nowait,
            uid,
            payload,
            session_id=session_id,
            index=index,
            tags=tags,
            versions=versions,
            tokens=tokens,
        )

    def mark_finished(self, uid: str) -> None:
        """Run ``mark_finished_nowait`` on the loop (same errors)."""
        self._run(self._buffer.mark_finished_nowait, uid)

    def mark_failed(self, uid: str) -> None:
        """Run ``mark_failed_nowait`` on the loop (same errors)."""
        self._run(self._buffer.mark_failed_nowait, uid)

    def put_group_nowait(
        self,
        uid: str,
        payloads: Collection[Any],
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None = None,
        session_ids: Sequence[int] | None = None,
        indices: Sequence[int] | None = None,
        status: GroupStatus = "finished",
        versions: Sequence[Sequence[tuple[int, int]] | None] | None = None,
        tokens: Sequence[int | None] | None = None,
        version: int | None = None,
        generation_seconds: float | None = None,
    ) -> list[str]:
        """Run ``put_group_nowait`` on the loop and return its keys (same errors, BufferFullError
        included, plus BufferClosedError if the loop stopped)."""
        return self._run(
            self._buffer.put_group_nowait,
            uid,
            payloads,
            global_steps=global_steps,
            partition=partition,
            tags=tags,
            trajectory_tags=trajectory_tags,
            session_ids=session_ids,
            indices=indices,
            status=status,
            versions=versions,
            tokens=tokens,
            version=version,
            generation_seconds=generation_seconds,
        )

    def dispatch_step(self, partition: str = "train") -> int:
        """Run ``dispatch_step`` on the loop (same errors)."""
        return self._run(self._buffer.dispatch_step, partition)

    def capacity(self, partition: str = "train", task: str | None = None) -> int | None:
        """Run ``capacity`` on the loop (same errors)."""
        return self._run(self._buffer.capacity, partition, task)

    def free_slots(self, partition: str = "train", task: str | None = None) -> int | None:
        """Run ``free_slots`` on the loop (same errors; the answer may be stale on return)."""
        return self._run(self._buffer.free_slots, partition, task)

    def full(self, partition: str = "train", task: str | None = None) -> bool:
        """Run ``full`` on the loop (same errors; the answer may be stale on return)."""
        return self._run(self._buffer.full, partition, task)

    def free_tokens(self, partition: str = "train") -> int | None:
        """Run ``free_tokens`` on the loop (same errors; the answer may be stale on return)."""
        return self._run(self._buffer.free_tokens, partition)

    def capacity_tokens(self, partition: str = "train") -> int | None:
        """Run ``capacity_tokens`` on the loop (same errors)."""
        return self._run(self._buffer.capacity_tokens, partition)

    # -- running on the loop ------------------------------------------------------------------

    def _run(self, method: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run ``method(*args, **kwargs)`` on the loop and return its result."""
        if threading.get_ident() == self._loop_thread:
            return method(*args, **kwargs)

        def run(future: concurrent.futures.Future[_T]) -> None:
            future.set_result(method(*args, **kwargs))

        return self._hand_over(run)

    def _wait(self, call: Callable[[], Awaitable[_T]], timeout: float | None) -> _T:
        """Await ``call()`` in a task of its own on the loop, for at most ``timeout`` seconds
        (None: no bound), and return its result.

        Raises:
            WrongThreadError: called on the loop's own thread.
            TimeoutError: ``timeout`` passed first (the call was cancelled: it changed nothing).
        """
        if threading.get_ident() == self._loop_thread:
            raise WrongThreadError(
                "a threadsafe() handle's waiting calls block their thread; on the event loop's own "
                "thread that would block the loop that must serve them: await the buffer's method"
            )

        async def bounded() -> _T:
            with anyio.move_on_after(timeout) as scope:
                return await call()
            assert scope.cancelled_caught  # (the call returned or raised otherwise)
            raise TimeoutError(f"the call did not complete within {timeout} s; it changed nothing")

        def start(future: concurrent.futures.Future[_T]) -> None:
            self._spawn(lambda: _deliver(bounded, future))

        return self._hand_over(start, started=True)

    def _hand_over(
        self, run: Callable[[concurrent.futures.Future[_T]], None], *, started: bool = False
    ) -> _T:
        """Have the loop call ``run(future)``, which must (then, or later with ``started``)
        complete ``future``; block until it did and return its result.

        Raises:
            What ``run`` put in the future; BufferClosedError if the loop stopped before running
            it, or (``started``) closed while the call it started was still waiting.
        """
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the thread gave up (its loop stopped): do nothing
            try:
                run(future)
            except BaseException as exc:  # the caller's error, raised in the caller's thread
                future.set_exception(exc)

        try:
            self._submit(call)
        except Exception as exc:  # the loop is closed, or the trio run finished
            raise BufferClosedError("the buffer's event loop has stopped") from exc
        # Not future.result(timeout): since Python 3.11 its TimeoutError is the builtin one, which
        # a call that timed out on the loop raises too.
        while not concurrent.futures.wait((future,), _LIVENESS_SECONDS).done:
            if not self._loop_running() and future.cancel():
                raise BufferClosedError("the buffer's event loop stopped before running the call")
            if started and future.running() and self._loop_closed():
                raise BufferClosedError("the buffer's event loop closed while the call waited")
        return future.result()


async def _deliver(call: Callable[[], Awaitable[_T]], future: concurrent.futures.Future[_T]) -> None:
    """Await ``call()`` and put its outcome in ``future`` (a task's whole body: it never raises
    but the loop's own cancellation, which the thread learns as BufferClosedError)."""
    try:
        future.set_result(await call())
    except anyio.get_cancelled_exc_class():
        future.set_exception(BufferClosedError("the buffer's event loop stopped while the call waited"))
        raise
    except BaseException as exc:  # raised in the caller's thread, never into the loop
        future.set_exception(exc)


def _asyncio_spawner(
    loop: asyncio.AbstractEventLoop,
) -> Callable[[Callable[[], Coroutine[Any, Any, None]]], None]:
    """Return what starts a coroutine function in a task of its own on ``loop`` (from its thread)."""
    tasks: set[asyncio.Task[None]] = set()  # strong references, as asyncio asks

    def spawn(function: Callable[[], Coroutine[Any, Any, None]]) -> None:
        task = loop.create_task(function())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return spawn


def _trio_spawn(function: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Start a coroutine function as a trio system task (from the trio thread), as
    ``trio.from_thread.run`` does; it is cancelled when the run ends."""
    import trio.lowlevel  # only for a buffer bound to trio, which then has trio

    async def body() -> None:
        with contextlib.suppress(trio.Cancelled):  # the run is ending; _deliver told the thread
            await function()

    trio.lowlevel.spawn_system_task(body, name="stalebuf.threadsafe")
