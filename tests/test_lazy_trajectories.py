"""Groups stored by put_group's fast path build their trajectory records on first read.

They must be indistinguishable from eagerly built groups: the same fields, the same tuple on
every read (records compare by identity), the same pickles, counts and metrics; and a resident
group must stay compact (few GC-tracked objects) until somebody reads its trajectories.
"""

from __future__ import annotations

import gc
import json
import pickle
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from _helpers import LIMIT, make, map_payloads, sample_now, stored_groups, trajectories_built
from stalebuf import Group, ReplayBuffer, Status, records


def _buffer(**config: Any) -> ReplayBuffer:
    """A buffer whose "train" partition exists (a partition's first group takes the general path)."""
    buf = make(**config)
    buf.put_group_nowait("first", [None], global_steps=0)
    sample_now(buf, 0, 1)
    return buf


def _fields(group: Group) -> list[tuple[Any, ...]]:
    return [(t.key, t.session_id, t.index, dict(t.tags), t.payload) for t in group.trajectories]


def _lazy_and_eager(payloads: list[Any]) -> tuple[Group, Group]:
    """The same group stored twice: by the fast path and by the general path (explicit ids)."""
    buf = _buffer()
    buf.put_group_nowait("lazy", payloads, global_steps=0)
    buf.put_group_nowait("eager", payloads, global_steps=0, session_ids=list(range(len(payloads))))
    groups = stored_groups(buf)
    assert not trajectories_built(groups["lazy"])
    assert trajectories_built(groups["eager"])
    return groups["lazy"], groups["eager"]


@pytest.mark.parametrize("count", [0, 1, 8, 64, 65, 200])
def test_a_lazily_stored_group_reads_like_an_eager_one(count: int) -> None:
    payloads = [object() for _ in range(count)]
    lazy, eager = _lazy_and_eager(payloads)
    assert [(key.replace("lazy", "eager"), *rest) for key, *rest in _fields(lazy)] == _fields(eager)
    assert all(a.payload is p for a, p in zip(lazy.trajectories, payloads, strict=True))
    untimed = {"generation_seconds": 0.0}  # the general path times the call
    assert repr(lazy.replace(**untimed)) == repr(eager.replace(**untimed)).replace("eager", "lazy")


def test_every_read_returns_the_same_records() -> None:
    lazy, _ = _lazy_and_eager([1, 2, 3])
    first = lazy.trajectories
    assert trajectories_built(lazy)
    assert lazy.trajectories is first
    assert lazy.trajectories[0] == first[0]  # identity equality holds across reads
    assert lazy.replace(status=Status.FAILURE).trajectories is first


def test_concurrent_first_reads_from_threads_get_the_same_tuple() -> None:
    buf = _buffer()
    for i in range(2000):
        buf.put_group_nowait(f"g{i}", [i] * 8, global_steps=0)
    groups = list(stored_groups(buf).values())
    seen: list[list[Any]] = [[], []]
    start = threading.Barrier(2)

    def read(out: list[Any]) -> None:
        start.wait()
        out.extend(group.trajectories for group in groups)

    threads = [threading.Thread(target=read, args=(out,)) for out in seen]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(LIMIT)
    assert all(a is b for a, b in zip(seen[0], seen[1], strict=True))
    assert all(group.trajectories is a for group, a in zip(groups, seen[0], strict=True))


@pytest.mark.parametrize("read_first", [False, True])
def test_a_pickled_group_round_trips_and_keeps_shared_records_identical(read_first: bool) -> None:
    lazy, _ = _lazy_and_eager([np.arange(3), "x"])
    if read_first:
        lazy.trajectories  # noqa: B018 - builds them
    group, trajectory = pickle.loads(pickle.dumps((lazy, lazy.trajectories[1])))
    assert isinstance(group, Group)
    assert type(group) is type(lazy)  # still stored lazily
    assert group.trajectories[1] is trajectory
    assert [t.key for t in group.trajectories] == ["lazy_0_0", "lazy_1_0"]
    np.testing.assert_array_equal(group.trajectories[0].payload, np.arange(3))


