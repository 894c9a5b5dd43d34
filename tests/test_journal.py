"""The journal (issue 25): exact at its last commit, refusals that leave files as they were,
``journal_interval=0``, backpressure (wake-up, timeout, cancellation, close), the writer's
errors, and its metrics. Async tests run on asyncio and trio under ``anyio.fail_after``.

The crash (SIGKILL) test is ``test_journal_crash.py``; recovery at a trainer step and its
conflicts are ``test_journal_recovery.py`` and the model test ``test_journal_model.py``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from _helpers import assert_conserved, copy_journal
from stalebuf import (
    BatchNotReadyError,
    BufferClosedError,
    BufferFullError,
    CheckpointError,
    ConfigError,
    ReplayBuffer,
    SamplerConfig,
    Status,
)

pytestmark = pytest.mark.anyio


def state_of(buffer: ReplayBuffer) -> tuple[Any, ...]:
    """What a recovery must reproduce: stats, clocks, and every group's content."""
    checkpoint = buffer.checkpoint()
    groups = [
        (g.uid, g.partition, g.dispatch_step, g.status, dict(g.tags), g.start_version,
         [(t.key, t.payload, t.versions, t.tokens) for t in g.trajectories])
        for g in checkpoint.groups
    ]  # fmt: skip
    return buffer.stats(), dict(checkpoint.clocks), groups, checkpoint.evicted_in_flight


def size(path: Path) -> int:
    return path.stat().st_size


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (the writer thread changes it; no event tells the loop)."""
    for _ in range(100_000):
        if condition():
            return
        await anyio.sleep(0.005)


@contextlib.contextmanager
def write_lock(path: Path) -> Iterator[None]:
    """Hold the journal's write lock from another connection: its writer waits (backpressure)."""
    connection = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        connection.execute("BEGIN IMMEDIATE")
        yield
        connection.execute("ROLLBACK")
    finally:
        connection.close()


# -- exactness at the last commit ----------------------------------------------------------------


