"""Groups that ``put_group`` stores lazily, against the same groups built eagerly.

``put_group_nowait`` without explicit session ids takes a fast path that stores a ``LazyGroup``:
its trajectory records are built on first read. With explicit session ids the general path builds
them at once. A lazily stored group must be indistinguishable from an eager one: the same fields,
the same tuple on every read (records compare by identity), the same pickles, copies, comparisons
and tuple behaviour, the same counts, metrics and whole-buffer behaviour; and a resident group must
stay compact (few GC-tracked objects) until somebody reads its trajectories.

The sections: reading a lazy group; the places where a lazy group once differed from an eager one
(each test names the difference it guards against); adversarial reads that must agree (pickles of
every protocol, deep copies, threads, finalizers, hostile payloads); and the whole buffer, run
twice with the same calls. The one documented difference (``"%s ..." % group``, where C reads the
tuple's slots) is checked as documented; the time the general path measures
(``generation_seconds``) is left out of every comparison.
"""

from __future__ import annotations

import copy
import gc
import json
import pickle
import random
import sys
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from _helpers import LIMIT, make, map_payloads, sample_now, stored_groups, trajectories_built
from stalebuf import Batch, Group, ReplayBuffer, Status
from stalebuf.errors import StalebufError
from stalebuf.records import EMPTY_TAGS


def _buffer(*, val: bool = False, **config: Any) -> ReplayBuffer:
    """A buffer whose "train" partition exists, and "val" too if asked (a partition's first group
    takes the general path)."""
    buf = make(**config)
    buf.put_group_nowait("first", [None], global_steps=0)
    if val:
        buf.put_group_nowait("firstval", [None], global_steps=0, partition="val")
    sample_now(buf, 0, 1)
    if val:
        sample_now(buf, 0, 1, partition="val")
    return buf


def _fields(group: Group) -> list[tuple[Any, ...]]:
    return [(t.key, t.session_id, t.index, dict(t.tags), t.payload) for t in group.trajectories]


def _side_by_side(payloads: list[Any]) -> tuple[Group, Group]:
    """The same payloads stored twice in one buffer: as "lazy" by the fast path and as "eager" by
    the general path (explicit ids)."""
    buf = _buffer()
    buf.put_group_nowait("lazy", payloads, global_steps=0)
    buf.put_group_nowait("eager", payloads, global_steps=0, session_ids=list(range(len(payloads))))
    groups = stored_groups(buf)
    assert not trajectories_built(groups["lazy"])
    assert trajectories_built(groups["eager"])
    return groups["lazy"], groups["eager"]


def _lazy_and_eager(payloads: list[Any], uid: str = "g", **config: Any) -> tuple[Group, Group]:
    """The same group (same uid) stored by the fast path and, in another buffer, by the general
    path; the lazy one is not built yet."""
    lazy_buf, eager_buf = _buffer(val=True, **config), _buffer(val=True, **config)
    lazy_buf.put_group_nowait(uid, payloads, global_steps=0)
    eager_buf.put_group_nowait(uid, payloads, global_steps=0, session_ids=list(range(len(payloads))))
    lazy, eager = stored_groups(lazy_buf)[uid], stored_groups(eager_buf)[uid]
    assert not trajectories_built(lazy)
    assert trajectories_built(eager)
    return lazy, eager


def _outcome(call: Callable[[], object]) -> object:
    """What ``call`` returns, or the type of what it raises."""
    try:
        return call()
    except Exception as exc:
        return type(exc)


# -- reading a lazily stored group ------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 8, 64, 65, 200])
def test_a_lazily_stored_group_reads_like_an_eager_one(count: int) -> None:
    payloads = [object() for _ in range(count)]
    lazy, eager = _side_by_side(payloads)
    assert [(key.replace("lazy", "eager"), *rest) for key, *rest in _fields(lazy)] == _fields(eager)
    assert all(a.payload is p for a, p in zip(lazy.trajectories, payloads, strict=True))
    untimed = {"generation_seconds": 0.0}  # the general path times the call
    assert repr(lazy.replace(**untimed)) == repr(eager.replace(**untimed)).replace("eager", "lazy")


