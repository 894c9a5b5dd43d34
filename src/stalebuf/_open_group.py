"""A group still being generated: the only mutable group state a buffer keeps.

An :class:`OpenGroup` is PENDING or RUNNING. The group store owns it (it is the only code
that writes it); it becomes an immutable :class:`~stalebuf.Group` record when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._versions import VersionSpan
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

    ``start_version`` is the policy version generation started at (its dispatch step until a
    producer says otherwise); ``span`` the head and tail of the trajectories put so far (None
    while none carried versions or tokens); ``head`` the group's head, the key its partition's
    in-flight index files it under.
    """

    __slots__ = (
        "admitted_at",
        "dispatch_step",
        "ending",
        "head",
        "partition",
        "seq",
        "span",
        "start_version",
        "started_at",
        "status",
        "tags",
        "task",
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
        self.task: str | None = None  # its task under a mixture (its partition's cell)
        self.dispatch_step = dispatch_step
        self.start_version = self.head = dispatch_step
        self.span: VersionSpan | None = None
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

    def head_now(self) -> int:
        """The group's head from its start version and what was put so far."""
        span = self.span
        return self.start_version if span is None else span.head(self.start_version)

    def tail_now(self) -> int:
        """The group's tail from its start version and what was put so far."""
        span = self.span
        return self.start_version if span is None else span.tail(self.start_version)

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
