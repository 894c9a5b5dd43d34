"""P1, wake-up latency: the batch-completing producer call -> the parked ``sample`` returns.

Measured side by side with a bare ``asyncio.Event`` (``trio.Event`` on trio) set -> wake,
rep by rep in one event loop, on asyncio, trio and uvloop; and against the polling
baseline, whose last group finishes at a random phase of the trainer's poll loop. The end
timestamp is taken as soon as ``sample`` returns, while the batch is still held: freeing
its groups and trajectories afterwards is not counted as wake-up latency.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio

from report import Report, Row, ms, p50_p99, percentile, ratio, status, us
from sizes import Sizes
from stalebuf import ReplayBuffer
from workloads import PollingBuffer, add_group_nowait, add_polling_group, settle

__all__ = ["p1_polling", "p1_side_by_side", "run"]

#: (name, anyio backend, backend options, bare event factory, its name) per event loop.
Backend = tuple[str, str, dict[str, Any], Callable[[], Any], str]


class _Shared:
    """State shared by the producer and the parked task of one latency run."""

    def __init__(self) -> None:
        self.t0 = 0
        self.parked = False  # the parked task is about to wait
        self.bare_parked = False  # the bare-event waiter is about to wait
        self.done = anyio.Event()


async def p1_side_by_side(
    bare_event: Callable[[], Any], reps: int, batch_size: int, status_log_interval: float | None = 60.0
) -> tuple[list[int], list[int]]:
    """Interleave ``reps`` bare Event set->wake round trips with ``reps`` stalebuf wake-ups.

    stalebuf: the sampler is parked in ``sample(r, batch_size)`` with ``batch_size - 1``
    groups finished; t0 is taken just before the ``mark_finished_nowait`` that completes
    the batch, t1 as soon as ``sample`` returns, before the batch is released. Bare: t0
    just before ``event.set()``, t1 right after ``await event.wait()`` returns. Returns
    (stalebuf ns, bare ns). ``status_log_interval`` is passed to the buffer (60.0 is its
    default).
    """
    buf = ReplayBuffer(status_log_interval=status_log_interval)
    shared = _Shared()
    buf_lat: list[int] = []
    bare_lat: list[int] = []

    async def sampler() -> None:
        for r in range(reps):
            shared.parked = True
            result = await buf.sample(r, batch_size)
            t1 = time.perf_counter_ns()
            buf_lat.append(t1 - shared.t0)
            del result  # freed after t1: releasing the batch is not part of the wake-up
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
            event = bare_event()
            shared.done = anyio.Event()
            tg.start_soon(bare_waiter, event)
            await settle(lambda: shared.bare_parked)
            shared.t0 = time.perf_counter_ns()
            event.set()
            await shared.done.wait()
            if r == 0:
                shared.done = anyio.Event()
                tg.start_soon(sampler)
            last = ""
            for i in range(batch_size):
                last = f"w{r}x{i}"
                add_group_nowait(buf, last, r, finish=i < batch_size - 1)
            await settle(sampler_parked)
            shared.done = anyio.Event()
            shared.t0 = time.perf_counter_ns()
            buf.mark_finished_nowait(last)
            await shared.done.wait()
    return buf_lat, bare_lat


async def p1_polling(interval: float, reps: int, batch_size: int, seed: int = 1) -> list[int]:
    """Wake-up latency of :class:`PollingBuffer`: the last group finishes at a random phase
    of the trainer's poll loop; t1 is taken when its ``sample`` returns, before the batch
    is released (as for stalebuf)."""
    buf = PollingBuffer(interval)
    rng = random.Random(seed)
    shared = _Shared()
    lat: list[int] = []

    async def sampler() -> None:
        for r in range(reps):
            batch = await buf.sample(r, batch_size)
            lat.append(time.perf_counter_ns() - shared.t0)
            del batch
            shared.done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(sampler)
        for r in range(reps):
            last = ""
            for i in range(batch_size):
                last = f"w{r}x{i}"
                add_polling_group(buf, last, r, finish=i < batch_size - 1)
            await settle(lambda: buf.sleeping == 1)
            await anyio.sleep(rng.uniform(0, interval))
            shared.done = anyio.Event()
            shared.t0 = time.perf_counter_ns()
            buf.mark_finished_nowait(last)
            await shared.done.wait()
    return lat


def _backends(report: Report) -> list[Backend]:
    """asyncio, plus trio and uvloop where installed (a row says which are not)."""
    backends: list[Backend] = [("asyncio", "asyncio", {}, asyncio.Event, "asyncio.Event")]
    try:
        import trio

        backends.append(("trio", "trio", {}, trio.Event, "trio.Event"))
    except ImportError:
        report.add(Row(target="P1", what="wake-up latency on trio", stalebuf="not installed"))
    try:
        import uvloop  # noqa: F401

        backends.append(("uvloop", "asyncio", {"use_uvloop": True}, asyncio.Event, "asyncio.Event"))
    except ImportError:
        report.add(Row(target="P1", what="wake-up latency on uvloop", stalebuf="not installed"))
    return backends


def _per_backend(sizes: Sizes, report: Report) -> float:
    """The B=8 rows on every backend; returns the asyncio p50 (ns)."""
    b = sizes.p1_batch
    asyncio_p50 = float("nan")
    for name, backend, options, bare, bare_name in _backends(report):
        status(f"P1 wake-up latency on {name}")
        buf_lat, bare_lat = anyio.run(
            p1_side_by_side, bare, sizes.p1_reps[name], b, backend=backend, backend_options=options
        )
        p50, p99 = percentile(buf_lat, 0.5), percentile(buf_lat, 0.99)
        bp50, bp99 = percentile(bare_lat, 0.5), percentile(bare_lat, 0.99)
        what = f"{name}: batch-completing call -> sample() returns, p50 (B={b}, n={len(buf_lat)})"
        if name == "asyncio":
            asyncio_p50 = p50
            verdict = report.check("P1", p50 <= 3 * bp50)
            report.add(
                Row(
                    target="P1",
                    what=what,
                    stalebuf=us(p50),
                    baseline=f"{us(bp50)} ({bare_name})",
                    ratio=ratio(p50, bp50),
                    goal="p50 <= 3x bare",
                    verdict=verdict,
                )
            )
        else:
            report.info("P1", what, us(p50), baseline=f"{us(bp50)} ({bare_name})", ratio=ratio(p50, bp50))
        report.info("P1", f"{name}: same, p99", us(p99), baseline=us(bp99), ratio=ratio(p99, bp99))
    return asyncio_p50


def _variant(
    report: Report,
    what: str,
    reps: int,
    batch_size: int,
    status_log_interval: float | None,
    *,
    goal: tuple[str, float] | None = None,
) -> None:
    """One asyncio variant of the B=8 measurement, reported as p50 / p99; with ``goal``
    (target name, largest p50 ratio) also judged."""
    buf_lat, bare_lat = anyio.run(
        p1_side_by_side, asyncio.Event, reps, batch_size, status_log_interval, backend="asyncio"
    )
    p50, bp50 = percentile(buf_lat, 0.5), percentile(bare_lat, 0.5)
    row = Row(
        target="P1",
        what=f"{what}, p50 / p99 (n={len(buf_lat)})",
        stalebuf=p50_p99(buf_lat),
        baseline=p50_p99(bare_lat),
        ratio=ratio(p50, bp50),
        verdict="info",
    )
    if goal is not None:
        target, limit = goal
        row = replace(row, goal=f"p50 <= {limit:g}x bare", verdict=report.check(target, p50 <= limit * bp50))
    report.add(row)


def _polling(sizes: Sizes, report: Report, asyncio_p50: float) -> None:
    """The polling baseline: measured intervals, then intervals reported from theory."""
    for interval, reps in sizes.p1_polls:
        status(f"P1 polling baseline, {interval} s poll, {reps} reps")
        lat = anyio.run(p1_polling, interval, reps, sizes.p1_batch, backend="asyncio")
        report.info(
            "P1",
            f"polling buffer, {interval:g} s poll: p50 / max (measured, n={reps}; ratio: polling / stalebuf)",
            us(asyncio_p50),
            baseline=f"{ms(percentile(lat, 0.5))} / {ms(max(lat))}",
            ratio=ratio(percentile(lat, 0.5), asyncio_p50),
        )
    for interval in sizes.p1_polls_computed:
        report.info(
            "P1",
            f"polling buffer, {interval:g} s poll: expected p50 = interval / 2 (computed, not run; "
            "ratio: polling / stalebuf)",
            us(asyncio_p50),
            baseline=ms(interval / 2 * 1e9),
            ratio=ratio(interval / 2 * 1e9, asyncio_p50),
        )


def run(sizes: Sizes, report: Report) -> None:
    """Measure P1 and add its rows to ``report``."""
    asyncio_p50 = _per_backend(sizes, report)
    status("P1 wake-up latency on asyncio, status_log_interval=None")
    _variant(
        report,
        "asyncio: same with status_log_interval=None (no status timer)",
        sizes.p1_big_reps,
        sizes.p1_batch,
        None,
    )
    small = sizes.p1_small_batch
    status(f"P1 wake-up latency on asyncio, B={small}")
    _variant(report, f"asyncio: same with B={small}", sizes.p1_reps["asyncio"], small, 60.0, goal=("P1", 3))
    big = sizes.p1_big_batch
    status(f"P1 wake-up latency on asyncio, B={big}")
    _variant(report, f"asyncio: same with B={big}", sizes.p1_big_reps, big, 60.0, goal=(f"P1 (B={big})", 5))
    _polling(sizes, report, asyncio_p50)
