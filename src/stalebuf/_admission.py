"""Admission control: the dispatch clocks, the producers waiting for a slot, and their waits.

The rule (how many groups per dispatch step, and which steps are still open) is the rule
book's ``admits``; :class:`Admission` keeps the clocks, asks the rule and parks producers in
arrival order until a slot opens. Slots are never counted apart from the groups: the store
counts resident groups per dispatch step, and a slot frees the moment its group leaves.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from ._partition import PartitionState
from ._rules import Rules
from ._status_log import logger
from ._store import GroupStore
from ._validation import check_partition, describe
from ._waiting import LoopBinding, ProducerWaits, Waiter, park
from .errors import BufferClosedError, BufferFullError, FutureTagError, TagClosedError

__all__ = ["Admission", "ProducerQueue"]

_T = TypeVar("_T")


class _Admitted(Generic[_T]):
    """What a woken producer's attempt returns: its call's result (which may be None)."""

    __slots__ = ("value",)

    def __init__(self, value: _T) -> None:
        self.value = value


class ProducerQueue:
    """One partition's admission state: producers waiting for a slot (arrival order; only
    the head may be admitted), the ledger of their waits, the last step sampled, and the
    producer calls refused for good since the last batch (``explain_wait`` reports them)."""

    __slots__ = ("last_sampled", "producers", "refusals", "refused_tag", "waits")

    def __init__(self) -> None:
        self.producers: deque[Waiter] = deque()
        self.waits = ProducerWaits()  # for the admission/producer_wait_seconds metric
        self.last_sampled = -1  # the largest step a sample returned a batch at
        self.refusals = 0  # TagClosedError and FutureTagError raised since the last batch
        self.refused_tag: int | None = None  # the tag of the latest of them

    def drop_abandoned(self, everywhere: bool = False) -> None:
        """Forget producers whose event loop was closed under them (the head only, O(1), unless
        ``everywhere``): they will never run, and their wait ends with their loop."""
        producers = self.producers
        if everywhere:
            if any(waiter.abandoned() for waiter in producers):
                for waiter in producers:
                    if waiter.abandoned():
                        self.waits.leave(waiter, None)
                live = [waiter for waiter in producers if not waiter.abandoned()]
                producers.clear()
                producers.extend(live)
            return
        while producers and producers[0].abandoned():
            self.waits.leave(producers.popleft(), None)


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
    """

    __slots__ = ("binding", "clocks", "queues", "rules", "store")

    def __init__(self, store: GroupStore, rules: Rules, binding: LoopBinding) -> None:
        self.store = store
        self.rules = rules
        self.binding = binding
        self.clocks: dict[str, int] = {}
        self.queues: dict[str, ProducerQueue] = {}

    def queue(self, name: str) -> ProducerQueue:
        """Return partition ``name``'s admission state, creating it the first time."""
        queue = self.queues.get(name)
        if queue is None:
            queue = self.queues[name] = ProducerQueue()
        return queue

    def last_sampled(self, name: str) -> int:
        """The largest step a sample on ``name`` returned a batch at (-1 before any)."""
        queue = self.queues.get(name)
        return -1 if queue is None else queue.last_sampled

    def clock(self, partition: object) -> int:
        """``dispatch_step``: partition ``partition``'s dispatch clock (any thread may ask).

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str.
        """
        return self.clocks.get(check_partition(partition), 0)

    def capacity_of(self, partition: object) -> int | None:
        """``capacity``: :meth:`capacity` of partition ``partition``, its arguments checked.

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: ``partition`` is not a non-empty str.
        """
        self.binding.check_thread()
        name = check_partition(partition)
        return self.capacity(self.store.partitions.get(name), name)

    def free_slots_of(self, partition: object) -> int | None:
        """``free_slots``: :meth:`free_slots` of partition ``partition``, its arguments checked.

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: ``partition`` is not a non-empty str.
            Exception: whatever the policy's ``admits`` raised.
        """
        self.binding.check_thread()
        name = check_partition(partition)
        return self.free_slots(self.store.partitions.get(name), name)

    def waiting(self, name: str) -> int:
        """How many producers wait for a slot in partition ``name``."""
        queue = self.queues.get(name)
        return 0 if queue is None else len(queue.producers)

    def refusals(self, name: str) -> tuple[int, int | None]:
        """How many producer calls on ``name`` were refused for good (TagClosedError,
        FutureTagError) since its last batch, and the tag the latest of them asked for."""
        queue = self.queues.get(name)
        return (0, None) if queue is None else (queue.refusals, queue.refused_tag)

    def _refused(self, name: str, tag: int, error: BufferFullError) -> BufferFullError:
        """Count ``error``, about to be raised to a producer that asked for ``tag``; return it."""
        queue = self.queue(name)
        queue.refusals += 1
        queue.refused_tag = tag
        return error

    # -- the clock and the samples that move it -------------------------------------------

    def advance(self, name: str, global_steps: int) -> None:
        """Move partition ``name``'s dispatch clock to ``global_steps`` if that is later."""
        if global_steps > self.clocks.get(name, 0):
            self.clocks[name] = global_steps
            self.wake(name)  # a new step: fresh slots

    def batch_taken(self, name: str, global_steps: int) -> None:
        """Record that a sample at ``global_steps`` returned a batch (its slots are free)."""
        queue = self.queue(name)
        if global_steps > queue.last_sampled:
            queue.last_sampled = global_steps
        queue.refusals, queue.refused_tag = 0, None  # "since the last batch"
        if queue.producers:
            self.wake(name)

    # -- the rule ---------------------------------------------------------------------

    def tag_for(
        self, name: str, part: PartitionState | None, requested: int | None, *, head: bool = False
    ) -> int:
        """Return the dispatch step a group added now gets (``requested``, or the clock).

        Raises:
            BufferFullError: admission control has no slot at that step for it now (or other
                producers wait first and ``head`` is False); TagClosedError if ``requested`` can
                never open, FutureTagError if it is ahead of the clock.
            StalebufError: the policy's ``admission_batch_size`` answered nonsense.
            Exception: whatever the policy's ``admits`` raised.
        """
        clock = self.clocks.get(name, 0)
        tag = clock if requested is None else requested
        queue = self.queues.get(name)
        if part is None:  # not created yet: nothing is resident there, nobody waits
            cap = self.rules.admission_cap(name)
            if cap is None:
                return tag
            resident, last_sampled, queue = 0, -1, None
        else:
            cap = part.cap
            if cap is None:
                return tag
            # What resident_at_step and last_sampled() answer, read inline: this runs per group.
            resident = part.resident_at.get(tag, 0) if part.resident_at is not None else 0
            last_sampled = -1 if queue is None else queue.last_sampled
        if tag > clock:
            ahead = FutureTagError(
                f"dispatch step {tag} of partition {describe(name)} is ahead of its dispatch clock "
                f"{clock} (the largest global_steps a sample was called with): under admission control "
                "a group is tagged at most the clock; dispatch at the clock (global_steps=None)"
            )
            raise ahead if head else self._refused(name, tag, ahead)
        if not head and queue is not None and queue.producers:
            queue.drop_abandoned()
            if queue.producers:
                if requested is not None and self.rules.closed_for_good(name, tag, last_sampled):
                    raise self._refused(name, tag, _closed_error(name, tag, last_sampled))
                raise BufferFullError(f"producers are waiting for admission to partition {describe(name)}")
        if not self.rules.admits(tag, resident, last_sampled, cap, name):
            if requested is not None and self.rules.closed_for_good(name, tag, last_sampled):
                error = _closed_error(name, tag, last_sampled)
                raise error if head else self._refused(name, tag, error)
            raise BufferFullError(
                f"partition {describe(name)} admits no more groups at dispatch step {tag} now "
                f"({resident} resident there, at most {cap} per step)"
            )
        return tag

    def free_slots(self, part: PartitionState | None, name: str) -> int | None:
        """How many groups ``add_prompt`` would admit at the clock's step of partition ``name``
        (``part``, None if unused: every slot at its clock's step) without waiting.

        Raises:
            Exception: whatever the policy's ``admits`` raised.
        """
        if part is None:
            return self.rules.admission_cap(name)
        cap = part.cap
        if cap is None:
            return None
        try:
            tag = self.tag_for(name, part, None)
        except BufferFullError:
            return 0
        return max(cap - part.resident_at_step(tag), 0)

    def capacity(self, part: PartitionState | None, name: str) -> int | None:
        """``T * S * b`` for partition ``name``; None without admission control."""
        return self.rules.capacity(self.rules.admission_cap(name) if part is None else part.cap)

    # -- waiting for a slot -------------------------------------------------------------

    async def wait_for_slot(
        self, part: PartitionState, requested: int | None, admit: Callable[[int], _T]
    ) -> _T:
        """Park in ``part``'s producer queue until a slot at the requested step (or the clock's)
        opens, then call ``admit(step)`` at once, in the same step of the loop.

        Raises:
            BufferClosedError: the buffer was closed meanwhile.
            BufferFullError: ``requested`` is a tag closed for good (at once, or once a sample
                closes it while the producer waits).
            Exception: whatever ``admit`` raised (the producer leaves the queue either way).
        """
        binding, name, rules = self.binding, part.name, self.rules
        binding.check_backend()
        binding.bind()
        waiter = binding.new_waiter(-1 if requested is None else requested, 0)
        queue = self.queue(name)

        def attempt() -> _Admitted[_T] | None:
            if self.store.closed:
                raise BufferClosedError("the buffer is closed")
            if queue.producers[0] is not waiter:
                return None
            try:
                tag = self.tag_for(name, part, requested, head=True)
            except BufferFullError as exc:
                if requested is None or not rules.closed_for_good(name, requested, queue.last_sampled):
                    return None
                self._refused(name, requested, exc)  # a sample closed its tag while it waited
                raise
            return _Admitted(admit(tag))

        if requested is not None and rules.closed_for_good(name, requested, queue.last_sampled):
            error = _closed_error(name, requested, queue.last_sampled)  # waiting would be forever
            raise self._refused(name, requested, error)
        queue.waits.park(waiter, waiter.now())
        queue.producers.append(waiter)  # from here on, the finally below must remove it (and count it)
        try:
            admitted = await park(waiter, attempt)
        finally:
            self._leave(queue, name, waiter)
        return admitted.value

    def take_producer_wait(self, name: str) -> float:
        """Return the seconds producers spent blocked on ``name`` since the last call, counting
        those still blocked up to now, and start the next period (O(1))."""
        queue = self.queue(name)
        now: float | None = None
        if queue.producers:
            with contextlib.suppress(RuntimeError):  # trio's clock, read outside its run: later
                now = queue.producers[0].now()
        return queue.waits.report(now)

    def _leave(self, queue: ProducerQueue, name: str, waiter: Waiter) -> None:
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
            self.wake(name)

    def wake(self, name: str) -> None:
        """Wake the head waiting producer of ``name`` if a slot is open for it (or its tag
        closed for good, so that it raises instead of holding the queue up forever).

        Runs after another call's state change: a policy hook that raises here is logged and
        the producer woken, to raise it from its own call.
        """
        queue = self.queues.get(name)
        if queue is None or self.store.closed:
            return
        queue.drop_abandoned()
        if not queue.producers:
            return
        head = queue.producers[0]
        requested = None if head.global_steps < 0 else head.global_steps
        try:
            self.tag_for(name, self.store.partitions.get(name), requested, head=True)
        except BufferFullError:
            try:
                closed = requested is not None and self.rules.closed_for_good(
                    name, requested, queue.last_sampled
                )
            except Exception:  # woken, it asks again and raises it from its own call
                logger.exception("a staleness policy hook raised while checking a waiting producer")
                closed = True
            if not closed:
                return
        except Exception:
            logger.exception("a staleness policy hook raised while checking a waiting producer")
        head.wake()

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
        for name, step in last_sampled.items():
            self.queue(name).last_sampled = step
