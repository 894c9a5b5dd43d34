"""The journal's change log (issue 25): a removal of many groups is one event, recorded in O(1)
on the ``sample`` path and resolved at the hand-off (``take``), that must mean what one event per
group, resolved as it happened, meant. The reference below is that per-group replay: each group
that has a gid leaves ``live`` with it; a group whose uid changed since the last take keeps its
record for a consumer-side or filter reason (the journal may lack its content); a group without
a gid (a restore evicting what it never put back, or a repeat of a uid already gone) is skipped.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hypothesis import given
from hypothesis import strategies as st

from stalebuf._journal_log import ADMIT, CONSUMER_REASONS, LEFT, ChangeLog


class Removed(NamedTuple):
    """Stands for a record: the change log reads its ``uid`` only."""

    uid: str
    n: int


_KEPT = CONSUMER_REASONS | {"filtered"}


def reference(
    journaled: dict[str, int], ops: list[tuple[Any, ...]], seq: int, next_gid: int
) -> tuple[dict[str, int], list[str], list[tuple[int, int, str, Any]], list[tuple[int, int, str]], int]:
    """Replay ``ops`` one group at a time: the live gids after them, the dirty uids, one
    ``(seq, gid, reason, record or None)`` per group that left (numbered in order from its
    removal's first number, skipped groups leaving a gap at the end), the admissions, the last seq."""
    live, dirty = dict(journaled), {}
    admitted: list[tuple[int, int, str]] = []
    left: list[tuple[int, int, str, Removed]] = []
    for op in ops:
        if op[0] == "admit":
            seq, live[op[1]] = seq + 1, next_gid
            admitted.append((seq, next_gid, op[1]))
            next_gid += 1
            dirty[op[1]] = None
        elif op[0] == "change":
            dirty[op[1]] = None
        else:
            _, names, reason, n = op
            gids = [(uid, live.pop(uid, None)) for uid in names]
            journaled_gids = [(uid, gid) for uid, gid in gids if gid is not None]
            left += [
                (seq + 1 + i, gid, reason, Removed(uid, n)) for i, (uid, gid) in enumerate(journaled_gids)
            ]
            seq += len(names)
    # A uid changed at any time before the take: the journal may lack that content.
    rows = [(s, gid, reason, record if reason in _KEPT and record.uid in dirty else None)
            for s, gid, reason, record in left]  # fmt: skip
    return live, list(dirty), rows, admitted, seq


def expanded(
    events: list[tuple[Any, ...]],
) -> tuple[list[tuple[int, int, str, Any]], list[tuple[int, int, str]]]:
    """The log's LEFT events, one row per group, and its ADMIT events."""
    rows, admitted = [], []
    for event in events:
        if event[0] == ADMIT:
            admitted.append((event[1], event[2], event[3]))
            continue
        kind, first, gids, reason, records = event
        assert kind == LEFT
        assert records is None or (len(records) == len(gids) and any(r is not None for r in records))
        for i, gid in enumerate(gids):
            rows.append((first + i, gid, reason, None if records is None else records[i]))
    return rows, admitted


uids = st.sampled_from([f"u{i}" for i in range(12)])
reasons = st.sampled_from(["sampled", "stale", "failure", "in_flight", "filtered", "restart"])
operations = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), uids),
        st.tuples(st.just("change"), uids),
        # may repeat a uid, or name one without a gid; arrives as a tuple or a list
        st.tuples(st.just("left"), st.lists(uids, max_size=10), reasons, st.booleans()),
    ),
    max_size=12,
)


@given(journaled=st.dictionaries(uids, st.integers(0, 1000)), ops=operations)
def test_a_batch_removal_means_one_removal_per_group(
    journaled: dict[str, int], ops: list[tuple[Any, ...]]
) -> None:
    log = ChangeLog(next_gid=2000, seq=7, on_first_change=lambda: None)
    log.seed(journaled)
    replayed: list[tuple[Any, ...]] = []
    for n, op in enumerate(ops):
        if op[0] == "admit":
            log.admitted(op[1], "train")
            replayed.append(op)
        elif op[0] == "change":
            log.changed(op[1])
            replayed.append(op)
        else:
            _, names, reason, as_tuple = op
            groups = [Removed(uid, n) for uid in names]
            log.left(tuple(groups) if as_tuple else groups, reason)
            if not as_tuple:
                groups.clear()  # the caller's list changing afterwards changes nothing recorded
            replayed.append(("left", names, reason, n))
    live, dirty, rows, admitted, seq = reference(journaled, replayed, 7, 2000)
    assert log.seq == seq
    assert log.armed or not ops
    taken, events, _ = log.take()
    assert expanded(events) == (rows, admitted)
    assert sorted(taken) == sorted(dirty)
    assert log.live == live
    assert not log.dirty
    assert not log.events
    assert not log.armed


def test_a_group_changed_before_it_left_keeps_its_record() -> None:
    """The content the journal may lack is never lost: a sampled group changed since the last
    take keeps its record, even when its uid comes back (a new incarnation) before the take."""
    log = ChangeLog(next_gid=1, seq=0, on_first_change=lambda: None)
    log.seed({"a": 0, "b": 5})
    log.changed("a")
    log.left([Removed("a", 0), Removed("b", 0)], "sampled")
    log.admitted("a", "train")
    _, events, _ = log.take()
    assert events == [(LEFT, 1, [0, 5], "sampled", [Removed("a", 0), None]), (ADMIT, 3, 1, "a", "train")]
    assert log.live == {"a": 1}
