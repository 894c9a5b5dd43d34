"""Capturing a buffer's parts as a :class:`~stalebuf.checkpoint.BufferCheckpoint`, and back.

:func:`capture` copies references only (records are immutable; an in-flight group is
snapshotted into a record with its PENDING/RUNNING status), so it is synchronous and consistent
with respect to every coroutine on the loop. :func:`rebuild` puts the groups back in admission
order, so FIFO ties, the clocks, admission state and every cumulative counter come out
identical; what happens to groups that were in flight is the caller's choice (``in_flight``).
Both go through the parts' own methods: the store, admission and eviction stay the only
writers of their state.
"""

from __future__ import annotations

import os
from time import monotonic
from typing import Any

from ._admission import Admission
from ._checkpoint_checks import checked
from ._checkpoint_file import read_checkpoint
from ._eviction import Eviction
from ._store import GroupStore
from ._stored import count_trajectories
from ._validation import check_payload_codec, describe
from .checkpoint import (
    COUNTERS,
    FORMAT_VERSION,
    NOT_GIVEN,
    BufferCheckpoint,
    InFlightMode,
    PartitionCheckpoint,
    check_in_flight,
)
from .errors import CheckpointError
from .records import EvictionEvent, Group, Status

__all__ = ["capture", "read_restore_arguments", "rebuild"]

_PENDING, _RUNNING = Status.PENDING, Status.RUNNING


def capture(store: GroupStore, admission: Admission) -> BufferCheckpoint:
    """Return the state of a buffer's parts; copies references, never payloads.

    Raises:
        CheckpointError: the policy was built from another config than the buffer's.
    """
    rules = store.rules
    config = rules.config
    rules_config = getattr(rules.base, "config", config)
    if rules_config is not config and rules_config != config:
        # restore rebuilds the policy from the one config a checkpoint keeps: refuse now rather
        # than let the restored buffer follow other rules than this one.
        raise CheckpointError(
            "this buffer's policy was built from another config than the buffer's, and restore "
            "rebuilds the policy from the buffer's config, so its rules would change; build the "
            "buffer with the policy's config (ReplayBuffer(policy=...) without config takes it)"
        )
    now = monotonic()
    clocks = admission.clocks
    groups = tuple(
        group if isinstance(group, Group) else store.snapshot(group, clocks.get(group.partition, 0), now)
        for group in store.groups.values()
    )
    partitions = tuple(
        PartitionCheckpoint(name, admission.last_sampled(name), {key: getattr(part, key) for key in COUNTERS})
        for name, part in store.partitions.items()
    )
    policy = rules.base
    policy_name = None
    if type(policy).__module__ != "stalebuf.policy" and config.custom_sampler is None:
        policy_name = f"{type(policy).__module__}:{type(policy).__qualname__}"
    return BufferCheckpoint(
        FORMAT_VERSION, config, policy_name, groups, partitions, dict(clocks), tuple(store.evicted_in_flight)
    )


def rebuild(
    store: GroupStore,
    admission: Admission,
    eviction: Eviction,
    checkpoint: BufferCheckpoint,
    in_flight: InFlightMode,
) -> tuple[Group, ...]:
    """Fill the empty parts with ``checkpoint``'s state; return the groups to reissue.

    Raises:
        CheckpointError: the checkpoint is inconsistent (a group of an unknown partition, a
            duplicate uid).
        Exception: whatever ``on_evict`` raised (under "evict", after the state is rebuilt).
    """
    admission.restore(
        dict(checkpoint.clocks), {saved.name: saved.last_sampled for saved in checkpoint.partitions}
    )
    for saved in checkpoint.partitions:
        store.partition(saved.name)
    reissue: list[Group] = []
    reissued: dict[str, list[int]] = {}  # partition -> [groups, trajectories discarded]
    restarted: dict[str, list[Group]] = {}
    for seq, group in enumerate(checkpoint.groups):
        part = store.partitions.get(group.partition)
        if part is None or group.uid in store.groups:
            raise CheckpointError(f"the checkpoint is inconsistent at group {describe(group.uid)}")
        if group.status is not _PENDING and group.status is not _RUNNING:
            store.restore_terminal(part, group, seq)
        elif in_flight == "evict":
            restarted.setdefault(part.name, []).append(group)
        elif in_flight == "keep":
            store.restore_in_flight(part, group, seq, keep=True)
        else:
            store.restore_in_flight(part, group, seq, keep=False)
            reissue.append(group.replace(status=_PENDING, trajectories=()))
            counts = reissued.setdefault(part.name, [0, 0])
            counts[0] += 1
            counts[1] += count_trajectories(group)
    for saved in checkpoint.partitions:  # cumulative counts are the saved ones, not what re-adding counted
        counts = reissued.get(saved.name, [0, 0])
        store.restore_counters(
            store.partitions[saved.name],
            {key: saved.counters.get(key, 0) for key in COUNTERS},
            (counts[0], counts[1]),
        )
    store.restore_sequence(len(checkpoint.groups), checkpoint.evicted_in_flight)
    events = []
    for name, groups in restarted.items():
        store.count_restarted(store.partitions[name], groups)
        events.append(EvictionEvent(name, "restart", tuple(groups), admission.clocks.get(name, 0)))
    if events:
        eviction.emit(events)
    return tuple(reissue)


def read_restore_arguments(
    source: object, in_flight: object, on_evict: object, status_log_interval: object, payload_codec: object
) -> tuple[BufferCheckpoint, InFlightMode, dict[str, Any]]:
    """Check ``ReplayBuffer.restore``'s arguments and read its checkpoint; return it, the
    ``in_flight`` mode and the options to build the buffer with.

    Raises:
        The errors of ``ReplayBuffer.restore`` that come before a buffer is built; among them
        CheckpointError for a checkpoint (a value or a file) that no live buffer could have taken.
    """
    mode = check_in_flight(in_flight)
    codec = check_payload_codec(payload_codec)
    if isinstance(source, BufferCheckpoint):
        checkpoint = checked(source)  # a value built by hand is checked as a file is
    elif isinstance(source, (str, os.PathLike)):
        checkpoint = read_checkpoint(source, codec)  # checked as it is read
    else:
        raise TypeError(f"source must be a BufferCheckpoint or a path, got {type(source).__name__}")
    # Passed only when given: a custom sampler's constructor need not take it.
    options: dict[str, Any] = {}
    if status_log_interval is not NOT_GIVEN:
        options["status_log_interval"] = status_log_interval
    if on_evict is not None:  # "restart" evictions are reported to it, from inside restore
        options["on_evict"] = on_evict
    return checkpoint, mode, options
