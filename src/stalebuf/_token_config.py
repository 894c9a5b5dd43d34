"""Checking the token-admission fields of :class:`~stalebuf.SamplerConfig`.

``admission_token_budget`` (tokens the trainer takes per step: the per-dispatch-step cap of
token admission), ``max_tokens_per_group`` (``M``: what an in-flight group reserves, and the
most tokens a group may hold) and ``max_resident_tokens`` (a cap on a partition's resident
tokens, reservations included). Each field is checked alone by its validator; the rules across
fields (and with ``admission_batch_size`` and the mixture) by :func:`check_token_admission`
once every field is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._validation import int_at_least
from .errors import ConfigError

__all__ = ["TOKEN_FIELDS", "check_token_admission", "drop_unset_token_fields", "optional_tokens"]

#: The token fields, all None by default.
TOKEN_FIELDS = ("admission_token_budget", "max_tokens_per_group", "max_resident_tokens")


def drop_unset_token_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Remove the token fields that are None from a config's ``fields`` (in place; returned):
    a checkpoint of a buffer without token caps then holds what releases before them wrote, and
    they read it (a missing field takes its default)."""
    for name in TOKEN_FIELDS:
        if fields.get(name, 0) is None:
            del fields[name]
    return fields


def optional_tokens(label: str) -> Any:
    """Return a validator accepting None or an int >= 1 (below 2**63; bools refused)."""
    check = int_at_least(label, 1)

    def validate(instance: object, attribute: object, value: object) -> None:
        if value is not None:
            check(instance, attribute, value)

    return validate


def check_token_admission(
    budget: int | None,
    per_group: int | None,
    resident: int | None,
    *,
    batch_size: int | None,
    threshold: int | None,
    mixture: Mapping[str, float] | None,
) -> None:
    """The rules across the token fields (``budget``: ``admission_token_budget``,
    ``per_group``: ``max_tokens_per_group``, ``resident``: ``max_resident_tokens``).

    Raises:
        ConfigError: ``admission_token_budget`` with ``admission_batch_size`` (one unit per
            admission), without ``max_tokens_per_group`` or a threshold, or below
            ``max_tokens_per_group``; ``max_resident_tokens`` without ``max_tokens_per_group``
            or below it; either cap with a task mixture (per-task token quotas do not exist).
    """
    if budget is not None:
        if batch_size is not None:
            raise ConfigError(
                "admission_token_budget and admission_batch_size are exclusive: admission counts "
                "either tokens or groups per dispatch step, not both"
            )
        if threshold is None:
            raise ConfigError(
                "admission_token_budget needs a max_off_policy_threshold (its tags close by the drop "
                "rule, and residency is bounded by T*S*admission_token_budget)"
            )
        if per_group is None:
            raise ConfigError(
                "admission_token_budget needs max_tokens_per_group: an in-flight group reserves that "
                "many tokens until it ends (e.g. n * max_response_length)"
            )
        if per_group > budget:
            raise ConfigError(
                f"max_tokens_per_group ({per_group}) must be <= admission_token_budget ({budget}): "
                "no group could ever be admitted"
            )
    if resident is not None:
        if per_group is None:
            raise ConfigError(
                "max_resident_tokens needs max_tokens_per_group: an in-flight group reserves that "
                "many tokens against the cap until it ends"
            )
        if resident < per_group:
            raise ConfigError(
                f"max_resident_tokens ({resident}) must be >= max_tokens_per_group ({per_group}): "
                "no group could ever be admitted"
            )
    if mixture is not None and (budget is not None or resident is not None):
        raise ConfigError(
            "admission_token_budget and max_resident_tokens cannot be used with a task mixture: "
            "a mixture splits admission into per-task quotas of groups, and per-task token quotas "
            "do not exist yet"
        )
