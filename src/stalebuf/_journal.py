"""The journal: a buffer's part that makes every state change durable in an SQLite file.

The store records each change in the :class:`~stalebuf._journal_log.ChangeLog` as it makes it
(O(1)); at most every ``journal_interval`` seconds the loop hands the log, the records of the
groups it names and the rest of the state (all references, no payload copied) to the writer
thread, which encodes and commits them (``_journal_writer.py``). The writer thread is also the
timer: it posts the next hand-off to the loop (asyncio's ``call_soon_threadsafe``, trio's
``run_sync_soon``), so a hand-off never runs in the middle of a buffer call.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import deque
from collections.abc import Callable, Iterable
from itertools import chain
from time import monotonic
from typing import Any

import anyio
import anyio.to_thread
import attrs

from ._admission import Admission
from ._filtering import Filtering
from ._group_snapshots import snapshot
from ._journal_log import LEFT, ChangeLog
from ._journal_writer import Handoff, JournalWriter
from ._mixture import Mixing
from ._open_group import OpenGroup
from ._restore import capture_state
from ._store import GroupStore
from ._stored import stored_payloads
from .errors import BufferClosedError, BufferFullError, CheckpointError
from .records import Group

__all__ = ["Journal", "JournalOptions", "JournalParts"]

logger = logging.getLogger("stalebuf")
_Post = Callable[[Callable[[], object]], object]
_WAIT_SLICE = 0.25  # seconds a worker thread waits for a commit at once


@attrs.frozen
class JournalOptions:
    """The journal arguments of a buffer, checked (see ``ReplayBuffer``)."""

    path: str
    interval: float = 1.0
    retention_steps: int = 4
    max_pending_bytes: int = 256 * 2**20


@attrs.frozen
class JournalParts:
    """The buffer parts a journal reads (it writes none of them)."""

    store: GroupStore
    admission: Admission
    filtering: Filtering
    mixing: Mixing
    policy: str | None


class _RoomWaiter:
    """A producer call parked until the writer catches up (its event is new each round)."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = anyio.Event()


