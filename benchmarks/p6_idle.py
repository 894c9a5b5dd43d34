"""P6, idle cost: how many times a parked ``sample`` evaluates its partition while producers
stay silent, or make calls that cannot let it return (expected 0), then after the one call
that completes its batch (expected 1). Counted with :func:`workloads.evaluations`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel

from report import Report, Row, status
from sizes import Sizes
from stalebuf import ReplayBuffer, SamplerConfig
from workloads import PollingBuffer, add_group_nowait, add_polling_group, evaluations, settle

__all__ = ["P6_STEP", "Scenario", "p6_count", "p6_polling_idle", "p6_scenarios", "run"]

P6_STEP = 100


@dataclass
class Scenario:
    """A parked ``sample`` plus producer calls that cannot change its outcome."""

    name: str
    buf: ReplayBuffer
    batch_size: int
    irrelevant: Callable[[ReplayBuffer, int], object] | None  # call i of N; None: stay silent
    last: str  # the group whose mark_finished lets the sample return


def _add_prompt(buf: ReplayBuffer, i: int) -> None:
    buf.add_prompt_nowait(f"new{i}", global_steps=P6_STEP)


def _mark_running(buf: ReplayBuffer, i: int) -> None:
    buf.mark_running_nowait(f"pend{i}")


def _put(buf: ReplayBuffer, i: int) -> None:
    buf.put_nowait(f"run{i % 8}", None, session_id=i // 8)


def _mark_finished(buf: ReplayBuffer, i: int) -> None:
    buf.mark_finished_nowait(f"more{i}")


def _mark_failed(buf: ReplayBuffer, i: int) -> None:
    buf.mark_failed_nowait(f"more{i}")


def _drop_buffer(ready: int) -> ReplayBuffer:
    """A drop-strategy buffer with ``ready`` finished groups and one running group, "last"."""
    buf = ReplayBuffer(SamplerConfig())  # drop, failure_strategy="sample"
    for i in range(ready):
        add_group_nowait(buf, f"ready{i}", P6_STEP)
    add_group_nowait(buf, "last", P6_STEP, finish=False)
    return buf


def _gated_scenario(calls: int, batch: int) -> Scenario:
    """Under the wait strategy: the batch is ready but a running group blocks the gate."""
    buf = ReplayBuffer(SamplerConfig(max_off_policy_strategy="wait", max_off_policy_threshold=8))
    add_group_nowait(buf, "blocker", 0, finish=False)
    for i in range(batch):
        add_group_nowait(buf, f"ready{i}", P6_STEP)
    for i in range(calls):
        add_group_nowait(buf, f"more{i}", P6_STEP, finish=False)
    name = f"wait strategy: {calls} x mark_finished while the gate is closed"
    return Scenario(name, buf, batch, _mark_finished, "blocker")


def p6_scenarios(calls: int) -> list[Scenario]:
    """Each scenario: a sample of ``calls + 16`` groups parks one group short (or behind the
    wait gate); ``calls`` producer calls follow that cannot let it return."""
    batch = calls + 16
    out = [
        Scenario("producers silent", _drop_buffer(batch - 1), batch, None, "last"),
        Scenario(f"{calls} x add_prompt", _drop_buffer(batch - 1), batch, _add_prompt, "last"),
    ]
    buf = _drop_buffer(batch - 1)
    for i in range(calls):
        buf.add_prompt_nowait(f"pend{i}", global_steps=P6_STEP)
    out.append(Scenario(f"{calls} x mark_running", buf, batch, _mark_running, "last"))
    buf = _drop_buffer(batch - 1)
    for j in range(8):
        add_group_nowait(buf, f"run{j}", P6_STEP, trajectories=0, finish=False)
    out.append(Scenario(f"{calls} x put into a running group", buf, batch, _put, "last"))
    for verb, call in (("mark_finished", _mark_finished), ("mark_failed", _mark_failed)):
        buf = _drop_buffer(batch - 1 - calls)
        for i in range(calls):
            add_group_nowait(buf, f"more{i}", P6_STEP, finish=False)
        out.append(Scenario(f"{calls} x {verb} that leaves the batch short", buf, batch, call, "last"))
    out.append(_gated_scenario(calls, batch))
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
        await settle(lambda: buf.stats().total.waiting_samplers == 1)
        start = evaluations(buf)
        if scenario.irrelevant is None:
            await anyio.sleep(idle)
        else:
            for i in range(calls):
                scenario.irrelevant(buf, i)
                await anyio.lowlevel.checkpoint()
        counts.append(evaluations(buf) - start)
        start = evaluations(buf)
        buf.mark_finished_nowait(scenario.last)
        with anyio.fail_after(10):
            await returned.wait()
        counts.append(evaluations(buf) - start)
    return counts[0], counts[1]


async def p6_polling_idle(groups: int, interval: float, idle: float) -> int:
    """Full re-reads the polling buffer does while its producers are silent for ``idle`` s."""
    buf = PollingBuffer(interval)
    for i in range(groups):
        add_polling_group(buf, f"g{i}", 0, finish=False)
    async with anyio.create_task_group() as tg:
        tg.start_soon(buf.sample, 0, groups + 1)
        await settle(lambda: buf.sleeping == 1)
        start = buf.polls
        await anyio.sleep(idle)
        polls = buf.polls - start
        tg.cancel_scope.cancel()
    return polls


def run(sizes: Sizes, report: Report) -> None:
    """Measure P6 and add its rows to ``report``."""
    status("P6 idle cost")
    calls, idle = sizes.p6_calls, sizes.p6_idle
    for scenario in p6_scenarios(calls):
        during, after = anyio.run(p6_count, scenario, calls, idle, backend="asyncio")
        baseline = ""
        what = f"evaluations of a parked sample during: {scenario.name}"
        if scenario.irrelevant is None:
            polls = anyio.run(p6_polling_idle, 1000, 0.05, idle, backend="asyncio")
            baseline = f"{polls} polls (0.05 s), each a scan of all groups"
            what += f" for {idle:g} s"
        report.add(
            Row(
                target="P6",
                what=what,
                stalebuf=f"{during} (then {after} on the completing call)",
                baseline=baseline,
                goal="0 (and 1)",
                verdict=report.check("P6", during == 0 and after == 1),
            )
        )
