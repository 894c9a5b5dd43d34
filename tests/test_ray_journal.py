"""stalebuf.ray with a journal: the file lives on the actor's node, holds payloads by value, and a new
actor recovers from it after the old one's process was SIGKILLed (at its last commit, or at the
trainer's checkpoint step, as a local buffer recovers from its own journal).

Runs on the local Ray instance of the session (see ``test_ray.py``: whichever file starts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import shutil
import signal
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

pytest.importorskip("ray")

import ray
import ray.cloudpickle

from stalebuf import BufferStats, ReplayBuffer, SamplerConfig, Status
from stalebuf.errors import BufferFullError, BufferUnavailableError, CheckpointError, ConfigError
from stalebuf.ray import PayloadRef, RemoteReplayBuffer, RemoteRestoreResult, resolve
from stalebuf.ray._protocol import PROTOCOL_VERSION

# The codec below runs in the actor's process, which cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEP_TIMEOUT = 30.0
#: The counters a recovered buffer has as its journal recorded them (BufferStats' == also
#: compares the groups' states; the journal_* fields are left out of it).
COUNTERS = ("admitted_groups", "admitted_trajectories", "sampled_groups", "sampled_trajectories", "finished")


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> Iterator[None]:
    """Start a local Ray instance unless one runs (``test_ray.py``'s session); stop what we start."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    if started:
        ray.shutdown()


def _json_encode(value: Any) -> bytes:
    return json.dumps(value).encode()


def _json_decode(data: bytes) -> Any:
    return json.loads(bytes(data))


JSON_CODEC = (_json_encode, _json_decode)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this machine) still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


async def _sigkill(buffer: RemoteReplayBuffer) -> None:
    """SIGKILL the actor's process and return once it has exited."""
    pid = await buffer.handle.__ray_call__.remote(lambda _host: os.getpid())
    os.kill(pid, signal.SIGKILL)
    while True:  # another process: nothing to wait on but polling
        if not _alive(pid):
            return
        await asyncio.sleep(0.05)


async def _committed(buffer: RemoteReplayBuffer, after: int) -> BufferStats:
    """Return the stats once the journal made a commit after its ``after``-th and has nothing left
    to commit (the commit timer's, not a flush's)."""
    while True:
        stats = await buffer.stats()
        if stats.journal_commits > after and stats.journal_lag_seconds == 0.0:
            return stats
        await asyncio.sleep(0.02)


def _copy_journal(source: Path, target: Path) -> Path:
    """Copy a journal whose writer is gone (its database and write-ahead log)."""
    for suffix in ("", "-wal"):
        if os.path.exists(str(source) + suffix):
            shutil.copyfile(str(source) + suffix, str(target) + suffix)
    return target


def test_the_protocol_version_says_the_journal_changed_the_records() -> None:
    assert PROTOCOL_VERSION == 9


