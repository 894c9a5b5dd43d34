"""The journal (issue 25): the producer path and ``sample`` with a journal and without, in one
pytest-benchmark group each so the table puts them side by side (``journal.py`` measures the
issue's targets, interleaved, with the writer thread running and the ratios; see the README).

Each round runs on one event loop kept across rounds (the journal's timer posts its hand-offs to
it, so they run in the next round, as they would in a live run). Smoke runs
(``--benchmark-disable``) run each body once, ``sample`` on 512 resident groups.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from journal import new_buffer, payloads
from stalebuf import ReplayBuffer

GROUPS = 256  # per producer round
RESIDENT = 4_096
BATCH = 64


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


@pytest.fixture(params=["no journal", "journal"])
def buffer(
    request: pytest.FixtureRequest, tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> Iterator[ReplayBuffer]:
    journal = str(tmp_path / "journal.sqlite") if request.param == "journal" else None
    buf = new_buffer(journal, journal_interval=1.0)
    yield buf
    loop.run_until_complete(buf.aclose())


def test_put_group(
    benchmark: BenchmarkFixture, buffer: ReplayBuffer, loop: asyncio.AbstractEventLoop
) -> None:
    """``GROUPS`` x ``await put_group`` (8 x 4 KiB), then one ``sample`` takes them all."""
    benchmark.group = f"journal: {GROUPS} x put_group(8 x 4 KiB) + sample({GROUPS})"
    group_payloads = payloads()
    rounds = 0

    async def one_round() -> None:
        nonlocal rounds
        rounds += 1
        for i in range(GROUPS):
            await buffer.put_group(f"r{rounds}g{i}", group_payloads, global_steps=rounds)
        batch, _ = await buffer.sample(rounds, batch_size=GROUPS, timeout=0)
        assert len(batch) == GROUPS

    benchmark.pedantic(lambda: loop.run_until_complete(one_round()), rounds=20, iterations=1)  # type: ignore[no-untyped-call]


def test_sample(
    benchmark: BenchmarkFixture, buffer: ReplayBuffer, loop: asyncio.AbstractEventLoop, smoke: bool
) -> None:
    """``sample(batch_size=64)`` of ``RESIDENT`` finished groups, refilled between rounds."""
    resident = 512 if smoke else RESIDENT
    benchmark.group = f"journal: sample({BATCH}) of {resident:,} resident groups"
    group_payloads = payloads()
    added = 0

    async def refill(count: int) -> None:
        nonlocal added
        for _ in range(count):
            await buffer.put_group(f"g{added}", group_payloads, global_steps=added // 256)
            added += 1

    loop.run_until_complete(refill(resident))

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        loop.run_until_complete(refill(resident - buffer.stats().total.finished))
        return (added // 256 + 1,), {}

    def target(step: int) -> None:
        batch, _ = loop.run_until_complete(buffer.sample(step, batch_size=BATCH, timeout=0))
        assert len(batch) == BATCH

    benchmark.pedantic(target, setup=setup, rounds=200, iterations=1)  # type: ignore[no-untyped-call]
