"""Measure the performance targets side by side with their baselines, in one process.

Usage::

    python benchmarks/compare.py            # full run, about 1-2 minutes
    python benchmarks/compare.py --quick    # tiny sizes, a few seconds (CI smoke run)

Prints a markdown table of absolute figures, ratios to the baselines measured in the
same run, and PASS/FAIL per target, then writes ``benchmarks/scaling.png`` (how cost
grows with N) when matplotlib is installed. Baselines: a bare ``asyncio.Event`` (or
``trio.Event``) set->wake, an ``asyncio.Queue`` put+get, and :class:`PollingBuffer`, a
minimal verl-like polling buffer, at poll intervals of 0.05 s and 2 s. Wherever a ratio
is the target, the two sides are measured interleaved (ABAB...) so that load from other
processes hits both alike. ``--quick`` sizes are too small for the verdicts to mean
anything; it only proves every measurement runs. Exit status is 0 unless ``--strict`` is
given and a target failed.

Each target lives in its own module (``p1_wakeup`` ... ``p7_memory``; ``p3_sample`` also
runs P4, which reuses its resident sets), and so do the targets of the second performance round:
``scale`` (put_group + sample end to end vs asyncio.Queue), ``out_of_order`` (finishing out of
admission order), ``sampleable`` (``sampleable_count`` with everything stale) and ``gc_cost``
(the cyclic GC's share of a large build). ``report`` holds the table and the plot.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import gc_cost
import out_of_order
import p1_wakeup
import p2_producer
import p3_sample
import p5_gate
import p6_idle
import p7_memory
import sampleable
import scale
from report import HERE, Report, machine_info, plot, status
from sizes import FULL, QUICK, Sizes

TARGETS: dict[str, Callable[[Sizes, Report], None]] = {
    "P1": p1_wakeup.run,
    "P2": p2_producer.run,
    "P3": p3_sample.run,  # and P4
    "P5": p5_gate.run,
    "P6": p6_idle.run,
    "P7": p7_memory.run,
    "SCALE": scale.run,
    "ORDER": out_of_order.run,
    "COUNT": sampleable.run,
    "GC": gc_cost.run,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds (smoke run)")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated targets to run, e.g. P1,P3 (P3 includes P4), or Scale, Order, Count, GC; "
        "default: all",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="where to write the scaling plot (default: benchmarks/scaling.png on a full run, "
        "none with --quick)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 if a target fails")
    return parser


def _wanted(parser: argparse.ArgumentParser, only: str) -> set[str]:
    """The targets named by ``--only`` (empty: all); P4 runs as part of P3."""
    wanted = {t.strip().upper() for t in only.split(",") if t.strip()}
    if "P4" in wanted:
        wanted.add("P3")
    unknown = wanted - set(TARGETS) - {"P4"}
    if unknown:
        parser.error(f"unknown targets: {', '.join(sorted(unknown))}")
    return wanted


def _run_targets(wanted: set[str], sizes: Sizes, report: Report) -> None:
    for name, run in TARGETS.items():
        if not wanted or name in wanted:
            section = time.perf_counter()
            run(sizes, report)
            status(f"{name}{' and P4' if name == 'P3' else ''} took {time.perf_counter() - section:.1f} s")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen targets, print the table; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    shown_argv = list(sys.argv[1:] if argv is None else argv)
    sizes = QUICK if args.quick else FULL
    wanted = _wanted(parser, args.only)

    info = machine_info(shown_argv)  # before the run: the commit the measured code came from
    report = Report()
    load_before = os.getloadavg()
    started = time.perf_counter()
    _run_targets(wanted, sizes, report)
    wall = time.perf_counter() - started
    load_after = os.getloadavg()

    print(
        f"## stalebuf performance{' (--quick: tiny sizes, verdicts not meaningful)' if sizes.quick else ''}"
    )
    print()
    for line in info:
        print(line)
    print(
        f"- wall time {wall:.1f} s; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
        "(other jobs share the cores: compare the ratios, which are measured interleaved)"
    )
    print()
    print(report.markdown())
    print()
    print(report.summary())
    plot_path = args.plot if args.plot is not None else (None if sizes.quick else HERE / "scaling.png")
    if plot_path is not None and not args.no_plot and (report.scaling or report.scaling_k):
        print()
        print(plot(report, plot_path))
    return 1 if args.strict and report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
