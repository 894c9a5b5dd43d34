"""Group filters: the verdict on a group that becomes FINISHED, and what a filtered group costs.

:class:`Filtering` runs the rule book's filters (``Rules.filters``) on every group of a
non-exempt partition that becomes FINISHED, in order, fail-open: a filter that raises or
returns None keeps the group, is counted (``filter_errors``) and logged at most once per 60 s.
It owns what the filters leave behind per partition: the last 256 verdicts (the pass rate), the
groups filtered and the filter errors since the partition's previous batch (sample metrics),
and when each filter last logged. A filtered group is evicted by the caller through the store;
the events are delivered to ``on_evict`` here, iteratively: an ``on_evict`` whose refill is
filtered again is served by the same loop, never by recursion, up to
:data:`~stalebuf._eviction.MAX_READMITTED_ROUNDS` rounds.
"""

from __future__ import annotations

from collections import deque
from time import monotonic
from typing import Any

from ._eviction import MAX_READMITTED_ROUNDS, Eviction
from ._partition import PartitionState
from ._status_log import logger
from ._validation import describe, describe_error
from .checkpoint import FilterCheckpoint
from .errors import StalebufError
from .filters import GroupFilter
from .records import EvictionEvent, Group

__all__ = ["FILTER_LOG_INTERVAL", "PASS_RATE_WINDOW", "Filtering"]

#: How many of a partition's latest verdicts the pass rate covers.
PASS_RATE_WINDOW = 256
#: The least time between two ERROR lines about one filter.
FILTER_LOG_INTERVAL = 60.0


class _Ledger:
    """What the filters left behind in one partition."""

    __slots__ = ("errors", "errors_total", "filtered", "verdicts")

    def __init__(self) -> None:
        self.verdicts: deque[bool] = deque(maxlen=PASS_RATE_WINDOW)  # True: kept
        self.filtered = 0  # since the partition's previous batch
        self.errors = 0  # since the partition's previous batch
        self.errors_total = 0  # stats().partitions[name].filter_errors


class Filtering:
    """The filter verdicts and filtered-group reports of one buffer."""

    __slots__ = ("emitting", "eviction", "filters", "ledgers", "logged", "queued")

    def __init__(self, filters: tuple[GroupFilter, ...], eviction: Eviction) -> None:
        self.filters = filters
        self.eviction = eviction
        self.ledgers: dict[str, _Ledger] = {}
        self.logged: dict[int, float] = {}  # id(filter) -> when it last logged an error
        self.queued: deque[EvictionEvent] = deque()
        self.emitting = False

    def applies(self, part: PartitionState) -> bool:
        """Whether groups of ``part`` that finish are filtered (filters, not exempt)."""
        return bool(self.filters) and not part.exempt

    def keeps(self, part: PartitionState, group: Group) -> bool:
        """Run the filters on ``group`` (FINISHED, of ``part``); return whether it is kept.
        Never raises: a filter that raises or returns None keeps the group (counted, logged)."""
        ledger = self.ledgers.get(part.name)
        if ledger is None:
            ledger = self.ledgers[part.name] = _Ledger()
        keep = True
        for group_filter in self.filters:
            try:
                verdict: Any = group_filter(group)
                if verdict is None:
                    raise TypeError("it returned None (a forgotten return?)")
                keep = bool(verdict)
            except Exception as exc:
                ledger.errors += 1
                ledger.errors_total += 1
                self._log(group_filter, group, exc)
                continue
            if not keep:
                break
        ledger.verdicts.append(keep)
        if not keep:
            ledger.filtered += 1
        return keep

    def _log(self, group_filter: GroupFilter, group: Group, exc: Exception) -> None:
        now = monotonic()
        last = self.logged.get(id(group_filter))
        if last is not None and now - last < FILTER_LOG_INTERVAL:
            return
        self.logged[id(group_filter)] = now
        logger.error(
            "filter %r raised on group %s of partition %s (kept: filters fail open): %s",
            group_filter,
            describe(group.uid),
            describe(group.partition),
            describe_error(exc),
        )

    def report(self, event: EvictionEvent) -> None:
        """Deliver a "filtered" event to ``on_evict``; one that its own refill causes is queued
        and delivered by the outer call's loop.

        Raises:
            StalebufError: ``on_evict``'s refills were filtered again, bound reached (the rest
                are evicted, unreported).
            Exception: what ``on_evict`` raised (after every queued event was delivered).
        """
        self.queued.append(event)
        if self.emitting:
            return
        self.emitting = True
        rounds = 0
        error: BaseException | None = None
        try:
            while self.queued:
                rounds += 1
                if rounds > MAX_READMITTED_ROUNDS:
                    self.queued.clear()
                    raise StalebufError(
                        f"on_evict re-admitted groups that were filtered again, {MAX_READMITTED_ROUNDS} "
                        "rounds in a row; the last ones are evicted without a report"
                    ) from error
                # Every queued event is delivered before an error propagates (as sample does):
                # one left queued would reach on_evict from an unrelated later call, or never.
                try:
                    self.eviction.emit([self.queued.popleft()])
                except BaseException as exc:
                    if error is None:
                        error = exc
                    else:
                        logger.exception("on_evict raised again while reporting a filtered group")
        finally:
            self.emitting = False
        if error is not None:
            raise error

    def errors(self, name: str) -> int:
        """How many times a filter raised (or returned None) on a group of partition ``name``."""
        ledger = self.ledgers.get(name)
        return 0 if ledger is None else ledger.errors_total

    def take_recent(self, part: PartitionState) -> tuple[int, int, float | None] | None:
        """``(filtered, errors, pass rate)`` of ``part`` since its previous batch, or None when
        its groups are not filtered; the counts start again from 0."""
        if not self.applies(part):
            return None
        ledger = self.ledgers.get(part.name)
        if ledger is None:
            ledger = self.ledgers[part.name] = _Ledger()
        filtered, errors = ledger.filtered, ledger.errors
        ledger.filtered = ledger.errors = 0
        verdicts = ledger.verdicts
        rate = sum(verdicts) / len(verdicts) if verdicts else None
        return filtered, errors, rate

    def saved(self, name: str) -> FilterCheckpoint | None:
        """What partition ``name``'s ledger holds, as a checkpoint keeps it (None if it has none;
        when each filter last logged is not kept: a restored buffer may log at once)."""
        ledger = self.ledgers.get(name)
        if ledger is None:
            return None
        return FilterCheckpoint(tuple(ledger.verdicts), ledger.errors_total, ledger.filtered, ledger.errors)

    def restore(self, name: str, saved: FilterCheckpoint) -> None:
        """Put back partition ``name``'s ledger (a restore, into a buffer that has none yet)."""
        ledger = self.ledgers[name] = _Ledger()
        ledger.verdicts.extend(saved.verdicts)
        ledger.errors_total = saved.errors
        ledger.filtered = saved.recent_filtered
        ledger.errors = saved.recent_errors
