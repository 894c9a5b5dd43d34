"""Recovering from a journal (issue 25) without a crash: each test closes its buffer (the final
commit) and recovers from the file, on asyncio and trio, every wait bounded by ``anyio.fail_after``.

The conflicts of recovering at a trainer's step ``g`` (consumer side after the point undone,
producer side kept): a uid sampled after the point and added again keeps the newer group; slots
later samples freed may leave a tag above its admission cap; an ``on_evict`` refill is kept while
the group it replaced comes back. Refusals (no such step, a file that is no journal) leave the
file as it was; recovering twice at one step gives one state; a payload codec round-trips.
(``tests/test_journal_recovery_model.py`` checks recoveries at every step of seeded runs against a
brute-force model; ``tests/test_journal_crash.py`` kills processes.)
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from _helpers import (
    LIMIT,
    assert_conserved,
    copy_journal,
    group_contents,
    resident_count,
    resident_groups,
    snapshot,
)
from stalebuf import (
    BufferFullError,
    EvictionEvent,
    Group,
    ReplayBuffer,
    SamplerConfig,
    Status,
)
from stalebuf.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.anyio


def payloads(group: Group) -> list[Any]:
    return [trajectory.payload for trajectory in group.trajectories]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def logical(path: Path, scratch: Path) -> list[str]:
    """The journal's content as SQL, read from a copy (so reading it changes nothing)."""
    scratch.mkdir(exist_ok=True)
    copy = scratch / "copy.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{copy}{suffix}").unlink(missing_ok=True)
    copy_journal(path, copy)
    connection = sqlite3.connect(copy)
    try:
        return list(connection.iterdump())
    finally:
        connection.close()


def recover(path: Path, **options: Any) -> Any:
    return ReplayBuffer.recover(path, status_log_interval=None, **options)


# -- conflicts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("again", ["finished", "in flight", "sampled again"])
async def test_a_uid_sampled_after_the_point_and_added_again_keeps_the_newer_group(
    tmp_path: Path, again: str
) -> None:
    """The older group of the uid comes back from the undone sample, the newer was added after
    the point: the newer is kept, the older dropped (``dropped``) and counted evicted "restart"."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=4), journal=path, status_log_interval=None
        )
        await buffer.put_group("a", [b"a0"])
        await buffer.put_group("x", [b"old0", b"old1"])
        assert (await buffer.sample(0, 1))[0].uids == ["a"]
        await buffer.flush(checkpoint_step=0)
        assert (await buffer.sample(1, 1))[0].uids == ["x"]
        if again == "in flight":
            await buffer.add_prompt("x")
            await buffer.put("x", b"new0")
        else:
            await buffer.put_group("x", [b"new0"])
        if again == "sampled again":  # both incarnations removed by samples after the point
            assert (await buffer.sample(2, 1))[0].uids == ["x"]
        await buffer.aclose()

        result = recover(path, global_steps=0)
        buffer = result.buffer
        assert [(group.uid, payloads(group)) for group in result.dropped] == [("x", [b"old0", b"old1"])]
        newer = [] if again == "in flight" else [b"new0"]  # reissued: its partial work discarded
        assert [(group.uid, payloads(group)) for group in result.kept] == [("x", [b"new0"])]
        assert [group.uid for group in result.reissue] == (["x"] if again == "in flight" else [])
        assert {uid: body for uid, (_, _, body) in group_contents(buffer).items()} == {"x": newer}
        total = buffer.stats().total
        assert (total.evicted_restart_groups, total.evicted_restart_trajectories) == (1, 2)
        assert (total.admitted_groups, total.sampled_groups, total.groups) == (3, 1, 1)
        assert_conserved(buffer)
        if again != "in flight":  # the resumed trainer trains the newer group
            batch, _ = await buffer.sample(1, 1)
            assert [payloads(group) for group in batch] == [[b"new0"]]
        await buffer.aclose()


async def test_slots_later_samples_freed_may_leave_a_tag_over_its_cap_until_admission_drains_it(
    tmp_path: Path,
) -> None:
    """Recovered at step 1, tag 1 holds the groups sample(2) had taken (twice) and the ones
    admitted into the slots they freed: 6 > b = 2, and 8 resident > capacity() = 6. Admission at
    the clock waits until the tag it would use is below the cap; from the moment the buffer is
    within capacity() it stays so, with producers filling every slot at every step."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        config = SamplerConfig(max_off_policy_threshold=3, admission_batch_size=2)
        buffer = ReplayBuffer(config, journal=path, status_log_interval=None)

        def put(uid: str, step: int | None = None) -> None:
            buffer.put_group_nowait(uid, [uid.encode()], global_steps=step)

        put("a0"), put("a1")
        await buffer.sample(0, 2)
        put("b0"), put("b1")
        await buffer.sample(1, 2)
        await buffer.flush(checkpoint_step=1)  # the point
        put("c0"), put("c1")
        await buffer.sample(2, 2)  # takes c0, c1: tag 1's slots free again
        put("d0", 1), put("d1", 1)
        await buffer.sample(2, 2)  # takes d0, d1
        put("d2", 1), put("d3", 1), put("e0"), put("e1")  # e*: tag 2
        assert resident_count(buffer) <= buffer.capacity()  # type: ignore[operator]
        await buffer.aclose()

        result = recover(path, global_steps=1)
        buffer = result.buffer
        steps = {uid: step for uid, (_, step, _) in group_contents(buffer).items()}
        assert steps == {"c0": 1, "c1": 1, "d0": 1, "d1": 1, "d2": 1, "d3": 1, "e0": 2, "e1": 2}
        assert [group.uid for group in result.kept] == list(steps)  # all admitted after the point
        assert buffer.dispatch_step() == 1
        assert (resident_count(buffer), buffer.capacity(), buffer.free_slots()) == (8, 6, 0)
        assert buffer.full()
        with pytest.raises(BufferFullError):
            buffer.add_prompt_nowait("refused")

        admitted: list[str] = []

        async def producer(uid: str) -> None:
            await buffer.add_prompt(uid)
            admitted.append(uid)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(producer, "n")
            await anyio.wait_all_tasks_blocked()
            assert (admitted, buffer.stats().total.waiting_producers) == ([], 1)
            assert (await buffer.sample(2, 2))[0].uids == ["c0", "c1"]
            await anyio.wait_all_tasks_blocked()
            assert admitted == []  # tag 2 (the clock's) is full: e0, e1
            assert resident_count(buffer) == 6  # within capacity() from here on
            assert (await buffer.sample(3, 2))[0].uids == ["d0", "d1"]
            await anyio.wait_all_tasks_blocked()
            assert admitted == ["n"]
            assert steps_of_uid(buffer, "n") == 3
        for step in range(4, 10):  # producers take every slot admission gives; the trainer samples
            for i in range(10):
                try:
                    buffer.put_group_nowait(f"s{step}-{i}", [b"x"])
                except BufferFullError:
                    break
            assert resident_count(buffer) <= buffer.capacity()  # type: ignore[operator]
            await buffer.sample(step, 2)
            assert resident_count(buffer) <= buffer.capacity()  # type: ignore[operator]
        assert_conserved(buffer)
        await buffer.aclose()


