"""The consumer: what ``sample`` does. Evict by the rules until nothing more goes, select, or park.

:class:`Consumer` owns the parked ``sample`` calls (one arrival-ordered queue per partition),
the status reporter, ``on_evict``, the sample observers and, apart, ``wait_for_sampleable``'s.
Each evaluation asks the rules first (``_rules.py``) and changes the store after, so a hook that
raises leaves the buffer as it was. A parked call re-checks everything when woken; when it leaves
the head of its partition's queue, for any reason, it passes the wake-up on (as asyncio does).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from time import monotonic

import anyio

from ._admission import Admission
from ._deadlines import Deadlines
from ._eviction import Eviction
from ._explain import Explainer
from ._filtering import Filtering
from ._group_snapshots import terminal_record
from ._mixture import Mixing
from ._open_group import OpenGroup
from ._partition import PartitionState
from ._partition_stats import buffer_stats
from ._rules import NEEDS_RULES, NO_BATCH, Rules
from ._sample_report import SampleReport
from ._sampleable import SampleableWaits
from ._status_log import StatusLog, log_waiting, logger, next_due
from ._store import GroupStore
from ._token_batches import TokenBatches
from ._waiting import LoopBinding, Waiter, drop_abandoned, park, park_with_deadline
from .errors import BufferClosedError
from .metrics import SampleMetrics
from .records import Batch, EvictionEvent, Group, Status
from .stats import BufferStats

__all__ = ["Consumer", "EvictCallback", "SampleObserver"]

_FINISHED = Status.FINISHED


#: What a parked sample's attempt returns to set its deadline timer again (never a batch: a
#: batch holds at least one group).
_RESCHEDULE: list[Group] = []

EvictCallback = Callable[[EvictionEvent], object]
#: Called with every batch a sample returns and its metrics (see ``observe_samples``).
SampleObserver = Callable[[Batch, Mapping[str, float]], object]


class Consumer:
    """The consumer side of one buffer: evaluation, eviction, waiting and wake-up.

    Attributes (read them; change them only through the methods):
        waiting: the parked ``sample`` calls of each partition, in arrival order.
        sampleable: ``sampleable_count`` and the parked ``wait_for_sampleable`` calls.
        explainer: ``explain_wait`` and the reason a status line gives.
        evaluations: how often a sample evaluated a partition (tests and benchmarks read it
            to prove an idle wait does no work).
    """

    __slots__ = (
        "admission",
        "binding",
        "deadlines",
        "evaluations",
        "eviction",
        "explainer",
        "filtering",
        "filters",
        "mixing",
        "observers",
        "report",
        "rules",
        "sampleable",
        "status_interval",
        "status_log",
        "store",
        "token_batches",
        "waiting",
    )

    def __init__(
        self,
        store: GroupStore,
        admission: Admission,
        rules: Rules,
        binding: LoopBinding,
        on_evict: EvictCallback | None,
        status_interval: float | None,
    ) -> None:
        self.store = store
        self.admission = admission
        self.rules = rules
        self.binding = binding
        self.eviction = Eviction(store, admission, rules, on_evict)
        self.sampleable = SampleableWaits(store, rules)
        self.filtering = Filtering(rules.filters, self.eviction)
        self.filters = bool(rules.filters)  # whether any group is ever filtered (read per group)
        self.deadlines = Deadlines(store, admission, rules, self.filtering)
        self.mixing = Mixing(store, rules)
        self.token_batches = TokenBatches(store, admission, rules, self.eviction, admission.tokens.refuses_at)
        admission.on_new_head(self.notify)  # a blocked head may make a token batch ready
        sampleable, mixing = self.sampleable, self.mixing
        self.explainer = Explainer(store, admission, rules, sampleable, self, mixing, status_interval)
        self.report = SampleReport(store, admission, rules, self.filtering, self.mixing)
        self.status_interval = status_interval
        self.status_log: StatusLog | None = None
        self.waiting: dict[str, deque[Waiter]] = {}
        self.observers: list[SampleObserver] = []
        self.evaluations = 0

    # -- groups ending -------------------------------------------------------------------

    def finish(
        self, group: OpenGroup, status: Status, clock: int, measured: bool = True, timed: float | None = None
    ) -> None:
        """End the in-flight ``group`` with ``status`` (``store.end``'s arguments, ``timed`` its
        ``seconds``): one that finishes is filtered first, and evicted at once if a filter rejects it.

        Raises:
            Exception: what ``on_evict`` raised reporting a filtered group (it is evicted all
                the same), or StalebufError when its refills keep being filtered.
        """
        store, record = self.store, None
        if status is _FINISHED and self.filters and not (part := store.cell_of(group)).exempt:
            record = terminal_record(group, status, clock, timed)
            keep = self.filtering.keeps(part, record)
            if store.groups.get(group.uid) is not group:  # a filter ended the group itself
                return
            if not keep:
                store.filter_out(group, measured)
                self.notify(part)  # it may have held the wait gate; before on_evict, which may raise
                self.filtered(part, (record,))
                return
        part = store.end(group, status, clock, measured, record, timed)
        if part.ledger is not None:  # its token reservation settled: the refund may admit a producer
            self.admission.refunded(part)
        self.notify(part)

    def judge(self, part: PartitionState, record: Group) -> bool:
        """Run the filters on ``record`` (FINISHED, of ``part``); whether it is kept (never raises)."""
        return self.filtering.keeps(part, record)

    def filtered(self, part: PartitionState, records: tuple[Group, ...]) -> None:
        """Report ``records``, just evicted by a filter: their slots are free (wake producers),
        then ``on_evict`` hears of them (see :meth:`Filtering.report`)."""
        clock = self.admission.clocks.get(part.name, 0)
        self.admission.wake(part.name)
        self.filtering.report(EvictionEvent(part.name, "filtered", records, clock))

    # -- wake-ups ------------------------------------------------------------------------

    def notify(self, part: PartitionState) -> None:
        """A group of ``part`` became sampleable (or failed): wake the head waiting sample if
        it may now get a batch or evict something.

        Runs on a producer's path after its state change: a policy hook that raises here must
        not turn the completed call into an error, so the error is logged and the waiter
        woken, to raise it from its own ``sample``.
        """
        if self.sampleable.waiting:  # first: its calls count before the woken sample takes
            self.sampleable.notify(part)
        waiters = self.waiting.get(part.name)
        if not waiters or self.store.closed:
            return
        head = waiters[0]
        if head.abandoned():  # its loop was closed under it: the next live waiter is the head
            drop_abandoned(waiters)
            if not waiters:
                return
            head = waiters[0]
        try:
            if head.token_budget is not None:
                wake = self.token_batches.has_work(part, head.global_steps, head.token_budget)
            elif part.task is None:
                wake = self.rules.has_work_for(part, head.global_steps, head.batch_size)
            else:  # a task's cell: the batch is judged across its partition's cells
                parent = self.store.partitions[part.name]
                wake = self.mixing.has_work(parent, head.global_steps, head.batch_size)
            if not wake and part.deadlines:  # a new head, or a deadline moved earlier: set the timer
                cut_at = self.deadlines.next_cut(part)
                if cut_at is not None and cut_at < head.cut_at:
                    wake = True  # woken, it evaluates and sets its timer again
        except Exception:
            logger.exception("a staleness policy hook raised while checking a waiting sample")
            wake = True
        if wake:
            head.wake()

    def admitted(self, part: PartitionState) -> None:
        """A group of ``part`` (which has deadlines) was admitted: a head sample parked without
        a cut timer (nothing was in flight then) sets one for it."""
        waiters = self.waiting.get(part.name)
        if not waiters or waiters[0].cut_at != math.inf or self.store.closed:
            return
        head = waiters[0]
        try:
            timer = self.deadlines.next_cut(part) is not None  # no deadline yet: no wake-up
        except Exception:  # woken, it asks again and raises it from its own sample
            logger.exception("a deadline hook raised while checking a waiting sample")
            timer = True
        if timer:
            head.wake()  # woken, it evaluates and sets its timer

    def has_live_waiter(self, name: str) -> bool:
        """Whether a ``sample`` that can still run waits on partition ``name``."""
        waiters = self.waiting.get(name)
        if not waiters:
            return False
        drop_abandoned(waiters)
        return bool(waiters)

    def close(self) -> None:
        """Wake every parked call (each raises BufferClosedError from its own ``sample``)."""
        for waiters in self.waiting.values():
            drop_abandoned(waiters, everywhere=True)
            for waiter in waiters:
                waiter.wake()
        self.sampleable.close()

    def count_waiting(self, name: str) -> int:
        """How many live ``sample`` calls wait on partition ``name``."""
        waiters = self.waiting.get(name)
        if not waiters:
            return 0
        drop_abandoned(waiters, everywhere=True)
        return len(waiters)

    def stats(self) -> BufferStats:
        """Return the buffer's snapshot: the store's counts, with the queues of the consumer
        and admission (abandoned waiters, whose loop closed under them, left out)."""
        self.admission.drop_abandoned()
        return buffer_stats(self.store, self.admission, self.filtering, self.mixing, self.count_waiting)

    def subscribe(self, observer: SampleObserver) -> Callable[[], None]:
        """Call ``observer(batch, metrics)`` with every batch returned; return what stops it."""
        observers = self.observers
        observers.append(observer)

        def stop() -> None:
            if observer in observers:
                observers.remove(observer)

        return stop

    def sample_now(
        self,
        part: PartitionState | None,
        name: str,
        global_steps: int,
        batch_size: int,
        metrics: SampleMetrics,
    ) -> tuple[Batch, dict[str, float]] | None:
        """What ``sample`` does before it waits: evaluate (unless an earlier sample waits on
        the partition, which goes first), move the clock once the call went through, and
        return the batch and its metrics, or None.

        Raises:
            Exception: what :meth:`evaluate` raises (the clock not moved then).
        """
        if part is not None and not self.has_live_waiter(name):
            groups = self.evaluate(part, global_steps, batch_size, metrics)
            self.admission.advance(name, global_steps)  # a hook that raised changed nothing
            if groups is not None:
                return self.result(part, global_steps, groups, metrics, 0.0)
            return None
        self.admission.advance(name, global_steps)
        return None

    # -- evaluation ---------------------------------------------------------------------

    def evaluate(
        self, part: PartitionState, global_steps: int, batch_size: int, metrics: SampleMetrics
    ) -> list[Group] | None:
        """Evict what must go, then take a batch if one may be returned; else None.

        Raises:
            StalebufError: the policy's ``select`` returned an invalid choice, or ``on_evict``
                re-admits groups that are evicted again at once.
            Exception: whatever a policy hook or ``on_evict`` raised, the buffer consistent.
        """
        self.evaluations += 1
        if part.deadlines and self.deadlines.cut_overdue(part) and self.sampleable.waiting:
            self.sampleable.notify(part)  # cut groups are terminal: sampleable, maybe
        if metrics.token_budget is not None:
            return self.token_batches.evaluate(part, global_steps, metrics)
        if part.cells is not None:
            return self._evaluate_mixture(part, global_steps, batch_size, metrics)
        verdict = self.rules.quick_verdict(part, global_steps, batch_size)
        if verdict != NEEDS_RULES:  # the common case: the default rules and nothing to evict
            if verdict == NO_BATCH:
                return None
            metrics.oldest_first = True
            return self._take_batch(part, None, global_steps, batch_size)
        left = self.eviction.run(part, global_steps, metrics)
        chosen, oldest = self.rules.choose_batch(part, global_steps, batch_size)
        if chosen is None:
            if left:
                self.admission.wake(part.name)
            return None
        metrics.oldest_first = oldest
        return self._take_batch(part, None if oldest else chosen, global_steps, batch_size)

    def _evaluate_mixture(
        self, part: PartitionState, global_steps: int, batch_size: int, metrics: SampleMetrics
    ) -> list[Group] | None:
        """:meth:`evaluate` for a partition under a task mixture: evict in every task's cell,
        then take each task's share of a batch if one may be returned (see ``_mixture.py``)."""
        left = False
        for cell in part.cells.values():  # type: ignore[union-attr]  # a mixture's parent
            left = self.eviction.run(cell, global_steps, metrics) or left
        mixing = self.mixing
        if not mixing.ready(part, global_steps, batch_size):
            if left:
                self.admission.wake(part.name)
            return None
        groups = mixing.take(part, mixing.choose(part, global_steps, batch_size), batch_size)
        self.admission.batch_taken(part.name, global_steps)
        metrics.oldest_first = False
        return groups

    def _take_batch(
        self, part: PartitionState, chosen: list[Group] | None, global_steps: int, batch_size: int
    ) -> list[Group]:
        """Remove and return the batch: ``chosen``, or the ``batch_size`` oldest groups if None."""
        groups = self.store.take_batch(part, chosen, batch_size)
        self.admission.batch_taken(part.name, global_steps)
        return groups

    def result(
        self,
        part: PartitionState,
        global_steps: int,
        groups: list[Group],
        metrics: SampleMetrics,
        wait_seconds: float,
    ) -> tuple[Batch, dict[str, float]]:
        """Build what ``sample`` returns for ``groups`` and tell the observers.

        An observer that raises is logged, never turned into an error: the batch is taken.
        """
        batch, rendered = self.report.render(part, global_steps, groups, metrics, wait_seconds)
        for observer in self.observers:
            try:
                observer(batch, rendered)
            except Exception:
                logger.exception("a sample observer raised; the batch is returned all the same")
        return batch, rendered

    # -- waiting ------------------------------------------------------------------------

    def _leave(self, waiters: deque[Waiter], part: PartitionState, waiter: Waiter) -> None:
        """Take ``waiter`` out of its queue; if it was the head, pass the turn on."""
        if waiters and waiters[0] is waiter:
            waiters.popleft()
            if waiters:
                self.notify(part)  # whether we succeeded or not
        elif waiter in waiters:  # not there if dropped as abandoned
            waiters.remove(waiter)

    async def wait_for_batch(
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
            Exception: what :meth:`evaluate` raises.
        """
        binding = self.binding
        binding.bind()
        waiter = binding.new_waiter(global_steps, batch_size)
        waiter.token_budget = metrics.token_budget
        waiter.started = started = waiter.now()  # (explain_wait reads how long it waited)
        interval = self.status_interval
        timer_logs = interval is not None and binding.on_asyncio
        if timer_logs:
            if self.status_log is None:
                self.status_log = StatusLog(interval, self.waiting, self.store.partitions, self.explainer)  # type: ignore[arg-type]
            self.status_log.watch(waiter, started)
        waiters = self.waiting.get(part.name)
        if waiters is None:
            waiters = self.waiting[part.name] = deque()
        store = self.store

        def attempt() -> list[Group] | None:
            if store.closed:
                raise BufferClosedError("the buffer is closed")
            if waiters[0] is not waiter:
                return None
            return self.evaluate(part, global_steps, batch_size, metrics)

        waiters.append(waiter)  # from here on, the finally below must remove it
        try:
            if part.deadlines:
                groups = await self._park_with_cuts(part, waiter, attempt, started, timeout, timer_logs)
            elif timeout is None and (interval is None or timer_logs):
                groups = await park(waiter, attempt)  # no deadline: no cancel scope
            else:
                groups = await self._park_with_deadlines(part, waiter, attempt, started, timeout, timer_logs)
        finally:
            self._leave(waiters, part, waiter)
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
        backend = self.binding.backend
        assert backend is not None  # bound before any wait
        interval = self.status_interval
        deadline = math.inf if timeout is None else started + timeout
        next_log = math.inf if timer_logs or interval is None else started + interval

        def log_line(now: float) -> tuple[float, bool]:
            nonlocal next_log
            log_waiting(part, waiter, next_log - started, interval, self.explainer.reason)  # type: ignore[arg-type]
            next_log = next_due(next_log, now, interval)  # type: ignore[arg-type]
            return next_log, False

        groups = await park_with_deadline(waiter, attempt, backend, deadline, log_line, next_log)
        if groups is None:
            raise waiter.timed_out(part.name, timeout)
        return groups

    async def _park_with_cuts(
        self,
        part: PartitionState,
        waiter: Waiter,
        attempt: Callable[[], list[Group] | None],
        started: float,
        timeout: float | None,
        timer_logs: bool,
    ) -> list[Group]:
        """Park on a partition with group deadlines: as :meth:`_park_with_deadlines`, and the
        head also wakes when the first straggler reaches its deadline, to cut it and evaluate.
        Every wake-up that gets no batch sets the timer again, and a producer whose change moves
        that time earlier wakes it, so the cut is on time without any background task.

        Raises:
            TimeoutError: ``timeout`` passed first.
            Exception: what :meth:`evaluate` raises, or a deadline hook.
        """
        backend = self.binding.backend
        assert backend is not None  # bound before any wait
        interval = self.status_interval
        deadline = math.inf if timeout is None else started + timeout
        next_log = math.inf if timer_logs or interval is None else started + interval

        def attempt_or_reschedule() -> list[Group] | None:
            # Every wake-up evaluates, and one that gets no batch sets the timer again: the
            # evaluation (a cut, an on_evict refill), or what woke it (a new head, a median that
            # appeared), may have moved the first deadline, and nothing else would re-arm it.
            groups = attempt()
            if groups is None:
                waiter.arm()
                return _RESCHEDULE
            return groups

        while True:
            now = backend.current_time()
            cut_at = self.deadlines.next_cut(part) if self.waiting[part.name][0] is waiter else None
            waiter.cut_at = math.inf if cut_at is None else cut_at
            wake_at = now + max(0.0, waiter.cut_at - monotonic())  # monotonic() to the loop's clock
            with anyio.CancelScope(deadline=min(deadline, next_log, wake_at)):
                groups = await park(waiter, attempt_or_reschedule)
                if groups is not _RESCHEDULE:
                    return groups
                continue
            now = backend.current_time()
            if now >= deadline:
                raise waiter.timed_out(part.name, timeout)
            waiter.rearm_if_cancelled()  # the scope's cancellation may have cancelled the signal
            if now >= next_log:
                log_waiting(part, waiter, next_log - started, interval, self.explainer.reason)  # type: ignore[arg-type]
                next_log = next_due(next_log, now, interval)  # type: ignore[arg-type]
            if now >= wake_at:  # a straggler's deadline: cut it and evaluate (as the head)
                taken = attempt()
                if taken is not None:
                    return taken
