"""Journal (issue 25): what the SQLite journal costs, side by side with the same buffer without one.

Three targets, each measured in this one process, the two variants interleaved (ABBA) so that
load from other processes hits both alike; every journal is a fresh file in a temporary
directory (``--dir``), with ``journal_interval=1.0`` and the other journal defaults unless said:

1. **Producer path on the event-loop thread** (target <= 1.3x). A producer task calls
   ``await put_group(uid, 8 x 4 KiB bytes)`` at a steady rate (``--rate`` groups/s, in bursts
   every 10 ms, sleeping between them) that the writer can keep up with, while a trainer task
   drains the buffer (``sample(batch_size=64)``, one step per batch), so residency stays at a
   few batches; a round ends with ``await buffer.flush()`` (at once without a journal). The
   judged figure is the loop thread's CPU time (``time.thread_time()`` from the round's start to
   the flush's return) per group: everything the loop thread did, the ``put_group`` calls, the
   sampler's calls, the journal's hand-offs to the writer (one per second, and the flush's), the
   loop's own wake-ups. CPU time, not wall time: the writer thread runs concurrently on the
   other core, and on a shared machine a descheduled or GIL-waiting thread is not charged.
   The mean and median wall time of one ``put_group`` call (GIL waits included) are reported.
2. **Sustained throughput** (target >= 20,000 trajectories/s). The paced producer above
   offers 40,000 trajectories/s (twice the target) while the trainer drains 256 groups per
   step; the figure is trajectories over the wall time until everything is committed (the
   final ``await buffer.flush()`` returns). Judged: the journal with the issue's settings
   (``journal_interval=1.0``, the other defaults: history more than ``journal_retention_steps=4``
   trainer steps behind the newest sample is deleted at each commit). Reported too: **history
   kept** (``journal_retention_steps`` so large that nothing is ever deleted: every payload
   reaches the disk and stays, as when the trainer marks its checkpoints rarely), which is
   disk-bound, beside this disk's ceiling measured in the same run (bare SQLite inserts of
   one group's encoded size under the journal's WAL and ``synchronous=FULL``). Backpressure
   (``journal_max_pending_bytes``) keeps the producer from outrunning the writer.
3. **``sample`` latency** (target: p50 at most 20 µs over the same call without a journal). Two
   buffers hold the same 4,096 finished groups (8 x 4 KiB each, 256 per dispatch step); each
   round times one ``await sample(global_steps, batch_size=64)`` (a batch is ready: the call
   never suspends) on each and refills the 64 groups it took, untimed. Judged: rounds back to
   back (the loop yields between them: the journal's hand-offs run there), so the writer is
   busy throughout (backpressure paces the refills). Reported too: rounds paced every 25.6 ms
   (the writer gets 2,500 groups/s, the throughput target), the loop sleeping between them: each
   timed call then starts with cold caches, which costs both buffers more, the journal's extra
   work (two dictionary passes over the batch, the state captured after it) most.

4. **Committing removals** (reported, no target): 4,096 groups committed, then all sampled (64 a
   step) and that committed (``flush``), history kept: what recording the removal of groups the
   journal already wrote costs the writer (their records must not be written again).

Usage: ``python benchmarks/journal.py [--only producer,throughput,sample,removals] [--rounds N] [--quick]``
(``--quick``: tiny sizes, a smoke run whose figures mean nothing). Exits 1 when a target is
missed (never with ``--quick``). Disk: the ``history kept`` run writes about 1.3 GB (deleted).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

from stalebuf import ReplayBuffer, SamplerConfig

__all__ = ["PAYLOAD_BYTES", "TRAJECTORIES", "Sizes", "new_buffer", "payloads"]

TRAJECTORIES = 8
PAYLOAD_BYTES = 4096
BIG_THRESHOLD = 1_000_000  # no group is ever stale
PRODUCER_RATIO, THROUGHPUT, SAMPLE_US = 1.3, 20_000, 20.0
OFFERED = 2 * THROUGHPUT  # trajectories/s the throughput measurement's producer offers
BURST_SECONDS = 0.01  # the paced producer's period
SAMPLE_RATE = THROUGHPUT / TRAJECTORIES  # groups/s refilled in the paced sample measurement
JUDGED_SAMPLE_REGIME = "back to back"


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does."""

    producer_groups: int = 3_000  # per round, at --rate groups/s: 2 s, two hand-offs and a flush
    producer_rounds: int = 12  # ABBA rounds (each runs both variants)
    throughput_groups: int = 50_000  # 10 s at OFFERED; 1.6 GB of payloads
    throughput_rounds: int = 2
    resident: int = 4_096
    sample_rounds: int = 400  # 10 s


