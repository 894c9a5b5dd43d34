"""What the buffer keeps for one partition: its indexes, its failed groups and its counters.

A :class:`PartitionState` only records what happened; it never decides what should happen
(that is the policy's job) and never waits (that is the waiting room's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._index import InFlightIndex, ReadyIndex
from .records import Group, Status, Trajectory
from .stats import PartitionStats

if TYPE_CHECKING:
    from ._waiting import Waiter

__all__ = ["OpenGroup", "PartitionState"]

_PENDING, _FINISHED, _FAILURE = Status.PENDING, Status.FINISHED, Status.FAILURE


class OpenGroup:
    """A PENDING or RUNNING group: the only mutable group state the buffer keeps."""

    __slots__ = ("dispatch_step", "partition", "seq", "status", "tags", "trajectories", "uid")

    def __init__(
        self, uid: str, partition: PartitionState, dispatch_step: int, seq: int, tags: Mapping[str, Any]
    ) -> None:
        self.uid = uid
        self.partition = partition
        self.dispatch_step = dispatch_step
        self.seq = seq
        self.status = _PENDING
        self.tags = tags
        # Keyed by trajectory key: keeps put order and detects duplicates in one structure.
        self.trajectories: dict[str, Trajectory] = {}

    @property
    def global_steps(self) -> int:
        """The dispatch step, under the name :class:`~stalebuf.Group` also answers to."""
        return self.dispatch_step


class PartitionState:
    """Everything the buffer tracks for one partition.

    ``exempt`` and ``evict_failures`` are the policy's answers for this partition, asked
    once when the partition is created. ``waiters`` are the blocked ``sample`` calls in
    arrival order; only the head may take groups.
    """

    __slots__ = (
        "admitted_groups",
        "admitted_trajectories",
        "evict_failures",
        "evicted_failure_groups",
        "evicted_failure_trajectories",
        "evicted_stale_groups",
        "evicted_stale_trajectories",
        "exempt",
        "failed",
        "failure",
        "finished",
        "in_flight",
        "name",
        "pending",
        "ready",
        "running",
        "sampled_groups",
        "sampled_trajectories",
        "trajectories",
        "waiters",
    )

    def __init__(self, name: str, *, exempt: bool, evict_failures: bool) -> None:
        self.name = name
        self.exempt = exempt
        self.evict_failures = evict_failures and not exempt
        self.ready = ReadyIndex()
        self.in_flight = InFlightIndex()
        self.failed: list[tuple[int, int, Group]] = []  # (step, seq, group): failed, to evict
        self.waiters: deque[Waiter] = deque()
        self.pending = self.running = self.finished = self.failure = 0
        self.trajectories = 0
        self.admitted_groups = self.admitted_trajectories = 0
        self.sampled_groups = self.sampled_trajectories = 0
        self.evicted_stale_groups = self.evicted_stale_trajectories = 0
        self.evicted_failure_groups = self.evicted_failure_trajectories = 0

    # -- in-flight groups -------------------------------------------------------------

    def admit(self, step: int) -> None:
        """Record a new PENDING group dispatched at ``step``."""
        self.pending += 1
        self.admitted_groups += 1
        self.in_flight.add(step)

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
        self.in_flight.remove(step)
        if record.status is _FINISHED:
            self.finished += 1
        else:
            self.failure += 1
            if self.evict_failures:
                self.failed.append((step, group.seq, record))
                return
        self.ready.push(step, group.seq, record)

    # -- terminal groups leaving ------------------------------------------------------

    def _forget(self, groups: list[Group]) -> int:
        """Drop ``groups`` from the resident counts; return their trajectory count."""
        trajectories = failures = 0
        for group in groups:
            trajectories += len(group.trajectories)
            if group.status is _FAILURE:
                failures += 1
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

    def stats(self) -> PartitionStats:
        """Return a snapshot of this partition's counts."""
        return PartitionStats(
            pending=self.pending,
            running=self.running,
            finished=self.finished,
            failure=self.failure,
            trajectories=self.trajectories,
            waiting_samplers=len(self.waiters),
            admitted_groups=self.admitted_groups,
            admitted_trajectories=self.admitted_trajectories,
            sampled_groups=self.sampled_groups,
            sampled_trajectories=self.sampled_trajectories,
            evicted_stale_groups=self.evicted_stale_groups,
            evicted_stale_trajectories=self.evicted_stale_trajectories,
            evicted_failure_groups=self.evicted_failure_groups,
            evicted_failure_trajectories=self.evicted_failure_trajectories,
        )
