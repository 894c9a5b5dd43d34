"""Reading a group's trajectories as stored: counted, copied or mapped without building the
records of a group ``put_group`` stored lazily (a :class:`~stalebuf._lazy_group.LazyGroup`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter, methodcaller
from typing import Any

from ._lazy_group import LazyGroup, new_lazy_group
from .records import Group, Trajectory, new_trajectory

__all__ = [
    "count_trajectories",
    "map_payloads",
    "peek_trajectories",
    "stored_payloads",
    "stored_trajectories",
]

#: A group's trajectories as stored, for C-level counting (``map(len, map(stored_trajectories,
#: groups))``): its records, or the payloads of a LazyGroup, one per trajectory either way.
stored_trajectories = attrgetter("_stored")
#: A group's payloads, one per trajectory, without building lazily stored records (a C-level
#: call, for ``chain.from_iterable(map(stored_payloads, groups))``).
stored_payloads: Callable[[Group], Sequence[Any]] = methodcaller("_stored_payloads")


def map_payloads(group: Group, change: Callable[[Any], Any]) -> Group:
    """Return ``group`` with every payload ``p`` replaced by ``change(p)``, everything else kept;
    a lazily stored group stays lazy (its records are not built twice)."""
    if group.__class__ is LazyGroup and group._built is None:
        return new_lazy_group(
            group.uid,
            group.partition,
            group.dispatch_step,
            group.status,
            group.tags,
            tuple(map(change, group._stored)),
            group.finish_step,
            group.generation_seconds,
            group.start_version,
        )
    trajectories = tuple(
        new_trajectory(t.key, t.session_id, t.index, t.tags, change(t.payload), t.versions, t.tokens)
        for t in group.trajectories
    )
    return group.replace(trajectories=trajectories)


def count_trajectories(group: Group) -> int:
    """How many trajectories ``group`` holds, without building lazily stored records."""
    return len(group._stored)


def peek_trajectories(group: Group) -> tuple[Trajectory, ...]:
    """``group.trajectories``, but lazily stored records are built without being kept: a
    checkpoint of a million resident groups leaves them as compact as it found them."""
    return group._peek()
