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

import importlib
import os
from collections.abc import Mapping
from time import monotonic
from typing import Any

import attrs

from ._admission import Admission
from ._checkpoint_checks import checked
from ._checkpoint_db import read_checkpoint
from ._custom_sampler import build_from_config, load_custom_sampler
from ._eviction import Eviction, check_on_evict
from ._filtering import Filtering
from ._group_snapshots import snapshot
from ._mixture import Mixing
from ._partition import PartitionState
from ._store import GroupStore
from ._stored import count_trajectories
from ._token_ledger import group_tokens
from ._validation import check_payload_codec, check_status_log_interval, describe, describe_error
from .checkpoint import (
    COUNTERS,
    FORMAT_VERSION,
    IN_FLIGHT_MODES,
    NOT_GIVEN,
    BufferCheckpoint,
    InFlightMode,
    MixtureCheckpoint,
    PartitionCheckpoint,
    TaskCheckpoint,
)
from .config import SamplerConfig
from .errors import CheckpointError, ConfigError
from .policy import StalenessPolicy
from .records import EvictionEvent, Group, Status

__all__ = [
    "build_restored",
    "capture",
    "capture_state",
    "check_in_flight",
    "policy_from_name",
    "policy_of",
    "read_restore_arguments",
    "rebuild",
]

_PENDING, _RUNNING = Status.PENDING, Status.RUNNING


def capture(
    store: GroupStore, admission: Admission, filtering: Filtering, mixing: Mixing
) -> BufferCheckpoint:
    """Return the state of a buffer's parts; copies references, never payloads.

    Raises:
        CheckpointError: the policy was built from another config than the buffer's, or restore
            would not rebuild it with the same rules (see :func:`_policy_name`).
    """
    policy = policy_of(store)
    state = capture_state(store, admission, filtering, mixing, policy)
    now = monotonic()
    clocks = admission.clocks
    groups = tuple(
        group if isinstance(group, Group) else snapshot(group, clocks.get(group.partition, 0), now)
        for group in store.groups.values()
    )
    return attrs.evolve(state, groups=groups)


