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

from collections.abc import Callable, Mapping
from math import isfinite
from operator import is_
from types import MappingProxyType
from typing import Any, TypeVar, cast

import attrs

from ._checkpoint_scan import behind_dicts, resident_if_valid
from ._checkpoint_versions import checked_versions
from ._lazy_group import LazyGroup, new_lazy_group
from ._partition import GENERATION_WINDOW
from ._store import CUT_REASON, EVICTED_UIDS_REMEMBERED
from ._validation import (
    MAX_INT,
    check_index,
    check_partition,
    check_step,
    check_tags,
    check_uid,
    describe,
    describe_error,
    is_finite_number,
)
from .checkpoint import COUNTERS, FORMAT_VERSION, TOKEN_COUNTERS, BufferCheckpoint, PartitionCheckpoint
from .config import SamplerConfig
from .errors import CheckpointError, ConfigError
from .records import EMPTY_TAGS, Group, Status, Trajectory, new_group, new_trajectory, pack_runs

__all__ = ["checked"]

_T = TypeVar("_T")
_COUNTER_NAMES = frozenset(COUNTERS)
_SEQUENCES = (tuple, list)
# The conservation law of stats() (see PartitionStats): what was admitted is resident or left
# by one of these ways; trajectories also leave when a reissuing restore discards them.
_GROUPS_LEFT = ("sampled_groups", "evicted_stale_groups", "evicted_failure_groups", "evicted_restart_groups")
_TRAJECTORIES_LEFT = (
    "sampled_trajectories",
    "evicted_stale_trajectories",
    "evicted_failure_trajectories",
    "evicted_restart_trajectories",
    "reissued_trajectories",
)
_TOKENS_LEFT = ("sampled_tokens", "evicted_tokens", "reissued_tokens")


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
        raise _invalid("format_version", f"must be an int >= 1, got {describe(version)}")
    if version > FORMAT_VERSION:
        raise _invalid(
            "format_version", f"{version} is newer than this stalebuf reads ({FORMAT_VERSION}): upgrade it"
        )
    config = _checked_config(checkpoint.config)
    policy = _checked_policy(checkpoint.policy, config)
    clocks = _checked_clocks(checkpoint.clocks)
    partitions = _checked_partitions(checkpoint.partitions, clocks)
    records, resident = _checked_groups(checkpoint.groups if groups is None else groups, partitions)
    for index, saved in enumerate(list(partitions.values())):
        partitions[saved.name] = _conserved(index, saved, *resident.get(saved.name, (0, 0, 0)))
    evicted = _checked_evicted(checkpoint.evicted_in_flight)
    reasons = _checked_reasons(checkpoint.evicted_reasons, len(evicted))
    return BufferCheckpoint(
        version, config, policy, records, tuple(partitions.values()), clocks, evicted, reasons
    )


