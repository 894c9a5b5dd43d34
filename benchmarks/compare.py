"""Measure the performance targets P1-P7 side by side with their baselines, in one process.

Usage::

    python benchmarks/compare.py            # full run, about 1-2 minutes
    python benchmarks/compare.py --quick    # tiny sizes, a few seconds (CI smoke run)

Prints a markdown table of absolute figures, ratios to the baselines measured in the
same run, and PASS/FAIL per target, then writes ``benchmarks/scaling.png`` (how cost
grows with N) when matplotlib is installed. Baselines: a bare ``asyncio.Event`` (or
``trio.Event``) set->wake, an ``asyncio.Queue`` put+get, and :class:`PollingBuffer`, a
minimal verl-like polling buffer, at poll intervals of 0.05 s and 2 s. Wherever a ratio
is the target, the two sides are measured interleaved (ABAB...) so that load from other
processes hits both alike. ``--quick`` sizes are too small for the verdicts to mean
anything; it only proves every measurement runs. Exit status is 0 unless ``--strict`` is
given and a target failed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

from stalebuf import ReplayBuffer, SamplerConfig
from workloads import (
    BASE_STEP,
    BIG_THRESHOLD,
    GATE_STEP,
    PER_STEP,
    TRAJECTORIES_PER_GROUP,
    CountingBuffer,
    Gated,
    PollingBuffer,
    Resident,
    add_group_nowait,
    add_polling_group,
    gc_paused,
    percentile,
    pipeline_polling,
    pipeline_stalebuf,
    queue_pipeline,
)

HERE = Path(__file__).resolve().parent
P3_BATCH = 256


# -- sizes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does."""

    quick: bool
    p1_reps: dict[str, int]
    p1_batch: int
    p1_big_batch: int
    p1_big_reps: int
    p1_polls: tuple[tuple[float, int], ...]  # (interval, measured reps)
    p1_polls_computed: tuple[float, ...]  # intervals reported from theory only
    p2_groups: int
    p2_rounds: int
    p2_poll_intervals: tuple[float, ...]
    p3_sizes: tuple[int, ...]
    p3_reps: int
    p3_poll_sizes: tuple[int, ...]
    p3_poll_reps: int
    p3_layouts: tuple[tuple[int | None, tuple[int, ...]], ...]  # (groups per step, sizes)
    p3_layout_reps: int
    p4_fixed_n: int
    p4_ks: tuple[int, ...]
    p4_k_at_n: int
    p4_reps: int
    p5_sizes: tuple[int, ...]
    p5_reps: int
    p5_poll_sizes: tuple[int, ...]
    p6_calls: int
    p6_idle: float
    p7_groups: int
    p7_polling_groups: int

    def __post_init__(self) -> None:
        if self.p4_fixed_n not in self.p3_sizes:
            raise ValueError("p4_fixed_n must be one of p3_sizes (P4 reuses the P3 buffers)")


FULL = Sizes(
    quick=False,
    p1_reps={"asyncio": 2000, "trio": 1000, "uvloop": 1000},
    p1_batch=8,
    p1_big_batch=64,
    p1_big_reps=500,
    p1_polls=((0.05, 40), (2.0, 5)),
    p1_polls_computed=(),
    p2_groups=2048,
    p2_rounds=11,
    p2_poll_intervals=(0.05, 2.0),
    p3_sizes=(1_000, 10_000, 100_000, 1_000_000),
    p3_reps=101,
    p3_poll_sizes=(1_000, 10_000, 100_000),
    p3_poll_reps=5,
    p3_layouts=((None, (1_000, 100_000, 1_000_000)), (1, (1_000, 10_000, 100_000))),
    p3_layout_reps=21,
    p4_fixed_n=100_000,
    p4_ks=(10, 100, 1_000, 10_000),
    p4_k_at_n=1_000,
    p4_reps=7,
    p5_sizes=(1_000, 10_000, 100_000, 1_000_000),
    p5_reps=301,
    p5_poll_sizes=(1_000, 10_000, 100_000, 1_000_000),
    p6_calls=1_000,
    p6_idle=0.25,
    p7_groups=100_000,
    p7_polling_groups=20_000,
)

QUICK = Sizes(
    quick=True,
    p1_reps={"asyncio": 100, "trio": 50, "uvloop": 50},
    p1_batch=8,
    p1_big_batch=64,
    p1_big_reps=20,
    p1_polls=((0.02, 3),),
    p1_polls_computed=(0.05, 2.0),
    p2_groups=256,
    p2_rounds=2,
    p2_poll_intervals=(0.02,),
    p3_sizes=(500, 2_000),
    p3_reps=5,
    p3_poll_sizes=(500, 2_000),
    p3_poll_reps=2,
    p3_layouts=((None, (500, 2_000)), (1, (500, 2_000))),
    p3_layout_reps=3,
    p4_fixed_n=2_000,
    p4_ks=(10, 100),
    p4_k_at_n=50,
    p4_reps=2,
    p5_sizes=(500, 2_000),
    p5_reps=11,
    p5_poll_sizes=(500, 2_000),
    p6_calls=50,
    p6_idle=0.1,
    p7_groups=1_000,
    p7_polling_groups=1_000,
)


# -- report ------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the result table."""

    target: str
    what: str
    stalebuf: str
    baseline: str = ""
    ratio: str = ""
    goal: str = ""
    verdict: str = ""


@dataclass
class Report:
    """Rows plus the series the scaling plot is drawn from."""

    rows: list[Row] = field(default_factory=list)
    verdicts: dict[str, list[bool]] = field(default_factory=dict)
    scaling: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # ns vs N
    scaling_k: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # ns vs k

    def add(self, row: Row) -> None:
        self.rows.append(row)

    def check(self, target: str, ok: bool) -> str:
        self.verdicts.setdefault(target, []).append(ok)
        return "PASS" if ok else "**FAIL**"

    def markdown(self) -> str:
        head = "| target | measurement | stalebuf | baseline | ratio | goal | verdict |"
        lines = [head, "|---|---|---:|---:|---:|---|---|"]
        for r in self.rows:
            cells = (r.target, r.what, r.stalebuf, r.baseline, r.ratio, r.goal, r.verdict)
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def us(ns: float) -> str:
    """Format nanoseconds as microseconds."""
    if ns != ns:  # NaN
        return "n/a"
    value = ns / 1e3
    if value >= 100:
        return f"{value:,.0f} µs"
    if value >= 10:
        return f"{value:.1f} µs"
    return f"{value:.2f} µs"


