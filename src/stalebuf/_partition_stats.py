"""The snapshots ``stats()`` returns: each partition's counts (a mixture's summed over its
task cells, and per task), with the queues, capacity and filter errors other parts own."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import attrs

from ._admission import Admission
from ._filtering import Filtering
from ._mixture import Mixing
from ._partition import PartitionState
from ._store import GroupStore
from .stats import BufferStats, PartitionStats

__all__ = ["buffer_stats", "partition_stats"]


def buffer_stats(
    store: GroupStore,
    admission: Admission,
    filtering: Filtering,
    mixing: Mixing,
    count_waiting: Callable[[str], int],
) -> BufferStats:
    """The buffer's snapshot (``count_waiting``: the consumer's parked samples of a partition)."""
    partitions: dict[str, PartitionStats] = {}
    for name, part in sorted(store.partitions.items()):
        outside = (count_waiting(name), admission.waiting(name), admission.capacity(part, name))
        if part.cells is None:
            partitions[name] = partition_stats(part, *outside, filtering.errors(name))
            continue
        total = PartitionStats()
        for cell in part.cells.values():
            total = total + partition_stats(cell, 0, 0, None)
        waiting, producers, capacity = outside
        partitions[name] = attrs.evolve(
            total,
            waiting_samplers=waiting,
            waiting_producers=producers,
            capacity=capacity,
            filter_errors=filtering.errors(name),
            tasks=mixing.task_stats(part),
        )
    total = PartitionStats()
    for item in partitions.values():
        total = total + item
    return BufferStats(closed=store.closed, partitions=MappingProxyType(partitions), total=total)


def partition_stats(
    part: PartitionState,
    waiting_samplers: int,
    waiting_producers: int,
    capacity: int | None,
    filter_errors: int = 0,
) -> PartitionStats:
    """A snapshot of ``part``'s own counts, with the queue lengths, capacity and filter errors
    that the consumer, admission and the filters own."""
    return PartitionStats(
        pending=part.pending,
        running=part.running,
        finished=part.finished,
        failure=part.failure,
        trajectories=part.trajectories,
        waiting_samplers=waiting_samplers,
        admitted_groups=part.admitted_groups,
        admitted_trajectories=part.admitted_trajectories,
        sampled_groups=part.sampled_groups,
        sampled_trajectories=part.sampled_trajectories,
        evicted_stale_groups=part.evicted_stale_groups,
        evicted_stale_trajectories=part.evicted_stale_trajectories,
        evicted_failure_groups=part.evicted_failure_groups,
        evicted_failure_trajectories=part.evicted_failure_trajectories,
        evicted_in_flight_groups=part.evicted_in_flight_groups,
        evicted_filtered_groups=part.evicted_filtered_groups,
        evicted_filtered_trajectories=part.evicted_filtered_trajectories,
        filter_errors=filter_errors,
        evicted_restart_groups=part.evicted_restart_groups,
        evicted_restart_trajectories=part.evicted_restart_trajectories,
        reissued_groups=part.reissued_groups,
        reissued_trajectories=part.reissued_trajectories,
        waiting_producers=waiting_producers,
        cut_groups=part.cut_groups,
        cut_trajectories=part.cut_trajectories,
        capacity=capacity,
        tokens=part.tokens,
        admitted_tokens=part.admitted_tokens,
        sampled_tokens=part.sampled_tokens,
        masked_tokens=part.masked_tokens,
        evicted_tokens=part.evicted_tokens,
        reissued_tokens=part.reissued_tokens,
        resident_tokens=_terminal_tokens(part),
        reserved_tokens=part.ledger.reserved if part.ledger is not None and part.ledger.gates else 0,
    )


def _terminal_tokens(part: PartitionState) -> int:
    """The tokens of ``part``'s resident terminal groups: its token ledger's settled sum, else
    its resident tokens less those in flight (O(groups in flight))."""
    if part.ledger is not None:
        return part.ledger.settled
    if not part.tokens:
        return 0
    in_flight = sum(
        group.span.tokens
        for groups in part.in_flight.groups.values()
        for group in groups.values()
        if group.span is not None
    )
    return part.tokens - in_flight
