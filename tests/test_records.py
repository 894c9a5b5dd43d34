"""The value records: fast constructors, views, immutability, and the pickles of groups
``put_group`` stored lazily (those of this release and those of f169765)."""

from __future__ import annotations

import ast
import copy
import pickle
import pickletools
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
import pytest

from _helpers import LIMIT, make, stored_groups, trajectories_built
from stalebuf import Batch, Group, ReplayBuffer, Status, Trajectory, records
from stalebuf.records import EMPTY_TAGS, new_batch, new_group, new_trajectory


def fields(record: object) -> tuple[object, ...]:
    if isinstance(record, tuple):  # Trajectory and Group are immutable tuple subclasses
        return tuple(record)
    return attrs.astuple(record, recurse=False)


def test_fast_constructors_build_what_the_classes_build() -> None:
    trajectory = new_trajectory("u_1_2", 1, 2, {"r": 1}, [1, 2])
    assert type(trajectory) is Trajectory
    assert fields(trajectory) == fields(Trajectory("u_1_2", 1, 2, {"r": 1}, [1, 2]))
    group = new_group("u", "train", 3, Status.FINISHED, EMPTY_TAGS, (trajectory,), 4, 1.5)
    assert type(group) is Group
    assert fields(group) == fields(Group("u", "train", 3, Status.FINISHED, EMPTY_TAGS, (trajectory,), 4, 1.5))
    assert group.global_steps == group.dispatch_step == 3  # the verl name is an alias
    batch = new_batch("train", 5, (group,), 2)
    assert type(batch) is Batch
    assert fields(batch) == fields(Batch("train", 5, (group,), 2))


@pytest.mark.parametrize(
    "record",
    [
        new_trajectory("u_0_0", 0, 0, EMPTY_TAGS, None),
        new_group("u", "train", 0, Status.FAILURE, EMPTY_TAGS, (), 0, 0.0),
        new_batch("train", 0, (), 1),
    ],
)
def test_fast_built_records_are_frozen(record: object) -> None:
    # attrs' FrozenInstanceError is an AttributeError, as is assigning a read-only field.
    with pytest.raises(AttributeError):
        record.partition = "x"  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        record.anything_new = 1  # type: ignore[attr-defined]
    if isinstance(record, tuple):
        with pytest.raises(TypeError):
            record[0] = "x"  # type: ignore[index]


def test_tuple_records_compare_by_identity_and_read_like_records() -> None:
    t = new_trajectory("u_0_0", 0, 0, EMPTY_TAGS, np.arange(3))
    twin = new_trajectory("u_0_0", 0, 0, EMPTY_TAGS, np.arange(3))
    assert t == t  # identity, not an element-wise comparison of the arrays
    assert t != twin
    assert hash(t) != hash(twin)
    assert repr(t).startswith("Trajectory(key='u_0_0', session_id=0, index=0")
    group = new_group("u", "train", 1, Status.FINISHED, EMPTY_TAGS, (t,), 2, 0.5)
    assert group.replace(status=Status.FAILURE).status is Status.FAILURE
    assert group.status is Status.FINISHED
    assert group.finish_step == 2


def test_batch_views_and_staleness() -> None:
    t = [new_trajectory(f"g_{i}_0", i, 0, {"i": i}, i * 10) for i in range(3)]
    g1 = new_group("a", "train", 4, Status.FINISHED, EMPTY_TAGS, (t[0], t[1]), 5, 0.0)
    g2 = new_group("b", "train", 6, Status.FAILURE, EMPTY_TAGS, (t[2],), 6, 0.0)
    batch = new_batch("train", 7, (g1, g2), 2)
    assert len(batch) == 2
    assert batch.uids == ["a", "b"]
    assert batch.keys == ["g_0_0", "g_1_0", "g_2_0"]
    assert batch.payloads == [0, 10, 20]
    assert [dict(tags) for tags in batch.tags] == [{"i": 0}, {"i": 1}, {"i": 2}]
    np.testing.assert_array_equal(batch.staleness, np.array([2.0, 1.0]))
    assert Status.FAILURE.is_terminal
    assert not Status.RUNNING.is_terminal


# -- pickles of groups put_group stored lazily ------------------------------------------------

