"""The codec form of a checkpoint: JSON rows and payloads through the user's codec (a group's
record in the SQLite format, and the body of the older container)."""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from ._stored import peek_trajectories
from ._token_config import drop_unset_token_fields
from ._validation import check_tags, describe, describe_error
from .checkpoint import (
    FILTER_COUNTERS,
    FORMAT_VERSION,
    TOKEN_COUNTERS,
    BufferCheckpoint,
    FilterCheckpoint,
    MixtureCheckpoint,
    PartitionCheckpoint,
    TaskCheckpoint,
)
from .config import SamplerConfig
from .errors import CheckpointError
from .records import Group, Status, Trajectory, pack_runs

__all__ = [
    "plain_manifest",
    "read_plain",
    "read_plain_groups",
    "read_plain_manifest",
    "write_plain_groups",
    "written_counters",
]

_J = TypeVar("_J", dict[str, Any], list[Any])
_OMITTED_WHEN_ZERO = frozenset((*TOKEN_COUNTERS, *FILTER_COUNTERS))


# -- writing ------------------------------------------------------------------------------------


def plain_manifest(checkpoint: BufferCheckpoint) -> bytes:
    """The JSON manifest of ``checkpoint``: everything but its groups (it counts them).

    Raises:
        CheckpointError: a value JSON cannot hold (named).
    """
    config = drop_unset_token_fields(attrs.asdict(checkpoint.config))
    config["exempt_partitions"] = sorted(config["exempt_partitions"])
    config["sampler_kwargs"] = dict(config["sampler_kwargs"])
    config["task_thresholds"] = dict(config["task_thresholds"])
    if config["mixture"] is not None:
        config["mixture"] = dict(config["mixture"])
    manifest = {
        "config": config,
        "policy": checkpoint.policy,
        "partitions": [_partition_row(p) for p in checkpoint.partitions],
        "clocks": dict(checkpoint.clocks),
        "evicted_in_flight": list(checkpoint.evicted_in_flight),
        "evicted_reasons": list(checkpoint.evicted_reasons),
        "groups": len(checkpoint.groups),
    }
    return _to_json(manifest, "the config")


def write_plain_groups(
    groups: tuple[Group, ...],
    encode: Callable[[Any], bytes],
    write_frame: Callable[[bytes | bytearray | memoryview], None],
) -> None:
    """Write ``groups`` as one frame of JSON rows, then one frame per payload made by ``encode``.

    Raises:
        CheckpointError: a value JSON cannot hold (named), or ``encode`` failed or returned
            something other than bytes.
    """
    rows = [_group_row(group) for group in groups]
    for group, row in zip(groups, rows, strict=True):  # one by one, to name the group at fault
        _check_plain(row, f"group {describe(group.uid)}")
    write_frame(json.dumps(rows, allow_nan=True, separators=(",", ":")).encode())
    for group in groups:
        for trajectory in peek_trajectories(group):
            try:
                data = encode(trajectory.payload)
            except Exception as exc:
                raise CheckpointError(
                    f"encode failed for trajectory {describe(trajectory.key)}: {describe_error(exc)}"
                ) from exc
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise CheckpointError(
                    f"encode must return bytes, got {type(data).__name__} "
                    f"for trajectory {describe(trajectory.key)}"
                )
            write_frame(data)


def written_counters(counters: Mapping[str, int]) -> dict[str, int]:
    """The counters a file holds: all but the token and filter counters that are 0 (a partition
    that never counted a token or filtered a group is then written as before versions or filters
    existed; a reader fills in 0)."""
    return {key: value for key, value in counters.items() if value or key not in _OMITTED_WHEN_ZERO}


