"""Eviction events of a remote buffer, as an async iterator (the remote ``on_evict``)."""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import TYPE_CHECKING

from .._validation import finite_in, int_at_least
from ..records import EvictionEvent

if TYPE_CHECKING:
    from ._connection import ActorConnection

__all__ = ["EvictionStream"]

logger = logging.getLogger("stalebuf.ray")

_check_max_events = int_at_least("max_events", 1)
_check_poll_seconds = finite_in("poll_seconds", 0.0, math.inf, open_low=True)


class EvictionStream:
    """An async iterator of the eviction events of a remote buffer (see
    :meth:`RemoteReplayBuffer.evictions`).

    It yields every event emitted from its first ``__anext__`` on (with ``from_oldest``, also
    the ones the actor still holds), and ends once the buffer is closed and every event was
    yielded. Each stream reads independently (several trainers can each have one). The actor
    keeps at most ``eviction_queue_size`` events; a reader that falls further behind loses the
    oldest, counted in :attr:`dropped` and logged. Payload references are stripped unless the
    actor keeps them (``keep_evicted_payloads``). ``max_events`` bounds the events fetched per
    round trip; ``poll_seconds`` is how long one round trip waits in the actor for an event
    (the stream just asks again).

    Raises:
        ConfigError: ``max_events`` is not an int >= 1 or ``poll_seconds`` not a finite
            number > 0.

    Attributes:
        dropped: events this stream lost because the actor's queue overflowed before it read
            them.
    """

    def __init__(
        self,
        connection: ActorConnection,
        label: str,
        *,
        from_oldest: bool,
        max_events: int,
        poll_seconds: float,
    ) -> None:
        _check_max_events(None, None, max_events)
        _check_poll_seconds(None, None, poll_seconds)
        self._connection = connection
        self._label = label
        self._from_oldest = from_oldest
        self._max_events = max_events
        self._poll_seconds = float(poll_seconds)
        self._cursor: int | None = None
        self._ready: deque[EvictionEvent] = deque()
        self._ended = False
        self.dropped = 0

    def __aiter__(self) -> EvictionStream:
        """Return the stream itself."""
        return self

    async def __anext__(self) -> EvictionEvent:
        """Return the next event, waiting for one.

        Raises:
            StopAsyncIteration: the buffer is closed and every event was yielded.
            BufferUnavailableError: the actor is gone.
        """
        while not self._ready:
            if self._ended:
                raise StopAsyncIteration
            cursor, events, missed, closed = await self._connection.call(
                "poll_evictions", self._cursor, self._from_oldest, self._max_events, self._poll_seconds
            )
            self._cursor = cursor
            self._ready.extend(events)
            self._ended = closed
            if missed:
                self.dropped += missed
                logger.warning(
                    "the eviction queue of %s overflowed: this reader lost %d event(s) (%d in all)",
                    self._label,
                    missed,
                    self.dropped,
                )
        return self._ready.popleft()