async def busy_buffer(path: Path, **options: Any) -> ReplayBuffer:
    config = SamplerConfig(max_off_policy_threshold=2, failure_strategy="evict")
    buffer = ReplayBuffer(config, journal=path, journal_interval=60.0, **options)
    for i in range(12):
        buffer.put_group_nowait(f"g{i}", [bytes([i]) * 5] * 3, global_steps=i // 4)
    buffer.add_prompt_nowait("run", global_steps=2)
    buffer.mark_running_nowait("run", version=3)
    buffer.put_nowait("run", b"partial", versions=[(3, 4), (4, 2)])
    buffer.add_prompt_nowait("bad", global_steps=2, tags={"kind": "x"})
    buffer.mark_failed_nowait("bad")
    buffer.sample_nowait(1, 4)
    buffer.put_group_nowait("late", [b"a", b"b"], tokens=[3, 4], global_steps=3)
    buffer.sample_nowait(4, 1)  # evicts stale groups and the failed one
    return buffer


async def test_recovering_at_the_last_commit_gives_the_state_exactly(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    buffer = await busy_buffer(path)
    with anyio.fail_after(10):
        await buffer.flush()
    expected = state_of(buffer)
    recovered = ReplayBuffer.recover(path, in_flight="keep").buffer  # the first buffer never closed
    assert state_of(recovered) == expected
    assert_conserved(recovered)
    await recovered.aclose()
    buffer.close()


async def test_a_recovered_buffer_journals_on_into_the_same_file(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    buffer = await busy_buffer(path)
    await buffer.aclose()
    recovered = ReplayBuffer.recover(path, in_flight="keep").buffer
    recovered.put_group_nowait("after", [b"z"])
    recovered.mark_finished_nowait("run")
    expected = state_of(recovered)
    await recovered.aclose()
    again = ReplayBuffer.recover(path, in_flight="keep").buffer
    assert state_of(again) == expected
    again.close()


async def test_close_commits_what_is_left(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=3600.0)
    buffer.put_group_nowait("a", [1, 2])
    buffer.close()  # the final commit, though the interval never passed
    assert "a" in ReplayBuffer.recover(path).buffer


async def test_the_timer_commits_without_a_flush(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=0.01)
    await buffer.put_group("a", [1, 2])
    with anyio.fail_after(10):
        await until(lambda: buffer.stats().journal_commits >= 2)  # the first commit: the empty start
    assert "a" in ReplayBuffer.recover(path).buffer  # read while the first still runs
    await buffer.aclose()


async def test_journal_interval_zero_commits_before_each_call_returns(tmp_path: Path) -> None:
    """Every producer call, and a sample, is durable when it returns."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=0)
    buffer.add_prompt_nowait("a")
    assert "a" in ReplayBuffer.recover(path).buffer
    buffer.put_nowait("a", b"x")
    buffer.mark_finished_nowait("a")
    buffer.put_group_nowait("b", [b"y"])
    assert ReplayBuffer.recover(path, in_flight="keep").buffer.stats() == buffer.stats()
    buffer.sample_nowait(0, 1)
    recovered = ReplayBuffer.recover(path, global_steps=0).buffer
    assert recovered.stats() == buffer.stats()
    buffer.close()


# -- refusals ------------------------------------------------------------------------------------


def test_an_existing_journal_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    ReplayBuffer(journal=path).put_group_nowait("a", [1])
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match="recover from it, or remove it"):
        ReplayBuffer(journal=path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("content", [b"not a database at all", b"SQLite format 3\x00" + b"\x07" * 200])
def test_a_foreign_file_is_refused_byte_for_byte(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "foreign.db"
    path.write_bytes(content)
    for attempt in (lambda: ReplayBuffer(journal=path), lambda: ReplayBuffer.recover(path)):
        with pytest.raises(CheckpointError):
            attempt()
        assert path.read_bytes() == content


def test_another_sqlite_database_is_refused_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE t (x)")
    connection.commit()
    connection.close()
    before = path.read_bytes()
    for attempt in (lambda: ReplayBuffer(journal=path), lambda: ReplayBuffer.recover(path)):
        with pytest.raises(CheckpointError, match="not a stalebuf"):
            attempt()
        assert path.read_bytes() == before


def test_an_empty_file_starts_a_new_journal(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    path.write_bytes(b"")
    buffer = ReplayBuffer(journal=path)
    buffer.put_group_nowait("a", [1])
    buffer.close()
    assert "a" in ReplayBuffer.recover(path).buffer


def test_recovering_a_missing_or_empty_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no journal to recover"):
        ReplayBuffer.recover(tmp_path / "missing.db")
    (tmp_path / "empty.db").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no journal to recover"):
        ReplayBuffer.recover(tmp_path / "empty.db")
    assert (tmp_path / "empty.db").read_bytes() == b""


def test_a_journal_written_with_a_codec_needs_it_and_one_without_refuses_it(tmp_path: Path) -> None:
    codec = (bytes, bytes)
    with_codec, plain = tmp_path / "codec.db", tmp_path / "pickle.db"
    buffer = ReplayBuffer(journal=with_codec, payload_codec=codec)
    buffer.put_group_nowait("a", [b"payload"])
    buffer.close()
    ReplayBuffer(journal=plain).close()
    with pytest.raises(CheckpointError, match="payload codec"):
        ReplayBuffer.recover(with_codec)
    with pytest.raises(CheckpointError, match="pickled payloads"):
        ReplayBuffer.recover(plain, payload_codec=codec)
    recovered = ReplayBuffer.recover(with_codec, payload_codec=codec).buffer
    batch, _ = recovered.sample_nowait(0, 1)
    assert batch.groups[0].trajectories[0].payload == b"payload"


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("journal_interval", -1.0),
        ("journal_interval", float("nan")),
        ("journal_interval", "1"),
        ("journal_interval", True),
        ("journal_retention_steps", -1),
        ("journal_retention_steps", 1.5),
        ("journal_max_pending_bytes", 0),
        ("journal_max_pending_bytes", None),
        ("journal", 12),
        ("journal", ""),
        ("payload_codec", (bytes,)),
    ],
)
def test_bad_journal_arguments_are_config_errors_that_create_nothing(
    tmp_path: Path, argument: str, value: Any
) -> None:
    options: dict[str, Any] = {"journal": tmp_path / "journal.db", argument: value}
    with pytest.raises(ConfigError):
        ReplayBuffer(**options)
    with pytest.raises(ConfigError):
        ReplayBuffer.from_config(SamplerConfig(), **options)
    assert not (tmp_path / "journal.db").exists()


async def test_flush_checks_its_step_and_is_a_no_op_without_a_journal() -> None:
    buffer = ReplayBuffer()
    await buffer.flush(checkpoint_step=3)
    with pytest.raises(ValueError, match="checkpoint_step"):
        await buffer.flush(checkpoint_step=-1)
    with pytest.raises(TypeError, match="checkpoint_step"):
        await buffer.flush(checkpoint_step=1.0)  # type: ignore[arg-type]


# -- backpressure --------------------------------------------------------------------------------


async def test_parked_producers_wake_in_arrival_order_once_the_writer_commits(
    tmp_path: Path, anyio_backend: str
) -> None:
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=0.001, journal_max_pending_bytes=1)
    order: list[str] = []
    lock = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=False)
    lock.execute("BEGIN IMMEDIATE")

    async def produce(uid: str) -> None:
        await buffer.put_group(uid, [b"w"])
        order.append(uid)

    with anyio.fail_after(20):
        buffer.put_group_nowait("first", [b"x" * 100])
        await until(lambda: buffer.stats().journal_pending_bytes > 1)
        async with anyio.create_task_group() as tasks:
            for uid in ("p1", "p2", "p3"):
                tasks.start_soon(produce, uid)
                await anyio.sleep(0.01)
            assert order == []
            lock.execute("ROLLBACK")
            lock.close()
    assert order == ["p1", "p2", "p3"]
    await buffer.flush()
    assert all(uid in ReplayBuffer.recover(path).buffer for uid in ("first", "p1", "p2", "p3"))
    await buffer.aclose()


@pytest.fixture
def stuck(tmp_path: Path) -> Iterator[tuple[Path, sqlite3.Connection]]:
    """A journal path whose write lock another connection holds until the test ends."""
    path = tmp_path / "journal.db"
    connection = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=False)
    yield path, connection
    with contextlib.suppress(sqlite3.Error):
        connection.execute("ROLLBACK")
    connection.close()


async def stuck_buffer(path: Path, connection: sqlite3.Connection) -> ReplayBuffer:
    buffer = ReplayBuffer(journal=path, journal_interval=0.001, journal_max_pending_bytes=1)
    connection.execute("BEGIN IMMEDIATE")
    buffer.put_group_nowait("first", [b"x" * 100])
    await until(lambda: buffer.stats().journal_pending_bytes > 1)
    return buffer


async def test_nowait_producers_raise_buffer_full_changing_nothing(
    stuck: tuple[Path, sqlite3.Connection], anyio_backend: str
) -> None:
    buffer = await stuck_buffer(*stuck)
    before = buffer.stats()
    for call in (
        lambda: buffer.put_group_nowait("refused", [b"z"]),
        lambda: buffer.add_prompt_nowait("refused"),
        lambda: buffer.mark_finished_nowait("first"),
    ):
        with pytest.raises(BufferFullError, match="journal_max_pending_bytes"):
            call()
    assert buffer.stats() == before
    assert "refused" not in buffer
    stuck[1].execute("ROLLBACK")
    with anyio.fail_after(10):
        await buffer.flush()
    buffer.put_group_nowait("accepted", [b"z"])
    await buffer.aclose()


async def test_a_parked_producer_times_out_changing_nothing(
    stuck: tuple[Path, sqlite3.Connection], anyio_backend: str
) -> None:
    buffer = await stuck_buffer(*stuck)
    before = buffer.stats()
    with anyio.fail_after(10):
        with anyio.move_on_after(0.05) as scope:
            await buffer.add_prompt("late")
    assert scope.cancelled_caught
    assert buffer.stats() == before
    assert "late" not in buffer
    stuck[1].execute("ROLLBACK")
    with anyio.fail_after(10):
        await buffer.add_prompt("late")  # the timed-out waiter left no trace in the queue
    await buffer.aclose()


async def test_a_cancelled_waiter_passes_the_wake_up_on(
    stuck: tuple[Path, sqlite3.Connection], anyio_backend: str
) -> None:
    buffer = await stuck_buffer(*stuck)
    done: list[str] = []

    async def produce(uid: str, scope: anyio.CancelScope | None = None) -> None:
        if scope is None:
            await buffer.put_group(uid, [b"w"])
            done.append(uid)
            return
        with scope:
            await buffer.put_group(uid, [b"w"])
            done.append(uid)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            head = anyio.CancelScope()
            tasks.start_soon(produce, "head", head)
            await anyio.sleep(0.01)
            tasks.start_soon(produce, "second")
            await anyio.sleep(0.01)
            head.cancel()  # the head leaves before the writer catches up
            await anyio.sleep(0.01)
            stuck[1].execute("ROLLBACK")
    assert done == ["second"]
    assert "head" not in buffer
    await buffer.aclose()


async def test_close_wakes_parked_producers_with_buffer_closed_error(
    stuck: tuple[Path, sqlite3.Connection], anyio_backend: str
) -> None:
    path, connection = stuck
    buffer = await stuck_buffer(path, connection)
    errors: list[BaseException] = []

    async def produce() -> None:
        try:
            await buffer.mark_running("nobody")
        except BaseException as exc:
            errors.append(exc)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(produce)
            await anyio.sleep(0.02)
            assert errors == []
            connection.execute("ROLLBACK")  # let close's final commit through
            await buffer.aclose()
    assert len(errors) == 1
    assert isinstance(errors[0], BufferClosedError)


# -- the writer's errors ------------------------------------------------------------------------


class Unpicklable:
    def __reduce__(self) -> Any:
        raise pickle.PicklingError("refused on purpose")


async def test_a_payload_the_writer_cannot_encode_stops_the_journal_loudly(
    tmp_path: Path, anyio_backend: str
) -> None:
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=3600.0)
    buffer.put_group_nowait("ok", [1])
    await buffer.flush()
    buffer.put_group_nowait("bad", [Unpicklable()])
    with anyio.fail_after(10), pytest.raises(CheckpointError, match="refused on purpose"):
        await buffer.flush()
    with pytest.raises(CheckpointError, match="stopped"):
        await buffer.flush()
    assert "ok" in ReplayBuffer.recover(path).buffer  # what was committed stays recoverable
    await buffer.aclose()


# -- metrics -------------------------------------------------------------------------------------


async def test_stats_report_the_journal(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=3600.0)
    start = buffer.stats()
    assert start.journal_commits == 1
    assert start.journal_bytes > 0
    assert start.journal_lag_seconds == 0.0
    buffer.put_group_nowait("a", [b"x" * 1000])
    await anyio.sleep(0.01)
    assert buffer.stats().journal_lag_seconds > 0
    await buffer.flush()
    stats = buffer.stats()
    assert stats.journal_commits == 2
    assert stats.journal_pending_bytes == 0
    assert stats.journal_lag_seconds == 0.0
    assert stats.journal_bytes == size(path) + size(Path(f"{path}-wal"))
    assert ReplayBuffer().stats().journal_commits == 0
    await buffer.aclose()


async def test_statuses_survive(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=3600.0)
    buffer.put_group_nowait("f", [1], status="failed")
    buffer.close()
    recovered = ReplayBuffer.recover(path).buffer
    assert recovered.stats().total.failure == 1
    assert recovered.checkpoint().groups[0].status is Status.FAILURE


async def test_save_compacts_the_journal(tmp_path: Path, anyio_backend: str) -> None:
    """The write-ahead log holds every commit until a checkpoint folds it in; save() does one
    and truncates it, so the journal's bytes drop to about the resident payloads."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=3600.0)
    for i in range(50):
        buffer.put_group_nowait(f"g{i}", [b"x" * 4096] * 4)
        await buffer.flush()
    buffer.sample_nowait(0, 50)
    await buffer.flush()
    wal = Path(f"{path}-wal")
    before = size(wal)
    assert before > 50 * 4 * 4096
    with anyio.fail_after(10):
        await buffer.save(tmp_path / "checkpoint")
        await buffer.flush()  # the compaction follows the commit save asked for
    assert size(wal) < before
    assert buffer.stats().journal_bytes < before
    await buffer.aclose()


@pytest.mark.parametrize(
    "view",
    [
        lambda payload: memoryview(np.arange(4, dtype=np.int64)),  # 8-byte items
        lambda payload: memoryview(np.arange(8, dtype=np.uint8))[::2],  # strided
        lambda payload: memoryview(np.zeros((0, 3), dtype=np.uint8)),  # empty, two dimensions
    ],
)
def test_a_codec_returning_odd_memoryviews_is_journaled_byte_for_byte(tmp_path: Path, view: Any) -> None:
    """Defect (found by review): the journal's codec frames cast every view to bytes, which
    raises for a strided or an empty multi-dimensional one, stopping the writer thread."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, payload_codec=(view, bytes))
    buffer.put_group_nowait("a", [b"payload"])
    buffer.close()
    recovered = ReplayBuffer.recover(path, payload_codec=(view, bytes)).buffer
    batch, _ = recovered.sample_nowait(0, 1)
    assert batch.groups[0].trajectories[0].payload == bytes(view(None).tobytes())


def test_a_sample_that_returns_nothing_journals_the_clock_it_moved(tmp_path: Path) -> None:
    """Defect (found by the model test): a sample that returned no batch moved the dispatch
    clock without recording a change, so the final commit skipped it and the recovered buffer
    tagged new groups at the old step."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=3600.0)
    with pytest.raises(BatchNotReadyError):
        buffer.sample_nowait(5, 1)
    buffer.close()
    assert ReplayBuffer.recover(path).buffer.dispatch_step() == 5


def test_another_programs_wal_database_gets_no_file_beside_it(tmp_path: Path) -> None:
    """Review: telling a foreign WAL database apart opened it, and SQLite left -wal and -shm
    files beside it; its header's application id tells it without opening."""
    path = tmp_path / "other.db"
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("CREATE TABLE t (x)")
    connection.commit()
    connection.close()
    before = sorted(tmp_path.iterdir())
    for attempt in (lambda: ReplayBuffer(journal=path), lambda: ReplayBuffer.recover(path)):
        with pytest.raises(CheckpointError, match="not a stalebuf"):
            attempt()
    assert sorted(tmp_path.iterdir()) == before


async def test_a_flush_waiting_for_a_stuck_writer_is_cancellable_and_raises_once_closed(
    stuck: tuple[Path, sqlite3.Connection], anyio_backend: str
) -> None:
    """flush() waits for the writer in a worker thread: a timeout or cancellation ends the wait at
    once (the commit still lands later), and a flush after close raises CheckpointError."""
    buffer = await stuck_buffer(*stuck)
    with anyio.fail_after(10):
        with anyio.move_on_after(0.05) as scope:
            await buffer.flush(checkpoint_step=0)
    assert scope.cancelled_caught
    stuck[1].execute("ROLLBACK")
    with anyio.fail_after(10):
        await buffer.flush()  # the writer caught up: this one returns
    await buffer.aclose()
    with pytest.raises(CheckpointError, match="closed"):
        await buffer.flush()


# -- found by review: the live side ---------------------------------------------------------------


def refusing_codec() -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]]:
    """A payload codec whose ``encode`` raises for the payload ``b"bad"``."""

    def encode(payload: Any) -> bytes:
        if payload == b"bad":
            raise ValueError("encode refused on purpose")
        return bytes(payload)

    return encode, bytes


async def test_save_after_close_writes_the_checkpoint(tmp_path: Path, anyio_backend: str) -> None:
    """Defect (found by review): ``save`` compacts the journal, and after ``aclose`` that raised
    CheckpointError ("closed"): a closed journaled buffer could not be saved, a plain one can."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path)
    buffer.put_group_nowait("a", [b"x"])
    await buffer.aclose()
    with anyio.fail_after(10):
        await buffer.save(tmp_path / "checkpoint")
    assert "a" in ReplayBuffer.restore(tmp_path / "checkpoint").buffer


async def test_a_stopped_writer_refuses_later_producers_with_checkpoint_error(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Defect (found by review): once the writer stopped on an error (an ``encode`` that raised),
    producer calls went on succeeding and nothing was journaled any more: the loss window grew
    without bound, silently. They now raise CheckpointError and change nothing; ``save`` still
    writes its checkpoint (the one durable copy left)."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=3600.0, payload_codec=refusing_codec())
    buffer.put_group_nowait("bad", [b"bad"])
    with anyio.fail_after(10), pytest.raises(CheckpointError, match="encode refused"):
        await buffer.flush()
    before = buffer.stats()
    for call in (
        lambda: buffer.put_group_nowait("later", [b"x"]),
        lambda: buffer.add_prompt_nowait("later"),
        lambda: buffer.mark_finished_nowait("bad"),
    ):
        with pytest.raises(CheckpointError, match="stopped"):
            call()
    with anyio.fail_after(10), pytest.raises(CheckpointError, match="stopped"):
        await buffer.put_group("later", [b"x"])
    assert "later" not in buffer
    assert buffer.stats() == before
    with anyio.fail_after(10):
        await buffer.save(tmp_path / "checkpoint")  # pickled: the payload the codec refused too
    assert "bad" in ReplayBuffer.restore(tmp_path / "checkpoint").buffer
    await buffer.aclose()


def test_interval_zero_commits_the_evictions_of_a_sample_whose_on_evict_raised(tmp_path: Path) -> None:
    """Defect (found by review): under ``journal_interval=0`` a sample that evicted groups and
    then raised (its ``on_evict`` did) returned before committing the evictions: a recovery
    brought the evicted group back."""

    def refuse(event: Any) -> None:
        raise RuntimeError("on_evict refused")

    path = tmp_path / "journal.db"
    config = SamplerConfig(failure_strategy="evict")
    buffer = ReplayBuffer(config, journal=path, journal_interval=0, on_evict=refuse)
    buffer.put_group_nowait("failed", [b"x"], status="failed")
    with pytest.raises(RuntimeError, match="on_evict refused"):
        buffer.sample_nowait(0, 1)
    copy = tmp_path / "copy.db"
    copy_journal(path, copy)
    recovered = ReplayBuffer.recover(copy).buffer
    assert state_of(recovered) == state_of(buffer)
    recovered.close()
    buffer.close()


async def test_interval_zero_commits_a_cut_made_by_a_sample_that_then_timed_out(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Defect (found by review): under ``journal_interval=0`` a waiting sample that cut a
    straggler at its deadline and then timed out returned before committing the cut (and no
    timer ever committed it)."""
    path = tmp_path / "journal.db"
    config = SamplerConfig(group_deadline_seconds=0.01)
    buffer = ReplayBuffer(config, journal=path, journal_interval=0)
    buffer.add_prompt_nowait("slow")
    buffer.mark_running_nowait("slow")
    with anyio.fail_after(10), pytest.raises(TimeoutError):
        await buffer.sample(0, 2, timeout=0.2)
    assert buffer.stats().total.cut_groups == 1
    copy = tmp_path / "copy.db"
    copy_journal(path, copy)
    recovered = ReplayBuffer.recover(copy, in_flight="keep").buffer
    assert state_of(recovered)[2] == state_of(buffer)[2]
    recovered.close()
    await buffer.aclose()


async def test_aclose_waiting_for_a_stuck_writer_is_cancellable(
    stuck: tuple[Path, sqlite3.Connection], anyio_backend: str
) -> None:
    """Defect (found by review): ``aclose`` waited for its final commit under a shield, so a
    writer stuck on another process's lock (up to a minute) or a hung disk held it past the
    caller's ``fail_after``. A cancelled ``aclose`` now closes the buffer at once; the final
    commit still lands once the writer gets through."""
    path, connection = stuck
    buffer = ReplayBuffer(journal=path, journal_interval=3600.0)
    connection.execute("BEGIN IMMEDIATE")
    buffer.put_group_nowait("a", [b"x"])
    with anyio.fail_after(10):
        with anyio.move_on_after(0.05) as scope:
            await buffer.aclose()
    assert scope.cancelled_caught
    assert buffer.closed
    with pytest.raises(CheckpointError, match="closed"):
        await buffer.flush()
    connection.execute("ROLLBACK")
    with anyio.fail_after(10):
        await until(lambda: buffer.stats().journal_commits == 2)
    assert "a" in ReplayBuffer.recover(path).buffer


def outcome_within(seconds: float, call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` in a daemon thread; its exception, None if it returned. Fails if it is
    still blocked after ``seconds`` (a hang becomes a failure, the thread left behind)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    return outcome[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_or_a_device_as_the_journal_is_refused_without_blocking(tmp_path: Path) -> None:
    """Defect (found by review): the journal's file check opened the path to read its header,
    which blocks forever on a FIFO (no writer comes): ``ReplayBuffer(journal=fifo)`` and
    ``recover(fifo)`` hung; a device (``/dev/null``) leaked sqlite3.OperationalError."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for attempt in (lambda: ReplayBuffer(journal=fifo), lambda: ReplayBuffer.recover(fifo)):
        assert isinstance(outcome_within(10, attempt), CheckpointError)
        assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert isinstance(outcome_within(10, lambda: ReplayBuffer(journal=os.devnull)), CheckpointError)
    with pytest.raises(IsADirectoryError):  # as save and restore say it
        ReplayBuffer(journal=tmp_path)


class Unsized:
    """A payload whose size cannot be asked (``sys.getsizeof`` raises)."""

    def __sizeof__(self) -> int:
        raise RuntimeError("no size on purpose")

    def __eq__(self, other: object) -> bool:
        return type(other) is Unsized

    __hash__ = object.__hash__


async def test_a_payload_whose_size_cannot_be_asked_is_journaled(tmp_path: Path, anyio_backend: str) -> None:
    """Defect (found by review): the hand-off's size estimate (backpressure) asked
    ``sys.getsizeof`` of each payload after it had taken the change log: a payload whose
    ``__sizeof__`` raised lost that commit's changes for good (a later commit then wrote counters
    that no longer conserved the groups: the journal could not be recovered), and the timer's
    exception crashed a trio run (TrioInternalError)."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=0.001)
    await buffer.put_group("a", [Unsized()])
    with anyio.fail_after(10):
        await until(lambda: buffer.stats().journal_commits >= 2)  # the timer's commit
    await buffer.put_group("b", [b"x"])
    await buffer.aclose()
    recovered = ReplayBuffer.recover(path).buffer
    assert sorted(group.uid for group in recovered.checkpoint().groups) == ["a", "b"]
    assert_conserved(recovered)
    recovered.close()


class Collecting:
    """A payload whose pickling runs the cyclic garbage collector (as any allocation may)."""

    def __reduce__(self) -> Any:
        gc.collect()
        return (Collecting, ())


def dropped_in_a_cycle(path: Path, lock: sqlite3.Connection) -> None:
    """A journaled buffer with a hand-off stuck behind ``lock`` (taken here) and a change made
    after it, dropped unclosed by an owner in a reference cycle (a trainer object, say)."""
    buffer = ReplayBuffer(journal=path, journal_interval=3600.0)
    owner: dict[str, Any] = {"buffer": buffer}
    owner["self"] = owner
    lock.execute("BEGIN IMMEDIATE")
    buffer.put_group_nowait("a", [Collecting()])

    async def flush_briefly() -> None:
        with anyio.move_on_after(0.05):
            await buffer.flush()  # handed off; the writer waits for the lock

    anyio.run(flush_briefly)
    buffer.put_group_nowait("late", [b"x"])


def test_a_buffer_collected_on_its_writer_thread_commits_and_stops(
    stuck: tuple[Path, sqlite3.Connection],
) -> None:
    """Defect (found by review): a buffer dropped unclosed is closed by its finalizer, in
    whichever thread the garbage collector runs; run in the journal's own writer thread (which
    allocates most while it pickles), the close waited for a commit only that thread could make:
    the writer hung forever inside its transaction, the file locked, the last changes lost."""
    path, connection = stuck
    dropped_in_a_cycle(path, connection)
    connection.execute("ROLLBACK")  # the writer pickles "a", collecting the buffer meanwhile
    copy = path.with_name("copy.db")
    for _ in range(1000):  # a hang shows as the final commit never landing
        for name in (copy, path.with_name("copy.db-wal")):
            with contextlib.suppress(OSError):
                name.unlink()
        copy_journal(path, copy)
        with contextlib.suppress(CheckpointError):
            recovered = ReplayBuffer.recover(copy).buffer
            uids = sorted(group.uid for group in recovered.checkpoint().groups)
            recovered.close()
            if uids == ["a", "late"]:
                return
        time.sleep(0.01)
    pytest.fail("the final commit never landed")


def test_interval_zero_commits_a_filter_eviction_whose_on_evict_raised(tmp_path: Path) -> None:
    """Defect (found by review, model test): under ``journal_interval=0`` a producer call whose
    group a filter evicted raised what ``on_evict`` raised before committing: the admission and
    the filter eviction were not durable when the call returned."""

    def refuse(event: Any) -> None:
        raise RuntimeError("on_evict refused")

    path, copy = tmp_path / "journal.db", tmp_path / "copy.db"
    buffer = ReplayBuffer(journal=path, journal_interval=0, on_evict=refuse, filters=[lambda group: False])
    buffer.add_prompt_nowait("open")
    calls = (
        lambda: buffer.put_group_nowait("new", [b"x"]),  # the fast path: a new finished group
        lambda: buffer.put_group_nowait("failed", [b"x"], tags={"k": "v"}, status="failed"),
        lambda: buffer.put_group_nowait("tagged", [b"x"], tags={"k": "v"}),  # the general path
        lambda: buffer.mark_finished_nowait("open"),
    )
    for call in calls:
        with contextlib.suppress(RuntimeError):
            call()
        copy_journal(path, copy)
        recovered = ReplayBuffer.recover(copy, in_flight="keep").buffer
        assert state_of(recovered) == state_of(buffer)
        recovered.close()
        for name in (copy, Path(f"{copy}-wal")):
            name.unlink(missing_ok=True)
    assert buffer.stats().total.evicted_filtered_groups == 3
    buffer.close()


def test_journal_bytes_of_a_relative_path_survive_a_change_of_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect (found by review): ``stats().journal_bytes`` measured the journal's path as given,
    relative to the working directory of the moment: after a ``chdir`` it reported 0, or the
    size of another file of that name."""
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    buffer = ReplayBuffer(journal="journal.db")
    before = buffer.stats().journal_bytes
    monkeypatch.chdir(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "journal.db").write_bytes(b"x")
    assert buffer.stats().journal_bytes == before
    buffer.close()


async def test_a_sample_that_times_out_on_a_journal_stopped_meanwhile_raises_its_timeout(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Review: a waiting sample journals what it changed when it times out (``journal_interval=0``);
    a writer that stopped meanwhile must not turn its TimeoutError (or a cancellation) into a
    CheckpointError: the stop is told by the call that caused it, and every producer call after."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=0, payload_codec=refusing_codec())
    errors: list[BaseException] = []

    async def sampler() -> None:
        try:
            await buffer.sample(0, 2, timeout=0.2)
        except BaseException as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(sampler)
            await anyio.sleep(0.02)
            with pytest.raises(CheckpointError, match="encode refused"):
                buffer.put_group_nowait("bad", [b"bad"])  # stops the writer
    assert [type(error) for error in errors] == [TimeoutError]
    buffer.close()


async def test_cancelled_flushes_leave_the_worker_threads_free(
    stuck: tuple[Path, sqlite3.Connection], anyio_backend: str
) -> None:
    """Defect (found by review): a flush waited for a stuck writer in a worker thread for as long
    as the writer was stuck; cancelled, the thread stayed blocked, and under trio it kept its
    token of anyio's default thread limiter: 40 cancelled flushes (a trainer retrying under a
    timeout) left every ``to_thread.run_sync`` of the program waiting for the journal."""
    buffer = await stuck_buffer(*stuck)
    for _ in range(45):
        with anyio.move_on_after(0.001):
            await buffer.flush()
    with anyio.fail_after(10):
        assert await anyio.to_thread.run_sync(lambda: 42) == 42
    stuck[1].execute("ROLLBACK")
    with anyio.fail_after(10):
        await buffer.flush()
    await buffer.aclose()
