"""What one ``sample`` does to a partition, as questions asked of the rule book.

Every function here only *reads*: it runs the policy's hooks (which may raise) and returns
what should change. The buffer applies the answer afterwards, so a hook that raises leaves
the buffer exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._partition import PartitionState
from ._waiting import Waiter
from .errors import StalebufError
from .policy import StalenessPolicy, select_label
from .records import Group

__all__ = [
    "asks_defaults",
    "choose_batch",
    "gate_open",
    "has_work_for",
    "oldest_is_stale",
    "stale_in_flight_steps",
    "stale_steps",
]


# The default selection takes the first batch_size candidates: its answer needs no check.
_DEFAULT_SELECT = StalenessPolicy.select


def asks_defaults(rules: StalenessPolicy, hooks: tuple[str, ...]) -> bool:
    """Whether ``rules`` answers every one of ``hooks`` (names of StalenessPolicy methods) with
    the default code, neither overridden nor replaced on the instance (asked once, when a
    buffer is built).

    Then a hot path may ask ``staleness`` directly (or take the oldest groups without calling
    ``select``): the same answers, without a Python call per question.
    """
    kind, own = type(rules), vars(rules)
    return all(getattr(kind, hook) is getattr(StalenessPolicy, hook) and hook not in own for hook in hooks)


def oldest_is_stale(rules: StalenessPolicy, part: PartitionState, global_steps: int) -> bool:
    """Whether the drop rule evicts the partition's oldest ready group at ``global_steps``.

    Stale groups are a prefix of the ready order, so this decides if there is any.
    """
    ready = part.ready
    return bool(
        rules.drops
        and ready.count
        and not part.exempt
        and rules.is_stale(global_steps, ready.oldest_step(), part.name)
    )


def stale_steps(rules: StalenessPolicy, part: PartitionState, global_steps: int) -> list[int]:
    """Return the dispatch steps, oldest first, whose ready groups the drop rule evicts."""
    if not oldest_is_stale(rules, part, global_steps):
        return []
    name = part.name
    return part.ready.stale_steps(lambda step: rules.is_stale(global_steps, step, name))


def stale_in_flight_steps(rules: StalenessPolicy, part: PartitionState, global_steps: int) -> list[int]:
    """Return the dispatch steps, oldest first, whose in-flight groups no later sample could
    return (only with in-flight eviction): the drop rule already holds for them."""
    if not part.evict_in_flight:
        return []
    name = part.name
    return part.in_flight.stale_steps(lambda step: rules.is_stale(global_steps, step, name))


def gate_open(rules: StalenessPolicy, part: PartitionState, global_steps: int) -> bool:
    """The wait gate: no in-flight group the sample at ``global_steps`` must wait for."""
    if rules.drops or part.exempt:
        return True
    oldest = part.in_flight.oldest()
    return oldest is None or not rules.must_wait_for(global_steps, oldest, part.name)


def has_work_for(rules: StalenessPolicy, part: PartitionState, waiter: Waiter) -> bool:
    """Whether evaluating for ``waiter`` could return a batch or evict something.

    A necessary condition only (eviction can still leave too few groups), but every wake-up
    it allows either returns a batch or evicts at least one group.
    """
    if part.failed or oldest_is_stale(rules, part, waiter.global_steps):
        return True
    if part.evict_in_flight:
        oldest = part.in_flight.oldest()
        if oldest is not None and rules.is_stale(waiter.global_steps, oldest, part.name):
            return True
    return part.ready.count >= waiter.batch_size and gate_open(rules, part, waiter.global_steps)


def choose_batch(
    rules: StalenessPolicy, part: PartitionState, global_steps: int, batch_size: int
) -> tuple[list[Group] | None, bool]:
    """Ask the policy which groups to return; return ``(chosen, oldest)``.

    ``chosen`` is None when no batch may be returned yet; ``oldest`` says the chosen groups
    are the ``batch_size`` oldest in order (so they can be taken in O(batch_size)).

    Raises:
        StalebufError: the policy returned something other than ``batch_size`` distinct
            groups from its candidates.
    """
    ready = part.ready
    if ready.count < batch_size or not gate_open(rules, part, global_steps):
        return None, False
    select = rules.select
    chosen = list(select(ready.iter_groups(), batch_size, global_steps, part.name))
    if (getattr(select, "__func__", None) is _DEFAULT_SELECT and len(chosen) == batch_size) or (
        len(chosen) == batch_size and ready.is_oldest(chosen)
    ):
        return chosen, True
    _check_selection(rules, chosen, ready.iter_groups(), batch_size)
    return chosen, False


def _check_selection(
    rules: StalenessPolicy, chosen: list[Group], candidates: Iterable[Group], batch_size: int
) -> None:
    ready = {id(group) for group in candidates}
    if (
        len(chosen) != batch_size
        or len({id(group) for group in chosen}) != batch_size
        or not all(id(group) in ready for group in chosen)
    ):
        raise StalebufError(
            f"{select_label(rules)} must return {batch_size} distinct groups "
            f"taken from its candidates, got {len(chosen)}"
        )