def _partition_row(saved: PartitionCheckpoint) -> list[Any]:
    """A partition's JSON row; the state of a task mixture or of filters is a 5th field, an
    object, only when it has some (files written before them hold rows of 4, or 3)."""
    row: list[Any] = [
        saved.name,
        saved.last_sampled,
        written_counters(saved.counters),
        list(saved.generation),
    ]
    extra: dict[str, Any] = {}
    mixture, filters = saved.mixture, saved.filters
    if mixture is not None:
        tasks = [[t.name, dict(t.counters), list(t.generation), t.balance, t.growth] for t in mixture.tasks]
        extra["mixture"] = [tasks, list(mixture.shares), mixture.batch_size]
    if filters is not None:
        extra["filters"] = [
            list(filters.verdicts),
            filters.errors,
            filters.recent_filtered,
            filters.recent_errors,
        ]
    if extra:
        row.append(extra)
    return row


def _group_row(group: Group) -> list[Any]:
    """A group's JSON row; its start version is a 9th field only when it is not the dispatch step,
    and a trajectory's versions and tokens two more fields only when it has any (files written
    before versions existed hold neither, and a reader of then reads a row without them)."""
    trajectories = [_trajectory_row(t) for t in peek_trajectories(group)]
    row = [
        group.uid,
        group.partition,
        group.dispatch_step,
        group.status.value,
        dict(group.tags),
        group.finish_step,
        group.generation_seconds,
        trajectories,
    ]
    if group.start_version != group.dispatch_step:
        row.append(group.start_version)
    return row


def _trajectory_row(trajectory: Trajectory) -> list[Any]:
    row = [trajectory.key, trajectory.session_id, trajectory.index, dict(trajectory.tags)]
    if trajectory.tokens or trajectory.versions:
        row += [[list(pair) for pair in trajectory.versions], trajectory.tokens]
    return row


def _to_json(value: Any, where: str) -> bytes:
    _check_plain(value, where)
    return json.dumps(value, allow_nan=True, separators=(",", ":")).encode()


def _check_plain(value: Any, where: str) -> None:
    """Raise CheckpointError naming the first value JSON cannot hold exactly."""
    kind = type(value)
    if value is None or kind in (str, int, bool):
        return
    if kind is float:
        return
    if kind is list:
        for item in value:
            _check_plain(item, where)
        return
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise CheckpointError(
                    f"{where}: a mapping key of type {type(key).__name__} cannot be saved as JSON"
                )
            _check_plain(item, f"{where}, key {describe(key)}")
        return
    raise CheckpointError(
        f"{where}: a value of type {kind.__name__} ({describe(value)}) cannot be saved as JSON "
        "(a plain format)"
    )


# -- reading ------------------------------------------------------------------------------------


#: The keys of a codec file's manifest and the JSON type of each value (None: any).
_MANIFEST = {"config": dict, "policy": None, "partitions": list, "clocks": dict, "evicted_in_flight": list,
             "evicted_reasons": list, "groups": int}  # fmt: skip
#: Keys added since the first codec files, with what an older file means by their absence.
_ADDED: dict[str, Any] = {"evicted_reasons": []}


def read_plain(
    next_frame: Callable[[], memoryview], decode: Callable[[bytes], Any]
) -> tuple[BufferCheckpoint, tuple[Group, ...]]:
    """The manifest and groups of a codec body, read from the frames ``next_frame`` hands out,
    payloads decoded by ``decode``.

    Raises:
        CheckpointError: the body is not shaped as the container held it (its manifest, then
            chunks as :func:`write_plain_groups` writes them), ``decode`` failed,
            or ``next_frame`` raised it (the file ends early).
    """
    checkpoint, count = read_plain_manifest(next_frame())
    groups: list[Group] = []
    while len(groups) < count:
        groups.extend(read_plain_groups(next_frame, decode, len(groups)))
    if len(groups) != count:
        raise CheckpointError(f"the file holds {len(groups)} groups where its manifest says {count}")
    return checkpoint, tuple(groups)


