"""The journal's writer thread: encodes what the event loop handed off and commits it to SQLite,
one transaction per hand-off; deletes history the retention no longer needs; doubles as the
timer that asks the loop for the next hand-off.

Only this thread touches the database once the journal runs; the loop only appends to the
queue (under the condition's lock) and reads the counters below (ints and floats, read whole).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import repeat
from time import monotonic
from typing import Any

import attrs

from ._journal_format import StateCodec, size_on_disk, write_key
from ._journal_log import ADMIT, LEFT, MARK, SAMPLE
from .checkpoint import BufferCheckpoint, MixtureCheckpoint, PartitionCheckpoint, TaskCheckpoint
from .errors import CheckpointError
from .records import Group

__all__ = ["Handoff", "JournalWriter"]

logger = logging.getLogger("stalebuf")
#: The longest the thread waits at once for a tick (it then waits again): ``threading`` refuses
#: timeouts beyond ``TIMEOUT_MAX`` (OverflowError), and ``journal_interval`` may be any finite number.
_MAX_WAIT = 3600.0


@attrs.frozen
class Handoff:
    """What the loop hands the writer at a commit (see ``Journal.hand_off``).

    Attributes:
        items: ``(gid, record)`` of every resident group changed since the last hand-off.
        events: the change log's events, in order.
        state: the buffer's state but its groups, now.
        seq: the number of the last event; next_gid: the next gid.
        since: when its oldest change was made (monotonic), or None.
        estimate: its estimated encoded size in bytes (backpressure counts it until committed).
    """

    items: list[tuple[int, Group]]
    events: list[tuple[Any, ...]]
    state: BufferCheckpoint
    seq: int
    next_gid: int
    since: float | None
    estimate: int


class JournalWriter:
    """One thread that commits hand-offs in order.

    Attributes (read them from any thread):
        commits: hand-offs committed.
        committed: the number of the last committed hand-off (they are numbered from 1).
        pending_bytes: estimated encoded bytes handed off and not yet committed.
        error: the error that stopped the writer, if any (every later wait raises it).
        path: the database file.
    """

    def __init__(
        self,
        connection: sqlite3.Connection,
        path: str,
        codec: StateCodec,
        retention_steps: int,
        history: tuple[list[tuple[int, int]], list[tuple[int, int]]],
        on_commit: Callable[[], object],
    ) -> None:
        self.path = path
        self._absolute = os.path.abspath(path)  # measured there, whatever the directory is then
        self.commits = 0
        self.committed = 0
        self.pending_bytes = 0
        self.error: BaseException | None = None
        self._connection = connection
        self._codec = codec
        self._retention = retention_steps
        self._samples, self._marks = history  # (seq, step) still in the file, oldest first
        self._on_commit = on_commit
        self._queue: deque[tuple[int, Handoff]] = deque()
        self._submitted = 0
        self._oldest: deque[tuple[int, float]] = deque()  # (number, since) of uncommitted ones
        self._tick: tuple[float, Callable[[], object]] | None = None
        self._closing = False
        self._compact = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="stalebuf-journal", daemon=True)
        self._thread.start()

    # -- the loop's side ---------------------------------------------------------------------

    def submit(self, handoff: Handoff) -> int:
        """Queue ``handoff`` for the next commit; return its number.

        Raises:
            CheckpointError: the writer stopped on an error (or was closed).
        """
        with self._condition:
            self._raise_if_broken()
            self._submitted += 1
            number = self._submitted
            self._queue.append((number, handoff))
            self.pending_bytes += handoff.estimate
            if handoff.since is not None:
                self._oldest.append((number, handoff.since))
            self._condition.notify_all()
            return number

    def request_tick(self, at: float, callback: Callable[[], object]) -> None:
        """Call ``callback`` in the writer thread once ``monotonic()`` reaches ``at`` (one pending
        request at a time: the earlier wins)."""
        with self._condition:
            if self._tick is None or at < self._tick[0]:
                self._tick = (at, callback)
                self._condition.notify_all()

    def request_compaction(self) -> None:
        """After the next commit, fold the write-ahead log back into the file and truncate it."""
        with self._condition:
            self._compact = True

    def fail(self, error: BaseException) -> None:
        """Stop on ``error``, raised on the loop's side: what is queued is committed, nothing
        more is taken (every later submit and wait raises it)."""
        with self._condition:
            if self.error is None:
                self.error = error
            self._closing = True
            self._condition.notify_all()

    def wait_committed(self, number: int, timeout: float | None = None) -> bool:
        """Block until hand-off ``number`` is committed; False if ``timeout`` passed first.

        Raises:
            CheckpointError: the writer stopped on an error before committing it.
        """
        deadline = None if timeout is None else monotonic() + timeout
        with self._condition:
            while self.committed < number:
                self._raise_if_broken()
                remaining = None if deadline is None else deadline - monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._condition.wait(remaining)
            return True

    def on_thread(self) -> bool:
        """Whether the caller is the writer thread itself."""
        return threading.current_thread() is self._thread

    def oldest_pending(self) -> float | None:
        """When the oldest change handed off and not yet committed was made (monotonic), or None."""
        with self._condition:
            return self._oldest[0][1] if self._oldest else None

    def size(self) -> int:
        """The journal's bytes on disk now."""
        return size_on_disk(self._absolute)

    def close(self, *, join: bool = True) -> None:
        """Commit what is queued, stop the thread and close the database (idempotent); without
        ``join``, return at once (the thread does it on its own)."""
        with self._condition:
            self._closing = True
            self._condition.notify_all()
        if join and self._thread is not threading.current_thread():
            self._thread.join()

    def _raise_if_broken(self) -> None:
        error = self.error
        if error is not None:
            raise CheckpointError(f"the journal {self.path!r} stopped: {error}") from error
        if self._closing:
            raise CheckpointError(f"the journal {self.path!r} is closed")

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                job, tick = self._next()
                if tick is not None:
                    tick()
                if job is None:
                    if tick is None:
                        return
                    continue
                number, handoff = job
                self._commit(handoff)
                with self._condition:
                    compact, self._compact = self._compact, False
                    self._queue.popleft()
                    self.committed = number
                    self.commits += 1
                    self.pending_bytes -= handoff.estimate
                    while self._oldest and self._oldest[0][0] <= number:
                        self._oldest.popleft()
                    self._condition.notify_all()
                self._on_commit()
                if compact:  # (a reader may keep part of the log: SQLite then truncates less)
                    self._connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except BaseException as exc:  # a disk error, an encode that failed: journaling stops
            logger.exception("the stalebuf journal %r stopped", self.path)
            with self._condition:
                self.error = exc
                self._condition.notify_all()
            self._on_commit()
        finally:
            self._connection.close()

    def _next(self) -> tuple[tuple[int, Handoff] | None, Callable[[], object] | None]:
        """Wait for the next hand-off or tick; (None, None) once closing with nothing queued."""
        with self._condition:
            while True:
                tick = self._tick
                if tick is not None and tick[0] <= monotonic():
                    self._tick = None
                    return (self._queue[0] if self._queue else None), tick[1]
                if self._queue:
                    return self._queue[0], None
                if self._closing:
                    return None, None
                # (capped: a huge journal_interval would be more than a thread can wait)
                self._condition.wait(
                    None if tick is None else min(max(0.0, tick[0] - monotonic()), _MAX_WAIT)
                )

    def _commit(self, handoff: Handoff) -> None:
        """Encode ``handoff`` and write it in one transaction.

        What this commit's pruning deletes is never written: a group admitted and gone before
        the oldest sample kept, a sample or mark already out of the retention. Each record is
        encoded as SQLite asks for its row (``executemany`` over a generator), so a hand-off's
        encoded payloads are never all in memory at once, and the GIL is released between rows
        (SQLite runs without it): the event loop never waits for a whole hand-off's pickling.
        """
        events = handoff.events
        prune = self._plan_prune(events)
        horizon = prune.horizon
        admitted: dict[int, tuple[Any, ...]] = {}  # gid -> its ADMIT row, in admission order
        gone: list[tuple[int, int, str, Group | None]] = []  # (seq, gid, reason, record or None)
        samples, marks = [], []
        for event in events:
            kind = event[0]
            if kind == ADMIT:
                _, seq, gid, uid, partition = event
                admitted[gid] = (gid, uid, partition, seq)
            elif kind == LEFT:
                _, first, gids, reason, records = event
                gone.extend(
                    zip(range(first, first + len(gids)), gids, repeat(reason), records or repeat(None))
                )
            elif kind == SAMPLE:
                samples.append(event)
            elif kind == MARK:
                marks.append(event)
        # A group that left before the horizon leaves no row: never inserted if admitted in this
        # hand-off, deleted if an earlier commit wrote it (its record is not encoded either way).
        doomed = [gid for seq, gid, _, _ in gone if seq < horizon and admitted.pop(gid, None) is None]
        self._write(handoff, admitted, gone, samples, marks, doomed, prune)
        self._connection.execute("PRAGMA incremental_vacuum")

    def _write(
        self,
        handoff: Handoff,
        admitted: dict[int, tuple[Any, ...]],
        gone: list[tuple[int, int, str, Group | None]],
        samples: list[tuple[Any, ...]],
        marks: list[tuple[Any, ...]],
        doomed: list[int],
        prune: _Prune,
    ) -> None:
        """The transaction of one commit (see :meth:`_commit`)."""
        codec, connection, horizon = self._codec, self._connection, prune.horizon
        executemany = connection.executemany
        state = codec.state(handoff.state)
        connection.execute("BEGIN IMMEDIATE")
        try:
            executemany(
                "INSERT INTO groups (gid, uid, partition, admitted) VALUES (?, ?, ?, ?)", admitted.values()
            )
            executemany(
                "INSERT OR REPLACE INTO removals (gid, removed, reason) VALUES (?, ?, ?)",
                ((gid, seq, reason) for seq, gid, reason, _ in gone if seq >= horizon),
            )
            executemany(  # the content of a group that left before the journal wrote it
                "UPDATE groups SET record = ? WHERE gid = ?",
                (
                    (codec.group(record), gid)
                    for seq, gid, _, record in gone
                    if record is not None and seq >= horizon
                ),
            )
            executemany("DELETE FROM groups WHERE gid = ?", ((gid,) for gid in doomed))
            executemany(
                "UPDATE groups SET record = ? WHERE gid = ?",
                ((codec.group(group), gid) for gid, group in handoff.items),
            )
            executemany(
                "INSERT INTO samples (seq, partition, step, state) VALUES (?, ?, ?, ?)",
                (
                    (seq, partition, str(step), codec.state(point_state(handoff.state, sample_state)))
                    for _, seq, partition, step, sample_state in samples
                    if seq not in prune.samples
                ),
            )
            executemany(
                "INSERT INTO marks (seq, step, wall) VALUES (?, ?, ?)",
                ((seq, str(step), time.time()) for _, seq, step in marks if seq not in prune.marks),
            )
            write_key(connection, "state", state)
            write_key(connection, "seq", handoff.seq)
            write_key(connection, "next_gid", handoff.next_gid)
            connection.execute(
                "INSERT OR REPLACE INTO commits (seq, wall) VALUES (?, ?)", (handoff.seq, time.time())
            )
            self._prune(prune)
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise

    def _plan_prune(self, events: list[tuple[Any, ...]]) -> _Prune:
        """Take this hand-off's samples and marks into the history; return what the retention no
        longer needs (samples more than the retention behind the newest one, unless at or after
        the mark before the newest; the marks older than them but the two newest) and the horizon: the groups
        that left before the oldest sample kept (all that left, while there is none) go."""
        samples, marks = self._samples, self._marks
        samples.extend((event[1], event[3]) for event in events if event[0] == SAMPLE)
        marks.extend((event[1], event[2]) for event in events if event[0] == MARK)
        doomed: set[int] = set()
        stale: set[int] = set()
        if samples:
            cutoff = max(step for _, step in samples) - self._retention
            if marks:  # back to the mark before the newest: a trainer that marks before its own
                cutoff = min(cutoff, marks[-min(2, len(marks))][1])  # save may resume there
            doomed = {seq for seq, step in samples if step < cutoff}
            if doomed:
                samples[:] = [(seq, step) for seq, step in samples if step >= cutoff]
                stale = {seq for seq, step in marks[:-2] if step < cutoff}
                marks[:] = [mark for mark in marks if mark[0] not in stale]
        return _Prune(doomed, stale, samples[0][0] if samples else None)

    def _prune(self, prune: _Prune) -> None:
        """Delete what :meth:`_plan_prune` found the history no longer needs."""
        executemany, execute = self._connection.executemany, self._connection.execute
        executemany("DELETE FROM samples WHERE seq = ?", ((seq,) for seq in sorted(prune.samples)))
        executemany("DELETE FROM marks WHERE seq = ?", ((seq,) for seq in sorted(prune.marks)))
        if prune.oldest is None:
            execute("DELETE FROM groups WHERE gid IN (SELECT gid FROM removals)")
            execute("DELETE FROM removals")
            return
        oldest = (prune.oldest,)
        execute("DELETE FROM groups WHERE gid IN (SELECT gid FROM removals WHERE removed < ?)", oldest)
        execute("DELETE FROM removals WHERE removed < ?", oldest)
        execute("DELETE FROM commits WHERE seq < ? AND seq < (SELECT MAX(seq) FROM commits)", (prune.oldest,))


