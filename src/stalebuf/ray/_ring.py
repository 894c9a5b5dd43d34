"""The actor's ring of eviction events, read by every client's ``evictions()`` stream.

The buffer's ``on_evict`` appends to the ring and never blocks; readers poll it with a cursor.
When the ring is full the oldest event falls off and readers that had not read it are told how
many they missed. Everything here runs on the actor's home loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable

from ..records import EvictionEvent, Trajectory

__all__ = ["EvictionRing"]


class EvictionRing:
    """At most ``size`` eviction events, numbered in emission order.

    Args:
        size: how many events the ring keeps.
        keep_payloads: keep payload references in the events (else they are stripped, so
            evicted payloads are freed at once).
        closed: whether the buffer is closed (readers end once they have every event).
    """

    def __init__(self, size: int, keep_payloads: bool, closed: Callable[[], bool]) -> None:
        self._events: collections.deque[EvictionEvent] = collections.deque(maxlen=size)
        self._keep_payloads = keep_payloads
        self._closed = closed
        self.end = 0  # sequence number of the next event
        self.overflowed = 0
        self._changed = asyncio.Event()  # binds to the home loop on first use

    @property
    def size(self) -> int | None:
        """How many events the ring keeps."""
        return self._events.maxlen

    def record(self, event: EvictionEvent) -> None:
        """The buffer's ``on_evict`` (inside ``sample``): append ``event``, never block."""
        if not self._keep_payloads:
            event = _without_payloads(event)
        events = self._events
        if len(events) == events.maxlen:
            self.overflowed += 1  # the oldest event falls off the ring
        events.append(event)
        self.end += 1
        self.notify()

    def notify(self) -> None:
        """Wake every waiting reader (a new event, or the buffer closed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def poll(
        self, cursor: int | None, from_oldest: bool, limit: int, wait: float
    ) -> tuple[int, list[EvictionEvent], int, bool]:
        """Return ``(next_cursor, events, missed, closed)`` (see ``BufferHost.poll_evictions``)."""
        events = self._events
        start = self.end - len(events)
        if cursor is None:
            cursor = start if from_oldest else self.end
        cursor = min(cursor, self.end)  # a cursor from before an actor restart
        missed = max(0, start - cursor)
        cursor = max(cursor, start)
        if cursor == self.end and not self._closed() and wait > 0:
            changed = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), wait)
            start = self.end - len(events)
            missed += max(0, start - cursor)
            cursor = max(cursor, start)
        offset = cursor - start
        taken = [events[i] for i in range(offset, min(len(events), offset + limit))]
        cursor += len(taken)
        closed = self._closed() and cursor == self.end
        return cursor, taken, missed, closed


def _without_payloads(event: EvictionEvent) -> EvictionEvent:
    groups = tuple(
        group.replace(
            trajectories=tuple(
                Trajectory(t.key, t.session_id, t.index, t.tags, None) for t in group.trajectories
            ),
        )
        for group in event.groups
    )
    return EvictionEvent(event.partition, event.reason, groups, event.global_steps)
