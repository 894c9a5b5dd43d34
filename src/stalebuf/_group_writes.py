"""Writing a whole group at once: the two bodies behind ``put_group``.

``_put_new_finished_group`` is the common case (a new FINISHED group of default keys, every
argument already checked by the caller): the group goes straight to the ready index as a
:class:`~stalebuf._lazy_group.LazyGroup`, never in flight. ``_put_group`` is everything else:
it checks every argument, then adds, fills and ends the group, all or nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ._lazy_group import LazyGroup
from ._partition import OpenGroup, PartitionState
from ._sampling import Sampling
from ._validation import check_group_payloads, check_partition, check_step, check_tags, check_uid, describe
from .errors import DuplicateGroupError, DuplicateTrajectoryError
from .records import EMPTY_TAGS, Group, Status, default_keys, new_trajectory

__all__ = ["GroupWrites"]

_FINISHED, _FAILURE = Status.FINISHED, Status.FAILURE
_tuple_new = tuple.__new__
# What ``put_group(status=...)`` accepts: a terminal Status or its value ("failed" too).
_TERMINAL: dict[object, Status] = {
    _FINISHED: _FINISHED,
    _FAILURE: _FAILURE,
    "finished": _FINISHED,
    "failure": _FAILURE,
    "failed": _FAILURE,
}


class GroupWrites(Sampling):
    """The whole-group writes of ``ReplayBuffer`` (``put_group_nowait``/``put_group`` call them)."""

    def _put_new_finished_group(
        self,
        part: PartitionState,
        uid: str,
        payloads: list[Any] | tuple[Any, ...],
        global_steps: int | None,
        tags: Mapping[str, Any] | None,
    ) -> list[str]:
        """``put_group_nowait`` of a new FINISHED group with default keys, its arguments checked: it
        goes straight to the ready index (never in flight). What can raise runs before any change."""
        frozen_tags = EMPTY_TAGS if tags is None else check_tags(tags)
        clock = self._clocks.get(part.name, 0)
        step = clock if global_steps is None else global_steps
        if part.cap is not None and not (  # the default admission rule inline, else the general check
            self._plain_admission
            and not part.producers
            and part.resident_at is not None
            and part.resident_at.get(step, 0) < part.cap
            and step >= part.last_sampled + 2 - self._stale_span  # not is_stale(last_sampled + 1, step)
        ):
            step = self._admission_tag(part.name, part, global_steps)  # may raise BufferFullError
        stored = payloads if type(payloads) is tuple else tuple(payloads)
        record = _tuple_new(  # _lazy_group.new_lazy_group: its records are built when first read
            LazyGroup, (uid, part.name, step, _FINISHED, frozen_tags, stored, max(clock, step), 0.0)
        )
        seq = self._next_seq
        self._next_seq = seq + 1
        self._groups[uid] = record
        part.add_terminal(record, seq)
        if part.waiters:
            self._wake_head(part)
        return default_keys(uid, len(stored))

    def _put_group(
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
    ) -> list[str]:
        """``put_group_nowait`` after the open/thread check: check everything, then change.

        ``granted`` is the admission slot a waiting producer was given (its dispatch step).
        """
        check_uid(uid)
        if global_steps is not None:
            check_step(global_steps)
        check_partition(partition)
        group_tags = check_tags(tags)
        if type(status) is not str and type(status) is not Status and isinstance(status, str):
            status = str.__str__(status)  # a str subclass (numpy's str_): its plain value, no override
        terminal = _TERMINAL.get(status) if type(status) in (str, Status) else None
        if terminal is None:
            raise ValueError(
                f"status must be Status.FINISHED or Status.FAILURE (or its value), got {describe(status)}"
            )
        keys, rows = check_group_payloads(uid, payloads, trajectory_tags, session_ids, indices)
        group: OpenGroup | Group | None = self._groups.get(uid)
        if group is not None:
            group = self._open_group(uid, "put a group into")
            step = group.dispatch_step
            if (global_steps is not None and step != global_steps) or group.partition.name != partition:
                raise DuplicateGroupError(
                    f"group {describe(uid)} is already in the buffer with "
                    f"global_steps={group.dispatch_step}, "
                    f"partition={describe(group.partition.name)}; put_group got global_steps={global_steps}, "
                    f"partition={describe(partition)}"
                )
            for key in keys:
                if key in group.trajectories:
                    raise DuplicateTrajectoryError(
                        f"group {describe(uid)} already holds trajectory {describe(key)}"
                    )
        elif uid in self._evicted_in_flight:  # only add_prompt may start such a uid afresh
            self._open_group(uid, "put a group into")  # raises GroupEvictedError
            raise AssertionError("unreachable")
        elif granted is not None:
            step = granted
        else:
            step = self._admission_tag(partition, self._partitions.get(partition), global_steps)
        # Everything is valid: from here on nothing raises, so the group lands whole.
        if group is None:
            group = self._admit(uid, step, self._partition(partition), group_tags)
        group.trajectories.update((row[0], new_trajectory(*row)) for row in rows)
        group.partition.add_trajectories(len(rows))
        self._terminate(group, terminal)
        return keys
