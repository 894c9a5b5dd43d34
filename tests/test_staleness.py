"""The staleness arithmetic: the bound the hot paths compare with inline agrees with the rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stalebuf.staleness import drop_span, exceeds_drop

steps = st.integers(0, 2**63 - 1)


@given(steps, steps, st.integers(1, 2**20), st.integers(1, 2**20))
def test_drop_span_gives_the_first_kept_dispatch_step(g: int, p: int, threshold: int, sync_step: int) -> None:
    p = min(p, g)
    assert exceeds_drop(g, p, threshold, sync_step) == (p < g + 1 - drop_span(threshold, sync_step))


def test_the_boundary_is_exact() -> None:
    for threshold, sync_step in [(1, 1), (2, 1), (1, 3), (3, 2)]:
        first_kept = 10 + 1 - drop_span(threshold, sync_step)
        assert not exceeds_drop(10, first_kept, threshold, sync_step)  # s == T: kept
        assert exceeds_drop(10, first_kept - 1, threshold, sync_step)  # one step older: dropped