def test_every_read_returns_the_same_records() -> None:
    lazy, _ = _side_by_side([1, 2, 3])
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
    lazy, _ = _side_by_side([np.arange(3), "x"])
    if read_first:
        lazy.trajectories  # noqa: B018 - builds them
    group, trajectory = pickle.loads(pickle.dumps((lazy, lazy.trajectories[1])))
    assert isinstance(group, Group)
    assert trajectories_built(group)  # the tuple read them: pickled as the eager group of its records
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
    lazy, eager = _side_by_side([1, 2])
    uid, partition, step, status, tags, trajectories, finish_step, seconds, start = lazy
    assert trajectories is lazy.trajectories
    assert start == lazy.start_version == step
    assert lazy[5] is lazy[-4] is lazy.trajectories
    assert lazy[4:6] == (lazy.tags, lazy.trajectories)
    assert (
        tuple(lazy)[:5] == (uid, partition, step, status, tags) == ("lazy", "train", 0, Status.FINISHED, tags)
    )
    assert (finish_step, seconds) == (lazy.finish_step, lazy.generation_seconds)
    assert len(lazy) == len(eager) == 9
    assert eager[5] is eager.trajectories


def test_map_payloads_keeps_a_lazy_group_lazy_and_maps_an_eager_one() -> None:
    lazy, eager = _side_by_side([1, 2, 3])
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
    lazy, eager = _side_by_side(["a", "b"])
    for group in (lazy, eager):
        t = group.trajectories
        assert (group + ())[5] is (() + group)[5] is (group * 1)[5] is (2 * group)[14] is t  # noqa: RUF005
        assert t in group
        assert (group.count(t), group.index(t), group.index(t, 5, 6)) == (1, 5, 5)
        with pytest.raises(ValueError, match="not in tuple"):
            group.index(t, 6)
        with pytest.raises(TypeError):
            group + []  # noqa: RUF005 - a tuple's own error
    # %-formatting with a group as the argument tuple reads the slots with no call to hook: the
    # one place a lazily stored group shows its payloads (documented on LazyGroup).
    assert ("%s|" * 9 % eager).split("|")[5] == str(eager.trajectories)
    assert ("%s|" * 9 % lazy).split("|")[5] == str(("a", "b"))


def test_a_lazily_stored_group_is_as_immutable_as_an_eager_one() -> None:
    lazy, eager = _side_by_side([1])
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


def test_replace_shares_the_records() -> None:
    """``replace`` on a lazy group shares its records, as on an eager group (how it pickles is
    tested in test_records.py)."""
    lazy, _ = _side_by_side([1, 2])
    failed = lazy.replace(status=Status.FAILURE)
    assert failed.trajectories is lazy.trajectories  # as replace on an eager group
    assert failed.status is Status.FAILURE


# -- where a lazy group once differed from an eager one (each fixed; these keep it fixed) -----


def test_rebuilding_a_group_from_its_own_fields_keeps_its_payloads() -> None:
    """``type(x)(*x)`` is how generic code rebuilds a tuple record with ``_fields`` (namedtuple
    handling in pytree libraries, collate functions). Defect: a LazyGroup rebuilt that way took
    the trajectory records for payloads and wrapped each in a second record."""
    for group in _lazy_and_eager([1, 2]):
        rebuilt = type(group)(*group)
        assert [t.payload for t in rebuilt.trajectories] == [1, 2]
        assert [t.key for t in rebuilt.trajectories] == ["g_0_0", "g_1_0"]


def test_a_shallow_copy_shares_the_trajectory_records() -> None:
    """An eager group's copy holds the same records (equal, as records compare by identity).
    Defect: an unread lazy group's copy built records of its own, unequal to the original's."""
    for group in _lazy_and_eager([1, 2]):
        duplicate = copy.copy(group)
        assert duplicate.trajectories is group.trajectories
        assert duplicate.trajectories[0] == group.trajectories[0]