@attrs.frozen
class _Prune:
    """What a commit deletes: ``samples`` and ``marks`` (their event numbers) and every group
    that left before event ``oldest`` (the oldest sample kept; None: every group that left)."""

    samples: set[int]
    marks: set[int]
    oldest: int | None

    @property
    def horizon(self) -> float:
        """Groups that left at an event before this are deleted."""
        return float("inf") if self.oldest is None else self.oldest


#: What a sample's observer takes on the loop: the clocks, and per partition its name, last
#: sampled step, masked tokens and, under a task mixture, its ledger and each task's masked tokens.
RawPoint = tuple[dict[str, int], list[tuple[str, int, int, Any]]]


def point_state(latest: BufferCheckpoint, raw: RawPoint) -> BufferCheckpoint:
    """The state a recovery point keeps (``raw``, built into a checkpoint off the loop): what a
    recovery takes from the point, with ``latest``'s config and policy; the other counters and
    the remembered evictions are the latest commit's."""
    clocks, parts = raw
    partitions = []
    for name, last_sampled, masked, mixed in parts:
        mixture = None
        if mixed is not None:
            (balances, growth, shares, batch_size), cells = mixed
            tasks = tuple(
                TaskCheckpoint(task, {"masked_tokens": cell}, (), balances[task], growth[task])
                for task, cell in cells.items()
            )
            mixture = MixtureCheckpoint(tasks, shares, batch_size)
        partitions.append(PartitionCheckpoint(name, last_sampled, {"masked_tokens": masked}, (), mixture))
    return BufferCheckpoint(
        latest.format_version, latest.config, latest.policy, (), tuple(partitions), clocks, ()
    )
