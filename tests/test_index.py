"""The per-partition index under adversarial orders, against a list-based reference model.

Out-of-order finishing into partly taken buckets, steps emptied and re-added, arbitrary
subsets taken (a custom ``_select``), drop prefixes and the lazily cleaned in-flight heap:
after every operation the index must agree with a sorted list. These tests drive the index
data structure directly (imported through ``_helpers``), not the buffer.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _helpers import OpenGroup, PartitionState
from stalebuf import ReplayBuffer, SamplerConfig, Status
from stalebuf.records import EMPTY_TAGS, Group, new_group, new_trajectory


def check_bucket(bucket: Any) -> None:
    """A bucket's own invariants: parallel lists, spent slots cleared, the merge in order."""
    head, seqs, members, late = bucket.head, bucket.seqs, bucket.members, bucket.late
    assert len(seqs) == len(members)
    assert 0 <= head < len(seqs)
    assert all(group is None for group in members[:head])  # taken groups are not kept alive
    assert all(isinstance(group, Group) for group in members[head:])
    assert list(seqs[head:]) == sorted(set(seqs[head:]))
    assert late is None or late  # no empty heap left behind
    late = late or []
    assert all(late[(i - 1) // 2][0] < late[i][0] for i in range(1, len(late)))  # a heap
    assert not {seq for seq, _ in late} & set(seqs[head:])
    entries = bucket.live_entries()
    assert [seq for seq, _ in entries] == sorted({seq for seq, _ in entries})
    assert len(entries) == len(bucket) == len(seqs) - head + len(late)
    assert [g for _, g in entries] == bucket.groups() == list(bucket.iter_groups())


class IndexModel:
    """A PartitionState with a list-based reference model next to it, checked after each step."""

    def __init__(self, evict_failures: bool) -> None:
        self.part = PartitionState("train", exempt=False, evict_failures=evict_failures)
        self.evict_failures = evict_failures
        self.next_seq = 0
        self.open: dict[int, OpenGroup] = {}  # seq -> in-flight group
        self.ready: list[tuple[int, int, Any]] = []  # (step, seq, group)
        self.failed: list[tuple[int, int, Any]] = []
        self.sampled = self.evicted_stale = self.evicted_failure = 0
        self.sampled_trajectories = 0

    # operations

    def admit(self, step: int) -> None:
        seq = self.next_seq
        self.next_seq += 1
        group = OpenGroup(f"u{seq}", self.part, step, seq, EMPTY_TAGS, 0.0)
        self.part.admit(group)
        self.open[seq] = group

    def start(self, pick: int) -> None:
        pending = [g for g in self.open.values() if g.status is Status.PENDING]
        if pending:
            group = pending[pick % len(pending)]
            group.status = Status.RUNNING
            self.part.start()

    def terminate(self, pick: int, n: int, failed: bool) -> None:
        if not self.open:
            return
        seqs = sorted(self.open)
        group = self.open.pop(seqs[pick % len(seqs)])  # any order: out-of-order finishing
        for i in range(n):
            key = f"{group.uid}_{i}_0"
            group.trajectories[key] = new_trajectory(key, i, 0, EMPTY_TAGS, None)
        self.part.add_trajectories(n)
        status = Status.FAILURE if failed else Status.FINISHED
        record = new_group(
            group.uid,
            "train",
            group.global_steps,
            status,
            EMPTY_TAGS,
            tuple(group.trajectories.values()),
            group.global_steps,
            0.0,
        )
        self.part.terminate(group, record)
        entry = (group.global_steps, group.seq, record)
        (self.failed if failed and self.evict_failures else self.ready).append(entry)

    def take_oldest(self, count: int) -> None:
        if not self.ready:
            return
        count = 1 + count % len(self.ready)
        self.ready.sort(key=lambda e: (e[0], e[1]))
        expected, self.ready = self.ready[:count], self.ready[count:]
        got = self.part.take_sampled(None, count)
        assert [g.uid for g in got] == [e[2].uid for e in expected]
        self.sampled += count
        self.sampled_trajectories += sum(len(e[2].trajectories) for e in expected)

    def take_subset(self, picks: list[int]) -> None:
        if not self.ready:
            return
        chosen = []
        for pick in picks:
            entry = self.ready[pick % len(self.ready)]
            if entry not in chosen:
                chosen.append(entry)
        for entry in chosen:
            self.ready.remove(entry)
        self.part.take_sampled(
            [e[2] for e in chosen], len(chosen)
        )  # any subset, any order (a custom _select)
        self.sampled += len(chosen)
        self.sampled_trajectories += sum(len(e[2].trajectories) for e in chosen)

    def take_stale(self, cutoff: int) -> None:
        expected = sorted((e for e in self.ready if e[0] < cutoff), key=lambda e: (e[0], e[1]))
        self.ready = [e for e in self.ready if e[0] >= cutoff]
        got = self.part.take_stale(self.part.ready.stale_steps(lambda step: step < cutoff), [])
        assert [g.uid for g in got] == [e[2].uid for e in expected]
        self.evicted_stale += len(expected)

    def take_failed(self) -> None:
        expected = sorted(self.failed, key=lambda e: (e[0], e[1]))
        self.failed = []
        got = self.part.take_failed()
        assert [g.uid for g in got] == [e[2].uid for e in expected]
        self.evicted_failure += len(expected)

    # checks

    def check(self) -> None:
        part = self.part
        order = sorted(self.ready, key=lambda e: (e[0], e[1]))
        assert [g.uid for g in part.ready.iter_groups()] == [e[2].uid for e in order]
        assert part.ready.count == len(order)
        assert (part.ready.steps[0] if part.ready.steps else None) == (order[0][0] if order else None)
        in_flight_steps = [g.global_steps for g in self.open.values()]
        assert part.in_flight.oldest() == (min(in_flight_steps) if in_flight_steps else None)
        assert list(part.ready.steps_in_order()) == sorted(part.ready.buckets)
        assert sorted(part.ready.steps) == sorted(part.ready.buckets)  # one heap entry per bucket
        for cutoff in range(-1, 7):
            assert part.ready.count_fresh(lambda step, c=cutoff: step < c) == sum(
                1 for e in order if e[0] >= cutoff
            )
            below = part.ready.steps_before(cutoff)  # the default rule's walk, no predicate
            assert below == part.ready.stale_steps(lambda step, c=cutoff: step < c)
            assert below == sorted(step for step in part.ready.buckets if step < cutoff)
        assert {-key for key in part.ready.newest} >= set(part.ready.buckets)  # lazily cleaned
        seq_of = {id(e[2]): e[1] for e in self.ready}
        for step, bucket in part.ready.buckets.items():
            check_bucket(bucket)
            entries = bucket.live_entries()
            assert entries, f"empty bucket left for step {step}"
            assert all(group.global_steps == step and seq_of[id(group)] == seq for seq, group in entries)
        pending = sum(1 for g in self.open.values() if g.status is Status.PENDING)
        assert (part.pending, part.running) == (pending, len(self.open) - pending)
        resident = self.ready + self.failed
        assert part.finished == sum(1 for e in resident if e[2].status is Status.FINISHED)
        assert part.failure == sum(1 for e in resident if e[2].status is Status.FAILURE)
        assert part.sampled_groups == self.sampled
        assert part.sampled_trajectories == self.sampled_trajectories
        assert part.evicted_stale_groups == self.evicted_stale
        assert part.evicted_failure_groups == self.evicted_failure
        assert part.admitted_groups == (
            len(self.open) + len(resident) + self.sampled + self.evicted_stale + self.evicted_failure
        )
        assert part.admitted_trajectories == (
            part.trajectories
            + part.sampled_trajectories
            + part.evicted_stale_trajectories
            + part.evicted_failure_trajectories
        )


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 5)),
        st.tuples(st.just("admit"), st.integers(0, 1)),  # big buckets at a few steps
        st.tuples(st.just("start"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.integers(0, 2)),
        st.tuples(st.just("fail"), st.integers(0, 50), st.integers(0, 2)),
        st.tuples(st.just("take_oldest"), st.integers(0, 50)),
        st.tuples(st.just("take_oldest"), st.integers(0, 2)),  # partial takes: spent slots
        st.tuples(st.just("take_subset"), st.lists(st.integers(0, 50), min_size=1, max_size=4)),
        st.tuples(st.just("take_stale"), st.integers(0, 6)),
        st.tuples(st.just("take_failed")),
        st.tuples(st.just("cycle"), st.integers(0, 40)),  # a step admitted and ended at once
    ),
    min_size=30,  # long programs: partly taken buckets need history
    max_size=150,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, evict_failures=st.booleans())
