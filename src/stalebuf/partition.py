"""The per-partition index: what the buffer knows about one partition, kept so that every
question ``sample`` asks costs O(1) or O(log N) instead of a scan.

- ``ready``: a min-heap of sampleable terminal groups keyed by ``(dispatch step, admission
  seq)``, i.e. oldest first with FIFO ties. Both drop eviction (stale groups are a prefix of
  that order) and selection (oldest first) pop from its front.
- ``failed``: failed groups waiting for eviction under ``failure_strategy="evict"``.
- ``in_flight``: a count of PENDING/RUNNING groups per dispatch step, plus a lazily
  cleaned min-heap of those steps, so the wait gate reads the oldest in-flight step in
  O(1) amortised.
- ``waiters``: blocked ``sample`` calls in arrival order; only the head may take groups.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .records import Group, Status, Trajectory
from .stats import PartitionStats

if TYPE_CHECKING:
    import anyio

__all__ = ["OpenGroup", "PartitionIndex", "Waiter"]

# (dispatch step, admission seq, group): tuples order by step, then FIFO; seq is unique,
# so comparison never reaches the group.
ReadyEntry = tuple[int, int, Group]


class OpenGroup:
    """A PENDING or RUNNING group: the only mutable group state the buffer keeps."""

    __slots__ = ("global_steps", "partition", "seq", "status", "tags", "trajectories", "uid")

    def __init__(
        self, uid: str, partition: PartitionIndex, global_steps: int, seq: int, tags: Mapping[str, Any]
    ) -> None:
        self.uid = uid
        self.partition = partition
        self.global_steps = global_steps
        self.seq = seq
        self.status = Status.PENDING
        self.tags = tags
        # Keyed by trajectory key: keeps put order and detects duplicates in one structure.
        self.trajectories: dict[str, Trajectory] = {}


class Waiter:
    """One blocked ``sample`` call. Woken by setting ``event``; it re-checks on its own."""

    __slots__ = ("batch_size", "event", "global_steps")

    def __init__(self, global_steps: int, batch_size: int, event: anyio.Event) -> None:
        self.global_steps = global_steps
        self.batch_size = batch_size
        self.event = event


class PartitionIndex:
    """Everything the buffer tracks for one partition."""

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
        "in_flight_steps",
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
        self.ready: list[ReadyEntry] = []
        self.failed: list[ReadyEntry] = []
        self.in_flight: dict[int, int] = {}
        self.in_flight_steps: list[int] = []
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
        count = self.in_flight.get(step)
        if count is None:
            self.in_flight[step] = 1
            heapq.heappush(self.in_flight_steps, step)
        else:
            self.in_flight[step] = count + 1

    def start(self) -> None:
        """Record that a PENDING group became RUNNING."""
        self.pending -= 1
        self.running += 1

    def add_trajectory(self) -> None:
        """Record one more trajectory held by an in-flight group."""
        self.trajectories += 1
        self.admitted_trajectories += 1

    def oldest_in_flight(self) -> int | None:
        """Return the smallest dispatch step among PENDING/RUNNING groups, or None."""
        steps = self.in_flight_steps
        while steps and steps[0] not in self.in_flight:
            heapq.heappop(steps)  # a step whose last in-flight group ended
        return steps[0] if steps else None

    def terminate(self, group: OpenGroup, record: Group) -> None:
        """Move ``group`` out of flight; ``record`` is its terminal form."""
        if group.status is Status.PENDING:
            self.pending -= 1
        else:
            self.running -= 1
        step = group.global_steps
        count = self.in_flight[step] - 1
        if count:
            self.in_flight[step] = count
        else:
            del self.in_flight[step]  # its heap entry is dropped lazily
        entry = (step, group.seq, record)
        if record.status is Status.FINISHED:
            self.finished += 1
            heapq.heappush(self.ready, entry)
        else:
            self.failure += 1
            if self.evict_failures:
                self.failed.append(entry)
            else:
                heapq.heappush(self.ready, entry)

    # -- terminal groups --------------------------------------------------------------

    def _forget(self, group: Group) -> int:
        if group.status is Status.FINISHED:
            self.finished -= 1
        else:
            self.failure -= 1
        n = len(group.trajectories)
        self.trajectories -= n
        return n

    def take_failed(self) -> list[Group]:
        """Evict and return every failed group awaiting eviction, oldest first."""
        entries = self.failed
        entries.sort()
        self.failed = []
        groups = [entry[2] for entry in entries]
        for group in groups:
            self.evicted_failure_trajectories += self._forget(group)
        self.evicted_failure_groups += len(groups)
        return groups

    def take_stale(self, is_stale: Callable[[int], bool]) -> list[Group]:
        """Evict and return the oldest ready groups while ``is_stale(dispatch_step)`` holds."""
        ready = self.ready
        groups: list[Group] = []
        while ready and is_stale(ready[0][0]):
            group = heapq.heappop(ready)[2]
            self.evicted_stale_trajectories += self._forget(group)
            groups.append(group)
        self.evicted_stale_groups += len(groups)
        return groups

    def take_oldest(self, count: int) -> list[Group]:
        """Remove and return the ``count`` oldest ready groups (the caller checked there are)."""
        ready = self.ready
        pop = heapq.heappop
        groups = [pop(ready)[2] for _ in range(count)]
        self._count_sampled(groups)
        return groups

    def take(self, chosen: list[Group]) -> None:
        """Remove the given ready groups (any subset, any order); O(N) rebuild of the heap."""
        ids = {id(group) for group in chosen}
        self.ready = [entry for entry in self.ready if id(entry[2]) not in ids]
        heapq.heapify(self.ready)
        self._count_sampled(chosen)

    def _count_sampled(self, groups: list[Group]) -> None:
        for group in groups:
            self.sampled_trajectories += self._forget(group)
        self.sampled_groups += len(groups)

    def iter_ready(self) -> Iterator[Group]:
        """Yield ready groups oldest first, lazily: O(k log k) for the first k.

        The heap must not change while the iterator is in use.
        """
        heap = self.ready
        if not heap:
            return
        size = len(heap)
        frontier: list[tuple[ReadyEntry, int]] = [(heap[0], 0)]
        while frontier:
            entry, i = heapq.heappop(frontier)
            yield entry[2]
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))

    def count_ready_while(self, is_stale: Callable[[int], bool]) -> int:
        """Return how many ready groups, oldest first, satisfy ``is_stale`` before one does not."""
        count = 0
        for group in self.iter_ready():
            if not is_stale(group.global_steps):
                break
            count += 1
        return count

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