@pytest.mark.parametrize("payloads", ["producer", "actor", "inline"])
@pytest.mark.asyncio
async def test_a_sigkilled_actor_is_recovered_with_every_group_committed_before_the_kill(
    tmp_path: Path, payloads: str
) -> None:
    """Groups committed by a flush and by the commit timer (no flush) survive a SIGKILL of the
    actor; the new actor holds them with their payloads' values (stored in its object store
    unless inline), the counters and the clock as they were, and reissues the in-flight group."""
    path = tmp_path / "run.journal"
    config = SamplerConfig(max_off_policy_threshold=3)
    buffer = RemoteReplayBuffer(
        config, journal=path, journal_interval=0.05, status_log_interval=None, payloads=payloads
    )
    recovered: RemoteReplayBuffer | None = None
    arrays = [np.arange(4) + i for i in range(3)]
    try:
        with anyio.fail_after(2 * STEP_TIMEOUT):
            await buffer.put_group("a", arrays[:2], tags={"k": 1})
            await buffer.put_group("b", [arrays[2], None], global_steps=1)
            await buffer.put_group("c", [ray.put("own")], global_steps=1)  # the user's own ObjectRef
            (taken, _) = await buffer.sample(1, 1)
            assert taken.uids == ["a"]
            await buffer.add_prompt("d")
            await buffer.mark_running("d")
            await buffer.put("d", "half")  # in flight: reissued
            await buffer.flush()
            commits = (await buffer.stats()).journal_commits
            await buffer.put_group("e", [b"timer"], global_steps=1)  # committed by the timer alone
            before = await _committed(buffer, commits)
            clock = await buffer.dispatch_step()
            await _sigkill(buffer)
            with pytest.raises(BufferUnavailableError):
                await buffer.stats()
            result = RemoteReplayBuffer.recover(path, status_log_interval=None, payloads=payloads)
            recovered = result.buffer
            assert isinstance(result, RemoteRestoreResult)
            assert [(g.uid, g.status, g.trajectories) for g in result.reissue] == [("d", Status.PENDING, ())]
            assert (result.kept, result.dropped) == ((), ())
            after = await recovered.stats()
            for field in COUNTERS:
                assert getattr(after.total, field) == getattr(before.total, field), field
            assert (after.total.pending, after.total.reissued_groups) == (1, 1)
            assert after.journal_commits >= 1  # journaling on into the same file
            assert await recovered.dispatch_step() == clock
            await recovered.mark_running("d")
            await recovered.put("d", "whole")
            await recovered.mark_finished("d")
            batch, _ = await recovered.sample(1, 4)
            assert sorted(batch.uids) == ["b", "c", "d", "e"]
            by_uid = {group.uid: group for group in batch.groups}
            first = by_uid["b"].trajectories[0].payload
            assert isinstance(first, np.ndarray if payloads == "inline" else PayloadRef)
            values = {g.uid: [t.payload for t in g.trajectories] for g in (await resolve(batch)).groups}
            assert np.array_equal(values["b"][0], arrays[2])
            assert values["b"][1] is None
            assert (values["c"], values["d"], values["e"]) == (["own"], ["whole"], [b"timer"])
    finally:
        buffer.kill()
        if recovered is not None:
            recovered.kill()


async def _checkpoint_scenario(buffer: Any) -> list[str]:
    """The trainer marks step 0, then samples step 1 while producers add a new group and re-add
    the uid that step 1 sampled; return what each sample took (all committed by the flushes)."""

    async def sample(step: int, size: int) -> list[str]:
        batch, _ = await buffer.sample(step, size)
        return list(batch.uids)

    async def put_group(uid: str, payload: bytes, step: int) -> None:
        await buffer.put_group(uid, [payload], global_steps=step)

    for i in range(4):
        await put_group(f"g{i}", b"v%d" % i, 0)
    taken = await sample(0, 2)
    await buffer.flush(checkpoint_step=0)  # the trainer saved its state at step 0
    taken += await sample(1, 1)
    await put_group("late", b"late", 1)
    await put_group(taken[-1], b"again", 1)  # the uid step 1 sampled, added again
    await buffer.flush()
    return taken


@pytest.mark.asyncio
async def test_recover_at_the_trainers_checkpoint_step_matches_a_local_recovery(tmp_path: Path) -> None:
    """``flush(checkpoint_step=g)`` + ``recover(global_steps=g)``: what the later sample took is
    resident again, what producers added after the point is kept (and listed), the older group
    of a re-added uid is dropped, exactly as a local buffer recovers from its own journal; a
    step the journal has no sample of is refused, the journal left recoverable."""
    local_path, path = tmp_path / "local.journal", tmp_path / "remote.journal"
    local = ReplayBuffer(journal=local_path, status_log_interval=None)
    buffer = RemoteReplayBuffer(journal=path, status_log_interval=None, payloads="actor")
    recovered: RemoteReplayBuffer | None = None
    try:
        with anyio.fail_after(2 * STEP_TIMEOUT):
            assert await _checkpoint_scenario(local) == ["g0", "g1", "g2"]
            await local.aclose()
            want = ReplayBuffer.recover(local_path, global_steps=0, status_log_interval=None)
            assert await _checkpoint_scenario(buffer) == ["g0", "g1", "g2"]
            await _sigkill(buffer)
            with pytest.raises(CheckpointError, match="recoverable steps on it are 0"):
                RemoteReplayBuffer.recover(path, global_steps=5)
            result = RemoteReplayBuffer.recover(path, global_steps=0, status_log_interval=None)
            recovered = result.buffer
            assert [g.uid for g in result.kept] == [g.uid for g in want.kept] == ["late", "g2"]
            assert [g.uid for g in result.dropped] == [g.uid for g in want.dropped] == ["g2"]
            assert isinstance(result.kept[0].trajectories[0].payload, PayloadRef)
            assert await recovered.stats() == want.buffer.stats()  # counters and groups' states
            assert await recovered.dispatch_step() == want.buffer.dispatch_step()
            batch, _ = await recovered.sample(1, 3)
            local_batch, _ = await want.buffer.sample(1, 3)
            assert batch.uids == local_batch.uids
            assert (await resolve(batch)).payloads == local_batch.payloads
            await want.buffer.aclose()
    finally:
        buffer.kill()
        if recovered is not None:
            recovered.kill()


