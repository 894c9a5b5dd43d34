"""What ``stalebuf simulate`` shows: the side-by-side text report and the PNG plot.

Both read finished :class:`SimulationResult` records only; matplotlib is imported only when a
plot is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import MissingDependencyError
from ._config import Latency
from ._result import SimulationResult

__all__ = ["format_report", "require_matplotlib", "write_plot"]


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


def _dispatch_lines(results: Sequence[SimulationResult]) -> list[str]:
    """Describe how prompts are dispatched in the runs without and with admission."""
    c = results[0].config
    lines = []
    if any(not r.config.admission for r in results):
        lines.append(
            f"  without admission: {c.dispatch_budget} prompts kept dispatched "
            f"(dispatch-ahead {c.dispatch_ahead:g})"
        )
    if any(r.config.admission for r in results):
        lines.append(
            f"  with admission: each worker loops rollout(); at most {c.batch_size} groups per dispatch "
            f"step, {c.threshold * c.parameter_sync_step * c.batch_size} resident (T*S*B)"
        )
    return lines


def format_report(results: Sequence[SimulationResult]) -> str:
    """Return the side-by-side text report of runs that share their settings but the strategy
    and admission.

    Raises:
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("format_report needs at least one result")
    c = results[0].config
    header = [
        f"stalebuf simulate: {c.steps} trainer steps x {c.batch_size} groups x {c.group_size} "
        f"trajectories, {c.workers} rollout workers",
        f"  threshold T={c.threshold}, parameter_sync_step S={c.parameter_sync_step}, "
        f"train step {_seconds(c.train_step_seconds)}, failure rate {_percent(c.failure_rate)} "
        f"({c.failure_strategy}), seed {c.seed}",
        f"  generation time per group: {_describe_latency(c.latency)}",
        *_dispatch_lines(results),
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
        ("  time waiting for admission", lambda r: _percent(r.admission_wait_fraction)),
        ("max resident groups", lambda r: f"{r.max_resident_groups}"),
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
    column = max(10, *(len(r.config.label) + 2 for r in results))
    lines = [*header, " " * label_width + "".join(f"{r.config.label:>{column}}" for r in results)]
    lines += [
        f"{label:<{label_width}}" + "".join(f"{cell(r):>{column}}" for r in results) for label, cell in rows
    ]
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
                f"{r.config.label} throws away {_percent(r.wasted_generation_fraction)} of generation time "
                f"and trains long prompts at {r.length_bias.ratio:.2f}x their share"
            )
        else:
            costs.append(
                f"{r.config.label} idles the trainer {_percent(r.trainer_idle_fraction)} of the time and "
                f"trains groups up to staleness {r.staleness.max:g}"
            )
    return [
        f"{fast.config.label} trains {ratio:.2f}x as many groups per hour as {slow.config.label}.",
        *(f"{cost};" for cost in costs[:-1]),
        f"{costs[-1]}.",
    ]


# -- the plot -------------------------------------------------------------------------

# One histogram colour per run, in the CLI's order: drop, drop+admission, wait, wait+admission.
_COLORS = ("tab:blue", "tab:cyan", "tab:orange", "tab:olive")


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


def write_plot(results: Sequence[SimulationResult], path: str) -> None:
    """Write a PNG to ``path``: a staleness histogram per run and the trainer's busy/idle timeline.

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install 'stalebuf[plot]'``).
        ValueError: ``results`` is empty.
        OSError: ``path`` cannot be written.
    """
    if not results:
        raise ValueError("write_plot needs at least one result")
    require_matplotlib()
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
        ax.bar(values, counts, width=width, color=_COLORS[i % len(_COLORS)])
        ax.axvline(threshold, color="black", linestyle="--", linewidth=1, label=f"threshold T={threshold}")
        ax.set_ylim(0, top * 1.1)
        ax.set_title(f"{result.config.label}\nstaleness of trained groups (mean {result.staleness.mean:.2f})")
        ax.set_xlabel("staleness (g - p + 1) / S")
        ax.set_ylabel("trained groups")
        ax.legend(loc="upper left")
    timeline = fig.add_subplot(grid[1, :])
    for lane, result in enumerate(results):
        idle = [(r.sample_start / 3600, r.wait_seconds / 3600) for r in result.steps]
        busy = [(r.train_start / 3600, (r.train_end - r.train_start) / 3600) for r in result.steps]
        timeline.broken_barh(busy, (lane - 0.4, 0.8), facecolors="tab:green")
        timeline.broken_barh(idle, (lane - 0.4, 0.8), facecolors="tab:red")
    timeline.set_yticks(range(count), [r.config.label for r in results])
    timeline.invert_yaxis()
    timeline.set_xlim(left=0)
    timeline.set_xlabel("simulated hours")
    timeline.set_title("trainer timeline: busy training (green), idle waiting in sample (red)")
    fig.savefig(path, format="png", dpi=100)