def read_plain_manifest(frame: bytes | memoryview) -> tuple[BufferCheckpoint, int]:
    """The checkpoint (without groups) and group count of a JSON manifest :func:`plain_manifest` wrote.

    Raises:
        CheckpointError: the manifest is not shaped as the writer writes it.
    """
    # Shapes only: the values go to _checkpoint_checks as they are, so it names the field at fault.
    manifest = json.loads(bytes(frame))
    if type(manifest) is dict and set(manifest) == set(_MANIFEST) - set(_ADDED):  # an older file
        manifest.update(_ADDED)
    if type(manifest) is not dict or set(manifest) != set(_MANIFEST):
        raise CheckpointError(
            f"the file's manifest must be a JSON object with the keys {', '.join(_MANIFEST)}"
        )
    for key, kind in _MANIFEST.items():
        if kind is not None and type(manifest[key]) is not kind:
            raise CheckpointError(f"the checkpoint's {key} must be a JSON {kind.__name__}")
    try:
        config = SamplerConfig(**manifest["config"])
    except Exception as exc:  # ConfigError naming the field, or TypeError for an unknown one
        raise CheckpointError(f"the checkpoint's config is invalid: {describe_error(exc)}") from exc
    partitions = [
        _partition_from_row(f"partitions[{index}]", row) for index, row in enumerate(manifest["partitions"])
    ]
    checkpoint = BufferCheckpoint(FORMAT_VERSION, config, manifest["policy"], (), tuple(partitions),
                                  manifest["clocks"], tuple(manifest["evicted_in_flight"]),
                                  tuple(manifest["evicted_reasons"]))  # fmt: skip
    return checkpoint, manifest["groups"]


def read_plain_groups(
    next_frame: Callable[[], memoryview], decode: Callable[[bytes], Any], first: int = 0
) -> list[Group]:
    """The groups of one frame of JSON rows, payloads decoded from the frames after it
    (``first``: the position of the first, to name a group at fault).

    Raises:
        CheckpointError: the frames are not shaped as :func:`write_plain_groups` writes them, or
            ``decode`` failed.
    """
    chunk = json.loads(bytes(next_frame()))
    if type(chunk) is not list or not chunk:
        raise CheckpointError(f"the file holds a {type(chunk).__name__} where a chunk of groups belongs")
    return [_group_from_row(f"groups[{first + i}]", row, next_frame, decode) for i, row in enumerate(chunk)]


def _row(where: str, value: object, size: int, longer: int | None = None) -> list[Any]:
    """``value``, a JSON list of ``size`` fields (or ``longer``, the row with its later fields).

    Raises:
        CheckpointError: it is something else.
    """
    if type(value) is not list or len(value) not in (size, longer):
        sizes = str(size) if longer is None else f"{size} or {longer}"
        raise CheckpointError(f"the checkpoint's {where} must be a JSON list of {sizes} fields")
    return value


def _partition_from_row(where: str, row: object) -> PartitionCheckpoint:
    """The partition of one JSON row (of 3 fields in older files, without generation times; of
    5 with the state of a task mixture or of filters).

    Raises:
        CheckpointError: the row is not shaped as the writer writes it.
    """
    if type(row) is list and len(row) == 3:  # an older file: no generation times
        row = [*row, []]
    name, last_sampled, counters, generation, *more = _row(where, row, 4, 5)
    _json(f"{where}.counters", counters, dict)  # its converter would read a list of pairs as a mapping
    _json(f"{where}.generation", generation, list)
    extra = _json(f"{where}[4]", more[0], dict) if more else {}
    if not extra.keys() <= {"mixture", "filters"}:
        raise CheckpointError(f"the checkpoint's {where}[4] may hold only the keys mixture and filters")
    mixture = filters = None
    if "mixture" in extra:
        tasks, shares, batch_size = _row(f"{where}.mixture", extra["mixture"], 3)
        mixture = MixtureCheckpoint(
            [
                _task_from_row(f"{where}.mixture.tasks[{i}]", task)
                for i, task in enumerate(_json(f"{where}.mixture.tasks", tasks, list))
            ],
            _json(f"{where}.mixture.shares", shares, list),
            batch_size,
        )
    if "filters" in extra:
        verdicts, errors, recent_filtered, recent_errors = _row(f"{where}.filters", extra["filters"], 4)
        filters = FilterCheckpoint(
            _json(f"{where}.filters.verdicts", verdicts, list), errors, recent_filtered, recent_errors
        )
    return PartitionCheckpoint(name, last_sampled, counters, generation, mixture, filters)


