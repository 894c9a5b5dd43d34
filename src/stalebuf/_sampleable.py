"""Counting what a ``sample`` could select, and waiting for that count without taking anything.

:class:`SampleableWaits` answers ``sampleable_count`` and owns the ``wait_for_sampleable`` calls
parked until a partition holds at least ``count`` groups a ``sample`` at their ``global_steps``
could select. Both count the same thing, in one place (:meth:`SampleableWaits.fresh`): the ready
groups the drop and failure rules keep at that step (as after the drop eviction a ``sample``
would run, which this never runs), over every task's cell under a task mixture (a
``wait_for_sampleable`` counts them all); the wait gate, batch sizes and quotas do not count.

A parked call is not in the queue of parked samples: it never delays or reorders a ``sample``
and takes nothing. A producer's change that makes a group sampleable (and a cut at a deadline)
wakes each call whose count is now reached; the woken call counts again before it returns, so
the count it returns held when it returned.
"""

from __future__ import annotations

from ._partition import PartitionState
from ._rules import Rules
from ._status_log import logger
from ._store import GroupStore
from ._validation import check_count, check_partition, check_step, check_timeout, describe
from ._waiting import Waiter, park, park_with_deadline
from .errors import BufferClosedError

__all__ = ["SampleableWaits"]


class SampleableWaits:
    """The ``wait_for_sampleable`` calls of one buffer, by partition.

    Attributes (read them; change them only through the methods):
        waiting: the parked calls of each partition with any (empty when none waits); each
            waiter's ``global_steps`` is its call's and its ``batch_size`` the ``count`` it waits for.
    """

    __slots__ = ("rules", "store", "waiting")

    def __init__(self, store: GroupStore, rules: Rules) -> None:
        self.store = store
        self.rules = rules
        self.waiting: dict[str, list[Waiter]] = {}

    def fresh(self, partition: str, global_steps: int, task: str | None = None) -> int:
        """How many groups of ``partition`` (of its ``task`` only, under a mixture, if given) a
        ``sample`` at ``global_steps`` could select now (its arguments checked by the caller).

        Raises:
            Exception: whatever the policy's ``is_stale`` raised.
        """
        part = self.store.partitions.get(partition)
        if part is None:
            return 0
        cells = [part] if part.cells is None else part.cells.values() if task is None else [part.cells[task]]
        return sum(self.rules.count_fresh(cell, global_steps) for cell in cells)

    async def wait(self, global_steps: object, count: object, partition: object, timeout: object) -> int:
        """``wait_for_sampleable``: check the arguments as ``sample`` does, then wait until
        :meth:`fresh` is at least ``count``; return it.

        Raises:
            TypeError, ValueError: an argument is invalid; nothing changed.
            BackendMismatchError: it may wait and runs under another backend than the bound one.
            WrongThreadError: called from another thread than the bound loop's.
            BufferClosedError: the buffer is or gets closed.
            TimeoutError: ``timeout`` seconds passed first.
            Exception: whatever the policy's ``is_stale`` raised.
        """
        store, binding = self.store, self.store.binding
        seconds = check_timeout(timeout)
        if seconds != 0:
            binding.check_backend()
        step, wanted, name = check_step(global_steps), check_count(count), check_partition(partition)
        binding.check_thread()
        if store.closed:
            raise BufferClosedError("the buffer is closed")
        have = self.fresh(name, step)
        if have >= wanted:
            return have
        if seconds == 0:
            raise TimeoutError(f"fewer than {wanted} groups sampleable in partition {describe(name)}")
        backend = binding.bind()
        waiter = binding.new_waiter(step, wanted)

        def attempt() -> int | None:
            if store.closed:
                raise BufferClosedError("the buffer is closed")
            have = self.fresh(name, step)
            return have if have >= wanted else None

        waiters = self.waiting.setdefault(name, [])
        waiters.append(waiter)  # from here on, the finally below must remove it
        try:
            if seconds is None:
                return await park(waiter, attempt)
            result = await park_with_deadline(waiter, attempt, backend, waiter.now() + seconds)
        finally:
            self._leave(name, waiter)
        if result is None:
            raise TimeoutError(
                f"fewer than {wanted} groups sampleable in partition {describe(name)} within {seconds} s"
            )
        return result

    def notify(self, part: PartitionState) -> None:
        """A group of ``part`` became sampleable: wake each call on it whose count is reached.

        Runs on a producer's path after its change: a policy hook that raises here is logged
        and the call woken, to raise it from its own ``wait_for_sampleable``.
        """
        waiters = self.waiting.get(part.name)
        if not waiters:
            return
        if any(waiter.abandoned() for waiter in waiters):  # their loop was closed under them
            waiters[:] = [waiter for waiter in waiters if not waiter.abandoned()]
            if not waiters:
                del self.waiting[part.name]
                return
        # A plain partition's ready count is never fewer than what the rules keep: a cheap first
        # test. (A task's cell counts only its task's groups: the count sums every cell.)
        ready = part.ready.count if part.task is None else None
        for waiter in waiters:
            if ready is not None and ready < waiter.batch_size:
                continue
            try:
                reached = self.fresh(part.name, waiter.global_steps) >= waiter.batch_size
            except Exception:
                logger.exception("a staleness policy hook raised while counting for wait_for_sampleable")
                reached = True
            if reached:
                waiter.wake()

    def close(self) -> None:
        """Wake every parked call (each raises BufferClosedError from its own call)."""
        for waiters in self.waiting.values():
            for waiter in waiters:
                if not waiter.abandoned():
                    waiter.wake()

    def _leave(self, name: str, waiter: Waiter) -> None:
        """Take ``waiter`` out of partition ``name``'s list (and the list out once empty)."""
        waiters = self.waiting.get(name)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self.waiting[name]
