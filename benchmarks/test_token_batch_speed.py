"""Token batches (issue 24): ``sample(token_budget=K)`` and ``sample(batch_size=k)`` returning the
same k groups from the same layout, in one pytest-benchmark group so the table puts them side by
side (``token_batches.py`` prints the same comparison, interleaved, with the ratio; the target is
<= 1.5x at N = 1e6). Smoke runs (``--benchmark-disable``) use N = 2,000.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from token_batches import TokenResident
from workloads import drive

K = 256
ROUNDS = 30


@pytest.fixture
def resident(smoke: bool) -> Iterator[TokenResident]:
    res = TokenResident.build(2_000 if smoke else 100_000, K)
    yield res
    gc.unfreeze()


def _run(benchmark: BenchmarkFixture, resident: TokenResident, kwargs: dict[str, int]) -> None:
    benchmark.group = f"token batches: k={K} groups from N={resident.n:,} resident"
    first = True

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        nonlocal first
        if not first:
            resident.refill(K)  # put back what the last round took
        first = False
        return (resident.global_steps,), {}

    def target(global_steps: int) -> None:
        batch, _ = drive(resident.buf.sample(global_steps, **kwargs))
        assert len(batch) == K

    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, iterations=1)  # type: ignore[no-untyped-call]


def test_sample_by_tokens(benchmark: BenchmarkFixture, resident: TokenResident) -> None:
    _run(benchmark, resident, {"token_budget": resident.budget})


def test_sample_by_count(benchmark: BenchmarkFixture, resident: TokenResident) -> None:
    _run(benchmark, resident, {"batch_size": K})
