"""Checkpoints of a remote buffer: payloads by value in the file, back in the object store after.

The actor writes and reads the file (a path on the actor's node). An object reference means
nothing after a restart, so ``save`` fetches every payload the buffer holds as a reference
(PayloadRef or ``ray.ObjectRef``) into the actor and writes the values; ``restore`` stores each
restored group's payloads in the object store again, one object per group, owned by the actor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs
from ray.exceptions import RayError

from .._checkpoint_file import PayloadCodec, read_checkpoint
from .._stored import peek_trajectories
from .._validation import describe_error
from ..buffer import ReplayBuffer
from ..checkpoint import BufferCheckpoint, InFlightMode
from ..errors import CheckpointError
from ..records import EvictionEvent, Group, Status, new_trajectory
from ._payloads import PackedRun, store_group, unique_refs, with_values

if TYPE_CHECKING:
    from ._client import RemoteReplayBuffer

__all__ = ["RemoteRestoreResult", "RestoreRequest", "by_value", "restore_buffer"]

_IN_FLIGHT = (Status.PENDING, Status.RUNNING)


@attrs.frozen(eq=False)
class RemoteRestoreResult:
    """What :meth:`RemoteReplayBuffer.restore` returns.

    Attributes:
        buffer: the client of the new actor, which holds the restored buffer.
        reissue: under ``in_flight="reissue"``, the groups that were in flight at the checkpoint
            (uid, partition, dispatch step, tags; no trajectories), oldest first: they are in the
            buffer as PENDING, to be generated again under the same uid.
    """

    buffer: RemoteReplayBuffer
    reissue: tuple[Group, ...]

    def __iter__(self) -> Iterator[Any]:
        """Unpack as ``buffer, reissue = ...``, in that order."""
        return iter((self.buffer, self.reissue))


@attrs.frozen
class RestoreRequest:
    """What a new actor restores its buffer from (sent to its constructor).

    Attributes:
        path: the checkpoint file, on the actor's node.
        in_flight: as for ``ReplayBuffer.restore``.
        payload_codec: as for ``ReplayBuffer.restore``.
        store: put each restored group's payloads in the object store (False: keep the values,
            the client's ``payloads="inline"`` mode).
    """

    path: str
    in_flight: InFlightMode
    payload_codec: PayloadCodec | None
    store: bool


async def by_value(checkpoint: BufferCheckpoint) -> BufferCheckpoint:
    """Return ``checkpoint`` with every payload held as an object reference replaced by its value,
    all fetched into this process at once.

    Raises:
        CheckpointError: a payload object is lost (e.g. its owner, a producer, died).
    """
    refs = unique_refs(t.payload for group in checkpoint.groups for t in peek_trajectories(group))
    if not refs:
        return checkpoint
    try:
        values = await asyncio.gather(*refs)
    except RayError as exc:
        raise CheckpointError(
            f"cannot save the buffer: a payload it holds is lost ({type(exc).__name__}: "
            f"{describe_error(exc)}); nothing was written"
        ) from exc
    by_ref = dict(zip(refs, values, strict=True))
    return attrs.evolve(checkpoint, groups=tuple(with_values(group, by_ref) for group in checkpoint.groups))


def restore_buffer(
    request: RestoreRequest,
    on_evict: Callable[[EvictionEvent], object],
    options: Mapping[str, Any],
) -> tuple[ReplayBuffer, tuple[Group, ...]]:
    """Read the file, store the payloads (unless ``request.store`` is False) and restore
    (``options``: ``status_log_interval``, when the client gave one).

    Raises:
        What ``ReplayBuffer.restore`` raises (CheckpointError, ConfigError, OSError, ...).
    """
    checkpoint = read_checkpoint(request.path, request.payload_codec)
    if request.store:
        keep_in_flight = request.in_flight == "keep"  # otherwise their trajectories are dropped
        groups = tuple(
            _stored(group) if keep_in_flight or group.status not in _IN_FLIGHT else group
            for group in checkpoint.groups
        )
        checkpoint = attrs.evolve(checkpoint, groups=groups)
    result = ReplayBuffer.restore(checkpoint, in_flight=request.in_flight, on_evict=on_evict, **options)
    return result.buffer, result.reissue


def _stored(group: Group) -> Group:
    """``group`` with its payloads in one object-store object, as PayloadRefs."""
    trajectories = group.trajectories
    stored: Any = store_group([t.payload for t in trajectories])
    if isinstance(stored, PackedRun):
        stored = stored.expand()
    elif all(a is b for a, b in zip(stored, (t.payload for t in trajectories), strict=True)):
        return group  # nothing to store (every payload None)
    return group.replace(
        trajectories=tuple(
            new_trajectory(t.key, t.session_id, t.index, t.tags, payload)
            for t, payload in zip(trajectories, stored, strict=True)
        ),
    )