@pytest.mark.asyncio
async def test_a_journal_written_by_an_actor_reads_locally_with_its_payload_codec(tmp_path: Path) -> None:
    """The journal holds payload values, not object references: a local ``ReplayBuffer.recover``
    reads a copy with pickle as its payload codec (the default), or with the user's codec (the
    file then holds no pickle), which a remote recovery takes too."""
    for codec, local_codec in ((None, (pickle.dumps, pickle.loads)), (JSON_CODEC, JSON_CODEC)):
        path = tmp_path / f"{codec is None}.journal"
        buffer = RemoteReplayBuffer(journal=path, status_log_interval=None, payload_codec=codec)
        recovered: RemoteReplayBuffer | None = None
        try:
            with anyio.fail_after(STEP_TIMEOUT):
                await buffer.put_group("a", [{"x": [1, 2]}, "s"], tags={"reward": 1.0})
                await buffer.flush()
                buffer.kill()
                copy = _copy_journal(path, tmp_path / f"{codec is None}.copy")
                local = ReplayBuffer.recover(copy, payload_codec=local_codec, status_log_interval=None)
                assert local.buffer.sample_nowait(0, 1)[0].payloads == [{"x": [1, 2]}, "s"]
                result = RemoteReplayBuffer.recover(path, payload_codec=codec, status_log_interval=None)
                recovered = result.buffer
                batch, _ = await recovered.sample(0, 1)
                assert (await resolve(batch)).payloads == [{"x": [1, 2]}, "s"]
                assert dict(batch.groups[0].tags) == {"reward": 1.0}
        finally:
            buffer.kill()
            if recovered is not None:
                recovered.kill()


@pytest.mark.asyncio
async def test_restore_and_from_config_journal_into_a_new_file(tmp_path: Path) -> None:
    """A restored actor's journal starts with the restored state; ``from_config`` journals too;
    each is recovered by a new actor after ``kill()`` (Ray's SIGKILL of the process)."""
    checkpoint, journal = tmp_path / "buffer.ckpt", tmp_path / "restored.journal"
    source = RemoteReplayBuffer.from_config(
        {"max_off_policy_threshold": 2}, journal=tmp_path / "built.journal", status_log_interval=None
    )
    actors = [source]
    try:
        with anyio.fail_after(2 * STEP_TIMEOUT):
            await source.put_group("a", [b"1"])
            await source.save(checkpoint)
            await source.flush()
            source.kill()
            again = RemoteReplayBuffer.recover(tmp_path / "built.journal", status_log_interval=None).buffer
            actors.append(again)
            assert (await again.stats()).total.finished == 1
            built = RemoteReplayBuffer.restore(checkpoint, journal=journal, status_log_interval=None)
            restored = built.buffer
            actors.append(restored)
            await restored.put_group("b", [b"2"])
            await restored.flush()
            restored.kill()
            result = RemoteReplayBuffer.recover(journal, status_log_interval=None)
            actors.append(result.buffer)
            batch, _ = await result.buffer.sample(0, 2)
            assert batch.uids == ["a", "b"]
            assert (await resolve(batch)).payloads == [b"1", b"2"]
            assert (await result.buffer.info())["config"].max_off_policy_threshold == 2
    finally:
        for actor in actors:
            actor.kill()


