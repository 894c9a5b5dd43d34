"""Per-token arrays of a batch, computed from run-length version segments (pure numpy).

Groundwork for versioned trajectories (issue 22): the arrays ``Batch`` hands the trainer,
built with vector operations only, never a Python loop per token.

**Representation.** A batch's trajectories are described by three int64 arrays, the *runs*
(:func:`pack_runs` builds them from what ``put`` stored, with one loop over trajectories):

- ``run_versions[R]``: the policy version of each run, trajectories concatenated in order;
- ``run_lengths[R]``: its number of tokens, ``>= 1`` (a run never has zero tokens);
- ``run_offsets[n + 1]``: CSR offsets into the runs: trajectory ``i`` owns the runs
  ``run_offsets[i]:run_offsets[i + 1]`` (``run_offsets[0] == 0``, ``run_offsets[-1] == R``).

A trajectory without segments has one run ``(default_version, tokens)`` when ``tokens > 0`` and
no run when ``tokens == 0``; functions that need a version for a trajectory without runs (its head
and tail) take ``default_versions[n]``. Per-token arrays are packed the same way: trajectory ``i``
owns tokens ``offsets[i]:offsets[i + 1]`` of ``offsets = token_offsets(...)``.

**Definitions** (exact integers; ``g`` the target version, ``S`` the sync step, ``span = T*S``):
a token of version ``v`` has lag ``g - v + 1``, staleness ``(g - v + 1) / S``, and is *fresh*
iff ``g - v + 1 <= span``.

**Bounds.** Versions, ``g`` and token counts are ints in ``[0, 2**63 - 1]`` (the buffer's step
bound), the total number of tokens at most ``2**63 - 1``; ``span`` and ``S`` are ints ``>= 1``
(``span`` may exceed int64: it is only compared in Python). No int64 operation here can
overflow within these bounds: freshness compares ``v >= g + 1 - span`` with the threshold
computed in Python ints and clamped at 0, and staleness subtracts ``g - v`` (in
``[-(2**63 - 1), 2**63 - 1]``) before converting to float. Staleness is exactly
``(g - v + 1) / S`` correctly rounded whenever ``|g - v| < 2**53``. Every check here is
O(runs) or O(trajectories), never O(tokens): run arrays are validated (types, ranges, CSR
shape, no overflow of a token total) on entry to each function.

No stalebuf import on purpose: ``_batch`` will import this module, and ``_validation`` imports
``records``, which imports ``_batch``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "MAX_INT",
    "fresh_token_counts",
    "freshness_mask",
    "head_tail_staleness",
    "head_tail_versions",
    "loss_excluded",
    "pack_runs",
    "packed_freshness_mask",
    "padded",
    "staleness",
    "token_counts",
    "token_offsets",
    "token_versions",
]

#: The largest version, target version, token count or token total: a signed 64-bit integer
#: (equal to ``_validation.MAX_INT``, the buffer's step bound; a test checks it).
MAX_INT = 2**63 - 1

Int64s = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
Floats = npt.NDArray[np.float64]

_END = object()


# -- validation (O(runs) or O(trajectories)) --------------------------------------------------


def _int_array(name: str, value: npt.ArrayLike) -> Int64s:
    """``value`` as a 1-D int64 array (no copy when it is one already).

    Raises:
        TypeError: not an integer array, or one that int64 cannot hold safely (uint64).
        ValueError: not one-dimensional.
    """
    array = np.asarray(value)
    if array.dtype != np.int64:
        if array.size == 0:  # np.asarray([]) is float64: an empty list is a valid empty array
            array = array.astype(np.int64)
        elif array.dtype.kind not in "iu":
            raise TypeError(f"{name} must be an array of ints, got dtype {array.dtype}")
        elif not np.can_cast(array.dtype, np.int64):
            raise TypeError(f"{name} must be an array of ints int64 can hold, got dtype {array.dtype}")
        else:
            array = array.astype(np.int64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def _int_arg(name: str, value: object, low: int, high: int | None = MAX_INT) -> int:
    """``value`` as a Python int in ``[low, high]`` (numpy ints accepted, bool refused).

    Raises:
        TypeError: not an int.
        ValueError: out of range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    number = int(value)
    if number < low or (high is not None and number > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bound}, got {number}")
    return number


