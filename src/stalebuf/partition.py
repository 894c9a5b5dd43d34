"""The per-partition index: what the buffer knows about one partition, kept so that every
question ``sample`` asks costs O(1) or O(log N) instead of a scan.

- ``ready``: sampleable terminal groups in per-dispatch-step buckets, each in admission
  order, plus a min-heap of those steps. Steps in order, then buckets front to back, yield the
  groups oldest first with FIFO ties. Drop eviction removes whole buckets from the front
  (stale groups are a prefix of that order) and selection takes groups off the front, so both
  cost O(k + b log S) for k groups spanning b of S steps, whatever the number resident. (One
  heap of all groups did it in O(k log N), but its cache misses made a 1e6-group sample 3-5x
  slower than a 1e3-group one.)
- ``failed``: failed groups waiting for eviction under ``failure_strategy="evict"``.
- ``in_flight``: a count of PENDING/RUNNING groups per dispatch step, plus a lazily
  cleaned min-heap of those steps, so the wait gate reads the oldest in-flight step in
  O(1) amortised.
- ``waiters``: blocked ``sample`` calls in arrival order; only the head may take groups.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

from .records import Group, Status, Trajectory
from .stats import PartitionStats

if TYPE_CHECKING:
    import asyncio

    from anyio.abc import AsyncBackend

__all__ = ["EventWaiter", "FutureWaiter", "OpenGroup", "PartitionIndex", "Waiter"]

# (admission seq, group): seq is unique, so comparing entries never reaches the group.
Entry = tuple[int, Group]
# What a taken slot holds until the bucket is compacted: not the group, so it can be freed.
_SPENT = cast(Entry, (-1, None))


class Bucket:
    """The ready groups of one dispatch step, in admission order, taken from the front.

    Taking advances ``head`` instead of shifting the list (a bucket may hold a million
    groups); taken slots are cleared at once so sampled groups are not kept alive, and the
    list is compacted once half of it is spent.
    """

    __slots__ = ("entries", "head")

    def __init__(self, seq: int, group: Group) -> None:
        self.entries: list[Entry] = [(seq, group)]
        self.head = 0

    def __len__(self) -> int:
        return len(self.entries) - self.head

    def add(self, seq: int, group: Group) -> None:
        """Insert a group; O(1) when groups finish in admission order, as they mostly do."""
        entries = self.entries
        if seq > entries[-1][0]:  # the last entry is never spent: an empty bucket is dropped
            entries.append((seq, group))
        else:
            bisect.insort(entries, (seq, group), lo=self.head)

    def take(self, count: int) -> list[Group]:
        """Remove and return the ``count`` oldest groups (fewer than the bucket holds)."""
        entries, start = self.entries, self.head
        end = start + count
        groups = [entry[1] for entry in entries[start:end]]
        if 2 * end >= len(entries):
            del entries[:end]
            self.head = 0
        else:
            entries[start:end] = [_SPENT] * count
            self.head = end
        return groups

    def groups(self) -> list[Group]:
        """Return every group, oldest first."""
        entries = self.entries
        return [entry[1] for entry in entries[self.head :]]


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
    """One blocked ``sample`` call, parked until a producer calls :meth:`wake`.

    ``wake`` only signals; the woken call re-checks everything itself, so nothing is handed
    to it before it runs and a cancelled waiter can lose nothing. Subclasses hold the
    backend's primitive; ``arm`` makes a fresh one before each park.
    """

    __slots__ = ("batch_size", "global_steps", "log_due", "started")

    def __init__(self, global_steps: int, batch_size: int) -> None:
        self.global_steps = global_steps
        self.batch_size = batch_size
        # Set when the buffer's status timer logs for this waiter (asyncio): when it started
        # waiting and when its next status line is due, in loop time.
        self.started = self.log_due = math.inf

    def arm(self) -> None:
        """Prepare a fresh, unset signal for the next park."""
        raise NotImplementedError

    def wake(self) -> None:
        """Signal the waiter (idempotent; harmless if it was cancelled)."""
        raise NotImplementedError

    def parked(self) -> Awaitable[object]:
        """Return what to await until :meth:`wake` is called."""
        raise NotImplementedError

    def abandoned(self) -> bool:
        """Whether the waiter can never run again (its event loop is closed)."""
        return False


class EventWaiter(Waiter):
    """Parks on an ``anyio.Event`` of the bound backend: works on every anyio backend."""

    __slots__ = ("backend", "event")

    def __init__(self, global_steps: int, batch_size: int, backend: type[AsyncBackend]) -> None:
        super().__init__(global_steps, batch_size)
        self.backend = backend
        self.event = backend.create_event()

    def arm(self) -> None:
        self.event = self.backend.create_event()

    def wake(self) -> None:
        self.event.set()

    def parked(self) -> Awaitable[object]:
        return self.event.wait()


class FutureWaiter(Waiter):
    """Parks on a bare asyncio future: the asyncio fast path.

    An ``anyio.Event`` wraps an ``asyncio.Event``, which wraps futures; awaiting the future
    directly saves two coroutine hops and an allocation on every wake-up.
    """

    __slots__ = ("future", "loop")

    def __init__(self, global_steps: int, batch_size: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(global_steps, batch_size)
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()

    def arm(self) -> None:
        self.future = self.loop.create_future()

    def wake(self) -> None:
        future = self.future
        if not future.done():  # done: already woken, or cancelled with its task
            future.set_result(None)

    def parked(self) -> Awaitable[object]:
        return self.future

    def abandoned(self) -> bool:
        return self.loop.is_closed()


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
        "ready_count",
        "ready_steps",
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
        self.ready: dict[int, Bucket] = {}
        self.ready_steps: list[int] = []  # a min-heap of the keys of ``ready``
        self.ready_count = 0
        self.failed: list[tuple[int, int, Group]] = []
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
            steps = self.in_flight_steps
            if len(steps) > 2 * len(self.in_flight) + 8:
                # Ended steps are dropped lazily only from the top; when an old group stays in
                # flight they pile up below it. Rebuilding here keeps the heap O(live steps).
                steps[:] = self.in_flight
                heapq.heapify(steps)
            else:
                heapq.heappush(steps, step)
        else:
            self.in_flight[step] = count + 1

    def start(self) -> None:
        """Record that a PENDING group became RUNNING."""
        self.pending -= 1
        self.running += 1

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
        if record.status is Status.FINISHED:
            self.finished += 1
        else:
            self.failure += 1
            if self.evict_failures:
                self.failed.append((step, group.seq, record))
                return
        self._push_ready(step, group.seq, record)

    # -- terminal groups --------------------------------------------------------------

    def _push_ready(self, step: int, seq: int, group: Group) -> None:
        bucket = self.ready.get(step)
        if bucket is None:
            self.ready[step] = Bucket(seq, group)
            heapq.heappush(self.ready_steps, step)
        else:
            bucket.add(seq, group)
        self.ready_count += 1

    def _forget(self, groups: list[Group]) -> int:
        """Drop ``groups`` from the resident counts; return their trajectory count."""
        trajectories = failures = 0
        for group in groups:
            trajectories += len(group.trajectories)
            if group.status is Status.FAILURE:
                failures += 1
        self.finished -= len(groups) - failures
        self.failure -= failures
        self.trajectories -= trajectories
        return trajectories

    def take_failed(self) -> list[Group]:
        """Evict and return every failed group awaiting eviction, oldest first."""
        entries = self.failed
        entries.sort()
        self.failed = []
        groups = [entry[2] for entry in entries]
        self.evicted_failure_trajectories += self._forget(groups)
        self.evicted_failure_groups += len(groups)
        return groups

    def take_stale(self, is_stale: Callable[[int], bool]) -> list[Group]:
        """Evict and return the oldest ready groups while ``is_stale(dispatch_step)`` holds."""
        steps, ready = self.ready_steps, self.ready
        groups: list[Group] = []
        while steps and is_stale(steps[0]):
            groups.extend(ready.pop(heapq.heappop(steps)).groups())
        if groups:
            self.ready_count -= len(groups)
            self.evicted_stale_trajectories += self._forget(groups)
            self.evicted_stale_groups += len(groups)
        return groups

    def take_oldest(self, count: int) -> list[Group]:
        """Remove and return the ``count`` oldest ready groups (the caller checked there are)."""
        steps, ready = self.ready_steps, self.ready
        groups: list[Group] = []
        need = count
        while need:
            bucket = ready[steps[0]]
            size = len(bucket)
            if size <= need:
                del ready[heapq.heappop(steps)]
                groups.extend(bucket.groups())
                need -= size
            else:
                groups.extend(bucket.take(need))
                need = 0
        self._count_sampled(groups)
        return groups

    def take(self, chosen: list[Group]) -> None:
        """Remove the given ready groups (any subset, any order); O(N)."""
        ids = {id(group) for group in chosen}
        for step, bucket in list(self.ready.items()):
            kept = [entry for entry in bucket.entries[bucket.head :] if id(entry[1]) not in ids]
            if kept:
                bucket.entries, bucket.head = kept, 0
            else:
                del self.ready[step]
        self.ready_steps = list(self.ready)
        heapq.heapify(self.ready_steps)
        self._count_sampled(chosen)

    def _count_sampled(self, groups: list[Group]) -> None:
        self.ready_count -= len(groups)
        self.sampled_trajectories += self._forget(groups)
        self.sampled_groups += len(groups)

    def steps_in_order(self) -> Iterator[int]:
        """Yield the ready steps in ascending order, lazily: O(j log j) for the first j.

        It walks the heap's tree with a frontier heap instead of sorting all steps. The
        index must not change while the iterator is in use.
        """
        heap = self.ready_steps
        if not heap:
            return
        size = len(heap)
        frontier = [(heap[0], 0)]
        while frontier:
            step, i = heapq.heappop(frontier)
            yield step
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))

    def iter_ready(self) -> Iterator[Group]:
        """Yield ready groups oldest first, lazily. The index must not change meanwhile."""
        ready = self.ready
        for step in self.steps_in_order():
            yield from ready[step].groups()

    def count_ready_while(self, is_stale: Callable[[int], bool]) -> int:
        """Return how many ready groups, oldest first, have a step satisfying ``is_stale``."""
        count = 0
        for step in self.steps_in_order():
            if not is_stale(step):
                break
            count += len(self.ready[step])
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
