"""Frozen statistics snapshots returned by ``ReplayBuffer.stats()``."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

__all__ = ["BufferStats", "PartitionStats"]


@attrs.frozen(kw_only=True)
class PartitionStats:
    """Counts for one partition (or, in ``BufferStats.total``, for all of them).

    Resident groups by status:
        pending, running, finished, failure.
    Attributes:
        trajectories: trajectories held by resident groups.
        waiting_samplers: ``sample`` calls currently blocked.
        admitted_groups, admitted_trajectories: cumulative ``add_prompt`` / ``put`` calls
            that succeeded.
        sampled_groups, sampled_trajectories: cumulative, returned by ``sample``.
        evicted_stale_groups, evicted_stale_trajectories: cumulative, dropped as stale.
        evicted_failure_groups, evicted_failure_trajectories: cumulative, evicted as failed.
        evicted_in_flight_groups: cumulative, evicted as stale while PENDING or RUNNING (included
            in ``evicted_stale_groups``).
        evicted_restart_groups, evicted_restart_trajectories: cumulative, evicted by
            ``ReplayBuffer.restore(..., in_flight="evict")`` (in-flight groups at the checkpoint).
        reissued_groups, reissued_trajectories: cumulative, in-flight groups that
            ``restore(..., in_flight="reissue")`` kept (as PENDING, to be generated again) and the
            partial trajectories it discarded from them. Informational for groups: they stay
            resident.
        waiting_producers: producer calls currently blocked on admission.
        cut_groups, cut_trajectories: cumulative, in-flight groups cut at their deadline (and
            their trajectories). Informational: a cut group is finished or failed, and counted
            where it goes from there (sampled, evicted as failed...).
        capacity: the bound on resident groups under admission control, ``T*S*b``; None without
            admission or for an exempt partition (in ``total``: the sum of the bounded partitions).
        tokens: tokens held by resident groups, in flight or not (``put(..., tokens=)`` or the
            lengths of ``versions``).
        admitted_tokens: cumulative, tokens put.
        sampled_tokens: cumulative, tokens of the trajectories ``sample`` returned.
        masked_tokens: cumulative, sampled tokens the ``mask`` strategy kept out of the loss
            (stale ones; a subset of ``sampled_tokens``).
        evicted_tokens: cumulative, tokens of evicted groups (any reason).
        reissued_tokens: cumulative, tokens of the partial trajectories
            ``restore(..., in_flight="reissue")`` discarded.
        evicted_filtered_groups, evicted_filtered_trajectories: cumulative, evicted at once by a
            group filter when they became FINISHED (``ReplayBuffer(filters=...)``).
        filter_errors: cumulative, how often a filter raised or returned None (the group was
            kept: filters fail open).

    Conservation, for groups:
    ``admitted == resident + sampled + evicted_stale + evicted_failure + evicted_restart +
    evicted_filtered``;
    for trajectories the same plus ``reissued_trajectories``; for tokens
    ``admitted_tokens == tokens + sampled_tokens + evicted_tokens + reissued_tokens``.
    """

    pending: int = 0
    running: int = 0
    finished: int = 0
    failure: int = 0
    trajectories: int = 0
    waiting_samplers: int = 0
    admitted_groups: int = 0
    admitted_trajectories: int = 0
    sampled_groups: int = 0
    sampled_trajectories: int = 0
    evicted_stale_groups: int = 0
    evicted_stale_trajectories: int = 0
    evicted_failure_groups: int = 0
    evicted_failure_trajectories: int = 0
    evicted_in_flight_groups: int = 0
    evicted_restart_groups: int = 0
    evicted_restart_trajectories: int = 0
    reissued_groups: int = 0
    reissued_trajectories: int = 0
    waiting_producers: int = 0
    cut_groups: int = 0
    cut_trajectories: int = 0
    capacity: int | None = None
    tokens: int = 0
    admitted_tokens: int = 0
    sampled_tokens: int = 0
    masked_tokens: int = 0
    evicted_tokens: int = 0
    reissued_tokens: int = 0
    evicted_filtered_groups: int = 0
    evicted_filtered_trajectories: int = 0
    filter_errors: int = 0

    @property
    def groups(self) -> int:
        """Resident groups in any status."""
        return self.pending + self.running + self.finished + self.failure

    @property
    def in_flight(self) -> int:
        """Resident groups still PENDING or RUNNING."""
        return self.pending + self.running

    def __add__(self, other: PartitionStats) -> PartitionStats:
        """Return the field-wise sum (used to build totals)."""
        if not isinstance(other, PartitionStats):
            return NotImplemented
        values = {
            name: getattr(self, name) + getattr(other, name)
            for name in attrs.fields_dict(PartitionStats)
            if name != "capacity"
        }
        bounded = [c for c in (self.capacity, other.capacity) if c is not None]
        return PartitionStats(**values, capacity=sum(bounded) if bounded else None)


@attrs.frozen(kw_only=True)
class BufferStats:
    """An immutable snapshot of the whole buffer; compares with ``==``.

    Attributes:
        closed: whether ``close()`` was called.
        partitions: per-partition counts, keyed by partition name (read-only mapping).
        total: the field-wise sum over all partitions.
    """

    closed: bool
    partitions: Mapping[str, PartitionStats]
    total: PartitionStats