def steps_of_uid(buffer: ReplayBuffer, uid: str) -> int:
    return resident_groups(buffer)[uid].dispatch_step


async def test_an_on_evict_refill_after_the_point_is_kept_and_the_group_it_replaced_comes_back(
    tmp_path: Path,
) -> None:
    """sample(2) evicts b and c as stale and ``on_evict`` refills their prompts: recovered at 0,
    b and c are resident again and so are their refills; ``kept`` lists every group admitted
    after the point (c, b's refill, c's refill), so a data loader restored to step 0 skips them."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffers: list[ReplayBuffer] = []

        def refill(event: EvictionEvent) -> None:
            for group in event.groups:
                buffers[0].add_prompt_nowait(f"{group.uid}-refill")

        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=2),
            journal=path,
            on_evict=refill,
            status_log_interval=None,
        )
        buffers.append(buffer)
        buffer.put_group_nowait("a", [b"a"])
        buffer.put_group_nowait("b", [b"b"])
        assert (await buffer.sample(0, 1))[0].uids == ["a"]
        await buffer.flush(checkpoint_step=0)
        buffer.put_group_nowait("c", [b"c"])
        async with anyio.create_task_group() as tasks:
            batches: list[list[str]] = []

            async def trainer() -> None:
                batches.append((await buffer.sample(2, 1))[0].uids)

            tasks.start_soon(trainer)
            await anyio.wait_all_tasks_blocked()  # b and c evicted, refilled; the sample waits
            await buffer.mark_running("b-refill")
            await buffer.put("b-refill", b"b2")
            await buffer.mark_finished("b-refill")
        assert batches == [["b-refill"]]
        assert buffer.stats().total.evicted_stale_groups == 2
        await buffer.aclose()

        result = recover(path, global_steps=0)
        buffer = result.buffer
        assert group_contents(buffer) == {
            "b": (Status.FINISHED, 0, [b"b"]),
            "c": (Status.FINISHED, 0, [b"c"]),
            "b-refill": (Status.FINISHED, 2, [b"b2"]),
            "c-refill": (Status.PENDING, 2, []),
        }
        assert [group.uid for group in result.kept] == ["c", "b-refill", "c-refill"]
        assert [group.uid for group in result.reissue] == ["c-refill"]
        total = buffer.stats().total
        assert (total.evicted_stale_groups, total.sampled_groups, total.admitted_groups) == (0, 1, 5)
        assert_conserved(buffer)
        await buffer.aclose()


# -- refusals ----------------------------------------------------------------------------------


async def test_a_step_with_no_committed_sample_is_refused_naming_the_recoverable_steps(
    tmp_path: Path,
) -> None:
    """With ``journal_retention_steps=1`` the journal keeps the samples of steps 3 and 4: step 0
    (deleted), step 9 (never sampled) and a partition never sampled are refused, the journal
    stays logically as it was, and recovering at its last commit gives the buffer it held."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=8),
            journal=path,
            journal_retention_steps=1,
            status_log_interval=None,
        )
        for i in range(8):
            buffer.put_group_nowait(f"g{i}", [i.to_bytes(1, "big")])
        for step in range(5):
            await buffer.sample(step, 1)
        before = snapshot(buffer)
        await buffer.aclose()
        dump = logical(path, tmp_path / "scratch")
        for step, partition, message in (
            (0, "train", "its recoverable steps on it are 3 (oldest) to 4 (newest)"),
            (9, "train", "its recoverable steps on it are 3 (oldest) to 4 (newest)"),
            (3, "other", "it holds no committed sample on it"),
        ):
            with pytest.raises(
                CheckpointError, match=re.escape(f"global_steps={step})") + ".*" + re.escape(message)
            ):
                recover(path, global_steps=step, partition=partition)
            assert logical(path, tmp_path / "scratch") == dump
        result = recover(path)
        assert snapshot(result.buffer) == before
        await result.buffer.aclose()


