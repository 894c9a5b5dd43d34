"""Token batches: what a ``sample`` with a ``token_budget`` takes, and when it may.

A group's size is the sum of its trajectories' ``tokens``. A sample of ``K`` tokens takes the
longest prefix of the default selection order (oldest first, FIFO ties) whose total is
``<= K``; when the first group that holds tokens is alone over ``K``, the prefix runs through
it (the groups of 0 tokens before it included), so a batch is never empty. It may be taken when
the rule book's :meth:`~stalebuf._rules.Rules.token_batch_ready` says so.

Cost: the partition keeps the tokens of its ready groups (``PartitionState.ready_tokens``, kept
by the store as groups become ready and leave), so readiness is O(1), never a scan; the prefix
is read from the oldest group on, O(k + log N) for a batch of k groups of N resident (the same
walk a count batch of k groups does).
"""

from __future__ import annotations

from itertools import accumulate, islice, takewhile
from operator import eq

from ._admission import Admission
from ._eviction import Eviction
from ._partition import PartitionState
from ._rules import NEEDS_RULES, Refusal, Rules
from ._status_log import logger
from ._store import GroupStore
from ._token_ledger import group_tokens
from ._validation import describe
from .errors import ConfigError
from .metrics import SampleMetrics
from .policy import overridden_select
from .records import Group

__all__ = ["TokenBatches"]

#: A batch size no partition reaches: :meth:`Rules.has_work_for` then answers only whether there
#: is eviction work.
_NO_COUNT = 1 << 63


class TokenBatches:
    """Evaluates the samples that take a token budget (the consumer's, for them).

    It owns one piece of state: the partitions already warned about a group of 0 tokens (one
    WARNING per partition per buffer). The groups are the store's, the clocks admission's.
    """

    __slots__ = ("admission", "eviction", "refuses", "rules", "store", "warned")

    def __init__(
        self,
        store: GroupStore,
        admission: Admission,
        rules: Rules,
        eviction: Eviction,
        refuses: Refusal,
    ) -> None:
        self.store = store
        self.admission = admission
        self.rules = rules
        self.eviction = eviction
        # ``refuses(part, global_steps)``: whether token admission would refuse a clock-tagged
        # in-flight group at tag max(clock, global_steps) right now (admission's refuses_at;
        # always False without token caps). The readiness rule asks it only when the sampleable
        # tokens fall short; every admission notifies parked samples, so a True is never missed.
        self.refuses = refuses
        self.warned: set[str] = set()

    def check(self, part: PartitionState | None, name: str) -> None:
        """Refuse a token budget on partition ``name`` (``part``, None while unused) that the
        rules cannot honour; changes nothing.

        Raises:
            ConfigError: the policy (or a ``ReplayBuffer`` subclass) overrides the selection,
                or the partition has a task mixture.
            Exception: whatever the policy's ``is_exempt`` raised.
        """
        rules = self.rules
        label = overridden_select(rules.policy)
        if label is not None:
            raise ConfigError(
                f"{label} overrides the selection, which cannot be used with a token budget: a select "
                "returns a count of groups, and a token batch is the longest prefix of the default order "
                "(oldest first) within the budget; sample with batch_size= instead"
            )
        if rules.tasks and (part.cells is not None if part is not None else not rules.policy.is_exempt(name)):
            raise ConfigError(
                f"partition {describe(name)} has a task mixture, which cannot be used with a token budget: "
                "its quotas are counts of groups, and splitting a budget of tokens by the weights is not "
                "supported yet; sample with batch_size= instead"
            )

    def has_work(self, part: PartitionState, global_steps: int, budget: int) -> bool:
        """Whether evaluating a sample of ``budget`` tokens at ``global_steps`` could return a
        batch or evict something (a necessary condition, as :meth:`Rules.has_work_for`).

        Raises:
            Exception: whatever a policy hook raised.
        """
        rules = self.rules
        return rules.has_work_for(part, global_steps, _NO_COUNT) or rules.token_batch_ready(
            part, global_steps, budget, self.refuses
        )

    def evaluate(self, part: PartitionState, global_steps: int, metrics: SampleMetrics) -> list[Group] | None:
        """Evict what must go, then take the batch of ``metrics.token_budget`` tokens if the
        readiness rule allows it; else None. (``part`` has no task mixture: :meth:`check`.)

        Raises:
            StalebufError: ``on_evict`` re-admits groups that are evicted again at once.
            Exception: whatever a policy hook or ``on_evict`` raised, the buffer consistent.
        """
        rules, budget = self.rules, metrics.token_budget
        assert budget is not None  # a token sample's
        left = rules.quick_verdict(part, global_steps, 1) == NEEDS_RULES and self.eviction.run(
            part, global_steps, metrics
        )
        if not rules.token_batch_ready(part, global_steps, budget, self.refuses):
            if left:
                self.admission.wake(part.name)
            return None
        warned = part.name in self.warned
        count, tokens, oversized, zero = prefix(part, budget, not warned)
        if zero and not warned:
            self.warned.add(part.name)
            logger.warning(
                "sample(token_budget=%d) on partition %s selected a group of 0 tokens: token batches "
                "need tokens= (or versions=) on every put; a group without them counts as 0 tokens",
                budget,
                describe(part.name),
            )
        groups = self.store.take_batch(part, None, count)
        self.admission.batch_taken(part.name, global_steps)
        metrics.oldest_first = True
        metrics.batch_tokens, metrics.oversized_groups = tokens, int(oversized)
        return groups


def prefix(part: PartitionState, budget: int, find_zero: bool = True) -> tuple[int, int, bool, bool]:
    """``(count, tokens, oversized, zero)`` of the batch of ``budget`` tokens from ``part``'s
    ready groups (at least one): the longest prefix, oldest first, whose tokens are ``<=
    budget``, or through the first group holding tokens when that one alone is over it
    (``oversized``); ``zero``: the batch holds a group of 0 tokens (looked for only if
    ``find_zero``). O(k) for k groups."""
    ready = part.ready
    # C-level: the running totals up to the first over the budget (read, then dropped).
    totals = list(takewhile(budget.__ge__, accumulate(map(group_tokens, ready.iter_groups()))))
    count = len(totals)
    tokens = totals[-1] if count else 0
    zero = find_zero and bool(count) and (not totals[0] or any(map(eq, totals, islice(totals, 1, None))))
    if tokens or count == ready.count:
        return count, tokens, False, zero
    # Nothing before held a token, and the next group alone is over the budget: it goes too.
    return count + 1, group_tokens(next(islice(ready.iter_groups(), count, None))), True, zero
