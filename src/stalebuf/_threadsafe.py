"""Producers on other threads: a handle whose calls run on the buffer's event loop.

Inference servers run engines and sync request handlers in worker threads. A buffer is not
thread-safe (its state and its waiters belong to one event loop), so a call from another
thread is handed to the loop (``call_soon_threadsafe`` on asyncio, the trio token's
``run_sync_soon`` on trio) and the thread blocks until it ran. The call then wakes a waiting
``sample`` exactly as a call on the loop would: at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import anyio.lowlevel

from ._group_writes import GroupStatus
from ._waiting import LoopBinding
from .errors import BufferClosedError, WrongThreadError

__all__ = ["ThreadsafeProducer"]

_T = TypeVar("_T")


class NowaitProducer(Protocol):
    """The ``*_nowait`` producer methods a handle runs on the loop (``ReplayBuffer`` has them)."""

    def add_prompt_nowait(
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
    ) -> list[str]: ...


# How often a thread blocked on a call checks that the loop still runs (only while blocked,
# and only matters if the loop stops before running the call).
_LIVENESS_SECONDS = 0.25


class ThreadsafeProducer:
    """The producer methods of one buffer, callable from any thread (see ``ReplayBuffer.threadsafe``).

    Each method runs the ``*_nowait`` method of the same name on the buffer's event loop and
    blocks the calling thread until it ran, returning its result or raising its error. Called
    on the loop's own thread, it runs the method directly.
    """

    __slots__ = ("_buffer", "_loop_running", "_loop_thread", "_submit")

    def __init__(
        self, buffer: NowaitProducer, native_token: object, loop_running: Callable[[], bool]
    ) -> None:
        self._buffer = buffer
        self._loop_thread = threading.get_ident()
        self._loop_running = loop_running
        if isinstance(native_token, asyncio.AbstractEventLoop):
            self._submit: Callable[[Callable[[], object]], object] = native_token.call_soon_threadsafe
        else:  # trio's TrioToken
            self._submit = native_token.run_sync_soon  # type: ignore[attr-defined]

    @classmethod
    def bound_to(cls, buffer: NowaitProducer, binding: LoopBinding) -> ThreadsafeProducer:
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

    def add_prompt(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Run ``add_prompt_nowait`` on the loop (same errors, plus BufferClosedError if the
        loop stopped)."""
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
    ) -> list[str]:
        """Run ``put_group_nowait`` on the loop and return its keys (same errors)."""
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
        )

    def _run(self, method: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        if threading.get_ident() == self._loop_thread:
            return method(*args, **kwargs)
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the thread gave up (its loop stopped): do nothing
            try:
                future.set_result(method(*args, **kwargs))
            except BaseException as exc:  # the caller's error, raised in the caller's thread
                future.set_exception(exc)

        try:
            self._submit(call)
        except Exception as exc:  # the loop is closed, or the trio run finished
            raise BufferClosedError("the buffer's event loop has stopped") from exc
        while True:
            try:
                return future.result(timeout=_LIVENESS_SECONDS)
            except concurrent.futures.TimeoutError:
                if not self._loop_running() and future.cancel():
                    raise BufferClosedError(
                        "the buffer's event loop stopped before running the call"
                    ) from None
