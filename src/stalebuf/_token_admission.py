"""The token-cap questions about admission: free tokens, the token bound, and whether a
group would be refused for tokens now (the seam of the token-batch readiness rule).

:class:`TokenQueries` owns no state: it reads admission's dispatch clocks and last sampled
steps (the dicts :class:`~stalebuf._admission.Admission` owns, passed in), each partition's
:class:`~stalebuf._token_ledger.TokenLedger` and the rule book. Every answer is O(1).
"""

from __future__ import annotations

from ._partition import PartitionState
from ._rules import Rules
from ._waiting import ProducerQueue

__all__ = ["TokenQueries"]


class TokenQueries:
    """Token-cap queries of one buffer (``ReplayBuffer.free_tokens`` and friends ask them)."""

    __slots__ = ("clocks", "queues", "rules", "sampled")

    def __init__(
        self,
        rules: Rules,
        clocks: dict[str, int],
        sampled: dict[str, int],
        queues: dict[str | tuple[str, str], ProducerQueue],
    ) -> None:
        self.rules = rules
        self.clocks = clocks  # admission's: read only
        self.sampled = sampled  # admission's: read only
        self.queues = queues  # admission's producer queues: read only

    def free_tokens(self, part: PartitionState | None, name: str) -> int | None:
        """The tokens a group could take at the clock's step of partition ``name`` (``part``, None
        if unused) now: the smaller of the per-step and residency rooms (0 at a closed step);
        None without ``admission_token_budget`` or ``max_resident_tokens`` (or exempt).

        Raises:
            Exception: whatever the policy's ``is_stale`` (or ``is_exempt``) raised.
        """
        if part is None:
            config = self.rules.config
            caps = [cap for cap in (config.admission_token_budget, config.max_resident_tokens) if cap]
            return min(caps) if caps and not self.rules.policy.is_exempt(name) else None
        ledger = part.ledger
        if ledger is None or not ledger.gates:
            return None
        clock = self.clocks.get(name, 0)
        if (ledger.budget is not None or part.cap is not None) and self.rules.closed_for_good(
            name, clock, self.sampled.get(name, -1), part.span
        ):
            return 0
        return max(ledger.room(clock), 0)

    def capacity_tokens(self, part: PartitionState | None, name: str) -> int | None:
        """The bound on partition ``name``'s resident tokens: ``T * S * admission_token_budget``,
        or ``max_resident_tokens`` if smaller; None without either (or exempt).

        Raises:
            Exception: whatever the policy's ``is_exempt`` raised.
        """
        rules = self.rules
        budget, resident = rules.config.admission_token_budget, rules.config.max_resident_tokens
        if budget is None and resident is None:
            return None
        if part.exempt if part is not None else rules.policy.is_exempt(name):
            return None
        bounds = [bound for bound in (rules.capacity(budget), resident) if bound is not None]
        return min(bounds)

    def full(self, part: PartitionState | None, name: str) -> bool:
        """Whether no in-flight group could be admitted now for want of tokens:
        :meth:`free_tokens` ``< max_tokens_per_group`` (False without token caps).

        Raises:
            The errors of :meth:`free_tokens`.
        """
        free = self.free_tokens(part, name)
        return free is not None and free < self.rules.config.max_tokens_per_group  # type: ignore[operator]

    def refuses_at(self, part: PartitionState, global_steps: int) -> bool:
        """The token-batch readiness rule's admission input: whether a clock-tagged
        ``add_prompt`` would be refused now at tag ``max(clock, global_steps)``, the clock a
        ``sample(global_steps)`` moves it to: :meth:`refuses_group` there, or
        :meth:`head_blocked` (producers queue FIFO per partition, so a head that cannot be
        admitted refuses everyone behind it).

        Raises:
            Exception: whatever the policy's ``is_stale`` raised.
        """
        name = part.name
        return self.refuses_group(
            part, name, max(self.clocks.get(name, 0), global_steps)
        ) or self.head_blocked(part)

    def head_blocked(self, part: PartitionState) -> bool:
        """Whether the head of ``part``'s producer queue asked for a tag (not the clock's) that
        is open but has less room than its group needs: it holds up every producer behind it
        until a refund at its tag or a batch, so a token sample that waited for producers at
        the clock could wait forever (a head at the clock's tag is :meth:`refuses_group`'s; one
        at a closed tag leaves with TagClosedError once woken). O(1).

        Raises:
            Exception: whatever the policy's ``is_stale`` raised.
        """
        queue = self.queues.get(part.key)
        if queue is None or not queue.producers:
            return False
        head = queue.producers[0]
        ledger = part.ledger
        if head.global_steps < 0 or ledger is None or not ledger.gates or head.abandoned():
            return False
        tag = head.global_steps
        if ledger.budget is not None and self.rules.closed_for_good(
            part.name, tag, self.sampled.get(part.name, -1), part.span
        ):
            return False
        return ledger.room(tag) < (ledger.per_group if head.batch_size < 0 else head.batch_size)

    def refuses_group(self, part: PartitionState | None, name: str, tag: int) -> bool:
        """Whether a clock-tagged ``add_prompt`` of partition ``name`` (``part``; None if unused)
        would be refused right now at ``tag`` for tokens: the per-step room or the room under
        ``max_resident_tokens`` is below ``max_tokens_per_group``, or (under
        ``admission_token_budget``) the tag is closed. False without token caps, and for a
        partition not used yet (nothing resident, no tag closed). O(1).

        The token-batch readiness rule asks it with ``tag = max(clock, g)``. Besides a sample
        (the clock, a closed tag), only an admission turns it True (a reservation, or a group
        written terminal); every admission into a partition with a ledger notifies its parked
        samples (``GroupWriter.add_prompt``; ``put_group`` ends in ``Consumer.finish``).

        Raises:
            Exception: whatever the policy's ``is_stale`` raised.
        """
        if part is None:
            return False
        ledger = part.ledger
        if ledger is None or not ledger.gates:
            return False
        if ledger.budget is not None and self.rules.closed_for_good(
            name, tag, self.sampled.get(name, -1), part.span
        ):
            return True
        return ledger.room(tag) < ledger.per_group
