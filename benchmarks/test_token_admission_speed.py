"""Token admission (issue 24) against group admission on the producer path.

All benchmarks share one group, so pytest-benchmark's table puts them side by side: one round
is ``GROUPS`` groups' producer path (see ``token_admission.py``, which prints the per-group
difference as a script and judges the target, <= 0.3 µs per group). Smoke runs use few groups.
"""

from __future__ import annotations

from typing import Any

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from stalebuf import ReplayBuffer
from token_admission import GROUPS, QUICK_GROUPS, TRAJECTORIES, VARIANTS, produce

ROUNDS = 30


@pytest.mark.parametrize("name", list(VARIANTS))
def test_producer_path(benchmark: BenchmarkFixture, smoke: bool, name: str) -> None:
    groups = QUICK_GROUPS if smoke else GROUPS
    benchmark.group = f"producer path: {groups} groups x {TRAJECTORIES} trajectories"
    benchmark.extra_info["groups_per_round"] = groups

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        buf = ReplayBuffer(VARIANTS[name](groups), status_log_interval=None)
        return (buf, [f"g{i}" for i in range(groups)]), {}

    benchmark.pedantic(produce, setup=setup, rounds=ROUNDS, iterations=1)  # type: ignore[no-untyped-call]
