"""The field helpers of the checkpoint checks: every refusal is a CheckpointError naming the
field (``groups[3].uid``), never another exception from a value a file or a caller made."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ._validation import MAX_INT, describe, describe_error
from .errors import CheckpointError

__all__ = ["copied", "field", "invalid", "sequence", "whole"]

_T = TypeVar("_T")
_SEQUENCES = (tuple, list)


def invalid(where: str, why: str) -> CheckpointError:
    """The error for the field ``where`` of a checkpoint, refused because ``why``."""
    return CheckpointError(f"the checkpoint's {where} {why}")


def field(where: str, check: Callable[[Any], _T], value: object) -> _T:
    """``check(value)``, its error (a live validator's TypeError or ValueError) as a CheckpointError.

    Raises:
        CheckpointError: ``check`` refused ``value``.
    """
    try:
        return check(value)
    except (TypeError, ValueError) as exc:
        raise invalid(where, f"is invalid: {exc}") from exc


def copied(where: str, value: object) -> dict[Any, Any]:
    """A plain copy of the mapping ``value`` (a user mapping may raise while it is read).

    Raises:
        CheckpointError: ``value`` is not a mapping, or reading it raised.
    """
    if not isinstance(value, Mapping):
        raise invalid(where, f"must be a mapping, got {type(value).__name__}")
    try:
        return dict(value)
    except Exception as exc:
        raise invalid(where, f"cannot be read: {describe_error(exc)}") from exc


def sequence(where: str, value: object) -> tuple[Any, ...]:
    """``value`` as a tuple, if it is a tuple or a list (a JSON form).

    Raises:
        CheckpointError: it is neither.
    """
    if type(value) not in _SEQUENCES:
        raise invalid(where, f"must be a tuple, got {type(value).__name__}")
    return tuple(value)  # type: ignore[arg-type]


def whole(where: str, value: object, low: int = 0) -> int:
    """``value`` if it is an int in ``[low, 2**63 - 1]`` (bool refused).

    Raises:
        CheckpointError: it is not.
    """
    if type(value) is not int or not low <= value <= MAX_INT:
        raise invalid(where, f"must be an int >= {low} (and < 2**63), got {describe(value)}")
    return value
