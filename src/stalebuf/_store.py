"""The group store: every resident group; through its parts, every partition's indexes and
counters and the memory of groups ended in flight. Only its methods write any of them: the
other parts read its attributes. A method that may fail checks first and changes after."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from operator import attrgetter
from time import monotonic
from types import MappingProxyType
from typing import Any

from ._evicted_uids import CUT_REASON, EVICTED_UIDS_REMEMBERED, FILTERED_REASON, EvictedUids
from ._group_snapshots import CUT_TAG, snapshot
from ._journal_log import ChangeLog
from ._judged_index import JudgedEntry
from ._lazy_group import LazyGroup
from ._open_group import OpenGroup
from ._partition import PartitionState
from ._partition_table import PartitionTable
from ._rules import Rules
from ._validation import describe
from ._versions import VersionSpan
from ._waiting import LoopBinding
from .errors import DuplicateTrajectoryError, InvalidTransitionError
from .records import (
    DEFAULT_KEY_SESSIONS,
    DEFAULT_KEY_SUFFIXES,
    Group,
    Status,
    Trajectory,
    default_keys,
    new_trajectory,
    pack_runs,
)

__all__ = ["CUT_REASON", "CUT_TAG", "EVICTED_UIDS_REMEMBERED", "FILTERED_REASON", "GroupStore"]


_PENDING, _RUNNING, _FINISHED = Status.PENDING, Status.RUNNING, Status.FINISHED
_tuple_new = tuple.__new__
_uid_of = attrgetter("uid")
#: Runs an iterator to its end in C: unregistering a batch of 64 groups costs no Python loop.
_consume = deque[object](maxlen=0).extend


class GroupStore:
    """Groups by uid (in admission order), partitions by name, and what was evicted in flight.

    Attributes (read them; change them only through the methods):
        groups: every resident group, in flight (:class:`OpenGroup`) or terminal (a record).
        partitions: every partition used so far.
        evicted_in_flight: uids of groups the buffer ended in flight, with why
            (:class:`~stalebuf._evicted_uids.EvictedUids`).
        table: the partitions' owner (:class:`~stalebuf._partition_table.PartitionTable`).
        next_seq: the admission sequence number of the next group (it orders FIFO ties).
        closed: whether the buffer was closed.
        rules, binding: the buffer's rule book and loop binding (parts the store only reads).
    """

    __slots__ = ("binding", "closed", "evicted_in_flight", "groups", "log", "next_seq", "partitions",
                 "rules", "table")  # fmt: skip

    def __init__(self, rules: Rules, binding: LoopBinding) -> None:
        self.rules = rules
        self.binding = binding  # the loop the buffer is bound to (its own part; read, not written)
        self.groups: dict[str, OpenGroup | Group] = {}
        self.table = PartitionTable(rules)
        self.partitions = self.table.partitions  # read here; the table adds to it
        self.evicted_in_flight = EvictedUids()
        self.next_seq = 0
        self.closed = False
        self.log: ChangeLog | None = None  # the journal's, once one records this buffer

    def journal_to(self, log: ChangeLog) -> None:
        """Tell ``log`` every change from now on (see ``_journal_log``)."""
        self.log = log

    # -- lookups --------------------------------------------------------------------------
    def partition(self, name: str) -> PartitionState:
        """Return partition ``name``, created if new (see :meth:`PartitionTable.partition`)."""
        return self.table.partition(name)

    def cell(self, name: str, tags: Mapping[str, Any]) -> PartitionState:
        """Where a new group lands (see :meth:`PartitionTable.cell`; raises what it raises)."""
        return self.table.cell(name, tags)

    def cell_of(self, group: OpenGroup | Group) -> PartitionState:
        """The partition (or task cell) that holds ``group``."""
        return self.table.cell_of(group)

    def open_group(self, uid: object, action: str) -> OpenGroup:
        """Return the in-flight group ``uid`` or raise the error a write to it deserves.

        Raises:
            What :meth:`EvictedUids.refused <stalebuf._evicted_uids.EvictedUids.refused>` returns.
        """
        group = self.groups.get(uid) if type(uid) is str else None
        if type(group) is OpenGroup:
            return group
        raise self.evicted_in_flight.refused(uid, group, action)

    def watch(self, uid: object, callback: Callable[[], object]) -> OpenGroup:
        """Add ``callback`` to the watchers of the in-flight group ``uid``; return that group.

        Raises:
            The errors of :meth:`open_group`.
        """
        group = self.open_group(uid, "watch")
        if group.watchers is None:
            group.watchers = []
        group.watchers.append(callback)
        return group

    def in_flight(self) -> Iterator[OpenGroup]:
        """Every group still in flight, in admission order."""
        return (group for group in self.groups.values() if type(group) is OpenGroup)

    # -- producers ----------------------------------------------------------------------

    def admit(self, uid: str, step: int, part: PartitionState, tags: Mapping[str, Any]) -> OpenGroup:
        """Register a new PENDING group (its arguments were checked, its slot granted)."""
        seq = self.next_seq
        self.next_seq = seq + 1
        group = self.groups[uid] = OpenGroup(uid, part.name, step, seq, tags, monotonic())
        group.task = part.task
        part.admit(group)
        if part.deadlines:
            part.track(group)
        self.evicted_in_flight.forget(uid)  # a new group: forget the old eviction
        if self.log is not None:
            self.log.admitted(uid, group.partition)
        return group

    def start(self, uid: object, version: int | None = None) -> PartitionState:
        """Move the group ``uid`` from PENDING to RUNNING; ``version`` (checked): its new start
        version (None keeps the one it has). Return its partition (or task cell).

        Raises:
            The errors of :meth:`open_group`; InvalidTransitionError if it is running already.
        """
        group = self.groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:
            group = self.open_group(uid, "mark running")
        if group.status is not _PENDING:
            raise InvalidTransitionError(f"cannot mark group {describe(uid)} running: it is already running")
        group.status = _RUNNING
        if self.log is not None:
            self.log.changed(group.uid)
        part = self.partitions[group.partition]
        if part.cells is not None:
            part = part.cells[group.task]  # type: ignore[index]
        part.start()
        if version is not None:
            self.set_start_version(group, version)
        return part

    def set_start_version(self, group: OpenGroup, version: int) -> None:
        """Set the in-flight ``group``'s start version (checked); its head may move."""
        group.start_version = version
        if self.log is not None:
            self.log.changed(group.uid)
        head = group.head_now()
        if head != group.head:
            self.cell_of(group).move(group, head)

    def put(
        self,
        uid: object,
        payload: Any,
        session_id: int,
        index: int,
        tags: Mapping[str, Any],
        segments: tuple[tuple[int, int], ...] = (),
        tokens: int = 0,
    ) -> str:
        """Add one trajectory to the in-flight group ``uid`` (checked ``segments`` and ``tokens``,
        as :func:`~stalebuf._versions.trajectory_versions` returns them); return its key.

        Raises:
            The errors of :meth:`open_group`; DuplicateTrajectoryError for a key it holds;
            ValueError if ``tokens`` would take the group past ``max_tokens_per_group``.
        """
        group = self.groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:
            group = self.open_group(uid, "put into")
        uid = group.uid
        if index or session_id >= DEFAULT_KEY_SESSIONS:
            key = f"{uid}_{session_id}_{index}"
        else:  # the common key, without formatting two ints
            key = uid + DEFAULT_KEY_SUFFIXES[session_id]
        trajectories = group.trajectories
        if key in trajectories:
            raise DuplicateTrajectoryError(
                f"group {describe(uid)} already holds session_id={session_id}, index={index} "
                f"({describe(key)})"
            )
        part = self.partitions[group.partition]
        if part.cells is not None:  # a task mixture: the group's task's cell
            part = part.cells[group.task]  # type: ignore[index]
        ledger, span = part.ledger, group.span  # max_tokens_per_group, before any change
        if tokens and ledger is not None and tokens + (span.tokens if span else 0) > ledger.per_group:
            ledger.check_put(uid, span.tokens if span else 0, tokens)
        trajectories[key] = _tuple_new(
            Trajectory,
            (
                key,
                session_id,
                index,
                tags,
                payload,
                segments,
                tokens,
                pack_runs(segments) if segments else b"",
            ),
        )
        if self.log is not None:
            self.log.changed(uid)
        part.trajectories += 1  # PartitionState.add_trajectories(1), inlined: runs per put
        part.admitted_trajectories += 1
        if tokens or group.span is not None:
            self._count_versions(group, part, ((segments, tokens),))
        return key

    @staticmethod
    def _count_versions(
        group: OpenGroup, part: PartitionState, added: Collection[tuple[tuple[tuple[int, int], ...], int]]
    ) -> None:
        """Count the versions and tokens of trajectories just put into ``group`` (once one had
        tokens, every later one: a trajectory without versions counts at the start version);
        move its head."""
        span = group.span
        if span is None:
            span = group.span = VersionSpan()
            span.plain = len(group.trajectories) - len(added)  # the ones put without versions
        tokens = 0
        for segments, count in added:
            span.add(segments, count)
            tokens += count
        part.tokens += tokens
        part.admitted_tokens += tokens
        head = span.head(group.start_version)
        if head != group.head:
            part.move(group, head)

    def end(
        self,
        group: OpenGroup,
        status: Status,
        clock: int,
        measured: bool = True,
        record: Group | None = None,
        seconds: float | None = None,
    ) -> PartitionState:
        """Make the in-flight ``group`` terminal with ``status``; return its partition. ``clock``:
        the partition's dispatch clock (the finish step, not before the dispatch step); ``measured``:
        seen in flight, so a FINISHED one counts for the median generation time; ``record``: its
        ``terminal_record`` if made already, else one of ``generation_seconds`` ``seconds``."""
        part = self.partitions[group.partition]
        if part.cells is not None:
            part = part.cells[group.task]  # type: ignore[index]
        if part.deadlines and measured and status is _FINISHED:
            part.record_generation(monotonic() - group.admitted_at)
        if record is None:
            step = group.dispatch_step
            record = _tuple_new(  # terminal_record, without the call: this runs per group
                Group,
                (
                    group.uid,
                    group.partition,
                    step,
                    status,
                    group.tags,
                    tuple(group.trajectories.values()),
                    clock if clock > step else step,
                    monotonic() - group.admitted_at if seconds is None else seconds,
                    group.start_version,
                ),
            )
        self.groups[group.uid] = record
        if self.log is not None:
            self.log.changed(group.uid)
        part.terminate(group, record)
        return part

    def filter_out(self, group: OpenGroup, measured: bool = False) -> PartitionState:
        """Evict the in-flight ``group``, which a filter rejected as it finished; remember
        why, so its producer's next write raises GroupEvictedError; return its partition.
        ``measured`` as for :meth:`end` (it finished uncut: its time counts for the median)."""
        part = self.cell_of(group)
        if part.deadlines and measured:
            part.record_generation(monotonic() - group.admitted_at)
        part.filter_out(group)
        del self.groups[group.uid]
        if self.log is not None:  # its record, for a recovery's ``kept`` (it was dispatched)
            self.log.left((snapshot(group, group.dispatch_step, monotonic()),), "filtered")
        self.remember_evicted(group.uid, FILTERED_REASON)
        group.ending = "filtered"
        return part

    def add_filtered(self, part: PartitionState, record: Group) -> None:
        """Count a group written FINISHED in one call that a filter rejected (never resident)."""
        part.add_filtered(record)
        self.remember_evicted(record.uid, FILTERED_REASON)
        if self.log is not None:  # admitted and filtered at once: a recovery lists it in ``kept``
            self.log.filtered_at_once(record)

    def fill(self, group: OpenGroup, rows: Collection[tuple[Any, ...]]) -> None:
        """Add checked trajectory ``rows`` (``new_trajectory`` arguments, keys not yet held)."""
        group.trajectories.update((row[0], new_trajectory(*row)) for row in rows)
        if self.log is not None:
            self.log.changed(group.uid)
        part = self.cell_of(group)
        part.add_trajectories(len(rows))
        added = [(row[5], row[6]) if len(row) > 5 else ((), 0) for row in rows]
        if group.span is not None or any(tokens for _, tokens in added):
            self._count_versions(group, part, added)

    def add_finished(
        self,
        part: PartitionState,
        uid: str,
        step: int,
        clock: int,
        payloads: tuple[Any, ...],
        tags: Mapping[str, Any],
        start_version: int | None = None,
        record: Group | None = None,
        seconds: float = 0.0,
    ) -> list[str]:
        """Add a new FINISHED group of default keys, stored lazily, straight to the ready index;
        return its keys. ``record``: its ``finished_record`` if made already; ``seconds``: its
        ``generation_seconds`` (the producer's measure; 0.0 when none was given)."""
        if record is None:
            record = _tuple_new(  # finished_record, without the call: this runs per group
                LazyGroup,
                (
                    uid,
                    part.name,
                    step,
                    _FINISHED,
                    tags,
                    payloads,
                    clock if clock > step else step,
                    seconds,
                    step if start_version is None else start_version,
                ),
            )
        seq = self.next_seq
        self.next_seq = seq + 1
        self.groups[uid] = record
        if self.log is not None:
            self.log.admitted(uid, part.name)
        part.add_terminal(record, seq)
        return default_keys(uid, len(payloads))

    # -- groups leaving -------------------------------------------------------------------

    def take_batch(self, part: PartitionState, chosen: list[Group] | None, count: int) -> list[Group]:
        """Remove and return a batch: ``chosen``, or the ``count`` oldest if None; counted sampled."""
        return self._remove(part.take_sampled(chosen, count), "sampled")

    def evict_failed(self, part: PartitionState) -> list[Group]:
        """Remove and return every failed group awaiting eviction, oldest first."""
        return self._remove(part.take_failed(), "failure")

    def evict_stale(self, part: PartitionState, steps: list[int], judged: list[JudgedEntry]) -> list[Group]:
        """Remove and return the ready groups of the oldest ``steps``, or the ``judged`` entries
        (the rules chose them)."""
        return self._remove(part.take_stale(steps, judged), "stale")

    def _remove(self, groups: list[Group], reason: str) -> list[Group]:
        """Drop the records ``groups`` (which left for ``reason``) from the groups; return them."""
        if self.log is None:
            _consume(map(self.groups.__delitem__, map(_uid_of, groups)))
        else:  # the log needs the uids too: read them once
            uids = list(map(_uid_of, groups))
            _consume(map(self.groups.__delitem__, uids))
            self.log.left(groups, reason, uids)
        return groups

    def evict_stale_in_flight(self, part: PartitionState, steps: list[int], clock: int) -> list[Group]:
        """Remove the in-flight groups of the oldest ``steps``, remember their uids, tell their
        watchers; return their records (finish step ``clock``, the evicting sample's)."""
        now = monotonic()
        records = []
        for group in part.take_stale_in_flight(steps):
            records.append(snapshot(group, clock, now))
            del self.groups[group.uid]
            self.remember_evicted(group.uid, None)
            group.notify_watchers("evicted")
        if self.log is not None:
            self.log.left(records, "in_flight")
        return records

    def cut(
        self, group: OpenGroup, status: Status, clock: int, deadline: float, record: Group | None = None
    ) -> None:
        """End the in-flight ``group``, past its ``deadline`` (seconds), with ``status`` and the
        tag ``stalebuf_cut``; remember it, so its producer's next write raises GroupCutError, and
        tell its watchers (a ``rollout()`` body is cancelled). ``record``: its record from
        :func:`~stalebuf._group_snapshots.cut_record`, if made already."""
        part, count, seconds = self.cell_of(group), len(group.trajectories), group.admitted_at
        group.tags = MappingProxyType({**group.tags, CUT_TAG: True})
        self.end(group, status, clock, measured=False, record=record)
        part.count_cut(count, monotonic() - seconds)
        self.remember_evicted(group.uid, f"{CUT_REASON}{deadline:.6g} s")
        evicted = status is not _FINISHED and part.evict_failures
        group.notify_watchers("cut-evicted" if evicted else "cut")

    def cut_filtered(self, group: OpenGroup, deadline: float) -> None:
        """Cut the in-flight ``group`` as FINISHED, which a filter then rejected: counted cut,
        evicted as filtered; its producer's next write raises GroupCutError."""
        part, count, seconds = self.cell_of(group), len(group.trajectories), group.admitted_at
        self.filter_out(group)
        reason = f"{CUT_REASON}{deadline:.6g} s (then filtered)"
        part.count_cut(count, monotonic() - seconds)
        self.remember_evicted(group.uid, reason)
        group.notify_watchers("cut-evicted")

    @staticmethod
    def count_masked(part: PartitionState, tokens: int) -> None:
        """Count ``tokens`` sampled tokens of ``part`` that the ``mask`` strategy masked."""
        part.count_masked(tokens)

    @staticmethod
    def take_recent_cuts(part: PartitionState) -> tuple[int, int, float]:
        """Return ``part``'s cuts since the last call: groups, trajectories, generation seconds."""
        return part.take_recent_cuts()

    def remember_evicted(self, uid: str, reason: str | None) -> None:
        """Remember that ``uid`` was evicted in flight (``reason`` None: as stale), boundedly."""
        self.evicted_in_flight.remember(uid, reason)

    def close(self) -> None:
        """Mark the store closed and tell every in-flight group's watchers."""
        self.closed = True
        for group in list(self.in_flight()):
            group.notify_watchers("closed")

    # -- checkpoints ------------------------------------------------------------------------

    def restore_terminal(self, part: PartitionState, group: Group, seq: int) -> None:
        """Put back a terminal ``group`` at position ``seq`` in ``part`` (its :meth:`cell_of`)."""
        self.groups[group.uid] = group
        part.add_terminal(group, seq)

    def restore_in_flight(
        self, part: PartitionState, group: Group, seq: int, *, prefix: bool, running: bool
    ) -> None:
        """Put back an in-flight ``group`` at position ``seq`` in ``part`` (its cell): with its
        trajectories and start version if ``prefix`` (else PENDING with none), RUNNING if it was and
        ``running``. Its deadline clock starts now: an outage must not cut a group early."""
        now = monotonic()
        state = self.groups[group.uid] = OpenGroup(
            group.uid, part.name, group.dispatch_step, seq, group.tags, now - group.generation_seconds, now
        )
        state.task = part.task
        part.admit(state)
        if part.deadlines:
            part.track(state)
        if running and group.status is _RUNNING:
            state.status = _RUNNING
            part.start()
        if prefix:
            self.set_start_version(state, group.start_version)
            state.trajectories = {trajectory.key: trajectory for trajectory in group.trajectories}
            part.add_trajectories(len(group.trajectories))
            added = [(t.versions, t.tokens) for t in group.trajectories]
            if any(tokens for _, tokens in added):
                self._count_versions(state, part, added)

    def restore_counters(
        self, part: PartitionState, counters: Mapping[str, int], reissued: tuple[int, int, int]
    ) -> None:
        """Set ``part``'s cumulative counters to the saved ones, plus ``reissued`` (groups,
        trajectories, tokens) that a restore reissued (their partial trajectories discarded)."""
        part.restore_counters(counters, reissued)

    def restore_sequence(
        self, next_seq: int, evicted_in_flight: tuple[str, ...], reasons: tuple[str | None, ...]
    ) -> None:
        """Set the admission sequence and the remembered in-flight evictions of a restore, with
        their reasons (``()``: all None, as older files hold)."""
        self.next_seq = next_seq
        self.evicted_in_flight.restore(evicted_in_flight, reasons)

    @staticmethod
    def restore_generation(part: PartitionState, times: tuple[float, ...]) -> None:
        """Put back ``part``'s measured generation times (the median ``group_deadline_factor``
        needs survives a restart: a dead server after it must still be cut)."""
        for seconds in times:
            part.record_generation(seconds)

    def count_restarted(self, groups: list[Group]) -> None:
        """Count in-flight ``groups`` a restore evicted (never put back), each in its cell; remember them."""
        for group in groups:  # a producer that survived the restart learns why on its next write
            self.cell_of(group).count_restarted([group])
            self.remember_evicted(group.uid, "restart")