def _offsets(name: str, value: npt.ArrayLike, end: int) -> Int64s:
    """``value`` as CSR offsets: 1-D int64, first 0, non-decreasing, last ``end``.

    Raises:
        TypeError: as :func:`_int_array`.
        ValueError: any other violation.
    """
    offsets = _int_array(name, value)
    if offsets.size == 0 or offsets[0] != 0 or offsets[-1] != end:
        raise ValueError(f"{name} must start at 0 and end at {end}")
    if not np.all(offsets[1:] >= offsets[:-1]):
        raise ValueError(f"{name} must be non-decreasing")
    return offsets


def _cumsum0(counts: Int64s) -> Int64s:
    """``[0, c0, c0 + c1, ...]`` in int64 (unchecked)."""
    out = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _check_versions(name: str, value: npt.ArrayLike) -> Int64s:
    """``value`` as 1-D int64 versions, all ``>= 0``.

    Raises:
        TypeError, ValueError: as :func:`_int_array`, or a negative version.
    """
    versions = _int_array(name, value)
    if versions.size and versions.min() < 0:
        raise ValueError(f"{name} must be >= 0, got {int(versions.min())}")
    return versions


def _check_lengths(run_lengths: npt.ArrayLike) -> Int64s:
    """``run_lengths`` as int64, checked: all ``>= 1``, with a total that fits int64.

    Raises:
        TypeError, ValueError: as :func:`_int_array`, or a violation.
    """
    lengths = _int_array("run_lengths", run_lengths)
    if lengths.size == 0:
        return lengths
    if lengths.min() < 1:
        raise ValueError(f"run_lengths must be >= 1, got {int(lengths.min())}")
    # R * max <= MAX_INT proves the total fits, with two cheap reductions; only beyond it (runs
    # of ~2**48 tokens) is the exact check needed: a cumulative sum of positive int64 terms
    # is strictly increasing unless it wrapped.
    if lengths.max() > MAX_INT // lengths.size:
        total = _cumsum0(lengths)
        if not np.all(total[1:] > total[:-1]):
            raise ValueError(f"run_lengths total more than {MAX_INT} tokens")
    return lengths


def _check_runs(run_versions: npt.ArrayLike, run_lengths: npt.ArrayLike) -> tuple[Int64s, Int64s]:
    """The run arrays as int64, checked: versions ``>= 0``, lengths as :func:`_check_lengths`,
    equal sizes.

    Raises:
        TypeError, ValueError: as :func:`_int_array`, or a violation.
    """
    versions = _check_versions("run_versions", run_versions)
    lengths = _check_lengths(run_lengths)
    if versions.size != lengths.size:
        raise ValueError(f"run_versions has {versions.size} runs, run_lengths {lengths.size}")
    return versions, lengths


def _fresh_threshold(target_version: object, span: object) -> int:
    """The smallest fresh version, ``g + 1 - span``, clamped at 0 (versions are ``>= 0``).

    Raises:
        TypeError, ValueError: ``target_version`` not an int in ``[0, MAX_INT]``, ``span`` not
            an int ``>= 1``.
    """
    g = _int_arg("target_version", target_version, 0)
    window = _int_arg("span", span, 1, None)
    return max(g + 1 - window, 0)


# -- building the runs ----------------------------------------------------------------------


