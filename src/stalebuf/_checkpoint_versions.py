"""Checking the versions and token counts a checkpoint's trajectories carry.

A trajectory holds run-length ``(version, n_tokens)`` segments and a token count: either no
segments and any count (the trajectory was put with ``tokens=`` or with neither), or segments of
an int version >= 0 and an int count >= 1 each, whose counts sum to its token count (what
``put`` makes of ``versions=``). :func:`checked_versions` checks one trajectory and names the
field at fault; :func:`valid_versions` checks every trajectory at once in C-level loops and only
says whether they all are (the fast scan of ``_checkpoint_scan``). Both also hold a trajectory's
packed copy of its versions (``Trajectory._runs``, what the batch arrays read) to its versions.
"""

from __future__ import annotations

import struct
from functools import partial
from itertools import chain, compress, repeat
from operator import itemgetter, mul
from typing import Any

from ._validation import MAX_INT, describe
from .errors import CheckpointError

__all__ = ["checked_versions", "valid_versions"]

Segments = tuple[tuple[int, int], ...]
_SEQUENCES = (tuple, list)
_second = itemgetter(1)
#: A trajectory's segments to their counts, as a C-level callable.
_counts = partial(map, _second)
#: Bytes per packed segment (two native int64, as ``records.pack_runs`` packs them).
_PAIR_BYTES = struct.calcsize("=2q")


def _invalid(where: str, why: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint's {where} {why}")


def _an_int(value: object, low: int) -> bool:
    return type(value) is int and low <= value <= MAX_INT


def checked_versions(where: str, versions: object, tokens: object) -> Segments:
    """Return the segments of the trajectory at ``where``: ``versions`` itself when it is a tuple
    of pairs (tuples), else a tuple of tuples copied from its lists (a JSON form).

    Raises:
        CheckpointError: a segment is not a pair of an int version >= 0 and an int count >= 1,
            the segments hold more than 2**63 - 1 tokens, ``tokens`` is not an int >= 0, or it
            differs from the segments' total (named).
    """
    if type(versions) not in _SEQUENCES:
        raise _invalid(
            f"{where}.versions",
            f"must be a tuple of (version, n_tokens) pairs, got {type(versions).__name__}",
        )
    canonical = type(versions) is tuple
    pairs: list[tuple[int, int]] = []
    items: tuple[Any, ...] | list[Any] = versions  # type: ignore[assignment]
    for position, pair in enumerate(items):
        at = f"{where}.versions[{position}]"
        if type(pair) not in _SEQUENCES or len(pair) != 2:
            raise _invalid(at, f"must be a (version, n_tokens) pair, got {describe(pair)}")
        version, count = pair
        if not _an_int(version, 0):
            raise _invalid(at, f"must start with a version, an int >= 0, got {describe(version)}")
        if not _an_int(count, 1):
            raise _invalid(at, f"must end with n_tokens, an int >= 1, got {describe(count)}")
        canonical = canonical and type(pair) is tuple
        pairs.append((version, count))
    total = sum(count for _, count in pairs)
    if total > MAX_INT:
        raise _invalid(f"{where}.versions", "hold more than 2**63 - 1 tokens")
    if not _an_int(tokens, 0):
        raise _invalid(f"{where}.tokens", f"must be an int >= 0 (and < 2**63), got {describe(tokens)}")
    if pairs and total != tokens:
        raise _invalid(f"{where}.tokens", f"is {tokens}, but its versions hold {total} tokens")
    return versions if canonical else tuple(pairs)  # type: ignore[return-value]


def valid_versions(versions: list[Any], tokens: list[Any], runs: list[Any]) -> bool:
    """Whether every trajectory's ``versions``, ``tokens`` and ``runs`` (its versions packed for
    the batch arrays; one item each per trajectory) pass :func:`checked_versions` unchanged
    (tuples of tuples) and agree; without a Python call per trajectory or segment."""
    if set(map(type, tokens)) != {int} or min(tokens) < 0 or max(tokens) > MAX_INT:
        return False
    if set(map(type, versions)) != {tuple} or set(map(type, runs)) != {bytes}:
        return False
    with_segments = list(map(bool, versions))
    if not any(with_segments):
        return not any(runs)
    pairs = list(chain.from_iterable(versions))
    if set(map(type, pairs)) != {tuple} or set(map(len, pairs)) != {2}:
        return False
    flat = list(chain.from_iterable(pairs))
    if set(map(type, flat)) != {int}:
        return False
    numbers, counts = flat[0::2], flat[1::2]
    if min(numbers) < 0 or max(numbers) > MAX_INT or min(counts) < 1 or max(counts) > MAX_INT:
        return False
    # The packed runs: each trajectory's 16 bytes per segment, all of them the segments' ints.
    if list(map(len, runs)) != list(map(mul, map(len, versions), repeat(_PAIR_BYTES))):
        return False
    if b"".join(runs) != struct.pack(f"={len(flat)}q", *flat):
        return False
    # Each trajectory's total: its counts summed.
    totals = list(map(sum, map(_counts, compress(versions, with_segments))))
    return totals == list(compress(tokens, with_segments))
