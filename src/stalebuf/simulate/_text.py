"""The pieces both text reports are made of: numbers in words, the header that describes the
runs, and the side-by-side table (:mod:`._report` and :mod:`._versions_report` lay them out)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._config import Latency, SimulationConfig
from ._result import SimulationResult

__all__ = ["Row", "count", "duration", "header", "percent", "seconds", "table", "tokens"]

#: One row of a report: its label, and how it shows a run's result.
Row = tuple[str, Callable[[SimulationResult], str]]


def duration(value: float) -> str:
    """``"12.5 s"``, ``"7 min"``, ``"2h 04m"``."""
    if value < 60:
        return f"{value:.1f} s"
    minutes = round(value / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60}h {minutes % 60:02d}m"


def seconds(value: float) -> str:
    """``"155 s"``, ``"7.3 s"``."""
    return f"{value:.0f} s" if value >= 100 else f"{value:.1f} s"


def percent(value: float) -> str:
    """``"12.3%"`` for 0.123."""
    return f"{100 * value:.1f}%"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 rollout worker"``, ``"2 rollout workers"``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def tokens(value: float) -> str:
    """A number of tokens, in millions or thousands past those: ``"27.32M"``, ``"950.1k"``."""
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def _describe_latency(latency: Latency) -> str:
    if latency.kind == "fixed":
        return f"{latency} (always {seconds(latency.mean)})"
    spec = str(latency)
    if latency.kind == "lognormal" and latency.spec is not None:  # lognormal-fit: show what it fitted
        mu, sigma = latency.params
        spec = f"{spec}, fitted MU,SIGMA = {mu:.4f},{sigma:.4f}"
    elif latency.kind == "empirical":
        spec = f"{spec}, {count(len(latency.params), 'value')} resampled"
    return (
        f"{spec} (median {seconds(latency.quantile(0.5))}, mean {seconds(latency.mean)}, "
        f"p95 {seconds(latency.quantile(0.95))})"
    )


def _dispatch_lines(results: Sequence[SimulationResult]) -> list[str]:
    """Describe how prompts are dispatched in the runs by count batches, without and with
    admission (:mod:`._token_report` describes those by token batches)."""
    c = results[0].config
    lines = []
    results = [r for r in results if not r.config.token_batches]
    if any(not r.config.admission for r in results):
        lines.append(
            f"  without admission: {count(c.dispatch_budget, 'prompt')} kept dispatched "
            f"(dispatch-ahead {c.dispatch_ahead:g}){_by_task(c.dispatch_split())}"
        )
    if any(r.config.admission for r in results):
        per_step = f"at most {count(c.batch_size, 'group')} per dispatch step"
        workers = ""
        if c.tasks is not None:
            per_step += _by_task(c.tasks.split(c.batch_size))
            workers = f", workers{_by_task(c.tasks.split(c.workers))}"
        lines.append(
            f"  with admission: each worker loops rollout(){workers}; {per_step}, "
            f"{c.threshold * c.parameter_sync_step * c.batch_size} resident (T*S*B)"
        )
    return lines


def _by_task(counts: dict[str, int]) -> str:
    """`` (math 16, code 16)``, or nothing without tasks."""
    return f" ({', '.join(f'{name} {n}' for name, n in counts.items())})" if counts else ""


def _generation_lines(c: SimulationConfig) -> list[str]:
    """Describe the generation time per group: one line, or with tasks, one per task."""
    if c.tasks is None:
        return [f"  generation time per group: {_describe_latency(c.latency)}"]
    quotas = c.tasks.split(c.batch_size)
    lines = [f"  tasks (mixture_policy {c.mixture_policy}), generation time per group:"]
    for task in c.tasks.tasks:
        lines.append(
            f"    {task.name}: weight {task.weight:g}, {quotas[task.name]} of {c.batch_size} per batch, "
            f"{_describe_latency(c.task_latency(task.name))}"
        )
    return lines


def _filter_lines(c: SimulationConfig) -> list[str]:
    if not c.filtering:
        return []
    return [
        f"  filter: zero_variance('score'), a finished group passes with probability "
        f"{percent(c.filter_pass_rate)}"
    ]


def header(results: Sequence[SimulationResult], *extra: str) -> list[str]:
    """The lines that describe the runs' shared settings, then ``extra`` ones, then a blank one."""
    c = results[0].config
    return [
        f"stalebuf simulate: {count(c.steps, 'trainer step')} x {count(c.batch_size, 'group')} x "
        f"{count(c.group_size, 'trajectory', 'trajectories')}, {count(c.workers, 'rollout worker')}",
        f"  threshold T={c.threshold}, parameter_sync_step S={c.parameter_sync_step}, "
        f"train step {seconds(c.train_step_seconds)}, failure rate {percent(c.failure_rate)} "
        f"({c.failure_strategy}), seed {c.seed}",
        *_generation_lines(c),
        *_filter_lines(c),
        *_dispatch_lines(results),
        *extra,
        "",
    ]


def table(results: Sequence[SimulationResult], rows: Sequence[Row]) -> list[str]:
    """The runs side by side: a line of run labels, then one line per row."""
    label_width = max(len(label) for label, _ in rows) + 2
    column = max(10, *(len(r.config.label) + 2 for r in results))
    lines = [" " * label_width + "".join(f"{r.config.label:>{column}}" for r in results)]
    lines += [
        f"{label:<{label_width}}" + "".join(f"{cell(r):>{column}}" for r in results) for label, cell in rows
    ]
    return lines
