"""The async buffer API that :class:`~stalebuf.ReplayBuffer` and
:class:`stalebuf.ray.RemoteReplayBuffer` share, as a :class:`typing.Protocol`.

Code written against :class:`AsyncReplayBuffer` runs unchanged on a local buffer or on one
hosted by a Ray actor. The type checker holds both classes to it (see
``stalebuf/ray/_conformance.py``, checked by mypy in CI), so their names and signatures cannot
drift apart. Default values are not compared by the type checker: they are written the same in
all three places by hand.

Both share, besides the producer calls and ``sample``: ``rollout()`` (an ``async with`` block
yielding a :class:`RolloutHandle`), ``save`` and ``flush``. Left out on purpose, because a process
boundary makes them differ:

- ``sampleable_count``, ``stats``, ``explain_wait`` and the flow-control queries ``dispatch_step``,
  ``capacity``, ``free_slots`` and ``full`` are plain methods locally but coroutines remotely (they ask the
  actor). A protocol member can only have one of the two types, and code that awaits one would
  break on the other; both classes keep these names, with the same parameters.
- ``add_prompt_nowait`` and ``put_group_nowait``: the same names and parameters on both, never
  waiting for admission (BufferFullError instead), but synchronous locally and coroutines
  remotely, for the same reason. The other ``*_nowait`` twins, ``close`` and ``on_evict`` are
  local only (a synchronous call cannot wait for an actor, and a callable cannot cross
  processes; remote clients read ``evictions()`` instead).
- a rollout group's ``put_nowait`` (local only), ``checkpoint`` (local only: a remote checkpoint
  is the file ``save`` writes), and ``restore`` and ``recover``, classmethods on both whose results
  differ (``RestoreResult`` holds a ReplayBuffer, ``RemoteRestoreResult`` a RemoteReplayBuffer).
- ``config`` and ``closed`` (local properties) and ``info``, ``evictions``, ``kill`` (remote
  only).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Protocol, TypeVar

from ._checkpoint_file import PayloadCodec
from ._group_writes import GroupStatus
from .records import Batch

__all__ = ["AsyncReplayBuffer", "RolloutHandle"]

_Buffer = TypeVar("_Buffer", bound="AsyncReplayBuffer")


class RolloutHandle(Protocol):
    """The group a ``rollout()`` block generates: :class:`~stalebuf.RolloutGroup` locally,
    :class:`~stalebuf.ray.RemoteRolloutGroup` remotely."""

    @property
    def uid(self) -> str:
        """The group's uid."""

    @property
    def partition(self) -> str:
        """Its partition."""

    @property
    def global_steps(self) -> int:
        """Its dispatch step (the tag admission gave it)."""

    @property
    def evicted(self) -> bool:
        """True once the group was evicted (or the buffer closed) while the block ran."""

    async def put(
        self,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
        versions: Sequence[tuple[int, int]] | None = None,
        tokens: int | None = None,
    ) -> str:
        """Add one trajectory to the group (with the versions that generated its tokens, or
        its token count); return its key."""


class AsyncReplayBuffer(Protocol):
    """The async API of a staleness-aware replay buffer, local or remote.

    Producers move a group through ``add_prompt`` -> ``mark_running`` -> ``put`` ... ->
    ``mark_finished`` / ``mark_failed`` (or do it all with ``put_group``); the trainer calls
    ``sample``. Each method raises the typed errors of :mod:`stalebuf.errors` that
    :class:`~stalebuf.ReplayBuffer` documents; a remote buffer also raises
    :class:`~stalebuf.errors.BufferUnavailableError` when its actor is gone.
    """

    # The signatures below deliberately repeat those of ReplayBuffer and RemoteReplayBuffer:
    # this copy is what mypy compares both classes with.

    async def add_prompt(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new PENDING group (waiting for admission), tagged ``global_steps`` or, for
        None, with the dispatch clock when it is admitted."""

    async def mark_running(self, uid: str, *, version: int | None = None) -> None:
        """Move a group from PENDING to RUNNING; ``version``: the policy version its generation
        started at (None keeps the start version it has)."""

    async def put(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
        versions: Sequence[tuple[int, int]] | None = None,
        tokens: int | None = None,
    ) -> str:
        """Add one trajectory to an in-flight group (with the run-length ``(version, n_tokens)``
        pairs that generated it, or its token count); return its key ``uid_session_index``."""

    async def mark_finished(self, uid: str) -> None:
        """Mark a group FINISHED: it becomes sampleable."""

    async def mark_failed(self, uid: str) -> None:
        """Mark a group FAILURE (sampled or evicted as ``failure_strategy`` says)."""

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
        versions: Sequence[Sequence[tuple[int, int]] | None] | None = None,
        tokens: Sequence[int | None] | None = None,
        version: int | None = None,
        generation_seconds: float | None = None,
    ) -> list[str]:
        """Add (if absent), fill and finish or fail a whole group, all or nothing (per-trajectory
        ``versions`` and ``tokens``, the group's start ``version``); return its keys."""

    async def sample(
        self,
        global_steps: int,
        batch_size: int | None = None,
        *,
        token_budget: int | None = None,
        partition: str = "train",
        timeout: float | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """Wait for, remove and return ``batch_size`` whole groups, or the groups of up to
        ``token_budget`` tokens (exactly one of the two), oldest first, with metrics."""

    async def wait_for_sampleable(
        self, global_steps: int, count: int, *, partition: str = "train", timeout: float | None = None
    ) -> int:
        """Wait until at least ``count`` groups are sampleable at ``global_steps``; return how many
        are (it takes nothing)."""

    def rollout(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        version: int | None = None,
    ) -> AbstractAsyncContextManager[RolloutHandle]:
        """Return an ``async with`` block that admits, runs and ends one group (the body is
        cancelled if the group is evicted in flight or the buffer closes)."""

    async def save(self, path: str | os.PathLike[str], *, payload_codec: PayloadCodec | None = None) -> None:
        """Checkpoint the buffer at once and write it to ``path`` atomically."""

    async def flush(self, *, checkpoint_step: int | None = None) -> None:
        """Commit the journal now and wait until it is durable (with ``checkpoint_step=g``, also
        record that the trainer's state at step ``g`` is durable); without a journal, return."""

    async def aclose(self) -> None:
        """Close the buffer: parked and later samplers and producers raise BufferClosedError."""

    async def __aenter__(self: _Buffer) -> _Buffer:
        """Return the buffer; ``async with`` closes it on exit."""

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the buffer."""
