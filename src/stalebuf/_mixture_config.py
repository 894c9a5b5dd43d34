"""Checking the task-mixture fields of :class:`~stalebuf.SamplerConfig`.

``mixture`` (task name -> weight), ``mixture_tag`` (the group tag naming a group's task),
``mixture_policy`` ("wait" or "borrow") and ``task_thresholds`` (task -> its own threshold).
The cross-field rules (thresholds name tasks of the mixture; no task gets a quota of 0 from
``admission_batch_size``) are checked once every field is set: :func:`check_mixture`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from types import MappingProxyType
from typing import Any

from ._quotas import normalised, quotas
from ._validation import MAX_INT, describe
from .errors import ConfigError

__all__ = ["MIXTURE_POLICIES", "check_mixture", "to_mixture", "to_task_thresholds"]

#: Accepted values of ``mixture_policy``.
MIXTURE_POLICIES: tuple[str, ...] = ("wait", "borrow")


def _items(name: str, value: object) -> list[tuple[Any, Any]]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a mapping, got {describe(value)}")
    try:
        return list(value.items())
    except Exception as exc:  # a user mapping whose iteration or lookup raises
        raise ConfigError(f"{name} could not be read: {type(exc).__name__}") from exc


def _finite(weight: Real) -> bool:
    """Whether ``weight`` is a finite number a float can hold (an int too large for one, whose
    ``math.isfinite`` raises OverflowError, is refused like an infinite weight)."""
    try:
        return math.isfinite(weight)
    except OverflowError:
        return False


def to_mixture(value: object) -> Mapping[str, float] | None:
    """``mixture`` as a read-only mapping, tasks sorted by name (None stays None).

    Raises:
        ConfigError: not a mapping of non-empty task names to finite numbers > 0, or empty.
    """
    if value is None:
        return None
    checked: dict[str, Any] = {}
    for task, weight in _items("mixture", value):
        if type(task) is not str or not task:
            raise ConfigError(f"mixture keys must be non-empty task names (str), got {describe(task)}")
        if isinstance(weight, bool) or not isinstance(weight, Real) or not _finite(weight) or weight <= 0:
            raise ConfigError(
                f"mixture[{describe(task)}] must be a finite number > 0, got {describe(weight)}"
            )
        checked[task] = weight
    if not checked:
        raise ConfigError("mixture must name at least one task (or be None: no mixture)")
    return MappingProxyType(dict(sorted(checked.items())))


def to_task_thresholds(value: object) -> Mapping[str, int]:
    """``task_thresholds`` as a read-only mapping, tasks sorted by name.

    Raises:
        ConfigError: not a mapping of task names to ints >= 1.
    """
    if value is None:
        value = {}
    checked: dict[str, int] = {}
    for task, threshold in _items("task_thresholds", value):
        if type(task) is not str or not task:
            raise ConfigError(f"task_thresholds keys must be task names (str), got {describe(task)}")
        if type(threshold) is not int or not 1 <= threshold <= MAX_INT:  # as max_off_policy_threshold
            raise ConfigError(
                f"task_thresholds[{describe(task)}] must be an int >= 1 (and < 2**63), "
                f"got {describe(threshold)}"
            )
        checked[task] = threshold
    return MappingProxyType(dict(sorted(checked.items())))


def check_mixture(
    mixture: Mapping[str, float] | None,
    tag: object,
    thresholds: Mapping[str, int],
    admission_batch_size: int | None,
) -> None:
    """The rules across the mixture fields.

    Raises:
        ConfigError: ``mixture_tag`` is not a non-empty str; ``task_thresholds`` without a
            mixture, or naming a task not in it; an ``admission_batch_size`` that gives some
            task a quota of 0 (it would starve that task silently).
    """
    if type(tag) is not str or not tag:
        raise ConfigError(f"mixture_tag must be a non-empty str (a group tag name), got {describe(tag)}")
    if mixture is None:
        if thresholds:
            raise ConfigError("task_thresholds needs a mixture (they override T for the tasks of one)")
        return
    unknown = sorted(set(thresholds) - set(mixture))
    if unknown:
        raise ConfigError(f"task_thresholds names tasks that are not in the mixture: {describe(unknown)}")
    if admission_batch_size is not None:
        starved = [
            task for task, quota in quotas(normalised(mixture), admission_batch_size).items() if not quota
        ]
        if starved:
            raise ConfigError(
                f"admission_batch_size={admission_batch_size} gives the task(s) {describe(starved)} a quota "
                "of 0 (largest remainder on the weights): they would never be admitted; raise it"
            )
