"""The fast scan of a checkpoint's groups: every group at once, in C-level loops.

The common checkpoint is valid; these checks pass it without a Python call per group and say
only whether it is, so ``_checkpoint_checks`` then checks group by group to name a fault.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from functools import partial
from itertools import chain, compress, repeat
from math import isfinite
from operator import add, attrgetter, is_not, itemgetter, le
from types import MappingProxyType
from typing import Any

from ._checkpoint_versions import valid_versions
from ._lazy_group import LazyGroup
from ._validation import MAX_INT, is_utf8
from .checkpoint import PartitionCheckpoint
from .records import EMPTY_TAGS, Group, Status, Trajectory

__all__ = ["behind_dicts", "resident_if_valid"]

_GROUP_KINDS = frozenset({Group, LazyGroup})
# The field accessors of the records read their slots in C (a lazily stored group's getitem would
# build its trajectory records; "_stored" reads the slot that holds them or its payloads).
_FIELDS = tuple("_stored" if name == "trajectories" else name for name in Group._fields)
_uid, _partition, _step, _status, _tags, _stored, _finish, _seconds, _start = map(attrgetter, _FIELDS)
_versions, _tokens, _runs = itemgetter(5), itemgetter(6), itemgetter(7)
#: A group's trajectory records to their token counts, as a C-level callable.
_tokens_of = partial(map, _tokens)


def resident_if_valid(
    records: tuple[Any, ...], partitions: Mapping[str, PartitionCheckpoint]
) -> dict[str, tuple[int, int, int]] | None:
    """Each partition's resident (groups, trajectories, tokens) if every record is a valid group
    with read-only tags, of a known partition, and no uid repeats; else None (the group-by-group
    check then names the fault). The same rules as :func:`_checked_group`, or stricter."""
    if not records:
        return {}
    kinds = list(map(type, records))
    if not _GROUP_KINDS.issuperset(kinds) or set(map(len, records)) != {len(Group._fields)}:
        return None
    uids, names, steps, finishes = (list(map(get, records)) for get in (_uid, _partition, _step, _finish))
    if not (_valid_uids(uids) and set(map(type, names)) == {str} and partitions.keys() >= set(names)):
        return None
    if not (_valid_steps(steps) and _valid_steps(finishes) and all(map(le, steps, finishes))):
        return None
    if not _valid_steps(list(map(_start, records))):
        return None
    seconds = list(map(_seconds, records))
    if set(map(type, seconds)) != {float} or not all(map(isfinite, seconds)) or min(seconds) < 0:
        return None
    if set(map(type, map(_status, records))) != {Status} or not _read_only(list(map(_tags, records))):
        return None
    stored = list(map(_stored, records))
    if set(map(type, stored)) != {tuple}:
        return None
    eager = list(map(is_not, kinds, repeat(LazyGroup)))
    eager_stored = list(compress(stored, eager))
    if not _valid_trajectories(list(compress(uids, eager)), eager_stored):
        return None
    # A lazily stored group holds no tokens; an eager one the sum of its trajectories'.
    tokens = iter(list(map(sum, map(_tokens_of, eager_stored))))
    resident: dict[str, tuple[int, int, int]] = {}
    for name, count, is_eager in zip(names, map(len, stored), eager, strict=True):
        held = resident.get(name, (0, 0, 0))
        resident[name] = (held[0] + 1, held[1] + count, held[2] + (next(tokens) if is_eager else 0))
    return resident


def _valid_uids(uids: list[Any]) -> bool:
    """Whether every uid passes ``check_uid`` and none repeats."""
    if set(map(type, uids)) != {str} or not all(uids) or len(set(uids)) != len(uids):
        return False
    joined = "".join(uids)  # holds "_" or a lone surrogate exactly when one of them does
    return "_" not in joined and is_utf8(joined)


def _valid_steps(steps: list[Any]) -> bool:
    """Whether every step passes ``check_step``."""
    if set(map(type, steps)) != {int}:  # first: a set of the values would merge True into 1
        return False
    distinct: set[int] = set(steps)  # few: the bounds are then checked on them alone
    return min(distinct) >= 0 and max(distinct) <= MAX_INT


def _read_only(tags: list[Any]) -> bool:
    """Whether every tags mapping is the shared empty one or a read-only view of a plain dict (as
    ``put`` makes them: a dict cannot raise while read, a subclass or another mapping may)."""
    tagged = list(compress(tags, map(is_not, tags, repeat(EMPTY_TAGS))))
    if not tagged:
        return True
    if set(map(type, tagged)) != {MappingProxyType}:
        return False
    return behind_dicts(tagged)


def behind_dicts(proxies: list[Any]) -> bool:
    """Whether each read-only mapping of ``proxies`` reads through a plain dict: its one referent
    (on CPython; another interpreter gets its tags copied, which is as safe)."""
    behind = list(chain.from_iterable(map(gc.get_referents, proxies)))
    return len(behind) == len(proxies) and set(map(type, behind)) == {dict}


class _Suffixes(dict[tuple[int, int], str]):
    """``"_{session}_{index}"`` by ``(session, index)``, each formatted once per check."""

    def __missing__(self, pair: tuple[int, int]) -> str:
        suffix = self[pair] = f"_{pair[0]}_{pair[1]}"
        return suffix


def _valid_trajectories(uids: list[str], stored: list[tuple[Any, ...]]) -> bool:
    """Whether the eager groups ``uids`` hold, in ``stored``, valid Trajectory records whose keys
    spell their uid, session id and index, with read-only tags; the keys are then distinct within
    a group exactly when they are distinct overall (a key names its uid, which holds no "_")."""
    records = list(chain.from_iterable(stored))
    if not records:
        return True
    if set(map(type, records)) != {Trajectory} or set(map(len, records)) != {Trajectory.SLOTS}:
        return False
    keys, sessions, indices, tags = (list(map(itemgetter(i), records)) for i in range(4))
    if not valid_versions(
        list(map(_versions, records)), list(map(_tokens, records)), list(map(_runs, records))
    ):
        return False
    if set(map(type, keys)) != {str} or not (_valid_steps(sessions) and _valid_steps(indices)):
        return False
    owners = chain.from_iterable(map(repeat, uids, map(len, stored)))
    suffixes = map(_Suffixes().__getitem__, zip(sessions, indices, strict=True))
    if list(map(add, owners, suffixes)) != keys or len(set(keys)) != len(keys):
        return False
    return _read_only(tags)