def test_comparing_with_the_plain_tuple_of_its_fields_answers_as_for_an_eager_group() -> None:
    """Group keeps object.__eq__, which gives way to tuple.__eq__ against a plain tuple, and it
    inherits tuple's ordering; both read the group's slots in C. Defect: a lazy group's slots
    held its payloads, so it compared with its own fields unlike an eager group."""
    lazy, eager = _lazy_and_eager([1, 2])
    operations: list[Callable[[Group, tuple[Any, ...]], object]] = [
        lambda g, t: g == t,
        lambda g, t: t == g,
        lambda g, t: g != t,
        lambda g, t: g < t,
        lambda g, t: g <= t,
        lambda g, t: t > g,
        lambda g, t: t >= g,
    ]
    for operation in operations:
        assert _outcome(partial(operation, lazy, tuple(lazy))) == _outcome(
            partial(operation, eager, tuple(eager))
        )


def test_ordering_two_groups_compares_their_records_not_their_payloads() -> None:
    """Two buffers may hold a group of the same uid: ordering them reaches the trajectories.
    Defect: lazy groups were ordered by their payloads, eager ones by their records."""
    lazy_a, eager_a = _lazy_and_eager([1, 2])
    lazy_b, eager_b = _lazy_and_eager([1, 3])
    assert (lazy_a < lazy_b, lazy_b < lazy_a) == (eager_a < eager_b, eager_b < eager_a)
    assert _outcome(lambda: lazy_a < eager_b) == _outcome(lambda: eager_a < eager_b)


def test_a_lazy_group_exposes_no_instance_dict() -> None:
    """An eager group has no __dict__. Defect: a lazy one's was visible and writable, and what
    it held was what ``trajectories`` returned (``vars(g)["_built"] = ...`` replaced a group's
    records)."""
    lazy, eager = _lazy_and_eager([1])
    assert _outcome(lambda: vars(eager)) is TypeError
    assert _outcome(lambda: vars(lazy)) is TypeError
    assert hasattr(lazy, "__dict__") is hasattr(eager, "__dict__")
    for group in (eager, lazy):
        # Even object.__setattr__ cannot overwrite a field. (It can add another attribute to a
        # lazy group, whose built records live in a hidden instance dict: the one bypass left,
        # documented on LazyGroup, as it can set the fields of a frozen attrs record.)
        assert _outcome(partial(object.__setattr__, group, "uid", "other")) is AttributeError
        assert group.uid == "g"


def test_getnewargs_shows_the_trajectories() -> None:
    """``tuple.__getnewargs__`` copies the slots in C (LazyGroup overrides every other tuple
    method). Defect: a lazy group's showed its payloads where the trajectories belong."""
    for group in _lazy_and_eager([1, 2]):
        (fields,) = group.__getnewargs__()  # type: ignore[attr-defined]
        assert fields[5] is group.trajectories


def test_count_and_index_take_positional_arguments_as_a_tuple_does() -> None:
    """A tuple's ``count`` and ``index`` are positional-only. Defect: a lazy group's overrides
    also took keyword arguments, where an eager group raises TypeError."""
    lazy, eager = _lazy_and_eager([1])
    calls: list[Callable[[Group], object]] = [
        lambda g: g.index(g.trajectories, start=0),  # type: ignore[call-arg]
        lambda g: g.count(value=g.trajectories),  # type: ignore[call-arg]
    ]
    for call in calls:
        assert _outcome(partial(call, eager)) is TypeError
        assert _outcome(partial(call, lazy)) is TypeError


