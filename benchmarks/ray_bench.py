"""Benchmark stalebuf.ray: cross-process wake-up latency and end-to-end groups/s.

Run: python benchmarks/ray_bench.py            (needs ``pip install 'stalebuf[ray]'``)
     python benchmarks/ray_bench.py --floor    (the same, side by side with Ray's own floor)

Starts a local Ray instance (``num_cpus=2``) and a RemoteReplayBuffer actor, then measures:

- wake-up latency: a trainer in this (driver) process is parked in ``sample``; a producer
  in another process (a Ray actor) makes the call that completes the batch (either
  ``mark_finished`` or one ``put_group``); latency is from just before that call, in the
  producer, to ``sample`` returning in the driver (both read CLOCK_MONOTONIC, which is
  system-wide on Linux). p50/p99 over ``--wakeups`` rounds.
- throughput: ``--producers`` producer processes (Ray actors), each running
  ``--concurrency`` rollout coroutines, upload groups of 8 trajectories x 512 int64 token
  ids with ``put_group`` (payloads in the object store, owned by the producer); the trainer
  in the driver samples batches of ``--batch-size`` and resolves their payloads (zero-copy
  numpy). Groups/s = groups sampled / wall time from the first upload to the last batch.

With ``--floor`` the same measurements also run, alternating run by run, against the floor: a
minimal Ray actor (:class:`FloorBuffer`) that receives the same payloads as one object per group
(``ray.put`` by the producer), the metadata batched 16 groups per actor call, and hands out
batches under an ``asyncio.Condition``; its wake-up is one group's ``ray.put`` plus its metadata
call. CPU time per group (all processes of this Ray session: the driver and its descendants) is
reported for both: on a machine with few cores, throughput is bounded by that CPU.

Prints a markdown table (and JSON with ``--json``). The machine's load average is printed
too: on a shared machine the numbers move with what else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.cloudpickle

from stalebuf import SamplerConfig
from stalebuf.ray import RemoteReplayBuffer, resolve

TRAJECTORIES = 8
TOKENS = 512
#: Groups per metadata call of the floor's producers.
FLOOR_BATCH = 16

# The producer actors run in Ray workers, which cannot import this script by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class Producer:
    """A rollout worker process: uploads finished groups to the buffer."""

    def __init__(self, buffer: RemoteReplayBuffer, prefix: str) -> None:
        self.buffer = buffer
        self.prefix = prefix
        self.pending: dict[str, int] = {}

    async def prepare(self, uid: str) -> None:
        """Add a group and its trajectories, leaving it RUNNING (for the mark_finished round)."""
        await self.buffer.add_prompt(uid, global_steps=0)
        await self.buffer.mark_running(uid)
        for session in range(TRAJECTORIES):
            await self.buffer.put(uid, np.arange(TOKENS, dtype=np.int64), session_id=session)

    async def finish(self, uid: str) -> float:
        """Mark the prepared group finished; return the clock reading just before the call."""
        started = time.perf_counter()
        await self.buffer.mark_finished(uid)
        return started

    async def upload(self, uid: str) -> float:
        """Upload a whole group with put_group; return the clock reading just before the call."""
        payloads = [np.arange(TOKENS, dtype=np.int64) + i for i in range(TRAJECTORIES)]
        started = time.perf_counter()
        await self.buffer.put_group(uid, payloads, global_steps=0)
        return started

    async def run(self, groups: int, concurrency: int) -> tuple[float, float]:
        """Upload ``groups`` groups from ``concurrency`` coroutines; return (first, last) clock."""
        counter = iter(range(groups))
        base = np.arange(TOKENS, dtype=np.int64)

        async def rollout() -> None:
            for i in counter:
                payloads = [base + (i * TRAJECTORIES + t) for t in range(TRAJECTORIES)]
                await self.buffer.put_group(f"{self.prefix}g{i}", payloads, global_steps=0)

        started = time.perf_counter()
        await asyncio.gather(*(rollout() for _ in range(concurrency)))
        return started, time.perf_counter()


@ray.remote(num_cpus=0)
class FloorBuffer:
    """Ray's floor for a replay buffer: (uid, object ref) pairs in a list, batches handed out
    under an ``asyncio.Condition``. No staleness, no lifecycle, no checks."""

    def __init__(self) -> None:
        self.groups: list[tuple[str, Any]] = []
        self.waiting = 0
        self.condition: asyncio.Condition | None = None  # made on the actor's event loop

    def _condition(self) -> asyncio.Condition:
        if self.condition is None:
            self.condition = asyncio.Condition()
        return self.condition

    async def put(self, metadata: list[tuple[str, Any]]) -> None:
        """Add finished groups: (uid, reference to the list of its payloads)."""
        condition = self._condition()
        async with condition:
            self.groups.extend(metadata)
            condition.notify_all()

    async def sample(self, batch_size: int) -> list[tuple[str, Any]]:
        """Wait for ``batch_size`` groups and return the oldest ones."""
        condition = self._condition()
        async with condition:
            self.waiting += 1
            try:
                await condition.wait_for(lambda: len(self.groups) >= batch_size)
            finally:
                self.waiting -= 1
            batch = self.groups[:batch_size]
            del self.groups[:batch_size]
        return batch

    async def parked(self) -> int:
        """How many ``sample`` calls wait."""
        return self.waiting


@ray.remote(num_cpus=0)
class FloorProducer:
    """A rollout worker process for the floor: one ``ray.put`` per group, metadata in batches."""

    def __init__(self, buffer: Any, prefix: str) -> None:
        self.buffer = buffer
        self.prefix = prefix

    async def upload(self, uid: str) -> float:
        """Store one group and send its metadata alone; return the clock reading before it."""
        payloads = [np.arange(TOKENS, dtype=np.int64) + i for i in range(TRAJECTORIES)]
        started = time.perf_counter()
        await self.buffer.put.remote([(uid, ray.put(payloads))])
        return started

    async def run(self, groups: int) -> tuple[float, float]:
        """Store ``groups`` groups, sending metadata every FLOOR_BATCH; return (first, last) clock."""
        base = np.arange(TOKENS, dtype=np.int64)
        started = time.perf_counter()
        pending: list[tuple[str, Any]] = []
        for i in range(groups):
            payloads = [base + (i * TRAJECTORIES + t) for t in range(TRAJECTORIES)]
            pending.append((f"{self.prefix}g{i}", ray.put(payloads)))
            if len(pending) == FLOOR_BATCH or i == groups - 1:
                await self.buffer.put.remote(pending)
                pending = []
        return started, time.perf_counter()


def session_cpu_seconds() -> float:
    """CPU seconds used so far by this process and its descendants (Ray's processes of this
    session: GCS, raylet, workers), read from /proc; 0.0 where /proc is not available."""
    try:
        stats = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                # after the command: state ppid ... utime (12th) stime (13th), in clock ticks
                stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    except OSError:
        return 0.0
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        todo.extend(children.get(pid, ()))
    return total / os.sysconf("SC_CLK_TCK")


async def _park_and_wait(buffer: RemoteReplayBuffer) -> None:
    while True:  # the parked call lives in the actor: poll its stats until it is there
        if (await buffer.stats()).total.waiting_samplers == 1:
            return
        await asyncio.sleep(0.001)


async def wakeup_latency(buffer: RemoteReplayBuffer, producer: Any, rounds: int, mode: str) -> list[float]:
    """Return ``rounds`` wake-up latencies (seconds) for ``mode`` "mark_finished" or "put_group"."""
    latencies = []
    for i in range(rounds + 5):  # the first 5 warm up
        uid = f"w{mode[0]}{i}"
        if mode == "mark_finished":
            await producer.prepare.remote(uid)
        sampler = asyncio.ensure_future(buffer.sample(0, 1, timeout=60))
        await _park_and_wait(buffer)
        call = producer.finish.remote(uid) if mode == "mark_finished" else producer.upload.remote(uid)
        batch, _ = await sampler
        woke = time.perf_counter()
        started = await call
        assert batch.uids == [uid]
        if i >= 5:
            latencies.append(woke - started)
    return latencies


async def throughput(
    buffer: RemoteReplayBuffer, producers: list[Any], groups: int, concurrency: int, batch_size: int
) -> dict[str, float]:
    """Run the producers against a trainer loop; return groups/s and friends."""
    total = groups * len(producers)
    runs = [p.run.remote(groups, concurrency) for p in producers]
    taken = 0
    tokens = 0
    while taken < total:
        batch, _ = await buffer.sample(0, min(batch_size, total - taken), timeout=120)
        resolved = await resolve(batch)
        tokens += sum(len(p) for p in resolved.payloads)
        taken += len(batch)
    done = time.perf_counter()
    spans = await asyncio.gather(*runs)
    first = min(start for start, _ in spans)
    produced = max(end for _, end in spans)
    assert tokens == total * TRAJECTORIES * TOKENS
    return {
        "groups": float(total),
        "seconds": done - first,
        "groups_per_s": total / (done - first),
        "producer_groups_per_s": total / (produced - first),
    }


async def _floor_parked(floor: Any) -> None:
    while True:  # as _park_and_wait: poll the actor until the sample waits there
        if await floor.parked.remote() == 1:
            return
        await asyncio.sleep(0.001)


async def floor_wakeup_latency(floor: Any, producer: Any, rounds: int) -> list[float]:
    """Return ``rounds`` wake-up latencies (seconds) of the floor: one group stored and its
    metadata sent by a producer process -> the driver's parked ``sample`` returns."""
    latencies = []
    for i in range(rounds + 5):  # the first 5 warm up
        uid = f"fw{i}"
        sampler = floor.sample.remote(1)
        await _floor_parked(floor)
        call = producer.upload.remote(uid)
        batch = await sampler
        woke = time.perf_counter()
        started = await call
        assert [u for u, _ in batch] == [uid]
        if i >= 5:
            latencies.append(woke - started)
    return latencies


