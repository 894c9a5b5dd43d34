"""The cyclic garbage collector's share of building a large resident set.

Builds ``gc_groups`` resident FINISHED groups of 8 trajectories with ``put_group_nowait`` (256 per
dispatch step), once with the collector enabled as the process had it and once with
``gc.disable()`` around the build, alternating ``gc_reps`` times; the buffer is dropped and
collected outside the timed region. The ratio is what the collector adds. Also counts the
GC-tracked objects one resident group leaves behind (after a collection, so tuples the collector
untracks are not counted).
"""

from __future__ import annotations

import gc
import statistics
import time

from report import Report, Row, fmt_n, ratio, status, us
from sizes import Sizes
from stalebuf import ReplayBuffer, SamplerConfig
from workloads import BIG_THRESHOLD, PER_STEP, TRAJECTORIES_PER_GROUP

__all__ = ["build_ns", "run", "tracked_per_group"]


def _build(uids: list[str]) -> ReplayBuffer:
    buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=BIG_THRESHOLD))
    payloads = [None] * TRAJECTORIES_PER_GROUP
    put_group = buf.put_group_nowait
    for i, uid in enumerate(uids):
        put_group(uid, payloads, global_steps=i // PER_STEP)
    return buf


def build_ns(uids: list[str], collector: bool) -> int:
    """Time building a buffer of ``len(uids)`` groups with the collector on or off."""
    gc.collect()
    was_enabled = gc.isenabled()
    if not collector:
        gc.disable()
    try:
        start = time.perf_counter_ns()
        buf = _build(uids)
        elapsed = time.perf_counter_ns() - start
    finally:
        if was_enabled:
            gc.enable()
    del buf  # freed outside the timed region
    gc.collect()
    return elapsed


def tracked_per_group(n: int) -> float:
    """GC-tracked objects per resident group (``n`` groups, after a full collection)."""
    uids = [f"t{i}" for i in range(n)]
    gc.collect()
    before = len(gc.get_objects())
    buf = _build(uids)
    gc.collect()
    tracked = (len(gc.get_objects()) - before) / n
    del buf
    gc.collect()
    return tracked


def run(sizes: Sizes, report: Report) -> None:
    """Measure the collector's share of a large build and add its rows to ``report``."""
    n = sizes.gc_groups
    uids = [f"g{i}" for i in range(n)]
    on: list[int] = []
    off: list[int] = []
    for rep in range(sizes.gc_reps):
        status(f"GC: building {n} resident groups with the collector on and off ({rep + 1}/{sizes.gc_reps})")
        on.append(build_ns(uids, collector=True))
        off.append(build_ns(uids, collector=False))
    t_on, t_off = statistics.median(on), statistics.median(off)
    report.add(
        Row(
            target="GC",
            what=f"building {fmt_n(n)} resident groups x {TRAJECTORIES_PER_GROUP} with put_group_nowait, "
            f"collector enabled vs gc.disable(), per group (median of {sizes.gc_reps}, interleaved)",
            stalebuf=us(t_on / n),
            baseline=f"{us(t_off / n)} (gc.disable())",
            ratio=ratio(t_on, t_off),
            goal="<= 1.5x",
            verdict=report.check("GC", t_on <= 1.5 * t_off),
        )
    )
    report.info(
        "GC",
        "GC-tracked objects left per resident group of 8 (after a full collection)",
        f"{tracked_per_group(min(n, 10_000)):.1f}",
    )
