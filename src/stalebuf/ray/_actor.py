"""The Ray async actor that hosts a real :class:`~stalebuf.ReplayBuffer`.

Ray runs each concurrency group of an async actor on its own thread and event loop. The
buffer is not thread-safe, so it lives on one loop, its *home*: the default group's loop,
where ``__init__`` runs and where ``sample`` calls run directly (parked samplers use only
slots of the default group). Every other call runs in its own group (``producer``,
``control``, ``events``) and hops onto the home loop with ``call_soon_threadsafe``: parked
samplers can never take the slots producers need, and every buffer method still runs on
the one loop, so each call stays atomic exactly as in the local buffer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar, cast

import ray

from .._validation import describe, int_at_least
from ..buffer import ReplayBuffer
from ..config import SamplerConfig
from ..errors import ConfigError
from ..records import Batch, EvictionEvent, Group, Status, Trajectory
from ..stats import BufferStats
from ._ledger import SampleLedger, SampleResult
from ._protocol import (
    PROTOCOL_VERSION,
    Op,
    Outcome,
    SampleRequest,
    Wire,
    decode_op,
    decode_sample,
    store_payloads,
)

__all__ = ["CONCURRENCY_GROUPS", "BufferHost", "actor_class"]

logger = logging.getLogger("stalebuf.ray")

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _method(group: str, **options: Any) -> Callable[[F], F]:
    """``ray.method(concurrency_group=group, ...)``, typed as the identity it is for mypy."""
    return cast("Callable[[F], F]", ray.method(concurrency_group=group, **options))


#: Concurrency groups of the actor; ``sample`` runs in Ray's default group.
PRODUCER_GROUP = "producer"
CONTROL_GROUP = "control"
EVENTS_GROUP = "events"
#: Default slots per concurrency group (producer calls only hop onto the home loop, so few
#: slots serve many clients; each eviction reader holds one ``events`` slot while it polls).
CONCURRENCY_GROUPS: Mapping[str, int] = {PRODUCER_GROUP: 64, CONTROL_GROUP: 16, EVENTS_GROUP: 64}


class BufferHost:
    """The actor's state: a ReplayBuffer on the home loop, plus the eviction-event ring.

    Not used directly: :func:`actor_class` wraps it with ``ray.remote`` and
    :class:`~stalebuf.ray.RemoteReplayBuffer` is its client.
    """

    def __init__(
        self,
        config: SamplerConfig | Mapping[str, Any] | None,
        use_factory: bool,
        status_log_interval: float | None,
        eviction_queue_size: int,
        keep_evicted_payloads: bool,
    ) -> None:
        self._home = _home_loop()
        self._keep_evicted_payloads = keep_evicted_payloads
        self._events: collections.deque[EvictionEvent] = collections.deque(maxlen=eviction_queue_size)
        self._events_end = 0  # sequence number of the next event
        self._events_overflowed = 0
        self._events_changed = asyncio.Event()  # binds to the home loop on first use
        self._init_error: Exception | None = None
        self._ledger = SampleLedger(self._readmit_batch)
        try:
            if use_factory:
                assert config is not None
                self._buffer = ReplayBuffer.from_config(
                    config, on_evict=self._record_eviction, status_log_interval=status_log_interval
                )
            else:
                assert config is None or isinstance(config, SamplerConfig)
                self._buffer = ReplayBuffer(
                    config, on_evict=self._record_eviction, status_log_interval=status_log_interval
                )
        except Exception as exc:  # reported to every caller instead of killing the actor
            self._init_error = exc
            self._buffer = ReplayBuffer(status_log_interval=None)
            self._buffer.close()

    # -- plumbing ---------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self._init_error is not None:
            raise self._init_error.with_traceback(None)

    async def _on_home(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the home loop and return its result (or raise its error)."""
        if asyncio.get_running_loop() is self._home:
            return fn()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the caller was cancelled before we ran: do nothing
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._home.call_soon_threadsafe(run)
        return await asyncio.wrap_future(future)

    async def _await_on_home(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._home))

    # -- default group: samplers ------------------------------------------------------

    async def sample(self, request: Wire) -> SampleResult:
        """``ReplayBuffer.sample`` on the home loop, under the request's id: the batch it takes
        is kept until the client acknowledges it or cancels the request (see SampleLedger)."""
        self._check_ready()
        serve = self._serve(decode_sample(request))
        if asyncio.get_running_loop() is self._home:
            return await serve
        return await self._await_on_home(serve)  # only with a private home loop

    async def _serve(self, request: SampleRequest) -> SampleResult:
        buffer, ledger = self._buffer, self._ledger
        task = ledger.start(
            request.request_id,
            lambda: buffer.sample(
                request.global_steps, request.batch_size, partition=request.partition, timeout=request.timeout
            ),
        )
        try:
            return await task
        finally:
            ledger.finish(request.request_id, task)

    # -- producer group ---------------------------------------------------------------

    @_method(PRODUCER_GROUP, enable_task_events=False)
    async def submit(self, ops: list[Wire], upload: bool) -> list[Outcome]:
        """Apply encoded producer operations in order, atomically with respect to samplers.

        With ``upload`` the payload values the ops carry are first stored in the object
        store from this actor (one object per operation), so the actor owns them.

        Raises:
            ProtocolError: an operation this actor cannot decode (nothing is applied).
        """
        self._check_ready()
        decoded = [decode_op(op) for op in ops]
        if upload:
            decoded = store_payloads(decoded)
        return await self._on_home(lambda: [self._apply(op) for op in decoded])

    def _apply(self, op: Op) -> Outcome:
        try:
            return Outcome(True, op.apply(self._buffer))
        except Exception as exc:
            return Outcome(False, exc)

    # -- control group ----------------------------------------------------------------

    @_method(CONTROL_GROUP)
    async def sampleable_count(self, global_steps: int, partition: str) -> int:
        """``ReplayBuffer.sampleable_count`` on the home loop."""
        self._check_ready()
        return await self._on_home(lambda: self._buffer.sampleable_count(global_steps, partition))

    @_method(CONTROL_GROUP)
    async def stats(self) -> BufferStats:
        """``ReplayBuffer.stats`` on the home loop."""
        self._check_ready()
        return await self._on_home(self._buffer.stats)

    @_method(CONTROL_GROUP)
    async def close(self) -> None:
        """Close the buffer (waking parked samplers and eviction pollers)."""
        self._check_ready()

        def close() -> None:
            self._buffer.close()
            self._notify_events()

        await self._on_home(close)

    @_method(CONTROL_GROUP)
    async def cancel_sample(self, request_id: str) -> None:
        """The client's ``sample`` under ``request_id`` was cancelled: the request takes nothing,
        or the batch it took and the client never received is put back, exactly once.

        Put-back groups are admitted again with their dispatch step, tags, trajectories and
        status (so the stats count them as admitted twice and sampled once); a group whose uid
        was reused meanwhile, or any group once the buffer is closed, cannot be put back and is
        logged as lost.
        """
        await self._on_home(lambda: self._ledger.cancel(request_id))

    @_method(CONTROL_GROUP, enable_task_events=False)
    async def acknowledge_sample(self, request_id: str) -> None:
        """The client received the batch of ``request_id``: the actor forgets it."""
        await self._on_home(lambda: self._ledger.acknowledge(request_id))

    @_method(CONTROL_GROUP)
    async def ping(self) -> int:
        """Return the protocol version: the actor is up (whether or not its buffer was built)."""
        return PROTOCOL_VERSION

    def _readmit_batch(self, batch: Batch) -> None:
        lost = [group.uid for group in batch.groups if not self._readmit(group)]
        if lost:
            logger.warning(
                "a cancelled sample had taken %d group(s); could not put back %s "
                "(uid reused or buffer closed)",
                len(batch),
                describe(lost),
            )
        else:
            logger.info("a cancelled sample had taken %d group(s); put them back", len(batch))

    def _readmit(self, group: Group) -> bool:
        buffer = self._buffer
        if buffer.closed or group.uid in buffer:
            return False
        trajectories = group.trajectories
        buffer.put_group_nowait(
            group.uid,
            [t.payload for t in trajectories],
            global_steps=group.global_steps,
            partition=group.partition,
            tags=group.tags,
            trajectory_tags=[t.tags for t in trajectories],
            session_ids=[t.session_id for t in trajectories],
            indices=[t.index for t in trajectories],
            status="finished" if group.status is Status.FINISHED else "failed",
        )
        return True

    @_method(CONTROL_GROUP)
    async def info(self) -> dict[str, Any]:
        """Facts about the actor: the config, whether closed, eviction-ring and sample-request
        counters."""
        self._check_ready()

        def info() -> dict[str, Any]:
            return {
                "config": self._buffer.config,
                "buffer_class": f"{type(self._buffer).__module__}.{type(self._buffer).__qualname__}",
                "closed": self._buffer.closed,
                "eviction_queue_size": self._events.maxlen,
                "evictions_emitted": self._events_end,
                "evictions_overflowed": self._events_overflowed,
                "sample_requests": self._ledger.counts(),
            }

        return await self._on_home(info)

    # -- events group -----------------------------------------------------------------

    def _record_eviction(self, event: EvictionEvent) -> None:
        """The buffer's on_evict (home loop, inside ``sample``): append to the ring, never block."""
        if not self._keep_evicted_payloads:
            event = _without_payloads(event)
        events = self._events
        if len(events) == events.maxlen:
            self._events_overflowed += 1  # the oldest event falls off the ring
        events.append(event)
        self._events_end += 1
        self._notify_events()

    def _notify_events(self) -> None:
        self._events_changed.set()
        self._events_changed = asyncio.Event()

    @_method(EVENTS_GROUP)
    async def poll_evictions(
        self, cursor: int | None, from_oldest: bool, limit: int, wait: float
    ) -> tuple[int, list[EvictionEvent], int, bool]:
        """Return ``(next_cursor, events, missed, closed)`` for events after ``cursor``.

        Waits up to ``wait`` seconds for an event if none is there. ``cursor=None`` starts
        at the newest end of the ring (or its oldest retained event with ``from_oldest``).
        ``missed`` counts events that fell off the ring before this reader got them.
        ``closed`` is True once the buffer is closed and the reader has every event.
        """
        self._check_ready()
        return await self._await_on_home(self._poll(cursor, from_oldest, limit, wait))

    async def _poll(
        self, cursor: int | None, from_oldest: bool, limit: int, wait: float
    ) -> tuple[int, list[EvictionEvent], int, bool]:
        events = self._events
        start = self._events_end - len(events)
        if cursor is None:
            cursor = start if from_oldest else self._events_end
        cursor = min(cursor, self._events_end)  # a cursor from before an actor restart
        missed = max(0, start - cursor)
        cursor = max(cursor, start)
        if cursor == self._events_end and not self._buffer.closed and wait > 0:
            changed = self._events_changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), wait)
            start = self._events_end - len(events)
            missed += max(0, start - cursor)
            cursor = max(cursor, start)
        offset = cursor - start
        taken = [events[i] for i in range(offset, min(len(events), offset + limit))]
        cursor += len(taken)
        closed = self._buffer.closed and cursor == self._events_end
        return cursor, taken, missed, closed


