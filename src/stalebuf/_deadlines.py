"""Group deadlines: a straggler is cut when a ``sample`` evaluates its partition, on time.

No background task: a ``sample`` cuts every in-flight group of its partition that is past its
deadline before it evaluates, and a ``sample`` that must wait parks with a timer until the
earliest deadline (see ``_consumer.py``), so it wakes and cuts exactly then. Deadlines are
measured on ``time.monotonic()`` from each group's admission (or from the restore that kept or
reissued it). The rules (the deadline, what a cut group becomes) are the policy's; the groups
are the store's.
"""

from __future__ import annotations

from time import monotonic

from ._admission import Admission
from ._filtering import Filtering
from ._group_snapshots import cut_record
from ._open_group import OpenGroup
from ._partition import PartitionState
from ._rules import Rules
from ._store import GroupStore
from .records import EvictionEvent, Group, Status

_FINISHED = Status.FINISHED

__all__ = ["Deadlines"]


class Deadlines:
    """Cuts the stragglers of a buffer's partitions (it owns no state of its own)."""

    __slots__ = ("admission", "filtering", "rules", "store")

    def __init__(self, store: GroupStore, admission: Admission, rules: Rules, filtering: Filtering) -> None:
        self.store = store
        self.admission = admission
        self.rules = rules
        self.filtering = filtering

    def next_cut(self, part: PartitionState) -> float | None:
        """When (``monotonic()``) the first in-flight group of ``part`` reaches its deadline, or
        None: no in-flight group, or no deadline now.

        Raises:
            StalebufError, Exception: the policy's ``group_deadline`` answered nonsense or raised.
        """
        if part.cells is not None:  # a task mixture: its cells hold the groups
            cuts = [cut for cut in map(self.next_cut, part.cells.values()) if cut is not None]
            return min(cuts, default=None)
        first = part.first_started() if part.deadlines else None
        if first is None:
            return None
        seconds = self.rules.deadline(part)
        return None if seconds is None else first.started_at + seconds

    def cut_overdue(self, part: PartitionState) -> int:
        """Cut every in-flight group of ``part`` past its deadline now; return how many.

        The policy is asked about every overdue group before the first is cut, so a hook that
        raises cuts nothing.

        Raises:
            StalebufError, Exception: a policy hook answered nonsense or raised.
        """
        if part.cells is not None:  # a task mixture: its cells hold the groups
            return sum(map(self.cut_overdue, part.cells.values()))
        if not part.deadlines or not part.starts:
            return 0
        first = part.first_started()
        if first is None:
            return 0
        seconds = self.rules.deadline(part)
        if seconds is None:
            return 0
        now = monotonic()
        if first.started_at + seconds > now:
            return 0
        overdue = _overdue(part, now - seconds)
        outcomes: list[tuple[OpenGroup, Status]] = [
            (group, self.rules.cut_status(part, len(group.trajectories))) for group in overdue
        ]
        clock = self.admission.clocks.get(part.name, 0)
        filtered: list[Group] = []
        for group, status in outcomes:
            self._cut(part, group, status, clock, seconds, filtered)
        if filtered or part.ledger is not None:  # slots freed, or reservations settled (refunds)
            self.admission.wake(part.name)
        if filtered:
            self.filtering.report(EvictionEvent(part.name, "filtered", tuple(filtered), clock))
        return len(outcomes)

    def _cut(
        self,
        part: PartitionState,
        group: OpenGroup,
        status: Status,
        clock: int,
        seconds: float,
        filtered: list[Group],
    ) -> None:
        """Cut ``group`` (a group that finishes is filtered first; one a filter ended itself,
        or an earlier cut's filter did, is left alone)."""
        store, filtering = self.store, self.filtering
        if store.groups.get(group.uid) is not group:
            return
        if status is not _FINISHED or not filtering.applies(part):
            store.cut(group, status, clock, seconds)
            return
        record = cut_record(group, status, clock)
        keep = filtering.keeps(part, record)
        if store.groups.get(group.uid) is not group:
            return
        if keep:
            store.cut(group, status, clock, seconds, record)
        else:
            store.cut_filtered(group, seconds)
            filtered.append(record)


def _overdue(part: PartitionState, started_before: float) -> list[OpenGroup]:
    """The in-flight groups of ``part`` whose deadline clock started at or before
    ``started_before``, oldest first (read from the heap without changing it).

    Only the heap's entries that started by then are visited, with their children: they form a
    subtree at its root (a heap's children never start earlier), so finding k overdue groups
    costs O(k log k) however many groups are in flight.
    """
    starts, in_flight = part.starts, part.in_flight.groups
    size = len(starts)
    found = []
    pending = [0] if size else []
    while pending:
        index = pending.pop()
        entry = starts[index]
        if entry[0] <= started_before:
            found.append(entry)
            child = 2 * index + 1
            pending.extend(range(child, min(child + 2, size)))
    found.sort()
    groups = []
    for _, _, group in found:
        at_step = in_flight.get(group.head)
        if at_step is not None and at_step.get(group.uid) is group:
            groups.append(group)
    return groups
