"""A dispatched prompt of a simulated run: :class:`Prompt`, everything the model draws and records
about it (its generation time, its fate, its token counts)."""

from __future__ import annotations

from typing import Literal

__all__ = ["Fate", "Prompt"]

#: What became of a prompt: trained, or evicted as stale, as a failure, or by the filter.
Fate = Literal["trained", "stale", "failure", "filtered"]


class Prompt:
    """A dispatched prompt; everything random about it is drawn at dispatch."""

    __slots__ = (
        "decoded",
        "dispatch_step",
        "done",
        "evicted_step",
        "fail_after",
        "failed",
        "fate",
        "finished",
        "lengths",
        "passes",
        "planned_tokens",
        "put_tokens",
        "seconds",
        "spent",
        "started",
        "task",
        "trained_step",
        "uid",
    )

    def __init__(
        self, uid: str, dispatch_step: int, seconds: float, fail_after: float | None, task: str | None
    ) -> None:
        self.uid = uid
        self.task = task  # with tasks: its task, its group's "task" tag
        self.dispatch_step = dispatch_step
        self.seconds = seconds  # its length: the full generation time
        self.fail_after = fail_after  # None: it finishes; else it fails after this long
        self.started: float | None = None  # when a worker took it
        self.spent = 0.0  # generation time spent on it, once done
        self.done = False
        self.failed = False  # it failed part-way (not: it was evicted in flight before failing)
        self.finished = False  # it finished generating: its group became FINISHED (and was judged)
        self.passes = True  # when filtering: whether its trajectories get distinct scores
        self.fate: Fate | None = None
        self.trained_step = -1
        self.evicted_step = -1
        # With in-flight weight updates: its trajectories' token counts (the longest first), the
        # tokens of each decoded once it stopped (-1 before), and the tokens it put. With a token
        # budget: its trajectories' tokens in put order, the tokens it will put unless evicted
        # first, and those it put.
        self.lengths: tuple[int, ...] = ()
        self.decoded = -1
        self.planned_tokens = 0
        self.put_tokens = 0

    def puts(self, group_size: int) -> int:
        """How many of its ``group_size`` trajectories it puts: all, or if it fails part-way,
        those finished by then."""
        if self.fail_after is None:
            return group_size
        return int(group_size * self.fail_after / self.seconds)