def _invalid(where: str, why: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint's {where} {why}")


def _field(where: str, check: Callable[[Any], _T], value: object) -> _T:
    """``check(value)``, its error (a live validator's TypeError or ValueError) as a CheckpointError.

    Raises:
        CheckpointError: ``check`` refused ``value``.
    """
    try:
        return check(value)
    except (TypeError, ValueError) as exc:
        raise _invalid(where, f"is invalid: {exc}") from exc


def _copied(where: str, value: object) -> dict[Any, Any]:
    """A plain copy of the mapping ``value`` (a user mapping may raise while it is read).

    Raises:
        CheckpointError: ``value`` is not a mapping, or reading it raised.
    """
    if not isinstance(value, Mapping):
        raise _invalid(where, f"must be a mapping, got {type(value).__name__}")
    try:
        return dict(value)
    except Exception as exc:
        raise _invalid(where, f"cannot be read: {describe_error(exc)}") from exc


def _sequence(where: str, value: object) -> tuple[Any, ...]:
    if type(value) not in _SEQUENCES:
        raise _invalid(where, f"must be a tuple, got {type(value).__name__}")
    return tuple(value)  # type: ignore[arg-type]


# -- the config and the policy --------------------------------------------------------------------


def _checked_config(config: object) -> SamplerConfig:
    """``config`` if it is a SamplerConfig whose fields its own constructor accepts (a pickle can
    set the fields of an attrs instance without running its validators); a subclass's instance
    gives way to the plain SamplerConfig of its fields, which the checks and the restore read.

    Raises:
        CheckpointError: it is not, naming the field the constructor refused.
    """
    if not isinstance(config, SamplerConfig):
        raise _invalid("config", f"must be a SamplerConfig, got {type(config).__name__}")
    try:
        fields = {field.name: getattr(config, field.name) for field in attrs.fields(SamplerConfig)}
        rebuilt = SamplerConfig(**fields)
    except ConfigError as exc:  # its message names the field
        raise _invalid("config", f"is invalid: {exc}") from exc
    except Exception as exc:  # whatever a forged field raises
        raise _invalid("config", f"is invalid: {describe_error(exc)}") from exc
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
        raise _invalid("policy", f"must be None or 'module:QualName', got {describe(policy)}")
    if config.custom_sampler is not None:
        # A live buffer saves its policy's name only when its config names no custom sampler.
        raise _invalid("policy", "names a class although config.custom_sampler names one too")
    return policy  # type: ignore[return-value]


# -- partitions, clocks, evicted uids --------------------------------------------------------------


def _checked_clocks(clocks: object) -> dict[str, int]:
    """The clocks as a plain dict: partition names to steps.

    Raises:
        CheckpointError: a name or a step is invalid.
    """
    copied = _copied("clocks", clocks)
    for name, step in copied.items():
        where = f"clocks[{describe(name)}]"
        _field(where, check_partition, name)
        _field(where, lambda value: check_step(value, "a clock"), step)
    return copied


def _checked_partitions(partitions: object, clocks: Mapping[str, int]) -> dict[str, PartitionCheckpoint]:
    """The partitions by name, each rebuilt from its checked values (missing counters are 0).

    Raises:
        CheckpointError: a record, name, step or counter is invalid, or a name repeats.
    """
    checked_partitions: dict[str, PartitionCheckpoint] = {}
    for index, saved in enumerate(_sequence("partitions", partitions)):
        where = f"partitions[{index}]"
        if type(saved) is not PartitionCheckpoint:
            raise _invalid(where, f"must be a PartitionCheckpoint, got {type(saved).__name__}")
        name = _field(f"{where}.name", check_partition, saved.name)
        if name in checked_partitions:
            raise _invalid(f"{where}.name", f"{describe(name)} repeats an earlier partition's")
        last = saved.last_sampled
        if type(last) is not int or not -1 <= last <= MAX_INT:
            raise _invalid(f"{where}.last_sampled", f"must be an int >= -1, got {describe(last)}")
        if last > clocks.get(name, 0):  # a sample moves the clock to its step before it returns
            raise _invalid(f"{where}.last_sampled", f"{last} is past the partition's clock")
        counters = _copied(f"{where}.counters", saved.counters)
        for key, value in counters.items():
            if type(key) is not str or key not in _COUNTER_NAMES:
                raise _invalid(f"{where}.counters", f"has an unknown counter {describe(key)}")
            _field(f"{where}.counters[{key!r}]", lambda value: check_step(value, "a counter"), value)
        # Token counters stay absent if all are (an older file): _conserved derives them.
        given = not counters.keys().isdisjoint(TOKEN_COUNTERS)
        counters = {key: counters.get(key, 0) for key in COUNTERS if given or key not in TOKEN_COUNTERS}
        if counters["evicted_in_flight_groups"] > counters["evicted_stale_groups"]:  # a part of it
            raise _invalid(f"{where}.counters", "count more groups evicted in flight than as stale")
        generation = _checked_generation(f"{where}.generation", saved.generation)
        checked_partitions[name] = PartitionCheckpoint(name, last, counters, generation)
    return checked_partitions


def _conserved(
    index: int, saved: PartitionCheckpoint, groups: int, trajectories: int, tokens: int
) -> PartitionCheckpoint:
    """Check the conservation laws of ``stats()`` for one partition with its resident counts;
    return it with its token counters, derived if it has none (a file written before versions
    existed): every resident token admitted, none gone yet.

    Raises:
        CheckpointError: the counters do not add up.
    """
    counters = dict(saved.counters)
    if "admitted_tokens" not in counters:
        counters.update(dict.fromkeys(TOKEN_COUNTERS, 0), admitted_tokens=tokens)
    for kind, resident, left in (
        ("groups", groups, _GROUPS_LEFT),
        ("trajectories", trajectories, _TRAJECTORIES_LEFT),
        ("tokens", tokens, _TOKENS_LEFT),
    ):
        admitted = counters[f"admitted_{kind}"]
        accounted = resident + sum(counters[key] for key in left)
        if admitted != accounted:
            raise _invalid(
                f"partitions[{index}].counters",
                f"do not conserve {kind}: {admitted} admitted, but {resident} resident and "
                f"{accounted - resident} gone ({', '.join(left)})",
            )
    if counters["masked_tokens"] > counters["sampled_tokens"]:  # a part of them
        raise _invalid(f"partitions[{index}].counters", "count more tokens masked than sampled")
    if counters.keys() == saved.counters.keys():
        return saved
    return PartitionCheckpoint(saved.name, saved.last_sampled, counters, saved.generation)


def _checked_evicted(uids: object) -> tuple[str, ...]:
    """The uids of groups evicted in flight, checked as uids, distinct and within the bound.

    Raises:
        CheckpointError: one is not a valid uid, repeats, or there are too many.
    """
    values = _sequence("evicted_in_flight", uids)
    if len(values) > EVICTED_UIDS_REMEMBERED:
        raise _invalid(
            "evicted_in_flight", f"holds {len(values)} uids; a buffer remembers {EVICTED_UIDS_REMEMBERED}"
        )
    for index, uid in enumerate(values):
        _field(f"evicted_in_flight[{index}]", check_uid, uid)
    if len(set(values)) != len(values):
        twice = next(uid for uid in values if values.count(uid) > 1)
        raise _invalid("evicted_in_flight", f"holds {describe(twice)} twice")
    return values


def _checked_reasons(reasons: object, count: int) -> tuple[str | None, ...]:
    """Why each remembered uid was ended in flight: none given (an older file), or one each of
    None (stale), "restart" or a cut's "cut at its deadline of ... s".

    Raises:
        CheckpointError: another value, or another count than the uids'.
    """
    values = _sequence("evicted_reasons", reasons)
    if values and len(values) != count:
        raise _invalid("evicted_reasons", f"holds {len(values)} reasons for {count} uids")
    for index, reason in enumerate(values):
        if not (reason is None or reason == "restart" or _is_cut_reason(reason)):
            raise _invalid(
                f"evicted_reasons[{index}]",
                f"must be None, 'restart' or 'cut at its deadline of ...', got {describe(reason)}",
            )
    return tuple(values)


def _is_cut_reason(reason: object) -> bool:
    return type(reason) is str and len(reason) <= 80 and reason.startswith(CUT_REASON)


def _checked_generation(where: str, times: object) -> tuple[float, ...]:
    """Measured generation times: at most the window, each a finite float >= 0.

    Raises:
        CheckpointError: another value, or more than the window holds.
    """
    values = _sequence(where, times)
    if len(values) > GENERATION_WINDOW:
        raise _invalid(where, f"holds {len(values)} times; a partition keeps {GENERATION_WINDOW}")
    for index, seconds in enumerate(values):
        if type(seconds) is not float or not isfinite(seconds) or seconds < 0.0:
            raise _invalid(f"{where}[{index}]", f"must be a finite float >= 0, got {describe(seconds)}")
    return tuple(values)


# -- groups -----------------------------------------------------------------------------------------


def _checked_groups(
    groups: object, partitions: Mapping[str, PartitionCheckpoint]
) -> tuple[tuple[Group, ...], dict[str, tuple[int, int, int]]]:
    """The groups (a record rebuilt where tags or versions needed copying), and each partition's
    resident (groups, trajectories, tokens).

    Raises:
        CheckpointError: a group is invalid, of an unknown partition, or repeats a uid.
    """
    records = _sequence("groups", groups)
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
        raise _invalid(where, f"must be a Group record, got {got}")
    uid, partition, step, status, tags, stored, finish, seconds, start = values
    uid = _field(f"{where}.uid", check_uid, uid)
    _field(f"{where}.partition", check_partition, partition)
    _field(f"{where}.dispatch_step", lambda value: check_step(value, "dispatch_step"), step)
    if type(status) is not Status:
        raise _invalid(f"{where}.status", f"must be a Status, got {describe(status)}")
    _field(f"{where}.finish_step", lambda value: check_step(value, "finish_step"), finish)
    if finish < step:  # a group finishes at the clock, never before its dispatch step
        raise _invalid(f"{where}.finish_step", f"{finish} is before its dispatch_step {step}")
    if not is_finite_number(seconds) or seconds < 0:
        raise _invalid(
            f"{where}.generation_seconds", f"must be a finite number >= 0, got {describe(seconds)}"
        )
    _field(f"{where}.start_version", lambda value: check_step(value, "start_version"), start)
    frozen = _checked_tags(f"{where}.tags", tags)
    if kind is LazyGroup:  # default keys: every record it builds is valid once its uid is
        if type(stored) is not tuple:
            raise _invalid(
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
    values = _sequence(f"{where}.trajectories", records)
    out: list[Trajectory] = []
    seen: dict[str, int] = {}
    for index, trajectory in enumerate(values):
        checked_record = _checked_trajectory(f"{where}.trajectories[{index}]", uid, trajectory)
        key = checked_record.key
        if seen.setdefault(key, index) != index:
            raise _invalid(
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
        raise _invalid(where, f"must be a Trajectory record, got {got}")
    key, session_id, index, tags, payload, versions, tokens, runs = values
    _field(f"{where}.session_id", lambda value: check_index(value, "session_id"), session_id)
    _field(f"{where}.index", lambda value: check_index(value, "index"), index)
    expected = f"{uid}_{session_id}_{index}"
    if type(key) is not str or key != expected:
        raise _invalid(
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
        raise _invalid(where, f"is invalid: {exc}") from exc