@pytest.mark.asyncio
async def test_flush_commits_marks_and_refuses_as_locally(tmp_path: Path) -> None:
    """``flush`` returns once committed (and at once without a journal), survives a cancelled
    call, refuses a bad ``checkpoint_step`` before asking the actor, and raises CheckpointError
    once the buffer is closed; the stats carry the journal's fields."""
    plain = RemoteReplayBuffer(status_log_interval=None)
    buffer = RemoteReplayBuffer(journal=tmp_path / "j", journal_interval=60.0, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await plain.flush(checkpoint_step=3)
            assert (await plain.stats()).journal_commits == 0
            await buffer.put_group("a", [b"x" * 1000])
            pending = await buffer.stats()
            assert pending.journal_lag_seconds > 0.0  # a 60 s interval: not committed yet
            flushing = asyncio.ensure_future(buffer.flush(checkpoint_step=0))
            await asyncio.sleep(0)
            flushing.cancel()  # the commit may still land; the journal stays usable
            with pytest.raises(asyncio.CancelledError):
                await flushing
            await buffer.flush(checkpoint_step=0)
            stats = await buffer.stats()
            assert stats.journal_commits > pending.journal_commits
            assert stats.journal_lag_seconds == 0.0
            assert stats.journal_pending_bytes == 0
            assert stats.journal_bytes > 1000
            with pytest.raises(ValueError, match="checkpoint_step"):
                await buffer.flush(checkpoint_step=-1)
            with pytest.raises(TypeError, match="checkpoint_step"):
                await buffer.flush(checkpoint_step=True)
            await buffer.aclose()
            with pytest.raises(CheckpointError, match="closed"):
                await buffer.flush()
    finally:
        plain.kill()
        buffer.kill()


@pytest.mark.asyncio
async def test_remote_producer_calls_wait_while_the_journals_writer_is_behind(tmp_path: Path) -> None:
    """Defect: the actor applied a client's ``put`` and ``mark_*`` as their ``*_nowait`` forms,
    so while the journal's writer was behind they raised BufferFullError instead of waiting as
    the local async calls do; a remote ``rollout()`` admitted then left its group PENDING. Now
    they wait for the writer and then run, in order; ``put_group_nowait`` still raises."""
    path = tmp_path / "j"
    buffer = RemoteReplayBuffer(
        journal=path, journal_interval=0.001, journal_max_pending_bytes=1, status_log_interval=None
    )
    lock = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=False)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await buffer.add_prompt("g", global_steps=0)
            await buffer.flush()
            lock.execute("BEGIN IMMEDIATE")  # the actor's writer cannot commit now
            await buffer.put_group("other", [b"x" * 100], global_steps=0)
            while True:  # the writer is another process's thread: polled
                if (await buffer.stats()).journal_pending_bytes > 1:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(BufferFullError, match="journal_max_pending_bytes"):
                await buffer.put_group_nowait("refused", [b"z"], global_steps=0)
            put = asyncio.ensure_future(buffer.put("g", b"p"))
            finish = asyncio.ensure_future(buffer.mark_finished("g"))
            entered: list[str] = []

            async def produce() -> None:
                async with buffer.rollout("r", global_steps=0) as group:
                    entered.append(group.uid)

            rollout = asyncio.ensure_future(produce())
            await asyncio.sleep(0.3)
            assert [call.done() for call in (put, finish, rollout)] == [False] * 3
            lock.execute("ROLLBACK")
            assert await put == "g_0_0"
            await finish
            await rollout
            assert entered == ["r"]
            groups = {group.uid: group for group in (await buffer.sample(0, 3))[0]}
            assert groups["g"].status is Status.FINISHED
            assert [t.key for t in groups["g"].trajectories] == ["g_0_0"]
            assert groups["r"].status is Status.FINISHED
    finally:
        with contextlib.suppress(sqlite3.Error):
            lock.execute("ROLLBACK")
        lock.close()
        buffer.kill()


