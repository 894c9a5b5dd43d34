"""Checking a checkpoint's partitions: their counters and the conservation law they keep with
the resident groups, their generation times, and what a task mixture (each task's cell and the
ledger of selection) and the group filters (their ledger) left in them.

:func:`checked_partitions` checks every field of each partition (before the groups are read);
:func:`conserved` then checks the laws a live buffer keeps between the counters and the groups:
per partition, and under a task mixture per task, whose counters also sum to the partition's.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import isfinite
from typing import Any

import attrs

from ._checkpoint_fields import copied, field, invalid, sequence, whole
from ._filtering import PASS_RATE_WINDOW
from ._mixture import SHARE_WINDOW
from ._partition import GENERATION_WINDOW
from ._stored import count_trajectories
from ._token_ledger import group_tokens
from ._validation import MAX_INT, check_partition, describe
from .checkpoint import (
    COUNTERS,
    TOKEN_COUNTERS,
    FilterCheckpoint,
    MixtureCheckpoint,
    PartitionCheckpoint,
    TaskCheckpoint,
)
from .config import SamplerConfig
from .records import Group

__all__ = ["checked_partitions", "conserved"]

_COUNTER_NAMES = frozenset(COUNTERS)
# The conservation law of stats() (see PartitionStats): what was admitted is resident or left
# by one of these ways; trajectories also leave when a reissuing restore discards them.
_GROUPS_LEFT = (
    "sampled_groups",
    "evicted_stale_groups",
    "evicted_failure_groups",
    "evicted_restart_groups",
    "evicted_filtered_groups",
)
_TRAJECTORIES_LEFT = (
    "sampled_trajectories",
    "evicted_stale_trajectories",
    "evicted_failure_trajectories",
    "evicted_restart_trajectories",
    "evicted_filtered_trajectories",
    "reissued_trajectories",
)
_TOKENS_LEFT = ("sampled_tokens", "evicted_tokens", "reissued_tokens")
Resident = tuple[int, int, int]  # groups, trajectories, tokens


def checked_partitions(
    partitions: object, clocks: Mapping[str, int], config: SamplerConfig
) -> dict[str, PartitionCheckpoint]:
    """The partitions by name, each rebuilt from its checked values (missing counters are 0).

    Raises:
        CheckpointError: a record, name, step, counter, generation time, or the state of a
            mixture or of filters is invalid, or a name repeats.
    """
    checked: dict[str, PartitionCheckpoint] = {}
    for index, saved in enumerate(sequence("partitions", partitions)):
        where = f"partitions[{index}]"
        if type(saved) is not PartitionCheckpoint:
            raise invalid(where, f"must be a PartitionCheckpoint, got {type(saved).__name__}")
        name = field(f"{where}.name", check_partition, saved.name)
        if name in checked:
            raise invalid(f"{where}.name", f"{describe(name)} repeats an earlier partition's")
        last = saved.last_sampled
        if type(last) is not int or not -1 <= last <= MAX_INT:
            raise invalid(f"{where}.last_sampled", f"must be an int >= -1, got {describe(last)}")
        if last > clocks.get(name, 0):  # a sample moves the clock to its step before it returns
            raise invalid(f"{where}.last_sampled", f"{last} is past the partition's clock")
        # Token counters stay absent if all are (an older file): _conserved derives them.
        counters = _checked_counters(f"{where}.counters", saved.counters, all_given=False)
        generation = checked_generation(f"{where}.generation", saved.generation)
        mixture, filters = saved.mixture, saved.filters
        if mixture is not None:
            mixture = _checked_mixture(f"{where}.mixture", mixture, config)
            if generation:  # a mixture's cells measure them, each its own
                raise invalid(f"{where}.generation", "must be empty under a task mixture")
        if filters is not None:
            filters = _checked_filters(f"{where}.filters", filters, counters)
        checked[name] = PartitionCheckpoint(name, last, counters, generation, mixture, filters)
    return checked


def _checked_counters(where: str, value: object, *, all_given: bool) -> dict[str, int]:
    """Known counters, each an int >= 0, the missing ones 0 (the token counters too if
    ``all_given`` or any is given: else they stay absent, an older file's).

    Raises:
        CheckpointError: an unknown counter, a value that is not an int >= 0, or more groups
            evicted in flight than as stale.
    """
    counters = copied(where, value)
    for key, count in counters.items():
        if type(key) is not str or key not in _COUNTER_NAMES:
            raise invalid(where, f"has an unknown counter {describe(key)}")
        whole(f"{where}[{key!r}]", count)
    given = all_given or not counters.keys().isdisjoint(TOKEN_COUNTERS)
    counters = {key: counters.get(key, 0) for key in COUNTERS if given or key not in TOKEN_COUNTERS}
    if counters["evicted_in_flight_groups"] > counters["evicted_stale_groups"]:  # a part of it
        raise invalid(where, "count more groups evicted in flight than as stale")
    return counters


def checked_generation(where: str, times: object) -> tuple[float, ...]:
    """Measured generation times: at most the window, each a finite float >= 0.

    Raises:
        CheckpointError: another value, or more than the window holds.
    """
    values = sequence(where, times)
    if len(values) > GENERATION_WINDOW:
        raise invalid(where, f"holds {len(values)} times; a partition keeps {GENERATION_WINDOW}")
    for index, seconds in enumerate(values):
        if type(seconds) is not float or not isfinite(seconds) or seconds < 0.0:
            raise invalid(f"{where}[{index}]", f"must be a finite float >= 0, got {describe(seconds)}")
    return values


# -- a task mixture and filters ---------------------------------------------------------------


def _checked_mixture(where: str, mixture: object, config: SamplerConfig) -> MixtureCheckpoint:
    """A mixture's saved state: one task record per task of the config's mixture, balances that
    sum to 0 (all 0, with no growth, under "wait"), the shares window, the batch size.

    Raises:
        CheckpointError: a value no live buffer could hold (named).
    """
    if type(mixture) is not MixtureCheckpoint:
        raise invalid(where, f"must be a MixtureCheckpoint or None, got {type(mixture).__name__}")
    weights = config.mixture
    if weights is None:
        raise invalid(where, "holds a task mixture's state, but the config has no mixture")
    tasks: dict[str, TaskCheckpoint] = {}
    for index, task in enumerate(sequence(f"{where}.tasks", mixture.tasks)):
        at = f"{where}.tasks[{index}]"
        if type(task) is not TaskCheckpoint:
            raise invalid(at, f"must be a TaskCheckpoint, got {type(task).__name__}")
        name = task.name
        if type(name) is not str or name not in weights or name in tasks:
            raise invalid(f"{at}.name", f"must be another task of the mixture, got {describe(name)}")
        counters = _checked_counters(f"{at}.counters", task.counters, all_given=True)
        generation = checked_generation(f"{at}.generation", task.generation)
        balance = whole(f"{at}.balance", task.balance, -MAX_INT)
        growth = whole(f"{at}.growth", task.growth)
        if config.mixture_policy == "wait" and (balance or growth):  # only borrowing moves them
            raise invalid(at, "holds a balance or its growth, but the mixture policy is 'wait'")
        tasks[name] = TaskCheckpoint(name, counters, generation, balance, growth)
    missing = [name for name in weights if name not in tasks]
    if missing:
        raise invalid(f"{where}.tasks", f"lack the task {describe(missing[0])}")
    if sum(task.balance for task in tasks.values()):
        raise invalid(f"{where}.tasks", "hold balances that do not sum to 0")
    shares = sequence(f"{where}.shares", mixture.shares)
    if len(shares) > SHARE_WINDOW:
        raise invalid(f"{where}.shares", f"holds {len(shares)} tasks; a partition keeps {SHARE_WINDOW}")
    for index, name in enumerate(shares):
        if type(name) is not str or name not in weights:
            raise invalid(f"{where}.shares[{index}]", f"must be a task of the mixture, got {describe(name)}")
    batch_size = whole(f"{where}.batch_size", mixture.batch_size, 1 if shares else 0)
    return MixtureCheckpoint(tuple(tasks.values()), shares, batch_size)


def _checked_filters(where: str, filters: object, counters: Mapping[str, int]) -> FilterCheckpoint:
    """The filters' saved ledger: at most the window of verdicts (bools), error and filtered
    counts no larger than the totals they are part of.

    Raises:
        CheckpointError: a value no live buffer could hold (named).
    """
    if type(filters) is not FilterCheckpoint:
        raise invalid(where, f"must be a FilterCheckpoint or None, got {type(filters).__name__}")
    verdicts = sequence(f"{where}.verdicts", filters.verdicts)
    if len(verdicts) > PASS_RATE_WINDOW:
        raise invalid(f"{where}.verdicts", f"holds {len(verdicts)}; a partition keeps {PASS_RATE_WINDOW}")
    for index, verdict in enumerate(verdicts):
        if type(verdict) is not bool:
            raise invalid(f"{where}.verdicts[{index}]", f"must be a bool, got {describe(verdict)}")
    errors = whole(f"{where}.errors", filters.errors)
    recent_filtered = whole(f"{where}.recent_filtered", filters.recent_filtered)
    recent_errors = whole(f"{where}.recent_errors", filters.recent_errors)
    if recent_filtered > counters["evicted_filtered_groups"]:
        raise invalid(f"{where}.recent_filtered", "is more than the groups filtered in all")
    if recent_errors > errors:
        raise invalid(f"{where}.recent_errors", "is more than the errors in all")
    return FilterCheckpoint(verdicts, errors, recent_filtered, recent_errors)


# -- the laws between counters and groups -------------------------------------------------------


def conserved(
    partitions: dict[str, PartitionCheckpoint],
    records: tuple[Group, ...],
    resident: Mapping[str, Resident],
    config: SamplerConfig,
) -> dict[str, PartitionCheckpoint]:
    """Check the conservation laws of ``stats()`` for every partition with its ``resident``
    counts, and under a task mixture for every task with its groups among ``records``, whose
    counters must sum to the partition's; return the partitions, with their token counters
    derived where they have none (a file written before versions existed).

    Raises:
        CheckpointError: the counters do not add up, or a group of a partition under a task
            mixture does not name one of its tasks.
    """
    mixed = {name for name, saved in partitions.items() if saved.mixture is not None}
    by_task = _task_resident(records, mixed, config) if mixed else {}
    out = {}
    for index, saved in enumerate(partitions.values()):
        where = f"partitions[{index}]"
        saved = _derived(saved, resident.get(saved.name, (0, 0, 0))[2])
        _law(f"{where}.counters", saved.counters, resident.get(saved.name, (0, 0, 0)))
        if saved.mixture is not None:
            totals = dict.fromkeys(COUNTERS, 0)
            for position, task in enumerate(saved.mixture.tasks):
                held = by_task.get((saved.name, task.name), (0, 0, 0))
                _law(f"{where}.mixture.tasks[{position}].counters", task.counters, held)
                for key, count in task.counters.items():
                    totals[key] += count
            if totals != dict(saved.counters):
                wrong = next(key for key in COUNTERS if totals[key] != saved.counters[key])
                raise invalid(f"{where}.mixture.tasks", f"do not sum to the partition's {wrong}")
        out[saved.name] = saved
    return out


def _derived(saved: PartitionCheckpoint, tokens: int) -> PartitionCheckpoint:
    """``saved`` with its token counters, derived if it has none (a file written before versions
    existed): every resident token admitted, none gone yet."""
    if "admitted_tokens" in saved.counters:
        return saved
    counters = {**saved.counters, **dict.fromkeys(TOKEN_COUNTERS, 0), "admitted_tokens": tokens}
    return attrs.evolve(saved, counters={key: counters[key] for key in COUNTERS})


def _law(where: str, counters: Mapping[str, int], resident: Resident) -> None:
    """Check that ``counters`` conserve the ``resident`` groups, trajectories and tokens.

    Raises:
        CheckpointError: they do not.
    """
    for kind, held, left in (
        ("groups", resident[0], _GROUPS_LEFT),
        ("trajectories", resident[1], _TRAJECTORIES_LEFT),
        ("tokens", resident[2], _TOKENS_LEFT),
    ):
        admitted = counters[f"admitted_{kind}"]
        accounted = held + sum(counters[key] for key in left)
        if admitted != accounted:
            raise invalid(
                where,
                f"do not conserve {kind}: {admitted} admitted, but {held} resident and "
                f"{accounted - held} gone ({', '.join(left)})",
            )
    if counters["masked_tokens"] > counters["sampled_tokens"]:  # a part of them
        raise invalid(where, "count more tokens masked than sampled")


def _task_resident(
    records: tuple[Group, ...], mixed: set[str], config: SamplerConfig
) -> dict[tuple[str, str], Resident]:
    """The resident (groups, trajectories, tokens) of each ``(partition, task)`` of the ``mixed``
    partitions, each group counted under the task its tag names.

    Raises:
        CheckpointError: a group of a mixed partition does not name one of the mixture's tasks.
    """
    tag, weights = config.mixture_tag, config.mixture or {}
    held: dict[tuple[str, str], Resident] = {}
    for index, group in enumerate(records):
        name = group.partition
        if name not in mixed:
            continue
        task: Any = group.tags.get(tag)
        if type(task) is not str or task not in weights:
            raise invalid(
                f"groups[{index}].tags",
                f"must name the group's task under {describe(tag)} (its partition is under the task "
                f"mixture), got {describe(task)}",
            )
        groups, trajectories, tokens = held.get((name, task), (0, 0, 0))
        count, tokens_held = count_trajectories(group), group_tokens(group)
        held[name, task] = (groups + 1, trajectories + count, tokens + tokens_held)
    return held
