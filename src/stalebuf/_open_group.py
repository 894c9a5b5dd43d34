"""A group still being generated: the only mutable group state a buffer keeps.

An :class:`OpenGroup` is PENDING or RUNNING. The group store owns it (it is the only code
that writes it); it becomes an immutable :class:`~stalebuf.Group` record when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .records import Status, Trajectory

__all__ = ["GroupWatch", "OpenGroup"]

_PENDING = Status.PENDING


class OpenGroup:
    """A PENDING or RUNNING group; it answers to the field names of :class:`~stalebuf.Group`.

    ``partition`` is the partition's name, as on a record. ``watchers`` are called once if the
    group is evicted in flight, cut at its deadline, or the buffer closes (``rollout()`` cancels
    its body this way); None for the common group nobody watches. ``ending`` says which, once
    it happened: "evicted", "closed", "cut" (finished or failed, kept) or "cut-evicted" (failed
    and evicted with it). ``started_at`` is when its deadline clock started (``monotonic()``):
    its admission, or the restore that kept or reissued it.
    """

    __slots__ = (
        "admitted_at",
        "dispatch_step",
        "ending",
        "partition",
        "seq",
        "started_at",
        "status",
        "tags",
        "trajectories",
        "uid",
        "watchers",
    )

    def __init__(
        self,
        uid: str,
        partition: str,
        dispatch_step: int,
        seq: int,
        tags: Mapping[str, Any],
        admitted_at: float,
        started_at: float | None = None,
    ) -> None:
        self.uid = uid
        self.partition = partition
        self.dispatch_step = dispatch_step
        self.seq = seq
        self.status = _PENDING
        self.tags = tags
        self.admitted_at = admitted_at
        self.started_at = admitted_at if started_at is None else started_at
        self.ending: str | None = None
        self.watchers: list[Callable[[], object]] | None = None
        # Keyed by trajectory key: keeps put order and detects duplicates in one structure.
        self.trajectories: dict[str, Trajectory] = {}

    @property
    def global_steps(self) -> int:
        """The dispatch step, under the name :class:`~stalebuf.Group` also answers to."""
        return self.dispatch_step

    def notify_watchers(self, ending: str) -> None:
        """Record how the group left flight (``ending``) and call every watcher once."""
        self.ending = ending
        watchers, self.watchers = self.watchers, None
        if watchers:
            for watcher in watchers:
                watcher()


class GroupWatch:
    """A handle on one in-flight group, by identity, from ``ReplayBuffer.watch``: a later group
    that reuses the uid is another group, which ``ReplayBuffer.end_watched`` leaves alone."""

    __slots__ = ("group",)

    def __init__(self, group: OpenGroup) -> None:
        self.group = group

    @property
    def uid(self) -> str:
        """The watched group's uid."""
        return self.group.uid

    @property
    def dispatch_step(self) -> int:
        """The watched group's dispatch step."""
        return self.group.dispatch_step

    @property
    def ending(self) -> str | None:
        """None while the group is in flight or ended normally; else how the buffer ended it:
        "evicted", "closed", "cut" or "cut-evicted" (see :class:`OpenGroup`)."""
        return self.group.ending

    def __repr__(self) -> str:
        return f"GroupWatch(uid={self.group.uid!r}, dispatch_step={self.group.dispatch_step})"