def test_partition_index_matches_a_list_model_under_adversarial_orders(
    ops: list[tuple[Any, ...]], evict_failures: bool
) -> None:
    """Out-of-order finishing into partly taken buckets, steps emptied and re-added,
    arbitrary subsets taken (custom _select), drop prefixes, and the lazily cleaned
    in-flight heap: the index must agree with a sorted list after every operation."""
    model = IndexModel(evict_failures)
    for op in ops:
        name = op[0]
        if name == "admit":
            model.admit(op[1])
        elif name == "start":
            model.start(op[1])
        elif name in ("finish", "fail"):
            model.terminate(op[1], op[2], failed=name == "fail")
        elif name == "take_oldest":
            model.take_oldest(op[1])
        elif name == "take_subset":
            model.take_subset(op[1])
        elif name == "take_stale":
            model.take_stale(op[1])
        elif name == "cycle":
            model.admit(op[1])
            model.terminate(len(model.open) - 1, 0, failed=False)
        else:
            model.take_failed()
        model.check()


@given(st.sets(st.integers(0, 300), max_size=120), st.integers(-1, 302))
def test_steps_before_is_every_step_below_the_cutoff_in_order(steps: set[int], cutoff: int) -> None:
    ready = _ready_index()
    for seq, step in enumerate(steps):  # set order: the heap is built in no particular order
        ready.push(step, seq, _group(f"g{seq}", step))
    assert ready.steps_before(cutoff) == sorted(step for step in steps if step < cutoff)


