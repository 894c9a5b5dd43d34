"""Balanced splits of a batch for data-parallel ranks: the LPT rule behind ``Batch.split``.

LPT (longest processing time first): items in decreasing cost, ties by their order in the
batch, each to the part with the least load so far, ties to the lowest part index. Its
maximum load is within ``4/3 - 1/(3n)`` of the optimum (Graham, 1969), not optimal: the
optimum is NP-hard, LPT costs O(k log k) for k items (a sort, then a heap of n loads).

No stalebuf import on purpose: ``_batch`` imports this module, and builds the parts' batches
from the index lists it returns.
"""

from __future__ import annotations

import heapq
import reprlib
from collections.abc import Sequence
from itertools import accumulate, pairwise, repeat
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["COSTS", "SPLIT_BY", "Costs", "SplitBy", "SplitCost", "check_split", "item_costs", "lpt_parts"]

Int64s = npt.NDArray[np.int64]
#: Item costs: an int64 array, or Python ints where int64 could overflow.
Costs = Int64s | list[int]
SplitCost = Literal["tokens", "quadratic", "groups"]
SplitBy = Literal["group", "trajectory"]
#: The costs ``split`` knows: tokens, tokens squared (attention-bound work), one per item.
COSTS: tuple[SplitCost, ...] = ("tokens", "quadratic", "groups")
#: What ``split`` may assign to parts: whole groups, or single trajectories.
SPLIT_BY: tuple[SplitBy, ...] = ("group", "trajectory")

#: The largest int numpy sums exactly: a larger total is summed in Python ints instead.
_MAX_INT64 = 2**63 - 1
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SCALARS = (type(None), bool, float, str, bytes)


