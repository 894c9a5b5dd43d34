"""Producer calls: transitions, keys, and every error leaving the buffer unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from _helpers import add_group, resident_groups, snapshot
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
    group = resident_groups(buf)["a"]
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


_LAST = 2**63 - 1


@pytest.mark.parametrize(
    ("session_id", "index"), [(0, 0), (7, 0), (63, 0), (64, 0), (65, 0), (0, 1), (63, 1), (_LAST, _LAST)]
)
def test_put_returns_and_stores_the_documented_key(session_id: int, index: int) -> None:
    # The common keys (index 0, the first 64 sessions) are built from a table, the rest formatted.
    buf = ReplayBuffer()
    buf.add_prompt_nowait("u1", global_steps=0)
    key = buf.put_nowait("u1", "x", session_id=session_id, index=index)
    assert key == f"u1_{session_id}_{index}"
    buf.mark_finished_nowait("u1")
    (trajectory,) = resident_groups(buf)["u1"].trajectories
    assert (trajectory.key, trajectory.session_id, trajectory.index) == (key, session_id, index)
    buf.add_prompt_nowait("u2", global_steps=0)
    buf.put_nowait("u2", session_id=session_id, index=index)
    with pytest.raises(DuplicateTrajectoryError):
        buf.put_nowait("u2", session_id=session_id, index=index)


def test_tags_are_copied() -> None:
    buf = ReplayBuffer()
    tags = {"k": 1}
    buf.add_prompt_nowait("a", global_steps=0, tags=tags)
    buf.put_nowait("a", tags=tags)
    tags["k"] = 2
    buf.mark_finished_nowait("a")
    group = resident_groups(buf)["a"]
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
    ("str step", lambda b: b.add_prompt_nowait("x", global_steps="1"), TypeError, "global_steps"),
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


def test_put_group_adds_fills_and_finishes_in_one_call() -> None:
    import numpy as np

    buf = ReplayBuffer()
    tokens = np.arange(12).reshape(3, 4)  # one row per trajectory
    keys = buf.put_group_nowait("g", tokens, global_steps=2, tags={"prompt": "p"})
    assert keys == ["g_0_0", "g_1_0", "g_2_0"]
    group = resident_groups(buf)["g"]
    assert group.status is Status.FINISHED
    assert group.dispatch_step == 2
    assert dict(group.tags) == {"prompt": "p"}
    assert [t.payload.tolist() for t in group.trajectories] == tokens.tolist()
    stats = buf.stats().total
    assert (stats.finished, stats.trajectories, stats.admitted_trajectories) == (1, 3, 3)
    assert "g" in buf
    assert "h" not in buf


def test_put_group_into_an_in_flight_group_with_custom_keys_and_failure() -> None:
    buf = ReplayBuffer()
    buf.add_prompt_nowait("g", global_steps=1, partition="p")
    buf.put_nowait("g", "first")
    keys = buf.put_group_nowait(
        "g",
        ["a", "b"],
        global_steps=1,
        partition="p",
        session_ids=[3, 3],
        indices=[0, 1],
        trajectory_tags=[{"r": 1}, None],
        status="failed",
    )
    assert keys == ["g_3_0", "g_3_1"]
    group = resident_groups(buf)["g"]
    assert group.status is Status.FAILURE
    assert [t.key for t in group.trajectories] == ["g_0_0", "g_3_0", "g_3_1"]
    assert dict(group.trajectories[1].tags) == {"r": 1}


@pytest.mark.anyio
async def test_put_group_async_twin() -> None:
    buf = ReplayBuffer()
    assert await buf.put_group("g", [1, 2], global_steps=0) == ["g_0_0", "g_1_0"]
    batch, _ = await buf.sample(0, 1, timeout=0)
    assert batch.payloads == [1, 2]


PUT_GROUP_ERRORS: list[tuple[str, Call, type[Exception], str]] = [
    ("late write", lambda b: b.put_group_nowait("fin", [1], global_steps=0), InvalidTransitionError, "late"),
    (
        "other step",
        lambda b: b.put_group_nowait("run", [1], global_steps=5, session_ids=[7]),
        DuplicateGroupError,
        "global_steps=0",
    ),
    (
        "other partition",
        lambda b: b.put_group_nowait("run", [1], global_steps=0, partition="val", session_ids=[7]),
        DuplicateGroupError,
        "partition",
    ),
    (
        "key held",
        lambda b: b.put_group_nowait("run", [1], global_steps=0),
        DuplicateTrajectoryError,
        "run_0_0",
    ),
    (
        "key twice",
        lambda b: b.put_group_nowait("new", [1, 2], global_steps=0, session_ids=[4, 4]),
        DuplicateTrajectoryError,
        "twice",
    ),
    (
        "short ids",
        lambda b: b.put_group_nowait("new", [1, 2], global_steps=0, session_ids=[1]),
        ValueError,
        "session_ids has 1",
    ),
    (
        "bad tag",
        lambda b: b.put_group_nowait("new", [1], global_steps=0, trajectory_tags=[[1]]),
        TypeError,
        "tags",
    ),
    (
        "bad index",
        lambda b: b.put_group_nowait("new", [1], global_steps=0, indices=[-1]),
        ValueError,
        "index",
    ),
    (
        "bad status",
        lambda b: b.put_group_nowait("new", [1], global_steps=0, status="done"),
        ValueError,
        "status",
    ),
    ("str payloads", lambda b: b.put_group_nowait("new", "ab", global_steps=0), TypeError, "payloads"),
    ("bad uid", lambda b: b.put_group_nowait("a_b", [1], global_steps=0), ValueError, "uid"),
    ("bad step", lambda b: b.put_group_nowait("new", [1], global_steps=True), TypeError, "global_steps"),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [e[1:] for e in PUT_GROUP_ERRORS], ids=[e[0] for e in PUT_GROUP_ERRORS]
)
def test_put_group_errors_change_nothing(call: Call, error: type[Exception], message: str) -> None:
    buf = _buffer_with_states()
    before = snapshot(buf)
    with pytest.raises(error, match=message):
        call(buf)
    assert snapshot(buf) == before


# Calls that are partly valid (some trajectories would fit): none of it may land.
PUT_GROUP_ALL_OR_NOTHING: list[tuple[str, type[Exception], dict[str, Any]]] = [
    # "open" holds "open_0_0", so session_ids=[0, 9] repeats a key it already has
    ("dup", DuplicateTrajectoryError, {"uid": "open", "global_steps": 0, "session_ids": [0, 9]}),
    ("step", DuplicateGroupError, {"uid": "open", "global_steps": 1}),
    ("partition", DuplicateGroupError, {"uid": "open", "global_steps": 0, "partition": "val"}),
    ("late", InvalidTransitionError, {"uid": "done", "global_steps": 0}),
    ("tags", TypeError, {"uid": "new", "global_steps": 0, "trajectory_tags": [None, 3]}),
    ("index", TypeError, {"uid": "new", "global_steps": 0, "indices": [0, True]}),
    ("length", ValueError, {"uid": "new", "global_steps": 0, "indices": [0]}),
    ("status", ValueError, {"uid": "new", "global_steps": 0, "status": "FINISHED"}),
    ("group tags", TypeError, {"uid": "new", "global_steps": 0, "tags": [("a", 1)]}),
]


@pytest.mark.parametrize(
    ("case", "error", "kwargs"), PUT_GROUP_ALL_OR_NOTHING, ids=[c[0] for c in PUT_GROUP_ALL_OR_NOTHING]
)
def test_put_group_nowait_error_changes_nothing(
    case: str, error: type[Exception], kwargs: dict[str, Any]
) -> None:
    """put_group_nowait is all or nothing: each invalid call raises before any change."""
    buf = ReplayBuffer(status_log_interval=None)
    add_group(buf, "open", 0, n=1, status=Status.RUNNING)
    add_group(buf, "done", 0, n=1)
    before = snapshot(buf)
    with pytest.raises(error):
        buf.put_group_nowait(payloads=["x", "y"], **kwargs)
    assert snapshot(buf) == before, case
    assert "new" not in buf


def test_put_group_on_closed_buffer() -> None:
    buf = ReplayBuffer()
    buf.close()
    with pytest.raises(BufferClosedError):
        buf.put_group_nowait("g", [1], global_steps=0)