async def floor_throughput(
    floor: Any, producers: list[Any], groups: int, batch_size: int
) -> dict[str, float]:
    """:func:`throughput` on the floor: the same producers' work, trainer and resolving."""
    total = groups * len(producers)
    runs = [p.run.remote(groups) for p in producers]
    taken = 0
    tokens = 0
    while taken < total:
        batch = await floor.sample.remote(min(batch_size, total - taken))
        values = await asyncio.gather(*(ref for _, ref in batch))
        tokens += sum(len(payload) for payloads in values for payload in payloads)
        taken += len(batch)
    done = time.perf_counter()
    spans = await asyncio.gather(*runs)
    first = min(start for start, _ in spans)
    produced = max(end for _, end in spans)
    assert tokens == total * TRAJECTORIES * TOKENS
    return {
        "groups": float(total),
        "seconds": done - first,
        "groups_per_s": total / (done - first),
        "producer_groups_per_s": total / (produced - first),
    }


async def _measured(run: Any) -> dict[str, float]:
    """Await one throughput run and add the CPU milliseconds per group it used."""
    cpu = session_cpu_seconds()
    result: dict[str, float] = await run
    result["cpu_ms_per_group"] = (session_cpu_seconds() - cpu) * 1e3 / result["groups"]
    return result


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _latency(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": _percentile(values, 50) * 1e3,
        "p99_ms": _percentile(values, 99) * 1e3,
        "mean_ms": statistics.fmean(values) * 1e3,
        "rounds": len(values),
    }