async def test_a_recover_whose_on_evict_raises_leaves_the_journal_as_it_was(tmp_path: Path) -> None:
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=8), journal=path, status_log_interval=None
        )
        buffer.put_group_nowait("done", [b"d"])
        buffer.add_prompt_nowait("half")
        buffer.put_nowait("half", b"h")
        await buffer.sample(0, 1)
        await buffer.flush(checkpoint_step=0)
        buffer.put_group_nowait("later", [b"l"])
        await buffer.sample(1, 1)
        await buffer.aclose()
        dump = logical(path, tmp_path / "scratch")

        def boom(event: EvictionEvent) -> None:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            recover(path, global_steps=0, in_flight="evict", on_evict=boom)
        assert logical(path, tmp_path / "scratch") == dump
        result = recover(path, global_steps=0, in_flight="evict")  # recoverable as before
        assert sorted(group_contents(result.buffer)) == ["later"]
        assert result.buffer.stats().total.evicted_restart_groups == 1
        assert_conserved(result.buffer)
        await result.buffer.aclose()


async def make_journal(path: Path, **options: Any) -> None:
    buffer = ReplayBuffer(
        SamplerConfig(max_off_policy_threshold=8), journal=path, status_log_interval=None, **options
    )
    for i in range(16):
        buffer.put_group_nowait(f"g{i}", [bytes(4096), bytes(4096)])
    await buffer.sample(0, 2)
    await buffer.flush(checkpoint_step=0)
    await buffer.aclose()


async def write_file(kind: str, path: Path) -> None:
    """A file ``recover`` must refuse: ``kind`` says what it holds."""
    if kind == "checkpoint":
        buffer = ReplayBuffer(SamplerConfig(), status_log_interval=None)
        buffer.put_group_nowait("g", [b"p"])
        await buffer.save(path)
    elif kind in ("torn", "format 2"):
        await make_journal(path)
    alter(kind, path)