# -- adversarial reads that must agree ---------------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("read_first", [False, True])
def test_pickles_of_every_protocol_round_trip_and_keep_shared_records_shared(
    protocol: int, read_first: bool
) -> None:
    """Lazy and eager groups, read or not, round-trip through every pickle protocol, and records
    shared between pickled objects (a group, one of its records, a replaced copy) stay shared."""
    for group in _lazy_and_eager([np.arange(3), "x", None]):
        if read_first:
            failed = group.replace(status=Status.FAILURE)
            loaded, record, loaded_failed = pickle.loads(
                pickle.dumps((group, group.trajectories[1], failed), protocol=protocol)
            )
            assert loaded.trajectories[1] is record
            assert loaded_failed.trajectories is loaded.trajectories
            assert loaded_failed.status is Status.FAILURE
        else:
            loaded = pickle.loads(pickle.dumps(group, protocol=protocol))
            assert trajectories_built(loaded) is trajectories_built(group)
        assert isinstance(loaded, Group)
        assert loaded.trajectories is loaded.trajectories
        assert [t.key for t in loaded.trajectories] == ["g_0_0", "g_1_0", "g_2_0"]
        assert [t.session_id for t in loaded.trajectories] == [0, 1, 2]
        assert all(t.tags is EMPTY_TAGS for t in loaded.trajectories)
        np.testing.assert_array_equal(loaded.trajectories[0].payload, np.arange(3))
        assert loaded.trajectories[1:] == loaded.trajectories[1:]  # identity holds across reads


@pytest.mark.parametrize("read_first", [False, True])
def test_a_deep_copy_copies_payloads_and_keeps_shared_records_shared(read_first: bool) -> None:
    """``copy.deepcopy`` copies the payloads and keeps one record shared between the copied
    objects, whether or not the lazy group was read first."""
    for group in _lazy_and_eager([[1], [2]]):
        if read_first:
            group.trajectories  # noqa: B018 - builds them
        duplicate, record = copy.deepcopy((group, group.trajectories[1]))
        assert duplicate.trajectories[1] is record
        assert [t.payload for t in duplicate.trajectories] == [[1], [2]]
        assert duplicate.trajectories[0].payload is not group.trajectories[0].payload
        assert [t.key for t in duplicate.trajectories] == ["g_0_0", "g_1_0"]


def test_python_level_tuple_reads_show_the_built_trajectories() -> None:
    """Every tuple read written in Python (reversal, slices, unpacking, zip with ``_fields``, the
    constructor, ``json.dumps``) sees the built trajectories, never the stored payloads."""
    for group in _lazy_and_eager(["a", "b"]):
        t = group.trajectories
        assert list(reversed(group))[3] is t
        assert group[::-1][3] is group[-4] is group[1::2][2] is group[-4:-10:-2][0] is t
        assert group[5:6] == (t,)
        assert dict(zip(Group._fields, group, strict=True))["trajectories"] is t
        assert (lambda *fields: fields)(*group)[5] is [*group][5] is list(group)[5] is t
        assert Group(*group).trajectories is t
        assert Group(**dict(zip(Group._fields, group, strict=True))).trajectories is t
        assert [name for name, value in zip(Group._fields, group, strict=True) if value is t] == [
            "trajectories"
        ]
        assert len(group) == len(tuple(group)) == 9
        rendered = json.dumps(group, default=str)
        assert rendered.count('"g_0_0"') == rendered.count('"g_1_0"') == 1