FULL = Sizes()
QUICK = Sizes(200, 1, 1_000, 1, 512, 20)


def payloads() -> list[bytes]:
    """One group's payloads: 8 distinct 4 KiB bytes objects (shared by every group: no memory
    grows with the groups, while every group's 32 KiB is encoded and written)."""
    return [os.urandom(PAYLOAD_BYTES) for _ in range(TRAJECTORIES)]


def new_buffer(journal: str | None, **options: int | float) -> ReplayBuffer:
    """A buffer where no group is ever stale, journaled to ``journal`` if given."""
    config = SamplerConfig(max_off_policy_threshold=BIG_THRESHOLD)
    if journal is None:
        return ReplayBuffer(config, status_log_interval=None)
    return ReplayBuffer(config, status_log_interval=None, journal=journal, **options)  # type: ignore[arg-type]


@dataclass
class Files:
    """Fresh journal paths in one temporary directory."""

    root: str
    count: int = 0

    def next(self) -> str:
        self.count += 1
        return os.path.join(self.root, f"journal{self.count}.sqlite")

    def clear(self) -> None:
        for name in os.listdir(self.root):
            os.remove(os.path.join(self.root, name))


async def _drain(buf: ReplayBuffer, batch_size: int) -> None:
    """The trainer: sample ``batch_size`` groups, one step per batch, until cancelled."""
    step = 1
    while True:
        await buf.sample(step, batch_size=batch_size, timeout=None)
        step += 1


# -- the paced producer (targets 1 and 2) --------------------------------------------------------


@dataclass
class Run:
    """One paced run: ``groups`` groups put at ``rate`` groups/s, then ``flush``."""

    groups: int
    cpu: float  # seconds of the loop thread's CPU from the first put to the flush's return
    wall: float  # seconds from the first put to the flush's return (everything committed)
    calls: list[int] = field(repr=False)  # ns of each put_group call
    lag: float = 0.0  # the largest journal_lag_seconds seen (every 100 ms), if watched


async def _watch_lag(buf: ReplayBuffer, run: Run) -> None:
    while True:
        run.lag = max(run.lag, buf.stats().journal_lag_seconds)
        await anyio.sleep(0.1)


async def paced(buf: ReplayBuffer, groups: int, rate: float, batch_size: int, watch: bool = False) -> Run:
    """Put ``groups`` groups (``await put_group``, 8 x 4 KiB) at ``rate`` groups/s, in bursts
    every 10 ms, while a trainer task samples ``batch_size`` at a time; then flush."""
    group_payloads = payloads()
    run = Run(groups, 0.0, 0.0, [])
    calls = run.calls
    per_burst = max(1, round(rate * BURST_SECONDS))
    clock = time.perf_counter_ns
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_drain, buf, batch_size)
        if watch:
            tasks.start_soon(_watch_lag, buf, run)
        await anyio.lowlevel.checkpoint()
        start_cpu, start = time.thread_time(), time.monotonic()
        for first in range(0, groups, per_burst):
            for i in range(first, min(groups, first + per_burst)):
                t0 = clock()
                await buf.put_group(f"p{i}", group_payloads)
                calls.append(clock() - t0)
            await anyio.sleep(max(0.0, start + (first + per_burst) / rate - time.monotonic()))
        await buf.flush()
        run.cpu, run.wall = time.thread_time() - start_cpu, time.monotonic() - start
        tasks.cancel_scope.cancel()
    await buf.aclose()
    return run


