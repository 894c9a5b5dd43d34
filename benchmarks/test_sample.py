"""P3 (sample cost vs resident groups), P4 (drop eviction vs k) and P5 (wait gate vs
in-flight groups), plus the polling baseline's poll at the same sizes.

``sample`` is driven without an event loop (:func:`workloads.drive`): with a batch
ready, or ``timeout=0``, it completes without suspending. Large sizes only run with
benchmarks enabled; ``compare.py`` also covers N = 1e6.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from workloads import (
    BASE_STEP,
    BIG_THRESHOLD,
    PER_STEP,
    Gated,
    PollingBuffer,
    Resident,
    add_polling_group,
    drive,
)

SMOKE_MAX_N = 1_000
BATCH = 256
SIZES = [1_000, 10_000, 100_000]

Args = tuple[tuple[Any, ...], dict[str, Any]]


def _skip_large(n: int, smoke: bool) -> None:
    if smoke and n > SMOKE_MAX_N:
        pytest.skip("smoke run: large sizes only with benchmarks enabled")


@pytest.fixture
def resident(request: pytest.FixtureRequest, smoke: bool) -> Iterator[Resident]:
    n = request.param
    _skip_large(n, smoke)
    res = Resident(n)
    yield res
    res.close()


@pytest.mark.parametrize("resident", SIZES, indirect=True, ids=lambda n: f"N={n}")
def test_p3_sample(benchmark: BenchmarkFixture, resident: Resident) -> None:
    """sample(B=256) with N resident finished groups of 8 trajectories (N kept constant)."""
    first = True

    def setup() -> Args:
        nonlocal first
        if not first:
            resident.refill(BATCH)  # put back what the last round took
        first = False
        return (resident.global_steps,), {}

    def target(global_steps: int) -> None:
        batch, _metrics = drive(resident.buf.sample(global_steps, BATCH, timeout=0))
        assert len(batch) == BATCH

    benchmark.extra_info["resident_groups"] = resident.n
    benchmark.pedantic(target, setup=setup, rounds=50, iterations=1)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("k", [10, 100, 1_000, 10_000], ids=lambda k: f"k={k}")
def test_p4_drop_eviction(benchmark: BenchmarkFixture, smoke: bool, k: int) -> None:
    """One sample(B=1) that evicts k stale groups, at N = 1e4 resident fresh groups."""
    n = 10_000
    if smoke:
        n, k = SMOKE_MAX_N, min(k, 100)
    res = Resident(n)
    first = True

    def setup() -> Args:
        nonlocal first
        if not first:
            res.refill(1)  # put back the group the last round sampled
        first = False
        res.add_stale(k)
        return (res.global_steps,), {}

    def target(global_steps: int) -> None:
        _batch, metrics = drive(res.buf.sample(global_steps, 1, timeout=0))
        assert metrics["training/off_policy/dropped_groups"] == k

    benchmark.extra_info.update(resident_groups=n, evicted_groups=k)
    rounds = 10 if k < 10_000 else 5
    try:
        benchmark.pedantic(target, setup=setup, rounds=rounds, iterations=1)  # type: ignore[no-untyped-call]
    finally:
        res.close()


@pytest.mark.parametrize("n", [*SIZES, 1_000_000], ids=lambda n: f"N={n}")
def test_p5_gate_blocked_evaluation(benchmark: BenchmarkFixture, smoke: bool, n: int) -> None:
    """sample(timeout=0) whose only obstacle is the wait gate, with N in-flight groups."""
    _skip_large(n, smoke)
    gated = Gated(n, 64)

    def target() -> None:
        with pytest.raises(TimeoutError):
            drive(gated.buf.sample(gated.global_steps, gated.batch_size, timeout=0))

    benchmark.extra_info["in_flight_groups"] = n
    try:
        benchmark.pedantic(target, rounds=200, iterations=1)  # type: ignore[no-untyped-call]
    finally:
        gated.close()


@pytest.mark.parametrize("n", SIZES[:2], ids=lambda n: f"N={n}")
def test_polling_baseline_poll(benchmark: BenchmarkFixture, smoke: bool, n: int) -> None:
    """The polling baseline's poll(B=256) with N resident finished groups (a full re-read)."""
    _skip_large(n, smoke)
    buf = PollingBuffer(2.0, threshold=BIG_THRESHOLD)
    for i in range(n):
        add_polling_group(buf, f"r{i}", BASE_STEP + i // PER_STEP)
    top = BASE_STEP + n // PER_STEP + 1
    uid = n

    def setup() -> Args:
        nonlocal uid, top
        while len(buf.meta) < n:
            uid += 1
            add_polling_group(buf, f"r{uid}", top)
            if uid % PER_STEP == 0:
                top += 1
        return (top + 1,), {}

    def target(global_steps: int) -> None:
        batch = buf.poll(global_steps, BATCH)
        assert batch is not None

    benchmark.extra_info["resident_groups"] = n
    benchmark.pedantic(target, setup=setup, rounds=20, iterations=1)  # type: ignore[no-untyped-call]