def test_batch_views_read_payloads_without_building_records() -> None:
    buf = _buffer()
    payloads = [[object() for _ in range(4)] for _ in range(3)]
    for i, group_payloads in enumerate(payloads):
        buf.put_group_nowait(f"g{i}", group_payloads, global_steps=0)
    batch, _ = buf.sample_nowait(0, 3)  # (sample_now's event loop may repr the batch: that builds)
    assert all(a is b for a, b in zip(batch.payloads, [p for ps in payloads for p in ps], strict=True))
    keys, tags = batch.keys, batch.tags
    assert not any(trajectories_built(group) for group in batch.groups)
    assert keys == [f"g{i}_{s}_0" for i in range(3) for s in range(4)]
    assert [dict(t) for t in tags] == [{}] * 12
    built = batch.trajectories
    assert (batch.keys, batch.tags, batch.payloads) == (
        [t.key for t in built],
        [t.tags for t in built],
        [t.payload for t in built],
    )
    assert keys == batch.keys
    stats = buf.stats().total
    assert (stats.sampled_groups, stats.sampled_trajectories, stats.trajectories) == (4, 13, 0)


def test_counts_do_not_build_records() -> None:
    buf = _buffer(max_off_policy_threshold=1)
    for i in range(4):
        buf.put_group_nowait(f"g{i}", [None] * 5, global_steps=i)
    assert buf.stats().total.trajectories == 20
    batch, _ = sample_now(buf, 2, 1)  # the groups of steps 0 and 1 are dropped as stale
    assert batch.uids == ["g2"]
    stats = buf.stats().total
    assert (stats.evicted_stale_groups, stats.evicted_stale_trajectories, stats.trajectories) == (2, 10, 5)
    assert not any(map(trajectories_built, stored_groups(buf).values()))


@pytest.mark.parametrize("codec", [False, True])
def test_a_checkpoint_round_trips_lazy_groups_and_leaves_them_unbuilt(tmp_path: Path, codec: bool) -> None:
    buf = _buffer()
    for i in range(3):
        buf.put_group_nowait(f"g{i}", [i, i + 1], global_steps=i)
    codec_pair = (lambda p: json.dumps(p).encode(), lambda b: json.loads(b)) if codec else None

    async def save() -> None:
        with anyio.fail_after(LIMIT):
            await buf.save(tmp_path / "ckpt", payload_codec=codec_pair)

    anyio.run(save)
    assert not any(map(trajectories_built, stored_groups(buf).values()))
    restored = ReplayBuffer.restore(tmp_path / "ckpt", payload_codec=codec_pair).buffer
    batch, _ = sample_now(restored, 2, 3)
    assert batch.payloads == [0, 1, 1, 2, 2, 3]
    assert batch.keys == [f"g{i}_{s}_0" for i in range(3) for s in range(2)]


