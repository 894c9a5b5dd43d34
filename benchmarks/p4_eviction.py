"""P4, drop eviction: one ``sample(B=1)`` that evicts k stale groups added just before it.

Cost at k=1,000 vs N (interleaved with N=1e3), cost per evicted group vs k at fixed N as
``(t(k) - t(0)) / k``, and a stress layout with the k stale groups at k distinct dispatch
steps. The measurements reuse the resident sets of P3, so ``p3_sample.run`` drives them;
this module holds the timed call and the rows.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

from report import Report, Row, fmt_n, ms, status, us, vs_ref
from sizes import Sizes
from workloads import Resident, interleaved

__all__ = ["evict_vs_n_rows", "layout_eviction_row", "p4_vs_k", "timed_eviction", "vs_k_rows"]


async def timed_eviction(res: Resident, k: int, *, distinct_steps: bool = False) -> int:
    """Add ``k`` stale groups (untimed), then time one ``sample(B=1)`` that evicts them."""
    res.add_stale(k, distinct_steps=distinct_steps)
    buf = res.buf
    g = res.global_steps
    start = time.perf_counter_ns()
    _batch, metrics = await buf.sample(g, 1, timeout=0)
    elapsed = time.perf_counter_ns() - start
    if metrics.get("training/off_policy/dropped_groups", 0.0) != k:
        raise AssertionError(f"expected {k} dropped groups, got {metrics}")
    res.refill(1)
    return elapsed


async def p4_vs_k(res: Resident, sizes: Sizes) -> dict[int, float]:
    """Median cost of one sample that evicts k stale groups, for each k, at fixed N."""
    totals: dict[int, float] = {}
    for k in (0, *sizes.p4_ks):
        status(f"P4 evicting k={k} at N={res.n}")
        totals[k] = statistics.median([await timed_eviction(res, k) for _ in range(sizes.p4_reps)])
    return totals


def evict_vs_n_rows(
    sizes: Sizes, report: Report, evict_ns: dict[int, float], evict_ratio: dict[int, float]
) -> None:
    """Rows for eviction of k=``p4_k_at_n`` at every N, and the verdict on its growth."""
    k = sizes.p4_k_at_n
    ref_n, hi = sizes.p3_sizes[0], sizes.p3_sizes[-1]
    for n in sizes.p3_sizes:
        report.add(
            Row(
                target="P4",
                what=f"sample evicting k={k} stale groups, N={fmt_n(n)} (median of {sizes.p4_reps})",
                stalebuf=f"{ms(evict_ns[n])} ({us(evict_ns[n] / k)}/group)",
                ratio=vs_ref(evict_ratio[n], ref_n),
            )
        )
    report.add(
        Row(
            target="P4",
            what=f"eviction of k={k}: cost at N={fmt_n(hi)} / cost at N={fmt_n(ref_n)}",
            stalebuf=f"{evict_ratio[hi]:.2f}x",
            baseline="a scan: ~N ratio",
            goal="<= 3 (log factors)",
            verdict=report.check("P4", evict_ratio[hi] <= 3),
        )
    )


def vs_k_rows(n: int, totals: dict[int, float], sizes: Sizes, report: Report) -> None:
    """Rows for the cost per evicted group vs k at N=``n``, and the verdict that it is O(k)."""
    base = totals[0]
    marginal = {k: (total - base) / k for k, total in totals.items() if k}
    report.add(
        Row(
            target="P4",
            what=f"sample(B=1) evicting nothing, N={fmt_n(n)} (median of {sizes.p4_reps})",
            stalebuf=us(base),
        )
    )
    for k, per_group in marginal.items():
        report.add(
            Row(
                target="P4",
                what=f"sample(B=1) evicting k={k:,} stale groups, N={fmt_n(n)} (median of {sizes.p4_reps}); "
                "per group: (t(k) - t(0)) / k",
                stalebuf=f"{ms(totals[k])} ({us(per_group)}/group)",
            )
        )
    k_hi = max(marginal)
    k_lo = min((k for k in marginal if 100 <= k < k_hi), default=min(marginal))
    growth = marginal[k_hi] / marginal[k_lo]
    report.add(
        Row(
            target="P4",
            what=f"per-group eviction cost: k={k_hi:,} / k={k_lo:,}",
            stalebuf=f"{growth:.2f}x",
            goal="<= 3 (O(k))",
            verdict=report.check("P4", growth <= 3),
        )
    )
    report.scaling_k[f"P4 eviction, per evicted group (N={fmt_n(n)})"] = sorted(marginal.items())


async def layout_eviction_row(
    sizes: Sizes, report: Report, layout: str, ref: Resident, res: Resident, *, last: bool
) -> Row:
    """Evict k stale groups dispatched at k distinct steps from ``res``, interleaved with
    ``ref``; return the row (with a verdict on the largest N, ``last``)."""
    k = sizes.p4_k_at_n
    status(f"P4 stress layout: {k} stale groups at {k} distinct steps, N={res.n}")
    t_n, t_ref = await interleaved(
        partial(timed_eviction, ref, k, distinct_steps=True),
        partial(timed_eviction, res, k, distinct_steps=True),
        max(3, sizes.p4_reps // 2),
    )
    what = (
        f"stress layout, {layout}: evicting k={k} stale groups dispatched at {k} "
        f"distinct steps, N={fmt_n(res.n)} vs N={fmt_n(ref.n)}"
    )
    return report.stress_row("P4", what, t_n, t_ref, ref.n, unit=ms, judged=last)
