"""The group store: every resident group, every partition's indexes and counters, and the
memory of groups evicted in flight. It is the only code that writes any of them.

Admission, the consumer and the buffer's facade read the store (its attributes are public to
read) and change it only through its methods. Each method that may fail checks first and
changes after, so a refused call leaves the store as it was.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Mapping
from operator import attrgetter
from time import monotonic
from types import MappingProxyType
from typing import Any

from ._lazy_group import LazyGroup
from ._open_group import OpenGroup
from ._partition import PartitionState
from ._rules import Rules
from ._stored import count_trajectories
from ._validation import describe
from ._waiting import LoopBinding
from .errors import (
    DuplicateTrajectoryError,
    GroupCutError,
    GroupEvictedError,
    InvalidTransitionError,
    UnknownGroupError,
)
from .records import (
    DEFAULT_KEY_SESSIONS,
    DEFAULT_KEY_SUFFIXES,
    Group,
    Status,
    Trajectory,
    default_keys,
    new_group,
    new_trajectory,
)

__all__ = ["CUT_REASON", "CUT_TAG", "EVICTED_UIDS_REMEMBERED", "GroupStore"]

#: The group tag every group cut at its deadline carries (True), finished or failed.
CUT_TAG = "stalebuf_cut"
#: How a remembered reason for a cut starts (the deadline in seconds follows).
CUT_REASON = "cut at its deadline of "

#: How many uids of groups evicted in flight the buffer remembers (most recent first), so that a
#: producer's late call on one raises GroupEvictedError rather than UnknownGroupError.
EVICTED_UIDS_REMEMBERED = 65_536

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
        evicted_in_flight: uids of groups the buffer ended in flight, most recent last: None
            for evicted as stale, else the reason ("restart", or "cut at its deadline of ...").
        next_seq: the admission sequence number of the next group (it orders FIFO ties).
        closed: whether the buffer was closed.
        rules, binding: the buffer's rule book and loop binding (parts the store only reads).
    """

    __slots__ = ("binding", "closed", "evicted_in_flight", "groups", "next_seq", "partitions", "rules")

    def __init__(self, rules: Rules, binding: LoopBinding) -> None:
        self.rules = rules
        self.binding = binding  # the loop the buffer is bound to (its own part; read, not written)
        self.groups: dict[str, OpenGroup | Group] = {}
        self.partitions: dict[str, PartitionState] = {}
        self.evicted_in_flight: OrderedDict[str, str | None] = OrderedDict()
        self.next_seq = 0
        self.closed = False

    # -- lookups ------------------------------------------------------------------------

    def partition(self, name: str) -> PartitionState:
        """Return partition ``name``, creating it (asking the rules its settings) if new.

        Raises:
            Exception: whatever a policy hook raised (nothing is created then).
        """
        part = self.partitions.get(name)
        if part is None:
            exempt, evict_failures, evict_in_flight, cap, deadlines = self.rules.settings(name)
            part = PartitionState(
                name,
                exempt=exempt,
                evict_failures=evict_failures,
                evict_in_flight=evict_in_flight,
                cap=cap,
                deadlines=deadlines,
            )
            self.partitions[name] = part
        return part

    def open_group(self, uid: object, action: str) -> OpenGroup:
        """Return the in-flight group ``uid`` or raise the error a write to it deserves.

        Raises:
            TypeError: ``uid`` is not a str.
            GroupCutError: it was cut at its deadline (and not added again since).
            GroupEvictedError: it was evicted in flight (and not added again since).
            UnknownGroupError: no such group.
            InvalidTransitionError: it is terminal (a late write).
        """
        group = self.groups.get(uid) if type(uid) is str else None
        if type(group) is OpenGroup:
            return group
        if type(uid) is not str:
            raise TypeError(f"uid must be a str, got {type(uid).__name__}")
        reason = self.evicted_in_flight.get(uid, "") if self.evicted_in_flight else ""
        if reason and reason.startswith("cut"):  # the cut group, resident or gone, not a new one
            raise GroupCutError(f"group {describe(uid)} was {reason} while in flight: stop generating")
        if group is None:
            if reason != "":
                how = "as stale" if reason is None else "by a restart"
                raise GroupEvictedError(
                    f"group {describe(uid)} was evicted {how} while in flight: stop generating"
                )
            raise UnknownGroupError(
                f"no group {describe(uid)} in the buffer (never added, or already sampled or evicted)"
            )
        raise InvalidTransitionError(
            f"cannot {action} group {describe(uid)}: it is already {group.status.value} (a late write)"
        )

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
        part.admit(group)
        if part.deadlines:
            part.track(group)
        if self.evicted_in_flight:
            self.evicted_in_flight.pop(uid, None)  # a new group: forget the old eviction
        return group

    def start(self, uid: object) -> None:
        """Move the group ``uid`` from PENDING to RUNNING.

        Raises:
            The errors of :meth:`open_group`; InvalidTransitionError if it is running already.
        """
        group = self.groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:
            group = self.open_group(uid, "mark running")
        if group.status is not _PENDING:
            raise InvalidTransitionError(f"cannot mark group {describe(uid)} running: it is already running")
        group.status = _RUNNING
        self.partitions[group.partition].start()

    def put(self, uid: object, payload: Any, session_id: int, index: int, tags: Mapping[str, Any]) -> str:
        """Add one trajectory to the in-flight group ``uid`` (checked arguments); return its key.

        Raises:
            The errors of :meth:`open_group`; DuplicateTrajectoryError for a key it holds.
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
        trajectories[key] = _tuple_new(Trajectory, (key, session_id, index, tags, payload))
        part = self.partitions[group.partition]
        part.trajectories += 1  # PartitionState.add_trajectories(1), inlined: runs per put
        part.admitted_trajectories += 1
        return key

    def end(
        self,
        group: OpenGroup,
        status: Status,
        clock: int,
        measured: bool = True,
        seconds: float | None = None,
    ) -> PartitionState:
        """Make the in-flight ``group`` terminal with ``status``; return its partition.
        ``clock`` is the partition's dispatch clock (the record's finish step, not before
        its dispatch step); ``measured``: the buffer saw it in flight (not a whole group written
        in one call), so a FINISHED one counts towards the median generation time (always the
        time the buffer measured: deadlines run on its clock); ``seconds``: the record's
        ``generation_seconds`` as its producer measured it (None: from admission to now)."""
        part = self.partitions[group.partition]
        step = group.dispatch_step
        if part.deadlines and measured and status is _FINISHED:
            part.record_generation(monotonic() - group.admitted_at)
        record = _tuple_new(  # records.new_group, without the call
            Group,
            (
                group.uid,
                part.name,
                step,
                status,
                group.tags,
                tuple(group.trajectories.values()),
                clock if clock > step else step,
                monotonic() - group.admitted_at if seconds is None else seconds,
            ),
        )
        self.groups[group.uid] = record
        part.terminate(group, record)
        return part

    def fill(self, group: OpenGroup, rows: Collection[tuple[Any, ...]]) -> None:
        """Add checked trajectory ``rows`` (``new_trajectory`` arguments, keys not yet held)."""
        group.trajectories.update((row[0], new_trajectory(*row)) for row in rows)
        self.partitions[group.partition].add_trajectories(len(rows))

    def add_finished(
        self,
        part: PartitionState,
        uid: str,
        step: int,
        clock: int,
        payloads: tuple[Any, ...],
        tags: Mapping[str, Any],
        seconds: float = 0.0,
    ) -> list[str]:
        """Add a new FINISHED group of default keys, stored lazily (its records are built when
        first read), straight to the ready index; return its keys. ``seconds`` is its
        ``generation_seconds`` (its producer's measure; 0.0: never in flight here, none given)."""
        record = _tuple_new(  # _lazy_group.new_lazy_group, without the call
            LazyGroup,
            (uid, part.name, step, _FINISHED, tags, payloads, clock if clock > step else step, seconds),
        )
        seq = self.next_seq
        self.next_seq = seq + 1
        self.groups[uid] = record
        part.add_terminal(record, seq)
        return default_keys(uid, len(payloads))

    # -- groups leaving -------------------------------------------------------------------

    def take_batch(self, part: PartitionState, chosen: list[Group] | None, count: int) -> list[Group]:
        """Remove and return a batch: ``chosen``, or the ``count`` oldest if None; counted sampled."""
        groups = part.take_sampled(chosen, count)
        _consume(map(self.groups.__delitem__, map(_uid_of, groups)))
        return groups

    def evict_failed(self, part: PartitionState) -> list[Group]:
        """Remove and return every failed group awaiting eviction, oldest first."""
        groups = part.take_failed()
        _consume(map(self.groups.__delitem__, map(_uid_of, groups)))
        return groups

    def evict_stale(self, part: PartitionState, steps: list[int]) -> list[Group]:
        """Remove and return the ready groups of the oldest ``steps`` (the rules chose them)."""
        groups = part.take_stale(steps)
        _consume(map(self.groups.__delitem__, map(_uid_of, groups)))
        return groups

    def evict_stale_in_flight(self, part: PartitionState, steps: list[int], clock: int) -> list[Group]:
        """Remove the in-flight groups of the oldest ``steps``, remember their uids, tell their
        watchers; return their records (finish step ``clock``, the evicting sample's)."""
        now = monotonic()
        records = []
        for group in part.take_stale_in_flight(steps):
            records.append(self.snapshot(group, clock, now))
            del self.groups[group.uid]
            self.remember_evicted(group.uid, None)
            group.notify_watchers("evicted")
        return records

    def cut(self, group: OpenGroup, status: Status, clock: int, deadline: float) -> None:
        """End the in-flight ``group``, past its ``deadline`` (seconds), with ``status`` and the
        tag ``stalebuf_cut``; remember it, so its producer's next write raises GroupCutError, and
        tell its watchers (a ``rollout()`` body is cancelled)."""
        part = self.partitions[group.partition]
        seconds = monotonic() - group.admitted_at
        count = len(group.trajectories)
        group.tags = MappingProxyType({**group.tags, CUT_TAG: True})
        self.end(group, status, clock, measured=False)
        part.cut_groups += 1
        part.cut_trajectories += count
        recent = part.recent_cuts
        recent[0], recent[1], recent[2] = recent[0] + 1, recent[1] + count, recent[2] + seconds
        self.remember_evicted(group.uid, f"{CUT_REASON}{deadline:.6g} s")
        evicted = status is not _FINISHED and part.evict_failures
        group.notify_watchers("cut-evicted" if evicted else "cut")

    @staticmethod
    def take_recent_cuts(part: PartitionState) -> tuple[int, int, float]:
        """Return ``part``'s cuts since the last call: groups, trajectories, generation seconds."""
        return part.take_recent_cuts()

    def remember_evicted(self, uid: str, reason: str | None) -> None:
        """Remember that ``uid`` was evicted in flight (``reason`` None: as stale), boundedly."""
        remembered = self.evicted_in_flight
        remembered[uid] = reason
        if len(remembered) > EVICTED_UIDS_REMEMBERED:
            remembered.popitem(last=False)

    def close(self) -> None:
        """Mark the store closed and tell every in-flight group's watchers."""
        self.closed = True
        for group in list(self.in_flight()):
            group.notify_watchers("closed")

    # -- checkpoints ------------------------------------------------------------------------

    @staticmethod
    def snapshot(group: OpenGroup, clock: int, now: float) -> Group:
        """Return the record of the in-flight ``group`` as it is at ``now`` (its status kept)."""
        return new_group(
            group.uid,
            group.partition,
            group.dispatch_step,
            group.status,
            group.tags,
            tuple(group.trajectories.values()),
            max(clock, group.dispatch_step),
            now - group.admitted_at,
        )

    def restore_terminal(self, part: PartitionState, group: Group, seq: int) -> None:
        """Put back a terminal ``group`` at admission position ``seq`` (a restore)."""
        self.groups[group.uid] = group
        part.add_terminal(group, seq)

    def restore_in_flight(self, part: PartitionState, group: Group, seq: int, keep: bool) -> None:
        """Put back an in-flight ``group`` at position ``seq``: exactly (``keep``), or as
        PENDING with no trajectories (to be generated again). Its deadline clock starts now: an
        outage must not cut a group before its producer could go on with it."""
        now = monotonic()
        state = OpenGroup(
            group.uid, part.name, group.dispatch_step, seq, group.tags, now - group.generation_seconds, now
        )
        self.groups[group.uid] = state
        part.admit(state)
        if part.deadlines:
            part.track(state)
        if keep:
            if group.status is _RUNNING:
                state.status = _RUNNING
                part.start()
            state.trajectories = {trajectory.key: trajectory for trajectory in group.trajectories}
            part.add_trajectories(len(group.trajectories))

    def restore_counters(
        self, part: PartitionState, counters: Mapping[str, int], reissued: tuple[int, int]
    ) -> None:
        """Set ``part``'s cumulative counters to the saved ones, plus ``reissued`` (groups,
        trajectories) that a restore reissued."""
        for key, value in counters.items():
            setattr(part, key, value)
        part.reissued_groups += reissued[0]
        part.reissued_trajectories += reissued[1]

    def restore_sequence(
        self, next_seq: int, evicted_in_flight: tuple[str, ...], reasons: tuple[str | None, ...]
    ) -> None:
        """Set the admission sequence and the remembered in-flight evictions of a restore, with
        their reasons (``()``: all None, as older files hold)."""
        self.next_seq = next_seq
        if reasons:
            self.evicted_in_flight = OrderedDict(zip(evicted_in_flight, reasons, strict=True))
        else:
            self.evicted_in_flight = OrderedDict.fromkeys(evicted_in_flight)

    @staticmethod
    def restore_generation(part: PartitionState, times: tuple[float, ...]) -> None:
        """Put back ``part``'s measured generation times (the median ``group_deadline_factor``
        needs survives a restart: a dead server after it must still be cut)."""
        for seconds in times:
            part.record_generation(seconds)

    def count_restarted(self, part: PartitionState, groups: list[Group]) -> None:
        """Count in-flight ``groups`` a restore evicted (never put back) and remember them."""
        part.evicted_restart_groups += len(groups)
        part.evicted_restart_trajectories += sum(map(count_trajectories, groups))
        for group in groups:  # a producer that survived the restart learns why on its next write
            self.remember_evicted(group.uid, "restart")
