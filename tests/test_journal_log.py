"""The journal's change log (issue 25): a removal of many groups is one event, recorded by C-level
passes, that must mean what one event per group meant. The reference below is the per-group
loop: each group that has a gid gets the next event number and leaves ``live``; a group changed
since the journal last wrote it leaves ``dirty``, and for a consumer-side reason its record is
kept; a group without a gid (a restore evicting what it never put back), or a repeat of a uid
already gone, is skipped.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hypothesis import given
from hypothesis import strategies as st

from stalebuf._journal_log import CONSUMER_REASONS, LEFT, ChangeLog


class Removed(NamedTuple):
    """Stands for a record: the change log reads its ``uid`` only."""

    uid: str
    n: int


def reference_left(
    live: dict[str, int], dirty: dict[str, None], seq: int, groups: list[Removed], reason: str
) -> tuple[list[tuple[int, int, str, Any]], int]:
    """One ``(seq, gid, reason, record or None)`` per group that left, and the last seq."""
    rows = []
    for group in groups:
        gid = live.pop(group.uid, None)
        if gid is None:
            continue
        seq += 1
        unwritten = group.uid in dirty
        if unwritten:
            del dirty[group.uid]
        # A consumer's removal keeps its record (a recovery may bring it back), and so does a
        # filter's (a recovery lists it in ``kept``).
        kept = reason in CONSUMER_REASONS or reason == "filtered"
        rows.append((seq, gid, reason, group if kept and unwritten else None))
    return rows, seq


def expanded(events: list[tuple[Any, ...]]) -> list[tuple[int, int, str, Any]]:
    """The log's LEFT events, one row per group."""
    rows = []
    for kind, first, gids, reason, records in events:
        assert kind == LEFT
        assert records is None or len(records) == len(gids)
        for i, gid in enumerate(gids):
            rows.append((first + i, gid, reason, None if records is None else records[i]))
    return rows


uids = st.sampled_from([f"u{i}" for i in range(12)])
removals = st.lists(
    st.tuples(
        st.lists(uids, max_size=10),  # may repeat a uid, or name one without a gid
        st.sampled_from(["sampled", "stale", "failure", "in_flight", "filtered", "restart"]),
        st.booleans(),  # whether it arrives as a tuple (the log must not keep the caller's list)
    ),
    max_size=6,
)


@given(
    journaled=st.dictionaries(uids, st.integers(0, 1000)),
    changed=st.sets(uids),
    steps=removals,
)
def test_a_batch_removal_means_one_removal_per_group(
    journaled: dict[str, int], changed: set[str], steps: list[tuple[list[str], str, bool]]
) -> None:
    log = ChangeLog(next_gid=0, seq=7, on_first_change=lambda: None)
    log.seed(journaled)
    for uid in sorted(changed):
        log.dirty[uid] = None  # as a change since the last hand-off leaves it
    live, dirty, seq = dict(journaled), dict.fromkeys(sorted(changed)), 7
    want: list[tuple[int, int, str, Any]] = []
    for n, (names, reason, as_tuple) in enumerate(steps):
        groups = [Removed(uid, n) for uid in names]
        rows, seq = reference_left(live, dirty, seq, groups, reason)
        want += rows
        given_groups: Any = tuple(groups) if as_tuple else groups
        log.left(given_groups, reason)
        if not as_tuple:
            groups.clear()  # the caller's list changing afterwards changes nothing recorded
        assert log.live == live
        assert log.dirty == dirty
        assert log.seq == seq
    assert expanded(log.events) == want
    assert log.armed or not steps
