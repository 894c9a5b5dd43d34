"""P3, sample cost vs N: ``sample(B=256, timeout=0)`` with N resident FINISHED groups.

Every measurement at N is interleaved with one on a reference set of N=1e3; the taken
groups are put back outside the timed region so N stays N. Two stress layouts (1
trajectory per group) put every group in one dispatch step, or each in its own. P4 is
measured on the same resident sets, in the same loop (see :mod:`p4_eviction`).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from functools import partial

import anyio

import p4_eviction
from report import Report, Row, fmt_n, one_poll, status, us, vs_ref
from sizes import Sizes
from workloads import (
    BASE_STEP,
    BIG_THRESHOLD,
    PER_STEP,
    TRAJECTORIES_PER_GROUP,
    PollingBuffer,
    Resident,
    add_polling_group,
    gc_paused,
    interleaved,
)

__all__ = ["P3_BATCH", "polling_resident_poll_ns", "run", "timed_sample"]

P3_BATCH = 256


@dataclass
class _BySize:
    """Medians per N of the main loop (P3 sample, P4 eviction of k=p4_k_at_n)."""

    sample_ns: dict[int, float] = field(default_factory=dict)
    sample_ratio: dict[int, float] = field(default_factory=dict)
    evict_ns: dict[int, float] = field(default_factory=dict)
    evict_ratio: dict[int, float] = field(default_factory=dict)
    vs_k: dict[int, float] = field(default_factory=dict)  # P4 cost vs k at N=p4_fixed_n


async def timed_sample(res: Resident) -> int:
    """Time one ``sample(B=256, timeout=0)`` on a resident set; then refill it (untimed)."""
    buf = res.buf
    g = res.global_steps
    start = time.perf_counter_ns()
    batch, _metrics = await buf.sample(g, P3_BATCH, timeout=0)
    elapsed = time.perf_counter_ns() - start
    if len(batch) != P3_BATCH:
        raise AssertionError("short batch")
    res.refill(P3_BATCH)
    return elapsed


def polling_resident_poll_ns(n: int, reps: int) -> list[int]:
    """Time ``PollingBuffer.poll(B=256)`` with ``n`` resident finished groups."""
    buf = PollingBuffer(2.0, threshold=BIG_THRESHOLD)
    with gc_paused():
        for i in range(n):
            add_polling_group(buf, f"r{i}", BASE_STEP + i // PER_STEP)
    top = BASE_STEP + n // PER_STEP + 1
    out: list[int] = []
    uid = n
    for _ in range(reps):
        start = time.perf_counter_ns()
        batch = buf.poll(top + 1, P3_BATCH)
        out.append(time.perf_counter_ns() - start)
        if batch is None or len(batch) != P3_BATCH:
            raise AssertionError("short batch")
        for _ in range(P3_BATCH):
            uid += 1
            add_polling_group(buf, f"r{uid}", top)
        top += 1
    del buf
    gc.unfreeze()
    gc.collect()
    return out


# -- the stress layouts ------------------------------------------------------------------


def _layout_name(per_step: int | None) -> str:
    if per_step is None:
        return "all groups in one dispatch step"
    return "one group per dispatch step" if per_step == 1 else f"{per_step} groups per step"


async def _layout(
    sizes: Sizes, report: Report, per_step: int | None, layout_sizes: tuple[int, ...]
) -> tuple[list[Row], list[Row]]:
    """One stress layout: P3 at every size past the first (the reference), and P4 too with
    one group per step. Returns (P3 rows, P4 rows)."""
    layout = _layout_name(per_step)
    p3_rows: list[Row] = []
    p4_rows: list[Row] = []
    ref_n, *others = layout_sizes
    status(f"P3 stress layout: {layout}, N={ref_n}")
    ref = Resident(ref_n, per_step=per_step, trajectories=1)
    for n in others:
        status(f"P3 stress layout: {layout}, N={n}")
        res = Resident(n, per_step=per_step, trajectories=1)
        t_n, t_ref = await interleaved(
            partial(timed_sample, ref), partial(timed_sample, res), sizes.p3_layout_reps
        )
        series = report.scaling.setdefault(f"P3 sample(B=256), stress layout: {layout}", [])
        if not series:
            series.append((ref_n, t_ref))
        series.append((n, t_n))
        last = n == others[-1]
        what = (
            f"stress layout, {layout}: sample(B=256), N={fmt_n(n)} vs N={fmt_n(ref_n)} "
            f"(median of {sizes.p3_layout_reps}, interleaved)"
        )
        p3_rows.append(report.stress_row("P3", what, t_n, t_ref, ref_n, unit=us, judged=last))
        if per_step == 1:
            p4_rows.append(await p4_eviction.layout_eviction_row(sizes, report, layout, ref, res, last=last))
        res.close()
    ref.close()
    return p3_rows, p4_rows


async def _layouts(sizes: Sizes, report: Report) -> tuple[list[Row], list[Row]]:
    """P3 and P4 on the stress layouts (1 trajectory per group, to keep the builds short:
    neither ``sample`` nor eviction looks at trajectories). Returns (P3 rows, P4 rows)."""
    p3_rows: list[Row] = []
    p4_rows: list[Row] = []
    for per_step, layout_sizes in sizes.p3_layouts:
        p3, p4 = await _layout(sizes, report, per_step, layout_sizes)
        p3_rows += p3
        p4_rows += p4
    return p3_rows, p4_rows


# -- the main sizes ----------------------------------------------------------------------


async def _by_size(sizes: Sizes) -> _BySize:
    """P3 and P4 at every N, each interleaved with the reference set (the first size)."""
    ref_n = sizes.p3_sizes[0]
    k = sizes.p4_k_at_n
    out = _BySize()
    status(f"P3 building the reference buffer, N={ref_n}")
    ref = Resident(ref_n)
    for n in sizes.p3_sizes:
        status(f"P3 building N={n} resident groups x {TRAJECTORIES_PER_GROUP} trajectories")
        res = ref if n == ref_n else Resident(n)
        mine, theirs = await interleaved(
            partial(timed_sample, ref), partial(timed_sample, res), sizes.p3_reps
        )
        out.sample_ns[n] = mine
        out.sample_ratio[n] = 1.0 if res is ref else mine / theirs
        status(f"P4 evicting k={k} stale groups at N={n}")
        mine, theirs = await interleaved(
            partial(p4_eviction.timed_eviction, ref, k),
            partial(p4_eviction.timed_eviction, res, k),
            sizes.p4_reps,
        )
        out.evict_ns[n] = mine
        out.evict_ratio[n] = 1.0 if res is ref else mine / theirs
        if n == sizes.p4_fixed_n:
            out.vs_k = await p4_eviction.p4_vs_k(res, sizes)
        if res is not ref:
            res.close()
    ref.close()
    return out


def _sample_rows(sizes: Sizes, report: Report, by: _BySize, poll_ns: dict[int, float]) -> None:
    """A row per N, with one poll of the polling baseline where it was run."""
    ref_n = sizes.p3_sizes[0]
    for n in sizes.p3_sizes:
        report.add(
            Row(
                target="P3",
                what=f"sample(B=256), N={fmt_n(n)} resident groups (median of {sizes.p3_reps}; "
                f"x N={fmt_n(ref_n)} interleaved)",
                stalebuf=us(by.sample_ns[n]),
                baseline=one_poll(poll_ns.get(n)),
                ratio=vs_ref(by.sample_ratio[n], ref_n),
            )
        )


def _verdict_rows(sizes: Sizes, report: Report, by: _BySize) -> None:
    """The two P3 verdicts: growth from the first to the largest N, and the absolute cost."""
    ref_n, hi = sizes.p3_sizes[0], sizes.p3_sizes[-1]
    report.add(
        Row(
            target="P3",
            what=f"t(N={fmt_n(hi)}) / t(N={fmt_n(ref_n)})",
            stalebuf=f"{by.sample_ratio[hi]:.2f}x",
            goal="<= 3",
            verdict=report.check("P3", by.sample_ratio[hi] <= 3),
        )
    )
    report.add(
        Row(
            target="P3",
            what=f"t(N={fmt_n(hi)}) absolute (median)",
            stalebuf=us(by.sample_ns[hi]),
            goal="<= 1 ms",
            verdict=report.check("P3", by.sample_ns[hi] <= 1e6),
        )
    )


async def _p3_p4(sizes: Sizes, report: Report) -> None:
    by = await _by_size(sizes)
    poll_ns: dict[int, float] = {}
    for n in sizes.p3_poll_sizes:
        status(f"P3 polling baseline, N={n}")
        poll_ns[n] = statistics.median(polling_resident_poll_ns(n, sizes.p3_poll_reps))
    _sample_rows(sizes, report, by, poll_ns)
    layout_p3, layout_p4 = await _layouts(sizes, report)
    _verdict_rows(sizes, report, by)
    report.rows.extend(layout_p3)
    report.scaling["P3 stalebuf sample(B=256)"] = sorted(by.sample_ns.items())
    report.scaling["P3 polling buffer, one poll"] = sorted(poll_ns.items())

    k = sizes.p4_k_at_n
    p4_eviction.evict_vs_n_rows(sizes, report, by.evict_ns, by.evict_ratio)
    p4_eviction.vs_k_rows(sizes.p4_fixed_n, by.vs_k, sizes, report)
    report.rows.extend(layout_p4)
    per_group = sorted((n, v / k) for n, v in by.evict_ns.items())
    report.scaling[f"P4 eviction of k={k}, per evicted group"] = per_group


def run(sizes: Sizes, report: Report) -> None:
    """Measure P3 and P4 (they share the resident sets) and add their rows to ``report``."""
    anyio.run(_p3_p4, sizes, report, backend="asyncio")
