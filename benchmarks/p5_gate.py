"""P5, the wait gate: ``sample(timeout=0)`` under the wait strategy with 64 groups ready and
N in-flight groups, the oldest of which blocks the gate. The call evaluates once and
raises ``TimeoutError``; it is interleaved with N=1e3. The polling baseline's blocked
poll re-reads all N groups.
"""

from __future__ import annotations

import gc
import statistics
import time
from functools import partial

import anyio

from report import Report, Row, fmt_n, one_poll, status, us, vs_ref
from sizes import Sizes
from workloads import GATE_STEP, PER_STEP, Gated, PollingBuffer, add_polling_group, gc_paused, interleaved

__all__ = ["P5_BATCH", "polling_gate_poll_ns", "run", "timed_gate"]

P5_BATCH = 64


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


async def _by_size(sizes: Sizes) -> tuple[dict[int, float], dict[int, float]]:
    """Median blocked evaluation per N, and its ratio to the reference set (the first N)."""
    ref_n = sizes.p5_sizes[0]
    ref = Gated(ref_n, P5_BATCH)
    eval_ns: dict[int, float] = {}
    eval_ratio: dict[int, float] = {}
    for n in sizes.p5_sizes:
        status(f"P5 wait gate with N={n} in-flight groups")
        gated = ref if n == ref_n else Gated(n, P5_BATCH)
        mine, theirs = await interleaved(partial(timed_gate, ref), partial(timed_gate, gated), sizes.p5_reps)
        eval_ns[n] = mine
        eval_ratio[n] = 1.0 if gated is ref else mine / theirs
        if gated is not ref:
            gated.close()
    ref.close()
    return eval_ns, eval_ratio


async def _p5(sizes: Sizes, report: Report) -> None:
    eval_ns, eval_ratio = await _by_size(sizes)
    poll_ns: dict[int, float] = {}
    for n in sizes.p5_poll_sizes:
        status(f"P5 polling baseline, N={n} in-flight groups")
        poll_ns[n] = statistics.median(polling_gate_poll_ns(n, P5_BATCH, 3))
    ref_n, hi = sizes.p5_sizes[0], sizes.p5_sizes[-1]
    for n in sizes.p5_sizes:
        report.add(
            Row(
                target="P5",
                what=f"sample(timeout=0) blocked by the wait gate, N={fmt_n(n)} in-flight groups "
                f"(median of {sizes.p5_reps})",
                stalebuf=us(eval_ns[n]),
                baseline=one_poll(poll_ns.get(n)),
                ratio=vs_ref(eval_ratio[n], ref_n),
            )
        )
    report.add(
        Row(
            target="P5",
            what=f"blocked evaluation: t(N={fmt_n(hi)}) / t(N={fmt_n(ref_n)})",
            stalebuf=f"{eval_ratio[hi]:.2f}x",
            baseline="" if hi not in poll_ns else f"{poll_ns[hi] / poll_ns[ref_n]:.0f}x",
            goal="<= 3 (O(1) or O(log N))",
            verdict=report.check("P5", eval_ratio[hi] <= 3),
        )
    )
    report.scaling["P5 stalebuf blocked evaluation"] = sorted(eval_ns.items())
    report.scaling["P5 polling buffer, one blocked poll"] = sorted(poll_ns.items())


def run(sizes: Sizes, report: Report) -> None:
    """Measure P5 and add its rows to ``report``."""
    anyio.run(_p5, sizes, report, backend="asyncio")