def test_many_threads_reading_first_get_one_tuple_per_group() -> None:
    """Eight threads racing to build the same groups' records, with the switch interval at its
    minimum, all get the one tuple each group keeps."""
    buf = _buffer(val=True)
    for i in range(1500):
        buf.put_group_nowait(f"g{i}", list(range(8)), global_steps=0)
    groups = list(stored_groups(buf).values())
    threads_count = 8
    seen: list[list[tuple[Group, Any]]] = [[] for _ in range(threads_count)]
    start = threading.Barrier(threads_count)

    def read(out: list[tuple[Group, Any]], backwards: bool) -> None:
        start.wait()
        out.extend((group, group.trajectories) for group in (groups[::-1] if backwards else groups))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython will
    try:
        threads = [threading.Thread(target=read, args=(out, i % 2 == 1)) for i, out in enumerate(seen)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(LIMIT)
    finally:
        sys.setswitchinterval(interval)
    assert all(len(out) == len(groups) for out in seen)
    assert all(records is group.trajectories for out in seen for group, records in out)


def test_a_finalizer_run_by_the_collector_may_read_trajectories() -> None:
    """A finalizer the collector runs in the middle of a build may itself read (and so build) a
    group's records: no deadlock, and every group still ends with one tuple of the right records."""
    buf = _buffer(val=True)
    for i in range(1000):
        buf.put_group_nowait(f"g{i}", [i, i], global_steps=0)
    groups = list(stored_groups(buf).values())
    read: list[tuple[Group, Any]] = []

    class Cycle:
        """Garbage only the collector frees; its finalizer reads a group's records."""

        def __init__(self, group: Group) -> None:
            self.group = group
            self.me = self

        def __del__(self) -> None:
            read.append((self.group, self.group.trajectories))

    thresholds = gc.get_threshold()
    gc.set_threshold(5, 1, 1)  # collect during the builds below, so finalizers nest in them
    try:
        for group in groups:
            Cycle(group)
            group.trajectories  # noqa: B018 - builds them
        gc.collect()
    finally:
        gc.set_threshold(*thresholds)
    assert len(read) == len(groups)
    assert all(records is group.trajectories for group, records in read)
    assert all([t.payload for t in group.trajectories] == [i, i] for i, group in enumerate(groups))


class Hostile:
    """A payload whose comparisons, hash, length, truth and iteration raise."""

    def _refuse(self, *args: object) -> Any:
        raise RuntimeError("refused")

    __eq__ = __ne__ = __lt__ = __hash__ = __len__ = __bool__ = __iter__ = _refuse


def _generator() -> Iterator[int]:
    yield 1


@pytest.mark.parametrize(
    "payloads",
    [
        [Hostile(), Hostile()],
        [np.zeros((2, 2)), np.ones(3)],
        [None, (1, (2, (3,))), _generator()],
        list(range(10_000)),
    ],
    ids=["hostile", "numpy", "odd", "10k"],
)
def test_odd_payloads_read_alike(payloads: list[Any]) -> None:
    """Payloads that refuse comparison, hashing and truth, numpy arrays, generators and 10,000
    items are stored, counted and read alike on both paths, each payload by identity."""
    lazy_buf, eager_buf = _buffer(val=True), _buffer(val=True)
    lazy_keys = lazy_buf.put_group_nowait("g", payloads, global_steps=0)
    eager_keys = eager_buf.put_group_nowait(
        "g", payloads, global_steps=0, session_ids=list(range(len(payloads)))
    )
    assert lazy_keys == eager_keys
    assert lazy_buf.stats() == eager_buf.stats()
    (lazy_batch, _), (eager_batch, _) = sample_now(lazy_buf, 0, 1), sample_now(eager_buf, 0, 1)
    for batch in (lazy_batch, eager_batch):
        assert all(a is b for a, b in zip(batch.payloads, payloads, strict=True))
        assert batch.keys == eager_keys
        (group,) = batch.groups
        assert [t.key for t in group.trajectories] == eager_keys
        assert all(t.payload is p for t, p in zip(group.trajectories, payloads, strict=True))
        assert group.trajectories in group
        assert group.index(group.trajectories) == 5
    if len(payloads) < 10:
        lazy, eager = lazy_batch.groups[0], eager_batch.groups[0]
        assert repr(lazy.replace(generation_seconds=0.0)) == repr(eager.replace(generation_seconds=0.0))


# -- whole-buffer differential: the same calls with lazily and eagerly stored groups ----------


def _view(group: Group) -> tuple[Any, ...]:
    records = [
        (t.key, t.session_id, t.index, dict(t.tags), t.tags is EMPTY_TAGS, t.payload)
        for t in group.trajectories
    ]
    fields = (group.uid, group.partition, group.dispatch_step, group.status, dict(group.tags))
    return (*fields, records, group.finish_step)


def _batch_view(batch: Batch) -> tuple[Any, ...]:
    return (
        batch.partition,
        batch.global_steps,
        [_view(group) for group in batch.groups],
        batch.keys,
        [(dict(tags), tags is EMPTY_TAGS) for tags in batch.tags],
        batch.payloads,
        batch.uids,
        batch.staleness.tolist(),
    )


def _untimed(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics without the wall-clock ones (the general path times put_group)."""
    return {k: v for k, v in metrics.items() if "seconds" not in k}


def _run(seed: int, eager: bool, config: dict[str, Any], tmp_path: Path) -> list[Any]:
    rng = random.Random(seed)
    log: list[Any] = []
    buf = _buffer(
        val=True,
        on_evict=lambda event: log.append(
            ("evicted", event.partition, event.reason, event.global_steps, [_view(g) for g in event.groups])
        ),
        **config,
    )
    step = 0
    for i in range(50):
        partition = rng.choice(["train", "train", "val"])
        if rng.random() < 0.65:
            payloads = [rng.randint(0, 9) for _ in range(rng.randint(0, 4))]
            steps = rng.choice([None, max(0, step + rng.randint(-3, 2))])
            ids: dict[str, Any] = {"session_ids": list(range(len(payloads)))} if eager else {}
            try:
                log.append(
                    buf.put_group_nowait(f"u{i}", payloads, global_steps=steps, partition=partition, **ids)
                )
            except StalebufError as exc:
                log.append(type(exc))
        else:
            step += rng.randint(0, 2)
            try:
                batch, metrics = buf.sample_nowait(step, rng.randint(1, 3), partition=partition)
                log.append((_batch_view(batch), _untimed(metrics)))
            except StalebufError as exc:
                log.append(type(exc))
        log.append(buf.stats())
    resident = {uid: _view(group) for uid, group in stored_groups(buf).items()}
    for uid in list(stored_groups(buf))[::2]:  # some groups read before saving, some not
        stored_groups(buf)[uid].trajectories  # noqa: B018 - builds them
    codec = (lambda p: json.dumps(p).encode(), json.loads)
    for name, payload_codec in (("pickled", None), ("codec", codec)):
        path = tmp_path / f"{name}-{seed}-{eager}"

        async def save(path: Path = path, payload_codec: Any = payload_codec) -> None:
            with anyio.fail_after(LIMIT):
                await buf.save(path, payload_codec=payload_codec)

        anyio.run(save)
        restored = ReplayBuffer.restore(path, payload_codec=payload_codec).buffer
        assert {uid: _view(group) for uid, group in stored_groups(restored).items()} == resident
        assert restored.stats() == buf.stats()
    log.append(resident)
    return log


@pytest.mark.parametrize(
    ("config", "evicts"),
    [
        ({}, False),
        ({"max_off_policy_threshold": 1}, True),
        ({"max_off_policy_threshold": 2, "admission_batch_size": 2}, False),
        ({"max_off_policy_strategy": "wait", "max_off_policy_threshold": 1}, False),
        ({"failure_strategy": "evict", "max_off_policy_threshold": 1, "evict_stale_in_flight": True}, True),
    ],
    ids=["default", "drop", "admission", "wait", "evict"],
)
def test_a_buffer_of_lazy_groups_behaves_as_one_of_eager_groups(
    config: dict[str, Any], evicts: bool, tmp_path: Path
) -> None:
    """Puts, samples (batch views, metrics), stats, evictions (on_evict), and save/restore with
    and without a codec, some groups read before saving: the same calls, the same answers."""
    logs = []
    for seed in range(4):
        lazy_log = _run(seed, False, config, tmp_path)
        assert lazy_log == _run(seed, True, config, tmp_path)
        logs.extend(lazy_log)
    assert any(type(entry) is tuple and len(entry) == 2 for entry in logs)  # it sampled
    if evicts:  # on_evict was exercised
        assert any(type(entry) is tuple and entry[0] == "evicted" for entry in logs)