def alter(kind: str, path: Path) -> None:
    """Write (or change) the file of ``kind`` (see :func:`write_file`)."""
    if kind == "text":
        path.write_text("not a database\n" * 100)
    elif kind == "sqlite":
        connection = sqlite3.connect(path)
        connection.execute("CREATE TABLE stalebuf (key TEXT PRIMARY KEY, value)")
        connection.execute("INSERT INTO stalebuf VALUES ('format', 1)")
        connection.commit()
        connection.close()
    elif kind == "torn":  # a journal cut in the middle
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "format 2":
        connection = sqlite3.connect(path)
        connection.execute("UPDATE stalebuf SET value = 2 WHERE key = 'format'")
        connection.commit()
        connection.close()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("text", "is not a stalebuf journal"),
        ("sqlite", "not a stalebuf journal"),
        ("checkpoint", "restore it with ReplayBuffer.restore"),
        ("torn", "malformed|torn"),
        ("format 2", "format 2"),
    ],
)
async def test_a_file_that_is_no_journal_is_refused_and_left_byte_for_byte(
    tmp_path: Path, kind: str, message: str
) -> None:
    """A foreign file, an SQLite database of another program, a checkpoint, a torn journal and a
    journal of another format: ``recover`` raises CheckpointError, and so does a new buffer
    journaling into it; the file keeps every byte."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "file.db"
        await write_file(kind, path)
        before = digest(path)
        with pytest.raises(CheckpointError, match=message):
            recover(path)
        assert digest(path) == before
        with pytest.raises(CheckpointError):
            recover(path, global_steps=0)
        assert digest(path) == before
        with pytest.raises(CheckpointError):
            ReplayBuffer(SamplerConfig(), journal=path)
        assert digest(path) == before


@pytest.mark.parametrize("kind", ["absent", "empty"])
async def test_no_journal_to_recover_from_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "journal.db"
    if kind == "empty":
        path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="no journal to recover from"):
        recover(path)
    assert path.exists() is (kind == "empty")
    if kind == "empty":
        assert path.read_bytes() == b""


async def test_a_new_buffer_refuses_an_existing_journal_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        await make_journal(path)
        before = digest(path)
        with pytest.raises(CheckpointError, match="recover from it"):
            ReplayBuffer(SamplerConfig(), journal=path)
        assert digest(path) == before


# -- idempotence -------------------------------------------------------------------------------


async def test_recovering_twice_at_one_step_gives_one_state_and_the_history_after_it_is_void(
    tmp_path: Path,
) -> None:
    """A crash right after a recovery at step 0 recovers at step 0 again: the same groups, the
    same counters (but ``reissued_groups``, which counts each recovery's reissued groups), the
    same clock; the steps sampled after the point are no longer recoverable."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=8), journal=path, status_log_interval=None
        )
        for i in range(6):
            buffer.put_group_nowait(f"g{i}", [b"p", b"q"])
        buffer.add_prompt_nowait("half")
        buffer.mark_running_nowait("half")
        buffer.put_nowait("half", b"h")
        await buffer.sample(0, 1)
        await buffer.flush(checkpoint_step=0)
        buffer.add_prompt_nowait("late")
        await buffer.sample(1, 2)
        await buffer.sample(2, 2)
        await buffer.aclose()

        first = recover(path, global_steps=0)
        once = snapshot(first.buffer)
        assert [group.uid for group in first.reissue] == ["half", "late"]
        await first.buffer.aclose()
        second = recover(path, global_steps=0)
        twice = snapshot(second.buffer)
        assert [group.uid for group in second.reissue] == ["half", "late"]
        assert [group.uid for group in second.kept] == [group.uid for group in first.kept] == ["late"]
        assert second.buffer.dispatch_step() == 0
        await second.buffer.aclose()
        assert twice[1:] == once[1:]  # the groups and the order
        assert twice[0].total.reissued_groups == once[0].total.reissued_groups + 2
        assert without_reissued(twice[0]) == without_reissued(once[0])
        for step in (1, 2):
            with pytest.raises(
                CheckpointError, match=re.escape("recoverable steps on it are 0 (oldest) to 0 (newest)")
            ):
                recover(path, global_steps=step)
        last = recover(path)  # the last commit: the second recovery's state
        assert snapshot(last.buffer)[1:] == twice[1:]
        await last.buffer.aclose()


def without_reissued(stats: Any) -> Any:
    partitions = {name: attrs.evolve(p, reissued_groups=0) for name, p in stats.partitions.items()}
    return attrs.evolve(stats, total=attrs.evolve(stats.total, reissued_groups=0), partitions=partitions)


async def test_a_crash_after_a_recovery_and_before_the_next_mark_recovers_at_the_same_step(
    tmp_path: Path,
) -> None:
    """Resumed at its mark (step 0) and killed again before it marked anew, the trainer's newest
    checkpoint is still step 0: the journal keeps the history since it, however many steps the
    resumed run sampled past ``journal_retention_steps`` ("history since the newest marked step
    is always kept"), and recovers at step 0 again. (``recover`` used to delete the mark of the
    step it recovered at, which follows that step's sample: retention then deleted the sample.)"""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=8),
            journal=path,
            journal_retention_steps=1,
            status_log_interval=None,
        )
        for i in range(12):
            buffer.put_group_nowait(f"g{i}", [i.to_bytes(1, "big")])
        await buffer.sample(0, 1)
        await buffer.flush(checkpoint_step=0)
        await buffer.sample(1, 1)
        await buffer.aclose()
        first = recover(path, global_steps=0, journal_retention_steps=1)
        resumed = group_contents(first.buffer)
        for step in range(1, 5):  # no mark: the trainer dies before its next checkpoint
            await first.buffer.sample(step, 1)
        await first.buffer.aclose()
        again = recover(path, global_steps=0, journal_retention_steps=1)
        assert group_contents(again.buffer) == resumed
        assert again.buffer.dispatch_step() == 0
        await again.buffer.aclose()


# -- the payload codec -------------------------------------------------------------------------

CODEC = (bytes, bytes)  # bytes payloads stored as they are: no pickle in the file


