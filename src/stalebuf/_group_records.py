"""Immutable value records of groups: statuses, trajectories and groups.

Users import them from :mod:`stalebuf.records` (which also holds batches and evictions, from
``_batch.py``); they are documented, pickled and shown under that name, so pickles and
checkpoint files name ``stalebuf.records`` whichever module defines a record.
"""

from __future__ import annotations

import collections
import enum
import struct
from collections.abc import Mapping, Sequence
from functools import partial
from itertools import repeat
from operator import itemgetter
from types import MappingProxyType
from typing import Any

__all__ = [
    "EMPTY_TAGS",
    "Group",
    "Status",
    "Trajectory",
    "default_keys",
    "default_records",
    "new_group",
    "new_trajectory",
    "pack_runs",
    "record_repr",
    "tags_for_pickle",
]

#: The tags of a record created without tags: one shared, read-only empty mapping,
#: so that a million untagged trajectories cost no million empty dicts.
EMPTY_TAGS: Mapping[str, Any] = MappingProxyType({})


class Status(enum.Enum):
    """The lifecycle of a group: PENDING -> RUNNING -> FINISHED or FAILURE."""

    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    FAILURE = "failure"

    @property
    def is_terminal(self) -> bool:
        """True for FINISHED and FAILURE: the group takes no more writes."""
        return self is Status.FINISHED or self is Status.FAILURE


# Trajectory and Group are immutable tuple subclasses, not attrs classes: a buffer builds
# eight trajectories and a group for every group it admits, and tuple.__new__ builds a record
# in one C call, where attrs' frozen __init__ routes every field through a setter. They still
# have named, read-only fields, and like the other records that carry payloads they compare
# and hash by identity: comparing payloads such as numpy arrays field by field is ambiguous,
# and identity is what "the same group" means.


#: The C field accessor namedtuple uses: as fast as a slot, where property(itemgetter(i)) costs
#: a call per read (``collections`` falls back to exactly that on interpreters without it).
_field: Any = getattr(collections, "_tuplegetter", lambda index, doc: property(itemgetter(index), doc=doc))


def record_repr(record: Any, name: str) -> str:
    """``Name(field=value, ...)`` of a tuple-based record, over its ``_fields``."""
    values = ", ".join(f"{field}={getattr(record, field)!r}" for field in record._fields)
    return f"{name}({values})"


def _repr(self: Any) -> str:
    return record_repr(self, type(self).__name__)


