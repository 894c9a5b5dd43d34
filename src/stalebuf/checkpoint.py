"""Checkpoint and resume: the value types of a buffer's saved state.

A :class:`BufferCheckpoint` is a buffer's whole state as one frozen value; ``_restore.py``
captures and rebuilds it through the buffer's parts, ``_checkpoint_db.py`` writes and reads
the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Generic, Literal, TypeVar

import attrs

from .config import SamplerConfig
from .records import Group

__all__ = [
    "COUNTERS",
    "FILTER_COUNTERS",
    "FORMAT_VERSION",
    "IN_FLIGHT_MODES",
    "TOKEN_COUNTERS",
    "BufferCheckpoint",
    "FilterCheckpoint",
    "InFlightMode",
    "MixtureCheckpoint",
    "PartitionCheckpoint",
    "RestoreResult",
    "TaskCheckpoint",
]

#: The version of the checkpoint format (the value and the file); a newer one is refused, an
#: older one read. 2: a group ``put_group`` stored with default keys pickles its payloads, not
#: its trajectory records (which a version-1 reader could not unpickle); 1: every group pickled
#: its records. Versions, token counts and start versions did not change it: a file holds them
#: only where they are not the defaults (no segments, 0 tokens, the dispatch step), so a
#: version-2 reader of before them reads a file without them exactly and refuses one with them
#: (an unknown counter, a longer row, a record built with more fields): it never misreads one.
#: Filters and task mixtures did not change it either, by the same rule: their counters are
#: written only when not 0, and their state (:class:`MixtureCheckpoint`,
#: :class:`FilterCheckpoint`) only for a partition that has some.
FORMAT_VERSION = 2
#: The cumulative token counters of a partition (see ``PartitionStats``): files written before
#: versions existed have none, and a file holds only those that are not 0.
TOKEN_COUNTERS: tuple[str, ...] = (
    "admitted_tokens",
    "sampled_tokens",
    "masked_tokens",
    "evicted_tokens",
    "reissued_tokens",
)
#: The counters of groups a filter evicted: files written before filters existed have none, and
#: a file holds them only when they are not 0.
FILTER_COUNTERS: tuple[str, ...] = ("evicted_filtered_groups", "evicted_filtered_trajectories")
#: The cumulative per-partition counters a checkpoint carries (the resident counts are derived
#: from the groups themselves, so they cannot disagree with them).
COUNTERS: tuple[str, ...] = (
    "admitted_groups",
    "admitted_trajectories",
    "sampled_groups",
    "sampled_trajectories",
    "evicted_stale_groups",
    "evicted_stale_trajectories",
    "evicted_failure_groups",
    "evicted_failure_trajectories",
    "evicted_in_flight_groups",
    "evicted_restart_groups",
    "evicted_restart_trajectories",
    "reissued_groups",
    "reissued_trajectories",
    "cut_groups",
    "cut_trajectories",
    *FILTER_COUNTERS,
    *TOKEN_COUNTERS,
)
InFlightMode = Literal["reissue", "keep", "evict", "resume"]
#: The ``in_flight`` modes of ``restore``.
IN_FLIGHT_MODES = ("reissue", "keep", "evict", "resume")
_Buffer = TypeVar("_Buffer")


def _frozen_map(value: Mapping[str, int]) -> Mapping[str, int]:
    return MappingProxyType(dict(value))


def _as_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _as_times(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(value)


def _as_reasons(value: Iterable[str | None]) -> tuple[str | None, ...]:
    return tuple(value)


def _as_tasks(value: Iterable[TaskCheckpoint]) -> tuple[TaskCheckpoint, ...]:
    return tuple(value)


def _as_verdicts(value: Iterable[bool]) -> tuple[bool, ...]:
    return tuple(value)


@attrs.frozen
class TaskCheckpoint:
    """One task's saved state in a partition under a task mixture (its cell).

    Attributes:
        name: the task.
        counters: its cumulative counters (:data:`COUNTERS`); summed over the tasks, the
            partition's.
        generation: the generation times of its last groups measured in flight, oldest first.
        balance: its borrow balance (0 under ``mixture_policy="wait"``).
        growth: how many samples in a row its positive balance grew (the starvation warning's
            count).
    """

    name: str
    counters: Mapping[str, int] = attrs.field(converter=_frozen_map)
    generation: tuple[float, ...] = attrs.field(default=(), converter=_as_times)
    balance: int = 0
    growth: int = 0

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: the read-only mapping travels as a dict."""
        fields = (self.name, dict(self.counters), self.generation, self.balance, self.growth)
        return (TaskCheckpoint, fields)


@attrs.frozen
class MixtureCheckpoint:
    """What a partition under a task mixture saves besides its groups (its task cells and the
    ledger selection keeps).

    Attributes:
        tasks: one :class:`TaskCheckpoint` per task of the mixture.
        shares: the tasks of the partition's last 256 sampled groups, oldest first (the
            ``mixture/{task}/share`` metric).
        batch_size: the ``B`` of the partition's latest ``sample`` call (0 before any): what
            ``TaskStats.shortage`` is measured against.
    """

    tasks: tuple[TaskCheckpoint, ...] = attrs.field(converter=_as_tasks)
    shares: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    batch_size: int = 0


