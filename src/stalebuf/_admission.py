"""Admission control: the dispatch clock, admission slots, and producers waiting for one.

The rule (how many groups per dispatch step, and which steps are still open) is the policy's
``admits``; this module keeps the clock, asks the rule, and parks producers in arrival order
until a slot opens. Slots are never counted separately from the groups: a slot frees the
moment its group leaves the buffer (see ``PartitionState._release``), so nothing can drift.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Generic, TypeVar

from ._core import BufferCore
from ._partition import PartitionState
from ._status_log import logger
from ._validation import check_partition, describe
from ._waiting import Waiter, park
from .errors import BufferFullError

__all__ = ["Admission"]

_T = TypeVar("_T")


class _Admitted(Generic[_T]):
    """What a woken producer's attempt returns: its call's result (which may be None)."""

    __slots__ = ("value",)

    def __init__(self, value: _T) -> None:
        self.value = value


def _closed_error(name: str, tag: int, last_sampled: int) -> BufferFullError:
    return BufferFullError(
        f"dispatch step {tag} of partition {describe(name)} is closed for good: a group tagged {tag} "
        f"would be stale at the next sample ({last_sampled + 1}); dispatch at the clock "
        "(global_steps=None) or a later step"
    )


class Admission(BufferCore):
    """The admission half of ``ReplayBuffer``'s state (documented there)."""

    def _advance_clock(self, name: str, global_steps: int) -> None:
        """Move partition ``name``'s dispatch clock to ``global_steps`` if that is later."""
        if global_steps > self._clocks.get(name, 0):
            self._clocks[name] = global_steps
            part = self._partitions.get(name)
            if part is not None and part.producers:
                self._wake_producer(part)  # a new step: fresh slots

    def _admission_tag(
        self, name: str, part: PartitionState | None, requested: int | None, *, head: bool = False
    ) -> int:
        """Return the dispatch step a group added now gets (``requested``, or the clock).

        Raises:
            BufferFullError: admission control has no slot at that step for it now (or other
                producers wait first and ``head`` is False).
            Exception: whatever the policy's ``admits`` raised.
        """
        tag = self._clocks.get(name, 0) if requested is None else requested
        if part is None:  # not created yet: nothing is resident there
            cap = self._rules.admission_batch_size(name)
            if cap is None:
                return tag
            resident, last_sampled = 0, -1
        else:
            cap = part.cap
            if cap is None:
                return tag
            resident, last_sampled = part.resident_at_step(tag), part.last_sampled
            if not head and part.producers:
                part.drop_abandoned()
                if part.producers:
                    if requested is not None and self._closed_for_good(name, tag, last_sampled):
                        raise _closed_error(name, tag, last_sampled)  # waiting would not help it
                    raise BufferFullError(
                        f"producers are waiting for admission to partition {describe(name)}"
                    )
        if not self._rules.admits(tag, resident, last_sampled, cap, name):
            if requested is not None and self._closed_for_good(name, tag, last_sampled):
                raise _closed_error(name, tag, last_sampled)
            raise BufferFullError(
                f"partition {describe(name)} admits no more groups at dispatch step {tag} now "
                f"({resident} resident there, at most {cap} per step)"
            )
        return tag

    def _closed_for_good(self, name: str, tag: int, last_sampled: int) -> bool:
        """Whether no slot at ``tag`` can ever open: the default admission rule refuses a tag
        that is stale at the next sample, and the drop rule is monotone while sample steps only
        grow. (A custom ``admits`` may reopen anything: never closed for good then.)

        Raises:
            Exception: whatever the policy's ``is_stale`` raised.
        """
        return self._admits_by_default and self._rules.is_stale(last_sampled + 1, tag, name)

    def _free_slots(self, part: PartitionState) -> int | None:
        """How many groups ``add_prompt`` would admit at the clock's step without waiting."""
        cap = part.cap
        if cap is None:
            return None
        try:
            tag = self._admission_tag(part.name, part, None)
        except BufferFullError:
            return 0
        return max(cap - part.resident_at_step(tag), 0)

    def _capacity(self, part: PartitionState | None, name: str) -> int | None:
        cap = self._rules.admission_batch_size(name) if part is None else part.cap
        if cap is None:
            return None
        return cap * self._rules.threshold * self._rules.sync_step

    async def _wait_for_slot(
        self, part: PartitionState, requested: int | None, admit: Callable[[int], _T]
    ) -> _T:
        """Park in ``part``'s producer queue until a slot at the requested step (or the clock's)
        opens, then call ``admit(step)`` at once, in the same step of the loop.

        Raises:
            BufferClosedError: the buffer was closed meanwhile.
            Exception: whatever ``admit`` raised (the producer leaves the queue either way).
        """
        binding = self._binding
        binding.check_backend()
        binding.bind()
        waiter = binding.new_waiter(-1 if requested is None else requested, 0)

        def attempt() -> _Admitted[_T] | None:
            self._check_open()
            if part.producers[0] is not waiter:
                return None
            try:
                tag = self._admission_tag(part.name, part, requested, head=True)
            except BufferFullError:
                if requested is not None and self._closed_for_good(part.name, requested, part.last_sampled):
                    raise  # a sample closed its tag while it waited: it would wait forever
                return None
            return _Admitted(admit(tag))

        if requested is not None and self._closed_for_good(part.name, requested, part.last_sampled):
            raise _closed_error(part.name, requested, part.last_sampled)  # waiting would be forever
        part.producer_waits.park(waiter, waiter.now())
        part.producers.append(waiter)  # from here on, the finally below must remove it (and count it)
        try:
            admitted = await park(waiter, attempt)
        finally:
            self._leave_producers(part, waiter)
        return admitted.value

    @staticmethod
    def _take_producer_wait(part: PartitionState) -> float:
        """Return the seconds producers spent blocked on ``part`` since the last call, counting
        those still blocked up to now, and start the next period (O(1))."""
        now: float | None = None
        if part.producers:
            with contextlib.suppress(RuntimeError):  # trio's clock, read outside its run: later
                now = part.producers[0].now()
        return part.producer_waits.report(now)

    def _leave_producers(self, part: PartitionState, waiter: Waiter) -> None:
        """Take ``waiter`` out of the producer queue and count its wait; if it was the head,
        pass the turn on."""
        producers = part.producers
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
        part.producer_waits.leave(waiter, now)
        if head:
            self._wake_producer(part)

    def _wake_producer(self, part: PartitionState) -> None:
        """Wake the head waiting producer if a slot is open for it.

        Runs after another call's state change: a policy hook that raises here is logged and
        the producer woken, to raise it from its own call.
        """
        if self._closed:
            return
        part.drop_abandoned()
        if not part.producers:
            return
        head = part.producers[0]
        requested = None if head.global_steps < 0 else head.global_steps
        try:
            self._admission_tag(part.name, part, requested, head=True)
        except BufferFullError:
            # Its tag closed for good: wake it to raise, or it would hold up the queue forever.
            try:
                closed = requested is not None and self._closed_for_good(
                    part.name, requested, part.last_sampled
                )
            except Exception:  # woken, it asks again and raises it from its own call
                logger.exception("a staleness policy hook raised while checking a waiting producer")
                closed = True
            if not closed:
                return
        except Exception:
            logger.exception("a staleness policy hook raised while checking a waiting producer")
        head.wake()

    # -- public queries (documented on ReplayBuffer) -------------------------------------

    def dispatch_step(self, partition: str = "train") -> int:
        """Return the step a group dispatched now is tagged with: the largest ``global_steps``
        any ``sample`` on ``partition`` has been called with (0 before the first).

        It reads one int, so unlike every other call it may be made from any thread (the
        example server's ``def`` handlers do).

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str.
        """
        check_partition(partition)
        return self._clocks.get(partition, 0)

    def capacity(self, partition: str = "train") -> int | None:
        """Return the bound on ``partition``'s resident groups under admission control,
        ``T * S * admission_batch_size``; None without admission or for an exempt partition.

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str.
            WrongThreadError: called from another thread than the bound loop's.
        """
        self._binding.check_thread()
        check_partition(partition)
        return self._capacity(self._partitions.get(partition), partition)

    def free_slots(self, partition: str = "train") -> int | None:
        """Return how many groups ``add_prompt`` would admit now at the clock's step without
        waiting; None without admission control or for an exempt partition.

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str.
            WrongThreadError: called from another thread than the bound loop's.
            Exception: whatever the policy's ``admits`` raised.
        """
        self._binding.check_thread()
        check_partition(partition)
        part = self._partitions.get(partition)
        if part is None:
            cap = self._rules.admission_batch_size(partition)
            return None if cap is None else cap  # an unused partition: every slot at its clock step
        return self._free_slots(part)

    def full(self, partition: str = "train") -> bool:
        """Return whether ``free_slots(partition) == 0`` (never True without admission control).

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str.
            WrongThreadError: called from another thread than the bound loop's.
        """
        return self.free_slots(partition) == 0