class Trajectory(tuple):  # type: ignore[type-arg]
    """One rollout session's output: a payload plus its key and tags (immutable).

    Attributes:
        key: ``f"{uid}_{session_id}_{index}"``, unique in the buffer.
        session_id: the rollout session (one of the group's n samples).
        index: the position of this piece within the session (multi-turn rollouts).
        tags: read-only metadata given to ``put`` (empty when none was given).
        payload: whatever the producer stored; the buffer never looks at it.
        versions: run-length ``(version, n_tokens)`` pairs in generation order: the policy
            version (a trainer step) that generated each run of tokens; ``()`` when none
            were given (its tokens then count at the group's start version).
        tokens: its token count (the sum of the runs when ``versions`` was given; 0 when
            neither was given).
    """

    __slots__ = ()
    # Identity equality and a readable repr, as class attributes rather than from a shared base
    # class (which would put LazyGroup four levels deep).
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__
    __repr__ = _repr
    _fields = ("key", "session_id", "index", "tags", "payload", "versions", "tokens")
    #: The tuple's length: the fields, then the versions packed for the batch arrays.
    SLOTS = 8

    def __new__(
        cls,
        key: str,
        session_id: int,
        index: int,
        tags: Mapping[str, Any],
        payload: Any,
        versions: tuple[tuple[int, int], ...] = (),
        tokens: int = 0,
    ) -> Trajectory:
        """Build a trajectory record (unchecked: the buffer checks what producers give)."""
        return tuple.__new__(
            cls, (key, session_id, index, tags, payload, versions, tokens, pack_runs(versions))
        )

    key: str = _field(0, "The key, ``f'{uid}_{session_id}_{index}'``.")
    session_id: int = _field(1, "The rollout session.")
    index: int = _field(2, "The piece of the session.")  # type: ignore[assignment]
    tags: Mapping[str, Any] = _field(3, "Read-only metadata.")
    payload: Any = _field(4, "What the producer stored.")
    versions: tuple[tuple[int, int], ...] = _field(5, "Run-length ``(version, n_tokens)`` pairs.")
    tokens: int = _field(6, "The token count.")
    # The versions as native int64 (version, n_tokens) pairs: a batch joins these bytes into its
    # run arrays in C, where reading the pairs back from tuples cost ~2 us per trajectory.
    _runs: bytes = _field(7, "The versions, packed.")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: the read-only tags travel as a plain dict (and a trajectory without
        tokens pickles as files written before versions existed hold it)."""
        fields = (self.key, self.session_id, self.index, _plain(self.tags), self.payload)
        if self.tokens or self.versions:
            return (_trajectory, (*fields, self.versions, self.tokens))
        return (_trajectory, fields)


class Group(tuple):  # type: ignore[type-arg]
    """A group as the buffer hands it out: one prompt and its trajectories (immutable).

    Attributes:
        uid: the group's id, unique among groups in the buffer.
        partition: the partition it was added to (e.g. "train", "val").
        dispatch_step: the trainer step at which the prompt was dispatched (its tag).
        status: FINISHED or FAILURE (PENDING or RUNNING for groups evicted in flight or saved
            in flight by a checkpoint).
        tags: read-only metadata given to ``add_prompt``.
        trajectories: the group's trajectories, in ``put`` order.
        finish_step: the partition's dispatch clock when the group finished (or was evicted in
            flight), and at least ``dispatch_step``; ``finish_step - dispatch_step`` is how many
            trainer steps it generated for.
        generation_seconds: wall-clock seconds from ``add_prompt`` to finish (or eviction).
        start_version: the policy version at which generation of the group started (its first
            token): ``mark_running(version=)``, ``put_group(version=)``, else the dispatch step.
    """

    __slots__ = ()
    # Identity equality and a readable repr, as class attributes rather than from a shared base
    # class (which would put LazyGroup four levels deep).
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__
    __repr__ = _repr
    _fields = (
        "uid",
        "partition",
        "dispatch_step",
        "status",
        "tags",
        "trajectories",
        "finish_step",
        "generation_seconds",
        "start_version",
    )

    def __new__(
        cls,
        uid: str,
        partition: str,
        dispatch_step: int,
        status: Status,
        tags: Mapping[str, Any],
        trajectories: tuple[Trajectory, ...],
        finish_step: int = 0,
        generation_seconds: float = 0.0,
        start_version: int | None = None,
    ) -> Group:
        """Build a group record (``start_version`` None: its dispatch step)."""
        if start_version is None:
            start_version = dispatch_step
        return tuple.__new__(
            cls,
            (
                uid,
                partition,
                dispatch_step,
                status,
                tags,
                trajectories,
                finish_step,
                generation_seconds,
                start_version,
            ),
        )

    uid: str = _field(0, "The group's id.")
    partition: str = _field(1, "Its partition.")
    dispatch_step: int = _field(2, "The step it was dispatched at.")
    status: Status = _field(3, "Its status.")
    tags: Mapping[str, Any] = _field(4, "Read-only metadata.")
    trajectories: tuple[Trajectory, ...] = _field(5, "Its trajectories, in ``put`` order.")
    finish_step: int = _field(6, "The clock when it finished.")
    generation_seconds: float = _field(7, "Seconds from add to finish.")
    start_version: int = _field(8, "The version generation started at.")
    # The trajectories as stored: the records here, the payloads in a LazyGroup (_lazy_group.py;
    # both have the group's len(); a field accessor reads the slot itself, past any override).
    _stored: Any = _field(5, "The trajectories as stored.")

    @property
    def global_steps(self) -> int:
        """The dispatch step: an alias of :attr:`dispatch_step`, the name verl uses."""
        return self.dispatch_step

    def replace(self, **changes: Any) -> Group:
        """Return a copy with the given fields changed (like ``attrs.evolve``); unless changed,
        it holds the same trajectory records."""
        values = dict(zip(self._fields, self._values(), strict=True))
        values.update(changes)
        return Group(**values)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: the read-only tags travel as a plain dict (and a group that starts at
        its dispatch step pickles as files written before versions existed hold it)."""
        fields = (self.uid, self.partition, self.dispatch_step, self.status, _plain(self.tags))
        rest = (self.trajectories, self.finish_step, self.generation_seconds)
        if self.start_version != self.dispatch_step:
            return (_group, (*fields, *rest, self.start_version))
        return (_group, (*fields, *rest))

    # -- the trajectories as stored: read without building lazily stored records --------

    def _values(self) -> tuple[Any, ...]:
        """The field values, the trajectories as records."""
        return tuple(tuple.__iter__(self))

    def _peek(self) -> tuple[Trajectory, ...]:
        """The trajectory records; a lazily stored group builds them without keeping them."""
        return self._stored  # type: ignore[no-any-return]

    def _stored_keys(self) -> Sequence[str]:
        return [t.key for t in self._stored]

    def _stored_tags(self) -> Sequence[Mapping[str, Any]]:
        return [t.tags for t in self._stored]

    def _stored_payloads(self) -> Sequence[Any]:
        return [t.payload for t in self._stored]


