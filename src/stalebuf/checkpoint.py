"""Checkpoint and resume: a buffer's whole state as one frozen value, and back.

:func:`capture` copies references only (records are immutable; an in-flight group is
snapshotted into a record with its PENDING/RUNNING status), so it is synchronous and consistent
with respect to every coroutine on the loop. :func:`rebuild` puts the groups back in admission
order, so FIFO ties, the clocks, admission state and every cumulative counter come out
identical; what happens to groups that were in flight is the caller's choice (``in_flight``).
The file format lives in ``_checkpoint_file.py``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from time import monotonic
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import attrs

from ._partition import OpenGroup, PartitionState
from ._sampling import EVICTED_UIDS_REMEMBERED
from ._stored import count_trajectories
from ._validation import check_payload_codec, describe, describe_error
from .config import SamplerConfig
from .errors import CheckpointError, ConfigError
from .records import EvictionEvent, Group, Status, new_group

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

__all__ = [
    "COUNTERS",
    "FORMAT_VERSION",
    "BufferCheckpoint",
    "InFlightMode",
    "PartitionCheckpoint",
    "RestoreResult",
    "restore_buffer",
]

#: The version of the checkpoint format (the value and the file); a newer one is refused, an
#: older one read. 2: a group ``put_group`` stored with default keys pickles its payloads, not
#: its trajectory records (which a version-1 reader could not unpickle); 1: every group pickled
#: its records.
FORMAT_VERSION = 2
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
)
InFlightMode = Literal["reissue", "keep", "evict"]
_IN_FLIGHT_MODES = ("reissue", "keep", "evict")
_PENDING, _RUNNING = Status.PENDING, Status.RUNNING


def _frozen_map(value: Mapping[str, int]) -> Mapping[str, int]:
    return MappingProxyType(dict(value))


def _as_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class PartitionCheckpoint:
    """One partition's saved state.

    Attributes:
        name: the partition.
        last_sampled: the largest step a ``sample`` on it returned a batch at (-1 before any);
            part of the admission state.
        counters: the cumulative counters named in :data:`COUNTERS`.
    """

    name: str
    last_sampled: int
    counters: Mapping[str, int] = attrs.field(converter=_frozen_map)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: the read-only mapping travels as a dict."""
        return (PartitionCheckpoint, (self.name, self.last_sampled, dict(self.counters)))


@attrs.frozen(eq=False)
class BufferCheckpoint:
    """A buffer's whole state: a frozen, picklable value (see ``ReplayBuffer.checkpoint``).

    Attributes:
        format_version: :data:`FORMAT_VERSION` when it was taken.
        config: the buffer's config (it names the custom sampler, if any).
        policy: ``"module:QualName"`` of a policy passed as ``policy=`` that the config does
            not name, else None; ``restore`` builds it as ``Cls(config, **sampler_kwargs)``.
        groups: every resident group, in admission order (which decides FIFO ties). In-flight
            groups are records with status PENDING or RUNNING, the trajectories put so far, and
            ``generation_seconds`` elapsed since their ``add_prompt``.
        partitions: every partition's admission state and cumulative counters.
        clocks: each partition's dispatch clock.
        evicted_in_flight: uids of groups evicted in flight that the buffer remembers.
    """

    format_version: int
    config: SamplerConfig
    policy: str | None
    groups: tuple[Group, ...]
    partitions: tuple[PartitionCheckpoint, ...]
    clocks: Mapping[str, int] = attrs.field(converter=_frozen_map)
    evicted_in_flight: tuple[str, ...] = attrs.field(converter=_as_tuple)

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
            ),
        )


@attrs.frozen(eq=False)
class RestoreResult:
    """What ``ReplayBuffer.restore`` returns.

    Attributes:
        buffer: the restored buffer.
        reissue: under ``in_flight="reissue"``, the groups that were in flight at the
            checkpoint (uid, partition, dispatch step, tags; no trajectories), in admission order: they
            are in the buffer as PENDING, to be generated again under the same uid.
    """

    buffer: ReplayBuffer
    reissue: tuple[Group, ...]