def policy_of(store: GroupStore) -> str | None:
    """How a checkpoint names the store's policy (see :func:`_policy_name`).

    Raises:
        CheckpointError: as :func:`capture`.
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
    return _policy_name(rules.base, config)


def capture_state(
    store: GroupStore,
    admission: Admission,
    filtering: Filtering,
    mixing: Mixing,
    policy: str | None,
) -> BufferCheckpoint:
    """Return the state of a buffer's parts but its groups (``policy``: :func:`policy_of`'s answer)."""
    partitions = tuple(
        _saved_partition(name, part, admission.last_sampled(name), filtering, mixing)
        for name, part in store.partitions.items()
    )
    remembered = store.evicted_in_flight
    return BufferCheckpoint(
        FORMAT_VERSION,
        store.rules.config,
        policy,
        (),
        partitions,
        dict(admission.clocks),
        tuple(remembered),
        tuple(remembered.values()),
    )


def _saved_partition(
    name: str, part: PartitionState, last_sampled: int, filtering: Filtering, mixing: Mixing
) -> PartitionCheckpoint:
    """Partition ``name``'s saved state: under a task mixture, its counters summed over its task
    cells, each cell's own and the ledger of selection; the filters' ledger, if any."""
    filters = filtering.saved(name)
    cells = part.cells
    if cells is None:
        return PartitionCheckpoint(name, last_sampled, _counters(part), tuple(part.generation), None, filters)
    balances, growth, shares, batch_size = mixing.saved(name)
    tasks = tuple(
        TaskCheckpoint(task, _counters(cell), tuple(cell.generation), balances[task], growth[task])
        for task, cell in cells.items()
    )
    counters = {key: sum(task.counters[key] for task in tasks) for key in COUNTERS}
    return PartitionCheckpoint(
        name, last_sampled, counters, (), MixtureCheckpoint(tasks, shares, batch_size), filters
    )


def _counters(part: PartitionState) -> dict[str, int]:
    return {key: getattr(part, key) for key in COUNTERS}


def _policy_name(policy: StalenessPolicy, config: SamplerConfig) -> str | None:
    """Return how a checkpoint names ``policy``: None when ``restore`` builds it from ``config``
    alone (``StalenessPolicy(config)``, or the custom sampler ``config`` names), else
    ``"module:QualName"``, which ``restore`` builds as ``Cls(config, **config.sampler_kwargs)``.

    A checkpoint holds no policy object (a codec file cannot hold one, and a live policy in a
    frozen value would change under it): so the policy restore would build is built here and
    compared with ``policy``, and a policy it would not rebuild with the same rules is refused.

    Raises:
        CheckpointError: restore would build another policy, or none (the message says what to do).
    """
    kind = type(policy)
    if config.custom_sampler is not None:  # built by from_config, rebuilt the same way
        _check_named_policy(kind, config.custom_sampler)
        return None
    name = None if kind is StalenessPolicy else f"{kind.__module__}:{kind.__qualname__}"
    built = (
        "StalenessPolicy(config)" if name is None else f"{kind.__qualname__}(config, **config.sampler_kwargs)"
    )
    refusal = f"this buffer's policy cannot be checkpointed: restore rebuilds it as {built}"
    if "<locals>" in kind.__qualname__:  # no import can find it by that name
        raise CheckpointError(
            f"{refusal}, but its class is defined inside a function: define {kind.__name__} at module level"
        )
    try:
        fresh = StalenessPolicy(config) if name is None else policy_from_name(name, config)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{refusal}, which fails ({exc}); pass its constructor's arguments in "
            "SamplerConfig.sampler_kwargs"
        ) from exc
    if type(fresh) is not kind:
        raise CheckpointError(
            f"{refusal}, but {name!r} now names another class: define it once, at module level"
        )
    difference = _difference(policy, fresh)
    if difference is not None:
        raise CheckpointError(
            f"{refusal}, whose {difference} differs from this policy's, so the restored buffer would "
            f"follow other rules; build the policy as {built} (its constructor's arguments in "
            "SamplerConfig.sampler_kwargs), keep state that changes while it runs out of it, or define "
            f"{kind.__qualname__}.__eq__ to say when a rebuilt one is the same"
        )
    return name


def _check_named_policy(kind: type, spec: str) -> None:
    """Refuse a policy of another class than the one the config's ``custom_sampler`` names (restore
    would build that one instead).

    Raises:
        CheckpointError: it names a StalenessPolicy subclass other than ``kind``.
    """
    try:
        target = load_custom_sampler(spec)
    except ConfigError:
        return  # restore reports it, as it always did
    if isinstance(target, type) and issubclass(target, StalenessPolicy) and target is not kind:
        raise CheckpointError(
            f"this buffer's policy, a {kind.__qualname__}, cannot be checkpointed: its config names "
            f"custom_sampler {describe(spec)}, which restore builds instead; build the buffer with "
            "ReplayBuffer.from_config(config), or from a config that names no custom sampler"
        )


_ABSENT = object()


def _difference(policy: StalenessPolicy, fresh: StalenessPolicy) -> str | None:
    """Say where ``fresh`` (the policy restore would build) differs from ``policy``: what the
    class's own ``__eq__`` says if it defines one, else the first attribute (in its ``__dict__``
    or its slots) that is neither the same object nor ``==``; None if nowhere."""
    try:
        if type(policy).__eq__ is not object.__eq__:
            return None if bool(policy == fresh) else "value (by its __eq__)"
        mine, theirs = _attributes(policy), _attributes(fresh)
        for name in (*mine, *(name for name in theirs if name not in mine)):
            value, other = mine.get(name, _ABSENT), theirs.get(name, _ABSENT)
            if value is not other and (value is _ABSENT or other is _ABSENT or not bool(value == other)):
                return f"attribute {describe(name)}"
    except Exception as exc:  # an __eq__ or an attribute that raises: it cannot be shown the same
        return f"state (comparing it raised {describe_error(exc)})"
    return None


def _attributes(policy: StalenessPolicy) -> dict[str, Any]:
    """A policy's attributes: its ``__dict__`` and the slots its classes declare."""
    found = dict(vars(policy)) if hasattr(policy, "__dict__") else {}
    for cls in type(policy).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            private = slot.startswith("__") and not slot.endswith("__")
            name = f"_{cls.__name__.lstrip('_')}{slot}" if private else slot
            if name not in ("__dict__", "__weakref__"):
                value = getattr(policy, name, _ABSENT)
                if value is not _ABSENT:
                    found[name] = value
    return found