#: How many sessions :data:`DEFAULT_KEY_SUFFIXES` covers.
DEFAULT_KEY_SESSIONS = 64
#: What follows the uid in the key of trajectory ``(session, 0)`` for the first sessions:
#: ``f"_{session}_0"``. Formatting two ints is most of what making a key costs.
DEFAULT_KEY_SUFFIXES = tuple(f"_{session}_0" for session in range(DEFAULT_KEY_SESSIONS))


def pack_runs(versions: tuple[tuple[int, int], ...]) -> bytes:
    """``versions`` as native int64 ``(version, n_tokens)`` pairs (``b""`` for none)."""
    if not versions:
        return b""
    return struct.pack(f"={2 * len(versions)}q", *[value for pair in versions for value in pair])


def default_keys(uid: str, count: int) -> list[str]:
    """The keys of trajectories ``0..count-1`` of ``uid`` with default session ids and indices:
    ``f"{uid}_{i}_0"``, built by C-level loops."""
    if count <= DEFAULT_KEY_SESSIONS:
        return list(map(uid.__add__, DEFAULT_KEY_SUFFIXES[:count]))
    return [f"{uid}_{i}_0" for i in range(count)]


_new_trajectory_from = partial(tuple.__new__, Trajectory)


def default_records(uid: str, payloads: tuple[Any, ...]) -> tuple[Trajectory, ...]:
    """The records of ``payloads`` under default keys (session ``i``, index 0, no tags)."""
    count = len(payloads)
    rows = zip(
        default_keys(uid, count),
        range(count),
        repeat(0),
        repeat(EMPTY_TAGS),
        payloads,
        repeat(()),
        repeat(0),
        repeat(b""),
    )
    return tuple(map(_new_trajectory_from, rows))


class LazyTrajectories:
    """A lazily stored group's trajectories as pickles up to f169765 hold them (uid, payloads,
    built records or None); only loading such a pickle makes one."""

    __slots__ = ("built", "payloads", "uid")

    def __init__(
        self, uid: str, payloads: tuple[Any, ...], built: tuple[Trajectory, ...] | None = None
    ) -> None:
        self.uid = uid
        self.payloads = payloads
        self.built = built

    def records(self) -> tuple[Trajectory, ...]:
        """The group's records: the built ones if any (a pickle holding one of them too shares
        it), else the payloads' under default keys."""
        return default_records(self.uid, self.payloads) if self.built is None else self.built


