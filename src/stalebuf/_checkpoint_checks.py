"""Checking a checkpoint before anything is built from it: :func:`checked`.

A checkpoint reaches ``restore`` from a file anyone can write (its SHA-256 is unkeyed: a crafted
file has a valid checksum) or as a value built by hand. Every field is checked as strictly as the
live API checks its inputs (with the same validators), and the laws a live buffer keeps are
checked too: unique uids, keys that spell their uid, session and index, counters that conserve
the groups. Whatever fails is a CheckpointError naming the field (``groups[3].uid``), before a
buffer is built: never another exception from deep inside ``restore``, never a buffer in a state
no live buffer could reach.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import is_
from types import MappingProxyType
from typing import Any, cast

import attrs

from ._checkpoint_fields import copied, field, invalid, sequence
from ._checkpoint_partitions import checked_partitions, conserved
from ._checkpoint_scan import behind_dicts, resident_if_valid
from ._checkpoint_versions import checked_versions
from ._lazy_group import LazyGroup, new_lazy_group
from ._store import CUT_REASON, EVICTED_UIDS_REMEMBERED, FILTERED_REASON
from ._validation import (
    check_index,
    check_partition,
    check_step,
    check_tags,
    check_uid,
    describe,
    describe_error,
    is_finite_number,
)
from .checkpoint import FORMAT_VERSION, BufferCheckpoint, PartitionCheckpoint
from .config import SamplerConfig
from .errors import CheckpointError, ConfigError
from .records import EMPTY_TAGS, Group, Status, Trajectory, new_group, new_trajectory, pack_runs

__all__ = ["checked"]

#: The reasons a group was ended in flight, besides None (stale) and a cut's.
_REASONS = ("restart", FILTERED_REASON)


def checked(checkpoint: object, groups: object = None) -> BufferCheckpoint:
    """Return the checkpoint ``restore`` may rebuild from ``checkpoint``: its checked values (tags
    given as plain mappings copied read-only, as ``put`` copies them). ``groups``, if given, are
    checked in place of the checkpoint's (a pickle file's manifest holds none, and rebuilding it
    with them would run its converters on values not yet checked).

    Raises:
        CheckpointError: a field holds what no live buffer could hold; the message names it.
    """
    # Exact types, here and for every record: a subclass could answer each read differently.
    if type(checkpoint) is not BufferCheckpoint:
        raise CheckpointError(f"a checkpoint must be a BufferCheckpoint, got {type(checkpoint).__name__}")
    version = checkpoint.format_version
    if type(version) is not int or version < 1:
        raise invalid("format_version", f"must be an int >= 1, got {describe(version)}")
    if version > FORMAT_VERSION:
        raise invalid(
            "format_version", f"{version} is newer than this stalebuf reads ({FORMAT_VERSION}): upgrade it"
        )
    config = _checked_config(checkpoint.config)
    policy = _checked_policy(checkpoint.policy, config)
    clocks = _checked_clocks(checkpoint.clocks)
    partitions = checked_partitions(checkpoint.partitions, clocks, config)
    records, resident = _checked_groups(checkpoint.groups if groups is None else groups, partitions)
    partitions = conserved(partitions, records, resident, config)
    evicted = _checked_evicted(checkpoint.evicted_in_flight)
    reasons = _checked_reasons(checkpoint.evicted_reasons, len(evicted))
    return BufferCheckpoint(
        version, config, policy, records, tuple(partitions.values()), clocks, evicted, reasons
    )


# -- the config and the policy --------------------------------------------------------------------


def _checked_config(config: object) -> SamplerConfig:
    """``config`` if it is a SamplerConfig whose fields its own constructor accepts (a pickle can
    set the fields of an attrs instance without running its validators); a subclass's instance
    gives way to the plain SamplerConfig of its fields, which the checks and the restore read.

    Raises:
        CheckpointError: it is not, naming the field the constructor refused.
    """
    if not isinstance(config, SamplerConfig):
        raise invalid("config", f"must be a SamplerConfig, got {type(config).__name__}")
    try:
        fields = {item.name: getattr(config, item.name) for item in attrs.fields(SamplerConfig)}
        rebuilt = SamplerConfig(**fields)
    except ConfigError as exc:  # its message names the field
        raise invalid("config", f"is invalid: {exc}") from exc
    except Exception as exc:  # whatever a forged field raises
        raise invalid("config", f"is invalid: {describe_error(exc)}") from exc
    return config if type(config) is SamplerConfig else rebuilt


def _checked_policy(policy: object, config: SamplerConfig) -> str | None:
    """``policy`` if it is None or ``"module:QualName"`` (``restore`` imports and checks the class).

    Raises:
        CheckpointError: it is neither, or the config names a custom sampler too.
    """
    if policy is None:
        return None
    module, _, qualname = policy.partition(":") if type(policy) is str else ("", "", "")
    if not all(part.isidentifier() for part in (*module.split("."), *qualname.split("."))):
        raise invalid("policy", f"must be None or 'module:QualName', got {describe(policy)}")
    if config.custom_sampler is not None:
        # A live buffer saves its policy's name only when its config names no custom sampler.
        raise invalid("policy", "names a class although config.custom_sampler names one too")
    return policy  # type: ignore[return-value]


# -- partitions, clocks, evicted uids --------------------------------------------------------------


def _checked_clocks(clocks: object) -> dict[str, int]:
    """The clocks as a plain dict: partition names to steps.

    Raises:
        CheckpointError: a name or a step is invalid.
    """
    values = copied("clocks", clocks)
    for name, step in values.items():
        where = f"clocks[{describe(name)}]"
        field(where, check_partition, name)
        field(where, lambda value: check_step(value, "a clock"), step)
    return values


def _checked_evicted(uids: object) -> tuple[str, ...]:
    """The uids of groups evicted in flight, checked as uids, distinct and within the bound.

    Raises:
        CheckpointError: one is not a valid uid, repeats, or there are too many.
    """
    values = sequence("evicted_in_flight", uids)
    if len(values) > EVICTED_UIDS_REMEMBERED:
        raise invalid(
            "evicted_in_flight", f"holds {len(values)} uids; a buffer remembers {EVICTED_UIDS_REMEMBERED}"
        )
    for index, uid in enumerate(values):
        field(f"evicted_in_flight[{index}]", check_uid, uid)
    if len(set(values)) != len(values):
        twice = next(uid for uid in values if values.count(uid) > 1)
        raise invalid("evicted_in_flight", f"holds {describe(twice)} twice")
    return values


def _checked_reasons(reasons: object, count: int) -> tuple[str | None, ...]:
    """Why each remembered uid was ended in flight: none given (an older file), or one each of
    None (stale), "restart", "filtered" or a cut's "cut at its deadline of ... s" (then perhaps
    " (then filtered)").

    Raises:
        CheckpointError: another value, or another count than the uids'.
    """
    values = sequence("evicted_reasons", reasons)
    if values and len(values) != count:
        raise invalid("evicted_reasons", f"holds {len(values)} reasons for {count} uids")
    for index, reason in enumerate(values):
        if not (reason is None or reason in _REASONS or _is_cut_reason(reason)):
            raise invalid(
                f"evicted_reasons[{index}]",
                "must be None, 'restart', 'filtered' or 'cut at its deadline of ...', got "
                f"{describe(reason)}",
            )
    return tuple(values)


def _is_cut_reason(reason: object) -> bool:
    return type(reason) is str and len(reason) <= 80 and reason.startswith(CUT_REASON)


# -- groups -----------------------------------------------------------------------------------------


def _checked_groups(
    groups: object, partitions: Mapping[str, PartitionCheckpoint]
) -> tuple[tuple[Group, ...], dict[str, tuple[int, int, int]]]:
    """The groups (a record rebuilt where tags or versions needed copying), and each partition's
    resident (groups, trajectories, tokens).

    Raises:
        CheckpointError: a group is invalid, of an unknown partition, or repeats a uid.
    """
    records = sequence("groups", groups)
    resident = resident_if_valid(records, partitions)
    if resident is not None:  # the common case, checked by C-level loops over every group at once
        return records, resident
    # Group by group: slower, and names the field at fault.
    out: list[Group] = []
    seen: dict[str, int] = {}
    resident = {}
    for index, group in enumerate(records):
        record, count, tokens = _checked_group(index, group)
        uid, partition = record.uid, record.partition
        if partition not in partitions:
            raise CheckpointError(
                f"the checkpoint is inconsistent: groups[{index}].partition {describe(partition)} is not "
                "one of its partitions"
            )
        if seen.setdefault(uid, index) != index:
            raise CheckpointError(
                f"the checkpoint is inconsistent: groups[{index}].uid {describe(uid)} is also "
                f"groups[{seen[uid]}]'s"
            )
        held = resident.get(partition, (0, 0, 0))
        resident[partition] = (held[0] + 1, held[1] + count, held[2] + tokens)
        out.append(record)
    return tuple(out), resident


def _checked_group(index: int, group: object) -> tuple[Group, int, int]:
    """The group (rebuilt if a tags mapping or versions needed copying), how many trajectories
    and how many tokens it holds.

    Raises:
        CheckpointError: a field is invalid (named).
    """
    where = f"groups[{index}]"
    kind = type(group)
    record = cast(Group, group) if kind is Group or kind is LazyGroup else None
    # The slots themselves: a lazily stored group holds its payloads where records hold trajectories.
    values: tuple[Any, ...] = () if record is None else tuple(tuple.__iter__(record))
    if record is None or len(values) != len(Group._fields):
        got = f"one of {len(values)} fields" if record is not None else kind.__name__
        raise invalid(where, f"must be a Group record, got {got}")
    uid, partition, step, status, tags, stored, finish, seconds, start = values
    uid = field(f"{where}.uid", check_uid, uid)
    field(f"{where}.partition", check_partition, partition)
    field(f"{where}.dispatch_step", lambda value: check_step(value, "dispatch_step"), step)
    if type(status) is not Status:
        raise invalid(f"{where}.status", f"must be a Status, got {describe(status)}")
    field(f"{where}.finish_step", lambda value: check_step(value, "finish_step"), finish)
    if finish < step:  # a group finishes at the clock, never before its dispatch step
        raise invalid(f"{where}.finish_step", f"{finish} is before its dispatch_step {step}")
    if not is_finite_number(seconds) or seconds < 0:
        raise invalid(f"{where}.generation_seconds", f"must be a finite number >= 0, got {describe(seconds)}")
    field(f"{where}.start_version", lambda value: check_step(value, "start_version"), start)
    frozen = _checked_tags(f"{where}.tags", tags)
    if kind is LazyGroup:  # default keys: every record it builds is valid once its uid is
        if type(stored) is not tuple:
            raise invalid(
                f"{where}.trajectories", f"must be a tuple of payloads, got {type(stored).__name__}"
            )
        records = stored
    else:
        records = _checked_trajectories(where, uid, stored)
    tokens = 0 if kind is LazyGroup else sum(trajectory.tokens for trajectory in records)
    if frozen is tags and records is stored:
        return record, len(records), tokens
    if kind is LazyGroup:
        record = new_lazy_group(uid, partition, step, status, frozen, records, finish, seconds, start)
    else:
        record = new_group(uid, partition, step, status, frozen, records, finish, seconds, start)
    return record, len(records), tokens


def _checked_trajectories(where: str, uid: str, records: object) -> tuple[Trajectory, ...]:
    """A group's trajectory records (rebuilt where a tags mapping needed copying): distinct keys,
    each spelling its uid, session id and index.

    Raises:
        CheckpointError: a record is invalid or repeats a key (named).
    """
    values = sequence(f"{where}.trajectories", records)
    out: list[Trajectory] = []
    seen: dict[str, int] = {}
    for index, trajectory in enumerate(values):
        checked_record = _checked_trajectory(f"{where}.trajectories[{index}]", uid, trajectory)
        key = checked_record.key
        if seen.setdefault(key, index) != index:
            raise invalid(
                f"{where}.trajectories[{index}].key", f"{describe(key)} repeats trajectories[{seen[key]}]'s"
            )
        out.append(checked_record)
    if all(map(is_, out, values)):
        return values
    return tuple(out)


def _checked_trajectory(where: str, uid: str, trajectory: object) -> Trajectory:
    """The trajectory record (rebuilt if its tags needed copying).

    Raises:
        CheckpointError: a field is invalid (named).
    """
    record = trajectory if type(trajectory) is Trajectory else None
    values: tuple[Any, ...] = () if record is None else tuple(tuple.__iter__(record))
    if record is None or len(values) != Trajectory.SLOTS:
        got = f"one of {len(values)} fields" if record is not None else type(trajectory).__name__
        raise invalid(where, f"must be a Trajectory record, got {got}")
    key, session_id, index, tags, payload, versions, tokens, runs = values
    field(f"{where}.session_id", lambda value: check_index(value, "session_id"), session_id)
    field(f"{where}.index", lambda value: check_index(value, "index"), index)
    expected = f"{uid}_{session_id}_{index}"
    if type(key) is not str or key != expected:
        raise invalid(
            f"{where}.key", f"must be {describe(expected)} (uid_session_index), got {describe(key)}"
        )
    frozen = _checked_tags(f"{where}.tags", tags)
    segments = checked_versions(where, versions, tokens)
    # The packed copy of the versions the batch arrays read is rebuilt unless it is theirs.
    if frozen is tags and segments is versions and type(runs) is bytes and runs == pack_runs(segments):
        return record
    return new_trajectory(key, session_id, index, frozen, payload, segments, tokens)


def _checked_tags(where: str, tags: object) -> Mapping[str, Any]:
    """``tags`` if it is what ``put`` makes (the shared empty mapping, or a read-only view of a
    plain dict); another mapping copied into one, as ``put`` copies it; None as no tags.

    Raises:
        CheckpointError: ``tags`` is not a mapping, or reading it raised.
    """
    if tags is EMPTY_TAGS or (type(tags) is MappingProxyType and behind_dicts([tags])):
        return tags
    try:
        return check_tags(tags)
    except TypeError as exc:
        raise invalid(where, f"is invalid: {exc}") from exc