#: Pickles (protocol 2) written by stalebuf at f169765, where a lazily stored group pickled as
#: ``records._group`` with a ``records.LazyTrajectories``: group "g" (step 0, payloads "p0" and
#: "p1", tags {"k": 1}, records not built); and the tuple of group "h" (payloads "q0" and "q1",
#: records built) and its second record.
OLD_UNBUILT = (
    b"\x80\x02cstalebuf.records\n_group\nq\x00(X\x01\x00\x00\x00gq\x01X\x05\x00\x00\x00trainq\x02K\x00"
    b"cstalebuf.records\nStatus\nq\x03X\x08\x00\x00\x00finishedq\x04\x85q\x05Rq\x06}q\x07X\x01\x00\x00"
    b"\x00kq\x08K\x01scstalebuf.records\nLazyTrajectories\nq\th\x01X\x02\x00\x00\x00p0q\nX\x02\x00\x00"
    b"\x00p1q\x0b\x86q\x0cN\x87q\rRq\x0eK\x00G\x00\x00\x00\x00\x00\x00\x00\x00tq\x0fRq\x10."
)
OLD_BUILT_AND_RECORD = (
    b"\x80\x02cstalebuf.records\n_group\nq\x00(X\x01\x00\x00\x00hq\x01X\x05\x00\x00\x00trainq\x02K\x00"
    b"cstalebuf.records\nStatus\nq\x03X\x08\x00\x00\x00finishedq\x04\x85q\x05Rq\x06Ncstalebuf.records\n"
    b"LazyTrajectories\nq\x07h\x01X\x02\x00\x00\x00q0q\x08X\x02\x00\x00\x00q1q\t\x86q\ncstalebuf.records"
    b"\n_trajectory\nq\x0b(X\x05\x00\x00\x00h_0_0q\x0cK\x00K\x00Nh\x08tq\rRq\x0eh\x0b(X\x05\x00\x00\x00"
    b"h_1_0q\x0fK\x01K\x00Nh\ttq\x10Rq\x11\x86q\x12\x87q\x13Rq\x14K\x00G\x00\x00\x00\x00\x00\x00\x00"
    b"\x00tq\x15Rq\x16h\x11\x86q\x17."
)


def _lazy(uid: str, payloads: list[Any], tags: dict[str, Any] | None = None) -> Group:
    """A group put_group stores lazily (a partition's first group takes the general path)."""
    buf = make()
    buf.put_group_nowait("first", [None])
    buf.put_group_nowait(uid, payloads, global_steps=0, tags=tags)
    group = stored_groups(buf)[uid]
    assert not trajectories_built(group)
    return group


def _content(group: Group) -> tuple[Any, ...]:
    trajectories = [(t.key, t.session_id, t.index, dict(t.tags), t.payload) for t in group.trajectories]
    return (group.uid, group.partition, group.dispatch_step, group.status, dict(group.tags), trajectories,
            group.finish_step, group.generation_seconds)  # fmt: skip


def _imported_globals(data: bytes) -> set[tuple[str, str]]:
    """The ``(module, name)`` pairs a pickle of protocol 2 or less imports when loaded."""
    return {tuple(arg.split(" ")) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}  # type: ignore[misc]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_lazy_group_pickles_as_its_payloads_and_loads_lazy_again(protocol: int) -> None:
    for tags in (None, {"k": [1]}):
        group = _lazy("g", ["p0", ["p1"]], tags)
        loaded = pickle.loads(pickle.dumps(group, protocol=protocol))
        assert not trajectories_built(group)  # pickling built nothing
        assert not trajectories_built(loaded)  # and the copy is as compact
        assert _content(loaded) == _content(group)
        assert loaded.trajectories is loaded.trajectories
        assert (loaded.tags is EMPTY_TAGS) is (tags is None)
        with pytest.raises(TypeError):
            loaded.tags["k"] = 2  # type: ignore[index]


