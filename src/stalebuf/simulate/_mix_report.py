"""The rows the text reports add for a filter or a task mixture (``stalebuf simulate
--filter-pass-rate`` and ``--tasks``): none for a run with neither, so that its report is what
it was before they existed.

Both :mod:`._report` and :mod:`._versions_report` append :func:`mix_rows` to their tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._result import FilterSummary, SimulationResult, TaskSummary
from ._text import Row, percent

__all__ = ["mix_rows"]


def _filters(result: SimulationResult) -> FilterSummary:
    if result.filters is None:
        raise ValueError(f"the run {result.config.label} has no filter summary")
    return result.filters


def _task(result: SimulationResult, index: int) -> TaskSummary:
    if result.tasks is None:
        raise ValueError(f"the run {result.config.label} has no task summaries")
    return result.tasks[index]


def _filter_rows() -> list[Row]:
    return [
        (
            "trainer steps per simulated hour",
            lambda r: f"{r.trained_groups_per_hour / r.config.batch_size:.1f}",
        ),
        ("groups filtered (zero variance)", lambda r: percent(_filters(r).filtered_fraction)),
        ("  generation time spent on them", lambda r: percent(_filters(r).filtered_generation_fraction)),
        ("  pass rate observed", lambda r: percent(_filters(r).pass_rate)),
    ]


def _share_cell(index: int) -> Callable[[SimulationResult], str]:
    return lambda r: percent(_task(r, index).trained_share)


def _staleness_cell(index: int) -> Callable[[SimulationResult], str]:
    return lambda r: f"{_task(r, index).staleness.max:.2f}"


def _task_rows(results: Sequence[SimulationResult]) -> list[Row]:
    rows: list[Row] = []
    for index, summary in enumerate(results[0].tasks or ()):
        label = f"task {summary.name}:"
        rows.append((f"{label} trained share (target {percent(summary.target_share)})", _share_cell(index)))
        rows.append((f"{' ' * len(label)} max staleness", _staleness_cell(index)))
    return rows


def mix_rows(results: Sequence[SimulationResult]) -> list[Row]:
    """The rows of the filter (when the runs filter) and of each task (when they have tasks).

    Raises:
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("mix_rows needs at least one result")
    config = results[0].config
    rows: list[Row] = []
    if config.filtering:
        rows += _filter_rows()
    if config.tasks is not None:
        rows += _task_rows(results)
    return rows
