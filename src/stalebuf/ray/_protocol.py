"""The client/actor protocol of :mod:`stalebuf.ray`: one typed record per operation.

The client builds records (:class:`AddPrompt`, :class:`Put`, ..., :class:`SampleRequest`);
:func:`encode` turns one into a plain tuple for the wire (an int code, then the fields) and the
actor's :func:`decode_op` / :func:`decode_sample` turn it back, refusing a code or a field count
they do not know (a client and an actor of different stalebuf versions) with a clear error.
Each producer record's ``apply`` runs it on the actor's buffer, so what a remote call carries
and what it does are written in one place; :class:`EndRollout` is the exception, as it names the
group by the rollout's token and the actor ends it through its watch of that very group.

Operations that add a group (:class:`AddPrompt`, :class:`PutGroup`, :class:`OpenRollout`) may carry
a *token*: when admission control has no slot for one, the actor parks it under that token instead
of failing it (the client then collects the result with ``await_admission``, or abandons it).

A :class:`RestoreRequest` is what a new actor restores its buffer from, a :class:`RecoverRequest`
the point of a journal it recovers its buffer at, and a :class:`JournalRequest` the journal its
buffer writes (each travels once, to the actor's constructor).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

import attrs

from .._checkpoint_file import PayloadCodec
from .._versions import check_start_version, trajectory_versions
from ..buffer import GroupStatus, ReplayBuffer
from ..checkpoint import InFlightMode
from ..errors import StalebufError
from ._payloads import PackedRun, store_group, stored_value

__all__ = [
    "FLOW_QUERIES",
    "JOURNAL_WAITING",
    "PROTOCOL_VERSION",
    "AddPrompt",
    "EndRollout",
    "JournalRequest",
    "MarkFailed",
    "MarkFinished",
    "MarkRunning",
    "Op",
    "OpenRollout",
    "Outcome",
    "Parked",
    "ProtocolError",
    "Put",
    "PutGroup",
    "RecoverRequest",
    "RestoreRequest",
    "SampleRequest",
    "WaitingOp",
    "Wire",
    "decode_op",
    "decode_sample",
    "encode",
    "put_op",
    "store_payloads",
]

#: Bumped whenever a record changes; the client compares it with the actor's on first contact.
#: 5: versions, tokens and start versions (MarkRunning, Put, PutGroup, OpenRollout).
#: 6: PutGroup's generation_seconds (the producer's measure of the group's generation time).
#: 7: filters (the actor's constructor) and ``task`` on the flow queries and sampleable_count.
#: 8: SampleRequest's token_budget (a sample by tokens); the token-cap flow queries
#:    ``free_tokens`` and ``capacity_tokens``.
#: 9: the journal: the actor's constructor takes a JournalRequest and a RecoverRequest, the
#:    actor has ``flush``, and ``restored`` (was ``reissued``) also returns ``kept`` and ``dropped``.
PROTOCOL_VERSION = 9
#: The queries the actor's ``flow`` answers (ReplayBuffer methods taking a partition, changing nothing).
FLOW_QUERIES = frozenset(
    {"dispatch_step", "capacity", "free_slots", "full", "explain_wait", "free_tokens", "capacity_tokens"}
)

#: A record as it travels: ``(code, *fields)``.
Wire = tuple[Any, ...]


class ProtocolError(StalebufError):
    """A message the other side cannot decode (the client and the actor run different versions)."""


class AddPrompt(NamedTuple):
    """``add_prompt(uid, global_steps=..., partition=..., tags=...)``; with a ``token`` it may wait
    for admission (``add_prompt``), without one it may not (``add_prompt_nowait``)."""

    token: str | None
    uid: str
    global_steps: int | None
    partition: str
    tags: Mapping[str, Any] | None

    def apply(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``; raises what ``add_prompt_nowait`` raises."""
        buffer.add_prompt_nowait(
            self.uid, global_steps=self.global_steps, partition=self.partition, tags=self.tags
        )

    async def apply_waiting(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``, waiting for admission; raises what ``add_prompt`` raises."""
        await buffer.add_prompt(
            self.uid, global_steps=self.global_steps, partition=self.partition, tags=self.tags
        )


class MarkRunning(NamedTuple):
    """``mark_running(uid, version=...)``."""

    uid: str
    version: int | None

    def apply(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``; raises what ``mark_running_nowait`` raises."""
        buffer.mark_running_nowait(self.uid, version=self.version)

    async def apply_waiting(self, buffer: ReplayBuffer) -> None:
        """Run it waiting while the journal's writer is behind; raises what ``mark_running`` raises."""
        await buffer.mark_running(self.uid, version=self.version)


class Put(NamedTuple):
    """``put(uid, payload, session_id=..., index=..., tags=..., versions=..., tokens=...)``."""

    uid: str
    payload: Any
    session_id: int
    position: int  # put's ``index`` (a NamedTuple field cannot be called index)
    tags: Mapping[str, Any] | None
    versions: Sequence[tuple[int, int]] | None
    tokens: int | None

    def apply(self, buffer: ReplayBuffer) -> str:
        """Run the operation on ``buffer``; raises what ``put_nowait`` raises."""
        return buffer.put_nowait(
            self.uid,
            self.payload,
            session_id=self.session_id,
            index=self.position,
            tags=self.tags,
            versions=self.versions,
            tokens=self.tokens,
        )

    async def apply_waiting(self, buffer: ReplayBuffer) -> str:
        """Run it waiting while the journal's writer is behind; raises what ``put`` raises."""
        return await buffer.put(
            self.uid,
            self.payload,
            session_id=self.session_id,
            index=self.position,
            tags=self.tags,
            versions=self.versions,
            tokens=self.tokens,
        )


def put_op(
    uid: str,
    payload: Any,
    session_id: int,
    index: int,
    tags: Mapping[str, Any] | None,
    versions: Sequence[tuple[int, int]] | None,
    tokens: int | None,
) -> Put:
    """The :class:`Put` a client sends: tags as a plain dict (a mappingproxy does not pickle;
    anything else goes as it is, for the actor to refuse with the local error), versions and
    tokens checked and copied as the local ``put`` takes them (a tuple of int pairs and an int
    travel, whatever sequence was given).

    Raises:
        TypeError, ValueError: ``versions`` or ``tokens`` as the local ``put`` refuses them.
    """
    plain = dict(tags) if isinstance(tags, Mapping) else tags
    if versions is not None or tokens is not None:
        segments, count = trajectory_versions(versions, tokens)
        versions, tokens = segments or None, count
    return Put(uid, payload, session_id, index, plain, versions, tokens)


class MarkFinished(NamedTuple):
    """``mark_finished(uid)``."""

    uid: str

    def apply(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``; raises what ``mark_finished_nowait`` raises."""
        buffer.mark_finished_nowait(self.uid)

    async def apply_waiting(self, buffer: ReplayBuffer) -> None:
        """Run it waiting while the journal's writer is behind; raises what ``mark_finished`` raises."""
        await buffer.mark_finished(self.uid)


class MarkFailed(NamedTuple):
    """``mark_failed(uid)``."""

    uid: str

    def apply(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``; raises what ``mark_failed_nowait`` raises."""
        buffer.mark_failed_nowait(self.uid)

    async def apply_waiting(self, buffer: ReplayBuffer) -> None:
        """Run it waiting while the journal's writer is behind; raises what ``mark_failed`` raises."""
        await buffer.mark_failed(self.uid)


class PutGroup(NamedTuple):
    """``put_group(uid, payloads, ...)``: payloads as a list, or a PackedRun once stored; with a
    ``token`` a new group may wait for admission."""

    token: str | None
    uid: str
    payloads: list[Any] | PackedRun
    global_steps: int | None
    partition: str
    tags: Mapping[str, Any] | None
    trajectory_tags: Sequence[Mapping[str, Any] | None] | None
    session_ids: Sequence[int] | None
    indices: Sequence[int] | None
    status: GroupStatus
    versions: Sequence[Sequence[tuple[int, int]] | None] | None
    tokens: Sequence[int | None] | None
    version: int | None
    generation_seconds: float | None

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
            versions=self.versions,
            tokens=self.tokens,
            version=self.version,
            generation_seconds=self.generation_seconds,
        )

    async def apply_waiting(self, buffer: ReplayBuffer) -> list[str]:
        """Run the operation on ``buffer``, waiting for admission; raises what ``put_group`` raises."""
        payloads = self.payloads
        return await buffer.put_group(
            self.uid,
            payloads.expand() if isinstance(payloads, PackedRun) else payloads,
            global_steps=self.global_steps,
            partition=self.partition,
            tags=self.tags,
            trajectory_tags=self.trajectory_tags,
            session_ids=self.session_ids,
            indices=self.indices,
            status=self.status,
            versions=self.versions,
            tokens=self.tokens,
            version=self.version,
            generation_seconds=self.generation_seconds,
        )


class OpenRollout(NamedTuple):
    """Enter a remote ``rollout()``: ``add_prompt`` (waiting for admission under ``token``), then
    ``mark_running`` (with the start ``version``, checked by the client). The actor then watches
    the group for its client (see ``_watches``)."""

    token: str
    uid: str
    global_steps: int | None
    partition: str
    tags: Mapping[str, Any] | None
    version: int | None

    def apply(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``; raises what ``add_prompt_nowait`` raises (or what
        ``mark_running_nowait`` raises for a bad ``version``, before anything is added)."""
        version = None if self.version is None else check_start_version(self.version)
        buffer.add_prompt_nowait(
            self.uid, global_steps=self.global_steps, partition=self.partition, tags=self.tags
        )
        buffer.mark_running_nowait(self.uid, version=version)  # just added: cannot fail

    async def apply_waiting(self, buffer: ReplayBuffer) -> None:
        """Run the operation on ``buffer``, waiting for admission; raises what ``add_prompt`` raises
        (or what ``mark_running`` raises for a bad ``version``, before anything waits)."""
        version = None if self.version is None else check_start_version(self.version)
        await buffer.add_prompt(
            self.uid, global_steps=self.global_steps, partition=self.partition, tags=self.tags
        )
        # Admitted, nothing ran since: this very group. Starting it waits while the journal's
        # writer is behind (the admission wait does not look at it); a failed wait fails the
        # group, which holds an admission slot now.
        watch = buffer.watch(self.uid, _ignore)
        try:
            await buffer.mark_running(self.uid, version=version)
        except BaseException:
            buffer.end_watched(watch, finished=False)
            raise


def _ignore() -> None:
    """A watch callback that does nothing (the actor's own watch of the group comes next)."""


class EndRollout(NamedTuple):
    """Leave a remote ``rollout()``: finish or fail the group the block entered under ``token``
    if that very group is still in flight (never a later group that reuses its uid). The actor
    applies it through its watch of the group (``RolloutWatches.end``), so it has no ``apply``."""

    token: str
    finished: bool


class SampleRequest(NamedTuple):
    """``sample(global_steps, batch_size, token_budget=..., partition=..., timeout=...)`` under a
    request id (exactly one of ``batch_size`` and ``token_budget`` is None).

    The id lets the client cancel this very call (see ``BufferHost.cancel_sample``).
    """

    request_id: str
    global_steps: int
    batch_size: int | None
    partition: str
    timeout: float | None
    token_budget: int | None = None

    def sample_options(self) -> dict[str, Any]:
        """The keyword arguments of the ``sample`` call it asks for."""
        return {"token_budget": self.token_budget, "partition": self.partition, "timeout": self.timeout}


@attrs.frozen
class RestoreRequest:
    """What a new actor restores its buffer from (sent to its constructor).

    Attributes:
        path: the checkpoint file, on the actor's node.
        in_flight: as for ``ReplayBuffer.restore`` ("reissue", "keep", "evict" or "resume").
        payload_codec: as for ``ReplayBuffer.restore``.
        store: put each restored group's payloads in the object store (False: keep the values,
            the client's ``payloads="inline"`` mode).
    """

    path: str
    in_flight: InFlightMode
    payload_codec: PayloadCodec | None
    store: bool


@attrs.frozen
class JournalRequest:
    """The journal a new actor's buffer writes (sent to its constructor).

    Attributes:
        path: the journal file, on the actor's node (absolute).
        interval, retention_steps, max_pending_bytes: ``journal_interval``,
            ``journal_retention_steps`` and ``journal_max_pending_bytes`` of ``ReplayBuffer``.
        payload_codec: the user's codec for the payloads' bytes (None: pickle).
        store: a recovered payload goes back into the object store (False: the value is kept,
            the client's ``payloads="inline"`` mode).
    """

    path: str
    interval: float
    retention_steps: int
    max_pending_bytes: int
    payload_codec: PayloadCodec | None
    store: bool


@attrs.frozen
class RecoverRequest:
    """Where in its journal (the actor's :class:`JournalRequest`) a new actor recovers its buffer.

    Attributes:
        global_steps: as for ``ReplayBuffer.recover`` (None: the journal's last commit).
        partition: the partition whose ``sample(global_steps)`` is the recovery point.
        in_flight: as for ``ReplayBuffer.recover``.
    """

    global_steps: int | None
    partition: str
    in_flight: InFlightMode


class Parked(NamedTuple):
    """What an operation that must wait for admission returns at once: the token the actor
    parked it under (collect its result with ``await_admission(token)``)."""

    token: str


class Outcome(NamedTuple):
    """The result of one producer operation: ``(True, value)`` or ``(False, the error it raised)``."""

    ok: bool
    value: Any


#: A producer operation.
Op = AddPrompt | MarkRunning | Put | MarkFinished | MarkFailed | PutGroup | OpenRollout | EndRollout
#: The operations that may wait for admission (they carry a token).
WaitingOp = AddPrompt | PutGroup | OpenRollout
#: The operations whose ``*_nowait`` form raises BufferFullError only while the buffer's journal's
#: writer is behind (the client's ``mark_running``, ``put``, ``mark_finished`` and ``mark_failed``,
#: which wait for it, as the local async calls do).
JOURNAL_WAITING = (MarkRunning, Put, MarkFinished, MarkFailed)
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
    OpenRollout,
    EndRollout,
)
_CODES: dict[type[_Record], int] = {kind: code for code, kind in enumerate(_KINDS)}
_OPS = tuple(kind for kind in _KINDS if kind is not SampleRequest)


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
            op = op._replace(payload=stored_value(op.payload))
        elif type(op) is PutGroup and not isinstance(op.payloads, PackedRun):
            op = op._replace(payloads=store_group(op.payloads))
        out.append(op)
    return out
