"""Payloads in the Ray object store: the reference type the buffer keeps, and every conversion
between payload values and references, both ways (storing a group's payloads, resolving a batch,
fetching the values of groups to save them).

Producers never send payload bytes through the buffer actor (except in ``payloads="inline"``
mode): the client ``ray.put``\\ s them and the buffer only keeps references. One ``ray.put``
carries the payloads of one group (or of one ``put``), so each trajectory's payload is a
:class:`PayloadRef` naming its item in that stored list, and the object is freed once the
group has left the buffer and nobody else holds its references. A producer may also pass
its own ``ray.ObjectRef`` as a payload; it is kept as it is.

A reference means nothing after a restart, so a checkpoint holds values: the actor's ``save``
fetches them (:func:`checkpoint_values`), and a restored group's payloads go back into the object
store, one object per group (:func:`stored`). So does a journal: its writer thread fetches each
payload's value as it writes it, and a recovering actor stores each payload it reads back
(:class:`JournalCodec`).
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import anyio
import attrs
import ray
from ray.exceptions import RayError

from .._checkpoint_file import PayloadCodec
from .._stored import map_payloads, peek_trajectories
from .._validation import describe_error
from ..checkpoint import BufferCheckpoint
from ..errors import CheckpointError
from ..records import Batch, Group, Status, new_trajectory

__all__ = [
    "JournalCodec",
    "PackedRun",
    "PayloadRef",
    "checkpoint_values",
    "fetch_values",
    "resolve",
    "resolve_sync",
    "store_group",
    "stored",
    "stored_checkpoint",
    "stored_value",
    "unique_refs",
    "with_values",
]

_IN_FLIGHT = (Status.PENDING, Status.RUNNING)


@attrs.frozen(weakref_slot=False)
class PayloadRef:
    """A trajectory payload stored in the Ray object store: item ``index`` of the list under ``ref``.

    The buffer keeps these instead of payloads, so payload bytes never pass through the
    buffer actor. Resolve a whole batch with :func:`resolve` (one call, one fetch per stored
    object); a single reference with :meth:`get`. Holding a PayloadRef keeps the stored
    object alive, and the object is freed when no reference to it is left anywhere.

    Attributes:
        ref: the object that holds a list of payloads.
        index: the position of this payload in that list.
    """

    ref: ray.ObjectRef[Any]
    index: int

    def __reduce__(self) -> tuple[type[PayloadRef], tuple[ray.ObjectRef[Any], int]]:
        """Pickle as ``PayloadRef(ref, index)`` (cheaper than attrs' slot state)."""
        return (PayloadRef, (self.ref, self.index))

    def get(self, *, timeout: float | None = None) -> Any:
        """Fetch and return the payload, blocking (numpy arrays come back zero-copy, read-only).

        Raises:
            ray.exceptions.GetTimeoutError: ``timeout`` seconds passed first.
            ray.exceptions.ObjectLostError: the object is gone, e.g. ``OwnerDiedError`` when the
                process that stored it (see ``payloads=`` of RemoteReplayBuffer) exited.
        """
        return ray.get(self.ref, timeout=timeout)[self.index]


def _is_stored(payload: object) -> bool:
    return payload is None or isinstance(payload, (PayloadRef, ray.ObjectRef))


class PackedRun(NamedTuple):
    """Payloads stored as items ``start`` to ``stop - 1`` of the list under ``ref``: how a whole
    group's payloads travel to the actor (one small object instead of a PayloadRef each)."""

    ref: ray.ObjectRef[Any]
    start: int
    stop: int

    def expand(self) -> list[PayloadRef]:
        """Return the PayloadRefs this run stands for."""
        ref = self.ref
        return [PayloadRef(ref, i) for i in range(self.start, self.stop)]


def store_group(payloads: Sequence[Any]) -> list[Any] | PackedRun:
    """Store the payloads of one group (or of one ``put``) that are not None, an ObjectRef or a
    PayloadRef, all with one ``ray.put``. Return a PackedRun when all of them were stored now,
    else the list with the stored ones replaced by PayloadRefs (or as it is, if none were).

    One object per group, never one shared by several groups: an object is freed only when no
    reference to any of its items is left, so a shared one would stay as long as its longest-
    resident group.
    """
    todo = [i for i, value in enumerate(payloads) if not _is_stored(value)]
    if not todo:
        return list(payloads)
    ref = ray.put([payloads[i] for i in todo])
    if len(todo) == len(payloads):
        return PackedRun(ref, 0, len(todo))
    items = list(payloads)
    for position, i in enumerate(todo):
        items[i] = PayloadRef(ref, position)
    return items


def stored_value(value: Any) -> Any:
    """Return ``value`` stored in the object store on its own, as a PayloadRef (None, an
    ObjectRef or a PayloadRef as it is)."""
    stored = store_group([value])
    return stored.expand()[0] if isinstance(stored, PackedRun) else stored[0]


class JournalCodec:
    """The payload codec an actor's buffer journals with: a payload held as a reference is
    written as its value, and one read back is stored again.

    A journal outlives the actor, the references do not, so :meth:`encode` (which the journal's
    writer thread calls, once per trajectory, group by group) fetches the value of a PayloadRef
    or an ObjectRef, blocking that thread (never the actor's event loop: hence the reference's
    ``future()``, not ``ray.get``, which warns in any thread of an async actor); it keeps the
    last object fetched, so a group stored as one object is fetched once. The
    value's bytes are the user's ``encode`` or, without a codec, ``pickle.dumps``. :meth:`decode`
    (a recovering actor, as it reads the journal) turns bytes back into the value and, with
    ``store``, stores it in the object store, one object per trajectory, owned by the actor.

    Args:
        codec: the user's ``(encode, decode)``, or None for pickle.
        store: store decoded values (False: keep them, for ``payloads="inline"``).
    """

    __slots__ = ("_codec", "_last", "_store")

    def __init__(self, codec: PayloadCodec | None, store: bool) -> None:
        self._codec = codec
        self._store = store
        self._last: tuple[ray.ObjectRef[Any], Any] | None = None

    def pair(self) -> PayloadCodec:
        """Return ``(encode, decode)``, the form ``ReplayBuffer``'s ``payload_codec`` takes."""
        return (self.encode, self.decode)

    def encode(self, payload: Any) -> bytes:
        """Return the bytes of ``payload``'s value (fetched if it is a reference).

        Raises:
            ray.exceptions.RayError: the object is lost (e.g. its owner, a producer, died).
            Exception: what the user's ``encode`` raised.
        """
        if isinstance(payload, PayloadRef):
            last = self._last
            if last is None or last[0] != payload.ref:
                last = self._last = (payload.ref, payload.ref.future().result())
            value = last[1][payload.index]
        elif isinstance(payload, ray.ObjectRef):
            value = payload.future().result()
        else:
            value = payload
        if self._codec is None:
            return pickle.dumps(value, protocol=5)
        return self._codec[0](value)

    def decode(self, data: bytes) -> Any:
        """Return the payload ``data`` holds: its value, stored in the object store with ``store``.

        Raises:
            Exception: what unpickling or the user's ``decode`` raised.
        """
        value = pickle.loads(data) if self._codec is None else self._codec[1](data)
        return stored_value(value) if self._store else value


def unique_refs(payloads: Iterable[Any]) -> list[ray.ObjectRef[Any]]:
    """Return the distinct stored objects that ``payloads`` reference (PayloadRefs and ObjectRefs)."""
    seen: dict[ray.ObjectRef[Any], None] = {}
    for payload in payloads:
        if isinstance(payload, PayloadRef):
            seen[payload.ref] = None
        elif isinstance(payload, ray.ObjectRef):
            seen[payload] = None
    return list(seen)


def with_values(group: Group, by_ref: Mapping[ray.ObjectRef[Any], Any]) -> Group:
    """Return ``group`` with each referencing payload replaced by its value from ``by_ref``
    (every other field, ``finish_step`` and ``generation_seconds`` included, kept)."""

    def value_of(payload: Any) -> Any:
        if isinstance(payload, PayloadRef):
            return by_ref[payload.ref][payload.index]
        if isinstance(payload, ray.ObjectRef):
            return by_ref[payload]
        return payload

    return map_payloads(group, value_of)


def stored(group: Group) -> Group:
    """Return ``group`` with its payloads in one object-store object, as PayloadRefs (``group``
    itself when there is nothing to store: every payload None or already a reference)."""
    trajectories = group.trajectories
    payloads: Any = store_group([t.payload for t in trajectories])
    if isinstance(payloads, PackedRun):
        payloads = payloads.expand()
    elif all(a is b for a, b in zip(payloads, (t.payload for t in trajectories), strict=True)):
        return group
    return group.replace(
        trajectories=tuple(
            new_trajectory(t.key, t.session_id, t.index, t.tags, payload, t.versions, t.tokens)
            for t, payload in zip(trajectories, payloads, strict=True)
        ),
    )


def stored_checkpoint(checkpoint: BufferCheckpoint, *, keep_in_flight: bool) -> BufferCheckpoint:
    """Return ``checkpoint`` with each group's payloads :func:`stored`, for a restoring actor;
    without ``keep_in_flight``, in-flight groups are left as they are (a restore discards their
    trajectories or evicts them)."""
    groups = tuple(
        stored(group) if keep_in_flight or group.status not in _IN_FLIGHT else group
        for group in checkpoint.groups
    )
    return attrs.evolve(checkpoint, groups=groups)


async def fetch_values(groups: tuple[Group, ...]) -> tuple[Group, ...]:
    """Return ``groups`` with every payload held as an object reference (PayloadRef or
    ``ray.ObjectRef``) replaced by its value, all fetched into this process at once; ``groups``
    itself when none is. Lazily stored groups are read without building their records.

    Raises:
        ray.exceptions.RayError: a payload object is lost (e.g. its owner, a producer, died).
    """
    refs = unique_refs(t.payload for group in groups for t in peek_trajectories(group))
    if not refs:
        return groups
    values = await asyncio.gather(*refs)
    by_ref = dict(zip(refs, values, strict=True))
    return tuple(with_values(group, by_ref) for group in groups)


async def checkpoint_values(checkpoint: BufferCheckpoint) -> BufferCheckpoint:
    """Return ``checkpoint`` with its payloads by value (see :func:`fetch_values`), ready to save.

    Raises:
        CheckpointError: a payload object is lost (e.g. its owner, a producer, died).
    """
    try:
        groups = await fetch_values(checkpoint.groups)
    except RayError as exc:
        raise CheckpointError(
            f"cannot save the buffer: a payload it holds is lost ({type(exc).__name__}: "
            f"{describe_error(exc)}); nothing was written"
        ) from exc
    return checkpoint if groups is checkpoint.groups else attrs.evolve(checkpoint, groups=groups)


def _substitute(batch: Batch, refs: Sequence[ray.ObjectRef[Any]], values: Sequence[Any]) -> Batch:
    by_ref = dict(zip(refs, values, strict=True))
    groups = tuple(with_values(group, by_ref) for group in batch.groups)
    return attrs.evolve(batch, groups=groups)  # every other field (T, S, masks) kept


async def resolve(batch: Batch, *, timeout: float | None = None) -> Batch:
    """Return a copy of ``batch`` whose payloads are the stored values instead of references.

    Every :class:`PayloadRef` and ``ray.ObjectRef`` payload is fetched, each distinct stored
    object once, all concurrently; other payloads (None, or values kept inline) are left as
    they are. numpy arrays come back zero-copy: read-only views of the object store's shared
    memory on this node (``.copy()`` one to write to it). Needs a running asyncio loop.

    Raises:
        TimeoutError: ``timeout`` seconds passed first.
        ray.exceptions.ObjectLostError: a stored object is gone, e.g. ``OwnerDiedError`` when the
            producer process that stored it exited (see ``payloads=`` of RemoteReplayBuffer).
    """
    refs = unique_refs(batch.payloads)
    if not refs:
        return batch
    with anyio.fail_after(timeout):
        values = await asyncio.gather(*refs)
    return _substitute(batch, refs, values)


def resolve_sync(batch: Batch, *, timeout: float | None = None) -> Batch:
    """The blocking twin of :func:`resolve`, for code without an event loop (one ``ray.get``).

    Raises:
        ray.exceptions.GetTimeoutError: ``timeout`` seconds passed first (a TimeoutError).
        ray.exceptions.ObjectLostError: a stored object is gone (see :func:`resolve`).
    """
    refs = unique_refs(batch.payloads)
    if not refs:
        return batch
    return _substitute(batch, refs, ray.get(refs, timeout=timeout))