class Journal:
    """Records, hands off and commits; parks producers while the writer is too far behind.

    Attributes (read them):
        log: the change log the store writes to.
        writer: the writer thread.
        options: the journal's arguments.
    """

    __slots__ = ("_closed", "_post", "_waiters", "log", "options", "parts", "writer")

    def __init__(
        self,
        options: JournalOptions,
        parts: JournalParts,
        writer: Callable[[Callable[[], object]], JournalWriter],
        next_gid: int,
        seq: int,
    ) -> None:
        self.options = options
        self.parts = parts
        self.log = ChangeLog(next_gid, seq, self._arm)
        self._waiters: deque[_RoomWaiter] = deque()
        self._post: _Post | None = None
        self._closed = False
        self.writer = writer(self._committed)

    # -- commits ------------------------------------------------------------------------------

    def _arm(self) -> None:
        """The first change since the last hand-off (or since the loop that was to commit it
        ended): have the writer post the next one to this change's loop."""
        loop = _running_loop()
        if loop is None:  # no running loop: committed at the next flush or close, or timed by
            self.log.disarm()  # the next change made on a loop
            return
        self._post, self.log.alive = loop
        # Under journal_interval=0 the calls commit before they return; this tick commits what
        # changed outside them at once (a sample's cut while it waits, say).
        self.writer.request_tick(monotonic() + self.options.interval, self._fire)

    def _fire(self) -> None:
        """In the writer thread, when the interval has passed: post the hand-off to the loop of
        the latest change (an earlier tick may have been asked for from a loop that has ended)."""
        post = self._post
        if post is not None:
            self._posted(post, self._tick)

    def _posted(self, post: _Post, callback: Callable[[], object]) -> None:
        """Run ``callback`` on the loop ``post`` reaches (from the writer thread); a loop that has
        ended takes nothing: the changes wait for the next loop's change, a flush or a close."""
        try:
            post(callback)
        except RuntimeError:  # the loop was closed
            self.log.disarm()

    def _tick(self) -> None:
        """On the loop: the interval has passed since the first change; hand off."""
        if self._closed or self.log.since is None:
            return
        try:
            self.hand_off()
        except Exception:  # (never into the loop: a trio run would crash)
            logger.exception("the stalebuf journal could not commit")

    def hand_off(self) -> int:
        """Give the writer what changed since the last hand-off; return the commit's number.

        Raises:
            CheckpointError: the writer stopped on an error, or was closed.
        """
        dirty, events, since = self.log.take()
        try:
            handoff = self._handoff(dirty, events, since)
        except Exception as exc:  # the log is taken: journaling on would write a wrong state
            self.writer.fail(exc)
            self._release()
            raise CheckpointError(f"the journal {self.options.path!r} stopped: {exc}") from exc
        return self.writer.submit(handoff)

    def _handoff(self, dirty: list[str], events: list[tuple[Any, ...]], since: float | None) -> Handoff:
        """What the writer is given for the changes just taken from the log."""
        log, parts = self.log, self.parts
        store, admission = parts.store, parts.admission
        groups, live, clocks, now = store.groups, log.live, admission.clocks, monotonic()
        items: list[tuple[int, Group]] = []
        for uid in dirty:
            group = groups.get(uid)
            gid = live.get(uid)
            if group is None or gid is None:
                continue
            if type(group) is OpenGroup:
                group = snapshot(group, clocks.get(group.partition, 0), now)
            items.append((gid, group))  # type: ignore[arg-type]
        state = capture_state(store, admission, parts.filtering, parts.mixing, parts.policy)
        estimate = _estimate((group for _, group in items), events)
        return Handoff(items, events, state, log.seq, log.next_gid, since, estimate)

    def settle(self) -> None:
        """With ``journal_interval=0``: commit what the call just changed before it returns
        (blocking the loop for about one fsync).

        Raises:
            CheckpointError: the writer stopped on an error.
        """
        if self.log.since is not None:
            self.writer.wait_committed(self.hand_off())

    def on_sample(self, batch: Any, _metrics: object) -> None:
        """The sample observer: record the sample and the state right after it."""
        # A recovery point needs only the clocks, last sampled steps, masked tokens and mixture
        # ledgers (the latest commit serves the rest): read them raw, the writer builds the state.
        parts = self.parts
        admission, mixing = parts.admission, parts.mixing
        point: list[tuple[str, int, int, Any]] = []
        for name, part in parts.store.partitions.items():
            cells = part.cells
            if cells is None:
                point.append((name, admission.last_sampled(name), part.masked_tokens, None))
                continue
            masked = {task: cell.masked_tokens for task, cell in cells.items()}
            ledger = (mixing.saved(name), masked)
            point.append((name, admission.last_sampled(name), sum(masked.values()), ledger))
        self.log.sampled(batch.partition, batch.global_steps, (dict(admission.clocks), point))
        if self.options.interval == 0:  # the sample returns once its batch is durable
            self.writer.wait_committed(self.hand_off())

    async def flush(self, checkpoint_step: int | None) -> None:
        """Commit now (recording the trainer's mark at ``checkpoint_step``) and wait for it.

        Raises:
            CheckpointError: the writer stopped on an error, or was closed.
        """
        if checkpoint_step is not None:
            self.log.marked(checkpoint_step)
        await self._committed_after(self.hand_off())

    async def _committed_after(self, number: int) -> None:
        """Wait (cancellable) until hand-off ``number`` is committed.

        In a worker thread, a slice at a time: a cancelled wait's thread then ends within a
        slice (under trio it holds a token of anyio's default thread limiter until it ends).

        Raises:
            CheckpointError: the writer stopped on an error, or was closed, first.
        """
        wait = self.writer.wait_committed
        while not await anyio.to_thread.run_sync(wait, number, _WAIT_SLICE, abandon_on_cancel=True):
            pass

    def compact(self) -> None:
        """Commit now, then fold the write-ahead log into the file and truncate it (``save``);
        nothing once closed or stopped (the save's checkpoint is then the one durable copy)."""
        if self._closed or self.writer.error is not None:
            return
        self.writer.request_compaction()
        self.hand_off()

    def close(self) -> None:
        """Commit what is left and stop the writer (blocking; idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.log.since is not None and self.writer.error is None:
                number = self.hand_off()
                # A buffer dropped unclosed is closed by its finalizer wherever the garbage
                # collector runs: on the writer thread, it commits this after the current one.
                if not self.writer.on_thread():
                    self.writer.wait_committed(number)
        except CheckpointError:
            logger.exception("the stalebuf journal could not commit at close")
        finally:
            self.writer.close()
            self._release()

    async def aclose(self) -> None:
        """:meth:`close`, the final commit waited for in a worker thread. Cancelled while it
        waits, the journal closes at once: the writer finishes that commit on its own.

        Raises:
            CheckpointError: the final commit failed (the journal is closed all the same).
        """
        if self._closed:
            return
        number = None
        if self.log.since is not None and self.writer.error is None:
            try:
                number = self.hand_off()
            except CheckpointError:
                logger.exception("the stalebuf journal could not commit at close")
        try:
            if number is not None:
                await self._committed_after(number)
        except anyio.get_cancelled_exc_class():
            self._closed = True
            self.writer.close(join=False)
            self._release()
            raise
        finally:
            self.close()

    # -- backpressure -------------------------------------------------------------------------

    def _over(self) -> bool:
        return self.writer.pending_bytes > self.options.max_pending_bytes

    def check_room(self) -> None:
        """Raise unless a producer may change the buffer now without waiting for the writer.

        Raises:
            BufferFullError: the writer's queue holds more than ``journal_max_pending_bytes``.
            CheckpointError: the writer stopped on an error (nothing would be journaled any more:
                the change is refused rather than made with no loss window bound).
        """
        self._raise_if_broken()
        if self._over():
            raise BufferFullError(
                f"the journal's writer is behind: {self.writer.pending_bytes} bytes wait to be "
                f"committed (journal_max_pending_bytes={self.options.max_pending_bytes})"
            )

    async def wait_room(self) -> None:
        """Wait (FIFO, cancellable) until a producer may change the buffer.

        Raises:
            BufferClosedError: the buffer was closed meanwhile.
            CheckpointError: the writer stopped on an error.
        """
        self._raise_if_broken()
        if not self._waiters and not self._over():
            return
        loop = _running_loop()
        if loop is not None:
            self._post = loop[0]
        waiter = _RoomWaiter()
        self._waiters.append(waiter)
        try:
            while self._waiters[0] is not waiter or self._over():
                await waiter.event.wait()
                waiter.event = anyio.Event()
                if self._closed:
                    raise BufferClosedError("the buffer is closed")
                self._raise_if_broken()
        finally:
            self._waiters.remove(waiter)
            self._release()  # pass the turn on (or the wake-up, if this call was cancelled)

    def _raise_if_broken(self) -> None:
        error = self.writer.error
        if error is not None:
            raise CheckpointError(f"the journal {self.options.path!r} stopped: {error}") from error

    def _committed(self) -> None:
        """In the writer thread, after each commit: wake the first parked producer if room."""
        post = self._post
        if self._waiters and post is not None:
            self._posted(post, self._release)

    def _release(self) -> None:
        """On the loop: wake the head producer if it may go on (or every one, once closed)."""
        waiters = self._waiters
        if not waiters:
            return
        if self._closed or self.writer.error is not None:
            for waiter in waiters:
                waiter.event.set()
        elif not self._over():
            waiters[0].event.set()

    # -- metrics ------------------------------------------------------------------------------

    def stats(self) -> tuple[int, int, int, float]:
        """Commits, bytes on disk, bytes pending and the age of the oldest uncommitted change."""
        writer = self.writer
        oldest = [t for t in (self.log.since, writer.oldest_pending()) if t is not None]
        lag = monotonic() - min(oldest) if oldest else 0.0
        return writer.commits, writer.size(), max(writer.pending_bytes, 0), lag


def _running_loop() -> tuple[_Post, Callable[[], bool]] | None:
    """How to run a callback on the running event loop from another thread, and whether that
    loop still runs (asked on the loop's thread); None if no loop runs.

    Asked directly (not through anyio, which finds no loop in a plain loop callback such as the
    thread handle's calls, and costs tens of µs): asyncio's running loop, else trio's token.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return loop.call_soon_threadsafe, loop.is_running
    trio = sys.modules.get("trio")  # (never imported for this: a trio loop has imported it)
    if trio is None:
        return None
    current = trio.lowlevel.current_trio_token
    try:
        token = current()
    except RuntimeError:
        return None

    def alive() -> bool:
        try:
            return current() is token
        except RuntimeError:
            return False

    return token.run_sync_soon, alive


def _estimate(groups: Iterable[Group], events: list[tuple[Any, ...]]) -> int:
    """The estimated encoded size of a hand-off: its payloads' sizes, plus a row's overhead."""
    removals = [event for event in events if event[0] == LEFT]
    records = [r for event in removals if event[4] is not None for r in event[4] if r is not None]
    written = [*groups, *records]
    # 64 bytes a row (a removal event stands for one row per group it names), 128 a record.
    total = 64 * (len(events) - len(removals) + sum(len(event[2]) for event in removals))
    total += 128 * len(written)
    # All payloads in one list, counted by C-level passes (a lazily stored group's records are
    # not built): this runs on the loop, for every group a commit writes.
    payloads = list(chain.from_iterable(map(stored_payloads, written)))
    if _SIZED_BY_LEN.issuperset(map(type, payloads)):  # the common case
        return total + sum(map(len, payloads))
    return total + sum(map(_payload_size, payloads))


#: Payload types whose ``len`` is their size (as ``_payload_size`` counts them).
_SIZED_BY_LEN = frozenset((bytes, bytearray, str))


def _payload_size(payload: Any) -> int:
    if type(payload) in _SIZED_BY_LEN:
        return len(payload)
    if type(payload) is memoryview:
        return payload.nbytes
    try:
        return sys.getsizeof(payload)
    except Exception:  # a payload's own __sizeof__ raised: it is an estimate anyway
        return 64