def pack_runs(
    segments: Sequence[tuple[tuple[int, int], ...]],
    tokens: Sequence[int],
    default_versions: Sequence[int],
) -> tuple[Int64s, Int64s, Int64s]:
    """Flatten per-trajectory segments into ``(run_versions, run_lengths, run_offsets)``.

    ``segments[i]`` is trajectory ``i``'s ``((version, n_tokens), ...)`` (``()`` when none),
    ``tokens[i]`` its token count (equal to the segments' total when it has segments) and
    ``default_versions[i]`` the version of a trajectory without segments (its group's start
    version). The values are those ``put`` validated: types are not checked here (a float
    would be truncated by numpy), ranges and consistency are.

    Raises:
        ValueError: the three sequences differ in length, a segment is not a pair, a version
            or default version is negative, an ``n_tokens`` is below 1, a ``tokens`` differs
            from its segments' total (or is negative), or a total exceeds ``MAX_INT``.
        OverflowError: a value above ``MAX_INT``.
    """
    n = len(segments)
    if len(tokens) != n or len(default_versions) != n:
        raise ValueError(
            f"{n} segments, {len(tokens)} tokens and {len(default_versions)} default versions: "
            "one of each per trajectory"
        )
    declared = np.fromiter(tokens, dtype=np.int64, count=n)
    if n and declared.min() < 0:
        raise ValueError(f"tokens must be >= 0, got {int(declared.min())}")
    _check_versions("default_versions", np.fromiter(default_versions, dtype=np.int64, count=n))
    # The only Python loop: it substitutes the default run, so the flattening below is a
    # chain of C iterators feeding np.fromiter.
    runs = [
        seg if seg else ((d, t),) if t else ()
        for seg, t, d in zip(segments, tokens, default_versions, strict=True)
    ]
    run_offsets = _cumsum0(np.fromiter(map(len, runs), dtype=np.int64, count=n))
    n_runs = int(run_offsets[-1])
    flat_iter = itertools.chain.from_iterable(itertools.chain.from_iterable(runs))
    flat = np.fromiter(flat_iter, dtype=np.int64, count=2 * n_runs)
    if next(flat_iter, _END) is not _END:
        raise ValueError("segments must be (version, n_tokens) pairs")
    pairs = flat.reshape(n_runs, 2)
    run_versions, run_lengths = _check_runs(pairs[:, 0].copy(), pairs[:, 1].copy())
    counted = np.diff(_cumsum0(run_lengths)[run_offsets])
    if not np.array_equal(declared, counted):
        first = int(np.flatnonzero(declared != counted)[0])
        raise ValueError(
            f"trajectory {first}: tokens={int(declared[first])} but its runs hold {int(counted[first])}"
        )
    return run_versions, run_lengths, run_offsets


# -- per-token arrays -----------------------------------------------------------------------


def token_offsets(run_lengths: npt.ArrayLike, run_offsets: npt.ArrayLike) -> Int64s:
    """The CSR token offsets ``int64[n + 1]``: trajectory ``i`` owns ``offsets[i]:offsets[i + 1]``.

    Raises:
        TypeError, ValueError: invalid run arrays (see the module docs).
    """
    lengths = _check_lengths(run_lengths)
    return _cumsum0(lengths)[_offsets("run_offsets", run_offsets, lengths.size)]


def token_counts(run_lengths: npt.ArrayLike, run_offsets: npt.ArrayLike) -> Int64s:
    """The number of tokens of each trajectory, ``int64[n]``.

    Raises:
        TypeError, ValueError: invalid run arrays (see the module docs).
    """
    return np.diff(token_offsets(run_lengths, run_offsets))


def token_versions(
    run_versions: npt.ArrayLike, run_lengths: npt.ArrayLike, run_offsets: npt.ArrayLike
) -> tuple[Int64s, Int64s]:
    """The version of every token and the CSR offsets: ``(int64[total], int64[n + 1])``.

    Raises:
        TypeError, ValueError: invalid run arrays (see the module docs).
    """
    versions, lengths = _check_runs(run_versions, run_lengths)
    offsets = _cumsum0(lengths)[_offsets("run_offsets", run_offsets, lengths.size)]
    return np.repeat(versions, lengths), offsets


