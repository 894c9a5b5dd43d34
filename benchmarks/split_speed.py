"""``Batch.split(8, cost="quadratic")`` of a 1,024-group batch (issue 24): the standalone loop.

The target: a split of ``test_split_speed.build(1024)`` (1,024 groups of 8 trajectories with
heavy-tailed token counts) into 8 parts takes <= 1 ms, the median of a standalone loop of 200
calls (after 20 untimed ones). Each round runs that loop in a fresh subprocess per side; with
``--base REV`` the base's ``src/`` (exported by ``git archive`` into a temporary directory) and
this tree's alternate, the order flipping round by round (ABBA), so load from other processes
hits both alike. Both sides build the batch with this tree's ``test_split_speed.build`` (public
API only). Per side: the median over the rounds of each round's median (the verdict), the best
round's median and the fastest call; with a base, head/base of the medians of each round
(paired: the two ran back to back).

Usage: ``python benchmarks/split_speed.py [--rounds 9] [--base REV]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GROUPS, PARTS, CALLS, WARMUP = 1_024, 8, 200, 20
TARGET_MS = 1.0


def loop() -> dict[str, float]:
    """The standalone loop in this process: median and min of ``CALLS`` calls, in ms."""
    from test_split_speed import build

    batch = build(GROUPS)
    for _ in range(WARMUP):
        batch.split(PARTS, cost="quadratic")
    times = []
    clock = time.perf_counter_ns
    for _ in range(CALLS):
        start = clock()
        batch.split(PARTS, cost="quadratic")
        times.append(clock() - start)
    return {"median": statistics.median(times) / 1e6, "min": min(times) / 1e6}


def _run(src: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{HERE}"}
    code = "import json, split_speed; print(json.dumps(split_speed.loop()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(out.stdout)
    return result


def _export(rev: str, into: Path) -> Path:
    """``rev``'s ``src/`` under ``into`` (a plain export, no worktree)."""
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, check=True, capture_output=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+: git's own archive, still checked
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    return into / "src"


def main(argv: list[str] | None = None) -> int:
    """Run the loops and print them; exit 1 when the head misses the target."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--base", help="a revision to run side by side (default: none)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="split_speed_") as tmp:
        sides = {"head": ROOT / "src"}
        if args.base:
            sides = {"base": _export(args.base, Path(tmp)), **sides}
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        names = list(sides)
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else reversed(names):
                rounds[name].append(_run(sides[name]))
    head_line = f"split({PARTS}, cost='quadratic') of {GROUPS:,} groups x 8: {CALLS} calls per loop"
    print(f"{head_line}, {args.rounds} rounds")
    for name, results in rounds.items():
        medians = [result["median"] for result in results]
        print(
            f"  {name:4s} median of medians {statistics.median(medians):.3f} ms, best round "
            f"{min(medians):.3f} ms, fastest call {min(r['min'] for r in results):.3f} ms"
        )
    if args.base:
        ratios = [h["median"] / b["median"] for h, b in zip(rounds["head"], rounds["base"], strict=True)]
        print(f"  head/base of each round's medians: median {statistics.median(ratios):.3f}")
    head = statistics.median(result["median"] for result in rounds["head"])
    verdict = "PASS" if head <= TARGET_MS else "FAIL"
    print(f"head: {head:.3f} ms (target <= {TARGET_MS} ms): {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
