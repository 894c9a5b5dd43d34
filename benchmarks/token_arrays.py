"""Token arrays (groundwork for issue 22): ``freshness_mask`` against a bare ``np.repeat``.

The target: for 256 groups x 8 trajectories x 4,096 tokens in 16 segments each (32,768 runs of
256 tokens, 8,388,608 tokens), ``freshness_mask()`` costs at most 2x a bare ``np.repeat`` of
the same run lengths, measured side by side in one run. The judged baseline is the strictest
one: ``np.repeat`` of a bool array of the runs (the very call ``freshness_mask`` ends with, so
the ratio is the price of its O(runs) checks and comparison). ``np.repeat`` of the int64 run
versions (the core of ``token_versions``) is reported too, and ``pack_runs`` (building the
runs from per-trajectory segment tuples) as information.

Rounds are interleaved, the order alternating round by round (ABBA), so load from other
processes hits every measurement alike; medians are reported.

Usage: ``python benchmarks/token_arrays.py [--rounds N] [--quick]`` (``--quick``: tiny sizes,
a smoke run whose figures mean nothing).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from stalebuf._token_arrays import freshness_mask, pack_runs, token_versions

__all__ = [
    "FULL",
    "QUICK",
    "Shape",
    "Workload",
    "build",
    "info_calls",
    "interleaved_medians",
    "judged_calls",
    "main",
]


@dataclass(frozen=True)
class Shape:
    """How big the batch is."""

    groups: int
    per_group: int
    tokens: int  # per trajectory
    segments: int  # per trajectory; tokens must be a multiple of it

    @property
    def trajectories(self) -> int:
        return self.groups * self.per_group

    def describe(self) -> str:
        return (
            f"{self.groups} groups x {self.per_group} trajectories x {self.tokens:,} tokens in "
            f"{self.segments} segments ({self.trajectories * self.segments:,} runs, "
            f"{self.trajectories * self.tokens:,} tokens)"
        )


FULL = Shape(groups=256, per_group=8, tokens=4096, segments=16)
QUICK = Shape(groups=2, per_group=2, tokens=64, segments=4)

#: The trainer step sampled at and T*S: with versions spread over 0..63 about half the runs
#: are stale, so neither outcome of the comparison is trivial.
TARGET_VERSION = 64
SPAN = 32


@dataclass(frozen=True)
class Workload:
    """The segment tuples as ``put`` stores them, and the runs ``pack_runs`` made of them."""

    shape: Shape
    segments: list[tuple[tuple[int, int], ...]]
    run_versions: npt.NDArray[np.int64]
    run_lengths: npt.NDArray[np.int64]
    run_offsets: npt.NDArray[np.int64]
    fresh_runs: npt.NDArray[np.bool_]


def build(shape: Shape, seed: int = 0) -> Workload:
    """A batch of ``shape``: per trajectory, non-decreasing versions (in-flight weight updates)."""
    rng = np.random.default_rng(seed)
    length = shape.tokens // shape.segments
    starts = rng.integers(0, 48, size=shape.trajectories)
    steps = rng.integers(0, 2, size=(shape.trajectories, shape.segments)).cumsum(axis=1)
    versions = (starts[:, None] + steps).tolist()
    segments = [tuple((int(v), length) for v in row) for row in versions]
    n = shape.trajectories
    rv, rl, ro = pack_runs(segments, [shape.tokens] * n, [0] * n)
    return Workload(shape, segments, rv, rl, ro, rv >= TARGET_VERSION + 1 - SPAN)


BARE = "np.repeat(bool runs, run_lengths)"


def judged_calls(work: Workload) -> dict[str, Callable[[], Any]]:
    """The judged pair: the bare bool repeat (the baseline) and ``freshness_mask``."""
    return {
        BARE: lambda: np.repeat(work.fresh_runs, work.run_lengths),
        "freshness_mask()": lambda: freshness_mask(work.run_versions, work.run_lengths, TARGET_VERSION, SPAN),
    }


def info_calls(work: Workload) -> dict[str, Callable[[], Any]]:
    """The reported calls, with the bare bool repeat again as their reference.

    Timed in rounds of their own: the 64 MB int64 outputs evict the caches, which would
    otherwise favour whichever of the judged pair happens to run after the other.
    """
    n = work.shape.trajectories
    return {
        BARE: lambda: np.repeat(work.fresh_runs, work.run_lengths),
        "np.repeat(int64 run_versions, run_lengths)": lambda: np.repeat(work.run_versions, work.run_lengths),
        "token_versions()": lambda: token_versions(work.run_versions, work.run_lengths, work.run_offsets),
        "pack_runs() from segment tuples": lambda: pack_runs(work.segments, [work.shape.tokens] * n, [0] * n),
    }


def interleaved_medians(timed: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[int]]:
    """Time every call once per round, in alternating order (ABBA); the ns of each, by name."""
    names = list(timed)
    samples: dict[str, list[int]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names if index % 2 == 0 else reversed(names):
            call = timed[name]
            start = time.perf_counter_ns()
            result = call()
            samples[name].append(time.perf_counter_ns() - start)
            del result  # freed outside the timed region
    return samples


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def _header(shape: Shape, rounds: int) -> list[str]:
    return [
        f"workload: {shape.describe()}",
        f"rounds: {rounds}, interleaved (ABBA); medians",
        f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} cpus, "
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}",
        f"load average before (1/5/15 min): {_load()}",
    ]


def _rows(samples: dict[str, list[int]]) -> list[str]:
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return [
        f"  {name:<45} {value / 1e6:9.3f} ms  ({value / medians[BARE]:.2f}x bare bool repeat)"
        for name, value in medians.items()
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    work = build(shape)
    judged, info = judged_calls(work), info_calls(work)
    for call in [*judged.values(), *info.values()]:  # warm up: first-touch page faults, caches
        call()
    lines = _header(shape, args.rounds)
    samples = interleaved_medians(judged, args.rounds)
    lines += ["judged pair:", *_rows(samples)]
    mine, bare = samples["freshness_mask()"], samples[BARE]
    ratio = statistics.median(mine) / statistics.median(bare)
    per_round = statistics.median(m / b for m, b in zip(mine, bare, strict=True))
    verdict = "PASS" if ratio <= 2 else "FAIL"
    if args.quick:  # the O(runs) checks dominate a few hundred tokens: nothing to judge
        verdict = "not judged (--quick)"
    lines.append(f"freshness_mask / bare repeat: {ratio:.2f}x (median of per-round ratios {per_round:.2f}x)")
    lines.append(f"target <= 2x: {verdict}")
    lines += ["for information (rounds of their own):", *_rows(interleaved_medians(info, args.rounds))]
    lines.append(f"load average after (1/5/15 min): {_load()}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