async def _floor_setup(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    floor = FloorBuffer.options(max_concurrency=1000).remote()
    producers = [FloorProducer.remote(floor, f"f{i}x") for i in range(args.producers)]
    await asyncio.gather(*(p.upload.remote(f"fwarm{i}") for i, p in enumerate(producers)))
    await floor.sample.remote(len(producers))
    return floor, producers


async def main(args: argparse.Namespace) -> dict[str, Any]:
    config = SamplerConfig(max_off_policy_threshold=1_000_000)
    buffer = RemoteReplayBuffer(config, payloads=args.payloads, status_log_interval=None)
    producers = [Producer.remote(buffer, f"p{i}x") for i in range(args.producers)]
    await asyncio.gather(*(p.upload.remote(f"warm{i}") for i, p in enumerate(producers)))
    await buffer.sample(0, len(producers), timeout=60)
    floor, floor_producers = await _floor_setup(args) if args.floor else (None, [])
    results: dict[str, Any] = {"payloads": args.payloads, "loadavg_before": os.getloadavg()}
    for mode in ("mark_finished", "put_group"):
        results[f"wakeup_{mode}"] = _latency(await wakeup_latency(buffer, producers[0], args.wakeups, mode))
    if floor is not None:
        results["floor_wakeup"] = _latency(
            await floor_wakeup_latency(floor, floor_producers[0], args.wakeups)
        )
    runs, floor_runs = [], []
    for _ in range(args.repeats):  # alternating, so that load from other jobs hits both alike
        runs.append(
            await _measured(throughput(buffer, producers, args.groups, args.concurrency, args.batch_size))
        )
        if floor is not None:
            floor_runs.append(
                await _measured(floor_throughput(floor, floor_producers, args.groups, args.batch_size))
            )
    results["throughput_runs"] = runs
    results["throughput"] = max(runs, key=lambda run: run["groups_per_s"])
    if floor_runs:
        results["floor_throughput_runs"] = floor_runs
        results["floor_throughput"] = max(floor_runs, key=lambda run: run["groups_per_s"])
    results["loadavg_after"] = os.getloadavg()
    stats = await buffer.stats()
    assert stats.total.groups == 0
    assert stats.total.admitted_groups == stats.total.sampled_groups
    buffer.kill()
    return results


def _runs(runs: list[dict[str, float]]) -> str:
    rates = ", ".join(f"{run['groups_per_s']:,.0f}" for run in runs)
    cpu = ", ".join(f"{run['cpu_ms_per_group']:.2f}" for run in runs)
    return f"best of {len(runs)}: {rates}; CPU ms per group {cpu}"


def _floor_rows(results: dict[str, Any]) -> list[str]:
    """The floor's rows and the ratios the issue's targets are stated in."""
    if "floor_throughput" not in results:
        return []
    fw, ft, tp = results["floor_wakeup"], results["floor_throughput"], results["throughput"]
    pg = results["wakeup_put_group"]
    rate = tp["groups_per_s"] / ft["groups_per_s"]
    return [
        f"| floor: wake-up, producer `ray.put` + metadata call -> driver `sample` returns | p50 "
        f"{fw['p50_ms']:.2f} ms, p99 {fw['p99_ms']:.2f} ms ({fw['rounds']} rounds) |",
        f"| floor: end-to-end throughput (same producers' work, sample, resolve) | {ft['groups_per_s']:,.0f} "
        f"groups/s ({_runs(results['floor_throughput_runs'])}) |",
        f"| stalebuf / floor, groups/s (best runs; target >= 1.0) | {rate:.2f}x |",
        f"| stalebuf / floor, wake-up p50 (put_group; target <= 2) | {pg['p50_ms'] / fw['p50_ms']:.2f}x |",
    ]


def _table(results: dict[str, Any], args: argparse.Namespace) -> str:
    mf, pg, tp = results["wakeup_mark_finished"], results["wakeup_put_group"], results["throughput"]
    return "\n".join(
        [
            f"stalebuf.ray, payloads={results['payloads']!r}, {args.producers} producer processes x "
            f"{args.concurrency} coroutines, groups of {TRAJECTORIES} x {TOKENS} int64, "
            f"batch {args.batch_size}; "
            f"{os.cpu_count()} cores; load average {results['loadavg_before'][0]:.2f} before, "
            f"{results['loadavg_after'][0]:.2f} after",
            "",
            "| measure | result |",
            "| --- | --- |",
            f"| wake-up, producer `mark_finished` -> driver `sample` returns | p50 {mf['p50_ms']:.2f} ms, "
            f"p99 {mf['p99_ms']:.2f} ms ({mf['rounds']} rounds) |",
            f"| wake-up, producer `put_group` -> driver `sample` returns | p50 {pg['p50_ms']:.2f} ms, "
            f"p99 {pg['p99_ms']:.2f} ms ({pg['rounds']} rounds) |",
            f"| end-to-end throughput (upload, sample, resolve) | {tp['groups_per_s']:,.0f} groups/s "
            f"({_runs(results['throughput_runs'])}) |",
            f"| producer-side rate in that run | {tp['producer_groups_per_s']:,.0f} groups/s |",
            *_floor_rows(results),
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16, help="rollout coroutines per producer")
    parser.add_argument("--groups", type=int, default=2500, help="groups per producer per run")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--wakeups", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs (best is reported)")
    parser.add_argument("--payloads", choices=("producer", "actor", "inline"), default="producer")
    parser.add_argument("--floor", action="store_true", help="also measure Ray's floor, alternating")
    parser.add_argument("--json", action="store_true", help="also print the raw results as JSON")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        outcome = asyncio.run(main(arguments))
    finally:
        ray.shutdown()
    print(_table(outcome, arguments))
    if arguments.json:
        print(json.dumps(outcome, indent=2))
