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
#: None)`` (the groups of one removal, numbered ``seq, seq + 1, ...``; as recorded it names uids
#: and candidate records, :meth:`ChangeLog.take` resolves them: then ``records[i]``, when
#: ``records`` is not None, is the record of ``gids[i]`` the journal may lack, or None),
#: ``(SAMPLE, seq, partition, step, state)``, ``(MARK, seq, step)``.
ADMIT, LEFT, SAMPLE, MARK = 0, 1, 2, 3
#: Why groups leave because of a ``sample`` (undone when recovering at an earlier step); every
#: other reason ("filtered", "restart") is the producers' side, kept by a recovery.
CONSUMER_REASONS = frozenset(("sampled", "stale", "failure", "in_flight"))
#: Removals whose records the journal keeps: the consumers' (a recovery may bring them back) and
#: the filters' (a recovery lists the groups filtered after its point in ``kept``).
_RECORDED = CONSUMER_REASONS | {"filtered"}
_uid_of = attrgetter("uid")


def _always() -> bool:
    return True


class ChangeLog:
    """Groups changed and events since the last :meth:`take`, in the order they happened.

    Attributes (read them; change them only through the methods):
        live: the gid of every resident group, by uid, as of the last take (or seed).
        dirty: uids of resident groups changed since the last take (their content is read then).
        events: admissions, removals, samples and marks since the last take, in order.
        seq: the number of the last event (the journal's position).
        next_gid: the gid the next admitted group gets.
        since: when the oldest change not yet taken was made (monotonic), or None.
        armed: whether a commit is scheduled for them.
        alive: whether the event loop that commit runs on still runs (set by the journal).
    """

    __slots__ = ("alive", "armed", "dirty", "events", "live", "next_gid", "on_first_change", "seq", "since")

    def __init__(self, next_gid: int, seq: int, on_first_change: Callable[[], object]) -> None:
        self.live: dict[str, int] = {}
        self.dirty: dict[str, None] = {}
        self.events: list[tuple[Any, ...]] = []
        self.next_gid = next_gid
        self.seq = seq
        self.since: float | None = None
        self.armed = False  # a commit is scheduled for the changes not yet taken
        # A commit scheduled on a loop that has ended since (``asyncio.run`` twice) never runs: a
        # change then schedules one again, on its own loop.
        self.alive: Callable[[], bool] = _always
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
        seq = self.seq = self.seq + 1
        self.events.append((ADMIT, seq, gid, uid, partition))
        self.dirty[uid] = None
        if not self.armed or not self.alive():
            self._first()

    def changed(self, uid: str) -> None:
        """Record that the resident group ``uid`` changed (its content is read at the next take)."""
        self.dirty[uid] = None
        if not self.armed or not self.alive():
            self._first()

    def left(self, groups: Iterable[Any], reason: str, uids: list[str] | None = None) -> None:
        """Record that ``groups`` (records, or in-flight groups for a producer-side reason) left
        for ``reason``; ``uids``: theirs, if the caller has them already (a list it keeps as is).

        One event for the call, its groups numbered ``seq + 1, seq + 2, ...`` in order. Which
        incarnation (gid) each was, and whether the journal still lacks its content (then a
        consumer-side or filter removal keeps its record: a recovery may bring it back or list
        it), is decided at :meth:`take`, off a ``sample``'s path: here it is O(1) but a copy."""
        if type(groups) is not list:
            groups = list(groups)
        if uids is None:
            uids = list(map(_uid_of, groups))
        # A copy: the caller's list may be the batch's, which the trainer owns.
        records = groups.copy() if reason in _RECORDED else None
        self.events.append((LEFT, self.seq + 1, uids, reason, records))
        self.seq += len(uids)
        if not self.armed or not self.alive():
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
        if not self.armed or not self.alive():
            self._first()

    def touched(self) -> None:
        """Record that the state beyond the groups changed (a clock a sample moved): the next
        commit takes it."""
        if not self.armed or not self.alive():
            self._first()

    def marked(self, step: int) -> None:
        """Record the trainer's mark: its state at ``step`` is durable."""
        seq = self.seq = self.seq + 1
        self.events.append((MARK, seq, step))
        if not self.armed or not self.alive():
            self._first()

    def take(self) -> tuple[list[str], list[tuple[Any, ...]], float | None]:
        """Return and forget what changed: the dirty uids, the events (removals resolved to
        gids) and when the oldest was made; ``live`` then names every resident group's gid."""
        live, dirty, events = self.live, self.dirty, self.events
        for i, event in enumerate(events):  # replayed in order: a uid may leave and come back
            kind = event[0]
            if kind == ADMIT:
                live[event[3]] = event[2]
            elif kind == LEFT:
                events[i] = _resolved(event, live, dirty)
        taken, since = list(dirty), self.since
        dirty.clear()
        self.events = []
        self.since = None
        self.armed = False
        return taken, events, since


def _resolved(event: tuple[Any, ...], live: dict[str, int], dirty: dict[str, None]) -> tuple[Any, ...]:
    """A removal as the writer takes it: ``(LEFT, first, gids, reason, records or None)``, where
    ``records[i]`` is the record of ``gids[i]`` if the journal may lack its content (its uid
    changed since the last take), else None. A group without a gid (a restore evicting what it
    never put back, or a uid named twice) is skipped; the event numbers keep their gaps."""
    kind, first, uids, reason, records = event
    gids = list(map(live.pop, uids, repeat(None)))
    if None in gids:
        journaled = [gid is not None for gid in gids]
        uids, gids = list(compress(uids, journaled)), list(compress(gids, journaled))
        if records is not None:
            records = list(compress(records, journaled))
    if records is not None:
        unwritten = list(map(dirty.__contains__, uids))
        if not any(unwritten):
            records = None
        elif not all(unwritten):
            records = [record if kept else None for record, kept in zip(records, unwritten, strict=True)]
    return (kind, first, gids, reason, records)
