"""Argument validation shared by the buffer's public methods.

Each check raises before anything changes, with a message that names the argument.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .records import EMPTY_TAGS

__all__ = [
    "check_batch_size",
    "check_index",
    "check_partition",
    "check_step",
    "check_tags",
    "check_timeout",
    "check_uid",
]


def check_uid(uid: object) -> str:
    """Return ``uid`` if it is a non-empty str without "_"; raise TypeError/ValueError otherwise."""
    if type(uid) is not str:
        raise TypeError(f"uid must be a str, got {type(uid).__name__}")
    if not uid or "_" in uid:
        raise ValueError(
            f"uid must be a non-empty str without '_' (trajectory keys are uid_session_index), got {uid!r}"
        )
    return uid


def check_step(value: object, name: str = "global_steps") -> int:
    """Return ``value`` if it is an int >= 0 (bool rejected)."""
    if type(value) is not int:
        raise TypeError(f"{name} must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


check_index = check_step


def check_batch_size(value: object) -> int:
    """Return ``value`` if it is an int >= 1 (bool rejected); raise ValueError otherwise."""
    if type(value) is not int or value < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {value!r}")
    return value


def check_partition(value: object) -> str:
    """Return ``value`` if it is a non-empty str."""
    if type(value) is not str:
        raise TypeError(f"partition must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError("partition must be a non-empty str")
    return value


def check_tags(tags: object) -> Mapping[str, Any]:
    """Return a private read-only copy of ``tags`` (None gives the shared empty mapping)."""
    if tags is None:
        return EMPTY_TAGS
    if not isinstance(tags, Mapping):
        raise TypeError(f"tags must be a mapping or None, got {type(tags).__name__}")
    return MappingProxyType(dict(tags)) if tags else EMPTY_TAGS


def check_timeout(value: object) -> float | None:
    """Return ``value`` if it is None or a finite real >= 0 (bool rejected)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {value!r}")
    if math.isnan(value) or value < 0:
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {value!r}")
    return float(value)