def freshness_mask(
    run_versions: npt.ArrayLike, run_lengths: npt.ArrayLike, target_version: int, span: int
) -> Bools:
    """``bool[total]``: True where a token may enter the loss, ``g - v + 1 <= span``.

    The comparison is made once per run and only the booleans are repeated, so the cost is
    one ``np.repeat`` of a bool array (plus O(runs) work); offsets as :func:`token_offsets`.

    Raises:
        TypeError, ValueError: invalid run arrays, ``target_version`` or ``span``.
    """
    versions, lengths = _check_runs(run_versions, run_lengths)
    fresh_runs = versions >= _fresh_threshold(target_version, span)
    return np.repeat(fresh_runs, lengths)


def packed_freshness_mask(run_versions: Int64s, run_lengths: Int64s, target_version: int, span: int) -> Bools:
    """:func:`freshness_mask` of runs a batch packed from checked records (int64 arrays of
    versions ``>= 0`` and lengths ``>= 1``): the same answer without re-checking the arrays.

    Raises:
        TypeError, ValueError: invalid ``target_version`` or ``span``.
    """
    fresh_runs: Bools = run_versions >= _fresh_threshold(target_version, span)
    return np.repeat(fresh_runs, run_lengths)


def fresh_token_counts(
    run_versions: npt.ArrayLike,
    run_lengths: npt.ArrayLike,
    run_offsets: npt.ArrayLike,
    target_version: int,
    span: int,
) -> Int64s:
    """The number of fresh tokens of each trajectory, ``int64[n]`` (masked = tokens - fresh).

    Raises:
        TypeError, ValueError: invalid run arrays, ``target_version`` or ``span``.
    """
    versions, lengths = _check_runs(run_versions, run_lengths)
    bounds = _offsets("run_offsets", run_offsets, lengths.size)
    return _fresh_counts(versions, lengths, bounds, _fresh_threshold(target_version, span))


def _fresh_counts(versions: Int64s, lengths: Int64s, bounds: Int64s, threshold: int) -> Int64s:
    """The fresh tokens per trajectory of checked runs (unchecked; see :func:`fresh_token_counts`)."""
    fresh_lengths = np.where(versions >= threshold, lengths, 0)
    return np.diff(_cumsum0(fresh_lengths)[bounds])


def loss_excluded(
    run_versions: npt.ArrayLike,
    run_lengths: npt.ArrayLike,
    run_offsets: npt.ArrayLike,
    target_version: int,
    span: int,
) -> Bools:
    """``bool[n]``: True for a trajectory with at least one token, all of them stale.

    Raises:
        TypeError, ValueError: invalid run arrays, ``target_version`` or ``span``.
    """
    versions, lengths = _check_runs(run_versions, run_lengths)
    bounds = _offsets("run_offsets", run_offsets, lengths.size)
    fresh = _fresh_counts(versions, lengths, bounds, _fresh_threshold(target_version, span))
    # Runs hold >= 1 token each, so "has a token" is "has a run".
    excluded: Bools = (bounds[1:] > bounds[:-1]) & (fresh == 0)
    return excluded


# -- per-trajectory versions and staleness ---------------------------------------------------


def head_tail_versions(
    run_versions: npt.ArrayLike, run_offsets: npt.ArrayLike, default_versions: npt.ArrayLike
) -> tuple[Int64s, Int64s]:
    """The oldest (head) and newest (tail) version of each trajectory, ``(int64[n], int64[n])``;
    a trajectory without runs gets its default version for both.

    Raises:
        TypeError, ValueError: invalid arrays, or ``default_versions`` not of size ``n``.
    """
    versions = _check_versions("run_versions", run_versions)
    bounds = _offsets("run_offsets", run_offsets, versions.size)
    head = _check_versions("default_versions", default_versions).copy()
    if head.size != bounds.size - 1:
        raise ValueError(f"default_versions has {head.size} entries for {bounds.size - 1} trajectories")
    tail = head.copy()
    # reduceat gives an empty slice the element at its start (not an identity) and refuses a
    # start equal to R, so reduce over the trajectories that have runs only: their starts are
    # strictly increasing and each slice runs exactly to the next one's start (the empty
    # trajectories in between start and end there too), the last to R.
    has_runs = bounds[1:] > bounds[:-1]
    if versions.size:
        starts = bounds[:-1][has_runs]
        head[has_runs] = np.minimum.reduceat(versions, starts)
        tail[has_runs] = np.maximum.reduceat(versions, starts)
    return head, tail


