"""Checkpoint files written by earlier releases still load, into exactly the state they hold.

The files are in ``tests/fixtures/`` (``make_checkpoint_fixtures.py`` made them at commit f169765
and its docstring lists the state): one in pickle mode, whose lazily stored groups are pickled as
``records._group`` with a ``records.LazyTrajectories`` (one with its records built), and one with
the JSON payload codec. Each is restored under every ``in_flight`` mode of that release, and the
expected values below are written out by hand from that state, never read from the code under
test. The files of commit e8b5814, the release before versioned trajectories, are checked next,
under every mode of this one ("resume" too); then those of commit 053194f, the last release whose
``save`` wrote the hand-written container (later ones write SQLite).
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from _ckpt_helpers import assert_tokens_conserved
from _helpers import LIMIT, assert_conserved
from stalebuf import (
    BufferFullError,
    EvictionEvent,
    Group,
    GroupEvictedError,
    ReplayBuffer,
    RestoreResult,
    Status,
)
from stalebuf.checkpoint import TOKEN_COUNTERS
from stalebuf.filters import zero_variance

FIXTURES = Path(__file__).parent / "fixtures"
#: The codec the codec file was saved with.
CODEC = (lambda payload: json.dumps(payload).encode(), json.loads)
FILES: dict[str, tuple[Path, Any]] = {
    "pickle": (FIXTURES / "checkpoint_pickle.ckpt", None),
    "codec": (FIXTURES / "checkpoint_codec.ckpt", CODEC),
}
MODES = ("reissue", "keep", "evict")
FINISHED, FAILURE, PENDING, RUNNING = Status.FINISHED, Status.FAILURE, Status.PENDING, Status.RUNNING

#: uid -> (partition, dispatch step, status, tags, trajectories as (key, session id, index, tags,
#: payload), finish step, generation seconds), in admission order.
TERMINAL: dict[str, tuple[Any, ...]] = {
    "lazy": (
        "train",
        3,
        FINISHED,
        {},
        [("lazy_0_0", 0, 0, {}, {"a": 1}), ("lazy_1_0", 1, 0, {}, [2, 3]), ("lazy_2_0", 2, 0, {}, None)],
        3,
        0.0,
    ),
    "built": (
        "train",
        3,
        FINISHED,
        {"kind": "built", "n": [1, 2]},
        [("built_0_0", 0, 0, {}, "b0"), ("built_1_0", 1, 0, {}, "b1")],
        3,
        0.0,
    ),
    "custom": (
        "train",
        4,
        FINISHED,
        {"kind": "custom"},
        [("custom_3_0", 3, 0, {"reward": 0.5}, 1.5), ("custom_5_2", 5, 2, {}, "c1")],
        4,
        0.25,
    ),
    "failed": ("train", 4, FAILURE, {}, [("failed_0_0", 0, 0, {}, "x")], 4, 0.25),
    "v0": ("val", 0, FINISHED, {"split": "val"}, [("v0_0_0", 0, 0, {}, "v")], 0, 0.25),
    "v1": ("val", 0, FINISHED, {}, [("v1_0_0", 0, 0, {}, "w0"), ("v1_1_0", 1, 0, {}, "w1")], 0, 0.0),
}
#: The groups in flight at the save, without their generation seconds (see SAVED_SECONDS).
IN_FLIGHT: dict[str, tuple[Any, ...]] = {
    "pending": ("train", 4, PENDING, {"kind": "pending"}, [("pending_1_0", 1, 0, {"turn": 0}, "p0")], 4),
    "running": (
        "train",
        5,
        RUNNING,
        {},
        [("running_0_0", 0, 0, {}, "r0"), ("running_0_1", 0, 1, {}, "r1")],
        5,
    ),
    "v2": ("val", 0, RUNNING, {}, [("v2_0_0", 0, 0, {}, {"v2": True})], 0),
}
#: Each file took its own snapshot, so the in-flight groups' ages differ (a quarter-second clock).
SAVED_SECONDS = {
    "pickle": {"pending": 1.5, "running": 1.25, "v2": 0.5},
    "codec": {"pending": 1.75, "running": 1.5, "v2": 0.75},
}
ORDER = ["lazy", "built", "custom", "failed", "pending", "running", "v0", "v1", "v2"]

# The counters that are not zero (capacity: None for val, and zero counters left out).
_TRAIN = {"admitted_groups": 9, "admitted_trajectories": 16, "sampled_groups": 1, "sampled_trajectories": 2,
          "evicted_stale_groups": 2, "evicted_stale_trajectories": 3, "evicted_in_flight_groups": 1,
          "capacity": 6, "finished": 3, "failure": 1}  # fmt: skip
_VAL = {"admitted_groups": 3, "admitted_trajectories": 4, "finished": 2}
STATS: dict[str, dict[str, dict[str, int]]] = {
    "reissue": {
        "train": {
            **_TRAIN,
            "pending": 2,
            "trajectories": 8,
            "reissued_groups": 2,
            "reissued_trajectories": 3,
        },
        "val": {**_VAL, "pending": 1, "trajectories": 3, "reissued_groups": 1, "reissued_trajectories": 1},
    },
    "keep": {
        "train": {**_TRAIN, "pending": 1, "running": 1, "trajectories": 11},
        "val": {**_VAL, "running": 1, "trajectories": 4},
    },
    "evict": {
        "train": {
            **_TRAIN,
            "trajectories": 8,
            "evicted_restart_groups": 2,
            "evicted_restart_trajectories": 3,
        },
        "val": {**_VAL, "trajectories": 3, "evicted_restart_groups": 1, "evicted_restart_trajectories": 1},
    },
}


def restore(name: str, mode: str) -> tuple[RestoreResult, list[EvictionEvent]]:
    """Restore fixture ``name`` under ``mode``; also return the events ``on_evict`` received."""
    path, codec = FILES[name]
    events: list[EvictionEvent] = []
    result = ReplayBuffer.restore(
        path,
        in_flight=mode,  # type: ignore[arg-type]
        payload_codec=codec,
        on_evict=events.append,
        status_log_interval=None,
    )
    return result, events


def content(group: Group) -> tuple[Any, ...]:
    """A group as plain values, payloads with their types (``1 == True``, ``[1] != (1,)``)."""
    trajectories = [
        (t.key, t.session_id, t.index, dict(t.tags), json.dumps(t.payload)) for t in group.trajectories
    ]
    return (group.partition, group.dispatch_step, group.status, dict(group.tags), trajectories,
            group.finish_step)  # fmt: skip


def expected(table: dict[str, tuple[Any, ...]], uid: str) -> tuple[Any, ...]:
    """``table[uid]`` as :func:`content` shows it."""
    partition, step, status, tags, trajectories, finish_step, *_ = table[uid]
    rows = [
        (key, session, index, tags_, json.dumps(payload))
        for key, session, index, tags_, payload in trajectories
    ]
    return (partition, step, status, tags, rows, finish_step)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FILES)
def test_the_groups_come_back_in_order_with_their_trajectories(name: str, mode: str) -> None:
    result, events = restore(name, mode)
    groups = {group.uid: group for group in result.buffer.checkpoint().groups}
    kept = ORDER if mode != "evict" else [uid for uid in ORDER if uid not in IN_FLIGHT]
    assert list(groups) == kept
    for uid in TERMINAL:
        assert content(groups[uid]) == expected(TERMINAL, uid), uid
        assert groups[uid].generation_seconds == TERMINAL[uid][6], uid
    saved = SAVED_SECONDS[name]
    if mode == "keep":
        for uid in IN_FLIGHT:
            assert content(groups[uid]) == expected(IN_FLIGHT, uid), uid
            assert saved[uid] <= groups[uid].generation_seconds < saved[uid] + LIMIT  # still ageing
    elif mode == "reissue":  # PENDING again, their trajectories dropped
        for uid in IN_FLIGHT:
            partition, step, _, tags, _, finish_step = IN_FLIGHT[uid]
            assert content(groups[uid]) == (partition, step, PENDING, tags, [], finish_step), uid
        reissued = [(g.uid, g.partition, g.dispatch_step, g.status, dict(g.tags), g.trajectories,
                     g.finish_step, g.generation_seconds) for g in result.reissue]  # fmt: skip
        assert reissued == [
            ("pending", "train", 4, PENDING, {"kind": "pending"}, (), 4, saved["pending"]),
            ("running", "train", 5, PENDING, {}, (), 5, saved["running"]),
            ("v2", "val", 0, PENDING, {}, (), 0, saved["v2"]),
        ]
    else:
        by_event = [(e.partition, e.reason, e.global_steps, [content(g) for g in e.groups]) for e in events]
        assert by_event == [
            ("train", "restart", 3, [expected(IN_FLIGHT, "pending"), expected(IN_FLIGHT, "running")]),
            ("val", "restart", 0, [expected(IN_FLIGHT, "v2")]),
        ]
    assert (result.reissue == ()) is (mode != "reissue")
    assert (events == []) is (mode != "evict")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FILES)
def test_counters_clocks_and_admission_come_back_exactly(name: str, mode: str) -> None:
    buf = restore(name, mode)[0].buffer
    stats = buf.stats()
    for partition in ("train", "val"):
        counters = {k: v for k, v in attrs.asdict(stats.partitions[partition]).items() if v}
        assert counters == STATS[mode][partition], partition
    assert set(stats.partitions) == {"train", "val"}
    assert_conserved(buf)
    assert (buf.dispatch_step("train"), buf.dispatch_step("val")) == (3, 0)
    ckpt = buf.checkpoint()
    assert dict(ckpt.clocks) == {"train": 3}
    assert [(p.name, p.last_sampled) for p in ckpt.partitions] == [("train", 3), ("val", -1)]
    assert ckpt.config.admission_batch_size == 3
    assert ckpt.config.max_off_policy_threshold == 2
    assert ckpt.config.evict_stale_in_flight
    assert ckpt.policy is None
    # b=3 per step: "lazy" and "built" hold two slots of step 3; step 2 would be stale at the
    # next sample (4) given the last sampled step 3, so it is closed for good.
    assert (buf.capacity("train"), buf.free_slots("train"), buf.capacity("val")) == (6, 1, None)
    with pytest.raises(BufferFullError, match="closed for good"):
        buf.add_prompt_nowait("late", global_steps=2)
    restarted = ("pending", "running", "v2") if mode == "evict" else ()
    assert ckpt.evicted_in_flight == ("old", *restarted)
    for uid in ("old", *restarted):
        with pytest.raises(GroupEvictedError):
            buf.put_nowait(uid, "late")


def _finish_in_flight(buf: ReplayBuffer, mode: str) -> list[tuple[str, str, Any]]:
    """End the groups that were in flight as a producer would after the restart; return the
    trajectories of the batch at step 5 as ``(uid, key, payload)``."""
    if mode == "reissue":  # generated again from scratch
        buf.put_group_nowait("pending", ["p-again"])
        buf.put_group_nowait("running", ["r-again"], session_ids=[1])
        return [("pending", "pending_0_0", "p-again"), ("running", "running_1_0", "r-again")]
    buf.mark_finished_nowait("pending")
    buf.put_nowait("running", "r2", session_id=1)
    buf.mark_finished_nowait("running")
    return [("pending", "pending_1_0", "p0"), ("running", "running_0_0", "r0"),
            ("running", "running_0_1", "r1"), ("running", "running_1_0", "r2")]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FILES)
def test_sampling_returns_the_saved_groups_oldest_first(name: str, mode: str) -> None:
    buf = restore(name, mode)[0].buffer
    batch, _ = buf.sample_nowait(3, 4)
    assert batch.uids == ["lazy", "built", "custom", "failed"]
    rows = [(uid, *row) for uid in batch.uids for row in TERMINAL[uid][4]]
    assert batch.keys == [key for _, key, *_ in rows]
    assert [json.dumps(p) for p in batch.payloads] == [json.dumps(row[-1]) for row in rows]
    assert [dict(tags) for tags in batch.tags] == [row[4] for row in rows]
    assert batch.staleness.tolist() == [1.0, 1.0, 0.0, 0.0]
    val, _ = buf.sample_nowait(0, 2, partition="val")
    assert (val.uids, val.keys, val.payloads) == (
        ["v0", "v1"],
        ["v0_0_0", "v1_0_0", "v1_1_0"],
        ["v", "w0", "w1"],
    )
    if mode == "evict":
        assert buf.stats().total.groups == 0
        return
    trajectories = _finish_in_flight(buf, mode)
    late, _ = buf.sample_nowait(5, 2)
    assert late.uids == ["pending", "running"]
    assert [(g.uid, t.key, t.payload) for g in late.groups for t in g.trajectories] == trajectories
    assert buf.stats().partitions["train"].groups == 0


@pytest.mark.parametrize("name", FILES)
def test_a_restored_group_reads_compares_copies_and_pickles_as_a_group(name: str) -> None:
    ckpt = restore(name, "keep")[0].buffer.checkpoint()
    for group in ckpt.groups:
        assert isinstance(group, Group)
        assert group.trajectories is group.trajectories  # one tuple on every read
        assert group == group
        twin = copy.copy(group)
        assert twin != group  # records compare by identity
        assert twin.trajectories is group.trajectories
        assert repr(group).startswith(f"Group(uid={group.uid!r}, partition=")
        rebuilt = type(group)(*group)
        assert rebuilt.trajectories is group.trajectories
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            again = pickle.loads(pickle.dumps(group, protocol=protocol))
            assert content(again) == content(group)
            assert again.generation_seconds == group.generation_seconds
        for tags in (group.tags, *(t.tags for t in group.trajectories)):
            with pytest.raises(TypeError):
                tags["x"] = 1  # type: ignore[index]


@pytest.mark.parametrize("codec", [False, True])
@pytest.mark.parametrize("name", FILES)
def test_an_old_file_saved_again_by_this_release_holds_the_same_state(
    name: str, codec: bool, tmp_path: Path
) -> None:
    first = restore(name, "keep")[0].buffer
    pair = CODEC if codec else None

    async def save() -> None:
        with anyio.fail_after(LIMIT):
            await first.save(tmp_path / "again.ckpt", payload_codec=pair)

    anyio.run(save)
    second = ReplayBuffer.restore(tmp_path / "again.ckpt", in_flight="keep", payload_codec=pair).buffer
    old, new = first.checkpoint(), second.checkpoint()
    assert [(g.uid, content(g)) for g in new.groups] == [(g.uid, content(g)) for g in old.groups]
    assert [g.generation_seconds for g in new.groups[:4]] == [g.generation_seconds for g in old.groups[:4]]
    assert (new.partitions, dict(new.clocks), new.evicted_in_flight, new.config) == (
        old.partitions,
        dict(old.clocks),
        old.evicted_in_flight,
        old.config,
    )
    assert second.stats().partitions == first.stats().partitions


# -- files written by e8b5814, the release before versioned trajectories (issue 22) ---------------
#
# ``make_checkpoint_fixtures_e8b5814.py`` made them (its docstring lists the state). That release
# knew no versions, token counts or start versions: every trajectory comes back with no segments
# and 0 tokens, every group starting at its dispatch step, every token counter 0, under every
# ``in_flight`` mode; and the buffer then takes versions like any other.

E8_FILES: dict[str, tuple[Path, Any]] = {
    "pickle": (FIXTURES / "checkpoint_e8b5814_pickle.ckpt", None),
    "codec": (FIXTURES / "checkpoint_e8b5814_codec.ckpt", CODEC),
}
ALL_MODES = ("reissue", "keep", "evict", "resume")
#: uid -> (partition, dispatch step, status, tags, trajectories as (key, session id, index, tags,
#: payload), finish step), in admission order; generation seconds apart (E8_SECONDS).
E8_GROUPS: dict[str, tuple[Any, ...]] = {
    "custom": ("train", 2, FINISHED, {"kind": "custom"},
               [("custom_3_0", 3, 0, {"reward": 0.5}, 1.5), ("custom_5_2", 5, 2, {}, "c1")], 2),
    "failed": ("train", 2, FAILURE, {}, [("failed_0_0", 0, 0, {}, "x")], 2),
    "pending": ("train", 2, PENDING, {"kind": "pending"}, [("pending_1_0", 1, 0, {"turn": 0}, "p0")], 3),
    "lazy": ("train", 3, FINISHED, {}, [("lazy_0_0", 0, 0, {}, {"a": 1}), ("lazy_1_0", 1, 0, {}, [2, 3]),
                                        ("lazy_2_0", 2, 0, {}, None)], 3),
    "built": ("train", 3, FINISHED, {"kind": "built", "n": [1, 2]},
              [("built_0_0", 0, 0, {}, "b0"), ("built_1_0", 1, 0, {}, "b1")], 3),
    "running": ("train", 3, RUNNING, {},
                [("running_0_0", 0, 0, {}, "r0"), ("running_0_1", 0, 1, {}, "r1")], 3),
    "v0": ("val", 0, FINISHED, {"split": "val"}, [("v0_0_0", 0, 0, {}, "v")], 0),
    "v1": ("val", 0, FINISHED, {}, [("v1_0_0", 0, 0, {}, "w0"), ("v1_1_0", 1, 0, {}, "w1")], 0),
    "v2": ("val", 0, RUNNING, {}, [("v2_0_0", 0, 0, {}, {"v2": True})], 0),
}  # fmt: skip
E8_IN_FLIGHT = ("pending", "running", "v2")
#: Generation seconds: terminal groups', and the in-flight groups' at each file's snapshot.
E8_SECONDS = {
    "pickle": {"custom": 0.25, "failed": 0.25, "lazy": 0.0, "built": 0.0, "v0": 0.25, "v1": 0.0,
               "pending": 1.5, "running": 1.25, "v2": 0.5},
    "codec": {"custom": 0.25, "failed": 0.25, "lazy": 0.0, "built": 0.0, "v0": 0.25, "v1": 0.0,
              "pending": 1.75, "running": 1.5, "v2": 0.75},
}  # fmt: skip
_E8_TRAIN = {"admitted_groups": 9, "admitted_trajectories": 16, "sampled_groups": 1,
             "sampled_trajectories": 2, "evicted_stale_groups": 2, "evicted_stale_trajectories": 3,
             "evicted_in_flight_groups": 1, "capacity": 8, "finished": 3, "failure": 1}  # fmt: skip
#: The counters that are not 0, per mode: no token counter is ever one of them.
E8_STATS: dict[str, dict[str, dict[str, int]]] = {
    "reissue": {
        "train": {**_E8_TRAIN, "pending": 2, "trajectories": 8, "reissued_groups": 2,
                  "reissued_trajectories": 3},
        "val": {**_VAL, "pending": 1, "trajectories": 3, "reissued_groups": 1, "reissued_trajectories": 1},
    },
    "keep": {
        "train": {**_E8_TRAIN, "pending": 1, "running": 1, "trajectories": 11},
        "val": {**_VAL, "running": 1, "trajectories": 4},
    },
    "resume": {
        "train": {**_E8_TRAIN, "pending": 2, "trajectories": 11},
        "val": {**_VAL, "pending": 1, "trajectories": 4},
    },
    "evict": {
        "train": {**_E8_TRAIN, "trajectories": 8, "evicted_restart_groups": 2,
                  "evicted_restart_trajectories": 3},
        "val": {**_VAL, "trajectories": 3, "evicted_restart_groups": 1, "evicted_restart_trajectories": 1},
    },
}  # fmt: skip


def restore_e8(name: str, mode: str) -> tuple[RestoreResult, list[EvictionEvent]]:
    """Restore the e8b5814 file ``name`` under ``mode``; also return the events ``on_evict`` got."""
    path, codec = E8_FILES[name]
    events: list[EvictionEvent] = []
    result = ReplayBuffer.restore(path, in_flight=mode, payload_codec=codec, on_evict=events.append,  # type: ignore[arg-type]
                                  status_log_interval=None)  # fmt: skip
    return result, events


def versioned(group: Group) -> tuple[Any, ...]:
    """A group as :func:`content` shows it, with its start version and each trajectory's
    versions and tokens."""
    return (*content(group), group.start_version, [(t.versions, t.tokens) for t in group.trajectories])


def expected_e8(uid: str, status: Status | None = None, trajectories: bool = True) -> tuple[Any, ...]:
    """``E8_GROUPS[uid]`` as :func:`versioned` shows it (``status`` in place of the saved one, and
    without trajectories unless ``trajectories``): no segments, 0 tokens, starting at its step."""
    partition, step, saved, tags, rows, finish_step = E8_GROUPS[uid]
    rows = rows if trajectories else []
    plain = [
        (key, session, index, tags_, json.dumps(payload)) for key, session, index, tags_, payload in rows
    ]
    return (partition, step, saved if status is None else status, tags, plain, finish_step, step,
            [((), 0)] * len(rows))  # fmt: skip


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("name", E8_FILES)
def test_an_e8b5814_file_loads_without_versions_under_every_mode(name: str, mode: str) -> None:
    result, events = restore_e8(name, mode)
    groups = {group.uid: group for group in result.buffer.checkpoint().groups}
    assert list(groups) == [uid for uid in E8_GROUPS if mode != "evict" or uid not in E8_IN_FLIGHT]
    seconds = E8_SECONDS[name]
    for uid, group in groups.items():
        if uid not in E8_IN_FLIGHT:
            assert versioned(group) == expected_e8(uid), uid
            assert group.generation_seconds == seconds[uid], uid
        elif mode == "keep":
            assert versioned(group) == expected_e8(uid), uid
        else:  # PENDING, with their trajectories under "resume", without under "reissue"
            assert versioned(group) == expected_e8(uid, PENDING, mode == "resume"), uid
        assert seconds[uid] <= group.generation_seconds < seconds[uid] + LIMIT, uid  # still ageing
    reissue = [(g.uid, versioned(g), g.generation_seconds) for g in result.reissue]
    if mode in ("reissue", "resume"):
        assert reissue == [
            (uid, expected_e8(uid, PENDING, mode == "resume"), seconds[uid]) for uid in E8_IN_FLIGHT
        ]
    else:
        assert reissue == []
    by_event = [(e.partition, e.reason, e.global_steps, [versioned(g) for g in e.groups]) for e in events]
    assert by_event == (
        [
            ("train", "restart", 3, [expected_e8("pending"), expected_e8("running")]),
            ("val", "restart", 0, [expected_e8("v2")]),
        ]
        if mode == "evict"
        else []
    )


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("name", E8_FILES)
def test_an_e8b5814_file_restores_its_counters_with_every_token_counter_0(name: str, mode: str) -> None:
    buf = restore_e8(name, mode)[0].buffer
    stats = buf.stats()
    for partition in ("train", "val"):
        counters = {k: v for k, v in attrs.asdict(stats.partitions[partition]).items() if v}
        assert counters == E8_STATS[mode][partition], partition
    assert_conserved(buf)
    assert_tokens_conserved(buf)
    ckpt = buf.checkpoint()
    assert [(p.name, p.last_sampled) for p in ckpt.partitions] == [("train", 3), ("val", -1)]
    for saved in ckpt.partitions:
        assert {key: saved.counters[key] for key in TOKEN_COUNTERS} == dict.fromkeys(TOKEN_COUNTERS, 0)
    # b=4 per step: "lazy", "built" and "running" (unless evicted) hold slots of step 3.
    free = 2 if mode == "evict" else 1
    assert (buf.dispatch_step("train"), buf.capacity("train"), buf.free_slots("train")) == (3, 8, free)
    assert ckpt.evicted_in_flight == ("old", *(E8_IN_FLIGHT if mode == "evict" else ()))


@pytest.mark.parametrize("mode", ["reissue", "keep", "resume"])
@pytest.mark.parametrize("name", E8_FILES)
def test_an_e8b5814_files_in_flight_groups_go_on_with_versions(name: str, mode: str) -> None:
    """After the restore the producers go on as this release's do: a start version, trajectories
    with versions; the batch then hands the trainer their tokens, the old ones with none."""
    buf = restore_e8(name, mode)[0].buffer
    if mode != "keep":  # both PENDING again; "running" starts at version 2 (its first token)
        buf.mark_running_nowait("running", version=2)
    buf.put_nowait("pending", "p1", session_id=2, versions=[(3, 4)])
    buf.put_nowait("running", "r2", session_id=1, versions=[(2, 1), (3, 2)])
    buf.mark_finished_nowait("pending")
    buf.mark_finished_nowait("running")
    batch, _ = buf.sample_nowait(3, 6)
    assert batch.uids == ["custom", "failed", "pending", "lazy", "built", "running"]
    lost = mode == "reissue"  # the partial trajectories were discarded, their keys gone
    pending = [] if lost else ["pending_1_0"]
    running = [] if lost else ["running_0_0", "running_0_1"]
    keys = ["custom_3_0", "custom_5_2", "failed_0_0", *pending, "pending_2_0", "lazy_0_0", "lazy_1_0",
            "lazy_2_0", "built_0_0", "built_1_0", *running, "running_1_0"]  # fmt: skip
    assert batch.keys == keys
    tokens = {"pending_2_0": 4, "running_1_0": 3}
    assert batch.token_counts.tolist() == [tokens.get(key, 0) for key in keys]
    versions, offsets = batch.token_versions()
    assert versions.tolist() == [3, 3, 3, 3, 2, 3, 3]
    assert offsets[-1] == 7
    mask, _ = batch.freshness_mask()
    assert mask.tolist() == [True] * 7  # lag 1 or 2 at step 3: fresh under T=2
    train = buf.stats().partitions["train"]
    assert (train.admitted_tokens, train.sampled_tokens, train.tokens) == (7, 7, 0)
    assert_tokens_conserved(buf)


# -- files written by 053194f, the last release of the hand-written container ------------------------
#
# ``make_checkpoint_fixtures_053194f.py`` made them (its docstring lists the state): a task mixture
# under "borrow", a filter, versions and tokens, groups in flight. Later releases write the SQLite
# format of the journal; these still restore exactly, under every mode. The values below were
# printed by that script from the live buffer it saved, and are written out here by hand.

C0_FILES: dict[str, tuple[Path, Any]] = {
    "pickle": (FIXTURES / "checkpoint_053194f_pickle.ckpt", None),
    "codec": (FIXTURES / "checkpoint_053194f_codec.ckpt", CODEC),
}
#: uid -> :func:`versioned` of the saved group, in admission order.
C0_GROUPS: dict[str, tuple[Any, ...]] = {
    "c2": ("train", 2, FAILURE, {"task": "code"}, [("c2_0_0", 0, 0, {}, '"x"')], 2, 2, [((), 7)]),
    "pending": ("train", 2, PENDING, {"task": "math"}, [("pending_1_0", 1, 0, {"turn": 0}, '"p0"')], 2,
                2, [(((2, 3),), 3)]),
    "running": ("train", 2, RUNNING, {"task": "code", "n": [1, 2]},
                [("running_0_0", 0, 0, {}, '"r0"'), ("running_0_1", 0, 1, {}, '"r1"')], 2, 2,
                [(((2, 1), (3, 1)), 2), ((), 6)]),
    "v0": ("val", 0, FINISHED, {"split": "val"}, [("v0_0_0", 0, 0, {}, '"v"'), ("v0_1_0", 1, 0, {}, '"w"')],
           0, 0, [((), 10), ((), 10)]),
    "v1": ("val", 0, RUNNING, {}, [("v1_0_0", 0, 0, {}, '{"v1": true}')], 0, 0, [(((0, 2),), 2)]),
}  # fmt: skip
C0_IN_FLIGHT = ("pending", "running", "v1")
#: The in-flight groups' ages at each file's snapshot (the terminal groups' are 0).
C0_SECONDS = {"pickle": {"pending": 1.0, "running": 0.75, "v1": 0.25},
              "codec": {"pending": 1.25, "running": 1.0, "v1": 0.5}}  # fmt: skip
#: The saved buffer's stats, their counters that are not 0 (the tasks apart).
C0_STATS = {
    "train": {"pending": 1, "running": 1, "failure": 1, "trajectories": 4, "admitted_groups": 9,
              "admitted_trajectories": 15, "sampled_groups": 4, "sampled_trajectories": 8,
              "evicted_stale_groups": 1, "evicted_stale_trajectories": 1, "evicted_in_flight_groups": 1,
              "capacity": 16, "tokens": 18, "admitted_tokens": 39, "sampled_tokens": 19, "evicted_tokens": 2,
              "evicted_filtered_groups": 1, "evicted_filtered_trajectories": 2, "resident_tokens": 7},
    "val": {"running": 1, "finished": 1, "trajectories": 3, "admitted_groups": 2, "admitted_trajectories": 3,
            "tokens": 22, "admitted_tokens": 22, "resident_tokens": 20},
}  # fmt: skip
#: Each task's saved counters that are not 0, its balance and its growth.
C0_TASKS = {
    "code": ({"admitted_groups": 4, "admitted_trajectories": 7, "sampled_groups": 1,
              "sampled_trajectories": 2, "evicted_filtered_groups": 1,
              "evicted_filtered_trajectories": 2, "admitted_tokens": 24, "sampled_tokens": 9}, 1, 1),
    "math": ({"admitted_groups": 5, "admitted_trajectories": 8, "sampled_groups": 3,
              "sampled_trajectories": 6, "evicted_stale_groups": 1, "evicted_stale_trajectories": 1,
              "evicted_in_flight_groups": 1, "admitted_tokens": 15, "sampled_tokens": 10,
              "evicted_tokens": 2}, -1, 0),
}  # fmt: skip


def restore_c0(name: str, mode: str) -> RestoreResult:
    """Restore the 053194f file ``name`` under ``mode``."""
    path, codec = C0_FILES[name]
    return ReplayBuffer.restore(path, in_flight=mode, payload_codec=codec, status_log_interval=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", C0_FILES)
def test_a_053194f_file_restores_exactly_what_was_saved(name: str) -> None:
    buf = restore_c0(name, "keep").buffer
    stats = buf.stats()
    for partition, expected_counters in C0_STATS.items():
        counters = {k: v for k, v in attrs.asdict(stats.partitions[partition]).items() if v and k != "tasks"}
        assert counters == expected_counters, partition
    assert_conserved(buf)
    assert_tokens_conserved(buf)
    ckpt = buf.checkpoint()
    assert [(g.uid, versioned(g)) for g in ckpt.groups] == list(C0_GROUPS.items())
    seconds = C0_SECONDS[name]
    for group in ckpt.groups:  # terminal ages exact; in-flight ones still ageing from the saved one
        saved = seconds.get(group.uid, 0.0)
        assert saved <= group.generation_seconds < saved + (LIMIT if group.uid in seconds else 1e-9)
    train, val = ckpt.partitions
    assert (train.name, train.last_sampled, val.name, val.last_sampled, val.mixture, val.filters) == (
        "train", 1, "val", -1, None, None,
    )  # fmt: skip
    assert train.mixture is not None
    assert train.filters is not None
    tasks = {t.name: ({k: v for k, v in t.counters.items() if v}, t.balance, t.growth)
             for t in train.mixture.tasks}  # fmt: skip
    assert tasks == C0_TASKS
    assert (train.mixture.shares, train.mixture.batch_size) == (("math", "code", "math", "math"), 2)
    filters = train.filters
    assert (filters.verdicts, filters.errors, filters.recent_filtered, filters.recent_errors) == (
        (True, False, True, True, True), 0, 0, 0,
    )  # fmt: skip
    assert (dict(ckpt.clocks), ckpt.evicted_in_flight, ckpt.evicted_reasons) == (
        {"train": 2}, ("c0", "old"), ("filtered", None),
    )  # fmt: skip
    assert (buf.dispatch_step("train"), buf.capacity("train")) == (2, 16)
    assert (buf.capacity("train", task="math"), buf.capacity("train", task="code")) == (8, 8)


@pytest.mark.parametrize("mode", ["reissue", "resume", "evict"])
@pytest.mark.parametrize("name", C0_FILES)
def test_a_053194f_files_in_flight_groups_follow_the_mode(name: str, mode: str) -> None:
    result = restore_c0(name, mode)
    buf = result.buffer
    groups = {g.uid: g for g in buf.checkpoint().groups}
    if mode == "evict":
        assert list(groups) == ["c2", "v0"]
        assert list(result.reissue) == []
        train, val = buf.stats().partitions["train"], buf.stats().partitions["val"]
        assert (train.evicted_restart_groups, train.evicted_restart_trajectories) == (2, 3)
        assert (val.evicted_restart_groups, val.evicted_restart_trajectories) == (1, 1)
    else:
        kept = mode == "resume"
        assert [(g.uid, len(g.trajectories)) for g in result.reissue] == [
            (uid, len(C0_GROUPS[uid][4]) if kept else 0) for uid in C0_IN_FLIGHT
        ]
        for uid in C0_IN_FLIGHT:
            assert groups[uid].status is PENDING
            assert [(t.versions, t.tokens) for t in groups[uid].trajectories] == (
                C0_GROUPS[uid][7] if kept else []
            ), uid
        reissued = buf.stats().partitions["train"].reissued_trajectories
        assert reissued == (0 if kept else 3)
    assert_conserved(buf)
    assert_tokens_conserved(buf)


@pytest.mark.parametrize("name", C0_FILES)
def test_a_053194f_buffer_goes_on_under_its_mixture_and_filter(name: str) -> None:
    """The borrowed quota is paid back and the filter is given again: it filters from then on."""
    path, codec = C0_FILES[name]
    buf = ReplayBuffer.restore(path, in_flight="keep", payload_codec=codec, status_log_interval=None,
                               filters=[zero_variance("reward")]).buffer  # fmt: skip
    tags = [{"reward": 1}, {"reward": 0}]
    buf.put_group_nowait("c3", ["a", "b"], tags={"task": "code"}, trajectory_tags=tags)
    buf.put_group_nowait("c4", ["a", "b"], tags={"task": "code"}, trajectory_tags=[{"reward": 1}] * 2)
    buf.mark_finished_nowait("running")
    buf.mark_finished_nowait("pending")
    batch, _ = buf.sample_nowait(2, 2)
    assert batch.uids == ["c2", "running"]  # code is owed one: it takes both slots (failures sample)
    train = buf.stats().partitions["train"]
    # "c4" filtered (with the saved "c0"); "running" has no rewards: the filter raised and kept it.
    assert (train.evicted_filtered_groups, train.filter_errors) == (2, 1)
    code, math = train.tasks["code"], train.tasks["math"]
    assert (code.sampled, math.sampled) == (3, 3)
    assert_conserved(buf)
