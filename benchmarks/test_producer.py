"""Hot producer calls and the P2 producer path, with the asyncio.Queue baseline.

Each producer-call benchmark times ``CALLS`` calls on fresh state built outside the
timed region; divide the reported time by ``CALLS`` (see ``extra_info``) for one call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from stalebuf import ReplayBuffer
from workloads import TRAJECTORIES_PER_GROUP, add_group_nowait, pipeline_stalebuf, queue_pipeline

CALLS = 1_000
ROUNDS = 30

Setup = Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]


def _run(benchmark: BenchmarkFixture, target: Callable[..., object], setup: Setup, calls: int) -> None:
    benchmark.extra_info["calls_per_round"] = calls
    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, iterations=1)  # type: ignore[no-untyped-call]


def test_add_prompt_nowait(benchmark: BenchmarkFixture) -> None:
    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (ReplayBuffer(), [f"g{i}" for i in range(CALLS)]), {}

    def target(buf: ReplayBuffer, uids: list[str]) -> None:
        for uid in uids:
            buf.add_prompt_nowait(uid, global_steps=0)

    _run(benchmark, target, setup, CALLS)


def test_mark_running_nowait(benchmark: BenchmarkFixture) -> None:
    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        buf = ReplayBuffer()
        uids = [f"g{i}" for i in range(CALLS)]
        for uid in uids:
            buf.add_prompt_nowait(uid, global_steps=0)
        return (buf, uids), {}

    def target(buf: ReplayBuffer, uids: list[str]) -> None:
        for uid in uids:
            buf.mark_running_nowait(uid)

    _run(benchmark, target, setup, CALLS)


def test_put_nowait(benchmark: BenchmarkFixture) -> None:
    groups = CALLS // TRAJECTORIES_PER_GROUP

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        buf = ReplayBuffer()
        uids = [f"g{i}" for i in range(groups)]
        for uid in uids:
            add_group_nowait(buf, uid, 0, trajectories=0, finish=False)
        return (buf, uids), {}

    def target(buf: ReplayBuffer, uids: list[str]) -> None:
        put = buf.put_nowait
        for uid in uids:
            for session in range(TRAJECTORIES_PER_GROUP):
                put(uid, None, session_id=session)

    _run(benchmark, target, setup, groups * TRAJECTORIES_PER_GROUP)


def test_mark_finished_nowait(benchmark: BenchmarkFixture) -> None:
    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        buf = ReplayBuffer()
        uids = [f"g{i}" for i in range(CALLS)]
        for uid in uids:
            add_group_nowait(buf, uid, 0, finish=False)
        return (buf, uids), {}

    def target(buf: ReplayBuffer, uids: list[str]) -> None:
        for uid in uids:
            buf.mark_finished_nowait(uid)

    _run(benchmark, target, setup, CALLS)


def test_group_lifecycle_nowait(benchmark: BenchmarkFixture) -> None:
    """add_prompt + mark_running + 8 x put + mark_finished, per group, no event loop."""
    groups = CALLS // 10

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (ReplayBuffer(), [f"g{i}" for i in range(groups)]), {}

    def target(buf: ReplayBuffer, uids: list[str]) -> None:
        for uid in uids:
            add_group_nowait(buf, uid, 0)

    _run(benchmark, target, setup, groups)


# -- P2: the whole producer path with a concurrent trainer, and its baseline ------------

P2_GROUPS = 1_024


def test_p2_producer_path(benchmark: BenchmarkFixture) -> None:
    """4 producers x (add_prompt + mark_running + 8 x put + mark_finished), trainer sample(B=64)."""
    benchmark.extra_info["trajectories_per_round"] = P2_GROUPS * TRAJECTORIES_PER_GROUP

    async def run() -> int:
        return await pipeline_stalebuf(P2_GROUPS)

    def target() -> int:
        return anyio.run(run, backend="asyncio")

    benchmark.pedantic(target, rounds=10, iterations=1)  # type: ignore[no-untyped-call]


def test_p2_producer_path_with_put_group(benchmark: BenchmarkFixture) -> None:
    """The same pipeline, each group uploaded by one put_group call."""
    benchmark.extra_info["trajectories_per_round"] = P2_GROUPS * TRAJECTORIES_PER_GROUP

    async def run() -> int:
        return await pipeline_stalebuf(P2_GROUPS, put_group=True)

    def target() -> int:
        return anyio.run(run, backend="asyncio")

    benchmark.pedantic(target, rounds=10, iterations=1)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("yield_every", [0, TRAJECTORIES_PER_GROUP], ids=["raw", "yield-per-8"])
def test_p2_queue_baseline(benchmark: BenchmarkFixture, yield_every: int) -> None:
    """asyncio.Queue put+get of as many items as test_p2_producer_path moves trajectories."""
    items = P2_GROUPS * TRAJECTORIES_PER_GROUP
    benchmark.extra_info["items_per_round"] = items

    async def run() -> int:
        return await queue_pipeline(items, yield_every=yield_every)

    def target() -> int:
        return anyio.run(run, backend="asyncio")

    benchmark.pedantic(target, rounds=10, iterations=1)  # type: ignore[no-untyped-call]
