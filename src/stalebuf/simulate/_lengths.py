"""How many tokens a simulated group's trajectories have: :class:`TrajectoryLengths`.

A group's longest trajectory is decoded for the group's whole generation time, so it has
``round(seconds * tokens_per_second)`` tokens (at least 1, at most a cap); its other trajectories
have from ``SHORTEST`` times that to as many, uniformly: they finish earlier. Both the chunked
decoding of in-flight weight updates (:mod:`._decoding`) and the token counts of token budgets
(:mod:`._token_work`) draw lengths this way.

Lengths are drawn from RNGs of their own (one per task with tasks, each in its task's dispatch
order), so that drawing them leaves every prompt's length and fate as the run's main RNG draws
them: a run with token counts is the run without them, plus the counts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["SHORTEST", "TrajectoryLengths"]

#: A group's other trajectories have from ``SHORTEST`` times its longest one's tokens to as many
#: (uniformly): they finish earlier, so their newest tokens are older than the longest one's.
SHORTEST = 0.25


class TrajectoryLengths:
    """The seeded draw of each group's trajectory lengths, in tokens, its longest first."""

    __slots__ = ("cap", "group_size", "rng", "task_rngs", "tokens_per_second")

    def __init__(
        self, *, group_size: int, tokens_per_second: float, cap: int, seed: int, tasks: Sequence[str] = ()
    ) -> None:
        self.cap = cap
        self.group_size = group_size
        self.tokens_per_second = tokens_per_second
        # A string seed is hashed the same way on every platform and Python version.
        self.rng = random.Random(f"stalebuf simulate trajectory lengths {seed}")
        # With tasks, one stream per task, drawn in that task's own dispatch order (the order
        # prompts of different tasks are dispatched in is trio's).
        self.task_rngs = {
            name: random.Random(f"stalebuf simulate trajectory lengths {seed} {name}") for name in tasks
        }

    def draw(self, seconds: float, task: str | None = None) -> tuple[int, ...]:
        """Draw the token counts of a group (of ``task``) generated in ``seconds``, its longest
        first: the longest is cut at ``cap`` tokens, the others are a share of what is left."""
        longest = min(self.cap, max(1, round(seconds * self.tokens_per_second)))
        draw = (self.rng if task is None else self.task_rngs[task]).random
        spread = 1.0 - SHORTEST
        others = [max(1, round(longest * (SHORTEST + spread * draw()))) for _ in range(self.group_size - 1)]
        return (longest, *others)

    def uncut(self, seconds: float) -> bool:
        """Whether a group generated in ``seconds`` keeps its longest trajectory whole (under
        ``cap``)."""
        return round(seconds * self.tokens_per_second) <= self.cap
