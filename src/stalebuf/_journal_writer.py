"""The journal's writer thread: encodes what the event loop handed off and commits it to SQLite,
one transaction per hand-off; deletes history the retention no longer needs; doubles as the
timer that asks the loop for the next hand-off.

Only this thread touches the database once the journal runs; the loop only appends to the
queue (under the condition's lock) and reads the counters below (ints and floats, read whole).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from time import monotonic
from typing import Any

import attrs

from ._journal_format import StateCodec, size_on_disk, write_key
from ._journal_log import ADMIT, LEFT, MARK, SAMPLE
from .checkpoint import BufferCheckpoint
from .errors import CheckpointError
from .records import Group

__all__ = ["Handoff", "JournalWriter"]

logger = logging.getLogger("stalebuf")


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

    def oldest_pending(self) -> float | None:
        """When the oldest change handed off and not yet committed was made (monotonic), or None."""
        with self._condition:
            return self._oldest[0][1] if self._oldest else None

    def size(self) -> int:
        """The journal's bytes on disk now."""
        return size_on_disk(self.path)

    def close(self) -> None:
        """Commit what is queued, stop the thread and close the database (idempotent)."""
        with self._condition:
            self._closing = True
            self._condition.notify_all()
        if self._thread is not threading.current_thread():
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
                self._condition.wait(None if tick is None else max(0.0, tick[0] - monotonic()))

    def _commit(self, handoff: Handoff) -> None:
        """Encode ``handoff`` and write it in one transaction (the encoding first, outside it)."""
        codec = self._codec
        blobs = [(codec.group(group), gid) for gid, group in handoff.items]
        events = [
            (kind, *rest, codec.group(rest[-1]) if kind == LEFT and rest[-1] is not None else None)
            if kind == LEFT
            else (kind, *rest[:-1], codec.state(rest[-1]))
            if kind == SAMPLE
            else (kind, *rest)
            for kind, *rest in handoff.events
        ]
        state = codec.state(handoff.state)
        connection = self._connection
        connection.execute("BEGIN IMMEDIATE")
        try:
            self._write_events(events)
            connection.executemany("UPDATE groups SET record = ? WHERE gid = ?", blobs)
            write_key(connection, "state", state)
            write_key(connection, "seq", handoff.seq)
            write_key(connection, "next_gid", handoff.next_gid)
            connection.execute(
                "INSERT OR REPLACE INTO commits (seq, wall) VALUES (?, ?)", (handoff.seq, time.time())
            )
            self._prune()
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("PRAGMA incremental_vacuum")

    def _write_events(self, events: list[tuple[Any, ...]]) -> None:
        execute = self._connection.execute
        for event in events:
            kind = event[0]
            if kind == ADMIT:
                _, seq, gid, uid, partition = event
                execute(
                    "INSERT INTO groups (gid, uid, partition, admitted) VALUES (?, ?, ?, ?)",
                    (gid, uid, partition, seq),
                )
            elif kind == LEFT:
                _, seq, gid, reason, _record, blob = event
                execute(
                    "UPDATE groups SET removed = ?, reason = ?, record = COALESCE(?, record) WHERE gid = ?",
                    (seq, reason, blob, gid),
                )
            elif kind == SAMPLE:
                _, seq, partition, step, state = event
                execute(
                    "INSERT INTO samples (seq, partition, step, state) VALUES (?, ?, ?, ?)",
                    (seq, partition, str(step), state),
                )
                self._samples.append((seq, step))
            elif kind == MARK:
                _, seq, step = event
                execute("INSERT INTO marks (seq, step, wall) VALUES (?, ?, ?)", (seq, str(step), time.time()))
                self._marks.append((seq, step))

    def _prune(self) -> None:
        """Delete the history no recovery point needs any more: samples more than the retention
        behind the newest one (unless at or after the newest mark), and the groups that left
        before the oldest sample kept (all that left, while there is none)."""
        samples, marks = self._samples, self._marks
        execute = self._connection.execute
        if samples:
            cutoff = max(step for _, step in samples) - self._retention
            if marks:
                cutoff = min(cutoff, marks[-1][1])
            doomed = [seq for seq, step in samples if step < cutoff]
            if doomed:
                execute(f"DELETE FROM samples WHERE seq IN ({','.join('?' * len(doomed))})", doomed)
                samples[:] = [(seq, step) for seq, step in samples if step >= cutoff]
                stale = {seq for seq, step in marks[:-1] if step < cutoff}
                if stale:
                    execute(f"DELETE FROM marks WHERE seq IN ({','.join('?' * len(stale))})", sorted(stale))
                    marks[:] = [mark for mark in marks if mark[0] not in stale]
        if not samples:
            execute("DELETE FROM groups WHERE removed IS NOT NULL")
            return
        oldest = samples[0][0]
        execute("DELETE FROM groups WHERE removed IS NOT NULL AND removed < ?", (oldest,))
        execute("DELETE FROM commits WHERE seq < ? AND seq < (SELECT MAX(seq) FROM commits)", (oldest,))
