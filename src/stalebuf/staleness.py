"""The staleness rules, in exact integer arithmetic.

A group dispatched at trainer step ``p`` and trained at step ``g`` has staleness
``s = (g - p + 1) / parameter_sync_step``; ``s == 1`` is on-policy. With threshold
``T`` and sync step ``S`` the rules compare the integer *age* ``g - p + 1`` with
``T * S`` so that no float rounding can move a boundary:

- drop: a terminal group is evicted when ``s > T``, i.e. ``age > T * S``;
- wait: sampling waits while an in-flight group has ``s >= T``, i.e. ``age >= T * S``.

Both predicates are monotone in ``p``: if a group is stale, every group dispatched
earlier is stale too. The buffer relies on that to look only at the oldest groups.

A threshold of None (verl's ``max_off_policy_threshold: null``) turns staleness control off:
neither predicate ever holds, and :func:`drop_span` answers :data:`NO_SPAN`, larger than any
age a step can give, so the inline comparisons that use it never hold either.
"""

from __future__ import annotations

__all__ = ["NO_SPAN", "age", "blocks_wait", "drop_span", "exceeds_drop"]

#: The span of "no threshold": steps are below 2**63, so every age ``g - p + 1`` is at most
#: 2**63 and below this; ``p < g + 1 - NO_SPAN`` is then never true for a step ``p >= 0``.
NO_SPAN = 1 << 64


def age(global_steps: int, dispatch_step: int) -> int:
    """Return ``global_steps - dispatch_step + 1``: how many trainer steps the group spans."""
    return global_steps - dispatch_step + 1


def exceeds_drop(global_steps: int, dispatch_step: int, threshold: int | None, sync_step: int) -> bool:
    """Return True when a terminal group must be dropped: ``s > threshold`` (never for None)."""
    return threshold is not None and global_steps - dispatch_step + 1 > threshold * sync_step


def drop_span(threshold: int | None, sync_step: int) -> int:
    """Return ``T * S``, the bound the hot paths compare with inline: :func:`exceeds_drop` holds
    exactly when ``dispatch_step < global_steps + 1 - drop_span(threshold, sync_step)``, so one
    subtraction gives the first dispatch step a sample at ``global_steps`` keeps (:data:`NO_SPAN`
    for no threshold: nothing is ever stale)."""
    return NO_SPAN if threshold is None else threshold * sync_step


def blocks_wait(global_steps: int, dispatch_step: int, threshold: int | None, sync_step: int) -> bool:
    """Return True when an in-flight group must finish before sampling: ``s >= threshold``
    (never for None)."""
    return threshold is not None and global_steps - dispatch_step + 1 >= threshold * sync_step
