"""Immutable value records handed to users: statuses, trajectories, groups, batches, evictions."""

from __future__ import annotations

import collections
import enum
import sys
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from itertools import repeat
from operator import itemgetter
from types import MappingProxyType
from typing import Any, Literal, SupportsIndex

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
    "EMPTY_TAGS",
    "Batch",
    "EvictionEvent",
    "Group",
    "Status",
    "Trajectory",
    "new_batch",
    "new_group",
    "new_trajectory",
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


class _Record(tuple):  # type: ignore[type-arg]
    """Shared behaviour of the tuple-based records: identity equality, a readable repr."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__name__}({values})"


class Trajectory(_Record):
    """One rollout session's output: a payload plus its key and tags (immutable).

    Attributes:
        key: ``f"{uid}_{session_id}_{index}"``, unique in the buffer.
        session_id: the rollout session (one of the group's n samples).
        index: the position of this piece within the session (multi-turn rollouts).
        tags: read-only metadata given to ``put`` (empty when none was given).
        payload: whatever the producer stored; the buffer never looks at it.
    """

    __slots__ = ()
    _fields = ("key", "session_id", "index", "tags", "payload")

    def __new__(
        cls, key: str, session_id: int, index: int, tags: Mapping[str, Any], payload: Any
    ) -> Trajectory:
        """Build a trajectory record."""
        return tuple.__new__(cls, (key, session_id, index, tags, payload))

    key: str = _field(0, "The key, ``f'{uid}_{session_id}_{index}'``.")
    session_id: int = _field(1, "The rollout session.")
    index: int = _field(2, "The piece of the session.")  # type: ignore[assignment]
    tags: Mapping[str, Any] = _field(3, "Read-only metadata.")
    payload: Any = _field(4, "What the producer stored.")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: the read-only tags travel as a plain dict."""
        return (_trajectory, (self.key, self.session_id, self.index, _plain(self.tags), self.payload))


class Group(_Record):
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
    """

    __slots__ = ()
    _fields = (
        "uid",
        "partition",
        "dispatch_step",
        "status",
        "tags",
        "trajectories",
        "finish_step",
        "generation_seconds",
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
    ) -> Group:
        """Build a group record."""
        return tuple.__new__(
            cls, (uid, partition, dispatch_step, status, tags, trajectories, finish_step, generation_seconds)
        )

    uid: str = _field(0, "The group's id.")
    partition: str = _field(1, "Its partition.")
    dispatch_step: int = _field(2, "The step it was dispatched at.")
    status: Status = _field(3, "Its status.")
    tags: Mapping[str, Any] = _field(4, "Read-only metadata.")
    finish_step: int = _field(6, "The clock when it finished.")
    generation_seconds: float = _field(7, "Seconds from add to finish.")
    # The trajectories as stored: a tuple, or LazyTrajectories (which supports len()). A field
    # accessor reads the slot directly, past the __getitem__ below.
    _stored: Any = _field(5, "The trajectories as stored.")

    @property
    def trajectories(self) -> tuple[Trajectory, ...]:
        """Its trajectories, in ``put`` order (built on first read for a group ``put_group``
        stored with default keys; the same tuple on every read)."""
        held = self._stored
        if held.__class__ is LazyTrajectories:
            return held.build()
        return held  # type: ignore[no-any-return]

    # Read as a tuple, a group shows its built trajectories, never their lazy store.
    def __iter__(self) -> Iterator[Any]:
        """Iterate over the field values, as a tuple would."""
        return iter(self._values())

    def __getitem__(self, index: Any) -> Any:
        """Return a field value (or a tuple of them for a slice), as a tuple would."""
        return self._values()[index]

    def __contains__(self, value: object) -> bool:
        """Whether ``value`` is one of the field values, as for a tuple."""
        return value in self._values()

    def __add__(self, other: tuple[Any, ...]) -> tuple[Any, ...]:
        """Concatenate the field values with a tuple, as a tuple would."""
        return self._values() + other

    def __radd__(self, other: tuple[Any, ...]) -> tuple[Any, ...]:
        """Concatenate a tuple with the field values, as a tuple would."""
        return other + self._values()

    def __mul__(self, times: SupportsIndex) -> tuple[Any, ...]:
        """Repeat the field values, as a tuple would."""
        return self._values() * times

    __rmul__ = __mul__

    def count(self, value: Any) -> int:
        """Count the field values equal to ``value``, as a tuple would."""
        return self._values().count(value)

    def index(self, value: Any, start: SupportsIndex = 0, stop: SupportsIndex = sys.maxsize) -> int:
        """Return the position of ``value`` among the field values, as a tuple would (raises
        ValueError if none is equal to it)."""
        return self._values().index(value, start, stop)

    def _values(self) -> tuple[Any, ...]:
        values = tuple(tuple.__iter__(self))
        if values[5].__class__ is LazyTrajectories:
            return (*values[:5], values[5].build(), *values[6:])
        return values

    @property
    def global_steps(self) -> int:
        """The dispatch step: an alias of :attr:`dispatch_step`, the name verl uses."""
        return self.dispatch_step

    def replace(self, **changes: Any) -> Group:
        """Return a copy with the given fields changed (like ``attrs.evolve``)."""
        values = dict(zip(self._fields, tuple.__iter__(self), strict=True))  # as stored: not built
        values.update(changes)
        return Group(**values)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: the read-only tags travel as a plain dict."""
        return (
            _group,
            (
                self.uid,
                self.partition,
                self.dispatch_step,
                self.status,
                _plain(self.tags),
                self._stored,  # lazily built trajectories travel as their payloads
                self.finish_step,
                self.generation_seconds,
            ),
        )


# Records put by ``put_group``'s fast path (default keys and tags) are built on first read. A
# resident group then holds one small object and its payloads instead of a tuple of n
# trajectory records: the cyclic garbage collector traverses every tracked object again at
# each collection of its generation, and with a million resident groups of 8 the eager records
# made building them about 3x slower with the collector on than off.
_new_trajectory_from = partial(tuple.__new__, Trajectory)
# What follows the uid in the default keys of a group's first trajectories: f"_{session}_0".
_DEFAULT_SUFFIXES = tuple(f"_{session}_0" for session in range(64))


def default_keys(uid: str, count: int) -> list[str]:
    """The keys of trajectories ``0..count-1`` of ``uid`` with default session ids and indices:
    ``f"{uid}_{i}_0"``, built by C-level loops."""
    if count <= len(_DEFAULT_SUFFIXES):
        return list(map(uid.__add__, _DEFAULT_SUFFIXES[:count]))
    return [f"{uid}_{i}_0" for i in range(count)]


class LazyTrajectories:
    """The trajectories of a group stored with default keys, session ids ``0..n-1``, index 0
    and no tags, built on first read and then kept (so every read returns the same records).

    Internal: :attr:`Group.trajectories` returns the built tuple, never this object.
    """

    __slots__ = ("_built", "payloads", "uid")

    def __init__(
        self, uid: str, payloads: tuple[Any, ...], built: tuple[Trajectory, ...] | None = None
    ) -> None:
        self.uid = uid
        self.payloads = payloads
        self._built = built

    def __len__(self) -> int:
        return len(self.payloads)

    def build(self) -> tuple[Trajectory, ...]:
        """Return the trajectory records, building them on the first call."""
        built = self._built
        if built is None:
            fresh = self.peek()
            # Read again: another thread may have built them while this one did. From this read
            # to the store there is no call, so no thread switch on CPython: every reader gets
            # the one stored tuple.
            built = self._built
            if built is None:
                built = self._built = fresh
        return built

    def peek(self) -> tuple[Trajectory, ...]:
        """Return the trajectory records without keeping them (built again unless
        :meth:`build` kept them): for readers such as a checkpoint that only copy fields."""
        built = self._built
        if built is not None:
            return built
        payloads = self.payloads
        count = len(payloads)
        rows = zip(default_keys(self.uid, count), range(count), repeat(0), repeat(EMPTY_TAGS), payloads)
        return tuple(map(_new_trajectory_from, rows))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: the payloads, and the records if they were built (so a pickle that
        also holds one of them keeps it identical to the group's)."""
        return (LazyTrajectories, (self.uid, self.payloads, self._built))

    def __repr__(self) -> str:
        # What a group's raw slot shows where C code formats it (``"%s" % group``): the records.
        return repr(self.build())


# Batch's views read lazily stored groups without building their records.
def _stored_keys(group: Group) -> Sequence[str]:
    held = group._stored
    if held.__class__ is LazyTrajectories and held._built is None:
        return default_keys(held.uid, len(held.payloads))
    return [t.key for t in group.trajectories]


def _stored_tags(group: Group) -> Sequence[Mapping[str, Any]]:
    held = group._stored
    if held.__class__ is LazyTrajectories and held._built is None:
        return [EMPTY_TAGS] * len(held.payloads)
    return [t.tags for t in group.trajectories]


def _stored_payloads(group: Group) -> Sequence[Any]:
    held = group._stored
    if held.__class__ is LazyTrajectories:
        return held.payloads
    return [t.payload for t in held]


@attrs.frozen(eq=False, weakref_slot=False)
class Batch:
    """What one ``sample`` call returns: whole groups, oldest first.

    Attributes:
        partition: the partition sampled.
        global_steps: the trainer step passed to ``sample``.
        groups: the selected groups, in selection order.
        parameter_sync_step: the config's sync step, used by :attr:`staleness`.
    """

    partition: str
    global_steps: int
    groups: tuple[Group, ...]
    parameter_sync_step: int = 1

    def __len__(self) -> int:
        """Return the number of groups."""
        return len(self.groups)

    def __iter__(self) -> Iterator[Group]:
        """Iterate over the groups in selection order."""
        return iter(self.groups)

    @property
    def uids(self) -> list[str]:
        """The group uids, in selection order."""
        return [group.uid for group in self.groups]

    @property
    def trajectories(self) -> list[Trajectory]:
        """All trajectories, flattened in group order."""
        return [t for group in self.groups for t in group.trajectories]

    @property
    def keys(self) -> list[str]:
        """All trajectory keys, flattened in group order."""
        return [key for group in self.groups for key in _stored_keys(group)]

    @property
    def tags(self) -> list[Mapping[str, Any]]:
        """All trajectory tags, flattened in group order."""
        return [tags for group in self.groups for tags in _stored_tags(group)]

    @property
    def payloads(self) -> list[Any]:
        """All trajectory payloads, flattened in group order."""
        return [payload for group in self.groups for payload in _stored_payloads(group)]

    @property
    def staleness(self) -> npt.NDArray[np.float64]:
        """Staleness ``(g - p + 1) / parameter_sync_step`` of each group, as float64."""
        dispatch = np.fromiter(
            (group.dispatch_step for group in self.groups), dtype=np.float64, count=len(self.groups)
        )
        return (self.global_steps + 1 - dispatch) / self.parameter_sync_step


EvictionReason = Literal["stale", "failure", "restart"]


@attrs.frozen(eq=False, weakref_slot=False)
class EvictionEvent:
    """Groups evicted together for one reason during one ``sample`` evaluation.

    Attributes:
        partition: the partition they were evicted from.
        reason: "stale" (drop strategy; in-flight groups too with ``evict_stale_in_flight``),
            "failure" (``failure_strategy="evict"``) or "restart" (in-flight groups evicted by
            ``ReplayBuffer.restore(..., in_flight="evict")``).
        groups: the evicted groups, oldest first.
        global_steps: the trainer step of the ``sample`` call that evicted them (for "restart",
            the partition's dispatch clock).
    """

    partition: str
    reason: EvictionReason
    groups: tuple[Group, ...]
    global_steps: int


# Fast constructors for the buffer's hot paths. Batch is an attrs class whose frozen __init__
# routes every field through object.__setattr__ by name; setting the slot descriptors directly
# takes about two thirds of that. The tuple-based records are built by tuple.__new__ in one C
# call. Each builds exactly what the class's own constructor builds, and tests compare the two.
_new = object.__new__
_tuple_new = tuple.__new__
_set_bpartition, _set_bsteps, _set_groups, _set_sync = (
    Batch.__dict__[field.name].__set__ for field in attrs.fields(Batch)
)


def new_trajectory(
    key: str, session_id: int, index: int, tags: Mapping[str, Any], payload: Any
) -> Trajectory:
    """Return ``Trajectory(key, session_id, index, tags, payload)``, built faster."""
    return _tuple_new(Trajectory, (key, session_id, index, tags, payload))


def new_group(
    uid: str,
    partition: str,
    dispatch_step: int,
    status: Status,
    tags: Mapping[str, Any],
    trajectories: tuple[Trajectory, ...],
    finish_step: int,
    generation_seconds: float,
) -> Group:
    """Return ``Group(uid, partition, dispatch_step, status, tags, trajectories, finish_step,
    generation_seconds)``, built faster."""
    return _tuple_new(
        Group, (uid, partition, dispatch_step, status, tags, trajectories, finish_step, generation_seconds)
    )


def new_batch(
    partition: str, global_steps: int, groups: tuple[Group, ...], parameter_sync_step: int
) -> Batch:
    """Return ``Batch(partition, global_steps, groups, parameter_sync_step)``, built faster."""
    batch = _new(Batch)
    _set_bpartition(batch, partition)
    _set_bsteps(batch, global_steps)
    _set_groups(batch, groups)
    _set_sync(batch, parameter_sync_step)
    return batch


def _plain(tags: Mapping[str, Any]) -> dict[str, Any] | None:
    return dict(tags) if tags else None


def _frozen_tags(tags: dict[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(tags) if tags else EMPTY_TAGS


def _trajectory(
    key: str, session_id: int, index: int, tags: dict[str, Any] | None, payload: Any
) -> Trajectory:
    return new_trajectory(key, session_id, index, _frozen_tags(tags), payload)


def _group(
    uid: str,
    partition: str,
    dispatch_step: int,
    status: Status,
    tags: dict[str, Any] | None,
    trajectories: tuple[Trajectory, ...],
    finish_step: int,
    generation_seconds: float,
) -> Group:
    return new_group(
        uid,
        partition,
        dispatch_step,
        status,
        _frozen_tags(tags),
        trajectories,
        finish_step,
        generation_seconds,
    )
