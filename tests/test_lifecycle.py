"""Producer calls: transitions, keys, and every error leaving the buffer unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from _helpers import add_group, snapshot
from stalebuf import ReplayBuffer, Status
from stalebuf.errors import (
    BufferClosedError,
    DuplicateGroupError,
    DuplicateTrajectoryError,
    InvalidTransitionError,
    StalebufError,
    UnknownGroupError,
)


def test_error_hierarchy() -> None:
    assert issubclass(UnknownGroupError, KeyError)
    for cls in (InvalidTransitionError, DuplicateGroupError, DuplicateTrajectoryError):
        assert issubclass(cls, ValueError)
    for cls in (UnknownGroupError, InvalidTransitionError, DuplicateGroupError, BufferClosedError):
        assert issubclass(cls, StalebufError)


def test_unknown_group_error_message_is_not_quoted() -> None:
    buf = ReplayBuffer()
    with pytest.raises(UnknownGroupError) as info:
        buf.mark_running_nowait("ghost")
    assert str(info.value).startswith("no group 'ghost'")


def test_lifecycle_and_counts() -> None:
    buf = ReplayBuffer()
    buf.add_prompt_nowait("a", global_steps=3, tags={"prompt": "2+2"})
    assert buf.stats().partitions["train"].pending == 1
    buf.mark_running_nowait("a")
    stats = buf.stats().partitions["train"]
    assert (stats.pending, stats.running) == (0, 1)
    assert buf.put_nowait("a", "x", session_id=1, index=2, tags={"r": 1.0}) == "a_1_2"
    assert buf.put_nowait("a", "y") == "a_0_0"
    buf.mark_finished_nowait("a")
    stats = buf.stats().partitions["train"]
    assert (stats.running, stats.finished, stats.trajectories) == (0, 1, 2)
    group = buf._groups["a"]
    assert group.status is Status.FINISHED
    assert [t.key for t in group.trajectories] == ["a_1_2", "a_0_0"]  # put order
    assert group.trajectories[0].tags == {"r": 1.0}
    assert group.tags == {"prompt": "2+2"}


def test_finish_and_fail_directly_from_pending() -> None:
    buf = ReplayBuffer()
    buf.add_prompt_nowait("a", global_steps=0)
    buf.add_prompt_nowait("b", global_steps=0)
    buf.put_nowait("a", 1)
    buf.mark_finished_nowait("a")
    buf.mark_failed_nowait("b")
    stats = buf.stats().partitions["train"]
    assert (stats.pending, stats.finished, stats.failure) == (0, 1, 1)


def test_tags_are_copied() -> None:
    buf = ReplayBuffer()
    tags = {"k": 1}
    buf.add_prompt_nowait("a", global_steps=0, tags=tags)
    buf.put_nowait("a", tags=tags)
    tags["k"] = 2
    buf.mark_finished_nowait("a")
    group = buf._groups["a"]
    assert group.tags["k"] == 1
    assert group.trajectories[0].tags["k"] == 1


def test_uid_reusable_after_it_left() -> None:
    buf = ReplayBuffer(status_log_interval=None)
    add_group(buf, "a", 0)
    buf.sampleable_count(0)
    import anyio

    anyio.run(buf.sample, 0, 1)
    add_group(buf, "a", 1)
    assert buf.stats().partitions["train"].finished == 1


@pytest.mark.anyio
async def test_async_twins_do_the_same() -> None:
    buf = ReplayBuffer()
    await buf.add_prompt("a", global_steps=0, partition="p")
    await buf.mark_running("a")
    assert await buf.put("a", 1, session_id=2, index=3) == "a_2_3"
    await buf.mark_finished("a")
    await buf.add_prompt("b", global_steps=0, partition="p")
    await buf.mark_failed("b")
    stats = buf.stats().partitions["p"]
    assert (stats.finished, stats.failure, stats.trajectories) == (1, 1, 1)
    with pytest.raises(InvalidTransitionError):
        await buf.put("a", 2)


def _buffer_with_states() -> ReplayBuffer:
    buf = ReplayBuffer(status_log_interval=None)
    add_group(buf, "pend", 0, status=Status.PENDING)
    add_group(buf, "run", 0, status=Status.RUNNING)
    add_group(buf, "fin", 0, status=Status.FINISHED)
    add_group(buf, "fail", 0, status=Status.FAILURE)
    return buf


Call = Callable[[ReplayBuffer], Any]

ERRORS: list[tuple[str, Call, type[Exception], str]] = [
    ("duplicate uid", lambda b: b.add_prompt_nowait("run", global_steps=0), DuplicateGroupError, "already"),
    (
        "duplicate terminal uid",
        lambda b: b.add_prompt_nowait("fin", global_steps=1),
        DuplicateGroupError,
        "fin",
    ),
    ("uid with _", lambda b: b.add_prompt_nowait("a_b", global_steps=0), ValueError, "'_'"),
    ("empty uid", lambda b: b.add_prompt_nowait("", global_steps=0), ValueError, "non-empty"),
    ("int uid", lambda b: b.add_prompt_nowait(5, global_steps=0), TypeError, "uid must be a str"),
    ("negative step", lambda b: b.add_prompt_nowait("x", global_steps=-1), ValueError, "global_steps"),
    ("bool step", lambda b: b.add_prompt_nowait("x", global_steps=True), TypeError, "global_steps"),
    ("None step", lambda b: b.add_prompt_nowait("x", global_steps=None), TypeError, "global_steps"),
    ("float step", lambda b: b.add_prompt_nowait("x", global_steps=1.0), TypeError, "global_steps"),
    (
        "empty partition",
        lambda b: b.add_prompt_nowait("x", global_steps=0, partition=""),
        ValueError,
        "partition",
    ),
    ("bad tags", lambda b: b.add_prompt_nowait("x", global_steps=0, tags=[1]), TypeError, "tags"),
    ("running twice", lambda b: b.mark_running_nowait("run"), InvalidTransitionError, "already running"),
    ("running after finish", lambda b: b.mark_running_nowait("fin"), InvalidTransitionError, "late write"),
    ("running after fail", lambda b: b.mark_running_nowait("fail"), InvalidTransitionError, "failure"),
    ("running unknown", lambda b: b.mark_running_nowait("ghost"), UnknownGroupError, "ghost"),
    ("put unknown", lambda b: b.put_nowait("ghost", 1), UnknownGroupError, "ghost"),
    (
        "put after finish",
        lambda b: b.put_nowait("fin", 1, session_id=9),
        InvalidTransitionError,
        "late write",
    ),
    ("put after fail", lambda b: b.put_nowait("fail", 1, session_id=9), InvalidTransitionError, "late write"),
    (
        "duplicate trajectory",
        lambda b: b.put_nowait("run", 1, session_id=0),
        DuplicateTrajectoryError,
        "run_0_0",
    ),
    ("negative session", lambda b: b.put_nowait("run", 1, session_id=-1), ValueError, "session_id"),
    ("bool index", lambda b: b.put_nowait("run", 1, index=False), TypeError, "index"),
    ("put bad tags", lambda b: b.put_nowait("run", 1, session_id=5, tags="x"), TypeError, "tags"),
    ("finish twice", lambda b: b.mark_finished_nowait("fin"), InvalidTransitionError, "finished"),
    ("finish failed", lambda b: b.mark_finished_nowait("fail"), InvalidTransitionError, "failure"),
    ("fail finished", lambda b: b.mark_failed_nowait("fin"), InvalidTransitionError, "finished"),
    ("fail unknown", lambda b: b.mark_failed_nowait("ghost"), UnknownGroupError, "ghost"),
    ("finish unknown", lambda b: b.mark_finished_nowait("ghost"), UnknownGroupError, "ghost"),
    ("finish non-str", lambda b: b.mark_finished_nowait(3), TypeError, "uid"),
    ("count bad step", lambda b: b.sampleable_count(-1), ValueError, "global_steps"),
    ("count bad partition", lambda b: b.sampleable_count(0, partition=None), TypeError, "partition"),
]


@pytest.mark.parametrize(("call", "error", "message"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_leave_state_unchanged(call: Call, error: type[Exception], message: str) -> None:
    buf = _buffer_with_states()
    before = snapshot(buf)
    with pytest.raises(error, match=message):
        call(buf)
    assert snapshot(buf) == before


def test_late_write_after_sampled_or_evicted_is_unknown() -> None:
    import anyio

    buf = ReplayBuffer(status_log_interval=None)
    add_group(buf, "old", 0)
    add_group(buf, "new", 20)
    batch, _ = anyio.run(buf.sample, 20, 1)  # evicts "old" as stale (default T=8), samples "new"
    assert batch.uids == ["new"]
    for uid in ("old", "new"):
        before = snapshot(buf)
        with pytest.raises(UnknownGroupError, match="already sampled or evicted"):
            buf.put_nowait(uid, 1, session_id=7)
        with pytest.raises(UnknownGroupError):
            buf.mark_finished_nowait(uid)
        assert snapshot(buf) == before


def test_closed_buffer_rejects_producers_but_keeps_stats() -> None:
    buf = _buffer_with_states()
    before = buf.stats()
    buf.close()
    buf.close()  # idempotent
    assert buf.closed
    for call in (
        lambda: buf.add_prompt_nowait("new", global_steps=0),
        lambda: buf.mark_running_nowait("pend"),
        lambda: buf.put_nowait("run", 1, session_id=3),
        lambda: buf.mark_finished_nowait("run"),
        lambda: buf.mark_failed_nowait("run"),
    ):
        with pytest.raises(BufferClosedError):
            call()
    after = buf.stats()
    assert after.closed
    assert after.partitions == before.partitions


def test_stats_is_an_immutable_value() -> None:
    buf = _buffer_with_states()
    first, second = buf.stats(), buf.stats()
    assert first == second
    assert first is not second
    with pytest.raises(AttributeError):
        first.closed = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        first.partitions["x"] = first.total  # type: ignore[index]
    total = first.total
    assert (total.pending, total.running, total.finished, total.failure) == (1, 1, 1, 1)
    assert total.groups == 4
    assert total.in_flight == 2
    assert total.admitted_groups == 4
    assert total.admitted_trajectories == total.trajectories == 8
    buf.add_prompt_nowait("more", global_steps=0)
    assert buf.stats() != first


def test_construction_needs_no_event_loop() -> None:
    buf = ReplayBuffer()  # plain sync code, no loop running
    buf.add_prompt_nowait("a", global_steps=0)
    assert buf.stats().total.pending == 1