def rebuild(
    store: GroupStore,
    admission: Admission,
    eviction: Eviction,
    ledgers: tuple[Filtering, Mixing],
    checkpoint: BufferCheckpoint,
    in_flight: InFlightMode,
) -> tuple[Group, ...]:
    """Fill the empty parts (``ledgers``: the consumer's filters and mixture ledgers) with
    ``checkpoint``'s state; return the groups to reissue (under "reissue" without their
    trajectories, under "resume" with them).

    Raises:
        CheckpointError: the checkpoint is inconsistent (a group of an unknown partition, a
            duplicate uid, a partition saved under a task mixture that is not under one now, or
            the other way round).
        Exception: whatever ``on_evict`` raised (under "evict", after the state is rebuilt).
    """
    admission.restore(
        dict(checkpoint.clocks), {saved.name: saved.last_sampled for saved in checkpoint.partitions}
    )
    filtering, mixing = ledgers
    for saved in checkpoint.partitions:
        for cell, _, generation in _cells(store, saved):
            store.restore_generation(cell, generation)
        if saved.filters is not None:
            filtering.restore(saved.name, saved.filters)
        mixture = saved.mixture
        if mixture is not None:
            balances = {task.name: task.balance for task in mixture.tasks}
            growth = {task.name: task.growth for task in mixture.tasks}
            mixing.restore(saved.name, balances, growth, mixture.shares, mixture.batch_size)
    reissue, reissued, restarted = _restore_groups(store, checkpoint.groups, in_flight)
    for saved in checkpoint.partitions:  # cumulative counts are the saved ones, not what re-adding counted
        for cell, counters, _ in _cells(store, saved):
            counts = reissued.get(cell.key, [0, 0, 0])
            store.restore_counters(
                cell, {key: counters.get(key, 0) for key in COUNTERS}, (counts[0], counts[1], counts[2])
            )
    store.restore_sequence(len(checkpoint.groups), checkpoint.evicted_in_flight, checkpoint.evicted_reasons)
    events = []
    for name, groups in restarted.items():
        store.count_restarted(groups)
        events.append(EvictionEvent(name, "restart", tuple(groups), admission.clocks.get(name, 0)))
    if events:
        eviction.emit(events)
    return tuple(reissue)


def _cells(
    store: GroupStore, saved: PartitionCheckpoint
) -> list[tuple[PartitionState, Mapping[str, int], tuple[float, ...]]]:
    """Where ``saved``'s counters and generation times go: its partition (created if new), or
    under a task mixture each task's cell, with that task's.

    Raises:
        CheckpointError: the partition is under a task mixture and ``saved`` holds none, or the
            other way round.
        Exception: whatever a policy hook raised creating the partition.
    """
    part = store.partition(saved.name)
    cells, mixture = part.cells, saved.mixture
    if (cells is None) != (mixture is None):
        raise CheckpointError(
            f"the checkpoint is inconsistent: partition {describe(saved.name)} is "
            f"{'not ' if cells is None else ''}under the task mixture, but its saved state is "
            f"{'not ' if mixture is None else ''}a mixture's"
        )
    if cells is None or mixture is None:
        return [(part, saved.counters, saved.generation)]
    return [(cells[task.name], task.counters, task.generation) for task in mixture.tasks]


