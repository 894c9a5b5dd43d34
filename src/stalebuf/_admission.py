"""Admission control: the dispatch clocks, the producers waiting for a slot, and their waits.

The rule (how many groups per dispatch step, and which steps are still open) is the rule
book's ``admits``; :class:`Admission` keeps the clocks, asks the rule and parks producers in
arrival order until a slot opens. Slots are never counted apart from the groups: the store
counts resident groups per dispatch step, and a slot frees the moment its group leaves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Generic, TypeVar

from ._partition import PartitionState
from ._rules import Rules
from ._status_log import logger
from ._store import GroupStore
from ._token_admission import TokenQueries
from ._token_ledger import UNBOUNDED, TokenLedger
from ._validation import describe
from ._waiting import LoopBinding, ProducerQueue, Waiter, park
from .errors import BufferClosedError, BufferFullError, FutureTagError, TagClosedError

__all__ = ["Admission"]

_T = TypeVar("_T")


class _Admitted(Generic[_T]):
    """What a woken producer's attempt returns: its call's result (which may be None)."""

    __slots__ = ("value",)

    def __init__(self, value: _T) -> None:
        self.value = value


def _ignore(_part: PartitionState) -> None:
    """No one listens yet (see :meth:`Admission.on_new_head`)."""


def _ahead_error(name: str, tag: int, clock: int) -> FutureTagError:
    return FutureTagError(
        f"dispatch step {tag} of partition {describe(name)} is ahead of its dispatch clock "
        f"{clock} (the largest global_steps a sample was called with): under admission control "
        "a group is tagged at most the clock; dispatch at the clock (global_steps=None)"
    )


def _closable(part: PartitionState, requested: int | None) -> int | None:
    """``requested`` if ``part``'s admission tags groups by step (a group cap, or token admission),
    so that it may close for good; else None (``max_resident_tokens`` alone checks no tag)."""
    if part.cap is None and (part.ledger is None or part.ledger.budget is None):
        return None
    return requested


def _closed_error(name: str, tag: int, last_sampled: int) -> TagClosedError:
    return TagClosedError(
        f"dispatch step {tag} of partition {describe(name)} is closed for good: a group tagged {tag} "
        f"would be stale at the next sample ({last_sampled + 1}); dispatch at the clock "
        "(global_steps=None) or a later step"
    )


class Admission:
    """The admission control of one buffer (its rules are documented on ``ReplayBuffer``).

    Attributes (read them; change them only through the methods):
        clocks: each partition's dispatch clock, the largest step a sample was called with.
        sampled: each partition's largest step a sample returned a batch at.
        refused: per partition, the producer calls refused for good (TagClosedError,
            FutureTagError) since its last batch and the tag the latest asked for
            (``explain_wait`` reports them).
        queues: the waiting producers, by ``PartitionState.key`` (a partition's name, or
            ``(name, task)`` for a task of a mixture: one FIFO per task).
        tokens: the token-cap queries (:class:`~stalebuf._token_admission.TokenQueries`:
            ``free_tokens``, ``capacity_tokens``, ``full``, ``refuses_group``), reading the clocks.
    """

    __slots__ = ("binding", "clocks", "new_head", "queues", "refused", "rules", "sampled", "store", "tokens")

    def __init__(self, store: GroupStore, rules: Rules, binding: LoopBinding) -> None:
        self.store = store
        self.rules = rules
        self.binding = binding
        self.clocks: dict[str, int] = {}
        self.sampled: dict[str, int] = {}
        self.refused: dict[str, tuple[int, int]] = {}
        self.queues: dict[str | tuple[str, str], ProducerQueue] = {}
        self.tokens = TokenQueries(rules, self.clocks, self.sampled, self.queues)
        # Told when a producer that asked for a tag becomes the head of a token-gated queue: a
        # head that cannot be admitted holds up every producer behind it, which the token-batch
        # readiness rule counts (TokenQueries.head_blocked); the consumer re-asks its samples.
        self.new_head: Callable[[PartitionState], object] = _ignore

    def on_new_head(self, listener: Callable[[PartitionState], object]) -> None:
        """Call ``listener(part)`` whenever a producer that asked for a tag becomes the head of
        ``part``'s queue under token caps (the consumer's ``notify``)."""
        self.new_head = listener

    def queue(self, key: str | tuple[str, str]) -> ProducerQueue:
        """Return the producer queue of ``key`` (a partition's or a task's), creating it."""
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = ProducerQueue()
        return queue

    def last_sampled(self, name: str) -> int:
        """The largest step a sample on ``name`` returned a batch at (-1 before any)."""
        return self.sampled.get(name, -1)

    def refusals(self, name: str) -> tuple[int, int | None]:
        """How many producer calls on ``name`` were refused for good since its last batch, and
        the tag the latest of them asked for."""
        count, tag = self.refused.get(name, (0, None))
        return count, tag

    def _refused(self, name: str, tag: int, error: BufferFullError) -> BufferFullError:
        """Count ``error``, about to be raised to a producer that asked for ``tag``; return it."""
        self.refused[name] = (self.refused.get(name, (0, tag))[0] + 1, tag)
        return error

    def waiting(self, name: str, task: str | None = None) -> int:
        """How many producers wait for a slot in partition ``name`` (of ``task`` only, if given)."""
        return sum(
            len(queue.producers)
            for key, queue in self.queues.items()
            if (key == name and task is None)
            or (type(key) is tuple and key[0] == name and task in (None, key[1]))
        )

    # -- the clock and the samples that move it -------------------------------------------

    def advance(self, name: str, global_steps: int) -> None:
        """Move partition ``name``'s dispatch clock to ``global_steps`` if that is later."""
        if global_steps > self.clocks.get(name, 0):
            self.clocks[name] = global_steps
            self.wake(name)  # a new step: fresh slots

    def batch_taken(self, name: str, global_steps: int) -> None:
        """Record that a sample at ``global_steps`` returned a batch (its slots are free)."""
        if global_steps > self.sampled.get(name, -1):
            self.sampled[name] = global_steps
        if self.refused:
            self.refused.pop(name, None)  # "since the last batch"
        queue = self.queues.get(name)
        if queue.producers if queue is not None else self.rules.tasks:  # a mixture's are its tasks'
            self.wake(name)

    # -- the rule ---------------------------------------------------------------------

    def tag_for(
        self,
        name: str,
        part: PartitionState | None,
        requested: int | None,
        *,
        head: bool = False,
        need: int | None = None,
    ) -> int:
        """Return the dispatch step a group added now gets (``requested``, or the clock).
        ``need``: the tokens it counts under token caps (None: an in-flight group's reservation,
        ``max_tokens_per_group``; a group written terminal counts its own).

        Raises:
            BufferFullError: admission control has no slot (or token room) at that step for it
                now (or other producers wait first and ``head`` is False); TagClosedError if
                ``requested`` can never open, FutureTagError if it is ahead of the clock.
            StalebufError: the policy's ``admission_batch_size`` answered nonsense.
            Exception: whatever the policy's ``admits`` raised.
        """
        clock = self.clocks.get(name, 0)
        tag = clock if requested is None else requested
        if part is None:  # not created yet: nothing is resident there, nobody waits
            cap = self.rules.admission_cap(name)
            if cap is None:
                rules = self.rules
                budget = rules.config.admission_token_budget  # token admission tags as groups' does
                if tag > clock and budget is not None and not rules.policy.is_exempt(name):
                    raise self._ahead(name, tag, clock, head)
                return tag
            resident, last_sampled, queue, span, ledger = 0, -1, None, self.rules.span, None
        else:
            cap = part.cap
            if cap is None:
                return self._token_tag(name, part, clock, tag, requested, head, need) if part.gated else tag
            # What resident_at_step and last_sampled() answer, read inline: this runs per group.
            resident = part.resident_at.get(tag, 0) if part.resident_at is not None else 0
            last_sampled = self.sampled.get(name, -1)
            queue, span, ledger = self.queues.get(part.key), part.span, part.ledger
        if tag > clock:
            raise self._ahead(name, tag, clock, head)
        if not head and queue is not None and queue.producers:
            self._queued(queue, name, tag, requested, last_sampled, span)
        if not self.rules.admits(tag, resident, last_sampled, cap, name, span):
            if requested is not None and self.rules.closed_for_good(name, tag, last_sampled, span):
                closed = _closed_error(name, tag, last_sampled)
                raise closed if head else self._refused(name, tag, closed)
            raise BufferFullError(
                f"partition {describe(name)} admits no more groups at dispatch step {tag} now "
                f"({resident} resident there, at most {cap} per step)"
            )
        if ledger is not None and ledger.gates:  # max_resident_tokens under group admission
            ledger.check_room(name, tag, need)
        return tag

    def _ahead(self, name: str, tag: int, clock: int, head: bool) -> BufferFullError:
        """The error refusing ``tag``, ahead of the ``clock`` (counted unless for the head)."""
        ahead = _ahead_error(name, tag, clock)
        return ahead if head else self._refused(name, tag, ahead)

    def _queued(
        self, queue: ProducerQueue, name: str, tag: int, requested: int | None, last_sampled: int, span: int
    ) -> None:
        """Refuse a producer that is not the head while live producers wait in ``queue``.

        Raises:
            TagClosedError: ``requested`` is closed for good (counted); else BufferFullError.
        """
        queue.drop_abandoned()
        if queue.producers:
            if requested is not None and self.rules.closed_for_good(name, tag, last_sampled, span):
                raise self._refused(name, tag, _closed_error(name, tag, last_sampled))
            raise BufferFullError(f"producers are waiting for admission to partition {describe(name)}")

    def _token_tag(
        self,
        name: str,
        part: PartitionState,
        clock: int,
        tag: int,
        requested: int | None,
        head: bool,
        need: int | None,
    ) -> int:
        """:meth:`tag_for` of a partition under token caps only (no group cap): the tag rules of
        group admission under ``admission_token_budget`` (none under ``max_resident_tokens``
        alone), then room for ``need`` tokens at ``tag``.

        Raises:
            The errors of :meth:`tag_for`.
        """
        ledger: TokenLedger = part.ledger  # type: ignore[assignment]  # gated without a cap
        budget = ledger.budget
        if budget is not None and tag > clock:
            raise self._ahead(name, tag, clock, head)
        last_sampled, span, rules = self.sampled.get(name, -1), part.span, self.rules
        queue = self.queues.get(part.key)
        if not head and queue is not None and queue.producers:
            self._queued(queue, name, tag, requested if budget is not None else None, last_sampled, span)
        if budget is not None and (
            tag
            < last_sampled + 2 - span  # closed_for_good inline (its default: admits is never overridden here)
            if rules.plain_admission
            else rules.closed_for_good(name, tag, last_sampled, span)
        ):
            if requested is not None:
                closed = _closed_error(name, tag, last_sampled)
                raise closed if head else self._refused(name, tag, closed)
            raise BufferFullError(
                f"partition {describe(name)} admits no more groups at dispatch step {tag} now (it is "
                "stale at the next sample): dispatch after the next sample"
            )
        # TokenLedger.room inline (this runs per group); check_room raises with the message.
        room = UNBOUNDED if budget is None else budget - ledger.at.get(tag, 0)  # type: ignore[union-attr]
        cap = ledger.resident_cap
        if cap is not None and cap - ledger.reserved - ledger.settled < room:
            room = cap - ledger.reserved - ledger.settled
        if room < (ledger.per_group if need is None else need):
            ledger.check_room(name, tag, need)
        return tag

    def cells(
        self, part: PartitionState | None, name: str, task: str | None = None
    ) -> list[tuple[int | None, int | None, PartitionState | None]]:
        """``(admission cap, threshold, cell)`` of each cell of partition ``name`` (``part``,
        None if unused: from the rules, no cell) that a query about ``task`` (None: all) covers.

        Raises:
            Exception: whatever a policy hook raised.
        """
        rules = self.rules
        if part is not None:
            cells = part.cells
            if cells is None:
                return [(part.cap, part.threshold, part)]
            chosen = cells.values() if task is None else (cells[task],)
            return [(cell.cap, cell.threshold, cell) for cell in chosen]
        cap = rules.admission_cap(name)
        if not rules.tasks or rules.policy.is_exempt(name):
            return [(cap, rules.threshold, None)]
        tasks = rules.tasks if task is None else (task,)
        return [(*rules.cell_settings(name, one, cap)[:2], None) for one in tasks]

    def free_slots(self, part: PartitionState | None, name: str, task: str | None = None) -> int | None:
        """How many groups ``add_prompt`` would admit at the clock's step of partition ``name``
        (``part``, None if unused: every slot at its clock's step) without waiting: of ``task``
        under a mixture, or summed over its tasks.

        Raises:
            Exception: whatever the policy's ``admits`` raised.
        """
        free = [self._free(cap, cell, name) for cap, _, cell in self.cells(part, name, task)]
        return None if None in free else sum(free)  # type: ignore[arg-type]

    def _free(self, cap: int | None, part: PartitionState | None, name: str) -> int | None:
        """:meth:`free_slots` of one cell (``part``; None: unused, every slot free)."""
        if part is None:
            return cap
        if cap is None:
            return None
        try:
            tag = self.tag_for(name, part, None)
        except BufferFullError:
            return 0
        return max(cap - part.resident_at_step(tag), 0)

    def capacity(self, part: PartitionState | None, name: str, task: str | None = None) -> int | None:
        """``T * S * b`` for partition ``name`` (of ``task``, or summed over the tasks of a
        mixture, each with its own ``T`` and quota of ``b``); None without admission control.

        Raises:
            Exception: whatever a policy hook raised.
        """
        bounds = [self.rules.capacity(cap, threshold) for cap, threshold, _ in self.cells(part, name, task)]
        return None if None in bounds else sum(bounds)  # type: ignore[arg-type]

    # -- waiting for a slot -------------------------------------------------------------

    async def wait_for_slot(
        self, part: PartitionState, requested: int | None, admit: Callable[[int], _T], need: int | None = None
    ) -> _T:
        """Park in ``part``'s producer queue until a slot at the requested step (or the clock's)
        opens, then call ``admit(step)`` at once, in the same step of the loop (``need``: the
        tokens the group counts under token caps, as for :meth:`tag_for`).

        Raises:
            BufferClosedError: the buffer was closed meanwhile.
            BufferFullError: ``requested`` is a tag closed for good (at once, or once a sample
                closes it while the producer waits).
            Exception: whatever ``admit`` raised (the producer leaves the queue either way).
        """
        binding, name, rules, span = self.binding, part.name, self.rules, part.span
        binding.check_backend()
        binding.bind()
        # A producer's waiter carries its tag (-1: the clock's) and its tokens (-1: a reservation).
        waiter = binding.new_waiter(-1 if requested is None else requested, -1 if need is None else need)
        queue = self.queue(part.key)

        def attempt() -> _Admitted[_T] | None:
            if self.store.closed:
                raise BufferClosedError("the buffer is closed")
            if queue.producers[0] is not waiter:
                return None
            try:
                tag = self.tag_for(name, part, requested, head=True, need=need)
            except BufferFullError as exc:
                last_sampled = self.last_sampled(name)
                if closable is None or not rules.closed_for_good(name, closable, last_sampled, span):
                    return None
                self._refused(name, closable, exc)  # a sample closed its tag while it waited
                raise
            return _Admitted(admit(tag))

        last, closable = self.last_sampled(name), _closable(part, requested)
        if closable is not None and rules.closed_for_good(name, closable, last, span):
            raise self._refused(
                name, closable, _closed_error(name, closable, last)
            )  # waiting would be forever
        queue.waits.park(waiter, waiter.now())
        queue.producers.append(waiter)  # from here on, the finally below must remove it (and count it)
        if requested is not None and part.gated and queue.producers[0] is waiter:
            self.new_head(part)
        try:
            admitted = await park(waiter, attempt)
        finally:
            self._leave(queue, part, waiter)
        return admitted.value

    def take_producer_wait(self, part: PartitionState) -> float:
        """Return the seconds producers spent blocked on ``part`` (its tasks' too) since the
        last call, counting those still blocked up to now, and start the next period."""
        total = 0.0
        for cell in part.cells.values() if part.cells is not None else (part,):
            queue = self.queue(cell.key)
            now: float | None = None
            if queue.producers:
                with contextlib.suppress(RuntimeError):  # trio's clock, read outside its run: later
                    now = queue.producers[0].now()
            total += queue.waits.report(now)
        return total

    def _leave(self, queue: ProducerQueue, part: PartitionState, waiter: Waiter) -> None:
        """Take ``waiter`` out of the queue and count its wait; if it was the head, pass the
        turn on."""
        producers = queue.producers
        head = bool(producers) and producers[0] is waiter
        if head:
            producers.popleft()
        elif waiter in producers:
            producers.remove(waiter)
        else:  # dropped as abandoned: its wait was counted then
            return
        try:
            now: float | None = waiter.now()
        except RuntimeError:  # trio's clock, once its run is over
            now = None
        queue.waits.leave(waiter, now)
        if head:
            self._wake_queue(part)
            if producers and producers[0].global_steps >= 0 and part.gated:
                self.new_head(part)

    def wake(self, name: str) -> None:
        """Wake the head waiting producer of ``name`` (of each of its tasks, under a mixture)
        if a slot is open for it (or its tag closed for good, so that it raises instead of
        holding the queue up forever).

        Runs after another call's state change: a policy hook that raises here is logged and
        the producer woken, to raise it from its own call.
        """
        part = self.store.partitions.get(name)
        if part is None or self.store.closed:
            return
        for cell in part.cells.values() if part.cells is not None else (part,):
            self._wake_queue(cell)

    def _wake_queue(self, part: PartitionState) -> None:
        """Wake the head producer of ``part``'s queue if it may go on (see :meth:`wake`)."""
        queue, name = self.queues.get(part.key), part.name
        if queue is None or self.store.closed:
            return
        queue.drop_abandoned()
        if not queue.producers:
            return
        head = queue.producers[0]
        requested = None if head.global_steps < 0 else head.global_steps
        need = None if head.batch_size < 0 else head.batch_size
        try:
            self.tag_for(name, part, requested, head=True, need=need)
        except BufferFullError:
            closable = _closable(part, requested)
            try:
                closed = closable is not None and self.rules.closed_for_good(
                    name, closable, self.last_sampled(name), part.span
                )
            except Exception:  # woken, it asks again and raises it from its own call
                logger.exception("a staleness policy hook raised while checking a waiting producer")
                closed = True
            if not closed:
                return
        except Exception:
            logger.exception("a staleness policy hook raised while checking a waiting producer")
        head.wake()

    def refunded(self, part: PartitionState) -> None:
        """Tokens of ``part`` were refunded (a group's reservation settled to its own tokens):
        wake its head producer if it may be admitted now (every tag's: a residency refund, or
        a tag's, wakes the one FIFO head, which passes the turn on once admitted)."""
        queue = self.queues.get(part.key)
        if queue is not None and queue.producers and part.gated:  # (the common case: nobody waits)
            self._wake_queue(part)

    def close(self) -> None:
        """Wake every waiting producer (each raises BufferClosedError from its own call)."""
        for queue in self.queues.values():
            queue.drop_abandoned(everywhere=True)
            for waiter in queue.producers:
                waiter.wake()

    def drop_abandoned(self) -> None:
        """Forget every producer whose event loop was closed under it (``stats()`` counts them)."""
        for queue in self.queues.values():
            queue.drop_abandoned(everywhere=True)

    # -- checkpoints ------------------------------------------------------------------------

    def restore(self, clocks: dict[str, int], last_sampled: dict[str, int]) -> None:
        """Set the clocks and last sampled steps a restore read (before anyone waits)."""
        self.clocks.update(clocks)
        self.sampled.update(last_sampled)
