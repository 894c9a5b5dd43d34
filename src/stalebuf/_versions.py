"""Policy versions of tokens: checking what producers give, and a group's head and tail.

A trajectory carries run-length *segments* ``((version, n_tokens), ...)`` in generation order
and a token count. Its **head** is the oldest version among its tokens (the min over its
segments), its **tail** the newest (the max); a trajectory without segments has head = tail =
its group's start version. A group's head is the min over its trajectories' heads **and** its
start version; its tail is the max over its trajectories' tails (the start version when it has
no trajectories). Without versions anywhere, head = tail = start version = dispatch step.

:class:`VersionSpan` keeps a group's head and tail as trajectories arrive, in O(1) per
trajectory. Which of the two a rule judges a group by is the rule book's choice
(:mod:`stalebuf.policy`); this module only measures.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

from ._validation import MAX_INT, describe

__all__ = [
    "NO_SEGMENTS",
    "VersionSpan",
    "check_group_versions",
    "check_start_version",
    "check_token_count",
    "check_versions",
    "record_span",
    "trajectory_versions",
]

Segments = tuple[tuple[int, int], ...]

#: The segments of a trajectory put without ``versions``.
NO_SEGMENTS: Segments = ()


def _an_int(value: object, name: str) -> int:
    """``value`` as an int (numpy's integers too), never a bool.

    Raises:
        TypeError: not an integer.
    """
    if type(value) is int:
        return value
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {describe(value)}")
    return operator.index(value)  # type: ignore[arg-type]


def check_start_version(version: object, name: str = "version") -> int:
    """Return ``version`` checked: an int in ``[0, 2**63 - 1]`` (a trainer step).

    Raises:
        TypeError: not an int (a bool is not one).
        ValueError: out of range.
    """
    value = _an_int(version, name)
    if not 0 <= value <= MAX_INT:
        raise ValueError(f"{name} must be an int in [0, 2**63 - 1], got {describe(value)}")
    return value


def check_token_count(tokens: object, name: str = "tokens") -> int:
    """Return ``tokens`` checked: an int in ``[0, 2**63 - 1]``.

    Raises:
        TypeError: not an int (a bool is not one).
        ValueError: negative or too large.
    """
    value = _an_int(tokens, name)
    if not 0 <= value <= MAX_INT:
        raise ValueError(f"{name} must be an int in [0, 2**63 - 1], got {describe(value)}")
    return value


def _plain_pairs(versions: object) -> tuple[Segments, int] | None:
    """``(segments, total)`` of a list or tuple of valid ``(int, int)`` tuples or lists (what
    producers pass), checked in one pass without a call per value; None for anything else,
    which :func:`check_versions` then checks (and names) value by value."""
    kind = type(versions)
    if (kind is not tuple and kind is not list) or not versions:
        return None
    total = 0
    pairs: list[tuple[int, int]] = []
    for pair in versions:  # type: ignore[attr-defined]
        kind = type(pair)
        if (kind is not tuple and kind is not list) or len(pair) != 2:
            return None
        version, count = pair
        if type(version) is not int or type(count) is not int or version < 0 or count < 1:
            return None
        total += count
        pairs.append((version, count) if kind is list else pair)
    if total > MAX_INT or max(pairs)[0] > MAX_INT:
        return None
    return tuple(pairs), total


def check_versions(versions: object, name: str = "versions") -> Segments:
    """Return ``versions`` as a tuple of ``(version, n_tokens)`` int pairs, checked.

    Raises:
        TypeError: not a sequence of pairs of ints (a str, a mapping or a set is none).
        ValueError: no pair, a version < 0, an ``n_tokens`` < 1, or a total over 2**63 - 1.
    """
    plain = _plain_pairs(versions)
    if plain is not None:
        return plain[0]
    if isinstance(versions, (str, bytes, bytearray, dict, set, frozenset)) or not isinstance(
        versions, Iterable
    ):
        raise TypeError(
            f"{name} must be a sequence of (version, n_tokens) pairs, got {type(versions).__name__}"
        )
    pairs: list[tuple[int, int]] = []
    total = 0
    for position, pair in enumerate(versions):
        where = f"{name}[{position}]"
        if isinstance(pair, (str, bytes, dict, set, frozenset)) or not isinstance(pair, Iterable):
            raise TypeError(f"{where} must be a (version, n_tokens) pair, got {type(pair).__name__}")
        items = tuple(pair)
        if len(items) != 2:
            raise ValueError(f"{where} must be a (version, n_tokens) pair, got {len(items)} items")
        version = _an_int(items[0], f"{where}'s version")
        count = _an_int(items[1], f"{where}'s n_tokens")
        if not 0 <= version <= MAX_INT:
            raise ValueError(f"{where}'s version must be an int in [0, 2**63 - 1], got {describe(version)}")
        if not 1 <= count <= MAX_INT:
            raise ValueError(f"{where}'s n_tokens must be an int in [1, 2**63 - 1], got {describe(count)}")
        total += count
        if total > MAX_INT:
            raise ValueError(f"{name} holds more than 2**63 - 1 tokens")
        pairs.append((version, count))
    if not pairs:
        raise ValueError(f"{name} must hold at least one (version, n_tokens) pair")
    return tuple(pairs)


def trajectory_versions(versions: object, tokens: object, where: str = "") -> tuple[Segments, int]:
    """Return a trajectory's ``(segments, tokens)`` from what a producer gave ``put``.

    Neither given: ``((), 0)``; ``versions`` only: its segments and their total; ``tokens``
    only: no segments and that count; both: ``tokens`` must equal the segments' total.

    Raises:
        TypeError, ValueError: what :func:`check_versions` and :func:`check_token_count` raise,
            or both given and disagreeing.
    """
    if versions is None:
        return NO_SEGMENTS, (0 if tokens is None else check_token_count(tokens, f"{where}tokens"))
    plain = _plain_pairs(versions)
    if plain is None:
        segments = check_versions(versions, f"{where}versions")
        total = sum(count for _, count in segments)
    else:
        segments, total = plain
    if tokens is not None and check_token_count(tokens, f"{where}tokens") != total:
        raise ValueError(
            f"{where}tokens={describe(tokens)} but {where}versions hold {total} tokens: give one, or "
            "both agreeing"
        )
    return segments, total


class VersionSpan:
    """The head and tail of an in-flight group as its trajectories arrive, and its tokens.

    ``low``/``high`` are the min head and max tail over the trajectories *with* segments
    (:data:`MAX_INT` + 1 and -1 while there is none); ``plain`` counts those without, which
    count at the start version.
    """

    __slots__ = ("high", "low", "plain", "tokens")

    def __init__(self) -> None:
        self.low = MAX_INT + 1
        self.high = -1
        self.plain = 0
        self.tokens = 0

    def add(self, segments: Segments, tokens: int) -> None:
        """Count one more trajectory."""
        self.tokens += tokens
        if not segments:
            self.plain += 1
            return
        for version, _ in segments:
            if version < self.low:
                self.low = version
            if version > self.high:
                self.high = version

    def head(self, start: int) -> int:
        """The group's head, given its start version."""
        return start if start < self.low else self.low

    def tail(self, start: int) -> int:
        """The group's tail, given its start version."""
        if self.plain or self.high < 0:
            return start if start > self.high else self.high
        return self.high


def record_span(start: int, trajectories: Iterable[Any]) -> tuple[int, int, int]:
    """Return ``(head, tail, tokens)`` of a group record with start version ``start``."""
    span = VersionSpan()
    for trajectory in trajectories:
        span.add(trajectory.versions, trajectory.tokens)
    return span.head(start), span.tail(start), span.tokens


def check_group_versions(count: int, versions: object, tokens: object) -> list[tuple[Segments, int]] | None:
    """Check ``put_group``'s per-trajectory ``versions`` and ``tokens`` for ``count``
    trajectories; return one ``(segments, tokens)`` per trajectory, or None when neither was
    given.

    Raises:
        TypeError: a collection is a str, bytes or mapping, or not a collection.
        ValueError: a collection has another length than ``count``.
        TypeError, ValueError: what :func:`trajectory_versions` raises for an entry (named).
    """
    if versions is None and tokens is None:
        return None
    columns = []
    for name, values in (("versions", versions), ("tokens", tokens)):
        if values is None:
            columns.append((None,) * count)
            continue
        if isinstance(values, (str, bytes, bytearray, dict)) or not isinstance(values, Iterable):
            raise TypeError(f"{name} must hold one item per trajectory, got {type(values).__name__}")
        items = tuple(values)
        if len(items) != count:
            raise ValueError(f"{name} has {len(items)} items for {count} payloads")
        columns.append(items)
    return [
        trajectory_versions(segments, total, f"trajectory {position}'s ")
        for position, (segments, total) in enumerate(zip(columns[0], columns[1], strict=True))
    ]
