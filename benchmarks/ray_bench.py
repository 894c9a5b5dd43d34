"""Benchmark stalebuf.ray: cross-process wake-up latency and end-to-end groups/s.

Run: python benchmarks/ray_bench.py            (needs ``pip install 'stalebuf[ray]'``)

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
from typing import Any

import numpy as np
import ray
import ray.cloudpickle

from stalebuf import SamplerConfig
from stalebuf.ray import RemoteReplayBuffer, resolve

TRAJECTORIES = 8
TOKENS = 512

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


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    config = SamplerConfig(max_off_policy_threshold=1_000_000)
    buffer = RemoteReplayBuffer(config, payloads=args.payloads, status_log_interval=None)
    producers = [Producer.remote(buffer, f"p{i}x") for i in range(args.producers)]
    await asyncio.gather(*(p.upload.remote(f"warm{i}") for i, p in enumerate(producers)))
    await buffer.sample(0, len(producers), timeout=60)
    results: dict[str, Any] = {"payloads": args.payloads, "loadavg_before": os.getloadavg()}
    for mode in ("mark_finished", "put_group"):
        lat = await wakeup_latency(buffer, producers[0], args.wakeups, mode)
        results[f"wakeup_{mode}"] = {
            "p50_ms": _percentile(lat, 50) * 1e3,
            "p99_ms": _percentile(lat, 99) * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3,
            "rounds": len(lat),
        }
    runs = [
        await throughput(buffer, producers, args.groups, args.concurrency, args.batch_size)
        for _ in range(args.repeats)
    ]
    results["throughput_runs"] = runs
    results["throughput"] = max(runs, key=lambda run: run["groups_per_s"])
    results["loadavg_after"] = os.getloadavg()
    stats = await buffer.stats()
    assert stats.total.groups == 0
    assert stats.total.admitted_groups == stats.total.sampled_groups
    buffer.kill()
    return results


def _table(results: dict[str, Any], args: argparse.Namespace) -> str:
    mf, pg, tp = results["wakeup_mark_finished"], results["wakeup_put_group"], results["throughput"]
    runs = ", ".join(f"{run['groups_per_s']:,.0f}" for run in results["throughput_runs"])
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
            f"(best of {len(results['throughput_runs'])}: {runs}) |",
            f"| producer-side rate in that run | {tp['producer_groups_per_s']:,.0f} groups/s |",
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
