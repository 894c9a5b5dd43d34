"""The per-partition indexes: what ``sample`` asks costs O(1) or O(log N), never a scan.

- :class:`ReadyIndex`: sampleable terminal groups in per-dispatch-step buckets, each in
  admission order, plus a min-heap of those steps. Steps in order, then buckets front to back,
  yield the groups oldest first with FIFO ties. Drop eviction removes whole buckets from the
  front (stale groups are a prefix of that order) and selection takes groups off the front,
  so both cost O(k + b log S) for k groups spanning b of S steps, whatever the number
  resident. (One heap of all groups did it in O(k log N), but its cache misses made a
  1e6-group sample 3-5x slower than a 1e3-group one.)
- :class:`InFlightIndex`: a count of PENDING/RUNNING groups per dispatch step, plus a lazily
  cleaned min-heap of those steps, so the wait gate reads the oldest in-flight step in O(1)
  amortised.

Nothing here knows a staleness rule: callers pass predicates over dispatch steps.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterator, MutableSequence
from itertools import chain
from operator import is_, itemgetter
from typing import TypeVar, cast

from ._open_group import OpenGroup
from .records import Group

__all__ = ["Bucket", "InFlightIndex", "ReadyIndex"]

_T = TypeVar("_T")

# (admission seq, group): seq is unique, so comparing entries never reaches the group. Only the
# rare paths build these (late finishers, subsets, listings): one per resident group would be one
# more object for the cyclic collector to traverse each time, and 56 bytes.
Entry = tuple[int, Group]
_group_of = itemgetter(1)
_seq_of = itemgetter(0)


# The hot paths below narrow ``list[Group | None]`` slices that hold no spent slot with a
# ``type: ignore`` rather than typing.cast, which is a Python-level call at run time.


def _iter_from(items: MutableSequence[_T], start: int) -> Iterator[_T]:
    """Iterate ``items[start:]`` lazily without copying; O(1) to start."""
    it = iter(items)
    if start:
        # islice would step over the ``start`` spent slots one by one (0.85 ms at 2.5e5).
        it.__setstate__(start)  # type: ignore[attr-defined]
    return it


class Bucket:
    """The ready groups of one dispatch step, in admission order, taken from the front.

    Groups that finish in admission order (most of them) are appended to two parallel arrays,
    ``seqs`` (machine integers) and ``members`` (no tuple per group), which are taken from by
    advancing ``head`` instead of shifting them (a bucket may hold a million groups); taken
    member slots are cleared at once so sampled groups are not kept alive, and the arrays are
    compacted once half of them is spent. A group that finishes out of order goes to ``late``,
    a heap of entries, instead of into the middle of the arrays: O(log n), not O(n). The
    bucket's order is the merge of the two; ``seqs`` is never empty while it holds a group.
    """

    __slots__ = ("head", "late", "members", "seqs")

    def __init__(self, seq: int, group: Group) -> None:
        # Admission numbers as machine integers: no int object per resident group for the cyclic
        # collector to visit on every full collection (nor its 32 bytes).
        self.seqs: array[int] = array("q", (seq,))
        self.members: list[Group | None] = [group]  # None in the spent slots before ``head``
        self.head = 0
        self.late: list[Entry] | None = None

    def __len__(self) -> int:
        late = self.late
        return len(self.seqs) - self.head + (len(late) if late else 0)

    def add(self, seq: int, group: Group) -> None:
        """Insert a group: O(1) when groups finish in admission order, O(log n) otherwise."""
        seqs = self.seqs
        if seq > seqs[-1]:  # the last slot is never spent: an empty bucket is dropped
            seqs.append(seq)
            self.members.append(group)
        elif self.late is None:
            self.late = [(seq, group)]
        else:
            heapq.heappush(self.late, (seq, group))

    def take(self, count: int) -> list[Group]:
        """Remove and return the ``count`` oldest groups (fewer than the bucket holds)."""
        if self.late:
            return self._take_merged(count)
        members, start = self.members, self.head
        end = start + count
        groups: list[Group] = members[start:end]  # type: ignore[assignment]  # (no spent slot)
        if 2 * end >= len(members):
            del members[:end]
            del self.seqs[:end]
            self.head = 0
        else:
            members[start:end] = [None] * count
            self.head = end
        return groups

    def _take_merged(self, count: int) -> list[Group]:
        seqs, members, late, head = self.seqs, self.members, self.late, self.head
        assert late is not None
        groups: list[Group | None] = []  # no None: only live slots are read
        for _ in range(count):
            if head < len(seqs) and (not late or seqs[head] < late[0][0]):
                groups.append(members[head])
                members[head] = None
                head += 1
            else:
                groups.append(heapq.heappop(late)[1])
        if 2 * head >= len(seqs):
            del seqs[:head]
            del members[:head]
            head = 0
        self.head = head
        if not seqs:  # keep seqs non-empty: the late ones, in order, move to the lists
            self.keep(sorted(late))
        elif not late:
            self.late = None
        return cast("list[Group]", groups)

    def keep(self, entries: list[Entry]) -> None:
        """Replace the contents with ``entries``: ``(seq, group)`` pairs, ascending, not empty."""
        self.seqs = array("q", map(_seq_of, entries))
        self.members = list(map(_group_of, entries))
        self.head = 0
        self.late = None

    def live_entries(self) -> list[Entry]:
        """Return every ``(seq, group)`` entry, oldest first (builds a pair per group)."""
        head = self.head
        entries = cast("list[Entry]", list(zip(self.seqs[head:], self.members[head:], strict=True)))
        if self.late:
            return list(heapq.merge(entries, sorted(self.late)))
        return entries

    def groups(self) -> list[Group]:
        """Return every group, oldest first."""
        if self.late:
            return list(map(_group_of, self.live_entries()))
        return self.members[self.head :]  # type: ignore[return-value]  # (no spent slot)

    def iter_entries(self) -> Iterator[Entry]:
        """Return an iterator over the ``(seq, group)`` entries, oldest first, lazily."""
        head = self.head
        members: Iterator[Group] = _iter_from(self.members, head)  # type: ignore[arg-type]  # no spent slot
        entries: Iterator[Entry] = zip(_iter_from(self.seqs, head), members, strict=True)
        if self.late:
            return heapq.merge(entries, sorted(self.late))
        return entries

    def iter_groups(self) -> Iterator[Group]:
        """Return an iterator over the groups, oldest first, lazily (O(1) to start)."""
        head = self.head
        groups: Iterator[Group] = _iter_from(self.members, head)  # type: ignore[arg-type]  # C-level
        if self.late:
            entries: Iterator[Entry] = zip(_iter_from(self.seqs, head), groups, strict=True)
            return map(_group_of, heapq.merge(entries, sorted(self.late)))
        return groups


def _bucket_groups(bucket: Bucket) -> Iterator[Group]:
    return bucket.iter_groups()


class ReadyIndex:
    """Sampleable groups of one partition, oldest first (ascending dispatch step, then FIFO)."""

    __slots__ = ("buckets", "count", "newest", "steps")

    def __init__(self) -> None:
        self.buckets: dict[int, Bucket] = {}
        self.steps: list[int] = []  # a min-heap of the keys of ``buckets``
        # A lazily cleaned max-heap (negated) of the same keys: counting what is fresh walks the
        # newest steps, which are few, instead of the stale ones, which may be millions.
        self.newest: list[int] = []
        self.count = 0

    def push(self, step: int, seq: int, group: Group) -> None:
        """Add a sampleable group dispatched at ``step`` with admission number ``seq``."""
        bucket = self.buckets.get(step)
        if bucket is None:
            self.buckets[step] = Bucket(seq, group)
            heapq.heappush(self.steps, step)
            newest = self.newest
            if len(newest) > 2 * len(self.buckets) + 8:  # entries of emptied steps pile up
                newest[:] = [-key for key in self.buckets]
                heapq.heapify(newest)
            else:
                heapq.heappush(newest, -step)
        else:
            bucket.add(seq, group)
        self.count += 1

    def oldest_step(self) -> int:
        """Return the smallest dispatch step held (the index must not be empty)."""
        return self.steps[0]

    def stale_steps(self, is_stale: Callable[[int], bool]) -> list[int]:
        """Return the steps, oldest first, that ``is_stale`` accepts before the first it rejects.

        Runs the predicate only; changes nothing, so a predicate that raises leaves the index
        as it was. O(j log S) for j returned steps.
        """
        stale: list[int] = []
        for step in self.steps_in_order():
            if not is_stale(step):
                break
            stale.append(step)
        return stale

    def steps_before(self, cutoff: int) -> list[int]:
        """Return the steps below ``cutoff``, ascending: what :meth:`stale_steps` returns for a
        threshold rule, without a predicate call per step. O(j log j) for j returned.

        Only the heap's subtrees under steps below ``cutoff`` are walked: a child is never
        smaller than its parent.
        """
        heap = self.steps
        if not heap or heap[0] >= cutoff:
            return []
        size = len(heap)
        found: list[int] = []
        frontier = [(heap[0], 0)]
        pop, push = heapq.heappop, heapq.heappush
        while frontier:
            step, i = pop(frontier)
            found.append(step)
            child = 2 * i + 1
            if child < size and heap[child] < cutoff:
                push(frontier, (heap[child], child))
            child += 1
            if child < size and heap[child] < cutoff:
                push(frontier, (heap[child], child))
        return found

    def pop_steps(self, steps: list[int]) -> list[Group]:
        """Remove and return the groups of the oldest ``steps`` (as :meth:`stale_steps` gave)."""
        heap, buckets = self.steps, self.buckets
        groups: list[Group] = []
        for _ in steps:
            groups.extend(buckets.pop(heapq.heappop(heap)).groups())
        self.count -= len(groups)
        return groups

    def take_oldest(self, count: int) -> list[Group]:
        """Remove and return the ``count`` oldest groups (the caller checked there are)."""
        heap, buckets = self.steps, self.buckets
        bucket = buckets[heap[0]]
        if bucket.late is None and len(bucket.members) - bucket.head == count:
            # The whole oldest bucket, in order: the common sample of one dispatch step's groups.
            # It is dropped, so its list of groups can be handed out as it is.
            del buckets[heapq.heappop(heap)]
            self.count -= count
            members = bucket.members
            return members[bucket.head :] if bucket.head else members  # type: ignore[return-value]
        groups: list[Group] = []
        need = count
        while need:
            bucket = buckets[heap[0]]
            size = len(bucket)
            if size <= need:
                del buckets[heapq.heappop(heap)]
                groups.extend(bucket.groups())
                need -= size
            else:
                groups.extend(bucket.take(need))
                need = 0
        self.count -= count
        return groups

    def is_oldest(self, chosen: list[Group]) -> bool:
        """Whether ``chosen`` is exactly the ``len(chosen)`` oldest groups, in order; O(len)."""
        if len(chosen) > self.count:
            return False
        return all(map(is_, chosen, self.iter_groups()))

    def take(self, chosen: list[Group]) -> None:
        """Remove the given groups (any subset, any order, all present); O(N)."""
        ids = {id(group) for group in chosen}
        for step, bucket in list(self.buckets.items()):
            kept = [entry for entry in bucket.live_entries() if id(entry[1]) not in ids]
            if kept:
                bucket.keep(kept)
            else:
                del self.buckets[step]
        self.steps = list(self.buckets)
        heapq.heapify(self.steps)
        self.newest = [-step for step in self.buckets]
        heapq.heapify(self.newest)
        self.count -= len(chosen)

    def remove(self, doomed: dict[int, set[int]]) -> None:
        """Remove the groups whose ids ``doomed`` lists under their dispatch step (all present);
        O(the buckets touched + S)."""
        buckets, emptied = self.buckets, False
        for step, ids in doomed.items():
            bucket = buckets[step]
            if len(ids) == len(bucket):
                del buckets[step]
                emptied = True
            else:
                bucket.keep([entry for entry in bucket.live_entries() if id(entry[1]) not in ids])
            self.count -= len(ids)
        if emptied:
            self.steps = list(buckets)
            heapq.heapify(self.steps)
            self.newest = [-step for step in buckets]
            heapq.heapify(self.newest)

    def iter_oldest(self) -> Iterator[tuple[int, int, Group]]:
        """Yield ``(step, seq, group)`` oldest first, lazily (the index must not change)."""
        buckets = self.buckets
        for step in self.steps_in_order():
            for seq, group in buckets[step].iter_entries():
                yield step, seq, group

    def entries(self) -> Iterator[tuple[int, int, Group]]:
        """Yield ``(step, seq, group)`` for every group, bucket by bucket (in no step order)."""
        for step, bucket in self.buckets.items():
            for seq, group in bucket.live_entries():
                yield step, seq, group

    def steps_in_order(self) -> Iterator[int]:
        """Yield the steps in ascending order, lazily: O(j log j) for the first j.

        It walks the heap's tree with a frontier heap instead of sorting all steps. The
        index must not change while the iterator is in use.
        """
        heap = self.steps
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

    def iter_groups(self) -> Iterator[Group]:
        """Return an iterator over the groups, oldest first, lazily. The index must not change
        while it is in use. The first bucket is read without the step walk: a batch usually
        comes from it."""
        heap, buckets = self.steps, self.buckets
        if not heap:
            return iter(())
        first = buckets[heap[0]].iter_groups()
        if len(heap) == 1:
            return first
        later = self.steps_in_order()
        next(later)
        return chain(first, chain.from_iterable(map(_bucket_groups, map(buckets.__getitem__, later))))

    def count_fresh(self, is_stale: Callable[[int], bool]) -> int:
        """Return how many groups have a step that ``is_stale`` rejects, given that stale steps
        are a prefix of the order: it walks the newest steps down to the first stale one, so it
        costs O(f log f) for f fresh steps, however many stale ones there are (O(1) when the
        oldest step is fresh, or the newest stale)."""
        heap, buckets = self.newest, self.buckets
        count = 0
        if not self.steps:  # (``newest`` is cleaned lazily: it may still hold emptied steps)
            return count
        if not is_stale(self.steps[0]):  # nothing is stale: O(1), however many steps are held
            return self.count
        size = len(heap)
        frontier = [(heap[0], 0)]
        seen: set[int] = set()
        while frontier:
            negated, i = heapq.heappop(frontier)
            step = -negated
            if step in buckets and step not in seen:  # skip emptied steps and duplicates
                if is_stale(step):
                    break
                seen.add(step)
                count += len(buckets[step])
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))
        return count


class InFlightIndex:
    """PENDING/RUNNING groups of one partition, by dispatch step (each step in admission order)."""

    __slots__ = ("groups", "steps")

    def __init__(self) -> None:
        self.groups: dict[int, dict[str, OpenGroup]] = {}
        self.steps: list[int] = []  # a lazily cleaned min-heap of the keys of ``groups``

    def add(self, step: int, uid: str, group: OpenGroup) -> None:
        """Record one more in-flight group dispatched at ``step``."""
        by_step = self.groups
        at_step = by_step.get(step)
        if at_step is None:
            by_step[step] = {uid: group}
            steps = self.steps
            if len(steps) > 2 * len(by_step) + 8:
                # Ended steps are dropped lazily only from the top; when an old group stays in
                # flight they pile up below it. Rebuilding here keeps the heap O(live steps).
                steps[:] = by_step
                heapq.heapify(steps)
            else:
                heapq.heappush(steps, step)
        else:
            at_step[uid] = group

    def remove(self, step: int, uid: str) -> None:
        """Forget the in-flight group ``uid`` dispatched at ``step`` (it ended or left)."""
        at_step = self.groups[step]
        del at_step[uid]
        if not at_step:
            del self.groups[step]  # its heap entry is dropped lazily

    def oldest(self) -> int | None:
        """Return the smallest dispatch step of an in-flight group, or None."""
        steps, by_step = self.steps, self.groups
        while steps and steps[0] not in by_step:
            heapq.heappop(steps)  # a step whose last in-flight group ended
        return steps[0] if steps else None

    def stale_steps(self, is_stale: Callable[[int], bool]) -> list[int]:
        """Return the steps, oldest first, that ``is_stale`` accepts before the first it rejects;
        changes nothing. O(j log S) for j returned steps."""
        stale: list[int] = []
        if self.oldest() is None:
            return stale
        heap = self.steps
        frontier = [(heap[0], 0)]
        size = len(heap)
        by_step = self.groups
        while frontier:
            step, i = heapq.heappop(frontier)
            if step in by_step and not (stale and stale[-1] == step):  # skip deleted, duplicates
                if not is_stale(step):
                    break
                stale.append(step)
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))
        return stale

    def pop_steps(self, steps: list[int]) -> list[OpenGroup]:
        """Remove and return the in-flight groups of ``steps``, oldest first (admission order)."""
        by_step = self.groups
        groups: list[OpenGroup] = []
        for step in steps:
            groups.extend(by_step.pop(step).values())
        return groups