def test_a_resident_group_leaves_few_gc_tracked_objects() -> None:
    # A count, not a timing: what the collector must traverse per resident group of 8.
    n = 5000
    gc.collect()
    before = len(gc.get_objects())
    buf = _buffer(max_off_policy_threshold=10**9)
    for i in range(n):
        buf.put_group_nowait(f"g{i}", [None] * 8, global_steps=i // 256)
    gc.collect()
    per_group = (len(gc.get_objects()) - before) / n
    assert per_group < 1.1  # the Group alone: no holder of its payloads, no index entry
    del buf


def test_read_as_a_tuple_a_lazy_group_shows_its_built_trajectories() -> None:
    lazy, eager = _lazy_and_eager([1, 2])
    uid, partition, step, status, tags, trajectories, finish_step, seconds = lazy
    assert trajectories is lazy.trajectories
    assert lazy[5] is lazy[-3] is lazy.trajectories
    assert lazy[4:6] == (lazy.tags, lazy.trajectories)
    assert (
        tuple(lazy)[:5] == (uid, partition, step, status, tags) == ("lazy", "train", 0, Status.FINISHED, tags)
    )
    assert (finish_step, seconds) == (lazy.finish_step, lazy.generation_seconds)
    assert len(lazy) == len(eager) == 8
    assert eager[5] is eager.trajectories


def test_map_payloads_keeps_a_lazy_group_lazy_and_maps_an_eager_one() -> None:
    lazy, eager = _lazy_and_eager([1, 2, 3])
    for group, stays_lazy in ((lazy, True), (eager, False)):
        mapped = map_payloads(group, lambda p: p * 10)
        assert trajectories_built(mapped) is not stays_lazy
        assert [t.payload for t in mapped.trajectories] == [10, 20, 30]
        assert [t.key for t in mapped.trajectories] == [t.key for t in group.trajectories]
        assert (mapped.uid, mapped.dispatch_step, mapped.status) == (
            group.uid,
            group.dispatch_step,
            group.status,
        )
    built_first = map_payloads(lazy, str)  # lazy was built above: the records are mapped
    assert trajectories_built(built_first)
    assert [t.payload for t in built_first.trajectories] == ["1", "2", "3"]


def test_tuple_operations_in_c_show_the_built_trajectories_too() -> None:
    # Concatenation, repetition, membership, count and index read a tuple's slots in C: a lazily
    # stored group answers them as an eager one does.
    lazy, eager = _lazy_and_eager(["a", "b"])
    for group in (lazy, eager):
        t = group.trajectories
        assert (group + ())[5] is (() + group)[5] is (group * 1)[5] is (2 * group)[13] is t  # noqa: RUF005
        assert t in group
        assert (group.count(t), group.index(t), group.index(t, 5, 6)) == (1, 5, 5)
        with pytest.raises(ValueError, match="not in tuple"):
            group.index(t, 6)
        with pytest.raises(TypeError):
            group + []  # noqa: RUF005 - a tuple's own error
    # %-formatting with a group as the argument tuple reads the slots with no call to hook: the
    # one place a lazily stored group shows its payloads (documented on LazyGroup).
    assert ("%s|" * 8 % eager).split("|")[5] == str(eager.trajectories)
    assert ("%s|" * 8 % lazy).split("|")[5] == str(("a", "b"))


def test_a_lazily_stored_group_is_as_immutable_as_an_eager_one() -> None:
    lazy, eager = _lazy_and_eager([1])
    for group in (lazy, eager):
        with pytest.raises(AttributeError):
            group.uid = "other"  # type: ignore[misc]
        with pytest.raises(AttributeError):
            group.extra = 1  # type: ignore[attr-defined]
        with pytest.raises(AttributeError):
            del group.uid  # type: ignore[misc]
        with pytest.raises(TypeError):
            group[0] = "other"  # type: ignore[index]
    with pytest.raises(AttributeError):
        lazy._built = ()  # type: ignore[misc]
    assert lazy.uid == "lazy"
    assert [t.payload for t in lazy.trajectories] == [1]


def test_replace_shares_the_records_and_pickles_keep_the_format_2_form() -> None:
    lazy, _ = _lazy_and_eager([1, 2])
    failed = lazy.replace(status=Status.FAILURE)
    assert failed.trajectories is lazy.trajectories  # as replace on an eager group
    assert failed.status is Status.FAILURE
    # The pickled form is the one the first format-2 files hold (and older readers understand):
    # the group pickles through records._group with its payloads in a records.LazyTrajectories.
    fresh, _ = _lazy_and_eager([1, 2])
    function, args = fresh.__reduce__()
    assert function is records._group
    assert type(args[5]) is records.LazyTrajectories
    assert (args[5].uid, args[5].payloads, args[5].built) == ("lazy", (1, 2), None)
    assert not trajectories_built(fresh)  # pickling built nothing
    restored = pickle.loads(pickle.dumps(fresh))
    assert not trajectories_built(restored)
    assert [t.key for t in restored.trajectories] == ["lazy_0_0", "lazy_1_0"]