def _restore_groups(
    store: GroupStore, groups: tuple[Group, ...], in_flight: InFlightMode
) -> tuple[list[Group], dict[str | tuple[str, str], list[int]], dict[str, list[Group]]]:
    """Put ``groups`` back in admission order (each in its partition or task cell), in-flight ones
    as ``in_flight`` says; return the groups to reissue, what reissuing discarded per partition
    or cell (by ``PartitionState.key``: groups, trajectories, tokens), and the in-flight groups
    to evict per partition (under "evict").

    Raises:
        CheckpointError: a group of an unknown partition, or a duplicate uid.
    """
    reissue: list[Group] = []
    reissued: dict[str | tuple[str, str], list[int]] = {}
    restarted: dict[str, list[Group]] = {}
    for seq, group in enumerate(groups):
        try:  # its partition, or under a task mixture its task's cell
            part = None if group.uid in store.groups else store.cell_of(group)
        except (KeyError, TypeError):  # an unknown partition or task (the checks refuse both)
            part = None
        if part is None:
            raise CheckpointError(f"the checkpoint is inconsistent at group {describe(group.uid)}")
        if group.status is not _PENDING and group.status is not _RUNNING:
            store.restore_terminal(part, group, seq)
        elif in_flight == "evict":
            restarted.setdefault(part.name, []).append(group)
        elif in_flight == "keep":
            store.restore_in_flight(part, group, seq, prefix=True, running=True)
        elif in_flight == "resume":  # PENDING, its prefix kept: its producer goes on after it
            store.restore_in_flight(part, group, seq, prefix=True, running=False)
            reissue.append(group.replace(status=_PENDING))
        else:  # generated again from its dispatch step: its partial trajectories are discarded
            store.restore_in_flight(part, group, seq, prefix=False, running=False)
            reissue.append(group.replace(status=_PENDING, trajectories=(), start_version=group.dispatch_step))
            counts = reissued.setdefault(part.key, [0, 0, 0])
            counts[0] += 1
            counts[1] += count_trajectories(group)
            counts[2] += group_tokens(group)
    return reissue, reissued, restarted


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
    # Checked here, before any buffer is built: a ConfigError from building it is then the
    # checkpoint's config's fault (a CheckpointError), never these arguments'.
    check_on_evict(on_evict)
    # Passed only when given: a custom sampler's constructor need not take it.
    options: dict[str, Any] = {}
    if status_log_interval is not NOT_GIVEN:
        options["status_log_interval"] = check_status_log_interval(status_log_interval)
    if on_evict is not None:  # "restart" evictions are reported to it, from inside restore
        options["on_evict"] = on_evict
    return checkpoint, mode, options


def build_restored(
    cls: type[Any], base: type[Any], checkpoint: BufferCheckpoint, options: dict[str, Any]
) -> Any:
    """Build the empty buffer ``ReplayBuffer.restore`` fills: ``cls`` with the checkpoint's
    policy, or what ``from_config`` builds from its config (``base`` is ReplayBuffer).

    Raises:
        CheckpointError: the policy cannot be rebuilt, or the config's custom sampler cannot
            be built (a config the live API would refuse: the checkpoint is at fault).
    """
    config = checkpoint.config
    if checkpoint.policy is not None:
        return cls(config, policy=policy_from_name(checkpoint.policy, config), **options)
    if cls is base and config.custom_sampler is None:
        # Only ReplayBuffer(config) built such a buffer: its constructor takes no sampler_kwargs
        # (from_config would pass them, and fail, when the config carries some).
        return cls(config, **options)
    try:
        return build_from_config(cls, base, config, options)
    except ConfigError as exc:
        raise CheckpointError(
            f"the checkpoint's config.custom_sampler {describe(config.custom_sampler)} cannot be built: {exc}"
        ) from exc


def check_in_flight(in_flight: object) -> InFlightMode:
    """Return ``in_flight`` if it is one of the modes; raise ConfigError otherwise."""
    if type(in_flight) is not str or in_flight not in IN_FLIGHT_MODES:
        raise ConfigError(f"in_flight must be one of {', '.join(map(repr, IN_FLIGHT_MODES))}")
    return in_flight  # type: ignore[return-value]


def policy_from_name(name: str, config: SamplerConfig) -> Any:
    """Build the policy a checkpoint names (``"module:QualName"``) as ``Cls(config, **kwargs)``.

    Raises:
        CheckpointError: it cannot be imported or built.
    """
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
