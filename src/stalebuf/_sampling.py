"""What ``sample`` does: evict by the rules until nothing more goes, select, or park.

Each evaluation asks the rules first (``_evaluation.py``) and changes state after, so a hook
that raises leaves the buffer as it was. A parked call re-checks everything when woken; when
it leaves the head of its partition's queue, for any reason, it passes the wake-up on.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from operator import attrgetter
from time import monotonic

from . import _evaluation as rules_of
from ._admission import Admission
from ._partition import OpenGroup, PartitionState
from ._status_log import StatusLog, log_waiting, logger, next_due
from ._validation import describe
from ._waiting import Waiter, park, park_with_deadline
from .errors import StalebufError
from .metrics import SampleMetrics
from .records import Batch, EvictionEvent, Group, new_batch, new_group

__all__ = ["EVICTED_UIDS_REMEMBERED", "MAX_READMITTED_ROUNDS", "Sampling"]

#: How many uids of groups evicted in flight the buffer remembers (most recent first), so that a
#: producer's late call on one raises GroupEvictedError rather than UnknownGroupError.
EVICTED_UIDS_REMEMBERED = 65_536

#: How many eviction rounds in a row one ``sample`` runs when each evicts only groups that
#: ``on_evict`` added during that sample, before it raises: re-admitting a stale group under a
#: new uid would otherwise loop forever.
MAX_READMITTED_ROUNDS = 1_000

_uid_of = attrgetter("uid")
#: Runs an iterator to its end in C: unregistering a batch of 64 groups costs no Python loop.
_consume = deque[object](maxlen=0).extend


class Sampling(Admission):
    """The consumer side of ``ReplayBuffer``: evaluation, eviction, parking."""

    def _evaluate(
        self, part: PartitionState, global_steps: int, batch_size: int, metrics: SampleMetrics
    ) -> list[Group] | None:
        """Evict what must go, then take a batch if one may be returned; else None.

        Eviction repeats until a round evicts nothing, because ``on_evict`` may finish or
        fail groups (a stale one must not slip into the batch; a failed one must not wait
        for an unrelated wake-up). Each step asks the rules first and changes state after.
        """
        self._evaluations += 1
        rules = self._rules
        ready = part.ready
        if (
            self._plain_rules
            and not part.failed
            and not part.evict_in_flight
            and (
                not rules.drops
                or part.exempt
                or not ready.count
                or ready.steps[0] >= global_steps + 1 - self._stale_span  # the oldest is kept
            )
        ):
            # The common case, asked inline: the default rules and nothing to evict. The loop
            # below gives the same answer (no stale step, no failure; the oldest groups).
            if ready.count < batch_size or not (
                rules.drops or part.exempt or rules_of.gate_open(rules, part, global_steps)
            ):
                return None
            metrics.oldest_first = True
            return self._take_batch(part, None, global_steps, batch_size)
        # Groups from seq readmitted_from on were added by on_evict during this sample (_readmitted_rounds).
        readmitted_from, evicted_before, readmitted_rounds = self._next_seq, frozenset[str](), 0
        left = False  # whether any group left: admission slots to hand out
        while True:
            stale = self._stale_steps(part, global_steps)
            stale_in_flight = rules_of.stale_in_flight_steps(rules, part, global_steps)
            if not stale and not stale_in_flight and not part.failed:
                break
            if evicted_before:
                readmitted_rounds = self._readmitted_rounds(
                    part, stale, stale_in_flight, readmitted_from, evicted_before, readmitted_rounds
                )
            # State changes from here on: the call has gone through, so the clock moves now
            # (a hook that raised above left everything, the clock included, as it was).
            self._advance_clock(part.name, global_steps)
            events = self._evict(part, global_steps, stale, stale_in_flight, metrics)
            left = True
            if part.producers:  # slots freed: wake before on_evict runs, which may raise
                self._wake_producer(part)
            evicted_before = frozenset(group.uid for event in events for group in event.groups)
            self._emit(events)
            self._check_open()  # on_evict may have closed the buffer
        chosen, oldest = rules_of.choose_batch(rules, part, global_steps, batch_size)
        if chosen is None:
            if left and part.producers:
                self._wake_producer(part)
            return None
        metrics.oldest_first = oldest
        return self._take_batch(part, None if oldest else chosen, global_steps, batch_size)

    def _stale_steps(self, part: PartitionState, global_steps: int) -> list[int]:
        """The dispatch steps, oldest first, whose ready groups the drop rule evicts now."""
        rules = self._rules
        if self._plain_rules:  # the default rule: stale iff p < g + 1 - T*S, no call per step
            if not rules.drops or part.exempt:
                return []
            return part.ready.steps_before(global_steps + 1 - self._stale_span)
        return rules_of.stale_steps(rules, part, global_steps)

    def _take_batch(
        self, part: PartitionState, chosen: list[Group] | None, global_steps: int, batch_size: int
    ) -> list[Group]:
        """Remove and return the batch: ``chosen``, or the ``batch_size`` oldest groups if None."""
        groups = part.take_sampled(chosen, batch_size)
        _consume(map(self._groups.__delitem__, map(_uid_of, groups)))
        if global_steps > part.last_sampled:
            part.last_sampled = global_steps
        if part.producers:
            self._wake_producer(part)
        return groups

    def _evict(
        self,
        part: PartitionState,
        global_steps: int,
        stale: list[int],
        stale_in_flight: list[int],
        metrics: SampleMetrics,
    ) -> list[EvictionEvent]:
        """Evict what the rules chose (nothing here raises); return the events to report."""
        events: list[EvictionEvent] = []
        if part.failed:
            failed = part.take_failed()
            metrics.failed_groups += len(failed)
            events.append(self._evicted(part, "failure", failed, global_steps))
        if stale or stale_in_flight:
            dropped = part.take_stale(stale)
            if stale_in_flight:
                in_flight = self._in_flight_records(
                    part, part.take_stale_in_flight(stale_in_flight), global_steps
                )
                metrics.in_flight_groups += len(in_flight)
                dropped = sorted(dropped + in_flight, key=lambda group: group.dispatch_step)
            metrics.add_dropped(dropped, global_steps)
            events.append(self._evicted(part, "stale", dropped, global_steps))
        return events

    def _in_flight_records(
        self, part: PartitionState, groups: list[OpenGroup], global_steps: int
    ) -> list[Group]:
        """Records of groups evicted in flight; remember their uids and tell their watchers."""
        # The sample evicting them moves the clock to its step (once it goes through).
        clock, now = max(self._clocks.get(part.name, 0), global_steps), monotonic()
        remembered = self._evicted_in_flight
        records = []
        for group in groups:
            records.append(
                new_group(
                    group.uid,
                    part.name,
                    group.dispatch_step,
                    group.status,
                    group.tags,
                    tuple(group.trajectories.values()),
                    max(clock, group.dispatch_step),
                    now - group.admitted_at,
                )
            )
            remembered[group.uid] = None
            if group.watchers:
                for watcher in group.watchers:
                    watcher()
        while len(remembered) > EVICTED_UIDS_REMEMBERED:
            remembered.popitem(last=False)
        return records

    @classmethod
    def _readmitted_rounds(
        cls,
        part: PartitionState,
        stale: list[int],
        stale_in_flight: list[int],
        readmitted_from: int,
        evicted_before: frozenset[str],
        rounds: int,
    ) -> int:
        """Return how many rounds in a row, this one included, evict only groups ``on_evict``
        added during this sample; refuse the round that reaches the bound (they stay).

        Counting from the sample's first round, not the round before: a group ``on_evict``
        added two rounds back would otherwise reset the count each round, and the loop run on.
        A round that evicts a group older than the sample resets it: those are finite."""
        if not cls._check_not_readmitted(part, stale, stale_in_flight, readmitted_from, evicted_before):
            return 0
        if rounds + 1 >= MAX_READMITTED_ROUNDS:
            raise StalebufError(
                f"on_evict added groups to partition {describe(part.name)} that were evicted again at "
                f"once, {MAX_READMITTED_ROUNDS} rounds in a row (stale at their dispatch step, or failed "
                "under failure_strategy='evict'), so sample would never finish; the last ones stay in "
                "the buffer. Re-admit at the current step instead."
            )
        return rounds + 1

    @staticmethod
    def _check_not_readmitted(
        part: PartitionState,
        stale: list[int],
        stale_in_flight: list[int],
        readmitted_from: int,
        evicted_before: frozenset[str],
    ) -> bool:
        """Return whether this round would evict only groups ``on_evict`` added during this
        sample (from ``readmitted_from`` on); refuse it if they are exactly what the round before
        evicted (same uids): it would loop forever. They stay in the buffer."""
        buckets, in_flight = part.ready.buckets, part.in_flight.groups
        entries = [(seq, group.uid) for step in stale for seq, group in buckets[step].live_entries()]
        entries += [(group.seq, uid) for step in stale_in_flight for uid, group in in_flight[step].items()]
        entries += [(seq, group.uid) for _, seq, group in part.failed]
        if not all(seq >= readmitted_from for seq, _ in entries):
            return False
        if all(uid in evicted_before for _, uid in entries):
            raise StalebufError(
                f"on_evict re-admitted groups of partition {describe(part.name)} that are evicted again "
                "at once "
                "(stale at their dispatch step, or failed under failure_strategy='evict'), so sample "
                "would never finish; they stay in the buffer. Re-admit at the current step instead."
            )
        return True

    def _evicted(
        self, part: PartitionState, reason: str, groups: list[Group], global_steps: int
    ) -> EvictionEvent:
        """Unregister evicted ``groups`` and return the event that reports them."""
        _consume(map(self._groups.__delitem__, map(_uid_of, groups)))
        return EvictionEvent(part.name, reason, tuple(groups), global_steps)  # type: ignore[arg-type]

    def _emit(self, events: list[EvictionEvent]) -> None:
        """Call ``on_evict`` for every event; re-raise the first error after all were called.

        BaseExceptions (KeyboardInterrupt, cancellation) too: every evicted group was counted,
        so every event is delivered before anything propagates.
        """
        callback = self._on_evict
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

    def _result(
        self,
        part: PartitionState,
        global_steps: int,
        groups: list[Group],
        metrics: SampleMetrics,
        wait_seconds: float,
    ) -> tuple[Batch, dict[str, float]]:
        batch = new_batch(part.name, global_steps, tuple(groups), self._sync_step)
        admission = None
        if part.cap is not None:
            # The batch is already taken: a policy hook that raises here must not lose it, so
            # the error is logged and the metric reports NaN (unknown).
            try:
                free: float = self._free_slots(part) or 0
            except Exception:
                logger.exception("a staleness policy hook raised while counting free admission slots")
                free = math.nan
            admission = (free, self._take_producer_wait(part))
        return batch, metrics.render(
            part.name, groups, global_steps, self._sync_step, wait_seconds, admission
        )

    # -- waiting ------------------------------------------------------------------------

    def _leave(self, part: PartitionState, waiter: Waiter) -> None:
        """Take ``waiter`` out of its queue; if it was the head, pass the turn on."""
        waiters = part.waiters
        if waiters and waiters[0] is waiter:
            waiters.popleft()
            if waiters:
                self._wake_head(part)  # whether we succeeded or not
        elif waiter in waiters:  # not there if dropped as abandoned
            waiters.remove(waiter)

    async def _wait_for_batch(
        self,
        part: PartitionState,
        global_steps: int,
        batch_size: int,
        timeout: float | None,
        metrics: SampleMetrics,
    ) -> tuple[list[Group], float]:
        """Park in ``part``'s queue until a batch may be taken; return it and the seconds waited.

        Raises:
            TimeoutError: ``timeout`` passed first.
            BufferClosedError: the buffer was closed meanwhile.
        """
        binding = self._binding
        binding.bind()
        waiter = binding.new_waiter(global_steps, batch_size)
        started = waiter.now()
        interval = self._status_interval
        timer_logs = interval is not None and binding.on_asyncio
        if timer_logs:
            if self._status_log is None:
                self._status_log = StatusLog(interval, self._partitions.values())  # type: ignore[arg-type]
            self._status_log.watch(waiter, started)

        def attempt() -> list[Group] | None:
            if self._closed:
                self._check_open()
            if part.waiters[0] is not waiter:
                return None
            return self._evaluate(part, global_steps, batch_size, metrics)

        part.waiters.append(waiter)  # from here on, the finally below must remove it
        try:
            if timeout is None and (interval is None or timer_logs):
                groups = await park(waiter, attempt)  # no deadline: no cancel scope
            else:
                groups = await self._park_with_deadlines(part, waiter, attempt, started, timeout, timer_logs)
        finally:
            self._leave(part, waiter)
        return groups, waiter.now() - started

    async def _park_with_deadlines(
        self,
        part: PartitionState,
        waiter: Waiter,
        attempt: Callable[[], list[Group] | None],
        started: float,
        timeout: float | None,
        timer_logs: bool,
    ) -> list[Group]:
        """Park under a deadline: raise TimeoutError at ``timeout`` and, where no loop timer
        does it, log a status line every interval."""
        backend = self._binding.backend
        assert backend is not None  # bound before any wait
        interval = self._status_interval
        deadline = math.inf if timeout is None else started + timeout
        next_log = math.inf if timer_logs or interval is None else started + interval

        def log_line(now: float) -> float:
            nonlocal next_log
            log_waiting(part, waiter, next_log - started)
            next_log = next_due(next_log, now, interval)  # type: ignore[arg-type]
            return next_log

        groups = await park_with_deadline(waiter, attempt, backend, deadline, log_line, next_log)
        if groups is None:
            raise TimeoutError(
                f"no batch of {waiter.batch_size} in partition {describe(part.name)} within {timeout} s"
            )
        return groups
