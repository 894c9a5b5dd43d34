"""Built-in group filters for ``ReplayBuffer(config, filters=[...])``.

A filter is a plain callable ``filter(group) -> bool``: True keeps the group, False filters it
(it is evicted at once, reason ``"filtered"``, and frees its admission slot). The built-ins are
small classes, so they pickle (a Ray actor runs its filters in its own process).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from ._validation import describe, describe_typed
from .errors import ConfigError
from .records import Group, Trajectory

__all__ = ["GroupFilter", "MinTrajectories", "ZeroVariance", "min_trajectories", "zero_variance"]

#: What a filter is: called with a group that just became FINISHED; a true result keeps it.
GroupFilter = Callable[[Group], object]


class ZeroVariance:
    """Keep a group unless all its trajectories have the same score (DAPO's dynamic sampling).

    ``score`` is a tag name (each trajectory's ``tags[score]``) or a callable
    ``Trajectory -> float``. A group with fewer than two trajectories is kept.
    """

    __slots__ = ("score",)

    def __init__(self, score: str | Callable[[Trajectory], Any]) -> None:
        if not (isinstance(score, str) and score) and not callable(score):
            raise ConfigError(
                f"zero_variance needs a tag name (a non-empty str) or a callable, got {describe(score)}"
            )
        self.score = score

    def _score(self, trajectory: Trajectory) -> Any:
        score = self.score
        if isinstance(score, str):
            try:
                return trajectory.tags[score]
            except KeyError:
                raise KeyError(
                    f"trajectory {trajectory.key!r} has no tag {score!r} (zero_variance reads scores there)"
                ) from None
        return score(trajectory)

    def __call__(self, group: Group) -> bool:
        """Whether ``group``'s trajectories do not all score the same.

        Raises:
            KeyError: a trajectory lacks the score tag (named).
            Exception: whatever the score callable raised.
        """
        trajectories = group.trajectories
        if len(trajectories) < 2:
            return True
        first = self._score(trajectories[0])
        return any(self._score(trajectory) != first for trajectory in trajectories[1:])

    def __repr__(self) -> str:
        return f"zero_variance({self.score!r})"


class MinTrajectories:
    """Keep groups with at least ``k`` trajectories."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        if type(k) is not int or k < 1:
            raise ConfigError(f"min_trajectories needs an int k >= 1, got {describe(k)}")
        self.k = k

    def __call__(self, group: Group) -> bool:
        """Whether ``group`` holds at least ``k`` trajectories."""
        return len(group.trajectories) >= self.k

    def __repr__(self) -> str:
        return f"min_trajectories({self.k})"


def zero_variance(score: str | Callable[[Trajectory], Any]) -> ZeroVariance:
    """A filter keeping a group unless all its trajectories have the same score (see
    :class:`ZeroVariance`).

    Raises:
        ConfigError: ``score`` is neither a non-empty str nor a callable.
    """
    return ZeroVariance(score)


def min_trajectories(k: int) -> MinTrajectories:
    """A filter keeping groups with at least ``k`` trajectories.

    Raises:
        ConfigError: ``k`` is not an int >= 1.
    """
    return MinTrajectories(k)


def check_filters(filters: object) -> tuple[GroupFilter, ...]:
    """Return ``filters`` as a tuple of plain callables.

    Raises:
        ConfigError: not a collection of callables (a str or a single callable is not one), or
            one is a coroutine function (a filter runs inside the call that finished a group).
    """
    if isinstance(filters, (str, bytes)) or callable(filters) or not isinstance(filters, Iterable):
        raise ConfigError(f"filters must be a sequence of callables, got {describe_typed(filters)}")
    checked: tuple[GroupFilter, ...] = tuple(filters)
    for position, group_filter in enumerate(checked):
        if not callable(group_filter):
            raise ConfigError(f"filters[{position}] must be callable, got {describe_typed(group_filter)}")
        call = getattr(group_filter, "__call__", None)  # noqa: B004 - an object's own __call__
        if inspect.iscoroutinefunction(group_filter) or inspect.iscoroutinefunction(call):
            raise ConfigError(
                f"filters[{position}] is async; a filter must be a plain (synchronous) callable: it "
                "runs inside the call that finished the group"
            )
    return checked
