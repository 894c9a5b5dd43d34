"""The records of groups that are still being written: what a group would become if it ended now.

Pure builders (no state): the store ends a group with the record one of these made, and a
filter is shown that record before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from time import monotonic
from types import MappingProxyType
from typing import Any

from ._lazy_group import LazyGroup
from ._open_group import OpenGroup
from .records import Group, Status

__all__ = ["CUT_TAG", "cut_record", "finished_record", "snapshot", "terminal_record"]

#: The group tag every group cut at its deadline carries (True), finished or failed.
CUT_TAG = "stalebuf_cut"

_tuple_new = tuple.__new__
_FINISHED = Status.FINISHED


def terminal_record(group: OpenGroup, status: Status, clock: int, seconds: float | None = None) -> Group:
    """The record the in-flight ``group`` becomes if ended now with ``status`` (``clock``: its
    partition's dispatch clock, the record's finish step unless before its dispatch step;
    ``seconds``: its generation time as its producer measured it, None: since its admission)."""
    step = group.dispatch_step
    return _tuple_new(  # records.new_group, without the call
        Group,
        (
            group.uid,
            group.partition,
            step,
            status,
            group.tags,
            tuple(group.trajectories.values()),
            clock if clock > step else step,
            monotonic() - group.admitted_at if seconds is None else seconds,
            group.start_version,
        ),
    )


def cut_record(group: OpenGroup, status: Status, clock: int) -> Group:
    """The record the in-flight ``group`` becomes if cut at its deadline now (tagged)."""
    record = terminal_record(group, status, clock)
    return record.replace(tags=MappingProxyType({**group.tags, CUT_TAG: True}))


def finished_record(
    partition: str,
    uid: str,
    step: int,
    clock: int,
    payloads: tuple[Any, ...],
    tags: Mapping[str, Any],
    start_version: int | None = None,
    seconds: float = 0.0,
) -> Group:
    """The lazily stored FINISHED group a ``put_group`` of a new group of default keys adds
    (``seconds``: its ``generation_seconds``, the producer's measure)."""
    finish, start = clock if clock > step else step, step if start_version is None else start_version
    return _tuple_new(  # _lazy_group.new_lazy_group, without the call
        LazyGroup, (uid, partition, step, _FINISHED, tags, payloads, finish, seconds, start)
    )


def snapshot(group: OpenGroup, clock: int, now: float) -> Group:
    """The record of the in-flight ``group`` as it is at ``now``, its status kept (a checkpoint)."""
    return Group(
        group.uid,
        group.partition,
        group.dispatch_step,
        group.status,
        group.tags,
        tuple(group.trajectories.values()),
        max(clock, group.dispatch_step),
        now - group.admitted_at,
        group.start_version,
    )