async def test_a_codec_journal_round_trips_and_refuses_the_wrong_codec(tmp_path: Path) -> None:
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=4),
            journal=path,
            payload_codec=CODEC,
            status_log_interval=None,
        )
        buffer.put_group_nowait("a", [b"a"])
        buffer.put_group_nowait("b", [b"\x00b", bytes(range(256))], tags={"task": "math"}, tokens=[3, 4])
        buffer.add_prompt_nowait("c")
        buffer.mark_running_nowait("c")
        buffer.put_nowait("c", b"partial", versions=[(0, 2)])
        assert (await buffer.sample(0, 1))[0].uids == ["a"]
        await buffer.flush(checkpoint_step=0)
        buffer.put_group_nowait("d", [b"d"], trajectory_tags=[{"reward": 0.5}])
        assert (await buffer.sample(1, 1))[0].uids == ["b"]
        await buffer.aclose()
        dump = logical(path, tmp_path / "scratch")
        with pytest.raises(CheckpointError, match="pass payload_codec="):
            recover(path, global_steps=0)
        assert logical(path, tmp_path / "scratch") == dump

        result = recover(path, global_steps=0, payload_codec=CODEC, in_flight="resume")
        buffer = result.buffer
        groups = resident_groups(buffer)
        assert sorted(groups) == ["b", "c", "d"]
        assert [t.payload for t in groups["b"].trajectories] == [b"\x00b", bytes(range(256))]
        assert [t.tokens for t in groups["b"].trajectories] == [3, 4]
        assert dict(groups["b"].tags) == {"task": "math"}
        assert dict(groups["d"].trajectories[0].tags) == {"reward": 0.5}
        assert [(g.uid, payloads(g)) for g in result.reissue] == [("c", [b"partial"])]
        assert [tuple(v) for v in result.reissue[0].trajectories[0].versions] == [(0, 2)]
        batch, _ = await buffer.sample(1, 1)  # the resumed trainer trains b again, as it was
        assert [payloads(group) for group in batch] == [[b"\x00b", bytes(range(256))]]
        await buffer.aclose()


async def test_a_pickle_journal_is_refused_with_a_codec(tmp_path: Path) -> None:
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        await make_journal(path)
        before = digest(path)
        with pytest.raises(CheckpointError, match="refusing to unpickle"):
            recover(path, payload_codec=CODEC)
        assert digest(path) == before


async def test_a_payload_the_codec_cannot_encode_stops_the_journal_at_its_last_commit(
    tmp_path: Path,
) -> None:
    """``bytes("text")`` raises in the writer thread: the flush raises CheckpointError, the
    journal keeps its last commit, and a recovery gives the buffer as it was then."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=4),
            journal=path,
            payload_codec=CODEC,
            status_log_interval=None,
        )
        buffer.put_group_nowait("good", [b"g"])
        await buffer.flush()
        buffer.put_group_nowait("bad", ["text"])
        with pytest.raises(CheckpointError):
            await buffer.flush()
        await buffer.aclose()
        result = recover(path, payload_codec=CODEC)
        assert group_contents(result.buffer) == {"good": (Status.FINISHED, 0, [b"g"])}
        await result.buffer.aclose()


async def test_the_mark_before_the_newest_keeps_its_history_for_a_trainer_that_marks_first(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Review: retention kept only the history since the newest mark, so a trainer that marks
    step 6 and is killed before writing its own checkpoint of step 6 (it resumes from 3) found
    sample(3) deleted. The history back to the mark before the newest is kept."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(SamplerConfig(max_off_policy_threshold=2), journal=path, journal_retention_steps=1)
    for step in range(9):
        buffer.put_group_nowait(f"p{step}", ["x"])
        await buffer.sample(step, 1)
        if step in (3, 6):
            await buffer.flush(checkpoint_step=step)
    await buffer.aclose()
    recovered = ReplayBuffer.recover(path, global_steps=3)
    assert {group.uid for group in recovered.kept} == {f"p{step}" for step in range(4, 9)}
    await recovered.buffer.aclose()


async def test_kept_lists_the_groups_filtered_after_the_point_too(tmp_path: Path, anyio_backend: str) -> None:
    """Review: ``kept`` listed only the groups the recovered buffer holds, so a prompt whose group
    a filter evicted after the point was dispatched again by a resumed dataloader."""
    path = tmp_path / "journal.db"

    def keep(group: Group) -> bool:
        return not group.uid.startswith("f")

    buffer = ReplayBuffer(SamplerConfig(max_off_policy_threshold=4), journal=path, filters=[keep])
    buffer.put_group_nowait("a", ["x"])
    await buffer.sample(0, 1)
    await buffer.flush(checkpoint_step=0)
    buffer.put_group_nowait("b", ["x"])
    buffer.add_prompt_nowait("f1")
    buffer.put_nowait("f1", "y")
    await buffer.flush()  # f1 written in flight, then filtered: its committed record is kept
    buffer.mark_finished_nowait("f1")
    buffer.put_group_nowait("f2", ["x"])  # written whole and filtered: never resident, dispatched
    buffer.add_prompt_nowait("f3")
    buffer.mark_finished_nowait("f3")  # admitted and filtered within one commit
    buffer.put_group_nowait("c", ["x"])
    await buffer.aclose()
    result = ReplayBuffer.recover(path, global_steps=0, filters=[keep])
    assert [group.uid for group in result.kept] == ["b", "f1", "f2", "f3", "c"]
    assert "f1" not in result.buffer
    assert "f3" not in result.buffer
    await result.buffer.aclose()


# -- review: crashes during a recovery, odd arguments, torn and crafted files -----------------


@pytest.mark.parametrize("in_flight", ["reissue", "resume", "evict"])
async def test_a_crash_between_voiding_the_history_and_the_first_commit_leaves_the_journal_recoverable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_flight: str
) -> None:
    """Review: ``recover`` committed the voided history (undone groups resident, dropped ones
    removed) in one transaction and the recovered state in the next: killed in between, the file
    held the old state with the new rows, and every later recovery refused it ("counters do not
    conserve groups"). Now the voiding commits the state it implies with it: recovering again
    gives what the interrupted recovery would have given."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=8), journal=path, status_log_interval=None
        )
        for i in range(4):
            buffer.put_group_nowait(f"g{i}", [b"p", b"q"])
        buffer.add_prompt_nowait("half")
        buffer.mark_running_nowait("half")
        buffer.put_nowait("half", b"h")
        await buffer.sample(0, 1)
        await buffer.flush(checkpoint_step=0)
        await buffer.sample(1, 2)  # g1, g2: undone
        buffer.put_group_nowait("g1", [b"new"])  # the older g1 is dropped
        await buffer.aclose()
        reference = tmp_path / "reference.db"
        copy_journal(path, reference)
        expected = recover(reference, global_steps=0, in_flight=in_flight)
        want = (snapshot(expected.buffer)[1:], expected.buffer.stats().total)
        await expected.buffer.aclose()

        class Killed(Exception):
            pass

        def killed(*args: object, **kwargs: object) -> None:
            raise Killed  # the process dies after the voiding commits, before the journal starts

        monkeypatch.setattr("stalebuf._journal_setup.Journal", killed)
        with pytest.raises(Killed):
            recover(path, global_steps=0, in_flight=in_flight)
        monkeypatch.undo()
        for global_steps in (None, 0):
            copy = tmp_path / f"copy{global_steps}.db"
            copy_journal(path, copy)
            again = recover(copy, global_steps=global_steps, in_flight=in_flight)
            assert (snapshot(again.buffer)[1:], again.buffer.stats().total) == want
            assert_conserved(again.buffer)
            await again.buffer.aclose()


