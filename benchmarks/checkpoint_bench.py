"""Checkpoint cost (issue 12): ``checkpoint()``, ``save()`` and the event loop's stalls meanwhile.

Usage::

    python benchmarks/checkpoint_bench.py              # 1e5 resident groups x 8 trajectories
    python benchmarks/checkpoint_bench.py --quick      # 2,000 groups: the CI smoke run, ~1 s
    python benchmarks/checkpoint_bench.py --backend trio --profile

The buffer holds ``--groups`` resident groups of ``--trajectories`` small payloads (32 bytes
each), 1 % of them still RUNNING (their snapshot is the only per-group work ``checkpoint()``
does). It is built with the cyclic GC paused and then frozen (``gc.freeze()``), as in the other
benchmarks, so a timed call does not pay for collecting setup objects.

- ``checkpoint()``: wall time of the synchronous call, median and max of ``--reps``, and its
  CPU time (steadier on a shared machine). Target: at most 20 ms at 1e5 x 8.
- ``save()``: wall time of ``await buffer.save(path)`` (a temporary directory on the same
  disk as the default temp dir), median of ``--save-reps``, and the file size.
- Loop stall during ``save()``: a ticker task sleeps 1 ms in a loop and records how late each
  wake-up is. The tick asleep when ``save()`` begins absorbs its synchronous ``checkpoint()``
  ("at save() start"); the later ticks measure the write in the worker thread ("while the file
  is written"). ``gc.callbacks`` time every collection in any thread; "without GC" subtracts the
  collection time inside each tick from its lateness. The same ticker runs for the same time
  without a save, for the noise floor.
- ``restore()``: wall time of ``ReplayBuffer.restore(path)`` (synchronous).

``--profile`` also prints cProfile's top entries for ``checkpoint()`` and for writing the file
(the writer called in this thread, through the private ``stalebuf._checkpoint_db``, because
cProfile sees only the thread it runs in). No test asserts on these timings.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from stalebuf import ReplayBuffer, SamplerConfig

TICK = 0.001
TARGET_CHECKPOINT = 0.020


@dataclass
class GcClock:
    """Every garbage collection's (start, end), in any thread, through ``gc.callbacks``."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)  # of each span
    _started: float = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        else:
            self.spans.append((self._started, now))
            self.generations.append(info["generation"])

    def within(self, start: float, end: float) -> float:
        """Seconds of collection inside [start, end]."""
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.spans)


@dataclass
class Stalls:
    """What the ticker saw: each tick's (start, end, lateness)."""

    ticks: list[tuple[float, float, float]] = field(default_factory=list)

    def longest(self, gc_clock: GcClock | None = None, after: float = -1.0, before: float = 1e300) -> float:
        """The largest lateness of the ticks that started in [after, before), without the
        collection time inside each tick if ``gc_clock`` is given."""
        lateness = [
            late - (gc_clock.within(a, b) if gc_clock is not None else 0.0)
            for a, b, late in self.ticks
            if after <= a < before
        ]
        return max(lateness, default=0.0)


