"""Token admission (issue 24) against group admission on the producer path, side by side.

The target: token admission (``admission_token_budget`` with ``max_tokens_per_group``) adds at
most 0.3 µs per group over group admission (``admission_batch_size``) on the producer path. One
group's path is what a producer does: ``add_prompt_nowait`` (clock-tagged), ``mark_running``,
``TRAJECTORIES`` calls of ``put_nowait(..., tokens=)`` and ``mark_finished_nowait``; a round
times ``GROUPS`` groups on a fresh buffer whose caps never bind (so every call takes the
admitted path: the reservation, the per-put bound, the settlement). The same path with
``max_resident_tokens`` as well is reported for information.

Rounds are interleaved, the order alternating round by round (ABBA), so load from other
processes hits every measurement alike; per group, the medians and minima are reported, and the
verdict is on the median of the paired differences (each round's variants ran back to back).
Time is the thread's CPU time (``time.thread_time``): on a machine shared with other work, the
time the thread waits descheduled is not counted.

Usage: ``python benchmarks/token_admission.py [--rounds N] [--quick]`` (``--quick``: tiny sizes,
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

from stalebuf import ReplayBuffer, SamplerConfig

__all__ = ["GROUPS", "QUICK_GROUPS", "TARGET_US", "TRAJECTORIES", "VARIANTS", "produce", "run_round"]

GROUPS, QUICK_GROUPS = 1_024, 64
TRAJECTORIES = 4
TOKENS = 100  # per trajectory
TARGET_US = 0.3

#: name -> the config of a buffer whose caps never bind for ``groups`` groups.
VARIANTS: dict[str, Callable[[int], SamplerConfig]] = {
    "group admission": lambda groups: SamplerConfig(admission_batch_size=groups),
    "token admission": lambda groups: SamplerConfig(
        admission_token_budget=groups * TRAJECTORIES * TOKENS, max_tokens_per_group=TRAJECTORIES * TOKENS
    ),
    "token admission + residency cap": lambda groups: SamplerConfig(
        admission_token_budget=groups * TRAJECTORIES * TOKENS,
        max_tokens_per_group=TRAJECTORIES * TOKENS,
        max_resident_tokens=groups * TRAJECTORIES * TOKENS,
    ),
}


def produce(buf: ReplayBuffer, uids: list[str]) -> None:
    """Every group's producer path, one group after the other."""
    for uid in uids:
        buf.add_prompt_nowait(uid)
        buf.mark_running_nowait(uid)
        for session in range(TRAJECTORIES):
            buf.put_nowait(uid, None, session_id=session, tokens=TOKENS)
        buf.mark_finished_nowait(uid)


def run_round(name: str, groups: int) -> float:
    """Seconds per group of one round of variant ``name`` (the buffer is built untimed)."""
    buf = ReplayBuffer(VARIANTS[name](groups), status_log_interval=None)
    uids = [f"g{i}" for i in range(groups)]
    start = time.thread_time()
    produce(buf, uids)
    seconds = (time.thread_time() - start) / groups
    assert buf.stats().total.finished == groups
    return seconds


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print it; exit 1 when the target is missed (never with --quick)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    args = parser.parse_args(argv)
    groups = QUICK_GROUPS if args.quick else GROUPS
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            times[name].append(run_round(name, groups))
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{groups} groups x {TRAJECTORIES} trajectories x {TOKENS} tokens, {args.rounds} rounds (ABBA)")
    base = times["group admission"]
    for name, values in times.items():
        # Paired: each round's variants ran back to back, so their difference cancels slow drift.
        paired = statistics.median(value - other for value, other in zip(values, base, strict=True)) * 1e6
        print(
            f"  {name:34s} median {statistics.median(values) * 1e6:7.3f} µs/group, "
            f"min {min(values) * 1e6:7.3f}; paired difference {paired:+.3f} µs"
        )
    extra = (
        statistics.median(value - other for value, other in zip(times["token admission"], base, strict=True))
        * 1e6
    )
    verdict = "not judged (--quick)" if args.quick else "PASS" if extra <= TARGET_US else "FAIL"
    print(f"token admission adds {extra:+.3f} µs/group (target <= {TARGET_US} µs): {verdict}")
    return 1 if verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
