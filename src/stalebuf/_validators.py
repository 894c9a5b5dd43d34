"""attrs validators for configuration records; each raises ConfigError naming its field."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

__all__ = ["int_at_least", "one_of"]


def int_at_least(label: str, low: int) -> Any:
    """Return a validator accepting an int >= ``low`` (bool rejected)."""

    def check(_instance: object, _attribute: object, value: object) -> None:
        if type(value) is not int or value < low:
            raise ConfigError(f"{label} must be an int >= {low}, got {value!r}")

    return check


def one_of(label: str, choices: tuple[str, ...]) -> Any:
    """Return a validator accepting one of ``choices``; the message lists them."""

    def check(_instance: object, _attribute: object, value: object) -> None:
        if value not in choices:
            raise ConfigError(f"{label} must be one of {', '.join(map(repr, choices))}; got {value!r}")

    return check