def build(groups: int, trajectories: int) -> ReplayBuffer:
    """``groups`` resident groups, 1 % of them RUNNING, of ``trajectories`` 32-byte payloads."""
    gc.disable()
    buffer = ReplayBuffer(SamplerConfig(max_off_policy_threshold=1_000_000), status_log_interval=None)
    running = max(1, groups // 100)
    payload = 0
    for i in range(groups):
        payloads = [(payload + k).to_bytes(8, "little") * 4 for k in range(trajectories)]
        payload += trajectories
        if i < groups - running:
            buffer.put_group_nowait(f"g{i}", payloads, global_steps=i // 1000)
        else:
            buffer.add_prompt_nowait(f"g{i}", global_steps=i // 1000)
            buffer.mark_running_nowait(f"g{i}")
            for session, item in enumerate(payloads[: trajectories // 2]):
                buffer.put_nowait(f"g{i}", item, session_id=session)
    gc.enable()
    gc.collect()
    gc.freeze()
    return buffer


def time_checkpoint(buffer: ReplayBuffer, reps: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (this thread's) seconds of each ``checkpoint()``: on a shared machine the
    CPU time is the steadier of the two."""
    wall, cpu = [], []
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        buffer.checkpoint()
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return wall, cpu


async def ticker(stalls: Stalls, stop: anyio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await anyio.sleep(TICK)
        end = time.perf_counter()
        stalls.ticks.append((start, end, end - start - TICK))


@dataclass
class Save:
    """One measured save: when it started, how long it took, what the ticker saw."""

    start: float
    duration: float
    stalls: Stalls

    def at_start(self, gc_clock: GcClock | None = None) -> float:
        """The stall of the tick that was asleep when save() began: checkpoint() blocks it."""
        return self.stalls.longest(gc_clock, before=self.start)

    def writing(self, gc_clock: GcClock | None = None) -> float:
        """The longest stall of the ticks that began after: the file written in a thread."""
        return self.stalls.longest(gc_clock, after=self.start)


async def measure_save(buffer: ReplayBuffer, path: Path) -> Save:
    """One save with the ticker running."""
    stalls, stop = Stalls(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker, stalls, stop)
        await anyio.sleep(0.02)  # the ticker is running
        stalls.ticks.clear()
        start = time.perf_counter()
        await buffer.save(path)
        duration = time.perf_counter() - start
        await anyio.sleep(2 * TICK)  # the last tick of the save is recorded
        stop.set()
    return Save(start, duration, stalls)


async def measure_idle(seconds: float) -> Stalls:
    stalls, stop = Stalls(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker, stalls, stop)
        await anyio.sleep(seconds)
        stop.set()
    return stalls


def profile(title: str, call: Callable[[], object], lines: int = 12) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    profiler.disable()
    print(f"\n-- profile: {title}")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(lines)


def profile_both(buffer: ReplayBuffer, path: Path) -> None:
    profile("checkpoint()", buffer.checkpoint)
    from stalebuf._checkpoint_db import write_checkpoint

    ckpt = buffer.checkpoint()
    profile("writing the file (in this thread)", lambda: write_checkpoint(path, ckpt, None))


def gc_summary(gc_clock: GcClock, save: Save) -> str:
    """The collections that began during ``save``: count, total and longest (its generation)."""
    spans = [
        (b - a, generation)
        for (a, b), generation in zip(gc_clock.spans, gc_clock.generations, strict=True)
        if save.start <= a <= save.start + save.duration
    ]
    longest = max(spans, default=(0.0, 0))
    total = sum(seconds for seconds, _ in spans)
    return f"{len(spans)}, {ms(total)}, {ms(longest[0])} (generation {longest[1]})"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def run(args: argparse.Namespace) -> None:
    built = time.perf_counter()
    buffer = build(args.groups, args.trajectories)
    built = time.perf_counter() - built
    checkpoint_times, checkpoint_cpu = time_checkpoint(buffer, args.reps)
    gc_clock = GcClock()
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "buffer.ckpt"
        gc.callbacks.append(gc_clock)
        try:
            saves = [
                anyio.run(measure_save, buffer, path, backend=args.backend) for _ in range(args.save_reps)
            ]
        finally:
            gc.callbacks.remove(gc_clock)
        durations = [save.duration for save in saves]
        worst = max(saves, key=lambda save: save.writing())
        idle = anyio.run(measure_idle, statistics.median(durations), backend=args.backend)
        size = path.stat().st_size
        start = time.perf_counter()
        restored = ReplayBuffer.restore(path).buffer
        restore_seconds = time.perf_counter() - start
        assert restored.stats().total.groups == args.groups
        if args.profile:
            profile_both(buffer, path)
    median_ckpt = statistics.median(checkpoint_times)
    verdict = "PASS" if median_ckpt <= TARGET_CHECKPOINT else "FAIL"
    target = "" if args.quick else f"  target <= 20 ms: {verdict}"
    running = max(1, args.groups // 100)
    rows += [
        ("resident groups", f"{args.groups:,} x {args.trajectories} ({running:,} running)"),
        ("build (not timed below)", f"{built:.1f} s"),
        (
            f"checkpoint() median / max of {args.reps}",
            f"{ms(median_ckpt)} / {ms(max(checkpoint_times))}{target}",
        ),
        ("  its CPU time, median", ms(statistics.median(checkpoint_cpu))),
        (f"save() median of {args.save_reps}", f"{statistics.median(durations):.2f} s ({size / 1e6:.1f} MB)"),
        ("loop stall at save() start (its checkpoint())", ms(max(save.at_start() for save in saves))),
        ("  the same without GC time", ms(max(save.at_start(gc_clock) for save in saves))),
        ("loop stall while the file is written, longest", ms(worst.writing())),
        ("  the same without GC time", ms(worst.writing(gc_clock))),
        ("  GC in that save: collections, total, longest", gc_summary(gc_clock, worst)),
        ("  idle loop, longest lateness (noise floor)", ms(idle.longest())),
        ("restore() (read + rebuild)", f"{restore_seconds:.2f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"stalebuf checkpoint benchmark ({args.backend}, pid {os.getpid()})")
    print(f"| {'measurement'.ljust(width)} | value |")
    print(f"|{'-' * (width + 2)}|-------|")
    for name, value in rows:
        print(f"| {name.ljust(width)} | {value} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--reps", type=int, default=None, help="checkpoint() repetitions")
    parser.add_argument("--save-reps", type=int, default=None)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    args.groups = args.groups or (2_000 if args.quick else 100_000)
    args.reps = args.reps or (5 if args.quick else 21)
    args.save_reps = args.save_reps or (1 if args.quick else 3)
    run(args)


if __name__ == "__main__":
    main()
