"""Task quotas: how many of a batch's groups each task of a mixture contributes.

The largest-remainder method on the weights, in exact rational arithmetic: task ``i`` gets
``floor(B * w_i)`` groups, and the groups left over go one each to the largest remainders
``B * w_i - floor(B * w_i)``, equal remainders to the task whose name sorts first. The quotas
depend on ``B`` only, so a run that samples with one ``B`` converges to the shares
``q_i(B) / B``, each within ``1 / B`` of its weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

__all__ = ["normalised", "quotas"]


def normalised(weights: Mapping[str, float]) -> dict[str, Fraction]:
    """The weights (finite numbers > 0: ints, floats, Fractions) as exact fractions summing
    to 1, by task name (sorted)."""
    exact = {task: Fraction(weights[task]) for task in sorted(weights)}
    total = sum(exact.values())
    return {task: weight / total for task, weight in exact.items()}


def quotas(shares: Mapping[str, Fraction], batch_size: int) -> dict[str, int]:
    """Each task's groups in a batch of ``batch_size`` (``shares``: :func:`normalised` weights);
    the quotas sum to ``batch_size``."""
    ideal = {task: share * batch_size for task, share in shares.items()}
    quota = {task: int(value) for task, value in ideal.items()}  # floor: the values are >= 0
    left = batch_size - sum(quota.values())
    by_remainder = sorted(ideal, key=lambda task: (-(ideal[task] - quota[task]), task))
    for task in by_remainder[:left]:
        quota[task] += 1
    return quota
