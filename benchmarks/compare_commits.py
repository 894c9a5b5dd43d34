"""P1 (wake-up) and P2 (producer path, ``put_group``) of two commits, side by side in one run.

Usage::

    python benchmarks/compare_commits.py                  # f169765 vs this working tree, 5 rounds
    python benchmarks/compare_commits.py --base REV --head HEAD --rounds 9 --json out.json

The base (``--base``, default ``f169765``, the main before the architecture round 2 of issue
20) is checked out with ``git worktree add --detach`` into a temporary directory, or an
existing clean detached worktree of that commit is reused; a worktree this script created is
removed at the end unless ``--keep``. The head is this working tree (its ``src/``, uncommitted
changes included: the header says so), or with ``--head REV`` a worktree of ``REV``.

Each round runs, for P1 and then for P2, one fresh subprocess per side, base and head
alternating which goes first from round to round. A subprocess gets ``PYTHONPATH=<tree>/src``
plus *this* tree's ``benchmarks/``, so both versions are measured by the same code, which uses
the public API of stalebuf only; it checks that ``stalebuf`` was imported from the tree it was
given. Each takes a few seconds:

- P1: ``p1_wakeup.p1_side_by_side`` on asyncio at B=1, 8 and 64: the wake-up latency of a
  parked ``sample`` and of a bare ``asyncio.Event``, alternated rep by rep; per round the
  median of each and the ratio of the medians (the P1 target's own measure, judged here).
- P2: ns per ``put_group_nowait`` of a new finished group of 8 (the loop of
  ``p2_producer.put_group_cost``: admission control off and on, GC paused; every group at
  step 0, the clock, as a step ahead of it is refused under admission control), the ``put_group``
  pipeline per group (``workloads.pipeline_stalebuf(groups, put_group=True)``) and the 11-call
  pipeline per group; each next to a control that runs no stalebuf code, timed in turn with it
  in the same subprocess: a plain-Python ``put_group`` (a dict entry, a per-step count and 8
  keys per group) for ``put_group_nowait``, ``asyncio.Queue`` put+get of 8 items per group for
  the pipelines (P2's own baseline).

P2 is timed on two clocks: wall time (``perf_counter_ns``, as ``p2_producer`` reports it) and
the thread's CPU time (``thread_time_ns``). Nothing in P2 sleeps, so the two agree on an idle
machine; with more runnable jobs than cores, wall time also counts the time the process waited
for a core. Even CPU time moves by tens of percent from one subprocess to the next when other
jobs share the cores (the controls show it: same code on both sides, yet head/base far from 1);
the ratio to the control measured alongside (median of the ratios within the subprocess)
cancels most of that, as P1's ratio to a bare Event does. So the verdicts are on the ratios
(P1: stalebuf / bare Event; P2: CPU time / its control), and the absolute times are shown as
"info" (µs, CPU time and wall time) next to their controls.

The table gives per metric the median over the rounds of each side, head/base of those
medians and the verdict (head/base <= 1.10); then two readings less sensitive to other jobs
on the machine: the median over the rounds of head/base within the round (the two sides of a
round run back to back), and head/base of the best round of each side. Exit status 0 unless
``--strict`` and a judged metric is over 1.10.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_BASE = "f169765"
LIMIT = 1.10
#: P1 batch sizes and reps per subprocess (each rep: one stalebuf and one bare wake-up).
P1_REPS = {1: 2000, 8: 2000, 64: 500}
#: P2 groups per timed call, and timed calls per metric per subprocess.
P2_GROUPS = 2048
P2_REPEATS = 25
P2_PIPELINE_REPEATS = 11
#: Seconds before a subprocess is considered stuck.
CHILD_TIMEOUT = 300.0


@dataclass(frozen=True)
class Metric:
    """One row of the table: ``kind`` is "judged", "info" or "control" (no stalebuf code)."""

    key: str
    label: str
    unit: str  # "µs" (values are stored in ns) or "x" (a ratio)
    kind: str


def _metrics() -> list[Metric]:
    rows: list[Metric] = []
    for b in P1_REPS:
        rows.append(
            Metric(f"p1_b{b}_ratio", f"P1 B={b}: stalebuf / bare asyncio.Event, median", "x", "judged")
        )
        rows.append(Metric(f"p1_b{b}_stalebuf", f"P1 B={b}: stalebuf wake-up, median", "µs", "info"))
        rows.append(Metric(f"p1_b{b}_bare", f"P1 B={b}: bare asyncio.Event wake-up, median", "µs", "control"))
    p2 = [  # (key, label, kind of its absolute rows): stalebuf is judged on the ratios below
        ("p2_put_group_off", "P2 put_group_nowait, new group of 8", "info"),
        ("p2_put_group_on", "P2 put_group_nowait, admission control on", "info"),
        ("p2_reference", "plain-Python put_group (control), per group", "control"),
        ("p2_pipeline_put_group", "P2 put_group pipeline, per group", "info"),
        ("p2_pipeline_calls", "P2 11-call pipeline, per group", "info"),
        ("p2_queue", "asyncio.Queue put+get x 8 (control), per group", "control"),
    ]
    rows += [Metric(f"{key}_cpu", f"{label} (CPU time)", "µs", kind) for key, label, kind in p2]
    rows += [
        Metric("p2_put_group_off_per_reference", "P2 put_group_nowait / plain-Python control", "x", "judged"),
        Metric(
            "p2_put_group_on_per_reference",
            "P2 put_group_nowait, admission on / plain-Python control",
            "x",
            "judged",
        ),
        Metric("p2_pipeline_put_group_per_queue", "P2 put_group pipeline / Queue control", "x", "judged"),
        Metric("p2_pipeline_calls_per_queue", "P2 11-call pipeline / Queue control", "x", "judged"),
    ]
    rows += [Metric(f"{key}_wall", f"{label} (wall time)", "µs", kind) for key, label, kind in p2]
    return rows


# -- the measuring side (a subprocess per part, side and round) -------------------------------


def _check_import(src: Path) -> str:
    """Import stalebuf and fail unless it came from ``src``; return its file."""
    import stalebuf

    where = Path(stalebuf.__file__ or "").resolve()
    if not where.is_relative_to(src.resolve()):
        raise SystemExit(f"stalebuf imported from {where}, not from {src}: check PYTHONPATH")
    return str(where)


def measure_p1() -> dict[str, float]:
    """P1 on asyncio at each batch size of ``P1_REPS``: medians in ns and their ratio."""
    import asyncio

    import anyio

    from p1_wakeup import p1_side_by_side

    out: dict[str, float] = {}
    for b, reps in P1_REPS.items():
        buf_lat, bare_lat = anyio.run(p1_side_by_side, asyncio.Event, reps, b, backend="asyncio")
        mine, bare = statistics.median(buf_lat), statistics.median(bare_lat)
        out[f"p1_b{b}_stalebuf"] = mine
        out[f"p1_b{b}_bare"] = bare
        out[f"p1_b{b}_ratio"] = mine / bare
    return out


def _put_group_cost(groups: int, config: Any) -> tuple[int, int]:
    """(wall ns, CPU ns) of ``groups`` ``put_group_nowait`` calls of a new finished group of 8
    on a fresh buffer, GC paused: the loop of ``p2_producer.put_group_cost``, timed on both
    clocks, except that every group is dispatched at step 0, the dispatch clock of a fresh
    buffer. (Under admission control a step ahead of the clock is refused since 80552c3, and
    only a ``sample`` moves the clock; see :func:`_configs` for the cap.)"""
    from stalebuf import ReplayBuffer
    from workloads import TRAJECTORIES_PER_GROUP

    buf = ReplayBuffer(config)
    uids = [f"g{i}" for i in range(groups)]
    payloads = [None] * TRAJECTORIES_PER_GROUP
    put_group = buf.put_group_nowait
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        for uid in uids:
            put_group(uid, payloads, global_steps=0)
        wall, cpu = time.perf_counter_ns() - wall, time.thread_time_ns() - cpu
    finally:
        if was_enabled:
            gc.enable()
    return wall, cpu


def _configs() -> tuple[Any, Any]:
    """(admission control off, on) for :func:`_put_group_cost`: a drop threshold no group
    reaches, and with admission on a per-step cap of ``P2_GROUPS``, so that every call is
    admitted and what is timed is the bookkeeping, never a refusal."""
    from stalebuf import SamplerConfig
    from workloads import BIG_THRESHOLD

    return (
        SamplerConfig(max_off_policy_threshold=BIG_THRESHOLD),
        SamplerConfig(max_off_policy_threshold=BIG_THRESHOLD, admission_batch_size=P2_GROUPS),
    )


async def _timed(run: Awaitable[int]) -> tuple[int, int]:
    """(wall ns as the workload measures it, CPU ns of this thread around it)."""
    cpu = time.thread_time_ns()
    wall = await run
    return wall, time.thread_time_ns() - cpu


async def _pipelines(groups: int, repeats: int) -> dict[str, list[float]]:
    """The two stalebuf pipelines and the queue control, alternated; ns per group, both clocks."""
    from workloads import TRAJECTORIES_PER_GROUP, pipeline_stalebuf, queue_pipeline

    runs: dict[str, list[float]] = {}
    for repeat in range(repeats + 1):  # the first is a warm-up
        timings = {
            "p2_pipeline_put_group": await _timed(pipeline_stalebuf(groups, put_group=True)),
            "p2_pipeline_calls": await _timed(pipeline_stalebuf(groups)),
            "p2_queue": await _timed(queue_pipeline(groups * TRAJECTORIES_PER_GROUP)),
        }
        if repeat:
            for name, (wall, cpu) in timings.items():
                runs.setdefault(f"{name}_wall", []).append(wall / groups)
                runs.setdefault(f"{name}_cpu", []).append(cpu / groups)
            queue = timings["p2_queue"][1]
            for name in ("p2_pipeline_put_group", "p2_pipeline_calls"):
                runs.setdefault(f"{name}_per_queue", []).append(timings[name][1] / queue)
    return runs


def _reference_cost(groups: int) -> tuple[int, int]:
    """(wall ns, CPU ns) of a plain-Python ``put_group`` of ``groups`` new groups of 8, no
    stalebuf code: per group a record tuple in a dict, a per-step count and 8 keys. Timed next
    to ``put_group_nowait`` in the same subprocess, it tracks how fast the machine runs Python
    at that moment, so put_group_nowait / this is steadier than either alone."""
    from workloads import TRAJECTORIES_PER_GROUP

    groups_by_uid: dict[str, tuple[Any, ...]] = {}
    per_step: dict[int, int] = {}
    uids = [f"g{i}" for i in range(groups)]
    payloads = [None] * TRAJECTORIES_PER_GROUP
    suffixes = [f"_{session}_0" for session in range(TRAJECTORIES_PER_GROUP)]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        for uid in uids:
            keys = [uid + suffix for suffix in suffixes]
            groups_by_uid[uid] = (uid, "train", 0, tuple(payloads), keys)
            per_step[0] = per_step.get(0, 0) + 1
        wall, cpu = time.perf_counter_ns() - wall, time.thread_time_ns() - cpu
    finally:
        if was_enabled:
            gc.enable()
    return wall, cpu


def measure_p2() -> dict[str, float]:
    """P2: put_group_nowait off/on with its control, and the pipelines; medians of the
    repeats, ns per group (ratios: medians of the ratios within a repeat)."""
    import anyio

    off, on = _configs()
    parts: list[tuple[str, Callable[[], tuple[int, int]]]] = [
        ("p2_reference", lambda: _reference_cost(P2_GROUPS)),
        ("p2_put_group_off", lambda: _put_group_cost(P2_GROUPS, off)),
        ("p2_put_group_on", lambda: _put_group_cost(P2_GROUPS, on)),
    ]
    runs: dict[str, list[float]] = {}
    for repeat in range(P2_REPEATS + 1):  # the first is a warm-up
        cpu_of: dict[str, int] = {}
        for name, run in parts[repeat % 3 :] + parts[: repeat % 3]:  # each goes first in turn
            wall, cpu = run()
            cpu_of[name] = cpu
            if repeat:
                runs.setdefault(f"{name}_wall", []).append(wall / P2_GROUPS)
                runs.setdefault(f"{name}_cpu", []).append(cpu / P2_GROUPS)
        if repeat:
            for name in ("p2_put_group_off", "p2_put_group_on"):
                runs.setdefault(f"{name}_per_reference", []).append(cpu_of[name] / cpu_of["p2_reference"])
    runs.update(anyio.run(_pipelines, P2_GROUPS, P2_PIPELINE_REPEATS, backend="asyncio"))
    return {name: statistics.median(values) for name, values in runs.items()}


def _child(part: str, src: Path) -> None:
    where = _check_import(src)
    metrics = measure_p1() if part == "p1" else measure_p2()
    print(json.dumps({"stalebuf": where, "metrics": metrics}))


# -- the driving side -----------------------------------------------------------------------------


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _dirty_src(tree: Path) -> bool:
    return bool(_git("status", "--porcelain", "--untracked-files=no", "--", "src", cwd=tree))


@dataclass
class Tree:
    """One side of the comparison: where its ``src`` is, and what it is."""

    name: str
    commit: str
    path: Path
    describe: str
    created: Path | None = None  # the temporary directory of a worktree this script added


def _existing_worktree(commit: str) -> Path | None:
    """A clean, detached worktree of ``commit`` other than this one, if git lists one."""
    path: Path | None = None
    head = ""
    for line in [*_git("worktree", "list", "--porcelain").splitlines(), ""]:
        if line.startswith("worktree "):
            path, head = Path(line.removeprefix("worktree ")), ""
        elif line.startswith("HEAD "):
            head = line.removeprefix("HEAD ")
        elif (
            line == "detached"
            and path is not None
            and head == commit
            and path.resolve() != ROOT
            and (path / "src" / "stalebuf").is_dir()
            and not _dirty_src(path)
        ):
            return path
    return None


def _subject(commit: str) -> str:
    return _git("log", "-1", "--format=%h %s", commit)[:100]


def _checkout(name: str, rev: str) -> Tree:
    """A worktree of ``rev``: an existing clean one, or a new one in a temporary directory."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    existing = _existing_worktree(commit)
    if existing is not None:
        return Tree(name, commit, existing, f"`{rev}` = {_subject(commit)} (reused worktree {existing})")
    tmp = Path(tempfile.mkdtemp(prefix=f"stalebuf-{commit[:10]}-"))
    path = tmp / "tree"
    _git("worktree", "add", "--detach", str(path), commit)
    return Tree(name, commit, path, f"`{rev}` = {_subject(commit)} (worktree {path})", created=tmp)


