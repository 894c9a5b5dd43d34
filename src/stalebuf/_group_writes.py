"""Writing a whole group at once: the two bodies behind ``put_group``.

:meth:`GroupWriter.put_new_finished` is the common case (a new FINISHED group of default keys,
every argument already checked by the caller): the group goes straight to the ready index as
a :class:`~stalebuf._lazy_group.LazyGroup`, never in flight. :meth:`GroupWriter.put` is
everything else: it checks every argument, then adds, fills and ends the group, all or nothing.
The writer owns no state: it asks admission for a tag and the store to change.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from ._admission import Admission
from ._consumer import Consumer
from ._group_snapshots import finished_record
from ._open_group import OpenGroup
from ._partition import PartitionState
from ._store import GroupStore
from ._validation import (
    check_generation_seconds,
    check_group_payloads,
    check_partition,
    check_step,
    check_tags,
    check_uid,
    describe,
)
from ._versions import check_group_versions, check_start_version
from .errors import DuplicateGroupError, DuplicateTrajectoryError
from .records import EMPTY_TAGS, Group, Status, default_keys

__all__ = ["GroupStatus", "GroupWriter"]

#: What ``put_group(status=...)`` accepts: a terminal Status, its value, or "failed".
GroupStatus = Status | Literal["finished", "failure", "failed"]
_FINISHED, _FAILURE = Status.FINISHED, Status.FAILURE
# What ``put_group(status=...)`` accepts: a terminal Status or its value ("failed" too).
_TERMINAL: dict[object, Status] = {
    _FINISHED: _FINISHED,
    _FAILURE: _FAILURE,
    "finished": _FINISHED,
    "failure": _FAILURE,
    "failed": _FAILURE,
}


class GroupWriter:
    """The whole-group writes of one buffer (``put_group_nowait``/``put_group`` call them)."""

    __slots__ = ("admission", "consumer", "store")

    def __init__(self, store: GroupStore, admission: Admission, consumer: Consumer) -> None:
        self.store = store
        self.admission = admission
        self.consumer = consumer

    def add_prompt(self, uid: str, step: int, part: PartitionState, tags: Mapping[str, Any]) -> None:
        """Admit a new PENDING group at ``step`` (checked arguments, slot granted); a parked
        sample of a partition with deadlines sets its cut timer for it, one that evicts in
        flight evicts it if it is stale already at its step, and one under token caps hears of
        its reservation (the token-batch readiness rule asks whether the next would be refused)."""
        group = self.store.admit(uid, step, part, tags)
        if part.deadlines:
            self.consumer.admitted(part)
        if part.evict_in_flight:
            self.consumer.notify(self.store.cell_of(group))
        elif part.ledger is not None and self.consumer.waiting.get(part.name):
            self.consumer.notify(part)  # (``part`` is the group's cell: no mixture under token caps)

    def end_watched(self, group: OpenGroup, finished: bool) -> bool:
        """Finish (or fail) ``group`` if that very group is still in flight; return whether it did."""
        store = self.store
        if store.closed or store.groups.get(group.uid) is not group:
            return False
        clock = self.admission.clocks.get(group.partition, 0)
        self.consumer.finish(group, _FINISHED if finished else _FAILURE, clock)
        return True

    def put_new_finished(
        self,
        part: PartitionState,
        uid: str,
        payloads: list[Any] | tuple[Any, ...],
        global_steps: int | None,
        tags: Mapping[str, Any] | None,
        version: int | None = None,
        generation_seconds: object = None,
    ) -> list[str]:
        """``put_group_nowait`` of a new FINISHED group with default keys, its arguments checked
        (``version``: its start version, and ``generation_seconds``, unchecked). What can raise
        runs before any change.

        Raises:
            TypeError, ValueError: ``tags``, ``version`` or ``generation_seconds`` is invalid.
            BufferFullError: admission control has no slot for it now.
        """
        frozen_tags = EMPTY_TAGS if tags is None else check_tags(tags)
        if version is not None:
            version = check_start_version(version)
        seconds = 0.0 if generation_seconds is None else check_generation_seconds(generation_seconds) or 0.0
        clock = self.admission.clocks.get(part.name, 0)
        step = clock if global_steps is None else global_steps
        if part.gated:  # (no tokens on this path: a token cap counts the group as 0)
            step = self.admission.tag_for(part.name, part, global_steps, need=0)
        stored = payloads if type(payloads) is tuple else tuple(payloads)
        consumer, store = self.consumer, self.store
        record = None
        if consumer.filters and not part.exempt:
            record = finished_record(part.name, uid, step, clock, stored, frozen_tags, version, seconds)
            keep = consumer.judge(part, record)
            if uid in store.groups:  # a filter added the uid itself
                raise DuplicateGroupError(f"a group with uid {describe(uid)} is already in the buffer")
            if not keep:
                store.add_filtered(part, record)
                consumer.filtered(part, (record,))
                return default_keys(uid, len(stored))
        keys = store.add_finished(part, uid, step, clock, stored, frozen_tags, version, record, seconds)
        if consumer.waiting.get(part.name) or consumer.sampleable.waiting:  # notify's first tests, inline
            consumer.notify(part)
        return keys

    def put(
        self,
        uid: str,
        payloads: Collection[Any],
        global_steps: int | None,
        partition: str,
        tags: Mapping[str, Any] | None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None,
        session_ids: Sequence[int] | None,
        indices: Sequence[int] | None,
        status: object,
        granted: int | None = None,
        versioning: tuple[object, object, object] = (None, None, None),
        generation_seconds: object = None,
    ) -> list[str]:
        """``put_group_nowait`` after the open/thread check: check everything, then change.

        ``granted`` is the admission slot a waiting producer was given (its dispatch step);
        ``versioning`` the ``(versions, tokens, version)`` arguments; ``generation_seconds`` the
        producer's measure (None: the time since its admission here, 0.0 for a group this call
        adds, as on the fast path).

        Raises:
            The errors of ``ReplayBuffer.put_group_nowait``.
        """
        check_uid(uid)
        if global_steps is not None:
            check_step(global_steps)
        check_partition(partition)
        group_tags = check_tags(tags)
        terminal = _terminal_status(status)
        seconds = check_generation_seconds(generation_seconds)
        keys, checked = check_group_payloads(uid, payloads, trajectory_tags, session_ids, indices)
        rows: tuple[tuple[Any, ...], ...] = checked
        versions, tokens, version = versioning
        start = None if version is None else check_start_version(version)
        counted = check_group_versions(len(rows), versions, tokens)
        if counted is not None:
            rows = tuple((*row, *count) for row, count in zip(rows, counted, strict=True))
        store = self.store
        measured = uid in store.groups  # in flight before this call: its generation time is real
        added = 0 if counted is None else sum(count[1] for count in counted)
        group = self._group_for(uid, global_steps, partition, group_tags, keys, granted, added)
        if start is not None:
            store.set_start_version(group, start)
        store.fill(group, rows)
        if seconds is None and not measured:  # added by this very call: nothing was generating here
            seconds = 0.0
        self.consumer.finish(
            group, terminal, self.admission.clocks.get(partition, 0), measured, timed=seconds
        )
        return keys

    def _group_for(
        self,
        uid: str,
        global_steps: int | None,
        partition: str,
        tags: Mapping[str, Any],
        keys: list[str],
        granted: int | None,
        added: int,
    ) -> OpenGroup:
        """The in-flight group a :meth:`put` of ``keys`` (``added`` tokens, every argument
        checked) fills: the one in flight, or a new one admitted at ``granted`` or by admission.

        Raises:
            The errors of :meth:`put` about the group: its state, admission, its tokens.
        """
        store = self.store
        group: OpenGroup | Group | None = store.groups.get(uid)
        if group is not None:
            group = store.open_group(uid, "put a group into")
            _check_same_group(group, global_steps, partition, keys)
            ledger = store.cell_of(group).ledger
            if ledger is not None:  # max_tokens_per_group
                ledger.check_put(uid, 0 if group.span is None else group.span.tokens, added)
            return group
        if uid in store.evicted_in_flight:  # only add_prompt may start such a uid afresh
            store.open_group(uid, "put a group into")  # raises GroupEvictedError
            raise AssertionError("unreachable")
        part = store.partitions.get(partition)
        if store.rules.tasks:  # its task's cell (ValueError before any change: no task)
            part = store.cell(partition, tags)
        if added:
            _check_new_tokens(store, part, partition, uid, added)
        if granted is None:
            granted = self.admission.tag_for(partition, part, global_steps, need=added)
        # Everything is valid: from here on nothing raises, so the group lands whole.
        return store.admit(uid, granted, part or store.partition(partition), tags)

    @staticmethod
    def tokens_needed(count: int, versions: object, tokens: object) -> int:
        """The tokens a new group of ``count`` trajectories with these (checked) ``versions`` and
        ``tokens`` arguments of ``put_group`` counts under token caps."""
        counted = check_group_versions(count, versions, tokens)
        return 0 if counted is None else sum(each[1] for each in counted)

    def put_back(self, group: Group) -> bool:
        """Put a sampled ``group`` back as it was (its generation time too), without a new
        admission; return False, changing nothing, if its uid is in use or the buffer is closed.

        Raises:
            TypeError: ``group`` is not a Group record.
            The errors of :meth:`put` for values it would refuse.
        """
        if not isinstance(group, Group):
            raise TypeError(f"group must be a Group, got {type(group).__name__}")
        if self.store.closed or group.uid in self.store.groups:
            return False
        trajectories = group.trajectories
        self.put(
            group.uid,
            [t.payload for t in trajectories],
            group.global_steps,
            group.partition,
            group.tags,
            [t.tags for t in trajectories],
            [t.session_id for t in trajectories],
            [t.index for t in trajectories],
            _FINISHED if group.status is _FINISHED else _FAILURE,
            granted=group.global_steps,  # its slot was granted when it was first admitted
            versioning=(
                [t.versions or None for t in trajectories],
                [t.tokens for t in trajectories],
                group.start_version,
            ),
            generation_seconds=group.generation_seconds,
        )
        return True


def _terminal_status(status: object) -> Status:
    """Return the terminal Status ``status`` names.

    Raises:
        ValueError: it names none.
    """
    if type(status) is not str and type(status) is not Status and isinstance(status, str):
        status = str.__str__(status)  # a str subclass (numpy's str_): its plain value, no override
    terminal = _TERMINAL.get(status) if type(status) in (str, Status) else None
    if terminal is None:
        raise ValueError(
            f"status must be Status.FINISHED or Status.FAILURE (or its value), got {describe(status)}"
        )
    return terminal


def _check_new_tokens(
    store: GroupStore, part: PartitionState | None, partition: str, uid: str, tokens: int
) -> None:
    """Refuse a new group of ``tokens`` tokens past ``max_tokens_per_group`` (in a partition
    that is not exempt; ``part``: the partition or its task's cell, None if unused).

    Raises:
        ValueError: as said.
    """
    if part is not None:
        if part.ledger is not None:
            part.ledger.check_put(uid, 0, tokens)
        return
    limit = store.rules.config.max_tokens_per_group
    if limit is not None and tokens > limit and not store.rules.policy.is_exempt(partition):
        raise ValueError(
            f"group {describe(uid)} would hold {tokens} tokens, more than max_tokens_per_group={limit}"
        )


def _check_same_group(group: OpenGroup, global_steps: int | None, partition: str, keys: list[str]) -> None:
    """Refuse a ``put_group`` into the in-flight ``group`` under another step or partition, or
    with keys it holds.

    Raises:
        DuplicateGroupError, DuplicateTrajectoryError: as said.
    """
    if (global_steps is not None and group.dispatch_step != global_steps) or group.partition != partition:
        raise DuplicateGroupError(
            f"group {describe(group.uid)} is already in the buffer with global_steps={group.dispatch_step}, "
            f"partition={describe(group.partition)}; put_group got global_steps={global_steps}, "
            f"partition={describe(partition)}"
        )
    for key in keys:
        if key in group.trajectories:
            raise DuplicateTrajectoryError(
                f"group {describe(group.uid)} already holds trajectory {describe(key)}"
            )
