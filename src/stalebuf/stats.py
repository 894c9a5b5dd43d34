"""Frozen snapshots: ``ReplayBuffer.stats()``'s counts and ``ReplayBuffer.explain_wait()``'s answer."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

__all__ = ["BufferStats", "PartitionStats", "TaskStats", "WaitExplanation"]


@attrs.frozen(kw_only=True)
class TaskStats:
    """One task of a partition under a task mixture (``PartitionStats.tasks[task]``).

    Attributes:
        resident: its resident groups, in any status.
        sampled: cumulative, its groups ``sample`` returned.
        balance: under ``mixture_policy="borrow"``, the groups it is owed (> 0: it was short and
            lent to; < 0: it gave more than its quota); 0 under "wait".
        shortage: how many groups it lacks now for its quota of the partition's latest
            ``sample`` batch size (0 before any sample).
    """

    resident: int = 0
    sampled: int = 0
    balance: int = 0
    shortage: int = 0


def _task_copy(value: Mapping[str, TaskStats]) -> dict[str, TaskStats]:
    # A plain dict (a fresh copy per snapshot): attrs.asdict(stats) then gives JSON-ready values.
    return dict(value)


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
        tasks: under a task mixture, one :class:`TaskStats` per task (empty otherwise, and in
            ``BufferStats.total``).
        resident_tokens: tokens of the resident *terminal* groups (``tokens`` less those of the
            groups in flight).
        reserved_tokens: under ``admission_token_budget`` or ``max_resident_tokens``,
            ``max_tokens_per_group`` for each resident in-flight group (0 otherwise); the residency
            cap bounds ``resident_tokens + reserved_tokens``.

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
    resident_tokens: int = 0
    reserved_tokens: int = 0
    tasks: Mapping[str, TaskStats] = attrs.field(factory=dict, converter=_task_copy)

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
            if name not in ("capacity", "tasks")
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
        journal_commits: commits the journal made (0 without a journal).
        journal_bytes: the journal's size on disk now, its write-ahead log included.
        journal_pending_bytes: estimated encoded bytes handed to the journal's writer and not
            yet committed (what ``journal_max_pending_bytes`` bounds).
        journal_lag_seconds: the age of the oldest change not yet committed (0.0 when none).
            The four journal fields are left out of ``==``.
    """

    closed: bool
    partitions: Mapping[str, PartitionStats]
    total: PartitionStats
    # Not compared: a journal's counters say how the state was written, not what it is.
    journal_commits: int = attrs.field(default=0, eq=False)
    journal_bytes: int = attrs.field(default=0, eq=False)
    journal_pending_bytes: int = attrs.field(default=0, eq=False)
    journal_lag_seconds: float = attrs.field(default=0.0, eq=False)


@attrs.frozen(kw_only=True)
class WaitExplanation:
    """Why the ``sample`` calls parked on a partition wait, as :meth:`ReplayBuffer.explain_wait`
    finds it (the same text ends the periodic status line of a waiting ``sample``).

    The first parked call (the head: calls are served in arrival order) is the one explained;
    the fields about it are None or 0 when no ``sample`` waits.

    Attributes:
        partition: the partition explained.
        reason: one human-readable sentence saying why the head waits (each cause that holds,
            most decisive first), or that no sample waits, or that it is about to get a batch.
        waiting_samplers: ``sample`` calls parked on the partition.
        global_steps, batch_size: the head's arguments (None when no sample waits; ``batch_size``
            None for a head that samples by tokens).
        token_budget: the head's ``token_budget`` (None unless it samples by tokens).
        waited_seconds: how long the head has waited (0.0 when no sample waits).
        sampleable: groups a ``sample`` at the head's step could select now (what
            ``sampleable_count`` answers; 0 when no sample waits).
        short_by: how many more groups the head's batch needs, ``batch_size - sampleable``
            (0 when enough are sampleable, or no sample waits; a head by tokens needs one).
        short_by_tokens: how many more tokens a head by tokens needs, its budget minus the
            tokens of the partition's ready groups (0 when they reach it, or for a count).
        in_flight: the partition's PENDING and RUNNING groups.
        gate_held_by: the uid of the in-flight group that keeps the wait gate closed for the
            head (``max_off_policy_strategy="wait"``: the oldest one in flight), else None.
        gate_staleness: that group's staleness at the head's step, ``(g - p + 1) / S``.
        closed_tag_refusals: producer calls on the partition refused for good since its last
            batch: an explicit ``global_steps`` no slot can ever open at (TagClosedError) or
            ahead of the dispatch clock (FutureTagError). Producers that stop on these errors
            leave a waiting sample without groups.
        closed_tag: the ``global_steps`` the latest of those calls asked for (None if none).
        admission_full: admission control has no free slot at the dispatch clock's step now, or
            under token caps no room for ``max_tokens_per_group`` there (False without either).
        waiting_producers: producer calls waiting for an admission slot on the partition.
    """

    partition: str
    reason: str
    waiting_samplers: int = 0
    global_steps: int | None = None
    batch_size: int | None = None
    token_budget: int | None = None
    waited_seconds: float = 0.0
    sampleable: int = 0
    short_by: int = 0
    short_by_tokens: int = 0
    in_flight: int = 0
    gate_held_by: str | None = None
    gate_staleness: float | None = None
    closed_tag_refusals: int = 0
    closed_tag: int | None = None
    admission_full: bool = False
    waiting_producers: int = 0
