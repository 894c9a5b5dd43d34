"""The tokens of a run with a token budget (``stalebuf simulate --token-budget K``):
:class:`TokenWork`.

Every trajectory is put with ``tokens=``: the prompt's ``prompt_tokens`` plus its response's,
drawn by :class:`~._lengths.TrajectoryLengths` (the group's longest response has
``round(seconds * tokens_per_second)`` tokens, cut at ``max_response_tokens``). A group's
trajectories are put shortest first, so that one that fails part-way puts those that would have
finished first. ``TokenWork`` draws them, puts them, and counts what the trainer took at each
step, what the buffer held at most, and (without admission, under token batches) the tokens of
the prompts dispatched and not yet resolved, which the trainer keeps at the run's
``token_dispatch_budget``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..records import Batch
from ._config import SimulationConfig
from ._lengths import TrajectoryLengths
from ._result import TokenBatchSummary

__all__ = ["TokenWork"]


class TokenWork:
    """The token counts of one run: drawn per prompt, put per trajectory, summed per step."""

    __slots__ = (
        "budget",
        "cut_groups",
        "dispatch_budget",
        "drawn_groups",
        "draws",
        "max_resident",
        "outstanding",
        "prompt_tokens",
        "resident",
        "step_groups",
        "step_tokens",
    )

    def __init__(self, config: SimulationConfig) -> None:
        if config.token_budget is None:
            raise ValueError("TokenWork needs a config with a token_budget")
        self.budget = config.token_budget
        self.prompt_tokens = config.prompt_tokens
        # Only token batches without admission keep a token budget dispatched (0: never short).
        self.dispatch_budget = 0
        if config.token_batches and not config.admission:
            self.dispatch_budget = config.token_dispatch_budget
        self.draws = TrajectoryLengths(
            group_size=config.group_size,
            tokens_per_second=config.tokens_per_second,
            cap=config.max_response_tokens,
            seed=config.seed,
        )
        self.outstanding = 0  # the tokens the dispatched, unresolved prompts will put
        self.resident = 0  # the tokens put by the groups in the buffer
        self.max_resident = 0
        self.drawn_groups = 0
        self.cut_groups = 0  # groups whose longest response was cut at max_response_tokens
        self.step_tokens: list[int] = []
        self.step_groups: list[int] = []

    def draw(self, seconds: float) -> tuple[int, ...]:
        """Draw the tokens of a new prompt's trajectories (generated in ``seconds``), in the
        order they are put: shortest first."""
        self.drawn_groups += 1
        self.cut_groups += not self.draws.uncut(seconds)
        prompt = self.prompt_tokens
        return tuple(sorted(prompt + response for response in self.draws.draw(seconds)))

    def dispatched(self, tokens: int) -> None:
        """Count a dispatched prompt that will put ``tokens`` unless it is evicted first."""
        self.outstanding += tokens

    def short(self) -> bool:
        """Whether the dispatched, unresolved prompts hold fewer tokens than the dispatch
        budget (never, with admission or count batches)."""
        return self.outstanding < self.dispatch_budget

    def put(self, put: Callable[..., object], lengths: Sequence[int], tags: Sequence[Any] | None) -> int:
        """``put`` one trajectory of each of ``lengths`` tokens (session ids from 0, with
        ``tags[session]`` when given); return the tokens put."""
        for session, tokens in enumerate(lengths):
            if tags is None:
                put(None, session_id=session, tokens=tokens)
            else:
                put(None, session_id=session, tokens=tokens, tags=tags[session])
        total = sum(lengths)
        self.resident += total
        self.max_resident = max(self.max_resident, self.resident)
        return total

    def left(self, put_tokens: int, planned_tokens: int) -> None:
        """Count a group leaving the buffer (trained or evicted) with the ``put_tokens`` it put,
        its prompt dispatched to put ``planned_tokens``."""
        self.resident -= put_tokens
        self.outstanding -= planned_tokens

    def sampled(self, batch: Batch) -> None:
        """Record the trainer's step: the tokens and groups of ``batch``."""
        self.step_tokens.append(int(batch.token_counts.sum()))
        self.step_groups.append(len(batch))

    def summary(self, simulated_seconds: float) -> TokenBatchSummary:
        """Summarise the run that took ``simulated_seconds``."""
        tokens = np.array(self.step_tokens, dtype=np.float64)
        groups = np.array(self.step_groups, dtype=np.float64)
        fill = tokens / self.budget
        trained = int(sum(self.step_tokens))
        return TokenBatchSummary(
            trained_tokens=trained,
            trained_tokens_per_hour=trained * 3600.0 / simulated_seconds,
            tokens_per_step_mean=float(tokens.mean()),
            tokens_per_step_cv=_cv(tokens),
            groups_per_step_mean=float(groups.mean()),
            groups_per_step_cv=_cv(groups),
            fill_mean=float(fill.mean()),
            fill_min=float(fill.min()),
            batches_over_budget=int(np.count_nonzero(tokens > self.budget)),
            max_resident_tokens=self.max_resident,
            cut_groups_fraction=self.cut_groups / self.drawn_groups if self.drawn_groups else 0.0,
            step_tokens=tuple(self.step_tokens),
        )


def _cv(values: np.ndarray[Any, np.dtype[np.float64]]) -> float:
    """The coefficient of variation, population standard deviation over mean (0.0 for a mean
    of 0)."""
    mean = float(values.mean())
    return float(values.std()) / mean if mean else 0.0
