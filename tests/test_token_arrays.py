"""The per-token batch arrays of ``_token_arrays`` against a brute-force pure-Python reference.

Each trajectory is expanded token by token in Python (its segments, or ``tokens`` copies of its
default version), and every array is recomputed from that list: the versions, the CSR offsets,
the freshness mask, head and tail (and their staleness), fresh counts, ``loss_excluded`` and
the padded layout. Then the edge cases (no trajectories, only empty ones, huge runs, bounds at
``2**63 - 1``), the dtypes and every refused input.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalebuf import _token_arrays as ta
from stalebuf._token_arrays import (
    MAX_INT,
    fresh_token_counts,
    freshness_mask,
    head_tail_staleness,
    head_tail_versions,
    loss_excluded,
    pack_runs,
    padded,
    staleness,
    token_counts,
    token_offsets,
    token_versions,
)
from stalebuf._validation import MAX_INT as BUFFER_MAX_INT

Segments = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Traj:
    """One trajectory as ``put`` stores it: its segments, token count and default version."""

    segments: Segments
    tokens: int
    default: int

    def token_list(self) -> list[int]:
        """The version of each token, generation order (the reference expansion)."""
        if not self.segments:
            return [self.default] * self.tokens
        return [v for v, n in self.segments for _ in range(n)]


@st.composite
def trajectories(draw: st.DrawFn, max_version: int = 50) -> Traj:
    """0..5 segments (n_tokens >= 1), or none with 0..6 tokens; versions 0..max_version."""
    version = st.integers(0, max_version)
    segments = tuple(draw(st.lists(st.tuples(version, st.integers(1, 6)), max_size=5)))
    tokens = sum(n for _, n in segments) if segments else draw(st.integers(0, 6))
    return Traj(segments, tokens, draw(version))


def pack(trajs: list[Traj]) -> tuple[Any, Any, Any]:
    return pack_runs([t.segments for t in trajs], [t.tokens for t in trajs], [t.default for t in trajs])


def ref_head_tail(t: Traj) -> tuple[int, int]:
    if not t.segments:
        return t.default, t.default
    versions = [v for v, _ in t.segments]
    return min(versions), max(versions)


def ref_padded(rows: list[list[int]], width: int, fill: int) -> list[list[int]]:
    return [row + [fill] * (width - len(row)) for row in rows]


batches = st.lists(trajectories(), max_size=8)
targets = st.integers(0, 80)
thresholds = st.integers(1, 5)
sync_steps = st.integers(1, 4)


# -- properties against the reference --------------------------------------------------------


@given(batches, targets, thresholds, sync_steps)
def test_every_array_matches_the_token_by_token_reference(
    trajs: list[Traj], g: int, threshold: int, sync_step: int
) -> None:
    span = threshold * sync_step
    rv, rl, ro = pack(trajs)
    rows = [t.token_list() for t in trajs]
    flat = [v for row in rows for v in row]
    expected_offsets = [0]
    for row in rows:
        expected_offsets.append(expected_offsets[-1] + len(row))

    versions, offsets = token_versions(rv, rl, ro)
    assert versions.tolist() == flat
    assert offsets.tolist() == expected_offsets
    assert token_offsets(rl, ro).tolist() == expected_offsets
    assert token_counts(rl, ro).tolist() == [t.tokens for t in trajs]
    assert freshness_mask(rv, rl, g, span).tolist() == [g - v + 1 <= span for v in flat]
    assert fresh_token_counts(rv, rl, ro, g, span).tolist() == [
        sum(g - v + 1 <= span for v in row) for row in rows
    ]
    assert loss_excluded(rv, rl, ro, g, span).tolist() == [
        bool(row) and all(g - v + 1 > span for v in row) for row in rows
    ]

    defaults = [t.default for t in trajs]
    head, tail = head_tail_versions(rv, ro, defaults)
    assert list(zip(head.tolist(), tail.tolist(), strict=True)) == [ref_head_tail(t) for t in trajs]
    head_s, tail_s = head_tail_staleness(rv, ro, defaults, g, sync_step)
    # Python's int / int is correctly rounded: the arrays must equal it bit for bit.
    assert head_s.tolist() == [(g - ref_head_tail(t)[0] + 1) / sync_step for t in trajs]
    assert tail_s.tolist() == [(g - ref_head_tail(t)[1] + 1) / sync_step for t in trajs]


@given(batches, st.integers(0, 3), st.integers(-5, 5))
def test_padded_matches_the_reference(trajs: list[Traj], extra: int, fill: int) -> None:
    rv, rl, ro = pack(trajs)
    versions, offsets = token_versions(rv, rl, ro)
    rows = [t.token_list() for t in trajs]
    longest = max(map(len, rows), default=0)
    out = padded(versions, offsets, fill=fill)
    assert out.shape == (len(trajs), longest)
    assert out.tolist() == ref_padded(rows, longest, fill)
    wider = padded(versions, offsets, pad_to=longest + extra, fill=fill)
    assert wider.tolist() == ref_padded(rows, longest + extra, fill)
    mask = freshness_mask(rv, rl, 30, 10)
    fresh_rows: list[list[int]] = [[30 - v + 1 <= 10 for v in row] for row in rows]
    assert padded(mask, offsets).tolist() == ref_padded(fresh_rows, longest, False)


@given(
    st.lists(st.integers(MAX_INT - 100, MAX_INT) | st.integers(0, 100), min_size=1, max_size=6),
    st.integers(MAX_INT - 100, MAX_INT) | st.integers(0, 100),
    st.integers(1, 2**70),
)
def test_bounds_at_int64_max_do_not_overflow(versions: list[int], g: int, span: int) -> None:
    n = len(versions)
    rv, rl, ro = pack_runs([((v, 1),) for v in versions], [1] * n, [0] * n)
    assert freshness_mask(rv, rl, g, span).tolist() == [g - v + 1 <= span for v in versions]
    assert loss_excluded(rv, rl, ro, g, span).tolist() == [g - v + 1 > span for v in versions]
    got = staleness(rv, g, 3).tolist()
    # Exact below 2**53; beyond, g - v is rounded once before the + 1 and once after.
    for value, v in zip(got, versions, strict=True):
        assert value == pytest.approx((g - v + 1) / 3, rel=2**-51, abs=0)


# -- edge cases ------------------------------------------------------------------------------


def check_dtypes(rv: Any, rl: Any, ro: Any, defaults: list[int]) -> None:
    assert rv.dtype == rl.dtype == ro.dtype == np.int64
    versions, offsets = token_versions(rv, rl, ro)
    assert versions.dtype == offsets.dtype == np.int64
    assert freshness_mask(rv, rl, 5, 2).dtype == np.bool_
    assert loss_excluded(rv, rl, ro, 5, 2).dtype == np.bool_
    assert fresh_token_counts(rv, rl, ro, 5, 2).dtype == np.int64
    assert token_counts(rl, ro).dtype == np.int64
    head, tail = head_tail_versions(rv, ro, defaults)
    assert head.dtype == tail.dtype == np.int64
    assert all(a.dtype == np.float64 for a in head_tail_staleness(rv, ro, defaults, 5, 2))


def test_no_trajectories() -> None:
    rv, rl, ro = pack_runs([], [], [])
    assert (rv.size, rl.size, ro.tolist()) == (0, 0, [0])
    check_dtypes(rv, rl, ro, [])
    versions, offsets = token_versions(rv, rl, ro)
    assert (versions.size, offsets.tolist()) == (0, [0])
    assert freshness_mask(rv, rl, 5, 2).size == 0
    assert loss_excluded(rv, rl, ro, 5, 2).size == 0
    assert all(a.size == 0 for a in head_tail_staleness(rv, ro, [], 5, 2))
    assert padded(versions, offsets).shape == (0, 0)
    assert padded(versions, offsets, pad_to=3).shape == (0, 3)


def test_only_empty_trajectories() -> None:
    defaults = [4, 7, 9]
    rv, rl, ro = pack_runs([(), (), ()], [0, 0, 0], defaults)
    assert (rv.size, ro.tolist()) == (0, [0, 0, 0, 0])
    check_dtypes(rv, rl, ro, defaults)
    head, tail = head_tail_versions(rv, ro, defaults)
    assert head.tolist() == tail.tolist() == defaults
    assert head_tail_staleness(rv, ro, defaults, 9, 2)[0].tolist() == [3.0, 1.5, 0.5]
    assert loss_excluded(rv, rl, ro, 100, 1).tolist() == [False] * 3  # no token: not excluded
    versions, offsets = token_versions(rv, rl, ro)
    assert padded(versions, offsets, fill=-1).shape == (3, 0)
    assert padded(versions, offsets, pad_to=2, fill=-1).tolist() == [[-1, -1]] * 3


def test_empty_trajectories_between_full_ones_do_not_fall_into_reduceat_pitfalls() -> None:
    # reduceat would give an empty slice the element at its start, and refuses a start == R.
    segments: list[Segments] = [(), ((5, 1), (2, 1)), (), (), ((9, 2), (7, 1)), ()]
    defaults = [40, 41, 42, 43, 44, 45]
    rv, _lengths, ro = pack_runs(segments, [0, 2, 0, 0, 3, 0], defaults)
    head, tail = head_tail_versions(rv, ro, defaults)
    assert head.tolist() == [40, 2, 42, 43, 7, 45]
    assert tail.tolist() == [40, 5, 42, 43, 9, 45]


def test_trajectories_without_segments_use_their_default_version() -> None:
    rv, rl, ro = pack_runs([(), ((1, 2),), ()], [3, 2, 0], [6, 0, 8])
    assert (rv.tolist(), rl.tolist(), ro.tolist()) == ([6, 1], [3, 2], [0, 1, 2, 2])
    assert token_versions(rv, rl, ro)[0].tolist() == [6, 6, 6, 1, 1]


def test_a_single_huge_run() -> None:
    n = 2**22
    rv, rl, ro = pack_runs([((3, n),)], [n], [0])
    versions, offsets = token_versions(rv, rl, ro)
    assert offsets.tolist() == [0, n]
    assert versions.size == n
    assert bool(np.all(versions == 3))
    assert bool(np.all(freshness_mask(rv, rl, 4, 2)))
    assert not bool(np.any(freshness_mask(rv, rl, 5, 2)))
    assert padded(versions, offsets).shape == (1, n)
    # Counts far beyond memory: only the O(runs) arrays, which never materialise tokens.
    huge = [2**62, 2**62 - 1]
    rv, rl, ro = pack_runs([((0, huge[0]),), ((9, huge[1]),)], huge, [0, 0])
    assert token_offsets(rl, ro).tolist() == [0, 2**62, MAX_INT]
    assert fresh_token_counts(rv, rl, ro, 9, 1).tolist() == [0, huge[1]]
    assert loss_excluded(rv, rl, ro, 9, 1).tolist() == [True, False]


def test_token_totals_beyond_int64_are_refused() -> None:
    with pytest.raises(ValueError, match="total"):
        pack_runs([((0, 2**62),), ((0, 2**62),)], [2**62, 2**62], [0, 0])
    with pytest.raises(ValueError, match="total"):
        token_offsets(np.array([MAX_INT, 1, 1]), [0, 3])


def test_the_freshness_boundary_is_exact() -> None:
    rv, rl = np.array([7, 8, 9]), np.array([1, 1, 1])
    # g=10, span=3: lag 4, 3, 2 -> only v=7 is stale.
    assert freshness_mask(rv, rl, 10, 3).tolist() == [False, True, True]
    assert freshness_mask(rv, rl, 10, 2**80).tolist() == [True] * 3
    assert freshness_mask(np.array([MAX_INT - 1, MAX_INT]), [1, 1], MAX_INT, 1).tolist() == [False, True]
    assert freshness_mask(rv, rl, 0, 1).tolist() == [True] * 3  # versions ahead of g: lag <= 0


def test_max_int_is_the_buffers_step_bound() -> None:
    assert MAX_INT == BUFFER_MAX_INT


def test_the_module_imports_nothing_from_stalebuf() -> None:
    # _batch will import it; importing _validation (-> records -> _batch) would be a cycle.
    tree = ast.parse(inspect.getsource(ta))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0
            assert not (node.module or "").startswith("stalebuf")
        if isinstance(node, ast.Import):
            assert not any(alias.name.startswith("stalebuf") for alias in node.names)


def test_integer_inputs_of_other_widths_and_lists_are_accepted() -> None:
    rv, rl, ro = np.array([1, 2], dtype=np.int32), np.array([2, 1], dtype=np.uint16), [0, 1, 2]
    versions, offsets = token_versions(rv, rl, ro)
    assert (versions.dtype, versions.tolist(), offsets.tolist()) == (np.int64, [1, 1, 2], [0, 2, 3])
    assert head_tail_versions([], [0, 0], np.array([3], dtype=np.int8))[0].tolist() == [3]


# -- refused inputs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("segments", "tokens", "defaults", "error", "match"),
    [
        ([()], [0, 0], [0], ValueError, "one of each"),
        ([()], [0], [], ValueError, "one of each"),
        ([((1, 2),)], [3], [0], ValueError, "tokens=3 but its runs hold 2"),
        ([()], [-1], [0], ValueError, "tokens must be >= 0"),
        ([((-1, 2),)], [2], [0], ValueError, "run_versions must be >= 0"),
        ([((1, 0),)], [0], [0], ValueError, "run_lengths must be >= 1"),
        ([()], [0], [-3], ValueError, "default_versions must be >= 0"),
        ([((1, 2, 3),)], [2], [0], ValueError, "pairs"),
        ([((2**63, 1),)], [1], [0], OverflowError, "too large"),
    ],
)
def test_pack_runs_refuses(
    segments: list[Segments], tokens: list[int], defaults: list[int], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        pack_runs(segments, tokens, defaults)


GOOD_V, GOOD_L, GOOD_O = np.array([1, 2]), np.array([1, 1]), np.array([0, 1, 2])


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: token_versions(np.array([1.0, 2.0]), GOOD_L, GOOD_O), TypeError, "array of ints"),
        (lambda: token_versions(GOOD_V, np.array([1, 1], dtype=np.uint64), GOOD_O), TypeError, "int64"),
        (lambda: token_versions(GOOD_V.reshape(2, 1), GOOD_L, GOOD_O), ValueError, "one-dimensional"),
        (lambda: token_versions(GOOD_V, GOOD_L[:1], GOOD_O), ValueError, "runs"),
        (lambda: token_versions(GOOD_V, GOOD_L, [0, 1]), ValueError, "end at 2"),
        (lambda: token_versions(GOOD_V, GOOD_L, [1, 2]), ValueError, "start at 0"),
        (lambda: token_versions(GOOD_V, GOOD_L, []), ValueError, "start at 0"),
        (lambda: token_versions(GOOD_V, GOOD_L, [0, 2, 1, 2]), ValueError, "non-decreasing"),
        (lambda: freshness_mask(GOOD_V, GOOD_L, -1, 1), ValueError, "target_version"),
        (lambda: freshness_mask(GOOD_V, GOOD_L, MAX_INT + 1, 1), ValueError, "target_version"),
        (lambda: freshness_mask(GOOD_V, GOOD_L, True, 1), TypeError, "target_version"),
        (lambda: freshness_mask(GOOD_V, GOOD_L, 1.0, 1), TypeError, "target_version"),
        (lambda: freshness_mask(GOOD_V, GOOD_L, 5, 0), ValueError, "span"),
        (lambda: loss_excluded(GOOD_V, GOOD_L, [0, 2, 0, 2], 5, 1), ValueError, "non-decreasing"),
        (lambda: staleness(GOOD_V, 5, 0), ValueError, "sync_step"),
        (lambda: staleness([-1], 5, 1), ValueError, "versions must be >= 0"),
        (lambda: head_tail_versions(GOOD_V, GOOD_O, [0]), ValueError, "default_versions has 1"),
        (lambda: head_tail_versions(GOOD_V, GOOD_O, [0, -1]), ValueError, "default_versions must be"),
    ],
)
def test_array_functions_refuse(call: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


# -- padded ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.int64, np.uint16, np.float32, np.float64])
def test_padded_keeps_the_dtype(dtype: Any) -> None:
    values = np.array([1, 0, 1], dtype=dtype)
    out = padded(values, [0, 1, 3], pad_to=4)
    assert out.dtype == np.dtype(dtype)
    assert out.tolist() == np.array([[1, 0, 0, 0], [0, 1, 0, 0]], dtype=dtype).tolist()


def test_padded_keeps_trailing_dimensions() -> None:
    values = np.arange(6, dtype=np.float32).reshape(3, 2)
    out = padded(values, [0, 2, 2, 3], fill=-1.0)
    assert out.shape == (3, 2, 2)
    assert out.tolist() == [[[0, 1], [2, 3]], [[-1, -1], [-1, -1]], [[4, 5], [-1, -1]]]


def test_padded_takes_a_nan_or_inexact_float_fill_for_floats() -> None:
    out = padded(np.array([1.0], dtype=np.float32), [0, 1], pad_to=2, fill=float("nan"))
    assert np.isnan(out[0, 1])
    assert padded(np.array([1.0], dtype=np.float32), [0, 1], pad_to=2, fill=0.1)[0, 1] == np.float32(0.1)


@pytest.mark.parametrize(
    ("values", "offsets", "kwargs", "error", "match"),
    [
        (np.arange(3), [0, 1, 3], {"pad_to": 1}, ValueError, "shorter than the longest"),
        (np.arange(3), [0, 1, 3], {"pad_to": -1}, ValueError, "pad_to"),
        (np.arange(3), [0, 1, 3], {"pad_to": True}, TypeError, "pad_to"),
        (np.arange(3), [0, 1, 3], {"pad_to": 2.0}, TypeError, "pad_to"),
        (np.arange(3), [0, 1, 2], {}, ValueError, "end at 3"),
        (np.arange(3), [0, 2, 1, 3], {}, ValueError, "non-decreasing"),
        (np.arange(3), [1, 3], {}, ValueError, "start at 0"),
        (np.arange(3), np.array([0.0, 3.0]), {}, TypeError, "array of ints"),
        (np.int64(3), [0, 1], {}, ValueError, "at least one dimension"),
        (np.arange(3), [0, 3], {"fill": 1.5}, ValueError, "not exactly representable"),
        (np.arange(3), [0, 3], {"fill": 2**70}, ValueError, "cannot be stored"),
        (np.arange(3, dtype=np.uint8), [0, 3], {"fill": -1}, ValueError, "cannot be stored"),
        (np.ones(3, dtype=bool), [0, 3], {"fill": 2}, ValueError, "not exactly representable"),
        (np.arange(3), [0, 3], {"fill": None}, ValueError, "cannot be stored"),
    ],
)
def test_padded_refuses(
    values: Any, offsets: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        padded(values, offsets, **kwargs)