@pytest.mark.parametrize(
    ("global_steps", "partition"),
    [(2**63, "train"), (10**5000, "train"), (0, "\udcff"), (None, "\udcff")],
    ids=["2**63", "10**5000", "surrogate at 0", "surrogate at None"],
)
async def test_a_step_out_of_range_or_a_partition_no_file_can_hold_is_a_config_error(
    tmp_path: Path, global_steps: int | None, partition: str
) -> None:
    """Review: ``global_steps=10**5000`` raised ValueError (str() of the int, in the query) and a
    partition with a lone surrogate UnicodeEncodeError (SQLite); 2**63 was looked up as a step no
    sample can have. Each is a ConfigError, as ``flush(checkpoint_step=)`` bounds steps, and the
    journal stays as it was."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        await make_journal(path)
        before = digest(path)
        with pytest.raises(ConfigError):
            recover(path, global_steps=global_steps, partition=partition)
        assert digest(path) == before


@pytest.mark.parametrize("cut", [1, 100, 4095])
async def test_a_journal_cut_inside_a_page_is_refused_and_left_byte_for_byte(
    tmp_path: Path, cut: int
) -> None:
    """Review: a journal whose last page was cut short (no write-ahead log beside it) passed
    SQLite's check, which reads the missing bytes as zeros: ``recover`` at the last commit took
    it and wrote into it, ``restore`` read it. SQLite writes whole pages: such a file is torn."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        await make_journal(path)
        data = path.read_bytes()
        path.write_bytes(data[:-cut])
        before = digest(path)
        for global_steps in (None, 0):
            with pytest.raises(CheckpointError, match="torn"):
                recover(path, global_steps=global_steps)
            assert digest(path) == before
        with pytest.raises(CheckpointError, match="torn"):
            ReplayBuffer.restore(path, status_log_interval=None)
        with pytest.raises(CheckpointError, match="torn"):
            ReplayBuffer(SamplerConfig(), journal=path)
        assert digest(path) == before


@pytest.mark.parametrize(
    ("sql", "global_steps"),
    [
        ("UPDATE samples SET step = 'abc'", None),
        ("UPDATE marks SET step = 'abc'", 0),
        ("UPDATE groups SET admitted = 'q'", 0),
    ],
)
async def test_a_journal_with_values_of_the_wrong_type_is_a_checkpoint_error(
    tmp_path: Path, sql: str, global_steps: int | None
) -> None:
    """Review: a crafted journal (a text step, a text event number) raised ValueError or
    TypeError from ``recover``, where ``restore`` of the same file raised CheckpointError."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        await make_journal(path)
        connection = sqlite3.connect(path)
        connection.execute(sql)
        connection.commit()
        connection.close()
        with pytest.raises(CheckpointError):
            recover(path, global_steps=global_steps)


@pytest.mark.parametrize("whose", ["its own", "a closed one", "a killed one"])
async def test_save_never_overwrites_a_journal(tmp_path: Path, whose: str) -> None:
    """Review: ``save(path)`` at a journal's path renamed a checkpoint over it (the journal's own
    file, while it journaled on into the unlinked one, or another buffer's): the journal was gone,
    and the checkpoint unreadable too, its name now beside the journal's write-ahead log
    ("database disk image is malformed"). ``save`` refuses such a file, as a new journal does,
    and leaves it as it was."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        await make_journal(path)
        if whose == "a killed one":  # the last commits only in its write-ahead log
            copy = tmp_path / "killed.db"
            buffer = ReplayBuffer(
                SamplerConfig(max_off_policy_threshold=8), journal=copy, status_log_interval=None
            )
            buffer.put_group_nowait("g0", [b"p"])
            await buffer.flush(checkpoint_step=0)
            path = tmp_path / "journal-killed.db"
            copy_journal(copy, path)
            await buffer.aclose()
        dump = logical(path, tmp_path / "scratch")
        saver = ReplayBuffer(SamplerConfig(), status_log_interval=None)
        if whose == "its own":
            await saver.aclose()
            result = recover(path)
            saver = result.buffer
            dump = logical(path, tmp_path / "scratch")
        saver.put_group_nowait("new", [b"n"])
        with pytest.raises(CheckpointError, match="journal"):
            await saver.save(path)
        await saver.aclose()
        if whose != "its own":
            assert logical(path, tmp_path / "scratch") == dump
        again = recover(path)
        assert ("new" in again.buffer) is (whose == "its own")
        assert_conserved(again.buffer)
        await again.buffer.aclose()