def staleness(versions: npt.ArrayLike, target_version: int, sync_step: int) -> Floats:
    """``(g - v + 1) / S`` for each version, as float64 (exact lag below ``2**53``).

    Raises:
        TypeError, ValueError: invalid ``versions``, ``target_version`` or ``sync_step``.
    """
    values = _check_versions("versions", versions)
    g = _int_arg("target_version", target_version, 0)
    step = _int_arg("sync_step", sync_step, 1)
    # g - v cannot overflow for g, v in [0, MAX_INT]; g - v + 1 could (g = MAX_INT, v = 0).
    behind: Int64s = np.int64(g) - values
    lag = behind.astype(np.float64)
    lag += 1.0
    lag /= step
    return lag


def head_tail_staleness(
    run_versions: npt.ArrayLike,
    run_offsets: npt.ArrayLike,
    default_versions: npt.ArrayLike,
    target_version: int,
    sync_step: int,
) -> tuple[Floats, Floats]:
    """The staleness of each trajectory's head and tail, ``(float64[n], float64[n])``; the
    head's is the larger (it is the oldest version).

    Raises:
        TypeError, ValueError: as :func:`head_tail_versions` and :func:`staleness`.
    """
    head, tail = head_tail_versions(run_versions, run_offsets, default_versions)
    return staleness(head, target_version, sync_step), staleness(tail, target_version, sync_step)


# -- padding -------------------------------------------------------------------------------


def _fill_value(fill: object, dtype: np.dtype[Any]) -> Any:
    """``fill`` converted to ``dtype``; for bool and integer dtypes it must convert exactly.

    Raises:
        ValueError: ``fill`` cannot be converted, or would change value (1.5 or 2**70 into
            int64, 2 into bool); floats take numpy's nearest value.
    """
    try:
        value = np.array(fill, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"fill of type {type(fill).__name__} cannot be stored as {dtype}") from exc
    if dtype.kind in "biu" and not bool(value == fill):
        # Builtin numbers only are shown: a user object's repr may raise or be huge.
        shown = repr(fill) if type(fill) in (int, float, bool) else f"of type {type(fill).__name__}"
        raise ValueError(f"fill {shown} is not exactly representable as {dtype}")
    return value


def padded(
    array: npt.ArrayLike, offsets: npt.ArrayLike, *, pad_to: int | None = None, fill: object = 0
) -> npt.NDArray[Any]:
    """The packed per-token ``array`` as ``(n, L, *array.shape[1:])``, each row padded with ``fill``.

    ``L`` is ``pad_to`` or the longest trajectory; the dtype is ``array``'s. One boolean-mask
    scatter: the True cells of ``arange(L) < lengths[:, None]``, read row by row, are exactly
    the packed order.

    Raises:
        TypeError: ``offsets`` not integers, ``pad_to`` not an int.
        ValueError: ``array`` is a scalar, ``offsets`` are not CSR offsets ending at
            ``len(array)``, ``pad_to`` is shorter than the longest trajectory, or ``fill`` does
            not fit the dtype (see :func:`_fill_value`).
    """
    values = np.asarray(array)
    if values.ndim == 0:
        raise ValueError("array must have at least one dimension (the tokens)")
    bounds = _offsets("offsets", offsets, len(values))
    lengths = np.diff(bounds)
    longest = int(lengths.max()) if lengths.size else 0
    width = longest if pad_to is None else _int_arg("pad_to", pad_to, 0)
    if width < longest:
        raise ValueError(f"pad_to={width} is shorter than the longest trajectory ({longest} tokens)")
    out = np.full((lengths.size, width, *values.shape[1:]), _fill_value(fill, values.dtype), values.dtype)
    out[np.arange(width) < lengths[:, None]] = values
    return out