@attrs.frozen
class FilterCheckpoint:
    """What the group filters left behind in a partition (the filters themselves are code, never
    in a checkpoint: ``restore`` takes them again as ``filters=``).

    Attributes:
        verdicts: the last 256 verdicts, oldest first (True: kept): the pass rate.
        errors: cumulative, how many times a filter raised or returned None (``filter_errors``).
        recent_filtered: groups filtered since the partition's previous batch (the next batch's
            ``filter_groups/evicted_samples``).
        recent_errors: filter errors since the partition's previous batch.
    """

    verdicts: tuple[bool, ...] = attrs.field(default=(), converter=_as_verdicts)
    errors: int = 0
    recent_filtered: int = 0
    recent_errors: int = 0


@attrs.frozen
class PartitionCheckpoint:
    """One partition's saved state.

    Attributes:
        name: the partition.
        last_sampled: the largest step a ``sample`` on it returned a batch at (-1 before any);
            part of the admission state.
        counters: the cumulative counters named in :data:`COUNTERS`.
        generation: the generation times (seconds) of its last groups measured in flight, oldest
            first, that ``group_deadline_factor`` takes the median of (``()`` in older files; under
            a task mixture, each task's are in ``mixture``).
        mixture: under a task mixture, its tasks' counters and generation times and the ledger
            of selection (None otherwise, and in older files).
        filters: what its group filters left behind (None if they left nothing, as without
            filters, and in older files).
    """

    name: str
    last_sampled: int
    counters: Mapping[str, int] = attrs.field(converter=_frozen_map)
    generation: tuple[float, ...] = attrs.field(default=(), converter=_as_times)
    mixture: MixtureCheckpoint | None = None
    filters: FilterCheckpoint | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: the read-only mapping travels as a dict; a partition with neither a
        mixture nor filters pickles as before they existed (so an older reader reads it)."""
        fields: tuple[Any, ...] = (self.name, self.last_sampled, dict(self.counters), self.generation)
        if self.mixture is not None or self.filters is not None:
            fields += (self.mixture, self.filters)
        return (PartitionCheckpoint, fields)


@attrs.frozen(eq=False)
class BufferCheckpoint:
    """A buffer's whole state: a frozen, picklable value (see ``ReplayBuffer.checkpoint``).

    Attributes:
        format_version: :data:`FORMAT_VERSION` when it was taken.
        config: the buffer's config (it names the custom sampler, if any).
        policy: ``"module:QualName"`` of a policy passed as ``policy=`` that the config does
            not name, else None; ``restore`` builds it as ``Cls(config, **sampler_kwargs)``
            (``checkpoint()`` refuses a policy that this would not build with the same state).
        groups: every resident group, in admission order (which decides FIFO ties). In-flight
            groups are records with status PENDING or RUNNING, the trajectories put so far, and
            ``generation_seconds`` elapsed since their ``add_prompt``.
        partitions: every partition's admission state and cumulative counters.
        clocks: each partition's dispatch clock.
        evicted_in_flight: uids of groups the buffer ended in flight and remembers, oldest first.
        evicted_reasons: why, for each of them: None (evicted as stale), "restart", "filtered",
            or "cut at its deadline of ... s" (its producer then hears GroupCutError; "... s (then
            filtered)" if a filter then rejected it); ``()`` in older files, read as all None.
    """

    format_version: int
    config: SamplerConfig
    policy: str | None
    groups: tuple[Group, ...]
    partitions: tuple[PartitionCheckpoint, ...]
    clocks: Mapping[str, int] = attrs.field(converter=_frozen_map)
    evicted_in_flight: tuple[str, ...] = attrs.field(converter=_as_tuple)
    evicted_reasons: tuple[str | None, ...] = attrs.field(default=(), converter=_as_reasons)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: the read-only mapping travels as a dict."""
        return (
            BufferCheckpoint,
            (
                self.format_version,
                self.config,
                self.policy,
                self.groups,
                self.partitions,
                dict(self.clocks),
                self.evicted_in_flight,
                self.evicted_reasons,
            ),
        )


@attrs.frozen(eq=False)
class RestoreResult(Generic[_Buffer]):
    """What ``ReplayBuffer.restore`` returns.

    Attributes:
        buffer: the restored buffer.
        reissue: under ``in_flight="reissue"``, the groups that were in flight at the
            checkpoint (uid, partition, dispatch step, tags; no trajectories; start version the
            dispatch step), in admission order: they are in the buffer as PENDING, to be
            generated again under the same uid. Under ``in_flight="resume"``, the same groups
            with their ``trajectories`` (the partial prefix, versions and tokens included) and
            ``start_version``: they are in the buffer as PENDING with that prefix, and their
            producers go on generating after it. Empty under "keep" and "evict".
        kept: from ``ReplayBuffer.recover`` at a step, every group admitted after the recovery
            point, in admission order: those the recovered buffer holds and those a filter
            evicted since (not in the buffer). A dataloader restored to that step skips their
            prompts: they were dispatched already. ``()`` otherwise.
        dropped: from ``recover`` at a step, the older groups of a uid that a producer added
            again after the point (the newer one is kept; these are counted evicted as
            "restart"); ``()`` otherwise.
    """

    buffer: _Buffer
    reissue: tuple[Group, ...]
    kept: tuple[Group, ...] = ()
    dropped: tuple[Group, ...] = ()

    def __iter__(self) -> Iterator[Any]:
        """Unpack as ``buffer, reissue = ...``, in that order."""
        return iter((self.buffer, self.reissue))


#: ``restore``'s default ``status_log_interval``: the built class's own default.
NOT_GIVEN: Any = object()