def _working_tree() -> Tree:
    commit = _git("rev-parse", "HEAD")
    dirty = " + uncommitted changes in src/" if _dirty_src(ROOT) else ""
    return Tree("head", commit, ROOT, f"working tree at {_subject(commit)}{dirty}")


def _remove(tree: Tree) -> None:
    if tree.created is None:
        return
    try:
        _git("worktree", "remove", "--force", str(tree.path))
    except subprocess.CalledProcessError as error:
        print(f"could not remove worktree {tree.path}: {error.stderr.strip()}", file=sys.stderr)
    shutil.rmtree(tree.created, ignore_errors=True)


def _run_child(tree: Tree, part: str) -> dict[str, float]:
    """One fresh subprocess measuring ``part`` against ``tree``'s src."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree.path / "src"), str(HERE)])
    env["PYTHONHASHSEED"] = "0"
    src = tree.path / "src"
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", part, "--src", str(src)],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{part} against {tree.name} failed ({done.returncode}):\n{done.stderr}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    metrics: dict[str, float] = answer["metrics"]
    return metrics


def _show(value: float, unit: str) -> str:
    return f"{value:.3f}x" if unit == "x" else f"{value / 1e3:.2f} µs"


def _round_line(round_no: int, name: str, part: str, values: dict[str, float]) -> str:
    if part == "p1":
        shown = "; ".join(
            f"B={b} {values[f'p1_b{b}_stalebuf'] / 1e3:.1f}/{values[f'p1_b{b}_bare'] / 1e3:.1f} µs "
            f"= {values[f'p1_b{b}_ratio']:.2f}x"
            for b in P1_REPS
        )
    else:
        names = sorted(key.removesuffix("_cpu") for key in values if key.endswith("_cpu"))
        shown = "; ".join(
            f"{name.removeprefix('p2_')} {values[name + '_cpu'] / 1e3:.2f} "
            f"({values[name + '_wall'] / 1e3:.2f})"
            for name in names
        )
        ratios = ", ".join(
            f"{key.removeprefix('p2_').replace('_per_', ' / ')} {value:.2f}x"
            for key, value in values.items()
            if "_per_" in key
        )
        shown = f"CPU (wall) µs: {shown}; CPU ratios: {ratios}"
    return f"round {round_no} {name:4} {part}: {shown}"


Results = dict[str, dict[str, list[float]]]  # side -> metric -> one value per round


def _run_rounds(base: Tree, head: Tree, rounds: int, loads: list[float]) -> Results:
    results: Results = {"base": {}, "head": {}}
    for r in range(rounds):
        order = (base, head) if r % 2 == 0 else (head, base)
        for part in ("p1", "p2"):
            for tree in order:
                values = _run_child(tree, part)
                for key, value in values.items():
                    results[tree.name].setdefault(key, []).append(value)
                print(_round_line(r + 1, tree.name, part, values), file=sys.stderr, flush=True)
        loads.append(os.getloadavg()[0])
    return results


def _table(results: Results) -> tuple[list[str], list[str]]:
    """The markdown table, and the labels of the judged metrics over the limit."""
    lines = [
        "| metric | base, median of rounds | head, median of rounds | head/base | verdict "
        "| head/base, paired by round | head/base, best round |",
        "|---|---|---|---|---|---|---|",
    ]
    over: list[str] = []
    for metric in _metrics():
        base, head = results["base"].get(metric.key), results["head"].get(metric.key)
        if not base or not head:
            continue
        b, h = statistics.median(base), statistics.median(head)
        rel = h / b
        paired = statistics.median(mine / theirs for mine, theirs in zip(head, base, strict=True))
        best = min(head) / min(base)
        if metric.kind == "judged":
            verdict = "ok" if rel <= LIMIT else f"OVER {LIMIT:.2f}x"
            if rel > LIMIT:
                over.append(metric.label)
        else:
            verdict = metric.kind
        lines.append(
            f"| {metric.label} | {_show(b, metric.unit)} | {_show(h, metric.unit)} | {rel:.3f} | {verdict} "
            f"| {paired:.3f} | {best:.3f} |"
        )
    return lines, over


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--base", default=DEFAULT_BASE, help=f"the base revision (default {DEFAULT_BASE})")
    parser.add_argument(
        "--head",
        default=None,
        help="the head revision (default: this working tree, uncommitted src included)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--keep", action="store_true", help="keep the worktrees this script created")
    parser.add_argument("--json", type=Path, default=None, help="also write every round's values here")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a judged metric is over 1.10x")
    parser.add_argument("--child", choices=("p1", "p2"), help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    return parser


def _header(argv: Sequence[str], base: Tree, head: Tree, rounds: int) -> list[str]:
    return [
        f"- command: `python benchmarks/compare_commits.py{' ' if argv else ''}{' '.join(argv)}`",
        f"- base: {base.describe}",
        f"- head: {head.describe}",
        f"- machine: {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}",
        f"- {rounds} rounds; per round and part one subprocess per side, alternating which goes first",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Compare the two trees and print the table; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child is not None:
        if args.src is None:
            parser.error("--child needs --src")
        _child(args.child, args.src)
        return 0
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    shown_argv = list(sys.argv[1:] if argv is None else argv)
    trees: list[Tree] = []
    try:
        base = _checkout("base", args.base)
        trees.append(base)
        head = _working_tree() if args.head is None else _checkout("head", args.head)
        trees.append(head)
        header = _header(shown_argv, base, head, args.rounds)
        load_before = os.getloadavg()
        started = time.perf_counter()
        loads: list[float] = []
        results = _run_rounds(base, head, args.rounds, loads)
        wall = time.perf_counter() - started
    finally:
        if not args.keep:
            for tree in trees:
                _remove(tree)
    if args.head is None and _working_tree().describe != head.describe:
        header.append(f"- note: the working tree moved during the run; it is now {_working_tree().describe}")
    lines, over = _table(results)
    print("\n".join(header))
    print(
        f"- wall time {wall:.0f} s; load average (1 min) {load_before[0]:.2f} before, "
        f"{', '.join(f'{load:.2f}' for load in loads)} after each round"
    )
    print()
    print("\n".join(lines))
    print()
    print(f"over {LIMIT:.2f}x: {', '.join(over)}" if over else f"every judged metric within {LIMIT:.2f}x")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "header": header,
                    "base": base.commit,
                    "head": head.commit,
                    "loads": loads,
                    "rounds": results,
                },
                indent=1,
            )
        )
    return 1 if args.strict and over else 0


if __name__ == "__main__":
    sys.exit(main())