def ms(ns: float) -> str:
    """Format nanoseconds as milliseconds."""
    return f"{ns / 1e6:,.2f} ms" if ns < 1e9 else f"{ns / 1e9:,.2f} s"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def fmt_n(n: int) -> str:
    exp = len(str(n)) - 1
    return f"1e{exp}" if n == 10**exp else f"{n:,}"


def status(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


# -- P1: wake-up latency -----------------------------------------------------------------


class _Shared:
    """State shared by the producer and the parked task of one latency run."""

    def __init__(self) -> None:
        self.t0 = 0
        self.parked = False  # the parked task is about to wait
        self.bare_parked = False  # the bare-event waiter is about to wait
        self.done = anyio.Event()


async def _settle(condition: Callable[[], bool]) -> None:
    """Yield until ``condition`` holds, then a couple of times more (the waiter is parked)."""
    while not condition():
        await anyio.lowlevel.checkpoint()
    for _ in range(2):
        await anyio.lowlevel.checkpoint()


async def p1_side_by_side(
    bare_event: Callable[[], Any], reps: int, batch_size: int, status_log_interval: float | None = 60.0
) -> tuple[list[int], list[int]]:
    """Interleave ``reps`` bare Event set->wake round trips with ``reps`` stalebuf wake-ups.

    stalebuf: the sampler is parked in ``sample(r, batch_size)`` with ``batch_size - 1``
    groups finished; t0 is taken just before the ``mark_finished_nowait`` that completes
    the batch, t1 right after ``sample`` returns. Bare: t0 just before ``event.set()``,
    t1 right after ``await event.wait()`` returns. Returns (stalebuf ns, bare ns).
    ``status_log_interval`` is passed to the buffer (60.0 is its default).
    """
    buf = ReplayBuffer(status_log_interval=status_log_interval)
    shared = _Shared()
    buf_lat: list[int] = []
    bare_lat: list[int] = []

    async def sampler() -> None:
        for r in range(reps):
            shared.parked = True
            await buf.sample(r, batch_size)
            buf_lat.append(time.perf_counter_ns() - shared.t0)
            shared.parked = False
            shared.done.set()

    async def bare_waiter(event: Any) -> None:
        shared.bare_parked = True
        await event.wait()
        bare_lat.append(time.perf_counter_ns() - shared.t0)
        shared.bare_parked = False
        shared.done.set()

    def sampler_parked() -> bool:
        return shared.parked and buf.stats().total.waiting_samplers == 1

    async with anyio.create_task_group() as tg:
        for r in range(reps):
            # bare Event
            event = bare_event()
            shared.done = anyio.Event()
            tg.start_soon(bare_waiter, event)
            await _settle(lambda: shared.bare_parked)
            shared.t0 = time.perf_counter_ns()
            event.set()
            await shared.done.wait()
            # stalebuf
            if r == 0:
                shared.done = anyio.Event()
                tg.start_soon(sampler)
            last = ""
            for i in range(batch_size):
                last = f"w{r}x{i}"
                add_group_nowait(buf, last, r, finish=i < batch_size - 1)
            await _settle(sampler_parked)
            shared.done = anyio.Event()
            shared.t0 = time.perf_counter_ns()
            buf.mark_finished_nowait(last)
            await shared.done.wait()
    return buf_lat, bare_lat


async def p1_polling(interval: float, reps: int, batch_size: int, seed: int = 1) -> list[int]:
    """Wake-up latency of :class:`PollingBuffer`: the last group finishes at a random phase
    of the trainer's poll loop; t1 is taken when its ``sample`` returns."""
    buf = PollingBuffer(interval)
    rng = random.Random(seed)
    shared = _Shared()
    lat: list[int] = []

    async def sampler() -> None:
        for r in range(reps):
            await buf.sample(r, batch_size)
            lat.append(time.perf_counter_ns() - shared.t0)
            shared.done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(sampler)
        for r in range(reps):
            last = ""
            for i in range(batch_size):
                last = f"w{r}x{i}"
                add_polling_group(buf, last, r, finish=i < batch_size - 1)
            await _settle(lambda: buf.sleeping == 1)
            await anyio.sleep(rng.uniform(0, interval))
            shared.done = anyio.Event()
            shared.t0 = time.perf_counter_ns()
            buf.mark_finished_nowait(last)
            await shared.done.wait()
    return lat


def run_p1(sizes: Sizes, report: Report) -> None:
    backends: list[tuple[str, str, dict[str, Any], Callable[[], Any], str]] = [
        ("asyncio", "asyncio", {}, asyncio.Event, "asyncio.Event"),
    ]
    try:
        import trio

        backends.append(("trio", "trio", {}, trio.Event, "trio.Event"))
    except ImportError:
        report.add(Row("P1", "wake-up latency on trio", "not installed"))
    try:
        import uvloop  # noqa: F401

        backends.append(("uvloop", "asyncio", {"use_uvloop": True}, asyncio.Event, "asyncio.Event"))
    except ImportError:
        report.add(Row("P1", "wake-up latency on uvloop", "not installed"))
    b = sizes.p1_batch
    asyncio_p50 = float("nan")
    for name, backend, options, bare, bare_name in backends:
        status(f"P1 wake-up latency on {name}")
        buf_lat, bare_lat = anyio.run(
            p1_side_by_side, bare, sizes.p1_reps[name], b, backend=backend, backend_options=options
        )
        p50, p99 = percentile(buf_lat, 0.5), percentile(buf_lat, 0.99)
        bp50, bp99 = percentile(bare_lat, 0.5), percentile(bare_lat, 0.99)
        n = len(buf_lat)
        if name == "asyncio":
            asyncio_p50 = p50
            verdict = report.check("P1", p50 <= 3 * bp50)
            goal = "p50 <= 3x bare"
        else:
            verdict, goal = "info", ""
        report.add(
            Row(
                "P1",
                f"{name}: batch-completing call -> sample() returns, p50 (B={b}, n={n})",
                us(p50),
                f"{us(bp50)} ({bare_name})",
                ratio(p50, bp50),
                goal,
                verdict,
            )
        )
        report.add(Row("P1", f"{name}: same, p99", us(p99), us(bp99), ratio(p99, bp99), "", "info"))
    status("P1 wake-up latency on asyncio, status_log_interval=None")
    buf_lat, bare_lat = anyio.run(
        p1_side_by_side, asyncio.Event, sizes.p1_big_reps, b, None, backend="asyncio"
    )
    report.add(
        Row(
            "P1",
            f"asyncio: same with status_log_interval=None (no status timer), p50 / p99 (n={len(buf_lat)})",
            f"{us(percentile(buf_lat, 0.5))} / {us(percentile(buf_lat, 0.99))}",
            f"{us(percentile(bare_lat, 0.5))} / {us(percentile(bare_lat, 0.99))}",
            ratio(percentile(buf_lat, 0.5), percentile(bare_lat, 0.5)),
            "",
            "info",
        )
    )
    status(f"P1 wake-up latency on asyncio, B={sizes.p1_big_batch}")
    buf_lat, bare_lat = anyio.run(
        p1_side_by_side, asyncio.Event, sizes.p1_big_reps, sizes.p1_big_batch, backend="asyncio"
    )
    report.add(
        Row(
            "P1",
            f"asyncio: same with B={sizes.p1_big_batch}, p50 / p99 (n={len(buf_lat)})",
            f"{us(percentile(buf_lat, 0.5))} / {us(percentile(buf_lat, 0.99))}",
            f"{us(percentile(bare_lat, 0.5))} / {us(percentile(bare_lat, 0.99))}",
            ratio(percentile(buf_lat, 0.5), percentile(bare_lat, 0.5)),
            "",
            "info",
        )
    )
    for interval, reps in sizes.p1_polls:
        status(f"P1 polling baseline, {interval} s poll, {reps} reps")
        lat = anyio.run(p1_polling, interval, reps, b, backend="asyncio")
        report.add(
            Row(
                "P1",
                f"polling buffer, {interval:g} s poll: p50 / max "
                f"(measured, n={reps}; ratio: polling / stalebuf)",
                us(asyncio_p50),
                f"{ms(percentile(lat, 0.5))} / {ms(max(lat))}",
                ratio(percentile(lat, 0.5), asyncio_p50),
                "",
                "info",
            )
        )
    for interval in sizes.p1_polls_computed:
        report.add(
            Row(
                "P1",
                f"polling buffer, {interval:g} s poll: expected p50 = interval / 2 (computed, not run; "
                "ratio: polling / stalebuf)",
                us(asyncio_p50),
                ms(interval / 2 * 1e9),
                ratio(interval / 2 * 1e9, asyncio_p50),
                "",
                "info",
            )
        )


# -- P2: producer path -------------------------------------------------------------------


def p2_call_costs(groups: int) -> dict[str, float]:
    """ns per call of each *_nowait producer call over ``groups`` fresh groups, no event loop."""
    buf = ReplayBuffer()
    uids = [f"c{i}" for i in range(groups)]
    t0 = time.perf_counter_ns()
    for uid in uids:
        buf.add_prompt_nowait(uid, global_steps=0)
    t1 = time.perf_counter_ns()
    for uid in uids:
        buf.mark_running_nowait(uid)
    t2 = time.perf_counter_ns()
    put = buf.put_nowait
    for uid in uids:
        for session in range(TRAJECTORIES_PER_GROUP):
            put(uid, None, session_id=session)
    t3 = time.perf_counter_ns()
    for uid in uids:
        buf.mark_finished_nowait(uid)
    t4 = time.perf_counter_ns()
    return {
        "add_prompt": (t1 - t0) / groups,
        "mark_running": (t2 - t1) / groups,
        "put": (t3 - t2) / (groups * TRAJECTORIES_PER_GROUP),
        "mark_finished": (t4 - t3) / groups,
    }


async def p2_async_lifecycle(groups: int) -> int:
    """The awaited producer calls of ``groups`` groups, one task, no trainer, no yields."""
    buf = ReplayBuffer()
    uids = [f"a{i}" for i in range(groups)]
    start = time.perf_counter_ns()
    for uid in uids:
        await buf.add_prompt(uid, global_steps=0)
        await buf.mark_running(uid)
        for session in range(TRAJECTORIES_PER_GROUP):
            await buf.put(uid, None, session_id=session)
        await buf.mark_finished(uid)
    return time.perf_counter_ns() - start


async def p2_side_by_side(groups: int, rounds: int) -> dict[str, list[float]]:
    """Alternate the stalebuf pipeline, the asyncio.Queue pipelines and the breakdown parts,
    ``rounds`` times; return ns per trajectory (per item, per call) of each."""
    items = groups * TRAJECTORIES_PER_GROUP
    out: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        out.setdefault(name, []).append(value)

    for _ in range(rounds):
        add("queue_raw", await queue_pipeline(items, yield_every=0) / items)
        add("stalebuf", await pipeline_stalebuf(groups) / items)
        add("queue_matched", await queue_pipeline(items, yield_every=TRAJECTORIES_PER_GROUP) / items)
        add("stalebuf_64", await pipeline_stalebuf(groups, yield_every=64) / items)
        add("stalebuf_put_group", await pipeline_stalebuf(groups, put_group=True) / items)
        add("awaited_group", await p2_async_lifecycle(groups) / groups)
        for name, value in p2_call_costs(groups).items():
            add(name, value)
    return out


def run_p2(sizes: Sizes, report: Report) -> None:
    status("P2 producer path vs asyncio.Queue")
    groups = sizes.p2_groups
    items = groups * TRAJECTORIES_PER_GROUP
    runs = anyio.run(p2_side_by_side, groups, sizes.p2_rounds, backend="asyncio")
    per = {name: statistics.median(values) for name, values in runs.items()}
    what = (
        f"per trajectory: add_prompt + mark_running + 8 x put + mark_finished (awaited), 4 producers "
        f"yielding after each group, trainer sample(B=64) concurrently ({groups} groups, median of "
        f"{sizes.p2_rounds}, interleaved)"
    )
    report.add(
        Row(
            "P2",
            what,
            us(per["stalebuf"]),
            f"{us(per['queue_raw'])} (Queue put+get)",
            ratio(per["stalebuf"], per["queue_raw"]),
            "<= 3x",
            report.check("P2", per["stalebuf"] <= 3 * per["queue_raw"]),
        )
    )
    report.add(
        Row(
            "P2",
            "same vs Queue put+get with the same scheduling (producers yield every 8 puts)",
            us(per["stalebuf"]),
            us(per["queue_matched"]),
            ratio(per["stalebuf"], per["queue_matched"]),
            "",
            "info",
        )
    )
    report.add(
        Row(
            "P2",
            "same, but producers yield only every 64 groups (minimal scheduling)",
            us(per["stalebuf_64"]),
            us(per["queue_raw"]),
            ratio(per["stalebuf_64"], per["queue_raw"]),
            "",
            "info",
        )
    )
    report.add(
        Row(
            "P2",
            "same pipeline, each group uploaded with one put_group call instead of 11 calls",
            us(per["stalebuf_put_group"]),
            us(per["queue_raw"]),
            ratio(per["stalebuf_put_group"], per["queue_raw"]),
            "",
            "info",
        )
    )
    report.add(
        Row(
            "P2",
            "throughput",
            f"{1e9 / per['stalebuf']:,.0f} traj/s",
            f"{1e9 / per['queue_raw']:,.0f} items/s",
            "",
            "",
            "info",
        )
    )
    # The breakdown uses the best round of each part: fixed work, so the least disturbed.
    calls = {name: min(values) for name, values in runs.items()}
    nowait_group = (
        calls["add_prompt"]
        + calls["mark_running"]
        + TRAJECTORIES_PER_GROUP * calls["put"]
        + calls["mark_finished"]
    )
    awaited_group = calls["awaited_group"]
    pipeline_group = calls["stalebuf"] * TRAJECTORIES_PER_GROUP
    report.add(
        Row(
            "P2",
            "breakdown per group of 8 (best round of each part): the *_nowait calls (add_prompt + "
            "mark_running + 8 x put + mark_finished); + awaiting the async twins; + loop yields, "
            "trainer and wake-ups",
            f"{us(calls['add_prompt'])} + {us(calls['mark_running'])} + 8 x {us(calls['put'])} + "
            f"{us(calls['mark_finished'])} = {us(nowait_group)}; "
            f"+ {us(awaited_group - nowait_group)}; + {us(pipeline_group - awaited_group)}",
            f"{us(calls['queue_raw'] * TRAJECTORIES_PER_GROUP)} (8 Queue put+get)",
            "",
            "",
            "info",
        )
    )
    for interval in sizes.p2_poll_intervals:
        status(f"P2 polling baseline, {interval} s poll")
        elapsed = anyio.run(pipeline_polling, groups, interval, backend="asyncio")
        report.add(
            Row(
                "P2",
                f"same pipeline on the polling buffer, {interval:g} s poll (end to end, 1 run; "
                "ratio: polling / stalebuf)",
                us(per["stalebuf"]),
                f"{us(elapsed / items)} ({items * 1e9 / elapsed:,.0f} traj/s)",
                ratio(elapsed / items, per["stalebuf"]),
                "",
                "info",
            )
        )


# -- P3 / P4: resident groups ------------------------------------------------------------


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


async def p3_p4_layouts(sizes: Sizes, report: Report) -> tuple[list[Row], list[Row]]:
    """P3 and P4 on stress layouts: every resident group in a single dispatch step, and one
    group per dispatch step (1 trajectory per group, to keep the builds short: neither
    ``sample`` nor eviction looks at trajectories). Returns (P3 rows, P4 rows)."""
    p3_rows: list[Row] = []
    p4_rows: list[Row] = []
    k = sizes.p4_k_at_n
    for per_step, layout_sizes in sizes.p3_layouts:
        if per_step is None:
            layout = "all groups in one dispatch step"
        else:
            layout = "one group per dispatch step" if per_step == 1 else f"{per_step} groups per step"
        ref_n, *others = layout_sizes
        status(f"P3 stress layout: {layout}, N={ref_n}")
        ref = Resident(ref_n, per_step=per_step, trajectories=1)
        for n in others:
            status(f"P3 stress layout: {layout}, N={n}")
            res = Resident(n, per_step=per_step, trajectories=1)
            mine: list[int] = []
            theirs: list[int] = []
            for _ in range(sizes.p3_layout_reps):
                theirs.append(await timed_sample(ref))
                mine.append(await timed_sample(res))
            t_n, t_ref = statistics.median(mine), statistics.median(theirs)
            series = report.scaling.setdefault(f"P3 sample(B=256), stress layout: {layout}", [])
            if not series:
                series.append((ref_n, t_ref))
            series.append((n, t_n))
            last = n == others[-1]
            p3_rows.append(
                Row(
                    "P3",
                    f"stress layout, {layout}: sample(B=256), N={fmt_n(n)} vs N={fmt_n(ref_n)} "
                    f"(median of {sizes.p3_layout_reps}, interleaved)",
                    us(t_n),
                    f"{us(t_ref)} (N={fmt_n(ref_n)})",
                    f"{t_n / t_ref:.2f}x",
                    "<= 3" if last else "",
                    report.check("P3 (stress layouts)", t_n <= 3 * t_ref) if last else "",
                )
            )
            if per_step == 1:
                status(f"P4 stress layout: {k} stale groups at {k} distinct steps, N={n}")
                mine, theirs = [], []
                for _ in range(max(3, sizes.p4_reps // 2)):
                    theirs.append(await timed_eviction(ref, k, distinct_steps=True))
                    mine.append(await timed_eviction(res, k, distinct_steps=True))
                t_n, t_ref = statistics.median(mine), statistics.median(theirs)
                p4_rows.append(
                    Row(
                        "P4",
                        f"stress layout, {layout}: evicting k={k} stale groups dispatched at {k} "
                        f"distinct steps, N={fmt_n(n)} vs N={fmt_n(ref_n)}",
                        ms(t_n),
                        f"{ms(t_ref)} (N={fmt_n(ref_n)})",
                        f"{t_n / t_ref:.2f}x",
                        "<= 3" if last else "",
                        report.check("P4 (stress layouts)", t_n <= 3 * t_ref) if last else "",
                    )
                )
            res.close()
        ref.close()
    return p3_rows, p4_rows


async def p3_p4(sizes: Sizes, report: Report) -> None:
    ref_n = sizes.p3_sizes[0]
    status(f"P3 building the reference buffer, N={ref_n}")
    ref = Resident(ref_n)
    sample_ns: dict[int, float] = {}
    sample_ratio: dict[int, float] = {}
    evict_ratio: dict[int, float] = {}
    evict_ns: dict[int, float] = {}
    k = sizes.p4_k_at_n
    vs_k: dict[int, float] = {}
    for n in sizes.p3_sizes:
        status(f"P3 building N={n} resident groups x {TRAJECTORIES_PER_GROUP} trajectories")
        res = ref if n == ref_n else Resident(n)
        mine: list[int] = []
        theirs: list[int] = []
        for _ in range(sizes.p3_reps):  # interleaved with the reference buffer
            theirs.append(await timed_sample(ref))
            mine.append(await timed_sample(res))
        sample_ns[n] = statistics.median(mine)
        sample_ratio[n] = 1.0 if res is ref else sample_ns[n] / statistics.median(theirs)
        status(f"P4 evicting k={k} stale groups at N={n}")
        mine, theirs = [], []
        for _ in range(sizes.p4_reps):
            theirs.append(await timed_eviction(ref, k))
            mine.append(await timed_eviction(res, k))
        evict_ns[n] = statistics.median(mine)
        evict_ratio[n] = 1.0 if res is ref else evict_ns[n] / statistics.median(theirs)
        if n == sizes.p4_fixed_n:
            vs_k = await p4_vs_k(res, sizes)
        if res is not ref:
            res.close()
    ref.close()

    poll_ns: dict[int, float] = {}
    for n in sizes.p3_poll_sizes:
        status(f"P3 polling baseline, N={n}")
        poll_ns[n] = statistics.median(polling_resident_poll_ns(n, sizes.p3_poll_reps))

    for n in sizes.p3_sizes:
        base = poll_ns.get(n)
        report.add(
            Row(
                "P3",
                f"sample(B=256), N={fmt_n(n)} resident groups (median of {sizes.p3_reps}; "
                f"x N={fmt_n(ref_n)} interleaved)",
                us(sample_ns[n]),
                "not run" if base is None else f"{us(base)} (one poll)",
                f"{sample_ratio[n]:.2f}x vs N={fmt_n(ref_n)}",
                "",
                "",
            )
        )
    layout_p3, layout_p4 = await p3_p4_layouts(sizes, report)
    hi = sizes.p3_sizes[-1]
    report.add(
        Row(
            "P3",
            f"t(N={fmt_n(hi)}) / t(N={fmt_n(ref_n)})",
            f"{sample_ratio[hi]:.2f}x",
            "",
            "",
            "<= 3",
            report.check("P3", sample_ratio[hi] <= 3),
        )
    )
    report.add(
        Row(
            "P3",
            f"t(N={fmt_n(hi)}) absolute (median)",
            us(sample_ns[hi]),
            "",
            "",
            "<= 1 ms",
            report.check("P3", sample_ns[hi] <= 1e6),
        )
    )
    report.rows.extend(layout_p3)
    report.scaling["P3 stalebuf sample(B=256)"] = sorted(sample_ns.items())
    report.scaling["P3 polling buffer, one poll"] = sorted(poll_ns.items())

    for n in sizes.p3_sizes:
        report.add(
            Row(
                "P4",
                f"sample evicting k={k} stale groups, N={fmt_n(n)} (median of {sizes.p4_reps})",
                f"{ms(evict_ns[n])} ({us(evict_ns[n] / k)}/group)",
                "",
                f"{evict_ratio[n]:.2f}x vs N={fmt_n(ref_n)}",
                "",
                "",
            )
        )
    report.add(
        Row(
            "P4",
            f"eviction of k={k}: cost at N={fmt_n(hi)} / cost at N={fmt_n(ref_n)}",
            f"{evict_ratio[hi]:.2f}x",
            "a scan: ~N ratio",
            "",
            "<= 3 (log factors)",
            report.check("P4", evict_ratio[hi] <= 3),
        )
    )
    report_p4_vs_k(sizes.p4_fixed_n, vs_k, sizes, report)
    report.rows.extend(layout_p4)
    per_group = sorted((n, v / k) for n, v in evict_ns.items())
    report.scaling[f"P4 eviction of k={k}, per evicted group"] = per_group


async def p4_vs_k(res: Resident, sizes: Sizes) -> dict[int, float]:
    """Median cost of one sample that evicts k stale groups, for each k, at fixed N."""
    totals: dict[int, float] = {}
    for k in (0, *sizes.p4_ks):
        status(f"P4 evicting k={k} at N={res.n}")
        totals[k] = statistics.median([await timed_eviction(res, k) for _ in range(sizes.p4_reps)])
    return totals


def report_p4_vs_k(n: int, totals: dict[int, float], sizes: Sizes, report: Report) -> None:
    base = totals[0]
    marginal = {k: (total - base) / k for k, total in totals.items() if k}
    report.add(Row("P4", f"sample(B=1) evicting nothing, N={fmt_n(n)} (median of {sizes.p4_reps})", us(base)))
    for k, per_group in marginal.items():
        report.add(
            Row(
                "P4",
                f"sample(B=1) evicting k={k:,} stale groups, N={fmt_n(n)} (median of {sizes.p4_reps}); "
                "per group: (t(k) - t(0)) / k",
                f"{ms(totals[k])} ({us(per_group)}/group)",
            )
        )
    k_hi = max(marginal)
    k_lo = min((k for k in marginal if 100 <= k < k_hi), default=min(marginal))
    growth = marginal[k_hi] / marginal[k_lo]
    report.add(
        Row(
            "P4",
            f"per-group eviction cost: k={k_hi:,} / k={k_lo:,}",
            f"{growth:.2f}x",
            "",
            "",
            "<= 3 (O(k))",
            report.check("P4", growth <= 3),
        )
    )
    report.scaling_k[f"P4 eviction, per evicted group (N={fmt_n(n)})"] = sorted(marginal.items())


# -- P5: the wait gate -------------------------------------------------------------------


async def timed_gate(gated: Gated) -> int:
    """Time one ``sample(timeout=0)`` that the wait gate blocks (it raises TimeoutError)."""
    start = time.perf_counter_ns()
    try:
        await gated.buf.sample(gated.global_steps, gated.batch_size, timeout=0)
    except TimeoutError:
        return time.perf_counter_ns() - start
    raise AssertionError("the gate did not block")


def polling_gate_poll_ns(n: int, batch: int, reps: int) -> list[int]:
    """Time one ``PollingBuffer.poll`` blocked by the wait gate with ``n`` in-flight groups."""
    buf = PollingBuffer(2.0, strategy="wait")
    with gc_paused():
        buf.add_prompt_nowait("blocker", global_steps=0)
        for i in range(n - 1):
            buf.add_prompt_nowait(f"f{i}", global_steps=GATE_STEP + i // PER_STEP)
        for i in range(batch):
            add_polling_group(buf, f"r{i}", GATE_STEP)
    out = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        if buf.poll(GATE_STEP, batch) is not None:
            raise AssertionError("the gate did not block")
        out.append(time.perf_counter_ns() - start)
    del buf
    gc.unfreeze()
    gc.collect()
    return out


async def p5(sizes: Sizes, report: Report) -> None:
    batch = 64
    ref_n = sizes.p5_sizes[0]
    ref = Gated(ref_n, batch)
    eval_ns: dict[int, float] = {}
    eval_ratio: dict[int, float] = {}
    for n in sizes.p5_sizes:
        status(f"P5 wait gate with N={n} in-flight groups")
        gated = ref if n == ref_n else Gated(n, batch)
        mine: list[int] = []
        theirs: list[int] = []
        for _ in range(sizes.p5_reps):
            theirs.append(await timed_gate(ref))
            mine.append(await timed_gate(gated))
        eval_ns[n] = statistics.median(mine)
        eval_ratio[n] = 1.0 if gated is ref else eval_ns[n] / statistics.median(theirs)
        if gated is not ref:
            gated.close()
    ref.close()
    poll_ns: dict[int, float] = {}
    for n in sizes.p5_poll_sizes:
        status(f"P5 polling baseline, N={n} in-flight groups")
        poll_ns[n] = statistics.median(polling_gate_poll_ns(n, batch, 3))
    for n in sizes.p5_sizes:
        base = poll_ns.get(n)
        report.add(
            Row(
                "P5",
                f"sample(timeout=0) blocked by the wait gate, N={fmt_n(n)} in-flight groups "
                f"(median of {sizes.p5_reps})",
                us(eval_ns[n]),
                "not run" if base is None else f"{us(base)} (one poll)",
                f"{eval_ratio[n]:.2f}x vs N={fmt_n(ref_n)}",
                "",
                "",
            )
        )
    hi = sizes.p5_sizes[-1]
    report.add(
        Row(
            "P5",
            f"blocked evaluation: t(N={fmt_n(hi)}) / t(N={fmt_n(ref_n)})",
            f"{eval_ratio[hi]:.2f}x",
            "" if hi not in poll_ns else f"{poll_ns[hi] / poll_ns[ref_n]:.0f}x",
            "",
            "<= 3 (O(1) or O(log N))",
            report.check("P5", eval_ratio[hi] <= 3),
        )
    )
    report.scaling["P5 stalebuf blocked evaluation"] = sorted(eval_ns.items())
    report.scaling["P5 polling buffer, one blocked poll"] = sorted(poll_ns.items())


# -- P6: idle cost -----------------------------------------------------------------------


P6_STEP = 100


@dataclass
class Scenario:
    """A parked ``sample`` plus producer calls that cannot change its outcome."""

    name: str
    buf: CountingBuffer
    batch_size: int
    irrelevant: Callable[[CountingBuffer, int], object] | None  # call i of N; None: stay silent
    last: str  # the group whose mark_finished lets the sample return


def _add_prompt(buf: CountingBuffer, i: int) -> None:
    buf.add_prompt_nowait(f"new{i}", global_steps=P6_STEP)


def _mark_running(buf: CountingBuffer, i: int) -> None:
    buf.mark_running_nowait(f"pend{i}")


def _put(buf: CountingBuffer, i: int) -> None:
    buf.put_nowait(f"run{i % 8}", None, session_id=i // 8)


def _mark_finished(buf: CountingBuffer, i: int) -> None:
    buf.mark_finished_nowait(f"more{i}")


def _mark_failed(buf: CountingBuffer, i: int) -> None:
    buf.mark_failed_nowait(f"more{i}")


def p6_scenarios(calls: int) -> list[Scenario]:
    """Each scenario: a sample of ``calls + 16`` groups parks one group short (or behind the
    wait gate); ``calls`` producer calls follow that cannot let it return."""
    batch = calls + 16

    def drop_buffer(ready: int) -> CountingBuffer:
        buf = CountingBuffer(SamplerConfig())  # drop, failure_strategy="sample"
        for i in range(ready):
            add_group_nowait(buf, f"ready{i}", P6_STEP)
        add_group_nowait(buf, "last", P6_STEP, finish=False)
        return buf

    out = [
        Scenario("producers silent", drop_buffer(batch - 1), batch, None, "last"),
        Scenario(f"{calls} x add_prompt", drop_buffer(batch - 1), batch, _add_prompt, "last"),
    ]
    buf = drop_buffer(batch - 1)
    for i in range(calls):
        buf.add_prompt_nowait(f"pend{i}", global_steps=P6_STEP)
    out.append(Scenario(f"{calls} x mark_running", buf, batch, _mark_running, "last"))
    buf = drop_buffer(batch - 1)
    for j in range(8):
        add_group_nowait(buf, f"run{j}", P6_STEP, trajectories=0, finish=False)
    out.append(Scenario(f"{calls} x put into a running group", buf, batch, _put, "last"))
    for verb, call in (("mark_finished", _mark_finished), ("mark_failed", _mark_failed)):
        buf = drop_buffer(batch - 1 - calls)
        for i in range(calls):
            add_group_nowait(buf, f"more{i}", P6_STEP, finish=False)
        out.append(Scenario(f"{calls} x {verb} that leaves the batch short", buf, batch, call, "last"))
    buf = CountingBuffer(SamplerConfig(max_off_policy_strategy="wait", max_off_policy_threshold=8))
    add_group_nowait(buf, "blocker", 0, finish=False)
    for i in range(batch):
        add_group_nowait(buf, f"ready{i}", P6_STEP)
    for i in range(calls):
        add_group_nowait(buf, f"more{i}", P6_STEP, finish=False)
    out.append(
        Scenario(
            f"wait strategy: {calls} x mark_finished while the gate is closed",
            buf,
            batch,
            _mark_finished,
            "blocker",
        )
    )
    return out


async def p6_count(scenario: Scenario, calls: int, idle: float) -> tuple[int, int]:
    """Return (evaluations during the irrelevant calls, evaluations after the completing call)."""
    buf = scenario.buf
    returned = anyio.Event()
    counts: list[int] = []

    async def sampler() -> None:
        await buf.sample(P6_STEP, scenario.batch_size)
        returned.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(sampler)
        await _settle(lambda: buf.stats().total.waiting_samplers == 1)
        start = buf.evaluations
        if scenario.irrelevant is None:
            await anyio.sleep(idle)
        else:
            for i in range(calls):
                scenario.irrelevant(buf, i)
                await anyio.lowlevel.checkpoint()
        counts.append(buf.evaluations - start)
        start = buf.evaluations
        buf.mark_finished_nowait(scenario.last)
        with anyio.fail_after(10):
            await returned.wait()
        counts.append(buf.evaluations - start)
    return counts[0], counts[1]


async def p6_polling_idle(groups: int, interval: float, idle: float) -> int:
    """Full re-reads the polling buffer does while its producers are silent for ``idle`` s."""
    buf = PollingBuffer(interval)
    for i in range(groups):
        add_polling_group(buf, f"g{i}", 0, finish=False)
    async with anyio.create_task_group() as tg:
        tg.start_soon(buf.sample, 0, groups + 1)
        await _settle(lambda: buf.sleeping == 1)
        start = buf.polls
        await anyio.sleep(idle)
        polls = buf.polls - start
        tg.cancel_scope.cancel()
    return polls


def run_p6(sizes: Sizes, report: Report) -> None:
    status("P6 idle cost")
    calls, idle = sizes.p6_calls, sizes.p6_idle
    for scenario in p6_scenarios(calls):
        during, after = anyio.run(p6_count, scenario, calls, idle, backend="asyncio")
        baseline = ""
        if scenario.irrelevant is None:
            polls = anyio.run(p6_polling_idle, 1000, 0.05, idle, backend="asyncio")
            baseline = f"{polls} polls (0.05 s), each a scan of all groups"
        what = f"evaluations of a parked sample during: {scenario.name}"
        if scenario.irrelevant is None:
            what += f" for {idle:g} s"
        report.add(
            Row(
                "P6",
                what,
                f"{during} (then {after} on the completing call)",
                baseline,
                "",
                "0 (and 1)",
                report.check("P6", during == 0 and after == 1),
            )
        )


# -- P7: memory --------------------------------------------------------------------------


def traced_states(build: Callable[[], Any], finish: Callable[[Any], object]) -> tuple[int, int]:
    """Bytes that ``build()`` leaves allocated, and the same after ``finish(built)``
    (tracemalloc; objects created before the call are not counted)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        built = build()
        gc.collect()
        in_flight = tracemalloc.get_traced_memory()[0] - before
        finish(built)
        gc.collect()
        terminal = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del built
    gc.collect()
    return in_flight, terminal


def run_p7(sizes: Sizes, report: Report) -> None:
    n, pn = sizes.p7_groups, sizes.p7_polling_groups
    # The caller's own objects (uids, step numbers) are created before tracing starts.
    uids = [f"m{i}" for i in range(n)]
    steps = [i // PER_STEP for i in range(n)]

    def stalebuf_build(trajectories: int) -> Callable[[], Any]:
        def build() -> ReplayBuffer:
            buf = ReplayBuffer()
            for uid, step in zip(uids, steps, strict=True):
                add_group_nowait(buf, uid, step, trajectories=trajectories, finish=False)
            return buf

        return build

    def polling_build(trajectories: int) -> Callable[[], Any]:
        def build() -> PollingBuffer:
            buf = PollingBuffer(2.0)
            for uid, step in zip(uids[:pn], steps[:pn], strict=True):
                add_polling_group(buf, uid, step, trajectories=trajectories, finish=False)
            return buf

        return build

    def finish_all(buf: Any) -> None:
        for uid in uids[: len(buf.meta) if isinstance(buf, PollingBuffer) else n]:
            buf.mark_finished_nowait(uid)

    # Per group: groups without trajectories; per trajectory: the extra bytes of 8 puts.
    mine: dict[int, tuple[int, int]] = {}
    theirs: dict[int, tuple[int, int]] = {}
    for t in (0, TRAJECTORIES_PER_GROUP):
        status(f"P7 memory, {n} groups x {t} trajectories")
        mine[t] = traced_states(stalebuf_build(t), finish_all)
        theirs[t] = traced_states(polling_build(t), finish_all)

    def split(mem: dict[int, tuple[int, int]], state: int, groups: int) -> tuple[float, float]:
        per_group = mem[0][state] / groups
        per_traj = (mem[TRAJECTORIES_PER_GROUP][state] - mem[0][state]) / (groups * TRAJECTORIES_PER_GROUP)
        return per_traj, per_group

    for label, state in (("resident terminal (FINISHED)", 1), ("in-flight (RUNNING)", 0)):
        traj, group = split(mine, state, n)
        ptraj, pgroup = split(theirs, state, pn)
        report.add(
            Row(
                "P7",
                f"{label}: bytes per trajectory ({fmt_n(n)} groups x 8, payload None)",
                f"{traj:.0f} B",
                f"{ptraj:.0f} B (polling, {fmt_n(pn)} groups)",
                ratio(traj, ptraj),
                "<= 200 B",
                report.check("P7", traj <= 200),
            )
        )
        report.add(
            Row(
                "P7",
                f"{label}: bytes per group (uids not counted)",
                f"{group:.0f} B",
                f"{pgroup:.0f} B (polling, {fmt_n(pn)} groups)",
                ratio(group, pgroup),
                "<= 500 B",
                report.check("P7", group <= 500),
            )
        )


# -- the run -----------------------------------------------------------------------------


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info(argv: Sequence[str]) -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(HERE), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=False,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    versions = ", ".join(
        f"{name} {_version(name)}" for name in ("stalebuf", "anyio", "trio", "uvloop", "numpy", "attrs")
    )
    return [
        f"- command: `python benchmarks/compare.py{' ' if argv else ''}{' '.join(argv)}`",
        f"- machine: {os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}",
        f"- Python: {platform.python_implementation()} {platform.python_version()}",
        f"- versions: {versions}",
        f"- commit: {commit or 'unknown'}",
    ]


def plot(report: Report, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written"
    fig, (by_n, by_k) = plt.subplots(1, 2, figsize=(10, 5.6), gridspec_kw={"width_ratios": [3, 2]})
    for ax, series in ((by_n, report.scaling), (by_k, report.scaling_k)):
        for label, points in series.items():
            if points:
                xs, ys = zip(*points, strict=True)
                style = "--" if "polling" in label else (":" if "stress" in label else "-")
                ax.plot(xs, [y / 1e3 for y in ys], style, marker="o", label=label)
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.16), frameon=False)
    by_n.set_yscale("log")
    by_k.set_ylim(bottom=0)
    by_n.set_xlabel("N: resident groups (P3, P4), in-flight groups (P5)")
    by_n.set_ylabel("µs per call (P4: per evicted group)")
    by_n.set_title("cost vs N (dashed: polling baseline; dotted: stress layouts)", fontsize=10)
    by_k.set_xlabel("k: stale groups evicted by one sample")
    by_k.set_ylabel("µs per evicted group")
    by_k.set_title("eviction cost per group vs k", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return f"plot written to {path}"


TARGETS: dict[str, Callable[[Sizes, Report], None]] = {
    "P1": run_p1,
    "P2": run_p2,
    "P3": lambda sizes, report: anyio.run(p3_p4, sizes, report, backend="asyncio"),
    "P5": lambda sizes, report: anyio.run(p5, sizes, report, backend="asyncio"),
    "P6": run_p6,
    "P7": run_p7,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds (smoke run)")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated targets to run, e.g. P1,P3 (P3 includes P4); default: all",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="where to write the scaling plot (default: benchmarks/scaling.png on a full run, "
        "none with --quick)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 if a target fails")
    args = parser.parse_args(argv)
    shown_argv = list(sys.argv[1:] if argv is None else argv)
    sizes = QUICK if args.quick else FULL
    wanted = {t.strip().upper() for t in args.only.split(",") if t.strip()}
    if "P4" in wanted:
        wanted.add("P3")
    unknown = wanted - set(TARGETS) - {"P4"}
    if unknown:
        parser.error(f"unknown targets: {', '.join(sorted(unknown))}")

    info = machine_info(shown_argv)  # before the run: the commit the measured code came from
    report = Report()
    load_before = os.getloadavg()
    started = time.perf_counter()
    for name, run in TARGETS.items():
        if not wanted or name in wanted:
            section = time.perf_counter()
            run(sizes, report)
            status(f"{name}{' and P4' if name == 'P3' else ''} took {time.perf_counter() - section:.1f} s")
    wall = time.perf_counter() - started
    load_after = os.getloadavg()

    print(
        f"## stalebuf performance{' (--quick: tiny sizes, verdicts not meaningful)' if sizes.quick else ''}"
    )
    print()
    for line in info:
        print(line)
    print(
        f"- wall time {wall:.1f} s; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
        "(other jobs share the cores: compare the ratios, which are measured interleaved)"
    )
    print()
    print(report.markdown())
    print()
    summary = []
    for target, results in sorted(report.verdicts.items()):
        summary.append(f"{target} {'PASS' if all(results) else 'FAIL'}")
    print("Summary: " + ", ".join(summary))
    plot_path = args.plot if args.plot is not None else (None if sizes.quick else HERE / "scaling.png")
    if plot_path is not None and not args.no_plot and (report.scaling or report.scaling_k):
        print()
        print(plot(report, plot_path))
    failed = any(not all(results) for results in report.verdicts.values())
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
