"""Review 18 of the audit fixes (41c5ac9..8bae8aa): the producer wait ledger, tags closed for
good, the on_evict re-admission bound, and checkpoint files.

Async tests run on asyncio and trio, every wait bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from _helpers import LIMIT, add_group, make, producer_ledger
from stalebuf import (
    ReplayBuffer,
    StalenessPolicy,
)

WAIT_METRIC = "training/admission/producer_wait_seconds"


def assert_ledger_matches_queue(buf: ReplayBuffer) -> None:
    counted, queued, starts, expected = producer_ledger(buf)
    assert counted == queued, f"the ledger counts {counted} producers, the queue holds {queued}"
    assert math.isclose(starts, expected, rel_tol=1e-9, abs_tol=1e-6), (starts, expected)


# -- the producer wait ledger against the queue, on every path in and out --------------------


# -- the on_evict re-admission bound -------------------------------------------------------------


class Runaway(Exception):
    """Raised by the test's own guard: the buffer let on_evict loop."""


# -- tags closed for good --------------------------------------------------------------------------


class StalePastOne(StalenessPolicy):
    """A custom ``is_stale``, monotone in both steps as the policy contract requires: stale once
    more than one step old."""

    def is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        return global_steps - dispatch_step > 1


# -- checkpoint files --------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX permissions")
@pytest.mark.anyio
async def test_a_file_system_that_refuses_chmod_still_takes_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vfat and some CIFS mounts refuse chmod (EPERM); a plain open there works, so save must."""

    def refuse(fd: int, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    buf = make()
    add_group(buf, "a", 0)
    path = tmp_path / "ckpt"
    monkeypatch.setattr(os, "fchmod", refuse)
    with anyio.fail_after(LIMIT):
        await buf.save(path)
    assert ReplayBuffer.restore(path, status_log_interval=None).buffer.stats().total.groups == 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary file left


@pytest.mark.anyio
async def test_a_codec_returning_an_empty_multidimensional_view_saves_and_restores(tmp_path: Path) -> None:
    """``memoryview(np.zeros((0, 3)))`` cannot be cast to bytes; it is an empty frame, not a TypeError."""
    codec: Any = (lambda value: memoryview(value), lambda data: np.frombuffer(data))
    buf = make()
    buf.put_group_nowait("g", [np.zeros((0, 3)), np.arange(6.0).reshape(2, 3)], global_steps=0)
    path = tmp_path / "ckpt"
    with anyio.fail_after(LIMIT):
        await buf.save(path, payload_codec=codec)
    restored = ReplayBuffer.restore(path, payload_codec=codec, status_log_interval=None).buffer
    batch, _ = restored.sample_nowait(0, 1)
    payloads = [t.payload for t in batch.groups[0].trajectories]
    assert [p.tolist() for p in payloads] == [[], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]


# -- collections whose len() is checked --------------------------------------------------------------


class Draining:
    """A collection that empties as it is iterated (a queue-like view): len() was true when asked."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Any:
        while self.items:
            yield self.items.pop(0)

    def __contains__(self, item: object) -> bool:
        return item in self.items