def test_a_lazy_group_pickle_names_only_what_f169765_defines() -> None:
    # new_lazy_group and records._frozen_tags have these names and parameters at f169765 too, so
    # its stalebuf loads these pickles, and checkpoint files holding them stay format 2 both ways.
    for tags in (None, {"k": 1}):
        data = pickle.dumps(_lazy("g", [1, 2], tags), protocol=2)
        assert _imported_globals(data) == {
            ("stalebuf._lazy_group", "new_lazy_group"),
            ("stalebuf.records", "_frozen_tags"),
            ("stalebuf.records", "Status"),
        }
    # Untagged groups share one empty tags in a pickle: three groups make five calls on loading
    # (three new_lazy_group, one Status, one _frozen_tags), not seven.
    data = pickle.dumps([_lazy(uid, [1], None) for uid in "abc"], protocol=2)
    assert [op.name for op, _, _ in pickletools.genops(data)].count("REDUCE") == 5


def test_a_built_lazy_group_pickles_as_the_eager_group_of_its_records() -> None:
    group = _lazy("g", [np.arange(3), "x"])
    failed = group.replace(status=Status.FAILURE)  # reads, so builds, the records
    loaded, record, loaded_failed = pickle.loads(pickle.dumps((group, group.trajectories[1], failed)))
    assert loaded.trajectories[1] is record  # a record the pickle also holds stays the group's
    assert loaded_failed.trajectories is loaded.trajectories
    assert _content(loaded)[:5] == _content(group)[:5]
    assert [t.key for t in loaded.trajectories] == ["g_0_0", "g_1_0"]
    np.testing.assert_array_equal(loaded.trajectories[0].payload, np.arange(3))


def test_a_deep_copy_of_a_lazy_group_stays_lazy_and_copies_its_payloads() -> None:
    group = _lazy("g", [[1], [2]], {"k": [3]})
    duplicate = copy.deepcopy(group)
    assert not trajectories_built(duplicate)
    assert _content(duplicate) == _content(group)
    assert duplicate.trajectories[0].payload is not group.trajectories[0].payload
    assert duplicate.tags["k"] is not group.tags["k"]


def test_pickles_written_by_f169765_load_as_the_same_groups() -> None:
    unbuilt = pickle.loads(OLD_UNBUILT)
    assert _content(unbuilt) == ("g", "train", 0, Status.FINISHED, {"k": 1},
                                 [("g_0_0", 0, 0, {}, "p0"), ("g_1_0", 1, 0, {}, "p1")], 0, 0.0)  # fmt: skip
    built, record = pickle.loads(OLD_BUILT_AND_RECORD)
    assert built.trajectories[1] is record  # the records it was pickled with, not new ones
    assert _content(built) == ("h", "train", 0, Status.FINISHED, {},
                               [("h_0_0", 0, 0, {}, "q0"), ("h_1_0", 1, 0, {}, "q1")], 0, 0.0)  # fmt: skip
    for group in (unbuilt, built):
        assert isinstance(group, Group)
        assert group.trajectories is group.trajectories
        assert all(type(t) is Trajectory and t.tags is EMPTY_TAGS for t in group.trajectories)
        assert copy.copy(group).trajectories is group.trajectories
        assert copy.copy(group) != group  # records compare by identity
        assert _content(pickle.loads(pickle.dumps(group))) == _content(group)
        with pytest.raises(TypeError):
            group.tags["k"] = 2  # type: ignore[index]
    assert built.tags is EMPTY_TAGS


def test_a_checkpoint_file_restores_lazy_groups_lazy(tmp_path: Path) -> None:
    buf = make()
    buf.put_group_nowait("first", [None])
    buf.put_group_nowait("g", [1, 2], global_steps=0, tags={"k": 1})

    async def save() -> None:
        with anyio.fail_after(LIMIT):
            await buf.save(tmp_path / "ckpt")

    anyio.run(save)
    restored = stored_groups(ReplayBuffer.restore(tmp_path / "ckpt").buffer)
    assert not trajectories_built(restored["g"])
    assert _content(restored["g"]) == _content(stored_groups(buf)["g"])


def test_records_imports_nothing_of_the_lazy_group() -> None:
    # LazyGroup builds on records.py, never the reverse (no import cycle, not even a lazy one).
    tree = ast.parse(Path(records.__file__).read_text(encoding="utf-8"))
    imported = [
        alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert imported  # the walk sees the module's imports
    assert [name for name in imported if "lazy_group" in name] == []
