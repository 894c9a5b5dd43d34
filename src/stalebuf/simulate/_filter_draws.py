"""The simulated scores that the buffer's zero-variance filter judges: :class:`FilterDraws`.

With ``filter_pass_rate`` below 1 the simulated buffer is built with
``filters=[zero_variance("score")]``, the real filter, so the run exercises the real eviction
and slot refund. Each prompt draws at dispatch whether it will pass; its trajectories are then
put with distinct scores (it passes) or all the same score (it is filtered as it finishes).

The draws come from a ``random.Random`` of their own, seeded from the run's ``seed``: prompt
``k`` draws the same generation time (and failure) whatever the pass rate, so runs at two pass
rates differ only in which groups are filtered, and a seed reproduces a run exactly.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from ..filters import GroupFilter, zero_variance
from ._config import SCORE_TAG, SimulationConfig

__all__ = ["FilterDraws"]


class FilterDraws:
    """The pass or fail draws of one run's prompts, and the score tags they put."""

    __slots__ = ("distinct", "filters", "rate", "rngs", "same")

    def __init__(self, config: SimulationConfig) -> None:
        self.rate = config.filter_pass_rate
        # A string seed is hashed with SHA-512: the same stream on every platform and run. With
        # tasks, one stream per task, drawn in that task's dispatch order.
        names = () if config.tasks is None else config.tasks.names
        self.rngs: dict[str | None, random.Random] = {
            task: random.Random(
                f"stalebuf simulate filter {config.seed}" + ("" if task is None else f" {task}")
            )
            for task in (None, *names)
        }
        sessions = range(config.group_size)
        self.distinct: tuple[Mapping[str, float], ...] = tuple({SCORE_TAG: float(s)} for s in sessions)
        self.same: tuple[Mapping[str, float], ...] = tuple({SCORE_TAG: 0.0} for _ in sessions)
        #: What the buffer is built with: the real built-in filter, reading the score tag.
        self.filters: tuple[GroupFilter, ...] = (zero_variance(SCORE_TAG),)

    def draw(self, task: str | None) -> bool:
        """Draw whether the next dispatched prompt (of ``task``) passes the filter, with
        probability ``filter_pass_rate``."""
        return self.rngs[task].random() < self.rate

    def tags(self, passes: bool) -> tuple[Mapping[str, float], ...]:
        """The score tag of each trajectory (by session) of a prompt that ``passes`` or not."""
        return self.distinct if passes else self.same
