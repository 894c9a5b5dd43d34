"""The client/actor protocol of :mod:`stalebuf.ray`: one typed record per operation.

The client builds records (:class:`AddPrompt`, :class:`Put`, ..., :class:`SampleRequest`);
:func:`encode` turns one into a plain tuple for the wire (an int code, then the fields) and the
actor's :func:`decode_op` / :func:`decode_sample` turn it back, refusing a code or a field count
they do not know (a client and an actor of different stalebuf versions) with a clear error.
Each producer record's ``apply`` runs it on the actor's buffer, so what a remote call carries
and what it does are written in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

from ..buffer import GroupStatus, ReplayBuffer
from ..errors import StalebufError
from ._payloads import PackedRun, store_group

__all__ = [
    "PROTOCOL_VERSION",
    "AddPrompt",
    "MarkFailed",
    "MarkFinished",
    "MarkRunning",
    "Op",
    "Outcome",
    "ProtocolError",
    "Put",
    "PutGroup",
    "SampleRequest",
    "Wire",
    "decode_op",
    "decode_sample",
    "encode",
    "store_payloads",
]

#: Bumped whenever a record changes; the client compares it with the actor's on first contact.
PROTOCOL_VERSION = 2

#: A record as it travels: ``(code, *fields)``.
Wire = tuple[Any, ...]


class ProtocolError(StalebufError):
    """A message the other side cannot decode (the client and the actor run different versions)."""


class AddPrompt(NamedTuple):
    """``add_prompt(uid, global_steps=..., partition=..., tags=...)``."""

    uid: str
    global_steps: int
    partition: str
    tags: Mapping[str, Any] | None

    def apply(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``; raises what ``add_prompt_nowait`` raises."""
        buffer.add_prompt_nowait(
            self.uid, global_steps=self.global_steps, partition=self.partition, tags=self.tags
        )


class MarkRunning(NamedTuple):
    """``mark_running(uid)``."""

    uid: str

    def apply(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``; raises what ``mark_running_nowait`` raises."""
        buffer.mark_running_nowait(self.uid)


class Put(NamedTuple):
    """``put(uid, payload, session_id=..., index=..., tags=...)``."""

    uid: str
    payload: Any
    session_id: int
    position: int  # put's ``index`` (a NamedTuple field cannot be called index)
    tags: Mapping[str, Any] | None

    def apply(self, buffer: ReplayBuffer) -> str:
        """Run the operation on ``buffer``; raises what ``put_nowait`` raises."""
        return buffer.put_nowait(
            self.uid, self.payload, session_id=self.session_id, index=self.position, tags=self.tags
        )


class MarkFinished(NamedTuple):
    """``mark_finished(uid)``."""

    uid: str

    def apply(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``; raises what ``mark_finished_nowait`` raises."""
        buffer.mark_finished_nowait(self.uid)


class MarkFailed(NamedTuple):
    """``mark_failed(uid)``."""

    uid: str

    def apply(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``; raises what ``mark_failed_nowait`` raises."""
        buffer.mark_failed_nowait(self.uid)


class PutGroup(NamedTuple):
    """``put_group(uid, payloads, ...)``: payloads as a list, or a PackedRun once stored."""

    uid: str
    payloads: list[Any] | PackedRun
    global_steps: int
    partition: str
    tags: Mapping[str, Any] | None
    trajectory_tags: Sequence[Mapping[str, Any] | None] | None
    session_ids: Sequence[int] | None
    indices: Sequence[int] | None
    status: GroupStatus

    def apply(self, buffer: ReplayBuffer) -> list[str]:
        """Run the operation on ``buffer``; raises what ``put_group_nowait`` raises."""
        payloads = self.payloads
        return buffer.put_group_nowait(
            self.uid,
            payloads.expand() if isinstance(payloads, PackedRun) else payloads,
            global_steps=self.global_steps,
            partition=self.partition,
            tags=self.tags,
            trajectory_tags=self.trajectory_tags,
            session_ids=self.session_ids,
            indices=self.indices,
            status=self.status,
        )


class SampleRequest(NamedTuple):
    """``sample(global_steps, batch_size, partition=..., timeout=...)`` under a request id.

    The id lets the client cancel this very call (see ``BufferHost.cancel_sample``).
    """

    request_id: str
    global_steps: int
    batch_size: int
    partition: str
    timeout: float | None


class Outcome(NamedTuple):
    """The result of one producer operation: ``(True, value)`` or ``(False, the error it raised)``."""

    ok: bool
    value: Any


#: A producer operation.
Op = AddPrompt | MarkRunning | Put | MarkFinished | MarkFailed | PutGroup
_Record = Op | SampleRequest

# The wire code of a record is its position here: append new kinds, never reorder.
_KINDS: tuple[type[_Record], ...] = (
    AddPrompt,
    MarkRunning,
    Put,
    MarkFinished,
    MarkFailed,
    PutGroup,
    SampleRequest,
)
_CODES: dict[type[_Record], int] = {kind: code for code, kind in enumerate(_KINDS)}
_OPS = _KINDS[:6]


def encode(record: _Record) -> Wire:
    """Return ``record`` as it travels: ``(code, *fields)``."""
    return (_CODES[type(record)], *record)


def _decode(wire: object, kinds: tuple[type[_Record], ...]) -> _Record:
    if type(wire) is tuple and wire and type(wire[0]) is int and 0 <= wire[0] < len(_KINDS):
        kind = _KINDS[wire[0]]
        if kind in kinds and len(wire) == len(kind._fields) + 1:
            return kind(*wire[1:])
    raise ProtocolError(
        f"cannot decode a {type(wire).__name__} as one of {', '.join(k.__name__ for k in kinds)} "
        f"(protocol version {PROTOCOL_VERSION}): do the client and the actor run the same stalebuf?"
    )


def decode_op(wire: object) -> Op:
    """Return the producer operation ``wire`` encodes.

    Raises:
        ProtocolError: ``wire`` is not an encoded producer operation of this version.
    """
    return cast(Op, _decode(wire, _OPS))


def decode_sample(wire: object) -> SampleRequest:
    """Return the sample request ``wire`` encodes.

    Raises:
        ProtocolError: ``wire`` is not an encoded sample request of this version.
    """
    return cast(SampleRequest, _decode(wire, (SampleRequest,)))


def store_payloads(ops: Sequence[Op]) -> list[Op]:
    """Return ``ops`` with their payload values stored in the object store: one object per
    operation (a group's payloads, or one ``put``'s), so each is freed as soon as the groups
    that reference it leave the buffer. ``put`` then carries a PayloadRef and ``put_group`` a
    PackedRun (or a list, when some of its payloads were already references)."""
    out: list[Op] = []
    for op in ops:
        if type(op) is Put:
            stored = store_group([op.payload])
            op = op._replace(payload=stored.expand()[0] if isinstance(stored, PackedRun) else stored[0])
        elif type(op) is PutGroup and not isinstance(op.payloads, PackedRun):
            op = op._replace(payloads=store_group(op.payloads))
        out.append(op)
    return out
