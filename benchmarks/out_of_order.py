"""Out-of-order finishing within one dispatch step: ``mark_finished_nowait`` with ``order_groups``
RUNNING groups in one step, finished in admission order (the baseline), in a random order, and
in reverse order (the worst case for the index's heap of late groups).

The three buffers are built alike (no trajectories, so that the call's own cost is measured)
and finished chunk by chunk, alternating between them; the per-call cost of each chunk is
its time over its size, and the medians over the chunks are compared.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

from report import Report, Row, fmt_n, ratio, status, us
from sizes import Sizes
from stalebuf import ReplayBuffer, SamplerConfig
from workloads import BIG_THRESHOLD, gc_paused

__all__ = ["ORDERS", "finish_side_by_side", "run"]

#: The finishing orders compared with admission order. "shuffled blocks" is random within each
#: block of 1,000 groups (blocks in order): as out of order for the index, without the cache
#: misses of jumping across all the groups' records that a random order over the whole step has.
ORDERS = ("admission order", "random order", "reverse order", "shuffled blocks of 1,000")
_BLOCK = 1_000


def _running(n: int, prefix: str) -> tuple[ReplayBuffer, list[str]]:
    """A buffer with ``n`` RUNNING groups, all dispatched at step 0, and their uids."""
    buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=BIG_THRESHOLD))
    uids = [f"{prefix}{i}" for i in range(n)]
    for uid in uids:
        buf.add_prompt_nowait(uid, global_steps=0)
        buf.mark_running_nowait(uid)
    return buf, uids


def finish_side_by_side(n: int, chunk: int, seed: int = 1) -> dict[str, float]:
    """Median ns per ``mark_finished_nowait`` in each of :data:`ORDERS`, chunks alternating."""
    with gc_paused():
        sides = [_running(n, f"o{i}x") for i in range(len(ORDERS))]
    rng = random.Random(seed)
    shuffled_blocks: list[str] = []
    for start in range(0, n, _BLOCK):
        shuffled_blocks += rng.sample(sides[3][1][start : start + _BLOCK], min(_BLOCK, n - start))
    orders = [sides[0][1], rng.sample(sides[1][1], n), sides[2][1][::-1], shuffled_blocks]
    per_call: list[list[float]] = [[] for _ in ORDERS]
    for start in range(0, n - chunk + 1, chunk):
        for i, (buf, _) in enumerate(sides):
            finish = buf.mark_finished_nowait
            uids = orders[i][start : start + chunk]
            began = time.perf_counter_ns()
            for uid in uids:
                finish(uid)
            per_call[i].append((time.perf_counter_ns() - began) / chunk)
    if any(buf.stats().total.finished != n for buf, _ in sides):
        raise AssertionError("a group was not finished")
    del sides, orders
    gc.unfreeze()
    gc.collect()
    return {name: statistics.median(values) for name, values in zip(ORDERS, per_call, strict=True)}


def run(sizes: Sizes, report: Report) -> None:
    """Measure out-of-order finishing and add its rows to ``report``."""
    n, chunk = sizes.order_groups, sizes.order_chunk
    status(f"Order: mark_finished with {n} groups in one dispatch step, in and out of order")
    cost = finish_side_by_side(n, chunk)
    in_order = cost[ORDERS[0]]
    report.info(
        "Order",
        f"mark_finished_nowait, {fmt_n(n)} RUNNING groups in one dispatch step, finished in admission "
        f"order (median of {n // chunk} chunks of {chunk} calls)",
        us(in_order),
    )
    for name in ORDERS[1:]:
        judged = name != ORDERS[-1]
        report.add(
            Row(
                target="Order",
                what=f"same, finished in {name} (chunks interleaved with the admission-order ones)",
                stalebuf=us(cost[name]),
                baseline=f"{us(in_order)} (admission order)",
                ratio=ratio(cost[name], in_order),
                goal="<= 2x" if judged else "",
                verdict=report.check("Order", cost[name] <= 2 * in_order) if judged else "info",
            )
        )