def _home_loop() -> asyncio.AbstractEventLoop:
    """The loop ``__init__`` runs on (Ray's default group), else a private loop thread."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # a Ray that runs async actors' __init__ outside their loop
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="stalebuf-home", daemon=True).start()
        return loop


def _without_payloads(event: EvictionEvent) -> EvictionEvent:
    groups = tuple(
        group.replace(
            trajectories=tuple(
                Trajectory(t.key, t.session_id, t.index, t.tags, None) for t in group.trajectories
            ),
        )
        for group in event.groups
    )
    return EvictionEvent(event.partition, event.reason, groups, event.global_steps)


@functools.lru_cache(maxsize=16)
def _actor_class(groups: tuple[tuple[str, int], ...]) -> Any:
    remote: Any = ray.remote  # its overloads do not list concurrency_groups
    return remote(concurrency_groups=dict(groups))(BufferHost)


def actor_class(concurrency_groups: Mapping[str, int]) -> Any:
    """Return ``BufferHost`` as a Ray actor class with these concurrency groups (merged over
    :data:`CONCURRENCY_GROUPS`); Ray accepts them only at ``ray.remote`` time, not in ``.options()``.

    Raises:
        ConfigError: a group that is not a str mapped to an int >= 1.
    """
    merged = dict(CONCURRENCY_GROUPS)
    for name, slots in concurrency_groups.items():
        if type(name) is not str or not name:
            raise ConfigError(
                f"concurrency_groups must map non-empty str names to ints, got {describe(name)}"
            )
        int_at_least(f"concurrency_groups[{name!r}]", 1)(None, None, slots)
        merged[name] = slots
    return _actor_class(tuple(sorted(merged.items())))
