"""The Ray async actor that hosts a real :class:`~stalebuf.ReplayBuffer`.

Ray runs each concurrency group of an async actor on its own thread and event loop. The
buffer is not thread-safe, so it lives on one loop, its *home*: the default group's loop,
where ``__init__`` runs and where ``sample`` calls run directly (parked samplers use only
slots of the default group). Every other call runs in its own group (``producer``,
``admission``, ``watch``, ``control``, ``events``) and hops onto the home loop with
``call_soon_threadsafe``: parked samplers can never take the slots producers need, producers
waiting for admission hold only ``admission`` slots (see ``_admission``) and watched rollouts only
``watch`` slots (see ``_watches``), and every buffer method still runs on the one loop, so each
call stays atomic exactly as in the local buffer.

The actor also writes and reads checkpoint files and its buffer's journal (paths on its node):
``save`` and the journal store payloads by value, and a restoring or recovering actor puts the
payloads it reads back into the object store, which it owns (see ``_payloads`` and ``_hosted``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar, cast

import ray

from .._checkpoint_file import PayloadCodec
from .._save_order import SaveSequencer, SaveTicket
from .._validation import describe, int_at_least
from ..buffer import ReplayBuffer
from ..checkpoint import BufferCheckpoint
from ..config import SamplerConfig
from ..errors import ConfigError
from ..filters import GroupFilter
from ..records import Batch, EvictionEvent, Group
from ..stats import BufferStats
from ._admission import AdmissionLedger
from ._hosted import HostedBuffer, Restored, build_buffer
from ._ledger import SampleLedger, SampleResult
from ._options import buffer_options
from ._payloads import checkpoint_values
from ._producer_ops import ProducerOps
from ._protocol import (
    FLOW_QUERIES,
    PROTOCOL_VERSION,
    JournalRequest,
    Outcome,
    ProtocolError,
    RecoverRequest,
    RestoreRequest,
    SampleRequest,
    Wire,
    decode_op,
    decode_sample,
    store_payloads,
)
from ._ring import EvictionRing
from ._watches import RolloutWatches

__all__ = ["CONCURRENCY_GROUPS", "BufferHost", "actor_class"]

logger = logging.getLogger("stalebuf.ray")

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _method(group: str, **options: Any) -> Callable[[F], F]:
    """``ray.method(concurrency_group=group, ...)``, typed as the identity it is for mypy."""
    return cast("Callable[[F], F]", ray.method(concurrency_group=group, **options))


#: Concurrency groups of the actor; ``sample`` runs in Ray's default group.
PRODUCER_GROUP = "producer"
ADMISSION_GROUP = "admission"
WATCH_GROUP = "watch"
CONTROL_GROUP = "control"
EVENTS_GROUP = "events"
#: Default slots per concurrency group. Producer calls only hop onto the home loop, so few slots
#: serve many clients. A producer waiting for admission holds one ``admission`` slot while its
#: client waits for the result (the wait itself is in the buffer's queue, so a full group only
#: delays results), each entered remote rollout one ``watch`` slot (a full group delays when
#: bodies learn of evictions), and each eviction reader one ``events`` slot while it polls.
CONCURRENCY_GROUPS: Mapping[str, int] = {
    PRODUCER_GROUP: 64,
    ADMISSION_GROUP: 1024,
    WATCH_GROUP: 4096,
    CONTROL_GROUP: 16,
    EVENTS_GROUP: 64,
}


class BufferHost:
    """The actor's state: a ReplayBuffer on the home loop, the eviction-event ring, the sample
    requests, the producers waiting for admission, the watched rollouts and the save order.

    Not used directly: :func:`actor_class` wraps it with ``ray.remote`` and
    :class:`~stalebuf.ray.RemoteReplayBuffer` is its client.
    """

    def __init__(
        self,
        config: SamplerConfig | Mapping[str, Any] | None,
        use_factory: bool,
        status_log_interval: tuple[float | None, ...],
        eviction_queue_size: int,
        keep_evicted_payloads: bool,
        restore: RestoreRequest | RecoverRequest | None = None,
        filters: tuple[GroupFilter, ...] = (),
        journal: JournalRequest | None = None,
    ) -> None:
        self._home = _home_loop()
        self._ring = EvictionRing(eviction_queue_size, keep_evicted_payloads, lambda: self._buffer.closed)
        self._init_error: Exception | None = None
        self._ledger = SampleLedger(self._readmit_batch)
        self._admissions = AdmissionLedger()
        self._saves = SaveSequencer()  # orders this actor's overlapping saves (see save)
        options = buffer_options(status_log_interval, filters)  # as the client gave them
        try:
            hosted = build_buffer(config, use_factory, options, self._record_eviction, restore, journal)
        except Exception as exc:  # reported to every caller instead of killing the actor
            self._init_error = exc
            hosted = HostedBuffer(ReplayBuffer(status_log_interval=None))
            hosted.buffer.close()
        self._buffer = hosted.buffer
        self._restored: Restored = hosted.restored()
        self._watches = RolloutWatches(self._buffer)
        self._ops = ProducerOps(self._buffer, self._admissions, self._watches)

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
        """Await ``coro`` on the home loop; cancelling the caller cancels it there."""
        if asyncio.get_running_loop() is self._home:
            return await coro
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
            lambda: buffer.sample(request.global_steps, request.batch_size, **request.sample_options()),
        )
        try:
            return await task
        finally:
            ledger.finish(request.request_id, task)

    async def wait_for_sampleable(
        self, global_steps: int, count: int, partition: str, timeout: float | None
    ) -> int:
        """``ReplayBuffer.wait_for_sampleable`` on the home loop (in the default group, as ``sample``)."""
        self._check_ready()
        wait = self._buffer.wait_for_sampleable(global_steps, count, partition=partition, timeout=timeout)
        return await self._await_on_home(wait)

    # -- producer group ---------------------------------------------------------------

    @_method(PRODUCER_GROUP, enable_task_events=False)
    async def submit(self, ops: list[Wire], upload: bool) -> list[Outcome]:
        """Apply encoded producer operations in order, atomically with respect to samplers.

        With ``upload`` the payload values the ops carry are first stored in the object
        store from this actor (one object per operation), so the actor owns them. An operation
        with a token that finds no admission slot is parked (its outcome is ``Parked(token)``:
        collect it with :meth:`await_admission`); this call never waits for admission.
        ``mark_running``, ``put``, ``mark_finished`` and ``mark_failed`` wait while the buffer's
        journal's writer is behind, as the local async calls do.

        Raises:
            ProtocolError: an operation this actor cannot decode (nothing is applied).
        """
        self._check_ready()
        decoded = [decode_op(op) for op in ops]
        if upload:
            decoded = store_payloads(decoded)
        applier = self._ops
        outcomes, rest = await self._on_home(lambda: applier.apply_until_behind(decoded))
        if rest:  # the journal's writer is behind: the rest waits for it, as the local calls do
            outcomes += await self._await_on_home(applier.apply_waiting(rest))
        return outcomes

    # -- admission and watch groups ---------------------------------------------------

    @_method(ADMISSION_GROUP)
    async def await_admission(self, token: str) -> Any:
        """Wait for the producer operation parked under ``token`` to be admitted; return its result.

        Raises:
            What the operation raised while it waited (e.g. BufferClosedError), or
            AdmissionAbandonedError when nothing is parked under ``token``.
        """
        self._check_ready()
        return await self._await_on_home(self._admissions.collect(token))

    @_method(WATCH_GROUP, enable_task_events=False)
    async def watch_rollout(self, token: str) -> str:
        """Return "evicted" or "closed" when the rollout entered under ``token`` is evicted in
        flight or the buffer closes, or "ended" once it ended otherwise."""
        self._check_ready()
        return await self._await_on_home(self._watches.watch(token))

    @_method(CONTROL_GROUP)
    async def abandon(self, token: str) -> None:
        """The client's call under ``token`` was cancelled: a wait for admission is cancelled
        (nothing is added), an entered rollout is failed, and an operation that has not arrived
        yet will not be applied. An add_prompt or put_group admitted before this arrived stays."""

        def abandon() -> None:
            parked = self._admissions.abandon(token)
            entered = self._watches.abandon(token)
            if not (parked or entered):
                self._admissions.remember_abandoned(token)

        await self._on_home(abandon)

    # -- control group ----------------------------------------------------------------

    @_method(CONTROL_GROUP)
    async def sampleable_count(self, global_steps: int, partition: str, task: str | None = None) -> int:
        """``ReplayBuffer.sampleable_count`` on the home loop."""
        self._check_ready()
        return await self._on_home(lambda: self._buffer.sampleable_count(global_steps, partition, task))

    @_method(CONTROL_GROUP)
    async def flow(self, query: str, partition: str, *task: str | None) -> Any:
        """A flow query of :data:`FLOW_QUERIES` (``ReplayBuffer.free_slots``...) on the home loop.

        Raises:
            ProtocolError: ``query`` is not one of :data:`FLOW_QUERIES`.
        """
        self._check_ready()
        if query not in FLOW_QUERIES:
            raise ProtocolError(f"unknown flow-control query {describe(query)}")
        method = getattr(self._buffer, query)
        return await self._on_home(lambda: method(partition, *task))

    @_method(CONTROL_GROUP)
    async def save(self, path: str, payload_codec: PayloadCodec | None) -> None:
        """Checkpoint the buffer at once (on the home loop), fetch every payload held as an object
        reference, and write ``path`` (on this node) in a worker thread, atomically, in the order
        the saves started (see ``_save_order``).

        Raises:
            CheckpointError: a payload object is lost, or the codec's format cannot hold a value.
            OSError: the file could not be written.
        """
        self._check_ready()
        checkpoint, ticket = await self._checkpoint_with_ticket()
        try:
            checkpoint = await checkpoint_values(checkpoint)
        except BaseException:
            ticket.end()  # drawn and never written: leave the order, or it holds landings for good
            raise
        await self._saves.write(path, checkpoint, payload_codec, ticket)

    async def _checkpoint_with_ticket(self) -> tuple[BufferCheckpoint, SaveTicket]:
        """Take the checkpoint, then its save ticket, in one step of the home loop (tickets follow states)."""

        def take() -> tuple[BufferCheckpoint, SaveTicket]:
            checkpoint = self._buffer.checkpoint()  # first: a refused checkpoint draws no ticket
            return checkpoint, self._saves.ticket()

        taking = asyncio.ensure_future(self._on_home(take))
        try:
            return await asyncio.shield(taking)
        except asyncio.CancelledError:  # the ticket may be drawn all the same: end it then
            taking.add_done_callback(_end_drawn_ticket)
            raise

    @_method(CONTROL_GROUP)
    async def restored(self) -> Restored:
        """``(reissue, kept, dropped)`` of a restored or recovered actor's buffer (see HostedBuffer)."""
        self._check_ready()
        return self._restored

    @_method(CONTROL_GROUP)
    async def flush(self, checkpoint_step: int | None) -> None:
        """``ReplayBuffer.flush`` on the home loop (the commit awaited in a worker thread)."""
        self._check_ready()
        await self._await_on_home(self._buffer.flush(checkpoint_step=checkpoint_step))

    @_method(CONTROL_GROUP)
    async def stats(self) -> BufferStats:
        """``ReplayBuffer.stats`` on the home loop."""
        self._check_ready()
        return await self._on_home(self._buffer.stats)

    @_method(CONTROL_GROUP)
    async def close(self) -> None:
        """Close the buffer (waking parked samplers and eviction pollers), its journal's final
        commit awaited in a worker thread."""
        self._check_ready()
        await self._await_on_home(self._aclose())

    async def _aclose(self) -> None:
        try:
            await self._buffer.aclose()
        finally:
            self._ring.notify()

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
        # A put-back refunds a group admission control had admitted, not a new admission: it
        # skips the per-step cap.
        return self._buffer.put_back(group)

    @_method(CONTROL_GROUP)
    async def info(self) -> dict[str, Any]:
        """Facts about the actor: the config, whether closed, counters of the eviction ring, the
        sample requests and the producers parked for admission, and the rollouts watched."""
        self._check_ready()

        def info() -> dict[str, Any]:
            return {
                "config": self._buffer.config,
                "buffer_class": f"{type(self._buffer).__module__}.{type(self._buffer).__qualname__}",
                "closed": self._buffer.closed,
                "eviction_queue_size": self._ring.size,
                "evictions_emitted": self._ring.end,
                "evictions_overflowed": self._ring.overflowed,
                "sample_requests": self._ledger.counts(),
                "admissions": self._admissions.counts(),
                "watched_rollouts": len(self._watches),
            }

        return await self._on_home(info)

    # -- events group -----------------------------------------------------------------

    def _record_eviction(self, event: EvictionEvent) -> None:
        """The buffer's on_evict (home loop, inside ``sample``): append to the ring, never block."""
        self._ring.record(event)

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
        return await self._await_on_home(self._ring.poll(cursor, from_oldest, limit, wait))


def _end_drawn_ticket(taking: asyncio.Future[tuple[BufferCheckpoint, SaveTicket]]) -> None:
    """End the ticket a cancelled save drew, if it drew one (nothing will write it)."""
    if not taking.cancelled() and taking.exception() is None:
        taking.result()[1].end()


def _home_loop() -> asyncio.AbstractEventLoop:
    """The loop ``__init__`` runs on (Ray's default group), else a private loop thread."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # a Ray that runs async actors' __init__ outside their loop
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="stalebuf-home", daemon=True).start()
        return loop


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