def _shown(value: object, typed: bool = True) -> str:
    """A short, safe description of a bad argument: a builtin scalar with its type ("float
    2.0"; an int without it unless ``typed``), anything else by its type alone (a user
    object's repr is never called)."""
    kind = type(value)
    if kind is int:
        bits = value.bit_length()  # type: ignore[attr-defined]
        shown = repr(value) if bits <= 128 else f"an int of {bits} bits"
        return f"int {shown}" if typed and bits <= 128 else shown
    if kind in _SCALARS:
        return f"{kind.__name__} {_SHORT.repr(value)}"
    return f"a {kind.__name__}"


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` as one of the strings ``choices`` (a str subclass counts by its plain value)."""
    listed = ", ".join(map(repr, choices))
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {listed}; got {_shown(value)}")
    text = str.__str__(value)
    if text not in choices:
        raise ValueError(f"{name} must be one of {listed}; got {_SHORT.repr(text)}")
    return text


def check_split(n: object, cost: object, by: object) -> tuple[int, SplitCost, SplitBy]:
    """Return ``(n, cost, by)`` checked.

    Raises:
        TypeError: ``n`` is not an int (a bool is not), or ``cost`` or ``by`` is not a str.
        ValueError: ``n`` is below 1 or above ``2**63 - 1``, or ``cost`` or ``by`` is not one
            of the names above.
    """
    if type(n) is not int:
        raise TypeError(f"n must be an int >= 1, got {_shown(n)}")
    if not 1 <= n <= _MAX_INT64:
        raise ValueError(f"n must be an int >= 1 (and < 2**63), got {_shown(n, typed=False)}")
    checked_cost = _choice("cost", cost, COSTS)
    checked_by = _choice("by", by, SPLIT_BY)
    return n, checked_cost, checked_by  # type: ignore[return-value]


def item_costs(tokens: Int64s, sizes: Sequence[int] | None, cost: SplitCost) -> Costs:
    """The cost of each item: of each group of ``sizes[i]`` consecutive trajectories (``sizes``
    None: each trajectory is an item) whose token counts are ``tokens`` (int64, each ``>= 0``).
    Exact: int64 when their total fits it, else Python ints."""
    count = len(tokens) if sizes is None else len(sizes)
    if cost == "groups":
        return np.ones(count, dtype=np.int64)
    if not tokens.size:
        return np.zeros(count, dtype=np.int64)
    longest = int(tokens.max())
    per_item = longest * longest if cost == "quadratic" else longest
    if per_item * tokens.size > _MAX_INT64:  # int64 could overflow: exact Python ints instead
        values: list[int] = tokens.tolist()
        if cost == "quadratic":
            values = [t * t for t in values]
        return values if sizes is None else _group_sums(values, sizes)
    array = tokens * tokens if cost == "quadratic" else tokens
    if sizes is None:
        return array
    if sizes.count(sizes[0]) == count:  # groups of one size, the usual case
        sums: Int64s = array.reshape(count, sizes[0]).sum(axis=1)
        return sums
    totals = np.zeros(tokens.size + 1, dtype=np.int64)
    np.cumsum(array, out=totals[1:])
    bounds = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64), out=bounds[1:])
    sums = totals[bounds[1:]] - totals[bounds[:-1]]
    return sums


def _group_sums(values: list[int], sizes: Sequence[int]) -> list[int]:
    """The sums of consecutive runs of ``sizes[i]`` values, in Python ints."""
    totals = [0, *accumulate(values)]
    bounds = [0, *accumulate(sizes)]
    return [totals[b] - totals[a] for a, b in pairwise(bounds)]


def _by_cost(costs: Int64s) -> Int64s:
    """The items in decreasing cost, equal costs in increasing index (``costs >= 0``)."""
    count = costs.size
    longest = int(costs.max())
    if (longest + 1) * count > _MAX_INT64:
        order: Int64s = np.argsort(-costs, kind="stable")
        return order
    # One unique key per item, (longest - cost) * count + index: an unstable sort of them (twice
    # as fast as a stable argsort here) gives the same order, and the key modulo count its item.
    keys = (longest - costs) * count
    keys += np.arange(count, dtype=np.int64)
    keys.sort()
    keys %= count
    return keys


def lpt_parts(costs: Costs, n: int) -> list[list[int]]:
    """The items of each of ``n`` parts by the LPT rule (see the module docstring), given their
    costs (``>= 0``; an int64 array must have a total int64 holds): ``n`` lists of item indices,
    each in increasing order; a part no item reaches is empty."""
    count = len(costs)
    if not count:
        return [[] for _ in repeat(None, n)]
    # Each part's load and index as one int, load * n + part: the heap's least is the least
    # load, ties to the lowest part. The first k parts suffice for k items: while an item is
    # left, one of them has not been reached yet (load 0). int64 when no key can overflow it.
    if isinstance(costs, np.ndarray):
        array = costs
        total = int(array.sum())
    else:
        array = None
        total = sum(costs)
    fits = (total + 1) * n <= _MAX_INT64
    if fits:
        if array is None:
            array = np.array(costs, dtype=np.int64)
        order = _by_cost(array)
        steps: list[int] = (array[order] * n).tolist()
    else:
        exact: list[int] = costs.tolist() if isinstance(costs, np.ndarray) else list(costs)
        ranked = sorted(range(count), key=exact.__getitem__, reverse=True)  # stable as well
        steps = [exact[item] * n for item in ranked]
    heap = list(range(min(n, count)))
    replace = heapq.heapreplace
    # heapreplace returns the key it pops, the heap's least before the item's cost is added:
    # the part the item goes to.
    keys = [replace(heap, heap[0] + step) for step in steps]
    if not fits:
        parts: list[list[int]] = [[] for _ in repeat(None, n)]
        for item, key in zip(ranked, keys, strict=True):
            parts[key % n].append(item)
        for items in parts:
            items.sort()  # back to batch order
        return parts
    # The part of each item in cost order, then every item as part * count + item: one sort
    # puts them by part, each part's in batch order (the keys are unique), and one list of the
    # items is cut into the parts (cheaper than a stable argsort and a split into arrays).
    owner = np.fromiter(keys, np.int64, count) % n
    by_part = owner * count
    by_part += order
    by_part.sort()
    flat: list[int] = (by_part % count).tolist()
    ends: list[int] = np.bincount(owner, minlength=min(n, count)).cumsum().tolist()
    parts = [flat[start:end] for start, end in pairwise([0, *ends])]
    parts.extend([] for _ in repeat(None, n - len(parts)))
    return parts