# -- 1. the producer path on the loop thread ----------------------------------------------------


def producer(sizes: Sizes, rounds: int, rate: float, files: Files) -> dict[str, list[Run]]:
    """Rounds of the paced producer with and without a journal, ABBA."""
    results: dict[str, list[Run]] = {"no journal": [], "journal": []}
    names = list(results)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            buf = new_buffer(files.next() if name == "journal" else None, journal_interval=1.0)
            results[name].append(asyncio.run(paced(buf, sizes.producer_groups, rate, 64)))
            files.clear()
    return results


def report_producer(results: dict[str, list[Run]], quick: bool) -> bool:
    base, journal = results["no journal"], results["journal"]
    print("\n1. producer path: await put_group(8 x 4 KiB), loop thread CPU per group (ABBA)")
    for name, runs in results.items():
        cpu = [r.cpu / r.groups * 1e6 for r in runs]
        calls = [ns / 1e3 for r in runs for ns in r.calls]
        print(
            f"  {name:11s} CPU/group median {statistics.median(cpu):6.1f} µs (min {min(cpu):5.1f});"
            f" one put_group call: mean {statistics.fmean(calls):5.1f} µs,"
            f" p50 {statistics.median(calls):5.1f} µs, p99 {_quantile(calls, 0.99):6.1f} µs"
        )
    paired = statistics.median(j.cpu / b.cpu for j, b in zip(journal, base, strict=True))
    ratio = statistics.median(r.cpu for r in journal) / statistics.median(r.cpu for r in base)
    return _verdict(f"ratio of medians {ratio:.2f}x, paired {paired:.2f}x", ratio <= PRODUCER_RATIO,
                    f"<= {PRODUCER_RATIO}x", quick)  # fmt: skip


# -- 2. sustained throughput ---------------------------------------------------------------------


THROUGHPUT_VARIANTS: dict[str, dict[str, int] | None] = {
    "no journal": None,
    "journal (defaults)": {},
    "journal (history kept)": {"journal_retention_steps": 10**9},
}


def throughput(sizes: Sizes, rounds: int, files: Files) -> dict[str, list[Run]]:
    """Paced runs at OFFERED trajectories/s per variant, rounds alternating the order."""
    results: dict[str, list[Run]] = {name: [] for name in THROUGHPUT_VARIANTS}
    names = list(results)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            options = THROUGHPUT_VARIANTS[name]
            buf = new_buffer(None if options is None else files.next(), **(options or {}))
            run = asyncio.run(paced(buf, sizes.throughput_groups, OFFERED / TRAJECTORIES, 256, watch=True))
            results[name].append(run)
            files.clear()
    return results


def disk_ceiling(groups: int, root: str) -> float:
    """Trajectories/s-equivalent of bare SQLite on this disk: ``groups`` rows of one group's
    encoded size (8 x 4 KiB pickled) inserted under the journal's settings (WAL,
    ``synchronous=FULL``), a commit per 1,000 rows; no encoding, no other table, nothing deleted."""
    path = os.path.join(root, "ceiling.sqlite")
    connection = sqlite3.connect(path, isolation_level=None)
    for pragma in (
        "auto_vacuum=INCREMENTAL",
        "journal_mode=WAL",
        "synchronous=FULL",
        "journal_size_limit=67108864",
    ):
        connection.execute(f"PRAGMA {pragma}")
    connection.execute("CREATE TABLE groups (gid INTEGER PRIMARY KEY, record BLOB)")
    blob = pickle.dumps(payloads())
    start = time.monotonic()
    for first in range(0, groups, 1_000):
        connection.execute("BEGIN IMMEDIATE")
        rows = ((i, blob) for i in range(first, min(groups, first + 1_000)))
        connection.executemany("INSERT INTO groups VALUES (?, ?)", rows)
        connection.execute("COMMIT")
    seconds = time.monotonic() - start
    connection.close()
    for name in os.listdir(root):
        os.remove(os.path.join(root, name))
    return groups * TRAJECTORIES / seconds


