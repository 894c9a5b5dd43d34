"""P2, the producer path: four producers run the eleven awaited calls per group of 8 while a
trainer samples B=64, alternated round by round with an ``asyncio.Queue`` put+get of as
many items; plus variants (matched scheduling, fewer yields, ``put_group``), the cost of
admission control per group (``put_group`` with and without it), a per-group breakdown
measured in the same rounds, and the polling baseline end to end.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import anyio

from report import Report, Row, ratio, status, us
from sizes import Sizes
from stalebuf import BatchNotReadyError, ReplayBuffer, SamplerConfig
from workloads import (
    BIG_THRESHOLD,
    TRAJECTORIES_PER_GROUP,
    pipeline_polling,
    pipeline_stalebuf,
    queue_pipeline,
)

__all__ = [
    "admission_configs",
    "p2_async_lifecycle",
    "p2_call_costs",
    "p2_side_by_side",
    "put_group_cost",
    "run",
]

#: Admission control's per-step bound in the admission rows: the pipeline's groups per step,
#: so that no producer ever waits (what is measured is the bookkeeping, not waiting).
ADMISSION_BATCH = 64
#: put_group_nowait timings per configuration and round.
ADMISSION_REPEATS = 6


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


def admission_configs() -> tuple[SamplerConfig, SamplerConfig] | None:
    """(admission control on, off), otherwise alike; None for a stalebuf without admission."""
    try:
        on = SamplerConfig(max_off_policy_threshold=BIG_THRESHOLD, admission_batch_size=ADMISSION_BATCH)
    except TypeError:  # the benchmarks also run against older versions, for before/after tables
        return None
    return on, SamplerConfig(max_off_policy_threshold=BIG_THRESHOLD)


def put_group_cost(groups: int, config: SamplerConfig) -> float:
    """ns per ``put_group_nowait`` of a new finished group of 8, ``groups`` of them,
    ``ADMISSION_BATCH`` per dispatch step, on a fresh buffer; no event loop.

    The cyclic GC is paused while timing: it costs both configurations alike (admission
    control adds no GC-tracked object) but its collections land at random in the loop, which
    would hide a difference of a fraction of a microsecond (the GC target measures it).
    """
    buf = ReplayBuffer(config)
    with contextlib.suppress(BatchNotReadyError):  # the clock to the last step: admission refuses
        buf.sample_nowait((groups - 1) // ADMISSION_BATCH, 1)  # a step ahead of the clock
    uids = [f"g{i}" for i in range(groups)]
    payloads = [None] * TRAJECTORIES_PER_GROUP
    put_group = buf.put_group_nowait
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for i, uid in enumerate(uids):
            put_group(uid, payloads, global_steps=i // ADMISSION_BATCH)
        elapsed = time.perf_counter_ns() - start
    finally:
        if was_enabled:
            gc.enable()
    return elapsed / groups


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
        configs = admission_configs()
        if configs is not None:
            on, off = configs
            # ns per group here: the target is a difference per group.
            add(
                "admission_off",
                await pipeline_stalebuf(groups, put_group=True, buf=ReplayBuffer(off)) / groups,
            )
            add(
                "admission_on", await pipeline_stalebuf(groups, put_group=True, buf=ReplayBuffer(on)) / groups
            )
            for repeat in range(ADMISSION_REPEATS):  # cheap: more samples, alternating which goes first
                first, second = ("on", "off") if repeat % 2 else ("off", "on")
                for name in (first, second):
                    add(f"put_group_{name}", put_group_cost(groups, on if name == "on" else off))
    return out


def _pipeline_rows(sizes: Sizes, report: Report, per: dict[str, float]) -> None:
    """The verdict row and the variants, from the median round of each part."""
    mine, raw = per["stalebuf"], per["queue_raw"]
    report.add(
        Row(
            target="P2",
            what=(
                "per trajectory: add_prompt + mark_running + 8 x put + mark_finished (awaited), 4 producers "
                f"yielding after each group, trainer sample(B=64) concurrently ({sizes.p2_groups} groups, "
                f"median of {sizes.p2_rounds}, interleaved)"
            ),
            stalebuf=us(mine),
            baseline=f"{us(raw)} (Queue put+get)",
            ratio=ratio(mine, raw),
            goal="<= 3x",
            verdict=report.check("P2", mine <= 3 * raw),
        )
    )
    matched = per["queue_matched"]
    report.info(
        "P2",
        "same vs Queue put+get with the same scheduling (producers yield every 8 puts)",
        us(mine),
        baseline=us(matched),
        ratio=ratio(mine, matched),
    )
    report.info(
        "P2",
        "same, but producers yield only every 64 groups (minimal scheduling)",
        us(per["stalebuf_64"]),
        baseline=us(raw),
        ratio=ratio(per["stalebuf_64"], raw),
    )
    grouped = per["stalebuf_put_group"]
    report.add(
        Row(
            target="P2",
            what="same pipeline, each group uploaded with one put_group call instead of 11 calls",
            stalebuf=us(grouped),
            baseline=f"{us(raw)} (Queue put+get)",
            ratio=ratio(grouped, raw),
            goal="<= 1.5x",
            verdict=report.check("P2 (put_group)", grouped <= 1.5 * raw),
        )
    )
    report.info("P2", "throughput", f"{1e9 / mine:,.0f} traj/s", baseline=f"{1e9 / raw:,.0f} items/s")


def _admission_rows(report: Report, per: dict[str, float]) -> None:
    """What admission control adds per group: put_group_nowait alone (the verdict), and the
    put_group pipeline end to end (its samples also report free slots)."""
    if "put_group_on" not in per:
        report.add(Row(target="P2", what="admission control", stalebuf="not in this version"))
        return
    on, off = per["put_group_on"], per["put_group_off"]
    report.add(
        Row(
            target="P2",
            what=f"put_group_nowait of a new group of 8, per group: admission control on "
            f"(admission_batch_size={ADMISSION_BATCH}) vs off (median of {ADMISSION_REPEATS} per round, "
            "interleaved; GC paused while timing)",
            stalebuf=us(on),
            baseline=f"{us(off)} (off)",
            ratio=f"{(on - off) / 1e3:+.2f} µs",
            goal="<= +0.3 µs",
            verdict=report.check("P2 (admission)", on - off <= 300),
        )
    )
    on, off = per["admission_on"], per["admission_off"]
    report.info(
        "P2",
        "the put_group pipeline above, per group: admission control on vs off",
        us(on),
        baseline=f"{us(off)} (off)",
        ratio=f"{(on - off) / 1e3:+.2f} µs",
    )


def _breakdown_row(report: Report, calls: dict[str, float]) -> None:
    """Per group: the *_nowait calls, the cost of awaiting them, and the rest of the pipeline.

    Uses the best round of each part: fixed work, so the least disturbed.
    """
    nowait_group = (
        calls["add_prompt"]
        + calls["mark_running"]
        + TRAJECTORIES_PER_GROUP * calls["put"]
        + calls["mark_finished"]
    )
    awaited_group = calls["awaited_group"]
    pipeline_group = calls["stalebuf"] * TRAJECTORIES_PER_GROUP
    report.info(
        "P2",
        "breakdown per group of 8 (best round of each part): the *_nowait calls (add_prompt + "
        "mark_running + 8 x put + mark_finished); + awaiting the async twins; + loop yields, "
        "trainer and wake-ups",
        f"{us(calls['add_prompt'])} + {us(calls['mark_running'])} + 8 x {us(calls['put'])} + "
        f"{us(calls['mark_finished'])} = {us(nowait_group)}; "
        f"+ {us(awaited_group - nowait_group)}; + {us(pipeline_group - awaited_group)}",
        baseline=f"{us(calls['queue_raw'] * TRAJECTORIES_PER_GROUP)} (8 Queue put+get)",
    )


def _polling_rows(sizes: Sizes, report: Report, mine: float) -> None:
    """The same pipeline on the polling baseline, one run per poll interval."""
    items = sizes.p2_groups * TRAJECTORIES_PER_GROUP
    for interval in sizes.p2_poll_intervals:
        status(f"P2 polling baseline, {interval} s poll")
        elapsed = anyio.run(pipeline_polling, sizes.p2_groups, interval, backend="asyncio")
        report.info(
            "P2",
            f"same pipeline on the polling buffer, {interval:g} s poll (end to end, 1 run; "
            "ratio: polling / stalebuf)",
            us(mine),
            baseline=f"{us(elapsed / items)} ({items * 1e9 / elapsed:,.0f} traj/s)",
            ratio=ratio(elapsed / items, mine),
        )


def run(sizes: Sizes, report: Report) -> None:
    """Measure P2 and add its rows to ``report``."""
    status("P2 producer path vs asyncio.Queue")
    runs = anyio.run(p2_side_by_side, sizes.p2_groups, sizes.p2_rounds, backend="asyncio")
    per = {name: statistics.median(values) for name, values in runs.items()}
    _pipeline_rows(sizes, report, per)
    _admission_rows(report, per)
    _breakdown_row(report, {name: min(values) for name, values in runs.items()})
    _polling_rows(sizes, report, per["stalebuf"])