# Fast constructors for the buffer's hot paths: the tuple-based records are built by
# tuple.__new__ in one C call. Each builds exactly what the class's own constructor builds, and
# tests compare the two.
_tuple_new = tuple.__new__


def new_trajectory(
    key: str,
    session_id: int,
    index: int,
    tags: Mapping[str, Any],
    payload: Any,
    versions: tuple[tuple[int, int], ...] = (),
    tokens: int = 0,
) -> Trajectory:
    """Return ``Trajectory(key, session_id, index, tags, payload, versions, tokens)``, built faster."""
    return _tuple_new(
        Trajectory, (key, session_id, index, tags, payload, versions, tokens, pack_runs(versions))
    )


def new_group(
    uid: str,
    partition: str,
    dispatch_step: int,
    status: Status,
    tags: Mapping[str, Any],
    trajectories: tuple[Trajectory, ...],
    finish_step: int,
    generation_seconds: float,
    start_version: int | None = None,
) -> Group:
    """Return ``Group(uid, partition, dispatch_step, status, tags, trajectories, finish_step,
    generation_seconds, start_version)``, built faster."""
    if start_version is None:
        start_version = dispatch_step
    return _tuple_new(
        Group,
        (
            uid,
            partition,
            dispatch_step,
            status,
            tags,
            trajectories,
            finish_step,
            generation_seconds,
            start_version,
        ),
    )


def _plain(tags: Mapping[str, Any]) -> dict[str, Any] | None:
    return dict(tags) if tags else None


def _frozen_tags(tags: dict[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(tags) if tags else EMPTY_TAGS


class _TagsInPickle:
    """A record's read-only tags on their way into a pickle, which they leave as read-only tags."""

    __slots__ = ("tags",)

    def __init__(self, tags: Mapping[str, Any]) -> None:
        self.tags = tags

    def __reduce__(self) -> tuple[Any, ...]:
        return (_frozen_tags, (_plain(self.tags),))


# One for every untagged record: a pickle then holds it once and loads it as EMPTY_TAGS once.
_NO_TAGS_IN_PICKLE = _TagsInPickle(EMPTY_TAGS)


def tags_for_pickle(tags: Mapping[str, Any]) -> object:
    """Return what a pickle holds for a record's read-only ``tags`` (a MappingProxyType cannot
    be pickled): it unpickles as read-only tags equal to them, EMPTY_TAGS for empty ones."""
    return _TagsInPickle(tags) if tags else _NO_TAGS_IN_PICKLE


def _trajectory(
    key: str,
    session_id: int,
    index: int,
    tags: dict[str, Any] | None,
    payload: Any,
    versions: tuple[tuple[int, int], ...] = (),
    tokens: int = 0,
) -> Trajectory:
    return new_trajectory(key, session_id, index, _frozen_tags(tags), payload, versions, tokens)


def _group(
    uid: str,
    partition: str,
    dispatch_step: int,
    status: Status,
    tags: dict[str, Any] | None,
    trajectories: tuple[Trajectory, ...] | LazyTrajectories,
    finish_step: int,
    generation_seconds: float,
    start_version: int | None = None,
) -> Group:
    # start_version: absent from pickles written before versions existed (the dispatch step).
    if isinstance(trajectories, LazyTrajectories):
        # A lazily stored group from an older pickle: loaded as the eager group of the same
        # records (a lazy group pickles through _lazy_group.new_lazy_group now, and records.py
        # cannot build one without importing the module that builds on it).
        trajectories = trajectories.records()
    return new_group(
        uid,
        partition,
        dispatch_step,
        status,
        _frozen_tags(tags),
        trajectories,
        finish_step,
        generation_seconds,
        dispatch_step if start_version is None else start_version,
    )


# Documented, pickled and shown as part of stalebuf.records, which re-exports each of them.
for _public in (
    Status,
    Trajectory,
    Group,
    LazyTrajectories,
    _TagsInPickle,
    _trajectory,
    _group,
    _frozen_tags,
):
    _public.__module__ = "stalebuf.records"
del _public
