"""Groups whose trajectory records are built when first read: :class:`LazyGroup`.

``put_group``'s fast path (a new FINISHED group, default keys, no per-trajectory tags) stores a
LazyGroup holding its payloads. A resident group is then one GC-tracked object (its payloads
tuple is untracked once the collector has seen it hold no container) instead of a tuple of n
trajectory records: the cyclic collector traverses every tracked object again at each collection
of its generation, and with a million resident groups of 8 the eager records made building them
about 3x slower with the collector on than off.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, SupportsIndex

from ._group_records import record_repr
from .records import EMPTY_TAGS, Group, Status, Trajectory, default_keys, default_records, tags_for_pickle

__all__ = ["LazyGroup", "new_lazy_group"]

_tuple_new = tuple.__new__
# Taken only to store built records, so that two threads reading a group's trajectories for the
# first time get one tuple (reentrant: a finalizer run by the collector may read another group).
_build_lock = threading.RLock()


def _new_lock_after_fork() -> None:
    # A fork while another thread held the lock must not leave the child's first reads hanging.
    global _build_lock
    _build_lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)


class _WithInstanceDict(Group):
    """A Group with an instance dict (a tuple subclass can have no slots), reached only through
    :data:`_dict_of`: LazyGroup hides ``__dict__``, as an eager group has none."""


_dict_of = _WithInstanceDict.__dict__["__dict__"].__get__


def _as_fields(other: tuple[Any, ...]) -> tuple[Any, ...]:
    return other._values() if isinstance(other, Group) else other


class LazyGroup(_WithInstanceDict):
    """A group stored with default keys (session ids ``0..n-1``, index 0, no tags): it holds
    its payloads and builds its trajectory records on the first read of :attr:`trajectories`,
    then keeps them, so every read returns the same tuple.

    Internal: it reads, compares, copies, pickles and prints as the :class:`Group` it stands
    for, and ``LazyGroup(...)`` builds a plain Group. The exceptions: C code that reads a
    tuple's slots without a call to hook, such as ``"%s ..." % group`` with the group as the
    argument tuple, sees the payloads in the trajectories' slot; ``numpy.int64(2) * group``
    raises ValueError (numpy declines a sequence that defines its own ``*``); and
    ``object.__setattr__`` can add an attribute (as it can set the fields of a frozen attrs
    record).
    """

    __slots__ = ()
    _built: tuple[Trajectory, ...] | None = None  # until the instance dict holds them

    def __new__(cls, *args: Any, **kwargs: Any) -> Group:  # type: ignore[misc]
        """Build a plain :class:`Group` (``type(g)(*g)`` rebuilds a record with the same fields)."""
        return Group(*args, **kwargs)

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        """Absent, as on an eager group (``vars(group)`` raises TypeError)."""
        raise AttributeError("'Group' object has no attribute '__dict__'")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot set {name!r}: a Group is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete {name!r}: a Group is immutable")

    @property
    def trajectories(self) -> tuple[Trajectory, ...]:  # type: ignore[override]
        """Its trajectories, in ``put`` order (built on the first read, then the same tuple)."""
        built = self._built
        if built is None:
            fresh = default_records(self.uid, self._stored)
            with _build_lock:  # another thread may be storing its own build of them
                built = _dict_of(self).setdefault("_built", fresh)
        return built

    def __repr__(self) -> str:
        return record_repr(self, "Group")

    def __copy__(self) -> Group:
        return self.replace()  # the same records, as copying an eager group keeps them

    def _values(self) -> tuple[Any, ...]:
        values = tuple(tuple.__iter__(self))
        return (*values[:5], self.trajectories, *values[6:])

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: unbuilt, its payloads, to load as a lazily stored group again; built,
        the eager group of its records (a pickle also holding one of them keeps it the group's)."""
        if self._built is not None:
            # Nothing compact is left to keep: the eager group of the same records loads without
            # the payloads tuple and the instance dict.
            return super().__reduce__()
        # new_lazy_group and records._frozen_tags, the names this pickle holds, are in stalebuf
        # since f169765 with these signatures: its checkpoint files stay readable by that release.
        fields = (self.uid, self.partition, self.dispatch_step, self.status, tags_for_pickle(self.tags))
        rest = (self._stored, self.finish_step, self.generation_seconds)
        if self.start_version != self.dispatch_step:
            return (new_lazy_group, (*fields, *rest, self.start_version))
        return (new_lazy_group, (*fields, *rest))

    def _peek(self) -> tuple[Trajectory, ...]:
        built = self._built
        return default_records(self.uid, self._stored) if built is None else built

    def _stored_keys(self) -> Sequence[str]:
        return default_keys(self.uid, len(self._stored))

    def _stored_tags(self) -> Sequence[Mapping[str, Any]]:
        return [EMPTY_TAGS] * len(self._stored)

    def _stored_payloads(self) -> Sequence[Any]:
        return self._stored  # type: ignore[no-any-return]

    # Read as a tuple, a group shows its built trajectories, never its payloads: the tuple
    # operations done in C read the slots, so each goes through the field values. Compared with
    # another group, equality stays identity and ordering compares field values, as for tuples.
    def __eq__(self, other: object) -> bool:
        if isinstance(other, tuple) and not isinstance(other, Group):
            return self._values() == other
        return object.__eq__(self, other)  # NotImplemented unless other is self

    __hash__ = object.__hash__

    def __lt__(self, other: tuple[Any, ...]) -> bool:
        return self._values() < _as_fields(other) if isinstance(other, tuple) else NotImplemented

    def __le__(self, other: tuple[Any, ...]) -> bool:
        return self._values() <= _as_fields(other) if isinstance(other, tuple) else NotImplemented

    def __gt__(self, other: tuple[Any, ...]) -> bool:
        return self._values() > _as_fields(other) if isinstance(other, tuple) else NotImplemented

    def __ge__(self, other: tuple[Any, ...]) -> bool:
        return self._values() >= _as_fields(other) if isinstance(other, tuple) else NotImplemented

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

    def __getnewargs__(self) -> tuple[tuple[Any, ...]]:
        return (self._values(),)

    def count(self, value: Any, /) -> int:
        """Count the field values equal to ``value``, as a tuple would."""
        return self._values().count(value)

    def index(self, value: Any, start: SupportsIndex = 0, stop: SupportsIndex = sys.maxsize, /) -> int:
        """Return the position of ``value`` among the field values, as a tuple would (raises
        ValueError if none is equal to it)."""
        return self._values().index(value, start, stop)


def new_lazy_group(
    uid: str,
    partition: str,
    dispatch_step: int,
    status: Status,
    tags: Mapping[str, Any],
    payloads: tuple[Any, ...],
    finish_step: int,
    generation_seconds: float,
    start_version: int | None = None,
) -> LazyGroup:
    """Return the :class:`LazyGroup` of ``payloads`` under default keys (records not built;
    ``start_version`` None: the dispatch step).

    Pickles of a LazyGroup call it by name to load: its name, module and parameters are part of
    the checkpoint file format (``start_version`` is optional: older pickles lack it).
    """
    if start_version is None:
        start_version = dispatch_step
    fields = (uid, partition, dispatch_step, status, tags, payloads, finish_step, generation_seconds)
    return _tuple_new(LazyGroup, (*fields, start_version))