def report_throughput(results: dict[str, list[Run]], ceiling: float, quick: bool) -> bool:
    groups = next(iter(results.values()))[0].groups
    print(f"\n2. sustained throughput: {groups:,} groups x {TRAJECTORIES} x 4 KiB offered at "
          f"{OFFERED:,} trajectories/s, trajectories over the wall time until all is committed")  # fmt: skip
    for name, runs in results.items():
        rates = [r.groups * TRAJECTORIES / r.wall for r in runs]
        print(f"  {name:23s} median {statistics.median(rates):7,.0f} trajectories/s (runs: "
              + ", ".join(f"{v:,.0f}" for v in rates)
              + f"); largest journal_lag_seconds {max(r.lag for r in runs):.2f}")  # fmt: skip
    kept = statistics.median(r.groups * TRAJECTORIES / r.wall for r in results["journal (history kept)"])
    print(f"  disk ceiling (bare SQLite inserts, WAL, synchronous=FULL) {ceiling:7,.0f} trajectories/s;"
          f" history kept reaches {kept / ceiling:.0%} of it (reported, not judged: disk-bound)")  # fmt: skip
    judged = statistics.median(r.groups * TRAJECTORIES / r.wall for r in results["journal (defaults)"])
    return _verdict(f"journal (defaults) {judged:,.0f} trajectories/s", judged >= THROUGHPUT,
                    f">= {THROUGHPUT:,}", quick)  # fmt: skip


# -- 3. sample latency ---------------------------------------------------------------------------


@dataclass
class Resident:
    """A buffer refilled to ``n`` groups after every sample."""

    buf: ReplayBuffer
    group_payloads: list[bytes]
    added: int = 0
    top: int = 0

    async def refill(self, count: int) -> None:
        put = self.buf.put_group  # waits while the journal's writer is too far behind
        for _ in range(count):
            self.top = self.added // 256
            await put(f"r{self.added}", self.group_payloads, global_steps=self.top)
            self.added += 1


