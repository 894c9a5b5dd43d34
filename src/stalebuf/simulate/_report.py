"""What ``stalebuf simulate`` shows: the side-by-side text report and the plot (PNG or JPEG).

Both read finished :class:`SimulationResult` records only; matplotlib is imported only when a
plot is written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..errors import MissingDependencyError
from ._mix_report import mix_rows
from ._result import SimulationResult, StalenessSummary
from ._text import Row, duration, header, percent, seconds, table
from ._token_report import token_header, token_rows
from ._versions_report import format_versions_report

__all__ = ["PLOT_FORMATS", "format_report", "plot_format", "require_matplotlib", "write_plot"]


def format_report(results: Sequence[SimulationResult]) -> str:
    """Return the side-by-side text report of runs that share their settings but the strategy
    and admission (with in-flight weight updates, the report of :mod:`._versions_report`).

    Raises:
        ValueError: ``results`` is empty, or mixes runs with and without in-flight updates.
    """
    if not results:
        raise ValueError("format_report needs at least one result")
    in_flight = {r.config.in_flight_updates for r in results}
    if len(in_flight) > 1:
        raise ValueError("format_report cannot put runs with and without in-flight updates side by side")
    if in_flight == {True}:
        return format_versions_report(results)
    rows: list[Row] = [
        ("trained groups per simulated hour", lambda r: f"{r.trained_groups_per_hour:.0f}"),
        ("simulated time", lambda r: duration(r.simulated_seconds)),
        ("trainer idle fraction", lambda r: percent(r.trainer_idle_fraction)),
        ("mean wait per step", lambda r: seconds(r.mean_wait_seconds)),
        ("rollouts dropped as stale (groups)", lambda r: percent(r.dropped_fraction)),
        ("  generation time wasted on them", lambda r: percent(r.wasted_generation_fraction)),
        ("rollouts failed", lambda r: percent(r.failed_fraction)),
        ("rollout worker utilization", lambda r: percent(r.worker_utilization)),
        ("  time waiting for admission", lambda r: percent(r.admission_wait_fraction)),
        ("max resident groups", lambda r: f"{r.max_resident_groups}"),
        ("staleness of trained groups: mean", lambda r: f"{r.staleness.mean:.2f}"),
        ("                              p50", lambda r: f"{r.staleness.p50:.2f}"),
        ("                              p95", lambda r: f"{r.staleness.p95:.2f}"),
        ("                              max", lambda r: f"{r.staleness.max:.2f}"),
        (
            f"long prompts (>= {seconds(results[0].length_bias.long_seconds)}) in trained",
            lambda r: percent(r.length_bias.long_share_trained),
        ),
        ("  vs dispatched (1.00x = no bias)", lambda r: f"{r.length_bias.ratio:.2f}x"),
        *token_rows(results),
        *mix_rows(results),
    ]
    lines = [*header(results, *token_header(results)), *table(results, rows)]
    if len(results) >= 2:
        lines += ["", *_verdict(results)]
    return "\n".join(lines)


def _verdict(results: Sequence[SimulationResult]) -> list[str]:
    """One line on throughput (the fastest run against the slowest), then one per run on its cost."""
    fast = max(results, key=lambda r: r.trained_groups_per_hour)
    slow = min(results, key=lambda r: r.trained_groups_per_hour)
    ratio = fast.trained_groups_per_hour / slow.trained_groups_per_hour
    costs = []
    for r in results:
        if r.config.strategy == "drop":
            costs.append(
                f"{r.config.label} throws away {percent(r.wasted_generation_fraction)} of generation time "
                f"and trains long prompts at {r.length_bias.ratio:.2f}x their share"
            )
        else:
            costs.append(
                f"{r.config.label} idles the trainer {percent(r.trainer_idle_fraction)} of the time and "
                f"trains groups up to staleness {r.staleness.max:g}"
            )
    if f"{ratio:.2f}" == "1.00":  # a tie: "drop trains 1.00x as many ... as drop" says nothing
        low, high = f"{slow.trained_groups_per_hour:.0f}", f"{fast.trained_groups_per_hour:.0f}"
        span = low if low == high else f"{low} to {high}"
        throughput = f"every run trains about as many groups per hour as the others ({span})."
    else:
        fast_label, slow_label = fast.config.label, slow.config.label
        throughput = f"{fast_label} trains {ratio:.2f}x as many groups per hour as {slow_label}."
    return [
        throughput,
        *(f"{cost};" for cost in costs[:-1]),
        f"{costs[-1]}.",
    ]


# -- the plot -------------------------------------------------------------------------

#: The image formats ``write_plot`` writes, by the path's suffix (lower-cased).
PLOT_FORMATS: dict[str, str] = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg"}

# Okabe & Ito's palette, made to stay distinct under every common colour-vision deficiency.
_BLUE, _ORANGE, _GREEN, _SKY, _VERMILLION, _PURPLE = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#56B4E9",
    "#D55E00",
    "#CC79A7",
)
_YELLOW, _BLACK = "#F0E442", "#000000"
# One histogram colour per run, in the CLI's order: drop, drop+admission, wait, wait+admission
# (then mask, mask+admission with in-flight updates).
_RUN_COLORS = (_GREEN, _SKY, _PURPLE, _VERMILLION, _YELLOW, _BLACK)
# The timeline's two states: a dark and a light colour, apart in lightness as well as hue.
_BUSY, _IDLE = _BLUE, _ORANGE


def require_matplotlib() -> None:
    """Check that matplotlib can be imported, so that ``--plot`` fails before simulating.

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install 'stalebuf[plot]'``).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "--plot needs matplotlib, which is not installed: pip install 'stalebuf[plot]'"
        ) from None