_HOLDER = """
import sys, anyio
from stalebuf import ReplayBuffer, SamplerConfig

async def main() -> None:
    buffer = ReplayBuffer(SamplerConfig(max_off_policy_threshold=8), journal=sys.argv[1])
    buffer.put_group_nowait("a", [b"a"])
    await buffer.sample(0, 1)
    await buffer.flush(checkpoint_step=0)
    print("ready", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)
    buffer.put_group_nowait("b", [b"b"])
    await buffer.aclose()

anyio.run(main)
"""


def refuse_while_another_process_journals(path: Path) -> None:
    """Run :data:`_HOLDER` on ``path``; while it journals, ``recover`` must be refused."""
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdin is not None
            assert holder.stdout.readline() == "ready\n"
            for global_steps in (None, 0):
                with pytest.raises(CheckpointError, match="in use"):
                    recover(path, global_steps=global_steps)
            holder.stdin.write("go\n")
            holder.stdin.close()
            assert holder.wait(timeout=LIMIT) == 0
        finally:
            holder.kill()


async def test_a_journal_another_process_journals_into_is_refused_and_its_writer_goes_on(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Review: ``recover`` of a journal that another process's buffer still journaled into (a
    trainer restarted while the old process still ran, an actor not yet dead) was accepted: two
    writers voided and wrote one file, and one of them stopped ("UNIQUE constraint failed:
    groups.gid"), its groups lost. A process's journal writers now hold the file's advisory lock
    until the last is closed: ``recover`` in another process is refused, the live buffer journals
    on, and once it is closed the file recovers. (Within one process a recovery of a journal an
    unclosed buffer holds stays possible: that is how tests simulate a crash.)"""
    path = tmp_path / "journal.db"
    refuse_while_another_process_journals(path)
    with anyio.fail_after(LIMIT):
        result = recover(path, global_steps=0)
        assert sorted(group_contents(result.buffer)) == ["b"]
        await result.buffer.aclose()


async def test_a_group_on_evict_adds_while_recover_evicts_in_flight_groups_is_journaled(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Review: under ``in_flight="evict"`` ``on_evict`` runs during ``recover``, before the journal
    starts; a prompt it added was never journaled (only the recovered groups were), so after the
    first commit the journal counted an admission it held no row for and no recovery could read
    it ("counters do not conserve groups"). Groups the restore added are journaled as admitted."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=8), journal=path, status_log_interval=None
        )
        buffer.put_group_nowait("done", [b"d"])
        buffer.add_prompt_nowait("half")
        buffer.put_nowait("half", b"h")
        await buffer.sample(0, 1)
        await buffer.flush(checkpoint_step=0)
        await buffer.aclose()
        built: list[ReplayBuffer] = []

        class Refilling(ReplayBuffer):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                built.append(self)

        def refill(event: EvictionEvent) -> None:
            for group in event.groups:
                built[0].add_prompt_nowait(f"{group.uid}-refill")

        result = Refilling.recover(
            path, global_steps=0, in_flight="evict", on_evict=refill, status_log_interval=None
        )
        expected = group_contents(result.buffer)
        assert sorted(expected) == ["half-refill"]
        await result.buffer.flush()
        copy = tmp_path / "copy.db"
        copy_journal(path, copy)
        again = recover(copy)
        assert group_contents(again.buffer) == expected
        assert_conserved(again.buffer)
        await again.buffer.aclose()
        await result.buffer.aclose()


_FORKING = """
import os, sys, time, anyio
from stalebuf import ReplayBuffer, SamplerConfig

async def main() -> None:
    buffer = ReplayBuffer(SamplerConfig(), journal=sys.argv[1], status_log_interval=None)
    buffer.put_group_nowait("a", [b"a"])
    await buffer.flush()
    child = os.fork()  # a data loader's worker, say: it inherits the lock's file
    if child == 0:
        time.sleep(30)
        os._exit(0)
    try:
        await buffer.aclose()
        recovered = ReplayBuffer.recover(sys.argv[1], status_log_interval=None)
        print(sorted(group.uid for group in recovered.buffer.checkpoint().groups), flush=True)
        await recovered.buffer.aclose()
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)

