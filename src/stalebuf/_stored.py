"""Reading a group's trajectories as stored: counted, copied or mapped without building the
records of a group ``put_group`` stored lazily (see :class:`~stalebuf.records.LazyTrajectories`)."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

from .records import Group, LazyTrajectories, Trajectory, new_trajectory

__all__ = ["count_trajectories", "map_payloads", "peek_trajectories", "stored_trajectories"]

#: A group's trajectories as stored, for C-level counting (``map(len, map(stored_trajectories,
#: groups))``): a tuple, or LazyTrajectories, which supports ``len()`` without building.
stored_trajectories = attrgetter("_stored")


def map_payloads(group: Group, change: Callable[[Any], Any]) -> Group:
    """Return ``group`` with every payload ``p`` replaced by ``change(p)``, everything else kept;
    a lazily stored group stays lazy (its records are not built twice)."""
    held = group._stored
    if held.__class__ is LazyTrajectories and held._built is None:
        return group.replace(trajectories=LazyTrajectories(held.uid, tuple(map(change, held.payloads))))
    trajectories = tuple(
        new_trajectory(t.key, t.session_id, t.index, t.tags, change(t.payload)) for t in group.trajectories
    )
    return group.replace(trajectories=trajectories)


def count_trajectories(group: Group) -> int:
    """How many trajectories ``group`` holds, without building lazily stored records."""
    return len(group._stored)


def peek_trajectories(group: Group) -> tuple[Trajectory, ...]:
    """``group.trajectories``, but lazily stored records are built without being kept: a
    checkpoint of a million resident groups leaves them as compact as it found them."""
    held = group._stored
    if held.__class__ is LazyTrajectories:
        return held.peek()
    return held  # type: ignore[no-any-return]
