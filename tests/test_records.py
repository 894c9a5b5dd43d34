"""The value records: fast constructors, views and immutability."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from stalebuf import Batch, Group, Status, Trajectory
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
