"""Where P1's wake-up time goes: the B=8 round trip of ``p1_wakeup`` split into four parts.

Times, per rep, (1) the completing ``mark_finished_nowait``, (2) from its return until the parked
``sample`` resumes, (3) the woken call's evaluation and take, (4) from there until ``sample``
returns (leaving the queue, the batch and its metrics), next to a bare ``asyncio.Event`` round
trip; prints the medians. It replaces ``stalebuf._consumer.park`` with a copy that takes two
timestamps: a diagnostic of the internals, not a target (``compare.py`` measures P1).

    python benchmarks/p1_split.py [B] [reps]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio

from stalebuf import ReplayBuffer, _consumer
from workloads import add_group_nowait, settle

_now = time.perf_counter_ns
_marks = {"resumed": 0, "evaluated": 0}


async def _timed_park(waiter: Any, attempt: Callable[[], Any]) -> Any:
    """``stalebuf._waiting.park``, with timestamps after the resume and after the attempt."""
    while True:
        await waiter.parked()
        _marks["resumed"] = _now()
        result = attempt()
        _marks["evaluated"] = _now()
        if result is not None:
            return result
        waiter.arm()


def _has_waiter(event: asyncio.Event) -> Callable[[], bool]:
    return lambda: bool(getattr(event, "_waiters", None))


async def split(batch_size: int, reps: int) -> dict[str, float]:
    """Median µs of each part over ``reps`` wake-ups, and of the bare Event round trip."""
    setattr(_consumer, "park", _timed_park)  # noqa: B010 - replacing an internal on purpose
    buf = ReplayBuffer()
    names = ("call", "hand-over", "evaluate", "return", "total", "bare")
    parts: dict[str, list[int]] = {name: [] for name in names}
    state = {"t0": 0, "called": 0, "parked": False}
    done = anyio.Event()

    async def sampler() -> None:
        nonlocal done
        for r in range(reps):
            state["parked"] = True
            result = await buf.sample(r, batch_size)
            t1 = _now()
            parts["call"].append(state["called"] - state["t0"])
            parts["hand-over"].append(_marks["resumed"] - state["called"])
            parts["evaluate"].append(_marks["evaluated"] - _marks["resumed"])
            parts["return"].append(t1 - _marks["evaluated"])
            parts["total"].append(t1 - state["t0"])
            del result  # released after t1, as in p1_wakeup
            state["parked"] = False
            done.set()

    async def bare(event: asyncio.Event) -> None:
        await event.wait()
        parts["bare"].append(_now() - state["t0"])
        done.set()

    async with anyio.create_task_group() as tg:
        for r in range(reps):
            event = asyncio.Event()
            done = anyio.Event()
            tg.start_soon(bare, event)
            await settle(_has_waiter(event))
            state["t0"] = _now()
            event.set()
            await done.wait()
            last = ""
            for i in range(batch_size):
                last = f"w{r}x{i}"
                add_group_nowait(buf, last, r, finish=i < batch_size - 1)
            if r == 0:
                tg.start_soon(sampler)
            await settle(lambda: bool(state["parked"]) and buf.stats().total.waiting_samplers == 1)
            done = anyio.Event()
            state["t0"] = _now()
            buf.mark_finished_nowait(last)
            state["called"] = _now()
            await done.wait()
    return {name: statistics.median(values) / 1000 for name, values in parts.items()}


def main() -> None:
    batch_size = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    medians = asyncio.run(split(batch_size, reps))
    print(f"B={batch_size}, {reps} reps, median µs: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))


if __name__ == "__main__":
    main()
