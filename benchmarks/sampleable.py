"""``sampleable_count`` with N resident groups that are all stale (and, for reference, all fresh).

The call changes nothing, so it is simply repeated. Each size is interleaved with a reference
set of the layout's first size, as in P3: ``t(N) / t(ref)`` stays bounded for an O(1) or
O(log N) count, and grows with the number of dispatch steps for a walk over the stale ones.
Groups hold one trajectory (the count never reads trajectories), 256 per dispatch step or one
per step.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial

import anyio

from report import Report, Row, fmt_n, status, us
from sizes import Sizes
from workloads import BIG_THRESHOLD, Resident, interleaved

__all__ = ["run", "timed_count"]


async def timed_count(res: Resident, stale: bool) -> int:
    """Time one ``sampleable_count``: at a step where every group is stale, or none is."""
    g = res.global_steps + BIG_THRESHOLD if stale else res.global_steps
    start = time.perf_counter_ns()
    count = res.buf.sampleable_count(g)
    elapsed = time.perf_counter_ns() - start
    if count != (0 if stale else res.n):
        raise AssertionError(f"sampleable_count gave {count}")
    return elapsed


def _timed(res: Resident, stale: bool) -> Callable[[], Awaitable[int]]:
    return partial(timed_count, res, stale)


async def _layout(sizes: Sizes, report: Report, per_step: int, layout_sizes: tuple[int, ...]) -> None:
    layout = "one group per dispatch step" if per_step == 1 else f"{per_step} groups per dispatch step"
    ref_n, *others = layout_sizes
    ref = Resident(ref_n, per_step=per_step, trajectories=1)
    for n in others:
        status(f"Count: sampleable_count, {layout}, N={n}")
        res = Resident(n, per_step=per_step, trajectories=1)
        for stale in (True, False):
            t_n, t_ref = await interleaved(_timed(ref, stale), _timed(res, stale), sizes.count_reps)
            state = "all stale" if stale else "all fresh (for reference)"
            judged = stale and n == others[-1]
            report.add(
                Row(
                    target="Count",
                    what=f"sampleable_count, N={fmt_n(n)} resident groups {state}, {layout}, "
                    f"vs N={fmt_n(ref_n)} (median of {sizes.count_reps}, interleaved)",
                    stalebuf=us(t_n),
                    baseline=f"{us(t_ref)} (N={fmt_n(ref_n)})",
                    ratio=f"{t_n / t_ref:.2f}x",
                    goal="<= 3 (O(1) or O(log N))" if judged else "",
                    verdict=report.check("Count", t_n <= 3 * t_ref) if judged else "info",
                )
            )
        res.close()
    ref.close()


async def _count(sizes: Sizes, report: Report) -> None:
    for per_step, layout_sizes in sizes.count_layouts:
        await _layout(sizes, report, per_step, layout_sizes)


def run(sizes: Sizes, report: Report) -> None:
    """Measure ``sampleable_count`` and add its rows to ``report``."""
    anyio.run(_count, sizes, report, backend="asyncio")
