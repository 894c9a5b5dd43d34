"""Immutable value records handed to users: statuses, trajectories, groups, batches and
evictions (defined in ``_group_records.py`` and ``_batch.py``, documented and pickled here)."""

from __future__ import annotations

from ._batch import Batch, EvictionEvent, EvictionReason, new_batch
from ._group_records import (
    DEFAULT_KEY_SESSIONS,
    DEFAULT_KEY_SUFFIXES,
    EMPTY_TAGS,
    Group,
    LazyTrajectories,
    Status,
    Trajectory,
    _frozen_tags,
    _group,
    _TagsInPickle,
    _trajectory,
    default_keys,
    default_records,
    new_group,
    new_trajectory,
    pack_runs,
    tags_for_pickle,
)

__all__ = [
    "DEFAULT_KEY_SESSIONS",
    "DEFAULT_KEY_SUFFIXES",
    "EMPTY_TAGS",
    "Batch",
    "EvictionEvent",
    "EvictionReason",
    "Group",
    "LazyTrajectories",
    "Status",
    "Trajectory",
    "default_keys",
    "default_records",
    "new_batch",
    "new_group",
    "new_trajectory",
    "pack_runs",
    "tags_for_pickle",
]

# What pickles and checkpoint files name under this module, beside the public records.
_PICKLED = (_frozen_tags, _group, _TagsInPickle, _trajectory)
