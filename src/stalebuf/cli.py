"""The ``stalebuf`` command line: ``stalebuf simulate`` compares drop and wait.

Every error is reported as one line on stderr with a non-zero exit status: 2 for bad
options, 1 for anything that goes wrong while running (a missing optional dependency,
an unwritable output path), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import IO, Literal, NoReturn

from . import __version__
from .errors import StalebufError
from .simulate import (
    Latency,
    MissingDependencyError,
    SimulationConfig,
    SimulationResult,
    simulate,
)

__all__ = ["format_report", "main", "write_plot"]

_DEFAULTS = SimulationConfig()


class _UsageError(Exception):
    """A bad command line; the message is the whole line to print."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, raised instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: error: {message}")


def _int_option(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}")
        return value

    return parse


def _float_option(
    low: float, high: float | None, *, low_open: bool, high_open: bool
) -> Callable[[str], float]:
    lo = "(" if low_open else "["
    hi = "inf)" if high is None else (f"{high:g})" if high_open else f"{high:g}]")
    expected = f"must be a number in {lo}{low:g}, {hi}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
        ok = math.isfinite(value) and (value > low if low_open else value >= low)
        if ok and high is not None:
            ok = value < high if high_open else value <= high
        if not ok:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value

    return parse


def _latency_option(text: str) -> Latency:
    try:
        return Latency.parse(text)
    except StalebufError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_MODEL = """\
the model:
  The trainer keeps batch-size * (1 + dispatch-ahead) prompts dispatched
  (taken from the dataset, not yet trained or evicted). Each step it calls
  sample(g, batch-size) on the real ReplayBuffer (idle time), dispatches as
  many new prompts tagged with step g, and trains for train-step-seconds (busy
  time). Rollout workers take prompts in dispatch order; each prompt's
  generation time (its "length") is drawn from --latency; a worker puts
  group-size trajectories and marks the group finished, or fails it part-way
  with probability --failure-rate. Groups the buffer evicts (stale under drop,
  failed under --failure-strategy evict) are replaced with fresh prompts from
  on_evict. Time is virtual (trio's MockClock); a seed reproduces a run.

reading the report:
  "long prompts" are the slowest quarter of the prompts whose fate was decided
  (trained, dropped or failed); "vs dispatched" is their share among trained
  groups over their share among those prompts: below 1.00x, the strategy
  under-trains long, hard prompts.
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults and keep the epilog's line breaks."""


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="stalebuf",
        description="stalebuf: a staleness-aware replay buffer for asynchronous RL of LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"stalebuf {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim = commands.add_parser(
        "simulate",
        help="compare the drop and wait strategies in a simulated async RL pipeline",
        description=(
            "Run the real ReplayBuffer inside a simulated asynchronous GRPO pipeline (a trainer\n"
            "and rollout workers) on a virtual clock, and compare the drop and wait strategies:\n"
            "throughput, trainer idle time, wasted rollouts, staleness and length bias."
        ),
        epilog=_MODEL,
        formatter_class=_HelpFormatter,
    )
    d = _DEFAULTS
    positive = _int_option(1)
    sim.add_argument("--strategy", choices=("drop", "wait", "both"), default="both", help="strategies to run")
    sim.add_argument(
        "--threshold", type=positive, default=d.threshold, metavar="T", help="max_off_policy_threshold"
    )
    sim.add_argument(
        "--parameter-sync-step",
        type=positive,
        default=d.parameter_sync_step,
        metavar="S",
        help="parameter_sync_step",
    )
    sim.add_argument("--steps", type=positive, default=d.steps, metavar="N", help="trainer steps to simulate")
    sim.add_argument(
        "--batch-size", type=positive, default=d.batch_size, metavar="B", help="groups per trainer step"
    )
    sim.add_argument(
        "--group-size",
        type=positive,
        default=d.group_size,
        metavar="N",
        help="trajectories per group (GRPO n)",
    )
    sim.add_argument(
        "--workers",
        type=positive,
        default=d.workers,
        metavar="W",
        help="rollout workers, one group at a time each",
    )
    sim.add_argument(
        "--dispatch-ahead",
        type=_float_option(0.0, 1000.0, low_open=False, high_open=False),
        default=d.dispatch_ahead,
        metavar="K",
        help="prompts dispatched beyond the batch being filled, in batches",
    )
    sim.add_argument(
        "--latency",
        type=_latency_option,
        default=d.latency,
        metavar="SPEC",
        help="generation time per group in seconds: lognormal:MU,SIGMA (of ln seconds), "
        "exponential:MEAN or fixed:SECONDS",
    )
    sim.add_argument(
        "--train-step-seconds",
        type=_float_option(0.0, None, low_open=True, high_open=True),
        default=d.train_step_seconds,
        metavar="SECONDS",
        help="time one trainer step takes once it has its batch",
    )
    sim.add_argument(
        "--failure-rate",
        type=_float_option(0.0, 1.0, low_open=False, high_open=True),
        default=d.failure_rate,
        metavar="P",
        help="probability that a group's generation fails",
    )
    sim.add_argument(
        "--failure-strategy",
        choices=("evict", "sample"),
        default=d.failure_strategy,
        help="evict failed groups (and dispatch replacements) or train on them",
    )
    sim.add_argument("--seed", type=_int_option(0), default=d.seed, metavar="N", help="random seed")
    sim.add_argument(
        "--json", metavar="PATH", default=argparse.SUPPRESS, help="write every number to a JSON file"
    )
    sim.add_argument(
        "--plot",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="write a PNG of staleness histograms and the trainer's busy/idle timeline (needs matplotlib)",
    )
    sim.add_argument(
        "--no-progress",
        action="store_true",
        default=argparse.SUPPRESS,
        help="no progress bar on stderr (it is off anyway when stderr is not a TTY)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``stalebuf`` command line and return its exit status.

    Args:
        argv: the arguments (without the program name); None means ``sys.argv[1:]``.

    Returns:
        0 on success, 2 for bad options, 1 for an error while running, 130 when interrupted.
        Errors are printed as one line on stderr; this function raises nothing but
        unexpected internal errors.
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        print(
            "stalebuf: error: missing command (try 'stalebuf simulate' or 'stalebuf --help')", file=sys.stderr
        )
        return 2
    try:
        return _simulate_command(args)
    except _UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (MissingDependencyError, OSError) as exc:
        print(f"stalebuf simulate: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stalebuf simulate: interrupted", file=sys.stderr)
        return 130


def _check_output_path(option: str, path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise _UsageError(f"stalebuf simulate: error: argument {option}: {path!r} is a directory")
    if not os.path.isdir(parent):
        raise _UsageError(f"stalebuf simulate: error: argument {option}: directory {parent!r} does not exist")


def _simulate_command(args: argparse.Namespace) -> int:
    strategies: tuple[Literal["drop", "wait"], ...] = (
        ("drop", "wait") if args.strategy == "both" else (args.strategy,)
    )
    json_path: str | None = getattr(args, "json", None)
    plot_path: str | None = getattr(args, "plot", None)
    if json_path is not None:
        _check_output_path("--json", json_path)
    if plot_path is not None:
        _check_output_path("--plot", plot_path)
        _require_matplotlib()
    configs = [
        SimulationConfig(
            strategy=strategy,
            threshold=args.threshold,
            parameter_sync_step=args.parameter_sync_step,
            failure_strategy=args.failure_strategy,
            steps=args.steps,
            batch_size=args.batch_size,
            group_size=args.group_size,
            workers=args.workers,
            dispatch_ahead=args.dispatch_ahead,
            latency=args.latency,
            train_step_seconds=args.train_step_seconds,
            failure_rate=args.failure_rate,
            seed=args.seed,
        )
        for strategy in strategies
    ]
    show_progress = not getattr(args, "no_progress", False) and sys.stderr.isatty()
    results = []
    for config in configs:
        bar = _ProgressBar(config.strategy, sys.stderr) if show_progress else None
        try:
            results.append(simulate(config, progress=bar))
        finally:
            if bar is not None:
                bar.clear()
    print(format_report(results))
    if json_path is not None:
        document = {
            "stalebuf_version": __version__,
            "results": {result.config.strategy: result.to_dict() for result in results},
        }
        with open(json_path, "w", encoding="utf-8") as file:
            json.dump(document, file, indent=2, allow_nan=False)
            file.write("\n")
        print(f"wrote {json_path}")
    if plot_path is not None:
        write_plot(results, plot_path)
        print(f"wrote {plot_path}")
    return 0


class _ProgressBar:
    """A one-line progress bar, redrawn in place on a TTY stream."""

    def __init__(self, label: str, stream: IO[str], width: int = 30) -> None:
        self.label = label
        self.stream = stream
        self.width = width
        self.shown = -1

    def __call__(self, done: int, total: int) -> None:
        filled = self.width * done // total
        percent = 100 * done // total
        if percent == self.shown:
            return
        self.shown = percent
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\rsimulating {self.label:<4} [{bar}] {percent:3d}% step {done}/{total}")
        self.stream.flush()

    def clear(self) -> None:
        if self.shown >= 0:
            self.stream.write("\r\033[K")
            self.stream.flush()


# -- the report -----------------------------------------------------------------------


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60}h {minutes % 60:02d}m"


def _seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 100 else f"{seconds:.1f} s"


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def _describe_latency(latency: Latency) -> str:
    if latency.kind == "fixed":
        return f"{latency} (always {_seconds(latency.mean)})"
    return (
        f"{latency} (median {_seconds(latency.quantile(0.5))}, mean {_seconds(latency.mean)}, "
        f"p95 {_seconds(latency.quantile(0.95))})"
    )


def format_report(results: Sequence[SimulationResult]) -> str:
    """Return the side-by-side text report of runs that share their settings but the strategy.

    Raises:
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("format_report needs at least one result")
    c = results[0].config
    header = [
        f"stalebuf simulate: {c.steps} trainer steps x {c.batch_size} groups x {c.group_size} "
        f"trajectories, {c.workers} rollout workers, {c.dispatch_budget} prompts kept dispatched",
        f"  threshold T={c.threshold}, parameter_sync_step S={c.parameter_sync_step}, "
        f"train step {_seconds(c.train_step_seconds)}, failure rate {_percent(c.failure_rate)} "
        f"({c.failure_strategy}), seed {c.seed}",
        f"  generation time per group: {_describe_latency(c.latency)}",
        "",
    ]
    rows: list[tuple[str, Callable[[SimulationResult], str]]] = [
        ("trained groups per simulated hour", lambda r: f"{r.trained_groups_per_hour:.0f}"),
        ("simulated time", lambda r: _duration(r.simulated_seconds)),
        ("trainer idle fraction", lambda r: _percent(r.trainer_idle_fraction)),
        ("mean wait per step", lambda r: _seconds(r.mean_wait_seconds)),
        ("rollouts dropped as stale (groups)", lambda r: _percent(r.dropped_fraction)),
        ("  generation time wasted on them", lambda r: _percent(r.wasted_generation_fraction)),
        ("rollouts failed", lambda r: _percent(r.failed_fraction)),
        ("rollout worker utilization", lambda r: _percent(r.worker_utilization)),
        ("staleness of trained groups: mean", lambda r: f"{r.staleness.mean:.2f}"),
        ("                              p50", lambda r: f"{r.staleness.p50:.2f}"),
        ("                              p95", lambda r: f"{r.staleness.p95:.2f}"),
        ("                              max", lambda r: f"{r.staleness.max:.2f}"),
        (
            f"long prompts (>= {_seconds(results[0].length_bias.long_seconds)}) in trained",
            lambda r: _percent(r.length_bias.long_share_trained),
        ),
        ("  vs dispatched (1.00x = no bias)", lambda r: f"{r.length_bias.ratio:.2f}x"),
    ]
    label_width = max(len(label) for label, _ in rows) + 2
    column = 10
    lines = [*header, " " * label_width + "".join(f"{r.config.strategy:>{column}}" for r in results)]
    lines += [
        f"{label:<{label_width}}" + "".join(f"{cell(r):>{column}}" for r in results) for label, cell in rows
    ]
    if len(results) == 2:
        lines += ["", *_verdict(results[0], results[1])]
    return "\n".join(lines)


def _verdict(a: SimulationResult, b: SimulationResult) -> list[str]:
    fast, slow = (a, b) if a.trained_groups_per_hour >= b.trained_groups_per_hour else (b, a)
    ratio = fast.trained_groups_per_hour / slow.trained_groups_per_hour
    drop, wait = (a, b) if a.config.strategy == "drop" else (b, a)
    return [
        f"{fast.config.strategy} trains {ratio:.2f}x as many groups per hour as {slow.config.strategy}.",
        f"drop throws away {_percent(drop.wasted_generation_fraction)} of generation time and trains long "
        f"prompts at {drop.length_bias.ratio:.2f}x their share;",
        f"wait idles the trainer {_percent(wait.trainer_idle_fraction)} of the time and trains groups "
        f"up to staleness {wait.staleness.max:g}.",
    ]


# -- the plot -------------------------------------------------------------------------


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "--plot needs matplotlib, which is not installed: pip install 'stalebuf[plot]'"
        ) from None


def write_plot(results: Sequence[SimulationResult], path: str) -> None:
    """Write a PNG to ``path``: a staleness histogram per run and the trainer's busy/idle timeline.

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install 'stalebuf[plot]'``).
        ValueError: ``results`` is empty.
        OSError: ``path`` cannot be written.
    """
    if not results:
        raise ValueError("write_plot needs at least one result")
    _require_matplotlib()
    from matplotlib.figure import Figure

    count = len(results)
    fig = Figure(figsize=(max(8.0, 4.5 * count), 7.0), layout="constrained")
    grid = fig.add_gridspec(2, count, height_ratios=(3.0, 2.0))
    threshold = results[0].config.threshold
    top = max(n for r in results for _, n in r.staleness.histogram)
    for i, result in enumerate(results):
        ax = fig.add_subplot(grid[0, i])
        values = [s for s, _ in result.staleness.histogram]
        counts = [n for _, n in result.staleness.histogram]
        width = 0.8 / result.config.parameter_sync_step
        ax.bar(values, counts, width=width, color="tab:blue" if i == 0 else "tab:orange")
        ax.axvline(threshold, color="black", linestyle="--", linewidth=1, label=f"threshold T={threshold}")
        ax.set_ylim(0, top * 1.1)
        ax.set_title(
            f"{result.config.strategy}: staleness of trained groups (mean {result.staleness.mean:.2f})"
        )
        ax.set_xlabel("staleness (g - p + 1) / S")
        ax.set_ylabel("trained groups")
        ax.legend(loc="upper left")
    timeline = fig.add_subplot(grid[1, :])
    for lane, result in enumerate(results):
        idle = [(r.sample_start / 3600, r.wait_seconds / 3600) for r in result.steps]
        busy = [(r.train_start / 3600, (r.train_end - r.train_start) / 3600) for r in result.steps]
        timeline.broken_barh(busy, (lane - 0.4, 0.8), facecolors="tab:green")
        timeline.broken_barh(idle, (lane - 0.4, 0.8), facecolors="tab:red")
    timeline.set_yticks(range(count), [r.config.strategy for r in results])
    timeline.invert_yaxis()
    timeline.set_xlim(left=0)
    timeline.set_xlabel("simulated hours")
    timeline.set_title("trainer timeline: busy training (green), idle waiting in sample (red)")
    fig.savefig(path, format="png", dpi=100)