@pytest.mark.asyncio
async def test_a_file_the_actor_refuses_is_left_as_it_was(tmp_path: Path) -> None:
    """A journal that exists is refused by a new buffer (every call raises CheckpointError) and by
    a restore (the actor is ended); a foreign, missing or empty file cannot be recovered from;
    each file stays byte-for-byte as it was."""
    path = tmp_path / "run.journal"
    first = RemoteReplayBuffer(journal=path, status_log_interval=None)
    second = None
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await first.put_group("a", [b"x"])
            await first.aclose()  # the final commit
            first.kill()
            written = path.read_bytes()
            second = RemoteReplayBuffer(journal=path, status_log_interval=None)
            with pytest.raises(CheckpointError, match="recover from it"):
                await second.stats()
            source = RemoteReplayBuffer(status_log_interval=None)
            await source.save(tmp_path / "b.ckpt")
            source.kill()
            with pytest.raises(CheckpointError, match="recover from it"):
                RemoteReplayBuffer.restore(tmp_path / "b.ckpt", journal=path)
            assert path.read_bytes() == written
            foreign = tmp_path / "foreign"
            foreign.write_bytes(b"not a journal at all")
            with pytest.raises(CheckpointError, match="not a stalebuf journal"):
                RemoteReplayBuffer.recover(foreign)
            assert foreign.read_bytes() == b"not a journal at all"
            with pytest.raises(CheckpointError, match="does not exist"):
                RemoteReplayBuffer.recover(tmp_path / "missing")
            (tmp_path / "empty").write_bytes(b"")
            with pytest.raises(CheckpointError, match="is empty"):
                RemoteReplayBuffer.recover(tmp_path / "empty")
    finally:
        first.kill()
        if second is not None:
            second.kill()


class _Unpicklable:
    """A codec half that cannot travel to the actor (it holds a lock)."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()

    def __call__(self, value: Any) -> Any:
        return value


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"journal": 3}, "journal must be None or a path"),
        ({"journal": ""}, "non-empty"),
        ({"journal": "j", "journal_interval": -1.0}, "journal_interval"),
        ({"journal": "j", "journal_interval": float("nan")}, "journal_interval"),
        ({"journal": "j", "journal_retention_steps": -1}, "journal_retention_steps"),
        ({"journal": "j", "journal_retention_steps": 1.5}, "journal_retention_steps"),
        ({"journal": "j", "journal_max_pending_bytes": 0}, "journal_max_pending_bytes"),
        ({"journal": "j", "journal_max_pending_bytes": True}, "journal_max_pending_bytes"),
        ({"journal": "j", "payload_codec": pickle.dumps}, "payload_codec"),
        ({"journal": "j", "payload_codec": (_Unpicklable(), pickle.loads)}, "cannot be pickled"),
    ],
)
def test_bad_journal_arguments_are_refused_before_any_actor_starts(
    arguments: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Any] = []
    monkeypatch.setattr("stalebuf.ray._connection.actor_class", lambda groups: started.append(groups))
    for build in (
        lambda: RemoteReplayBuffer(**arguments),
        lambda: RemoteReplayBuffer.from_config({}, **arguments),
    ):
        with pytest.raises(ConfigError, match=message):
            build()
    assert started == []


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"journal": None}, "journal must be a path"),
        ({"journal": 3}, "journal must be None or a path"),
        ({"journal": "j", "global_steps": -1}, "global_steps"),
        ({"journal": "j", "global_steps": "0"}, "global_steps"),
        ({"journal": "j", "partition": 3}, "partition"),
        ({"journal": "j", "in_flight": "drop"}, "in_flight"),
        ({"journal": "j", "journal_interval": -1}, "journal_interval"),
        ({"journal": "j", "payload_codec": (1, 2)}, "payload_codec"),
    ],
)
def test_bad_recover_arguments_are_refused_before_any_actor_starts(
    arguments: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Any] = []
    monkeypatch.setattr("stalebuf.ray._connection.actor_class", lambda groups: started.append(groups))
    journal = arguments.pop("journal")
    with pytest.raises(ConfigError, match=message):
        RemoteReplayBuffer.recover(journal, **arguments)
    assert started == []
