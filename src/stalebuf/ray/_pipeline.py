"""Producer operations of one client on one event loop, combined into few actor calls.

While one actor call is in flight, the operations made meanwhile queue up and leave together in
the next one (at most ``MAX_OPS_PER_CALL``); each still gets its own result or error, and the
operations of one coroutine apply in the order it made them.
"""

from __future__ import annotations

import asyncio
import copy
from collections import deque
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayError

from ._errors import translate
from ._protocol import Op, Outcome, encode, store_payloads
from ._start import StartGate

__all__ = ["MAX_OPS_PER_CALL", "ProducerPipeline"]

#: At most this many producer operations travel in one actor call.
MAX_OPS_PER_CALL = 1024

_Item = tuple[Op, "asyncio.Future[Outcome]"]


class ProducerPipeline:
    """The producer operations waiting to be sent from one event loop, and the task sending them.

    Args:
        loop: the event loop the operations are made on.
        handle: the actor handle.
        payloads: the client's payload mode ("producer", "actor" or "inline").
        gate: waited on before the first call, so a call never waits on an actor that never starts.
        where: describes the actor in error messages.
    """

    __slots__ = ("_gate", "_handle", "_payloads", "_queue", "_task", "_where", "loop")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        handle: Any,
        payloads: str,
        gate: StartGate,
        where: Callable[[], str],
    ) -> None:
        self.loop = loop
        self._handle = handle
        self._payloads = payloads
        self._gate = gate
        self._where = where
        self._queue: deque[_Item] = deque()
        self._task: asyncio.Task[None] | None = None

    async def submit(self, op: Op) -> Any:
        """Queue ``op``, wait until the actor applied it and return its result.

        Raises:
            What the operation raised in the actor, translated (see ``translate``).
        """
        future: asyncio.Future[Outcome] = self.loop.create_future()
        self._queue.append((op, future))
        if self._task is None:
            self._task = self.loop.create_task(self._flush())
        ok, value = await future
        if ok:
            return value
        raise value

    async def _flush(self) -> None:
        """Send queued operations, one actor call at a time, until the queue is empty."""
        queue = self._queue
        try:
            while queue:
                items: list[_Item] = []
                while queue and len(items) < MAX_OPS_PER_CALL:
                    item = queue.popleft()
                    if not item[1].done():  # a caller cancelled before sending: not applied
                        items.append(item)
                if items:
                    await self._send(items)
        finally:
            self._task = None
            while queue:
                queue.popleft()[1].cancel()

    async def _send(self, items: list[_Item]) -> None:
        try:
            await self._gate.wait()
            ops = [op for op, _ in items]
            if self._payloads == "producer":
                ops = store_payloads(ops)
            ref = self._handle.submit.remote([encode(op) for op in ops], self._payloads == "actor")
        except asyncio.CancelledError as exc:  # the loop is shutting down: nothing was sent
            self._fail(items, exc)
            raise
        except RayError as exc:
            self._fail(items, exc)
            return
        except Exception as exc:  # e.g. a payload that cannot be serialised, or no actor
            if len(items) == 1 or not self._gate.started:
                self._fail(items, exc)
            else:  # find the culprit: the others must not fail with it
                for item in items:
                    await self._send([item])
            return
        try:
            outcomes: list[Outcome] = await ref
        except asyncio.CancelledError as exc:  # the loop is shutting down: the ops may have applied
            self._fail(items, exc)
            raise
        except Exception as exc:
            self._fail(items, exc)
            return
        for (_, future), outcome in zip(items, outcomes, strict=True):
            if not future.done():
                future.set_result(outcome)

    def _fail(self, items: list[_Item], exc: BaseException) -> None:
        for i, (_, future) in enumerate(items):
            if future.done():
                continue
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
                continue
            error = translate(exc, self._where())
            future.set_result(Outcome(False, error if i == 0 else copy.copy(error)))
