"""What the group store keeps for one partition: its indexes, its failed groups, its counters.

A :class:`PartitionState` only records what happened; it never decides what should happen
(that is the rule book's job), never waits (the consumer and admission own the queues), and
is written only by the group store that owns it.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from operator import attrgetter

from ._index import InFlightIndex, ReadyIndex
from ._open_group import OpenGroup
from ._stored import count_trajectories, stored_trajectories
from .records import Group, Status
from .stats import PartitionStats

__all__ = ["GENERATION_WINDOW", "MEDIAN_AFTER", "PartitionState"]

#: How many generation times of groups that finished uncut in flight a partition keeps, and how
#: many it needs before ``group_deadline_factor`` gives a deadline.
GENERATION_WINDOW, MEDIAN_AFTER = 256, 16

_PENDING, _FINISHED, _FAILURE = Status.PENDING, Status.FINISHED, Status.FAILURE
_status_of = attrgetter("status")


def _in_flight(in_flight: dict[int, dict[str, OpenGroup]], group: OpenGroup) -> bool:
    """Whether ``group`` (by identity) is still in flight in the index ``in_flight``."""
    at_step = in_flight.get(group.dispatch_step)
    return at_step is not None and at_step.get(group.uid) is group


class PartitionState:
    """Everything the group store tracks for one partition.

    ``exempt``, ``evict_failures``, ``evict_in_flight`` and ``cap`` (admission control's
    per-dispatch-step bound ``b``, None without it) are the rule book's answers for this
    partition, asked once when it is created. Under admission control it keeps
    ``resident_at``, the resident groups per dispatch step, which admission reads.
    """

    __slots__ = (
        "_sorted_generation",
        "admitted_groups",
        "admitted_trajectories",
        "cap",
        "cut_groups",
        "cut_trajectories",
        "deadlines",
        "evict_failures",
        "evict_in_flight",
        "evicted_failure_groups",
        "evicted_failure_trajectories",
        "evicted_in_flight_groups",
        "evicted_restart_groups",
        "evicted_restart_trajectories",
        "evicted_stale_groups",
        "evicted_stale_trajectories",
        "exempt",
        "failed",
        "failure",
        "finished",
        "generation",
        "in_flight",
        "name",
        "pending",
        "ready",
        "recent_cuts",
        "reissued_groups",
        "reissued_trajectories",
        "resident_at",
        "running",
        "sampled_groups",
        "sampled_trajectories",
        "starts",
        "trajectories",
    )

    def __init__(
        self,
        name: str,
        *,
        exempt: bool,
        evict_failures: bool,
        evict_in_flight: bool = False,
        cap: int | None = None,
        deadlines: bool = False,
    ) -> None:
        self.name = name
        self.exempt = exempt
        self.evict_failures = evict_failures and not exempt
        self.evict_in_flight = evict_in_flight and not exempt
        self.cap = None if exempt else cap
        self.ready = ReadyIndex()
        self.in_flight = InFlightIndex()
        self.failed: list[tuple[int, int, Group]] = []  # (step, seq, group): failed, to evict
        # Resident groups per dispatch step, kept only under admission control. Every group
        # leaves through _forget or _release, which decrement it: it cannot drift from the truth.
        self.resident_at: dict[int, int] | None = None if self.cap is None else {}
        # Group deadlines (only when the rules give this partition any): the in-flight groups by
        # when their deadline clock started (a lazily cleaned heap), the generation times of the
        # last 256 groups that finished uncut in flight, and the cuts since the last batch.
        self.deadlines = deadlines and not exempt
        self.starts: list[tuple[float, int, OpenGroup]] = []
        self.generation: deque[float] = deque(maxlen=GENERATION_WINDOW)
        # The same times kept sorted: the median in O(1), each new time in O(window) memmove
        # (a sort of the window per finish cost 13 µs while a sample waited).
        self._sorted_generation: list[float] = []
        self.recent_cuts: list[float] = [0, 0, 0.0]  # groups, trajectories, generation seconds
        self.cut_groups = self.cut_trajectories = 0
        self.pending = self.running = self.finished = self.failure = 0
        self.trajectories = 0
        self.admitted_groups = self.admitted_trajectories = 0
        self.sampled_groups = self.sampled_trajectories = 0
        self.evicted_stale_groups = self.evicted_stale_trajectories = 0
        self.evicted_failure_groups = self.evicted_failure_trajectories = 0
        self.evicted_in_flight_groups = 0
        self.evicted_restart_groups = self.evicted_restart_trajectories = 0
        self.reissued_groups = self.reissued_trajectories = 0

    # -- in-flight groups -------------------------------------------------------------

    def admit(self, group: OpenGroup) -> None:
        """Record a new PENDING group."""
        self.pending += 1
        self.admitted_groups += 1
        step = group.dispatch_step
        self.in_flight.add(step, group.uid, group)
        resident_at = self.resident_at
        if resident_at is not None:
            resident_at[step] = resident_at.get(step, 0) + 1

    # -- deadlines ----------------------------------------------------------------------

    def track(self, group: OpenGroup) -> None:
        """Remember when the in-flight ``group``'s deadline clock started (with deadlines)."""
        starts = self.starts
        if len(starts) > 2 * (self.pending + self.running) + 64:
            # Ended groups leave the heap from its top only: behind one group still in flight,
            # they (and their payloads) would stay for as long as its deadline. Dropping them
            # once they outnumber the groups in flight costs O(1) per group, amortised.
            in_flight = self.in_flight.groups
            starts = self.starts = [entry for entry in starts if _in_flight(in_flight, entry[2])]
            heapq.heapify(starts)
        heapq.heappush(starts, (group.started_at, group.seq, group))

    def first_started(self) -> OpenGroup | None:
        """The in-flight group whose deadline clock started first (ended ones are dropped)."""
        starts, in_flight = self.starts, self.in_flight.groups
        while starts:
            group = starts[0][2]
            if _in_flight(in_flight, group):
                return group
            heapq.heappop(starts)
        return None

    def record_generation(self, seconds: float) -> None:
        """Count the generation time of a group that finished uncut, seen in flight."""
        window, ordered = self.generation, self._sorted_generation
        if len(window) == GENERATION_WINDOW:  # the oldest leaves the window
            del ordered[bisect.bisect_left(ordered, window[0])]
        window.append(seconds)
        bisect.insort(ordered, seconds)

    def median_generation(self) -> float | None:
        """The median of the recorded generation times; None before :data:`MEDIAN_AFTER`."""
        times = self._sorted_generation
        if len(times) < MEDIAN_AFTER:
            return None
        middle = len(times) // 2
        return times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2

    def take_recent_cuts(self) -> tuple[int, int, float]:
        """Return the cuts since the last call (groups, trajectories, generation seconds)."""
        groups, trajectories, seconds = self.recent_cuts
        self.recent_cuts = [0, 0, 0.0]
        return int(groups), int(trajectories), seconds

    def start(self) -> None:
        """Record that a PENDING group became RUNNING."""
        self.pending -= 1
        self.running += 1

    def add_trajectories(self, count: int) -> None:
        """Record ``count`` trajectories put into an in-flight group."""
        self.trajectories += count
        self.admitted_trajectories += count

    def terminate(self, group: OpenGroup, record: Group) -> None:
        """Move ``group`` out of flight; ``record`` is its terminal form."""
        if group.status is _PENDING:
            self.pending -= 1
        else:
            self.running -= 1
        step = group.dispatch_step
        self.in_flight.remove(step, group.uid)
        if record.status is _FINISHED:
            self.finished += 1
        else:
            self.failure += 1
            if self.evict_failures:
                self.failed.append((step, group.seq, record))
                return
        self.ready.push(step, group.seq, record)

    def add_terminal(self, group: Group, seq: int) -> None:
        """Record a group that arrives already terminal (``put_group`` of a new group, or a
        restored one): what admit, put and terminate would record, without a detour through
        flight."""
        step = group.dispatch_step
        count = count_trajectories(group)
        self.admitted_groups += 1
        self.admitted_trajectories += count
        self.trajectories += count
        resident_at = self.resident_at
        if resident_at is not None:
            resident_at[step] = resident_at.get(step, 0) + 1
        if group.status is _FINISHED:
            self.finished += 1
        else:
            self.failure += 1
            if self.evict_failures:
                self.failed.append((step, seq, group))
                return
        self.ready.push(step, seq, group)

    def take_stale_in_flight(self, steps: list[int]) -> list[OpenGroup]:
        """Evict and return the in-flight groups of the oldest ``steps`` (the policy chose them)."""
        groups = self.in_flight.pop_steps(steps)
        trajectories = running = 0
        for group in groups:
            trajectories += len(group.trajectories)
            if group.status is not _PENDING:
                running += 1
            self._release(group.dispatch_step)
        self.running -= running
        self.pending -= len(groups) - running
        self.trajectories -= trajectories
        self.evicted_stale_trajectories += trajectories
        self.evicted_stale_groups += len(groups)
        self.evicted_in_flight_groups += len(groups)
        return groups

    # -- terminal groups leaving ------------------------------------------------------

    def _release(self, step: int) -> None:
        """Free a group's admission slot at ``step``."""
        resident_at = self.resident_at
        if resident_at is not None:
            count = resident_at[step] - 1
            if count:
                resident_at[step] = count
            else:
                del resident_at[step]

    def _forget(self, groups: list[Group]) -> int:
        """Drop terminal ``groups`` from the resident counts; return their trajectory count."""
        # C-level loops: this runs for every sampled batch.
        trajectories = sum(map(len, map(stored_trajectories, groups)))
        # No resident failure, none to count: a batch of 64 then skips reading 64 statuses.
        failures = list(map(_status_of, groups)).count(_FAILURE) if self.failure else 0
        if self.resident_at is not None:
            for group in groups:
                self._release(group.dispatch_step)
        self.finished -= len(groups) - failures
        self.failure -= failures
        self.trajectories -= trajectories
        return trajectories

    def take_failed(self) -> list[Group]:
        """Evict and return every failed group awaiting eviction, oldest first."""
        entries = self.failed
        entries.sort(key=lambda entry: entry[:2])
        self.failed = []
        groups = [entry[2] for entry in entries]
        self.evicted_failure_trajectories += self._forget(groups)
        self.evicted_failure_groups += len(groups)
        return groups

    def take_stale(self, steps: list[int]) -> list[Group]:
        """Evict and return the ready groups of the oldest ``steps`` (the policy chose them)."""
        groups = self.ready.pop_steps(steps)
        self.evicted_stale_trajectories += self._forget(groups)
        self.evicted_stale_groups += len(groups)
        return groups

    def take_sampled(self, chosen: list[Group] | None, count: int) -> list[Group]:
        """Remove and return a batch: the ``count`` oldest ready groups when ``chosen`` is None
        (O(count)), else exactly ``chosen`` (O(N)); count them sampled."""
        if chosen is None:
            chosen = self.ready.take_oldest(count)
        else:
            self.ready.take(chosen)
        self.sampled_trajectories += self._forget(chosen)
        self.sampled_groups += len(chosen)
        return chosen

    # -- admission ----------------------------------------------------------------------

    def resident_at_step(self, step: int) -> int:
        """How many resident groups are tagged ``step`` (only under admission control)."""
        return self.resident_at.get(step, 0) if self.resident_at is not None else 0

    def stats(self, waiting_samplers: int, waiting_producers: int, capacity: int | None) -> PartitionStats:
        """Return a snapshot of this partition's counts, with the queue lengths and capacity
        that the consumer and admission own."""
        return PartitionStats(
            pending=self.pending,
            running=self.running,
            finished=self.finished,
            failure=self.failure,
            trajectories=self.trajectories,
            waiting_samplers=waiting_samplers,
            admitted_groups=self.admitted_groups,
            admitted_trajectories=self.admitted_trajectories,
            sampled_groups=self.sampled_groups,
            sampled_trajectories=self.sampled_trajectories,
            evicted_stale_groups=self.evicted_stale_groups,
            evicted_stale_trajectories=self.evicted_stale_trajectories,
            evicted_failure_groups=self.evicted_failure_groups,
            evicted_failure_trajectories=self.evicted_failure_trajectories,
            evicted_in_flight_groups=self.evicted_in_flight_groups,
            evicted_restart_groups=self.evicted_restart_groups,
            evicted_restart_trajectories=self.evicted_restart_trajectories,
            reissued_groups=self.reissued_groups,
            reissued_trajectories=self.reissued_trajectories,
            waiting_producers=waiting_producers,
            cut_groups=self.cut_groups,
            cut_trajectories=self.cut_trajectories,
            capacity=capacity,
        )