async def _sample_rounds(sizes: Sizes, files: Files, paced: bool) -> dict[str, list[int]]:
    group_payloads = payloads()
    buffers = {"no journal": new_buffer(None), "journal": new_buffer(files.next(), journal_interval=1.0)}
    residents = {name: Resident(buf, group_payloads) for name, buf in buffers.items()}
    for resident in residents.values():
        await resident.refill(sizes.resident)
        await resident.buf.flush()
    times: dict[str, list[int]] = {name: [] for name in residents}
    names = list(residents)
    clock = time.perf_counter_ns
    start = time.monotonic()
    for round_ in range(sizes.sample_rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            resident = residents[name]
            step = resident.top + 1
            t0 = clock()
            batch, _ = await resident.buf.sample(step, batch_size=64, timeout=0)
            times[name].append(clock() - t0)
            assert len(batch) == 64
            await resident.refill(64)
        if paced:  # 64 groups a round at SAMPLE_RATE groups/s; the loop sleeps between rounds
            await anyio.sleep(max(0.0, start + (round_ + 1) * 64 / SAMPLE_RATE - time.monotonic()))
        else:  # the journal's hand-offs run here, as in a live run
            await anyio.lowlevel.checkpoint()
    for resident in residents.values():
        await resident.buf.aclose()
    return times


def report_sample(regimes: dict[str, dict[str, list[int]]], quick: bool) -> bool:
    print("\n3. sample(batch_size=64) with 4,096 resident groups (ABBA, one call each per round)")
    for regime, times in regimes.items():
        print(f"  {regime}:")
        for name, values in times.items():
            us = [v / 1e3 for v in values]
            print(f"    {name:11s} p50 {statistics.median(us):6.1f} µs, mean {statistics.fmean(us):6.1f},"
                  f" p90 {_quantile(us, 0.9):6.1f}")  # fmt: skip
        extra = (statistics.median(times["journal"]) - statistics.median(times["no journal"])) / 1e3
        paired = statistics.median(j - b for j, b in zip(times["journal"], times["no journal"], strict=True))
        print(f"    p50 difference {extra:+.1f} µs (median of the paired differences {paired / 1e3:+.1f} µs)")
    times = regimes[JUDGED_SAMPLE_REGIME]
    extra = (statistics.median(times["journal"]) - statistics.median(times["no journal"])) / 1e3
    return _verdict(f"{JUDGED_SAMPLE_REGIME}: p50 difference {extra:+.1f} µs", extra <= SAMPLE_US,
                    f"<= +{SAMPLE_US:.0f} µs", quick)  # fmt: skip


def sample(sizes: Sizes, files: Files) -> dict[str, dict[str, list[int]]]:
    """Both regimes of the sample measurement (see the module's docstring)."""
    return {
        JUDGED_SAMPLE_REGIME: asyncio.run(_sample_rounds(sizes, files, paced=False)),
        "paced (a round every 25.6 ms)": asyncio.run(_sample_rounds(sizes, files, paced=True)),
    }


# -- 4. committing removals (reported, no target) -------------------------------------------------


async def _removal_commit(sizes: Sizes, path: str) -> float:
    """Seconds to sample every group of a committed buffer and commit that (``flush``)."""
    buf = new_buffer(path, journal_retention_steps=10**9)  # history kept: every removal is written
    group_payloads = payloads()
    for i in range(sizes.resident):
        await buf.put_group(f"g{i}", group_payloads, global_steps=0)
    await buf.flush()
    start = time.perf_counter()
    for step in range(1, sizes.resident // 64 + 1):
        await buf.sample(step, batch_size=64)
    await buf.flush()
    seconds = time.perf_counter() - start
    await buf.aclose()
    return seconds


def removals(sizes: Sizes, files: Files) -> None:
    """Time the commit of groups that leave after the journal wrote them (three runs)."""
    runs = [asyncio.run(_removal_commit(sizes, files.next())) for _ in range(3)]
    files.clear()
    print(f"\n4. sampling {sizes.resident:,} committed groups (8 x 4 KiB) and committing that, history kept:")
    print("  " + ", ".join(f"{seconds * 1e3:.0f} ms" for seconds in runs) + " (reported, no target)")


# -- driver --------------------------------------------------------------------------------------


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _verdict(figure: str, met: bool, target: str, quick: bool) -> bool:
    verdict = "not judged (--quick)" if quick else "PASS" if met else "FAIL"
    print(f"  {figure} (target {target}): {verdict}")
    return met or quick


def main(argv: list[str] | None = None) -> int:
    """Run the measurements, print them; exit 1 when a target is missed (never with --quick)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", default="producer,throughput,sample,removals")
    parser.add_argument("--rounds", type=int, default=None, help="producer ABBA rounds")
    parser.add_argument("--rate", type=float, default=1_500.0, help="paced producer, groups/s")
    parser.add_argument("--dir", default=None, help="where the journals go (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    only = set(args.only.split(","))
    root = tempfile.mkdtemp(prefix="stalebuf-journal-bench-", dir=args.dir)
    files = Files(root)
    load = os.getloadavg()
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; journals in {root}")  # fmt: skip
    met: list[bool] = []
    if "producer" in only:
        results = producer(sizes, args.rounds or sizes.producer_rounds, args.rate, files)
        met.append(report_producer(results, args.quick))
    if "throughput" in only:
        results = throughput(sizes, sizes.throughput_rounds, files)
        ceiling = disk_ceiling(sizes.throughput_groups // 4, root)
        met.append(report_throughput(results, ceiling, args.quick))
    if "sample" in only:
        met.append(report_sample(sample(sizes, files), args.quick))
    if "removals" in only:
        removals(sizes, files)
    shutil.rmtree(root)
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