anyio.run(main)
"""


def test_a_forked_child_does_not_hold_the_journal_lock(tmp_path: Path) -> None:
    """Review (of the lock above): a child forked while a buffer journals inherits the lock's
    open file, and with it the lock: once the parent closed its buffer, its own ``recover`` was
    refused ("in use") for as long as the child lived. A forked child drops the lock."""
    done = subprocess.run(
        [sys.executable, "-c", _FORKING, str(tmp_path / "journal.db")],
        capture_output=True,
        text=True,
        timeout=LIMIT * 3,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, "['a']\n"), done.stderr


async def test_a_buffer_whose_journal_stopped_can_still_be_saved(tmp_path: Path) -> None:
    """Review: ``save`` compacts the journal first, and raised the journal's error when its writer
    had stopped (a payload the journal's codec cannot encode, a full disk): the one durable copy
    left, a checkpoint pickle could hold, was refused too. The save goes on without compacting."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(SamplerConfig(), journal=path, payload_codec=CODEC, status_log_interval=None)
        buffer.put_group_nowait("good", [b"g"])
        await buffer.flush()
        buffer.put_group_nowait("bad", ["text"])  # bytes("text") raises in the writer
        with pytest.raises(CheckpointError):
            await buffer.flush()
        await buffer.save(tmp_path / "saved.ckpt")  # pickled: it holds "text"
        await buffer.aclose()
        restored = ReplayBuffer.restore(tmp_path / "saved.ckpt", status_log_interval=None).buffer
        assert group_contents(restored) == {
            "good": (Status.FINISHED, 0, [b"g"]),
            "bad": (Status.FINISHED, 0, ["text"]),
        }
        await restored.aclose()


def test_a_journal_path_with_a_nul_is_a_config_error(tmp_path: Path) -> None:
    """Review: a path holding "\\x00" raised ValueError ("embedded null byte") from ``recover``
    and from a new buffer's journal, where every other bad path is a typed error."""
    path = f"{tmp_path}/journal\x00.db"
    with pytest.raises(ConfigError, match="journal"):
        recover(path)
    with pytest.raises(ConfigError, match="journal"):
        ReplayBuffer(SamplerConfig(), journal=path)
    assert list(tmp_path.iterdir()) == []


async def test_a_disk_error_while_voiding_the_history_is_a_checkpoint_error_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: an SQLite error in the transaction that voids the history after the point (a full
    disk, an I/O error) came out of ``recover`` as ``sqlite3.OperationalError``, not the
    documented CheckpointError. The transaction is rolled back: the journal is as it was."""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        await make_journal(path)
        dump = logical(path, tmp_path / "scratch")

        def full(*args: object) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr("stalebuf._journal_recovery.write_key", full)
        with pytest.raises(CheckpointError, match="disk is full"):
            recover(path, global_steps=0)
        monkeypatch.undo()
        assert logical(path, tmp_path / "scratch") == dump
        result = recover(path, global_steps=0)
        assert_conserved(result.buffer)
        await result.buffer.aclose()


async def test_recovering_a_journal_with_more_marks_than_sqlite_takes_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: ``recover`` deleted the marks after the point with one ``NOT IN (?, ?, ...)`` of
    every mark it keeps: past SQLite's variable limit (999 before SQLite 3.32, which some
    systems still ship; emulated here, lower) it failed with "too many SQL variables" and the journal
    could not be recovered at that step at all. (A trainer that marks the same step on every
    flush keeps all those marks: retention deletes only marks older than its cutoff.)"""
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=8), journal=path, status_log_interval=None
        )
        for i in range(4):
            buffer.put_group_nowait(f"g{i}", [b"p"])
        await buffer.sample(0, 1)
        for _ in range(120):
            await buffer.flush(checkpoint_step=0)
        await buffer.sample(1, 1)
        await buffer.flush(checkpoint_step=1)
        await buffer.aclose()
        import stalebuf._journal_setup as setup

        connect = setup.connect

        def old_sqlite(path: str, **options: Any) -> sqlite3.Connection:
            connection = connect(path, **options)
            if sys.version_info >= (3, 11):
                connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 99)
                return connection
            execute = connection.execute  # Python 3.10 cannot set the limit: refuse as SQLite would

            def limited(sql: str, parameters: Any = ()) -> sqlite3.Cursor:
                if len(parameters) > 99:
                    raise sqlite3.OperationalError("too many SQL variables")
                return execute(sql, parameters)

            connection.execute = limited  # type: ignore[method-assign]
            return connection

        monkeypatch.setattr(setup, "connect", old_sqlite)
        result = recover(path, global_steps=0)
        assert sorted(group_contents(result.buffer)) == ["g1", "g2", "g3"]
        await result.buffer.aclose()
