"""The status reporter: a ``sample`` blocked for ``status_log_interval`` seconds logs a line.

The line says what the call waits for, what its partition holds, and why it waits (the reason
``explain_wait`` gives). It is INFO at first; once one call has waited :data:`ESCALATE_AFTER`
intervals (its third line, 3 minutes at the default 60 s), every line about it is a WARNING, so
a sample that hangs is seen even where only warnings are shown.

On asyncio one loop timer per buffer serves every waiter: it fires when the earliest waiter
is due a line and stops when no sample waits, so a wait costs no timer of its own. Other
backends log from the waiting call itself (see ``_waiting.park_with_deadline``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

from ._partition import PartitionState
from ._waiting import Waiter

__all__ = ["ESCALATE_AFTER", "StatusLog", "logger"]

logger = logging.getLogger("stalebuf")

#: After how many intervals of waiting a ``sample``'s status lines are WARNINGs, not INFO.
ESCALATE_AFTER = 3

#: Tells why a parked sample waits, for its line: ``reason(partition name, waiter)``.
Reason = Callable[[str, Waiter], str]


class Explains(Protocol):
    """What tells the status reporter why a parked sample waits (``_explain.Explainer``)."""

    def reason(self, name: str, waiter: Waiter) -> str:
        """Why ``waiter``, parked on partition ``name``, waits (never raises)."""


def next_due(due: float, now: float, interval: float) -> float:
    """Return the first ``due + k * interval`` (k >= 1) after ``now``, in one step.

    A loop that was stalled for many intervals logs once, not once per missed interval.
    """
    if due > now:
        return due
    return due + interval * (math.floor((now - due) / interval) + 1)


def log_waiting(part: PartitionState, waiter: Waiter, waited: float, interval: float, reason: Reason) -> None:
    """Log one line saying what ``waiter`` has waited for (``waited`` seconds, its lines due
    every ``interval``), what its partition holds and why it waits (``reason(name, waiter)``):
    INFO, or WARNING once it has waited :data:`ESCALATE_AFTER` intervals."""
    # Half an interval of slack: the third line is due at 3 intervals, give or take a rounding.
    level = logging.WARNING if waited >= (ESCALATE_AFTER - 0.5) * interval else logging.INFO
    cells = [part] if part.cells is None else list(part.cells.values())  # a mixture's hold its groups
    heads = [head for head in (cell.in_flight.oldest() for cell in cells) if head is not None]
    logger.log(
        level,
        "sample(global_steps=%d, %s=%d) on partition %r has waited %.0f s: "
        "pending=%d running=%d finished=%d failure=%d ready=%d oldest_in_flight_step=%s; "
        "waiting because %s",
        waiter.global_steps,
        "batch_size" if waiter.token_budget is None else "token_budget",
        waiter.batch_size if waiter.token_budget is None else waiter.token_budget,
        part.name,
        waited,
        sum(cell.pending for cell in cells),
        sum(cell.running for cell in cells),
        sum(cell.finished for cell in cells),
        sum(cell.failure for cell in cells),
        sum(cell.ready.count for cell in cells),
        min(heads, default=None),
        reason(part.name, waiter),
    )


class StatusLog:
    """The asyncio status timer of one buffer."""

    __slots__ = ("explainer", "interval", "loop", "partitions", "timer", "waiting")

    def __init__(
        self,
        interval: float,
        waiting: Mapping[str, deque[Waiter]],
        partitions: Mapping[str, PartitionState],
        explainer: Explains,
    ) -> None:
        self.interval = interval
        self.explainer = explainer  # why a waiter waits (never raises)
        # Live views: partitions and queues created later are seen.
        self.waiting = waiting
        self.partitions = partitions
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def watch(self, waiter: Waiter, started: float) -> None:
        """Start reporting on ``waiter``, which started waiting at ``started`` (loop time)."""
        waiter.started = started
        waiter.log_due = started + self.interval
        loop = asyncio.get_running_loop()
        if self.timer is None or self.loop is not loop:
            self.loop = loop
            self.timer = loop.call_at(waiter.log_due, self.tick)

    def tick(self) -> None:
        """Log a line for every waiter that is due one, then sleep until the next is due."""
        loop, interval = self.loop, self.interval
        if loop is None:  # unreachable: set before the timer is scheduled
            return
        now = loop.time()
        earliest = math.inf
        for name, waiters in self.waiting.items():
            for waiter in waiters:
                if waiter.abandoned():  # its loop was closed under it: nobody waits there
                    continue
                if waiter.log_due <= now:
                    waited = waiter.log_due - waiter.started
                    log_waiting(self.partitions[name], waiter, waited, interval, self.explainer.reason)
                    waiter.log_due = next_due(waiter.log_due, now, interval)
                earliest = min(earliest, waiter.log_due)
        self.timer = None if earliest == math.inf else loop.call_at(earliest, self.tick)
