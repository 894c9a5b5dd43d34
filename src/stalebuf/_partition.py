"""What the group store keeps for one partition: its indexes, its failed groups, its counters.

A :class:`PartitionState` only records what happened (the rule book decides, the consumer and
admission own the queues); only the group store that owns it writes it.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Mapping
from operator import attrgetter

from ._index import InFlightIndex, ReadyIndex
from ._judged_index import JudgedEntry, JudgedIndex
from ._lazy_group import LazyGroup
from ._open_group import OpenGroup
from ._stored import count_trajectories, stored_trajectories
from ._token_ledger import TokenLedger, group_tokens
from ._versions import record_span
from .records import Group, Status

__all__ = ["BY_DISPATCH", "BY_HEAD", "BY_TAIL", "GENERATION_WINDOW", "MEDIAN_AFTER", "PartitionState"]

#: Which version a partition's ready groups are judged by (the rule book's answer): none
#: differs from the dispatch step for eviction (``wait``, exempt), the head (``drop``), the
#: tail (``mask``).
BY_DISPATCH, BY_HEAD, BY_TAIL = 0, 1, 2

#: How many generation times of groups that finished uncut in flight a partition keeps, and how
#: many it needs before ``group_deadline_factor`` gives a deadline.
GENERATION_WINDOW, MEDIAN_AFTER = 256, 16

_PENDING, _FINISHED, _FAILURE = Status.PENDING, Status.FINISHED, Status.FAILURE
_status_of = attrgetter("status")


def _in_flight(in_flight: dict[int, dict[str, OpenGroup]], group: OpenGroup) -> bool:
    """Whether ``group`` (by identity) is still in flight in the index ``in_flight``."""
    at_step = in_flight.get(group.head)
    return at_step is not None and at_step.get(group.uid) is group


class PartitionState:
    """Everything the group store tracks for one partition.

    ``exempt``, ``evict_failures``, ``evict_in_flight`` and ``cap`` (admission control's
    per-dispatch-step bound ``b``, None without it) are the rule book's answers for this
    partition, asked once when it is created, and so is ``judge``: which version its ready
    groups are judged by (:data:`BY_DISPATCH`, :data:`BY_HEAD` or :data:`BY_TAIL`). Under
    admission control it keeps ``resident_at``, the resident groups per dispatch step, which
    admission reads. In-flight groups are indexed by their head; ready groups by dispatch step,
    plus ``judged`` (a :class:`~stalebuf._judged_index.JudgedIndex`) while some ready group is
    judged by another version than its dispatch step. ``ledger`` (a ``TokenLedger``, or None) counts
    tokens for the token caps; ``gated``: whether admission control or a token cap applies.
    """

    __slots__ = (
        "_sorted_generation",
        "admitted_groups",
        "admitted_tokens",
        "admitted_trajectories",
        "cap",
        "cells",
        "cut_groups",
        "cut_trajectories",
        "deadlines",
        "evict_failures",
        "evict_in_flight",
        "evicted_failure_groups",
        "evicted_failure_trajectories",
        "evicted_filtered_groups",
        "evicted_filtered_trajectories",
        "evicted_in_flight_groups",
        "evicted_restart_groups",
        "evicted_restart_trajectories",
        "evicted_stale_groups",
        "evicted_stale_trajectories",
        "evicted_tokens",
        "exempt",
        "failed",
        "failure",
        "finished",
        "gated",
        "generation",
        "in_flight",
        "judge",
        "judged",
        "key",
        "ledger",
        "masked_tokens",
        "name",
        "pending",
        "ready",
        "ready_tokens",
        "recent_cuts",
        "reissued_groups",
        "reissued_tokens",
        "reissued_trajectories",
        "resident_at",
        "running",
        "sampled_groups",
        "sampled_tokens",
        "sampled_trajectories",
        "span",
        "starts",
        "task",
        "threshold",
        "tokens",
        "trajectories",
    )

    def __init__(
        self,
        name: str,
        *,
        exempt: bool,
        evict_failures: bool,
        evict_in_flight: bool = False,
        cap: int | None = None,
        deadlines: bool = False,
        judge: int = BY_DISPATCH,
        threshold: int | None = None,
        span: int = 1,
        task: str | None = None,
        ledger: TokenLedger | None = None,
    ) -> None:
        self.name = name
        # A partition of a task mixture is a parent with one cell (a PartitionState of its
        # own, ``task`` set) per task: the groups, indexes and counters live in the cells, and
        # the parent only names them (``cells``). ``key`` tells cells apart in admission's queues.
        self.task = task
        self.key: str | tuple[str, str] = name if task is None else (name, task)
        self.cells: dict[str, PartitionState] | None = None
        self.threshold = threshold  # T of its groups (the task's, in a cell); span = T*S
        self.span = span
        self.judge = BY_DISPATCH if exempt else judge
        self.judged: JudgedIndex | None = None
        self.exempt = exempt
        self.evict_failures = evict_failures and not exempt
        self.evict_in_flight = evict_in_flight and not exempt
        self.cap = None if exempt else cap
        self.ready = ReadyIndex()
        self.in_flight = InFlightIndex()
        self.failed: list[tuple[int, int, Group]] = []  # (step, seq, group): failed, to evict
        # Resident groups per dispatch step, kept only under admission control. Every group
        # leaves through _forget or _release, which decrement it: it cannot drift from the truth.
        self.resident_at: dict[int, int] | None = None if self.cap is None else {}
        self.ledger = ledger = None if exempt else ledger  # every transition below keeps it too
        self.gated = self.cap is not None or (ledger is not None and ledger.gates)
        # Group deadlines (only when the rules give this partition any): the in-flight groups by
        # when their deadline clock started (a lazily cleaned heap), the generation times of the
        # last 256 groups that finished uncut in flight, and the cuts since the last batch.
        self.deadlines = deadlines and not exempt
        self.starts: list[tuple[float, int, OpenGroup]] = []
        self.generation: deque[float] = deque(maxlen=GENERATION_WINDOW)
        # Kept sorted too: the median in O(1) (sorting the window per finish cost 13 µs).
        self._sorted_generation: list[float] = []
        self.recent_cuts: list[float] = [0, 0, 0.0]  # groups, trajectories, generation seconds
        self.pending = self.running = self.finished = self.failure = self.trajectories = self.cut_groups = 0
        self.cut_trajectories = self.admitted_groups = self.admitted_trajectories = self.sampled_groups = 0
        self.sampled_trajectories = 0
        self.evicted_stale_groups = self.evicted_stale_trajectories = self.evicted_in_flight_groups = 0
        self.evicted_failure_groups = self.evicted_failure_trajectories = 0
        self.evicted_filtered_groups = self.evicted_filtered_trajectories = self.evicted_restart_groups = 0
        self.evicted_restart_trajectories = self.reissued_groups = self.reissued_trajectories = 0
        # Tokens: resident, and the conservation law's terms; masked ones are a subset of the sampled.
        self.tokens = self.admitted_tokens = self.sampled_tokens = self.masked_tokens = 0
        self.evicted_tokens = self.reissued_tokens = self.ready_tokens = 0  # ready: in ``ready``

    # -- in-flight groups -------------------------------------------------------------

    def admit(self, group: OpenGroup) -> None:
        """Record a new PENDING group."""
        self.pending += 1
        self.admitted_groups += 1
        step = group.dispatch_step
        self.in_flight.add(group.head, group.uid, group)
        resident_at = self.resident_at
        if resident_at is not None:
            resident_at[step] = resident_at.get(step, 0) + 1
        if self.ledger is not None:
            self.ledger.reserve(step)

    def move(self, group: OpenGroup, head: int) -> None:
        """File the in-flight ``group`` under its new ``head`` (a put or a start version moved it)."""
        in_flight = self.in_flight
        in_flight.remove(group.head, group.uid)
        group.head = head
        in_flight.add(head, group.uid, group)

    # -- deadlines ----------------------------------------------------------------------

    def track(self, group: OpenGroup) -> None:
        """Remember when the in-flight ``group``'s deadline clock started (with deadlines)."""
        starts = self.starts
        if len(starts) > 2 * (self.pending + self.running) + 64:
            # Ended groups leave the heap from its top only: behind one group still in flight,
            # they (and their payloads) would stay for as long as its deadline. Dropping them
            # once they outnumber the groups in flight costs O(1) per group, amortised.
            in_flight = self.in_flight.groups
            starts = self.starts = [entry for entry in starts if _in_flight(in_flight, entry[2])]
            heapq.heapify(starts)
        heapq.heappush(starts, (group.started_at, group.seq, group))

    def first_started(self) -> OpenGroup | None:
        """The in-flight group whose deadline clock started first (ended ones are dropped)."""
        starts, in_flight = self.starts, self.in_flight.groups
        while starts:
            group = starts[0][2]
            if _in_flight(in_flight, group):
                return group
            heapq.heappop(starts)
        return None

    def record_generation(self, seconds: float) -> None:
        """Count the generation time of a group that finished uncut, seen in flight."""
        window, ordered = self.generation, self._sorted_generation
        if len(window) == GENERATION_WINDOW:  # the oldest leaves the window
            del ordered[bisect.bisect_left(ordered, window[0])]
        window.append(seconds)
        bisect.insort(ordered, seconds)

    def median_generation(self) -> float | None:
        """The median of the recorded generation times; None before :data:`MEDIAN_AFTER`."""
        times = self._sorted_generation
        if len(times) < MEDIAN_AFTER:
            return None
        middle = len(times) // 2
        return times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2

    def take_recent_cuts(self) -> tuple[int, int, float]:
        """Return the cuts since the last call (groups, trajectories, generation seconds)."""
        groups, trajectories, seconds = self.recent_cuts
        self.recent_cuts = [0, 0, 0.0]
        return int(groups), int(trajectories), seconds

    def count_cut(self, trajectories: int, seconds: float) -> None:
        """Count a group cut at its deadline (holding ``trajectories``, ``seconds`` old)."""
        self.cut_groups += 1
        self.cut_trajectories += trajectories
        recent = self.recent_cuts
        recent[0], recent[1], recent[2] = recent[0] + 1, recent[1] + trajectories, recent[2] + seconds

    def restore_counters(self, counters: Mapping[str, int], reissued: tuple[int, int, int]) -> None:
        """Set the cumulative counters to saved ones, plus ``reissued`` (groups, trajectories,
        tokens) that a restore reissued."""
        for key, value in counters.items():
            setattr(self, key, value)
        self.reissued_groups += reissued[0]
        self.reissued_trajectories += reissued[1]
        self.reissued_tokens += reissued[2]

    def count_restarted(self, groups: list[Group]) -> None:
        """Count in-flight ``groups`` a restore evicted (never put back)."""
        self.evicted_restart_groups += len(groups)
        self.evicted_restart_trajectories += sum(map(count_trajectories, groups))
        self.evicted_tokens += sum(map(group_tokens, groups))

    def start(self) -> None:
        """Record that a PENDING group became RUNNING."""
        self.pending -= 1
        self.running += 1

    def add_trajectories(self, count: int, tokens: int = 0) -> None:
        """Record ``count`` trajectories (of ``tokens`` tokens) put into an in-flight group."""
        self.trajectories += count
        self.admitted_trajectories += count
        self.tokens += tokens
        self.admitted_tokens += tokens

    def terminate(self, group: OpenGroup, record: Group) -> None:
        """Move ``group`` out of flight; ``record`` is its terminal form."""
        if group.status is _PENDING:
            self.pending -= 1
        else:
            self.running -= 1
        step = group.dispatch_step
        self.in_flight.remove(group.head, group.uid)
        if self.ledger is not None:  # its reservation settles to its tokens (admission wakes producers)
            self.ledger.settle(step, 0 if group.span is None else group.span.tokens)
        if record.status is _FINISHED:
            self.finished += 1
        else:
            self.failure += 1
            if self.evict_failures:
                self.failed.append((step, group.seq, record))
                return
        if group.span is not None:
            self.ready_tokens += group.span.tokens
        judge = self.judge
        if judge == BY_DISPATCH or (group.span is None and group.start_version == step):
            if self.judged is None:
                self.ready.push(step, group.seq, record)
                return
            key = step
        else:
            key = group.head if judge == BY_HEAD else group.tail_now()
        self._push_judged(step, group.seq, record, key)

    def filter_out(self, group: OpenGroup) -> None:
        """Move ``group`` out of flight as evicted by a filter (it became FINISHED, and a
        filter rejected it): it never becomes sampleable, its slot is free at once."""
        if group.status is _PENDING:
            self.pending -= 1
        else:
            self.running -= 1
        self.in_flight.remove(group.head, group.uid)
        self._release(group.dispatch_step, self.ledger)
        count = len(group.trajectories)
        tokens = 0 if group.span is None else group.span.tokens
        self.trajectories -= count
        self.tokens -= tokens
        self.evicted_filtered_groups += 1
        self.evicted_filtered_trajectories += count
        self.evicted_tokens += tokens

    def add_filtered(self, group: Group) -> None:
        """Count a group written FINISHED in one call that a filter rejected: admitted and
        evicted at once, never resident."""
        count = count_trajectories(group)
        tokens = 0 if group.__class__ is LazyGroup else record_span(group.start_version, group._peek())[2]
        self.admitted_groups += 1
        self.admitted_trajectories += count
        self.admitted_tokens += tokens
        self.evicted_filtered_groups += 1
        self.evicted_filtered_trajectories += count
        self.evicted_tokens += tokens

    def _push_judged(self, step: int, seq: int, record: Group, key: int) -> None:
        """Add a ready group judged by version ``key`` (keeping ``judged`` once one differs)."""
        judged = self.judged
        if judged is None:
            if key == step:
                self.ready.push(step, seq, record)
                return
            # Every group already ready is judged by its dispatch step.
            judged = self.judged = JudgedIndex(self.ready.entries())
        self.ready.push(step, seq, record)
        judged.push(key, seq, record)

    def add_terminal(self, group: Group, seq: int) -> None:
        """Record a group that arrives already terminal (``put_group`` of a new group, or a
        restored one): what admit, put and terminate would record, without a detour through
        flight."""
        step = group.dispatch_step
        count = count_trajectories(group)
        self.admitted_groups += 1
        self.admitted_trajectories += count
        self.trajectories += count
        tokens = 0
        if group.__class__ is LazyGroup:
            head = tail = group.start_version
        else:
            head, tail, tokens = record_span(group.start_version, group._peek())
            self.tokens += tokens
            self.admitted_tokens += tokens
            if self.ledger is not None:
                self.ledger.add(step, tokens)
        resident_at = self.resident_at
        if resident_at is not None:
            resident_at[step] = resident_at.get(step, 0) + 1
        if group.status is _FINISHED:
            self.finished += 1
        else:
            self.failure += 1
            if self.evict_failures:
                self.failed.append((step, seq, group))
                return
        self.ready_tokens += tokens
        judge = self.judge
        key = step if judge == BY_DISPATCH else head if judge == BY_HEAD else tail
        if key == step and self.judged is None:  # the common case, without the call
            self.ready.push(step, seq, group)
        else:
            self._push_judged(step, seq, group, key)

    def take_stale_in_flight(self, steps: list[int]) -> list[OpenGroup]:
        """Evict and return the in-flight groups of the oldest ``steps`` (the policy chose them)."""
        groups = self.in_flight.pop_steps(steps)
        trajectories = running = tokens = 0
        for group in groups:
            trajectories += len(group.trajectories)
            if group.span is not None:
                tokens += group.span.tokens
            if group.status is not _PENDING:
                running += 1
            self._release(group.dispatch_step, self.ledger)
        self.tokens -= tokens
        self.evicted_tokens += tokens
        self.running -= running
        self.pending -= len(groups) - running
        self.trajectories -= trajectories
        self.evicted_stale_trajectories += trajectories
        self.evicted_stale_groups += len(groups)
        self.evicted_in_flight_groups += len(groups)
        return groups

    # -- terminal groups leaving ------------------------------------------------------

    def _release(self, step: int, in_flight: TokenLedger | None = None) -> None:
        """Free a group's admission slot at ``step`` (and, for an in-flight group, its token
        reservation in ``in_flight``: its partition's ledger)."""
        if in_flight is not None:
            in_flight.unreserve(step)
        resident_at = self.resident_at
        if resident_at is not None:
            count = resident_at[step] - 1
            if count:
                resident_at[step] = count
            else:
                del resident_at[step]

    def _forget(self, groups: list[Group]) -> tuple[int, int]:
        """Drop terminal ``groups`` from the resident counts (and the judged index); return
        their trajectory and token counts."""
        # C-level loops: this runs for every sampled batch.
        trajectories = sum(map(len, map(stored_trajectories, groups)))
        # No resident failure, none to count: a batch of 64 then skips reading 64 statuses.
        failures = list(map(_status_of, groups)).count(_FAILURE) if self.failure else 0
        if self.resident_at is not None:
            for group in groups:
                self._release(group.dispatch_step)
        self.finished -= len(groups) - failures
        self.failure -= failures
        self.trajectories -= trajectories
        judged = self.judged
        if judged is not None:
            judged.forget(groups)
            if not self.ready.count:
                self.judged = None  # back to the buckets alone
        ledger = self.ledger  # (it refunds their tokens; else, none resident: none leave)
        tokens = ledger.forget(groups) if ledger else sum(map(group_tokens, groups)) if self.tokens else 0
        self.tokens -= tokens
        return trajectories, tokens

    def take_failed(self) -> list[Group]:
        """Evict and return every failed group awaiting eviction, oldest first."""
        entries = self.failed
        entries.sort(key=lambda entry: entry[:2])
        self.failed = []
        groups = [entry[2] for entry in entries]
        trajectories, tokens = self._forget(groups)
        self.evicted_failure_trajectories += trajectories
        self.evicted_tokens += tokens
        self.evicted_failure_groups += len(groups)
        return groups

    def take_stale(self, steps: list[int], judged: list[JudgedEntry]) -> list[Group]:
        """Evict and return the ready groups the rules found stale, oldest first: those of the
        oldest ``steps`` (buckets judged by dispatch step), or the ``judged`` entries."""
        if judged:
            doomed: dict[int, set[int]] = {}
            for _, _, group in judged:
                doomed.setdefault(group.dispatch_step, set()).add(id(group))
            self.ready.remove(doomed)
            judged.sort(key=lambda entry: (entry[2].dispatch_step, entry[1]))
            groups = [entry[2] for entry in judged]
        else:
            groups = self.ready.pop_steps(steps)
        trajectories, tokens = self._forget(groups)
        self.ready_tokens -= tokens
        self.evicted_stale_trajectories += trajectories
        self.evicted_tokens += tokens
        self.evicted_stale_groups += len(groups)
        return groups

    def take_sampled(self, chosen: list[Group] | None, count: int) -> list[Group]:
        """Remove and return a batch: the ``count`` oldest ready groups when ``chosen`` is None
        (O(count)), else exactly ``chosen`` (O(N)); count them sampled."""
        if chosen is None:
            chosen = self.ready.take_oldest(count)
        else:
            self.ready.take(chosen)
        trajectories, tokens = self._forget(chosen)
        self.ready_tokens -= tokens
        self.sampled_trajectories += trajectories
        self.sampled_tokens += tokens
        self.sampled_groups += len(chosen)
        return chosen

    def count_masked(self, tokens: int) -> None:
        """Count ``tokens`` sampled tokens that the ``mask`` strategy kept out of the loss."""
        self.masked_tokens += tokens

    def oldest_judged(self) -> int:
        """The smallest version a ready group is judged by (there must be one)."""
        judged = self.judged
        if judged is not None:
            oldest = judged.oldest()
            if oldest is not None:
                return oldest
        return self.ready.steps[0]

    # -- admission ----------------------------------------------------------------------

    def resident_at_step(self, step: int) -> int:
        """How many resident groups are tagged ``step`` (only under admission control)."""
        return self.resident_at.get(step, 0) if self.resident_at is not None else 0