def plot_format(path: str) -> str:
    """Return the image format ``write_plot`` writes ``path`` in, from its suffix.

    Raises:
        ValueError: the suffix is not one of :data:`PLOT_FORMATS` (the message lists them).
    """
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in PLOT_FORMATS:
        raise ValueError(
            f"cannot write a plot to {suffix or 'a path without a suffix'}: "
            f"use {', '.join(PLOT_FORMATS)} (PNG or JPEG)"
        )
    return PLOT_FORMATS[suffix]


def write_plot(results: Sequence[SimulationResult], path: str) -> None:
    """Write an image to ``path``, a PNG or a JPEG by its suffix: a staleness histogram per run
    (of trained groups; of trained tokens with in-flight updates) and the trainer's busy/idle
    timeline, in colour-blind-safe colours.

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install 'stalebuf[plot]'``).
        ValueError: ``results`` is empty, or ``path`` has no suffix of :data:`PLOT_FORMATS`.
        OSError: ``path`` cannot be written.
    """
    if not results:
        raise ValueError("write_plot needs at least one result")
    image_format = plot_format(path)
    require_matplotlib()
    from matplotlib.figure import Figure

    count = len(results)
    # Small enough that a README shows it near its own size, so its text stays legible.
    fig = Figure(figsize=(max(7.0, 3.2 * count), 6.5), layout="constrained")
    grid = fig.add_gridspec(2, count, height_ratios=(3.0, 2.0))
    _histograms(fig, grid, results)
    _timeline(fig.add_subplot(grid[1, :]), results)
    # No "Software" stamp in a PNG, so that regenerating docs/simulate.png changes only its pixels.
    metadata = {"Software": None} if image_format == "png" else None
    fig.savefig(path, format=image_format, dpi=100, metadata=metadata)


def _histograms(fig: Any, grid: Any, results: Sequence[SimulationResult]) -> None:
    """One staleness histogram per run, on a shared count axis, with the threshold marked."""
    threshold = results[0].config.threshold
    summaries = [_staleness(r) for r in results]
    top = max((n for summary in summaries for _, n in summary.histogram), default=1) * 1.15
    tokens = results[0].tokens is not None
    first = None
    for i, (result, summary) in enumerate(zip(results, summaries, strict=True)):
        ax = fig.add_subplot(grid[0, i], sharey=first)
        values = [s for s, _ in summary.histogram]
        counts = [n for _, n in summary.histogram]
        width = 0.8 / result.config.parameter_sync_step
        ax.bar(values, counts, width=width, color=_RUN_COLORS[i % len(_RUN_COLORS)])
        ax.axvline(threshold, color="black", linestyle="--", linewidth=1, label=f"threshold T={threshold}")
        ax.set_ylim(0, top)
        ax.set_title(f"{result.config.label}\nmean staleness {summary.mean:.2f}")
        ax.set_xlabel("token staleness (g - v + 1) / S" if tokens else "staleness (g - p + 1) / S")
        if first is None:  # the shared axis is labelled once
            first = ax
            ax.set_ylabel("trained tokens" if tokens else "trained groups")
            ax.legend(loc="upper left")
        else:
            ax.tick_params(labelleft=False)


def _staleness(result: SimulationResult) -> StalenessSummary:
    """What a run's histogram shows: its trained tokens with in-flight updates, else its groups."""
    return result.staleness if result.tokens is None else result.tokens.staleness


def _timeline(ax: Any, results: Sequence[SimulationResult]) -> None:
    """One lane per run: when the trainer trained (busy) and when it waited in ``sample`` (idle)."""
    from matplotlib.patches import Patch

    for lane, result in enumerate(results):
        idle = [(r.sample_start / 3600, r.wait_seconds / 3600) for r in result.steps]
        busy = [(r.train_start / 3600, (r.train_end - r.train_start) / 3600) for r in result.steps]
        ax.broken_barh(busy, (lane - 0.4, 0.8), facecolors=_BUSY)
        ax.broken_barh(idle, (lane - 0.4, 0.8), facecolors=_IDLE)
    ax.set_yticks(range(len(results)), [r.config.label for r in results])
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("simulated hours")
    ax.set_title("trainer timeline", loc="left")
    states = [Patch(color=_BUSY, label="busy: training"), Patch(color=_IDLE, label="idle: waiting in sample")]
    ax.legend(handles=states, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=2, frameon=False)
