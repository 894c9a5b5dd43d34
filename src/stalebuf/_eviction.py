"""Eviction inside ``sample``: rounds of "ask the rules, then remove", reported to ``on_evict``.

Eviction repeats until a round evicts nothing, because ``on_evict`` may finish or fail groups
(a stale one must not slip into the batch; a failed one must not wait for an unrelated
wake-up). Each round asks the rules first and changes state after, so a hook that raises
leaves the buffer as it was; ``on_evict`` runs after the state is consistent.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ._admission import Admission
from ._judged_index import JudgedEntry
from ._partition import PartitionState
from ._rules import Rules
from ._status_log import logger
from ._store import GroupStore
from ._validation import describe, describe_typed
from .errors import BufferClosedError, ConfigError, StalebufError
from .metrics import SampleMetrics
from .records import EvictionEvent

__all__ = ["MAX_READMITTED_ROUNDS", "Eviction", "check_on_evict"]

#: How many eviction rounds in a row one ``sample`` runs when each evicts only groups that
#: ``on_evict`` added during that sample, before it raises: re-admitting a stale group under a
#: new uid would otherwise loop forever.
MAX_READMITTED_ROUNDS = 1_000


def check_on_evict(on_evict: object) -> None:
    """Refuse an ``on_evict`` that is not None or a plain (synchronous) callable.

    Raises:
        ConfigError: as said; it is called inside ``sample``, so a coroutine would never run.
    """
    if on_evict is not None and not callable(on_evict):
        raise ConfigError(f"on_evict must be callable or None, got {describe_typed(on_evict)}")
    if inspect.iscoroutinefunction(on_evict):
        raise ConfigError("on_evict must be a plain (synchronous) callable; it is called inside sample")


class Eviction:
    """Evicts what the rules say must go and reports it to ``on_evict`` (it owns no state
    but the callback: the groups are the store's, the clocks admission's)."""

    __slots__ = ("admission", "on_evict", "rules", "store")

    def __init__(
        self,
        store: GroupStore,
        admission: Admission,
        rules: Rules,
        on_evict: Callable[[EvictionEvent], object] | None,
    ) -> None:
        self.store = store
        self.admission = admission
        self.rules = rules
        self.on_evict = on_evict

    def run(self, part: PartitionState, global_steps: int, metrics: SampleMetrics) -> bool:
        """Evict until a round evicts nothing; return whether any group left.

        Raises:
            StalebufError: ``on_evict`` keeps re-admitting groups that are evicted at once.
            BufferClosedError: ``on_evict`` closed the buffer.
            Exception: whatever a policy hook or ``on_evict`` raised (the round's evictions
                were applied and reported first).
        """
        rules, name = self.rules, part.name
        # Groups from seq readmitted_from on were added by on_evict during this sample.
        readmitted_from, evicted_before, rounds = self.store.next_seq, frozenset[str](), 0
        left = False
        while True:
            stale = rules.stale_steps(part, global_steps)
            judged = rules.stale_judged(part, global_steps)
            stale_in_flight = rules.stale_in_flight_steps(part, global_steps)
            if not stale and not judged and not stale_in_flight and not part.failed:
                return left
            if evicted_before:
                rounds = _readmitted_rounds(
                    part, (stale, judged, stale_in_flight), readmitted_from, evicted_before, rounds
                )
            # State changes from here on: the call has gone through, so the clock moves now
            # (a hook that raised above left everything, the clock included, as it was).
            self.admission.advance(name, global_steps)
            events = self._evict(part, global_steps, (stale, judged, stale_in_flight), metrics)
            left = True
            self.admission.wake(name)  # slots freed: wake before on_evict runs, which may raise
            evicted_before = frozenset(group.uid for event in events for group in event.groups)
            self.emit(events)
            if self.store.closed:  # on_evict may have closed the buffer
                raise BufferClosedError("the buffer is closed")

    def _evict(
        self,
        part: PartitionState,
        global_steps: int,
        chosen: tuple[list[int], list[JudgedEntry], list[int]],
        metrics: SampleMetrics,
    ) -> list[EvictionEvent]:
        """Evict what the rules chose (``chosen``: stale ready steps, stale judged entries,
        stale in-flight heads; nothing here raises); return the events to report."""
        stale, judged, stale_in_flight = chosen
        events: list[EvictionEvent] = []
        store = self.store
        if part.failed:
            failed = store.evict_failed(part)
            metrics.failed_groups += len(failed)
            events.append(EvictionEvent(part.name, "failure", tuple(failed), global_steps))
        if stale or judged or stale_in_flight:
            dropped = store.evict_stale(part, stale, judged)
            if stale_in_flight:
                # The sample evicting them moves the clock to its step (it went through).
                clock = max(self.admission.clocks.get(part.name, 0), global_steps)
                in_flight = store.evict_stale_in_flight(part, stale_in_flight, clock)
                metrics.in_flight_groups += len(in_flight)
                dropped = sorted(dropped + in_flight, key=lambda group: group.dispatch_step)
            metrics.add_dropped(dropped, global_steps)
            events.append(EvictionEvent(part.name, "stale", tuple(dropped), global_steps))
        return events

    def emit(self, events: list[EvictionEvent]) -> None:
        """Call ``on_evict`` for every event; re-raise the first error after all were called.

        BaseExceptions (KeyboardInterrupt, cancellation) too: every evicted group was counted,
        so every event is delivered before anything propagates.
        """
        callback = self.on_evict
        if callback is None:
            return
        error: BaseException | None = None
        for event in events:
            try:
                callback(event)
            except BaseException as exc:
                if error is None:
                    error = exc
                else:
                    logger.exception("on_evict raised again while reporting %s", event.reason)
        if error is not None:
            raise error


def _readmitted_rounds(
    part: PartitionState,
    chosen: tuple[list[int], list[JudgedEntry], list[int]],
    readmitted_from: int,
    evicted_before: frozenset[str],
    rounds: int,
) -> int:
    """Return how many rounds in a row, this one included, evict only groups ``on_evict``
    added during this sample; refuse the round that reaches the bound (they stay).

    Counting from the sample's first round, not the round before: a group ``on_evict``
    added two rounds back would otherwise reset the count each round, and the loop run on.
    A round that evicts a group older than the sample resets it: those are finite.

    Raises:
        StalebufError: the bound is reached, or the round would evict exactly what the round
            before evicted (same uids: it would loop forever).
    """
    stale, judged, stale_in_flight = chosen
    buckets, in_flight = part.ready.buckets, part.in_flight.groups
    entries = [(seq, group.uid) for step in stale for seq, group in buckets[step].live_entries()]
    entries += [(seq, group.uid) for _, seq, group in judged]
    entries += [(group.seq, uid) for step in stale_in_flight for uid, group in in_flight[step].items()]
    entries += [(seq, group.uid) for _, seq, group in part.failed]
    if not all(seq >= readmitted_from for seq, _ in entries):
        return 0
    if all(uid in evicted_before for _, uid in entries):
        raise StalebufError(
            f"on_evict re-admitted groups of partition {describe(part.name)} that are evicted again "
            "at once (stale at their dispatch step, or failed under failure_strategy='evict'), so "
            "sample would never finish; they stay in the buffer. Re-admit at the current step instead."
        )
    if rounds + 1 >= MAX_READMITTED_ROUNDS:
        raise StalebufError(
            f"on_evict added groups to partition {describe(part.name)} that were evicted again at "
            f"once, {MAX_READMITTED_ROUNDS} rounds in a row (stale at their dispatch step, or failed "
            "under failure_strategy='evict'), so sample would never finish; the last ones stay in "
            "the buffer. Re-admit at the current step instead."
        )
    return rounds + 1
