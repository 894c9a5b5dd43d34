"""Ready groups by the version the rules judge them by, once some differ from their dispatch step.

Without versions a ready group is judged by its dispatch step, and :class:`~stalebuf._index.
ReadyIndex`'s per-step buckets answer every eviction question as a prefix of steps. Once a
partition holds a ready group judged by another version (its head under ``drop``, its tail
under ``mask``), its partition also keeps a :class:`JudgedIndex`: a lazily cleaned min-heap of
``(judged version, seq, group)`` over *all* its ready groups, so the groups to evict are again
a prefix (of the heap's order), found in O(j log j) for j of them. The buckets keep the batch
order (dispatch step, then FIFO); the heap only says what is stale. A partition drops its
heap when its last ready group leaves, and goes back to the buckets alone.

Nothing here knows a staleness rule: callers pass a predicate over versions.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from .records import Group

__all__ = ["JudgedEntry", "JudgedIndex"]

#: (judged version, admission seq, group): seq is unique, so comparing never reaches the group.
JudgedEntry = tuple[int, int, Group]


class JudgedIndex:
    """A lazily cleaned min-heap of every ready group of a partition, by judged version.

    ``live`` maps ``id(group)`` to the admission seq of its live entry: an entry whose group
    left (or came back under another seq, as ``put_back`` does) is skipped and dropped later.
    The entry holds the group, so its id cannot be reused while the entry exists.
    """

    __slots__ = ("heap", "live")

    def __init__(self, entries: Iterable[JudgedEntry]) -> None:
        self.heap = list(entries)
        heapq.heapify(self.heap)
        self.live = {id(group): seq for _, seq, group in self.heap}

    def __len__(self) -> int:
        return len(self.live)

    def _is_live(self, entry: JudgedEntry) -> bool:
        return self.live.get(id(entry[2])) == entry[1]

    def push(self, key: int, seq: int, group: Group) -> None:
        """Add a ready group judged by version ``key``."""
        heap, live = self.heap, self.live
        if len(heap) > 2 * len(live) + 64:  # entries of groups that left pile up behind live ones
            heap[:] = [entry for entry in heap if self._is_live(entry)]
            heapq.heapify(heap)
        heapq.heappush(heap, (key, seq, group))
        live[id(group)] = seq

    def forget(self, groups: Iterable[Group]) -> None:
        """Mark ``groups`` (ready groups leaving the partition) as gone; O(len)."""
        pop = self.live.pop
        for group in groups:
            pop(id(group), None)

    def oldest(self) -> int | None:
        """The smallest judged version of a ready group, or None (dead entries are dropped)."""
        heap = self.heap
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def stale(self, is_stale: Callable[[int], bool]) -> list[JudgedEntry]:
        """The live entries whose version ``is_stale`` accepts, oldest first, given that the
        accepted versions are a prefix of the order (the rules are monotone). Changes nothing,
        so a predicate that raises leaves the index as it was. O(j log j) for j visited."""
        heap = self.heap
        found: list[JudgedEntry] = []
        if not heap:
            return found
        size = len(heap)
        frontier = [(heap[0], 0)]
        verdicts: dict[int, bool] = {}
        while frontier:
            entry, i = heapq.heappop(frontier)
            key = entry[0]
            verdict = verdicts.get(key)
            if verdict is None:
                verdict = verdicts[key] = bool(is_stale(key))
            if not verdict:
                break  # every entry left in the frontier, and below it, has a version >= key
            if self._is_live(entry):
                found.append(entry)
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))
        return found
