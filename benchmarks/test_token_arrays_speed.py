"""Token arrays (issue 22 groundwork): ``freshness_mask()`` side by side with a bare ``np.repeat``.

All benchmarks share one group, so pytest-benchmark's table puts them side by side. The
``freshness_mask`` benchmark also times the bare bool ``np.repeat`` in its setup before every
round (interleaved, outside its own timed region) and stores both medians and their ratio in
``extra_info``: the target is a ratio <= 2 at the full size (see ``token_arrays.py``, which
prints the same comparison as a script). Smoke runs use a tiny batch.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from stalebuf._token_arrays import freshness_mask, pack_runs, token_versions
from token_arrays import FULL, QUICK, SPAN, TARGET_VERSION, Workload, build

ROUNDS = 30
GROUP = "token arrays: 256 groups x 8 x 4,096 tokens in 16 segments"


@pytest.fixture
def work(smoke: bool) -> Workload:
    return build(QUICK if smoke else FULL)


def _run(benchmark: BenchmarkFixture, work: Workload, target: Any, setup: Any = None) -> None:
    benchmark.group = GROUP
    benchmark.extra_info["workload"] = work.shape.describe()
    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=1)  # type: ignore[no-untyped-call]


def test_freshness_mask(benchmark: BenchmarkFixture, work: Workload) -> None:
    bare: list[int] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        start = time.perf_counter_ns()
        result = np.repeat(work.fresh_runs, work.run_lengths)
        bare.append(time.perf_counter_ns() - start)
        del result
        return (), {}

    def target() -> None:
        freshness_mask(work.run_versions, work.run_lengths, TARGET_VERSION, SPAN)

    _run(benchmark, work, target, setup)
    expected = np.repeat(work.fresh_runs, work.run_lengths)
    got = freshness_mask(work.run_versions, work.run_lengths, TARGET_VERSION, SPAN)
    assert np.array_equal(got, expected)
    if benchmark.stats is not None:  # None when benchmarks are disabled
        mine = benchmark.stats.stats.median
        theirs = statistics.median(bare) / 1e9
        benchmark.extra_info.update(bare_repeat_median_s=theirs, ratio_to_bare_repeat=mine / theirs)


def test_bare_repeat_bool(benchmark: BenchmarkFixture, work: Workload) -> None:
    _run(benchmark, work, lambda: np.repeat(work.fresh_runs, work.run_lengths))


def test_bare_repeat_int64(benchmark: BenchmarkFixture, work: Workload) -> None:
    _run(benchmark, work, lambda: np.repeat(work.run_versions, work.run_lengths))


def test_token_versions(benchmark: BenchmarkFixture, work: Workload) -> None:
    _run(benchmark, work, lambda: token_versions(work.run_versions, work.run_lengths, work.run_offsets))


def test_pack_runs(benchmark: BenchmarkFixture, work: Workload) -> None:
    n = work.shape.trajectories
    tokens, defaults = [work.shape.tokens] * n, [0] * n
    _run(benchmark, work, lambda: pack_runs(work.segments, tokens, defaults))
