"""pytest configuration for the benchmarks.

``pytest benchmarks --benchmark-only`` times them (pytest-benchmark, from the ``bench``
extra); ``pytest benchmarks --benchmark-disable`` runs each body once, on small sizes
only, as a smoke test (CI). No test asserts on a timing: the targets and their
verdicts live in ``compare.py``.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def smoke(request: pytest.FixtureRequest) -> bool:
    """True when benchmarks are disabled (each body runs once: keep the sizes small)."""
    return bool(request.config.getoption("benchmark_disable"))