def test_late_finishers_land_in_order_behind_spent_slots() -> None:
    """A deterministic case of the property above: a bucket that was partly taken gets groups
    that finish out of order, some older than every live entry (they go to the bucket's heap of
    late finishers, which the order merges with its in-order list)."""
    model = IndexModel(evict_failures=False)

    def finish(seq: int) -> None:
        model.terminate(sorted(model.open).index(seq), 1, failed=False)
        model.check()

    for _ in range(12):
        model.admit(0)
    for seq in (11, 10, 9, 8, 7, 6, 5):  # newest first
        finish(seq)
    model.take_oldest(0)  # takes seq 5 of 7 entries
    model.check()
    assert model.part.ready.buckets[0].late  # 10..6 finished before 11's slot: late finishers
    for seq in (4, 0, 2):  # each older than every live entry, inserted behind the spent slot
        finish(seq)
    assert [g.uid for g in model.part.ready.iter_groups()] == [
        "u0",
        "u2",
        "u4",
        *(f"u{i}" for i in range(6, 12)),
    ]
    model.take_oldest(1)  # 2 of 9 live: still no compaction
    model.check()
    model.take_subset([3, 0])
    model.check()
    for seq in (1, 3):
        finish(seq)
    model.take_oldest(0)
    model.check()
    model.take_oldest(len(model.ready) // 2)  # takes over half
    model.check()


def test_in_flight_heap_stays_bounded_and_correct_behind_an_old_group() -> None:
    """An old group stays in flight while many later steps start and end: their heap entries
    pile up below it until the heap is rebuilt, which must keep it a valid heap."""
    model = IndexModel(evict_failures=False)
    model.admit(0)  # stays in flight throughout
    for step in range(1, 60):
        model.admit(step)  # live: steps 0 and `step`; every ended step left a heap entry
        if step > 1:
            model.terminate(1, 0, failed=False)  # ends step - 1
        model.check()
        assert len(model.part.in_flight.steps) <= 2 * 3 + 9  # rebuilt, not growing with churn
    model.terminate(0, 0, failed=False)  # step 0 ends: the oldest is now a rebuilt entry
    model.check()
    while model.open:
        model.terminate(0, 0, failed=False)
        model.check()


class Payload:
    """A trajectory payload that can be watched with a weak reference (a Group cannot)."""


def _group(uid: str, step: int, payload: object = None) -> Group:
    trajectories = (new_trajectory(f"{uid}_0_0", 0, 0, EMPTY_TAGS, payload),)
    return new_group(uid, "train", step, Status.FINISHED, EMPTY_TAGS, trajectories, step, 0.0)


def _ready_index() -> Any:
    return PartitionState("train", exempt=False, evict_failures=False).ready


def test_bucket_merges_in_order_and_late_groups_across_takes_and_compaction() -> None:
    """Groups that finish in order go to the parallel lists, the others to the late heap; every
    take returns the merge oldest first, spent slots are cleared and the lists are compacted
    once half is spent, on the in-order and the merged path, with seqs and groups aligned."""
    ready = _ready_index()
    groups = {seq: _group(f"u{seq}", 0) for seq in range(21)}
    taken: list[Group] = []

    def push(*seqs: int) -> None:
        for seq in seqs:
            ready.push(0, seq, groups[seq])
        check_bucket(ready.buckets[0])

    def take(count: int, head: int, seqs: list[int] | None = None) -> None:
        taken.extend(ready.take_oldest(count))
        bucket = ready.buckets[0]
        check_bucket(bucket)
        assert bucket.head == head
        if seqs is not None:  # just compacted
            assert list(bucket.seqs) == seqs
            assert [g.uid for g in bucket.members] == [f"u{s}" for s in seqs]
        resident = sorted(int(g.uid[1:]) for g in ready.iter_groups())
        assert taken + list(ready.iter_groups()) == [groups[seq] for seq in range(resident[-1] + 1)]

    push(0, 2, 4, 5, 6, 7, 8, 9, 1, 3)  # 1 and 3 finish late
    assert list(ready.buckets[0].seqs) == [0, 2, 4, 5, 6, 7, 8, 9]
    assert len(ready.buckets[0].late) == 2
    take(2, head=1)  # 0 from the list, 1 from the heap
    take(2, head=2)  # 2, 3: the heap is empty now
    assert ready.buckets[0].late is None
    take(1, head=3)  # 4: the in-order path, one spent slot more
    take(1, head=0, seqs=[6, 7, 8, 9])  # 5: half spent, compacted (in-order path)
    push(10, 11, 13, 14, 15, 16, 12)  # 12 late behind the compacted list
    take(7, head=0, seqs=[13, 14, 15, 16])  # 6..12: compacted on the merged path
    push(18, 17)
    take(5, head=0, seqs=[18])  # 13..16 from the list, then 17 from the heap
    push(20, 19)
    taken.extend(ready.take_oldest(3))  # the whole bucket, with a late group: 18, 19, 20
    assert taken == [groups[seq] for seq in range(21)]
    assert not ready.buckets
    assert ready.count == 0


def test_bucket_of_late_groups_only_moves_them_to_the_lists() -> None:
    """When the in-order lists run out before the late heap, the late groups, in order, become
    the lists (the bucket's lists are never empty while it holds a group)."""
    ready = _ready_index()
    groups = {seq: _group(f"u{seq}", 3) for seq in range(6)}
    for seq in (5, 4, 3, 2, 1, 0):
        ready.push(3, seq, groups[seq])
    bucket = ready.buckets[3]
    assert list(bucket.seqs) == [5]
    assert len(bucket.late) == 5
    assert ready.take_oldest(2) == [groups[0], groups[1]]
    check_bucket(bucket)
    assert ready.take_oldest(1) == [groups[2]]
    check_bucket(bucket)
    ready.take([groups[4]])  # an arbitrary subset
    check_bucket(ready.buckets[3])
    assert list(ready.iter_groups()) == [groups[3], groups[5]]


def test_taken_groups_are_freed_at_once_from_spent_slots() -> None:
    """A partial take leaves spent slots in the bucket's lists until compaction; they must not
    keep the taken groups (and their payloads) alive, on the in-order and the merged path."""
    ready = _ready_index()
    payloads = [Payload() for _ in range(12)]
    refs = [weakref.ref(p) for p in payloads]
    for seq in (*range(1, 12), 0):  # seq 0 finishes last: late
        ready.push(0, seq, _group(f"u{seq}", 0, payloads[seq]))
    del payloads
    taken = ready.take_oldest(2)  # the merged path: seq 0 from the heap, seq 1 from the list
    taken += ready.take_oldest(2)  # the in-order path
    bucket = ready.buckets[0]
    assert bucket.head == 3
    assert bucket.late is None
    check_bucket(bucket)
    del taken
    gc.collect()
    assert [ref() is None for ref in refs] == [True] * 4 + [False] * 8


def test_resident_groups_leave_no_gc_tracked_tuple_each() -> None:
    """A ready group costs no (seq, group) tuple the cyclic collector must traverse: after a
    collection (which untracks tuples of untracked items only), no tuple refers to a Group."""
    n = 10_000
    buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=10**9))
    for i in range(n):
        buf.put_group_nowait(f"g{i}", [None] * 8, global_steps=i // 256)
    gc.collect()
    tuples = sum(
        1 for obj in gc.get_objects() if type(obj) is tuple and any(isinstance(item, Group) for item in obj)
    )
    assert tuples < n // 100, f"{tuples} GC-tracked tuples refer to a Group, {n} resident groups"
