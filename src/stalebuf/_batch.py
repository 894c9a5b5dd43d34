"""The records of a ``sample`` and an eviction: :class:`Batch` and :class:`EvictionEvent`
(exported by :mod:`stalebuf.records`, with the group and trajectory records they hold)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

import attrs
import numpy as np
import numpy.typing as npt

from ._group_records import Group, Trajectory

__all__ = ["Batch", "EvictionEvent", "EvictionReason", "new_batch"]


@attrs.frozen(eq=False, weakref_slot=False)
class Batch:
    """What one ``sample`` call returns: whole groups, oldest first.

    Attributes:
        partition: the partition sampled.
        global_steps: the trainer step passed to ``sample``.
        groups: the selected groups, in selection order.
        parameter_sync_step: the sync step S of the buffer's policy (its config's), used by
            :attr:`staleness`.
    """

    partition: str
    global_steps: int
    groups: tuple[Group, ...]
    parameter_sync_step: int = 1

    def __len__(self) -> int:
        """Return the number of groups."""
        return len(self.groups)

    def __iter__(self) -> Iterator[Group]:
        """Iterate over the groups in selection order."""
        return iter(self.groups)

    @property
    def uids(self) -> list[str]:
        """The group uids, in selection order."""
        return [group.uid for group in self.groups]

    @property
    def trajectories(self) -> list[Trajectory]:
        """All trajectories, flattened in group order."""
        return [t for group in self.groups for t in group.trajectories]

    @property
    def keys(self) -> list[str]:
        """All trajectory keys, flattened in group order."""
        return [key for group in self.groups for key in group._stored_keys()]

    @property
    def tags(self) -> list[Mapping[str, Any]]:
        """All trajectory tags, flattened in group order."""
        return [tags for group in self.groups for tags in group._stored_tags()]

    @property
    def payloads(self) -> list[Any]:
        """All trajectory payloads, flattened in group order."""
        return [payload for group in self.groups for payload in group._stored_payloads()]

    @property
    def staleness(self) -> npt.NDArray[np.float64]:
        """Staleness ``(g - p + 1) / parameter_sync_step`` of each group, as float64."""
        dispatch = np.fromiter(
            (group.dispatch_step for group in self.groups), dtype=np.float64, count=len(self.groups)
        )
        return (self.global_steps + 1 - dispatch) / self.parameter_sync_step


EvictionReason = Literal["stale", "failure", "restart"]


@attrs.frozen(eq=False, weakref_slot=False)
class EvictionEvent:
    """Groups evicted together for one reason during one ``sample`` evaluation.

    Attributes:
        partition: the partition they were evicted from.
        reason: "stale" (drop strategy; in-flight groups too with ``evict_stale_in_flight``),
            "failure" (``failure_strategy="evict"``) or "restart" (in-flight groups evicted by
            ``ReplayBuffer.restore(..., in_flight="evict")``).
        groups: the evicted groups, oldest first.
        global_steps: the trainer step of the ``sample`` call that evicted them (for "restart",
            the partition's dispatch clock).
    """

    partition: str
    reason: EvictionReason
    groups: tuple[Group, ...]
    global_steps: int


# Batch is an attrs class whose frozen __init__ routes every field through object.__setattr__
# by name; setting the slot descriptors directly takes about two thirds of that. Tests compare
# what this builds with what the class's own constructor builds.
_new = object.__new__
_set_bpartition, _set_bsteps, _set_groups, _set_sync = (
    Batch.__dict__[field.name].__set__ for field in attrs.fields(Batch)
)


def new_batch(
    partition: str, global_steps: int, groups: tuple[Group, ...], parameter_sync_step: int
) -> Batch:
    """Return ``Batch(partition, global_steps, groups, parameter_sync_step)``, built faster."""
    batch = _new(Batch)
    _set_bpartition(batch, partition)
    _set_bsteps(batch, global_steps)
    _set_groups(batch, groups)
    _set_sync(batch, parameter_sync_step)
    return batch


# Documented, pickled and shown as part of stalebuf.records, where users import them from.
Batch.__module__ = EvictionEvent.__module__ = "stalebuf.records"
