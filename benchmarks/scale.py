"""Scale: about 1e6 groups of 8 trajectories through ``put_group`` + ``sample(256)``, end to end,
against ``asyncio.Queue`` put+get of as many items, per trajectory.

Four producer tasks upload one group per ``put_group`` call (yielding after each group) while a
trainer samples 256 groups at a time; the baseline is four tasks putting the same number of
items into an ``asyncio.Queue`` without yielding and one task getting them (the raw put+get
of P2). The two alternate, ``scale_reps`` times each, with a full collection between runs.
"""

from __future__ import annotations

import gc
import statistics

import anyio

from report import Report, Row, fmt_n, ratio, status, us
from sizes import Sizes
from workloads import TRAJECTORIES_PER_GROUP, pipeline_stalebuf, queue_pipeline

__all__ = ["SCALE_BATCH", "run", "scale_side_by_side"]

SCALE_BATCH = 256


def scale_groups(requested: int) -> int:
    """The number of groups actually run: ``requested`` rounded up to whole batches."""
    return -(-requested // SCALE_BATCH) * SCALE_BATCH


async def scale_side_by_side(groups: int, reps: int) -> tuple[float, float]:
    """Alternate the put_group pipeline and the Queue baseline ``reps`` times; return the
    medians in ns per trajectory (stalebuf, queue)."""
    items = groups * TRAJECTORIES_PER_GROUP
    mine: list[float] = []
    theirs: list[float] = []
    for _ in range(reps):
        gc.collect()
        theirs.append(await queue_pipeline(items, yield_every=0) / items)
        gc.collect()
        mine.append(await pipeline_stalebuf(groups, batch_size=SCALE_BATCH, put_group=True) / items)
    gc.collect()
    return statistics.median(mine), statistics.median(theirs)


def run(sizes: Sizes, report: Report) -> None:
    """Measure the scale target and add its row to ``report``."""
    groups = scale_groups(sizes.scale_groups)
    status(f"Scale: {groups} groups through put_group + sample({SCALE_BATCH}), vs asyncio.Queue")
    mine, theirs = anyio.run(scale_side_by_side, groups, sizes.scale_reps, backend="asyncio")
    report.add(
        Row(
            target="Scale",
            what=f"per trajectory, end to end: {fmt_n(groups)} groups x {TRAJECTORIES_PER_GROUP} uploaded "
            f"by 4 producers with put_group (yielding after each group), trainer sample(B={SCALE_BATCH}) "
            f"concurrently (median of {sizes.scale_reps}, interleaved)",
            stalebuf=f"{us(mine)} ({1e9 / mine:,.0f} traj/s)",
            baseline=f"{us(theirs)} (Queue put+get, {fmt_n(groups * TRAJECTORIES_PER_GROUP)} items)",
            ratio=ratio(mine, theirs),
            goal="<= 1.5x",
            verdict=report.check("Scale", mine <= 1.5 * theirs),
        )
    )
