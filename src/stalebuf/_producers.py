"""The producer half of the buffer: groups move PENDING -> RUNNING -> FINISHED | FAILURE.

Each ``*_nowait`` method checks everything before it changes anything, so a failed call leaves
the buffer as it was; its awaitable twin of the same name has the same checks, errors and
effect. Completing a group wakes the partition's head waiting ``sample`` when it may now get
a batch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from threading import get_ident
from typing import Any, Literal

from ._group_writes import GroupWrites
from ._partition import OpenGroup
from ._validation import check_index, check_partition, check_step, check_tags, check_uid, describe
from .errors import BufferFullError, DuplicateGroupError, DuplicateTrajectoryError, InvalidTransitionError
from .records import DEFAULT_KEY_SESSIONS, DEFAULT_KEY_SUFFIXES, EMPTY_TAGS, Status, Trajectory

__all__ = ["GroupStatus", "Producers"]

#: What ``put_group(status=...)`` accepts: a terminal Status, its value, or "failed".
GroupStatus = Status | Literal["finished", "failure", "failed"]
_FINISHED, _FAILURE, _PENDING, _RUNNING = Status.FINISHED, Status.FAILURE, Status.PENDING, Status.RUNNING
_tuple_new = tuple.__new__


class Producers(GroupWrites):
    """The producer methods of ``ReplayBuffer`` (documented there)."""

    # -- producers --------------------------------------------------------------------

    def add_prompt_nowait(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new group ``uid`` as PENDING, tagged ``global_steps`` (its dispatch step;
        None: the partition's dispatch clock, :meth:`dispatch_step`, at this moment).

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: ``uid``, ``global_steps``, ``partition`` or ``tags`` is invalid.
            DuplicateGroupError: a group with this uid is in the buffer.
            BufferFullError: admission control has no slot for it now; nothing changed.
        """
        thread = self._binding.thread
        if self._closed or (thread is not None and thread != get_ident()):
            self._check_usable()
        # The hot path: each check is inlined, the slow helpers only build the error.
        if type(uid) is not str or not uid or "_" in uid:
            check_uid(uid)
        if global_steps is not None and (type(global_steps) is not int or not 0 <= global_steps < 1 << 63):
            check_step(global_steps)
        part = self._partitions.get(partition) if type(partition) is str else None
        if part is None:
            check_partition(partition)
        frozen_tags = EMPTY_TAGS if tags is None else check_tags(tags)
        if uid in self._groups:
            raise DuplicateGroupError(f"a group with uid {describe(uid)} is already in the buffer")
        if part is None or part.cap is not None or global_steps is None:
            global_steps = self._admission_tag(partition, part, global_steps)
        self._admit(uid, global_steps, part or self._partition(partition), frozen_tags)

    def _add_prompt_at(self, uid: str, tag: int, partition: str, tags: Mapping[str, Any] | None) -> None:
        """Admit ``uid`` at ``tag``, a slot the caller was granted (a waiting producer's turn)."""
        self._check_usable()
        if uid in self._groups:
            raise DuplicateGroupError(f"a group with uid {describe(uid)} is already in the buffer")
        self._admit(uid, tag, self._partition(partition), check_tags(tags))

    def mark_running_nowait(self, uid: str) -> None:
        """Move group ``uid`` from PENDING to RUNNING.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is not PENDING.
        """
        thread = self._binding.thread
        if self._closed or (thread is not None and thread != get_ident()):
            self._check_usable()
        group = self._groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:  # the lookup inlined; _open_group raises the right error
            group = self._open_group(uid, "mark running")
        if group.status is not _PENDING:
            raise InvalidTransitionError(f"cannot mark group {describe(uid)} running: it is already running")
        group.status = _RUNNING
        group.partition.start()

    def put_nowait(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
    ) -> str:
        """Add one trajectory to the PENDING or RUNNING group ``uid``; return its key,
        ``f"{uid}_{session_id}_{index}"``.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: ``session_id``/``index`` is not an int >= 0, or ``tags`` is
                not a mapping.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is terminal (a late write).
            DuplicateTrajectoryError: the group already holds this ``(session_id, index)``.
        """
        thread = self._binding.thread
        if self._closed or (thread is not None and thread != get_ident()):
            self._check_usable()
        if type(session_id) is not int or not 0 <= session_id < 1 << 63:
            check_index(session_id, "session_id")
        if type(index) is not int or not 0 <= index < 1 << 63:
            check_index(index, "index")
        frozen_tags = EMPTY_TAGS if tags is None else check_tags(tags)
        group = self._groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:  # the lookup inlined; _open_group raises the right error
            group = self._open_group(uid, "put into")
        if index or session_id >= DEFAULT_KEY_SESSIONS:
            key = f"{uid}_{session_id}_{index}"
        else:  # the common key, without formatting two ints
            key = uid + DEFAULT_KEY_SUFFIXES[session_id]
        trajectories = group.trajectories
        if key in trajectories:
            raise DuplicateTrajectoryError(
                f"group {describe(uid)} already holds session_id={session_id}, index={index} "
                f"({describe(key)})"
            )
        trajectories[key] = _tuple_new(Trajectory, (key, session_id, index, frozen_tags, payload))
        group.partition.trajectories += 1  # PartitionState.add_trajectories(1), inlined: runs per put
        group.partition.admitted_trajectories += 1
        return key

    def mark_finished_nowait(self, uid: str) -> None:
        """Move group ``uid`` from PENDING or RUNNING to FINISHED; it becomes sampleable.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is already terminal.
        """
        thread = self._binding.thread
        if self._closed or (thread is not None and thread != get_ident()):
            self._check_usable()
        group = self._groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:  # the lookup inlined; _open_group raises the right error
            group = self._open_group(uid, "mark finished")
        self._terminate(group, _FINISHED)

    def mark_failed_nowait(self, uid: str) -> None:
        """Move group ``uid`` from PENDING or RUNNING to FAILURE.

        Under ``failure_strategy="sample"`` (or in an exempt partition) it becomes
        sampleable; under "evict" the next ``sample`` of its partition evicts it.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is already terminal.
        """
        thread = self._binding.thread
        if self._closed or (thread is not None and thread != get_ident()):
            self._check_usable()
        self._terminate(self._open_group(uid, "mark failed"), _FAILURE)

    def put_group_nowait(
        self,
        uid: str,
        payloads: Collection[Any],
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None = None,
        session_ids: Sequence[int] | None = None,
        indices: Sequence[int] | None = None,
        status: GroupStatus = "finished",
    ) -> list[str]:
        """Add (if absent), fill and finish or fail a whole group in one call; return its keys.

        Does what ``add_prompt`` + one ``put`` per payload + ``mark_finished`` (or
        ``mark_failed``) would, all or nothing: everything is checked before anything changes.
        Trajectory ``i`` gets ``session_ids[i]`` (default ``i``), ``indices[i]`` (default 0)
        and ``trajectory_tags[i]``. If the group is already in flight, it must have the same
        ``global_steps`` and ``partition``, the payloads are added to what it holds, and
        ``tags`` is ignored (group tags are set when a group is added); ``global_steps=None``
        means the group's own step, or the dispatch clock for a new group. ``status`` is
        ``Status.FINISHED`` or ``Status.FAILURE`` or their values ("failed" also works).

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: an argument is invalid, ``payloads`` is not a collection, a
                per-trajectory collection has another length than ``payloads``, or ``status``
                is not a terminal status.
            InvalidTransitionError: the group is already terminal (a late write).
            DuplicateGroupError: the group is in flight with another step or partition.
            DuplicateTrajectoryError: two payloads, or a payload and the group, share a key.
            BufferFullError: the group is new and admission control has no slot for it now.
        """
        thread = self._binding.thread
        if self._closed or (thread is not None and thread != get_ident()):
            self._check_usable()
        part = self._partitions.get(partition) if type(partition) is str else None
        if (  # the common case gets a path of its own: a new, finished group of default keys
            part is not None
            and trajectory_tags is None
            and session_ids is None
            and indices is None
            and (type(payloads) is list or type(payloads) is tuple)
            and (status is _FINISHED or (type(status) is str and status == "finished"))
            and (global_steps is None or (type(global_steps) is int and 0 <= global_steps < 1 << 63))
            and type(uid) is str
            and uid
            and "_" not in uid
            and uid not in self._groups
            and uid not in self._evicted_in_flight  # put_group raises GroupEvictedError for those
        ):
            return self._put_new_finished_group(part, uid, payloads, global_steps, tags)
        return self._put_group(
            uid, payloads, global_steps, partition, tags, trajectory_tags, session_ids, indices, status
        )

    async def add_prompt(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new PENDING group; like :meth:`add_prompt_nowait`, but under admission
        control it waits (FIFO per partition, cancellable) for a slot instead of raising
        BufferFullError; with ``global_steps=None`` the group is tagged when it is admitted.

        Raises:
            The errors of :meth:`add_prompt_nowait` except BufferFullError, which it raises only
                for an explicit ``global_steps`` whose tag is closed for good (stale at the next
                ``sample``: no slot there can ever open), at once or when a sample closes it.
            BufferClosedError: the buffer was closed while it waited.
        """
        try:
            self.add_prompt_nowait(uid, global_steps=global_steps, partition=partition, tags=tags)
            return
        except BufferFullError:
            pass

        def admit(tag: int) -> None:
            self._add_prompt_at(uid, tag, partition, tags)

        await self._wait_for_slot(self._partition(partition), global_steps, admit)

    async def mark_running(self, uid: str) -> None:
        """Mark a group RUNNING; the async twin of :meth:`mark_running_nowait` (same errors)."""
        self.mark_running_nowait(uid)

    async def put(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
    ) -> str:
        """Add one trajectory and return its key; the async twin of :meth:`put_nowait` (same errors)."""
        return self.put_nowait(uid, payload, session_id=session_id, index=index, tags=tags)

    async def mark_finished(self, uid: str) -> None:
        """Mark a group FINISHED; the async twin of :meth:`mark_finished_nowait` (same errors)."""
        self.mark_finished_nowait(uid)

    async def mark_failed(self, uid: str) -> None:
        """Mark a group FAILURE; the async twin of :meth:`mark_failed_nowait` (same errors)."""
        self.mark_failed_nowait(uid)

    async def put_group(
        self,
        uid: str,
        payloads: Collection[Any],
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None = None,
        session_ids: Sequence[int] | None = None,
        indices: Sequence[int] | None = None,
        status: GroupStatus = "finished",
    ) -> list[str]:
        """Add (if absent), fill and end a whole group; like :meth:`put_group_nowait`, but a
        group that must be added waits under admission control (FIFO, cancellable) for a slot
        instead of raising BufferFullError. A group already in the buffer never waits.

        Raises:
            The errors of :meth:`put_group_nowait` except BufferFullError, which it raises only
                for an explicit ``global_steps`` whose tag is closed for good (stale at the next
                ``sample``: no slot there can ever open), at once or when a sample closes it.
            BufferClosedError: the buffer was closed while it waited.
        """
        try:
            return self.put_group_nowait(
                uid,
                payloads,
                global_steps=global_steps,
                partition=partition,
                tags=tags,
                trajectory_tags=trajectory_tags,
                session_ids=session_ids,
                indices=indices,
                status=status,
            )
        except BufferFullError:
            pass

        arguments = (
            uid,
            payloads,
            global_steps,
            partition,
            tags,
            trajectory_tags,
            session_ids,
            indices,
            status,
        )

        def admit(tag: int) -> list[str]:
            self._check_usable()
            return self._put_group(*arguments, granted=tag)

        return await self._wait_for_slot(self._partition(partition), global_steps, admit)