def capture(buffer: ReplayBuffer) -> BufferCheckpoint:
    """Return ``buffer``'s state; copies references, never payloads."""
    now = monotonic()
    clocks = buffer._clocks
    groups = tuple(
        group if isinstance(group, Group) else _snapshot(group, clocks.get(group.partition.name, 0), now)
        for group in buffer._groups.values()
    )
    partitions = tuple(
        PartitionCheckpoint(name, part.last_sampled, {key: getattr(part, key) for key in COUNTERS})
        for name, part in buffer._partitions.items()
    )
    policy = buffer._policy
    policy_name = None
    if type(policy).__module__ != "stalebuf.policy" and buffer.config.custom_sampler is None:
        policy_name = f"{type(policy).__module__}:{type(policy).__qualname__}"
    return BufferCheckpoint(
        FORMAT_VERSION,
        buffer.config,
        policy_name,
        groups,
        partitions,
        dict(clocks),
        tuple(buffer._evicted_in_flight),
    )


def _snapshot(group: OpenGroup, clock: int, now: float) -> Group:
    return new_group(
        group.uid,
        group.partition.name,
        group.dispatch_step,
        group.status,
        group.tags,
        tuple(group.trajectories.values()),
        max(clock, group.dispatch_step),
        now - group.admitted_at,
    )


def check_in_flight(in_flight: object) -> InFlightMode:
    """Return ``in_flight`` if it is one of the modes; raise ConfigError otherwise."""
    if type(in_flight) is not str or in_flight not in _IN_FLIGHT_MODES:
        raise ConfigError(f"in_flight must be one of {', '.join(map(repr, _IN_FLIGHT_MODES))}")
    return in_flight  # type: ignore[return-value]


def rebuild(buffer: ReplayBuffer, checkpoint: BufferCheckpoint, in_flight: InFlightMode) -> tuple[Group, ...]:
    """Fill the empty ``buffer`` with ``checkpoint``'s state; return the groups to reissue.

    Raises:
        CheckpointError: the checkpoint is inconsistent (a group of an unknown partition, a
            duplicate uid).
    """
    buffer._clocks.update(checkpoint.clocks)
    for saved in checkpoint.partitions:
        buffer._partition(saved.name).last_sampled = saved.last_sampled
    reissue: list[Group] = []
    discarded: dict[str, int] = {}  # partition -> trajectories dropped from reissued groups
    restarted: dict[str, list[Group]] = {}
    now = monotonic()
    for seq, group in enumerate(checkpoint.groups):
        part = buffer._partitions.get(group.partition)
        if part is None or group.uid in buffer._groups:
            raise CheckpointError(f"the checkpoint is inconsistent at group {describe(group.uid)}")
        if group.status is not _PENDING and group.status is not _RUNNING:
            _put_back_terminal(buffer, part, group, seq)
        elif in_flight == "evict":
            restarted.setdefault(part.name, []).append(group)
        elif in_flight == "keep":
            _put_back_in_flight(buffer, part, group, seq, now, keep=True)
        else:
            _put_back_in_flight(buffer, part, group, seq, now, keep=False)
            reissue.append(group.replace(status=_PENDING, trajectories=()))
            discarded[part.name] = discarded.get(part.name, 0) + count_trajectories(group)
    for saved in checkpoint.partitions:
        part = buffer._partitions[saved.name]
        for key in COUNTERS:  # cumulative counts are the saved ones, not what re-adding counted
            setattr(part, key, saved.counters.get(key, 0))
    for group in reissue:
        buffer._partitions[group.partition].reissued_groups += 1
    for name, count in discarded.items():
        buffer._partitions[name].reissued_trajectories += count
    buffer._next_seq = len(checkpoint.groups)
    buffer._evicted_in_flight = OrderedDict.fromkeys(checkpoint.evicted_in_flight)
    _evict_restarted(buffer, restarted)
    return tuple(reissue)


