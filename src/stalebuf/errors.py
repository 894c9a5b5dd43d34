"""Typed errors raised by :mod:`stalebuf`.

Every error is raised *before* the buffer changes state, so a failed call leaves
the buffer exactly as it was. All classes derive from :class:`StalebufError`;
each also derives from the built-in exception a caller would naturally catch.
"""

from __future__ import annotations

__all__ = [
    "BackendMismatchError",
    "BatchNotReadyError",
    "BufferClosedError",
    "BufferFullError",
    "BufferUnavailableError",
    "CheckpointError",
    "ConfigError",
    "DuplicateGroupError",
    "DuplicateTrajectoryError",
    "FutureTagError",
    "GroupCutError",
    "GroupEvictedError",
    "InvalidTransitionError",
    "MissingDependencyError",
    "StalebufError",
    "TagClosedError",
    "UnknownGroupError",
    "WrongThreadError",
]


class StalebufError(Exception):
    """Base class of every error raised by stalebuf."""


class ConfigError(StalebufError, ValueError):
    """A configuration value (or a custom sampler it names) is invalid."""


class UnknownGroupError(StalebufError, KeyError):
    """The uid names no group in the buffer (never added, or already sampled or evicted)."""

    def __str__(self) -> str:
        # KeyError.__str__ repr()s its argument; a sentence reads better unquoted.
        return str(self.args[0]) if self.args else ""


class DuplicateGroupError(StalebufError, ValueError):
    """``add_prompt`` was given a uid that a group in the buffer already has."""


class DuplicateTrajectoryError(StalebufError, ValueError):
    """``put`` was given a ``(session_id, index)`` that the group already holds."""


class InvalidTransitionError(StalebufError, ValueError):
    """The call is not allowed in the group's current status (e.g. a late write to a terminal group)."""


class BufferClosedError(StalebufError):
    """The buffer was closed; producers and samplers can no longer use it."""


class BufferUnavailableError(StalebufError):
    """A remote buffer (``stalebuf.ray``) cannot be reached: its actor died or never started."""


class BackendMismatchError(StalebufError, RuntimeError):
    """A ``sample`` waited under another async backend than the one the buffer is bound to."""


class BatchNotReadyError(StalebufError):
    """``sample_nowait`` found no batch it may return now (the analogue of ``asyncio.QueueEmpty``)."""


class WrongThreadError(StalebufError, RuntimeError):
    """The buffer was called from another thread than its event loop's; nothing changed.

    Use :meth:`stalebuf.ReplayBuffer.threadsafe` for producers on other threads.
    """


class MissingDependencyError(StalebufError, ImportError):
    """An optional dependency (trio for simulating, matplotlib for plotting) is not installed.

    The message says which ``pip install 'stalebuf[...]'`` fixes it.
    """


class BufferFullError(StalebufError):
    """A ``*_nowait`` producer found no admission slot (the analogue of ``asyncio.QueueFull``).

    Nothing changed; the awaitable form of the call waits for a slot instead.
    """


class TagClosedError(BufferFullError):
    """An explicit dispatch step (``global_steps``) whose admission slots can never open: a group
    tagged there would be stale at the next ``sample``. Waiting would not help; dispatch at the
    clock (``global_steps=None``) or a later step."""


class FutureTagError(BufferFullError):
    """Under admission control, an explicit dispatch step (``global_steps``) ahead of the
    partition's dispatch clock: a producer cannot hold weights of a step the trainer has not
    reached, and slots at future steps would let residency exceed ``capacity()``. Waiting would
    not help; dispatch at the clock (``global_steps=None``)."""


class GroupCutError(InvalidTransitionError):
    """The group was cut at its deadline (``group_deadline_seconds``/``group_deadline_factor``)
    while still in flight: it was finished with what it had (``group_quorum``) or failed. Raised
    by a producer's next write to it: stop generating for it."""


class GroupEvictedError(UnknownGroupError):
    """The group was evicted while still in flight: stop generating for it.

    Raised by a producer call on such a group: evicted as stale (``evict_stale_in_flight=True``),
    or by ``ReplayBuffer.restore(..., in_flight="evict")`` (reason "restart").
    """


class CheckpointError(StalebufError):
    """A checkpoint cannot be written or read: a value the format cannot hold, or a file that is
    truncated, corrupt, foreign, of a newer format version, or needs a payload codec."""
