"""The journal's change log on the event loop: what changed since the last hand-off to the
writer thread, recorded in O(1) per change (a dict entry or a small tuple appended).

The store tells it each change as it makes it (it is the one writer of groups); the journal
(``_journal.py``) takes the log at each commit. Groups are named by ``gid``, the journal's id of
one incarnation of a uid (a uid sampled and added again is a new incarnation, a new row).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import compress, repeat
from operator import attrgetter
from time import monotonic
from typing import Any

__all__ = [
    "ADMIT",
    "CONSUMER_REASONS",
    "LEFT",
    "MARK",
    "SAMPLE",
    "ChangeLog",
]

#: Event kinds: ``(ADMIT, seq, gid, uid, partition)``, ``(LEFT, seq, gids, reason, records or
#: None)`` (the groups of one removal, numbered ``seq, seq + 1, ...``; ``records[i]``, when
#: ``records`` is not None, is the record of ``gids[i]`` the journal has not yet written, or None),
#: ``(SAMPLE, seq, partition, step, state)``, ``(MARK, seq, step)``.
ADMIT, LEFT, SAMPLE, MARK = 0, 1, 2, 3
#: Why groups leave because of a ``sample`` (undone when recovering at an earlier step); every
#: other reason ("filtered", "restart") is the producers' side, kept by a recovery.
CONSUMER_REASONS = frozenset(("sampled", "stale", "failure", "in_flight"))
#: Removals whose records the journal keeps: the consumers' (a recovery may bring them back) and
#: the filters' (a recovery lists the groups filtered after its point in ``kept``).
_RECORDED = CONSUMER_REASONS | {"filtered"}
_uid_of = attrgetter("uid")
_WRITTEN = object()  # what ``dirty.pop`` gives for a group the journal has written since it changed


class ChangeLog:
    """Groups changed and events since the last :meth:`take`, in the order they happened.

    Attributes (read them; change them only through the methods):
        live: the gid of every resident group, by uid.
        dirty: uids of resident groups changed since the last take (their content is read then).
        events: admissions, removals, samples and marks since the last take, in order.
        seq: the number of the last event (the journal's position).
        next_gid: the gid the next admitted group gets.
        since: when the oldest change not yet taken was made (monotonic), or None.
        armed: whether a commit is scheduled for them.
    """

    __slots__ = ("armed", "dirty", "events", "live", "next_gid", "on_first_change", "seq", "since")

    def __init__(self, next_gid: int, seq: int, on_first_change: Callable[[], object]) -> None:
        self.live: dict[str, int] = {}
        self.dirty: dict[str, None] = {}
        self.events: list[tuple[Any, ...]] = []
        self.next_gid = next_gid
        self.seq = seq
        self.since: float | None = None
        self.armed = False  # a commit is scheduled for the changes not yet taken
        self.on_first_change = on_first_change  # the journal arms its commit timer

    def seed(self, live: dict[str, int]) -> None:
        """Take over the gids of a recovered buffer's groups (before any change)."""
        self.live.update(live)

    def _first(self) -> None:
        if self.since is None:
            self.since = monotonic()
        self.armed = True
        self.on_first_change()

    def disarm(self) -> None:
        """Forget that a commit is scheduled (the loop that would run it has ended): the next
        change schedules one again."""
        self.armed = False

    def admitted(self, uid: str, partition: str) -> None:
        """Record a new group ``uid`` (a new incarnation, whatever it held before)."""
        gid = self.next_gid
        self.next_gid = gid + 1
        self.live[uid] = gid
        seq = self.seq = self.seq + 1
        self.events.append((ADMIT, seq, gid, uid, partition))
        self.dirty[uid] = None
        if not self.armed:
            self._first()

    def changed(self, uid: str) -> None:
        """Record that the resident group ``uid`` changed (its content is read at the next take)."""
        self.dirty[uid] = None
        if not self.armed:
            self._first()

    def left(self, groups: Iterable[Any], reason: str, uids: list[str] | None = None) -> None:
        """Record that ``groups`` (records, or in-flight groups for a producer-side reason) left
        for ``reason``; a consumer-side removal keeps the record of a group whose content the
        journal has not yet written (a recovery at an earlier step brings it back). ``uids``:
        theirs, if the caller has them already.

        One event for the call (a batch of 64 leaves in C-level passes, not 64 appends): its
        groups get the event numbers ``seq, seq + 1, ...`` in order."""
        if type(groups) is not list:
            groups = list(groups)
        live, dirty = self.live, self.dirty
        if uids is None:
            uids = list(map(_uid_of, groups))
        count = len(live)
        gids = list(map(live.pop, uids, repeat(None)))
        if count - len(live) != len(gids):
            # Some were never journaled (a restore evicting what it did not put back): skipped.
            journaled = [gid is not None for gid in gids]
            groups, uids = list(compress(groups, journaled)), list(compress(uids, journaled))
            gids = list(compress(gids, journaled))
        if gids and not dirty:  # all written (right after a hand-off): no pass over dirty
            self.events.append((LEFT, self.seq + 1, gids, reason, None))
            self.seq += len(gids)
        elif gids:
            count = len(dirty)
            # dirty.pop gives None (its value) for a group changed since the journal wrote it,
            # and each of those shrinks ``dirty``: counting them needs no pass over the list.
            written = list(map(dirty.pop, uids, repeat(_WRITTEN)))
            unwritten = count - len(dirty)
            records = None
            if unwritten and reason in _RECORDED:
                if unwritten == len(groups):  # (a copy: the caller's list is the batch's)
                    records = list(groups)
                else:
                    records = [None if w is _WRITTEN else g for g, w in zip(groups, written, strict=True)]
            self.events.append((LEFT, self.seq + 1, gids, reason, records))
            self.seq += len(gids)
        if not self.armed:
            self._first()

    def filtered_at_once(self, record: Any) -> None:
        """Record a group admitted and filtered in one call (never resident), with its record."""
        self.admitted(record.uid, record.partition)
        self.left([record], "filtered")

    def sampled(self, partition: str, step: int, state: Any) -> None:
        """Record a ``sample`` on ``partition`` at ``step`` that returned a batch, and the state
        (all but the groups) right after it."""
        seq = self.seq = self.seq + 1
        self.events.append((SAMPLE, seq, partition, step, state))
        if not self.armed:
            self._first()

    def touched(self) -> None:
        """Record that the state beyond the groups changed (a clock a sample moved): the next
        commit takes it."""
        if not self.armed:
            self._first()

    def marked(self, step: int) -> None:
        """Record the trainer's mark: its state at ``step`` is durable."""
        seq = self.seq = self.seq + 1
        self.events.append((MARK, seq, step))
        if not self.armed:
            self._first()

    def take(self) -> tuple[list[str], list[tuple[Any, ...]], float | None]:
        """Return and forget what changed: the dirty uids, the events and when the oldest was made."""
        dirty, events, since = list(self.dirty), self.events, self.since
        self.dirty.clear()
        self.events = []
        self.since = None
        self.armed = False
        return dirty, events, since