def _put_back_in_flight(
    buffer: ReplayBuffer, part: PartitionState, group: Group, seq: int, now: float, keep: bool
) -> None:
    state = OpenGroup(group.uid, part, group.dispatch_step, seq, group.tags, now - group.generation_seconds)
    buffer._groups[group.uid] = state
    part.admit(state)
    if keep:
        if group.status is _RUNNING:
            state.status = _RUNNING
            part.start()
        state.trajectories = {trajectory.key: trajectory for trajectory in group.trajectories}
        part.add_trajectories(len(group.trajectories))


def _put_back_terminal(buffer: ReplayBuffer, part: PartitionState, group: Group, seq: int) -> None:
    buffer._groups[group.uid] = group
    part.add_terminal(group, seq)


def _evict_restarted(buffer: ReplayBuffer, restarted: dict[str, list[Group]]) -> None:
    """Count and report in-flight groups evicted by ``in_flight="evict"`` (one event each)."""
    events = []
    for name, groups in restarted.items():
        part = buffer._partitions[name]
        part.evicted_restart_groups += len(groups)
        part.evicted_restart_trajectories += sum(map(count_trajectories, groups))
        events.append(EvictionEvent(name, "restart", tuple(groups), buffer._clocks.get(name, 0)))
        for group in groups:  # a producer that survived the restart learns why on its next write
            buffer._evicted_in_flight[group.uid] = None
    remembered = buffer._evicted_in_flight
    while len(remembered) > EVICTED_UIDS_REMEMBERED:  # the documented bound holds after a restore too
        remembered.popitem(last=False)
    if events:
        buffer._emit(events)


def policy_from_name(name: str, config: SamplerConfig) -> Any:
    """Build the policy a checkpoint names (``"module:QualName"``) as ``Cls(config, **kwargs)``.

    Raises:
        CheckpointError: it cannot be imported or built.
    """
    import importlib

    from .policy import StalenessPolicy

    module_name, _, qualname = name.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
    except Exception as exc:
        raise CheckpointError(
            f"cannot import the checkpoint's policy {describe(name)}: {describe_error(exc)}"
        ) from exc
    if not (isinstance(target, type) and issubclass(target, StalenessPolicy)):
        raise CheckpointError(f"the checkpoint's policy {describe(name)} is not a StalenessPolicy subclass")
    try:
        return target(config, **config.sampler_kwargs)
    except Exception as exc:
        raise CheckpointError(
            f"cannot rebuild the checkpoint's policy {describe(name)}: {describe_error(exc)}"
        ) from exc


def restore_buffer(
    cls: type[ReplayBuffer],
    source: object,
    in_flight: object,
    on_evict: object,
    status_log_interval: object,
    payload_codec: object,
) -> RestoreResult:
    """Build what ``ReplayBuffer.restore`` promises (see its docs)."""
    from ._checkpoint_file import read_checkpoint  # it imports this module
    from ._custom_sampler import build_from_config
    from .buffer import ReplayBuffer

    mode = check_in_flight(in_flight)
    codec = check_payload_codec(payload_codec)
    if isinstance(source, BufferCheckpoint):
        checkpoint = source
    elif isinstance(source, (str, os.PathLike)):
        checkpoint = read_checkpoint(source, codec)
    else:
        raise TypeError(f"source must be a BufferCheckpoint or a path, got {type(source).__name__}")
    if checkpoint.format_version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint format {checkpoint.format_version} is newer than {FORMAT_VERSION}")
    options: dict[str, Any] = {"status_log_interval": status_log_interval}
    if on_evict is not None:  # "restart" evictions are reported to it, from inside restore
        options["on_evict"] = on_evict
    config = checkpoint.config
    if checkpoint.policy is not None:
        buffer: ReplayBuffer = cls(config, policy=policy_from_name(checkpoint.policy, config), **options)
    else:
        buffer = build_from_config(cls, ReplayBuffer, config, options)
    reissue = rebuild(buffer, checkpoint, mode)
    return RestoreResult(buffer, reissue)
