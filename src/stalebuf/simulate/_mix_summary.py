"""The filter's and the tasks' share of a finished run: :func:`filter_summary` and
:func:`task_summaries`.

Both walk the prompts in dispatch order (never in the order events happened), like the rest of
the result, so that a seed reproduces every number whatever order trio ran simultaneous tasks in.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from ..staleness import age as staleness_age
from ._config import SimulationConfig
from ._result import FilterSummary, StalenessSummary, TaskSummary

__all__ = ["SummarisedPrompt", "filter_summary", "task_summaries"]


class SummarisedPrompt(Protocol):
    """What the summaries read of a dispatched prompt (:class:`~._prompt.Prompt`)."""

    @property
    def fate(self) -> str | None: ...
    @property
    def finished(self) -> bool: ...
    @property
    def spent(self) -> float: ...
    @property
    def task(self) -> str | None: ...
    @property
    def dispatch_step(self) -> int: ...
    @property
    def trained_step(self) -> int: ...


def filter_summary(prompts: Sequence[SummarisedPrompt]) -> FilterSummary:
    """Summarise what the filter did to ``prompts``: a prompt that finished generating was
    judged once, as it finished; its fate says whether it was filtered."""
    judged = filtered = resolved = 0
    generated: list[float] = []
    on_filtered: list[float] = []
    for prompt in prompts:
        judged += prompt.finished
        if prompt.fate is None:
            continue
        resolved += 1
        generated.append(prompt.spent)
        if prompt.fate == "filtered":
            filtered += 1
            on_filtered.append(prompt.spent)
    total = math.fsum(generated)
    return FilterSummary(
        judged_groups=judged,
        filtered_groups=filtered,
        pass_rate=1.0 - filtered / judged if judged else 0.0,
        filtered_fraction=filtered / resolved if resolved else 0.0,
        filtered_generation_fraction=math.fsum(on_filtered) / total if total else 0.0,
    )


def task_summaries(config: SimulationConfig, prompts: Sequence[SummarisedPrompt]) -> tuple[TaskSummary, ...]:
    """Summarise each task of ``config.tasks`` (in the order given) over ``prompts``: its
    dispatched and trained groups, its trained share and the staleness of its trained groups.

    Raises:
        ValueError: the run has no tasks.
    """
    if config.tasks is None:
        raise ValueError("task_summaries needs a run with tasks")
    quotas = config.tasks.split(config.batch_size)
    dispatched: Counter[str | None] = Counter()
    lags: dict[str | None, Counter[int]] = {name: Counter() for name in config.tasks.names}
    for prompt in prompts:
        dispatched[prompt.task] += 1
        if prompt.fate == "trained":
            lags[prompt.task][staleness_age(prompt.trained_step, prompt.dispatch_step)] += 1
    trained = {name: sum(lags[name].values()) for name in config.tasks.names}
    everything = sum(trained.values())
    return tuple(
        TaskSummary(
            name=name,
            target_share=quotas[name] / config.batch_size,
            dispatched_groups=dispatched[name],
            trained_groups=trained[name],
            trained_share=trained[name] / everything if everything else 0.0,
            staleness=StalenessSummary.from_lags(lags[name], config.parameter_sync_step),
        )
        for name in config.tasks.names
    )
