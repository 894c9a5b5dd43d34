"""Token batches (issue 24): ``sample(token_budget=K)`` side by side with ``sample(batch_size=k)``.

Target: with 1e6 resident groups, a sample by tokens costs <= 1.5x a sample by count that
returns the same k groups. One buffer holds N finished groups of ``TRAJECTORIES`` trajectories
whose token counts repeat a pattern of period k (heavy-tailed: 20..4,000 tokens), so every k
consecutive groups hold exactly ``K`` tokens: ``sample(token_budget=K)`` returns k groups, as
``sample(batch_size=k)`` does. Rounds interleave the two calls on the same buffer (each
followed by a refill of k groups, untimed), so both see the same N and the same layout; the
calls are driven without an event loop (a batch is ready: ``sample`` never suspends). It
prints each median and the ratio.

Usage: ``python benchmarks/token_batches.py [--n 1000000] [--k 256] [--rounds 101]``
(``--quick`` for a smoke run). Memory: about 0.5 GB at N = 1e6 with 2 trajectories a group.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass

from stalebuf import ReplayBuffer, SamplerConfig
from workloads import BIG_THRESHOLD, PER_STEP, drive

TRAJECTORIES = 2
TARGET = 1.5


@dataclass
class TokenResident:
    """A buffer of ``n`` finished groups with tokens, refilled to ``n`` after every sample."""

    n: int
    k: int
    buf: ReplayBuffer
    pattern: list[list[int]]  # the trajectories' tokens of the groups, by index modulo k
    added: int = 0
    top: int = 0

    @classmethod
    def build(cls, n: int, k: int, seed: int = 0) -> TokenResident:
        rng = random.Random(seed)
        pattern = [
            [min(4000, int(20 * rng.paretovariate(1.2))) for _ in range(TRAJECTORIES)] for _ in range(k)
        ]
        resident = cls(n, k, ReplayBuffer(SamplerConfig(max_off_policy_threshold=BIG_THRESHOLD)), pattern)
        gc.disable()
        try:
            resident.refill(n)
        finally:
            gc.enable()
        gc.freeze()  # the resident groups never change: keep the collector off them
        return resident

    @property
    def budget(self) -> int:
        """The tokens of any k consecutive groups."""
        return sum(map(sum, self.pattern))

    @property
    def global_steps(self) -> int:
        return self.top + 1

    def refill(self, count: int) -> None:
        put = self.buf.put_group_nowait
        payloads = [None] * TRAJECTORIES
        for _ in range(count):
            self.top = self.added // PER_STEP
            put(f"g{self.added}", payloads, global_steps=self.top, tokens=self.pattern[self.added % self.k])
            self.added += 1


def measure(n: int, k: int, rounds: int) -> tuple[float, float]:
    """Median seconds of ``sample(token_budget=K)`` and of ``sample(batch_size=k)``."""
    resident = TokenResident.build(n, k)
    buf, budget = resident.buf, resident.budget
    by_tokens: list[int] = []
    by_count: list[int] = []
    for _ in range(rounds):
        for times, kwargs in ((by_tokens, {"token_budget": budget}), (by_count, {"batch_size": k})):
            g = resident.global_steps
            start = time.perf_counter_ns()
            batch, _ = drive(buf.sample(g, **kwargs))
            times.append(time.perf_counter_ns() - start)
            assert len(batch) == k, (kwargs, len(batch))
            resident.refill(k)
    gc.unfreeze()
    return statistics.median(by_tokens) / 1e9, statistics.median(by_count) / 1e9


def main(argv: list[str] | None = None) -> int:
    """Print both medians and their ratio; exit 1 if the ratio is over the target."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=101)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    args = parser.parse_args(argv)
    n, rounds = (2_000, 5) if args.quick else (args.n, args.rounds)
    tokens, count = measure(n, args.k, rounds)
    ratio = tokens / count
    print(
        f"N={n:,} resident groups x {TRAJECTORIES} trajectories, k={args.k} groups a batch, {rounds} rounds"
    )
    print(f"sample(token_budget=K): {tokens * 1e6:9.1f} us (median)")
    print(f"sample(batch_size=k):   {count * 1e6:9.1f} us (median)")
    print(f"ratio: {ratio:.2f}x (target <= {TARGET}x): {'ok' if ratio <= TARGET else 'OVER'}")
    return 0 if ratio <= TARGET or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