def _task_from_row(where: str, row: object) -> TaskCheckpoint:
    """One task's record of a mixture's JSON row.

    Raises:
        CheckpointError: the row is not shaped as the writer writes it.
    """
    name, counters, generation, balance, growth = _row(where, row, 5)
    _json(f"{where}.counters", counters, dict)
    return TaskCheckpoint(name, counters, _json(f"{where}.generation", generation, list), balance, growth)


def _json(where: str, value: Any, kind: type[_J]) -> _J:
    """``value`` if it is of the JSON type ``kind`` (the values inside go to the checks).

    Raises:
        CheckpointError: it is not.
    """
    if type(value) is not kind:
        raise CheckpointError(
            f"the checkpoint's {where} must be a JSON {'object' if kind is dict else kind.__name__}"
        )
    return value


def _group_from_row(
    where: str, row: object, next_frame: Callable[[], memoryview], decode: Callable[[bytes], Any]
) -> Group:
    """The group of one JSON row, its payloads decoded from the next frames.

    Raises:
        CheckpointError: the row is not shaped as the writer writes it, or ``decode`` failed.
    """
    uid, partition, step, status, tags, finish_step, seconds, rows, *start = _row(where, row, 8, 9)
    if type(rows) is not list:
        raise CheckpointError(f"the checkpoint's {where}.trajectories must be a JSON list")
    trajectories = []
    for position, trajectory in enumerate(rows):
        key, session_id, index, trajectory_tags, *counted = _row(
            f"{where}.trajectories[{position}]", trajectory, 4, 6
        )
        versions, tokens = (_segments(counted[0]), counted[1]) if counted else ((), 0)
        try:
            payload = decode(bytes(next_frame()))
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"decode failed for trajectory {describe(key)}: {describe_error(exc)}"
            ) from exc
        trajectories.append(
            tuple.__new__(  # its runs packed only if they can be: the checks name what is wrong
                Trajectory,
                (
                    key,
                    session_id,
                    index,
                    _frozen(trajectory_tags),
                    payload,
                    versions,
                    tokens,
                    _packed(versions),
                ),
            )
        )
    with contextlib.suppress(ValueError):  # not a status: left for the checks to name
        status = Status(status)
    if type(seconds) is float and not math.isfinite(seconds):
        seconds = 0.0  # JSON may hold NaN or Infinity; no clock measures either
    # An older row has no start version: the dispatch step. A given one goes to the checks as it
    # is (new_group would read a null as "the dispatch step").
    fields = (uid, partition, step, status, _frozen(tags), tuple(trajectories), finish_step, seconds)
    return tuple.__new__(Group, (*fields, start[0] if start else step))


def _packed(versions: Any) -> bytes:
    """``versions`` packed as the batch arrays read them, or ``b""`` if they cannot be (not int
    pairs): the checks then refuse them, naming the field."""
    try:
        return pack_runs(versions)
    except (TypeError, ValueError, struct.error):
        return b""


def _segments(versions: object) -> Any:
    """A JSON list of ``[version, n_tokens]`` lists as a tuple of pairs; another value as it is,
    for the checks to name."""
    if type(versions) is list and all(type(pair) is list for pair in versions):
        return tuple(map(tuple, versions))
    return versions


def _frozen(tags: object) -> Any:
    """A JSON object's read-only copy; another value as it is, for the checks to name."""
    return check_tags(tags) if type(tags) is dict else tags
