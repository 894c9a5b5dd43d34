"""The records of a ``sample`` and an eviction: :class:`Batch` and :class:`EvictionEvent`
(exported by :mod:`stalebuf.records`, with the group and trajectory records they hold)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, Literal, TypeVar, overload

import attrs
import numpy as np
import numpy.typing as npt

from . import _token_arrays as arrays
from ._group_records import Group, Trajectory, pack_runs
from ._split import Costs, SplitBy, SplitCost, check_split, item_costs, lpt_parts

#: The bytes of one packed (version, n_tokens) run.
_RUN_BYTES = 16
_runs_of = itemgetter(7)  # Trajectory._runs
_tokens_of = itemgetter(6)  # Trajectory.tokens
_start_of = attrgetter("start_version")
_trajectories_of = attrgetter("trajectories")
_T = TypeVar("_T")

__all__ = [
    "Batch",
    "EvictionEvent",
    "EvictionReason",
    "batch_runs",
    "excluded_trajectories",
    "fresh_runs",
    "fresh_span",
    "new_batch",
    "split_groups",
]


@attrs.frozen(eq=False, weakref_slot=False)
class Batch:
    """What one ``sample`` call returns: whole groups, oldest first.

    Attributes:
        partition: the partition sampled.
        global_steps: the trainer step passed to ``sample``.
        groups: the selected groups, in selection order.
        parameter_sync_step: the sync step S of the buffer's policy (its config's), used by
            :attr:`staleness` and the per-token staleness.
        max_off_policy_threshold: the threshold T of the buffer's policy: a token of version
            ``v`` is fresh iff ``g - v + 1 <= T*S`` (:meth:`freshness_mask`); None: every token
            is fresh (no staleness bound).
        masks: whether the ``mask`` strategy judged this batch (non-exempt partition):
            :attr:`loss_excluded` is all False otherwise.
        group_thresholds: under a task mixture with ``task_thresholds``, each group's own T
            (in group order; None: no bound), which replaces ``max_off_policy_threshold`` for its
            tokens; None otherwise.

    The per-trajectory and per-token arrays are flattened over :attr:`trajectories` (group
    order); per-token ones are packed (trajectories concatenated, no padding) with CSR
    ``offsets`` (trajectory ``i`` owns ``offsets[i]:offsets[i + 1]``). A trajectory put
    without ``versions`` contributes ``tokens`` copies of its group's start version.
    """

    partition: str
    global_steps: int
    groups: tuple[Group, ...]
    parameter_sync_step: int = 1
    max_off_policy_threshold: int | None = None
    masks: bool = False
    group_thresholds: tuple[int | None, ...] | None = None

    def __len__(self) -> int:
        """Return the number of groups."""
        return len(self.groups)

    def __iter__(self) -> Iterator[Group]:
        """Iterate over the groups in selection order."""
        return iter(self.groups)

    @property
    def uids(self) -> list[str]:
        """The group uids, in selection order."""
        return [group.uid for group in self.groups]

    @property
    def trajectories(self) -> list[Trajectory]:
        """All trajectories, flattened in group order."""
        return [t for group in self.groups for t in group.trajectories]

    @property
    def keys(self) -> list[str]:
        """All trajectory keys, flattened in group order."""
        return [key for group in self.groups for key in group._stored_keys()]

    @property
    def tags(self) -> list[Mapping[str, Any]]:
        """All trajectory tags, flattened in group order."""
        return [tags for group in self.groups for tags in group._stored_tags()]

    @property
    def payloads(self) -> list[Any]:
        """All trajectory payloads, flattened in group order."""
        return [payload for group in self.groups for payload in group._stored_payloads()]

    @property
    def staleness(self) -> npt.NDArray[np.float64]:
        """Staleness ``(g - p + 1) / parameter_sync_step`` of each group, as float64."""
        dispatch = np.fromiter(
            (group.dispatch_step for group in self.groups), dtype=np.int64, count=len(self.groups)
        )
        # g - p in int64 first: in float64, g + 1 - p rounds to 0 for steps near 2**63
        age: npt.NDArray[np.float64] = (np.int64(self.global_steps) - dispatch).astype(np.float64)
        age += 1.0
        age /= self.parameter_sync_step
        return age

    # -- versions and tokens --------------------------------------------------------------

    @property
    def target_version(self) -> int:
        """The policy version being trained: ``global_steps``."""
        return self.global_steps

    def _runs(self) -> tuple[arrays.Int64s, arrays.Int64s, arrays.Int64s, arrays.Int64s]:
        return batch_runs(self.groups)

    def _span(self) -> int:
        return fresh_span(self)

    @property
    def token_counts(self) -> npt.NDArray[np.int64]:
        """The token count of each trajectory, ``int64[n_traj]``."""
        return np.fromiter((t.tokens for group in self.groups for t in group.trajectories), dtype=np.int64)

    @property
    def head_staleness(self) -> npt.NDArray[np.float64]:
        """The staleness ``(g - head + 1) / S`` of each trajectory's oldest token, ``float64[n_traj]``."""
        versions, _, offsets, starts = self._runs()
        return arrays.head_tail_staleness(
            versions, offsets, starts, self.global_steps, self.parameter_sync_step
        )[0]

    @property
    def tail_staleness(self) -> npt.NDArray[np.float64]:
        """The staleness ``(g - tail + 1) / S`` of each trajectory's newest token, ``float64[n_traj]``."""
        versions, _, offsets, starts = self._runs()
        return arrays.head_tail_staleness(
            versions, offsets, starts, self.global_steps, self.parameter_sync_step
        )[1]

    @property
    def loss_excluded(self) -> npt.NDArray[np.bool_]:
        """``bool[n_traj]``: True for a trajectory the ``mask`` strategy keeps out of the loss
        (at least one token, all of them stale); all False under ``drop`` and ``wait``."""
        versions, lengths, offsets, _ = self._runs()
        if not self.masks:
            return np.zeros(offsets.size - 1, dtype=np.bool_)
        return excluded_trajectories(fresh_runs(self, versions, offsets), lengths, offsets)

    def token_versions(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The version of every token and the CSR offsets: ``(int64[total_tokens], int64[n_traj + 1])``."""
        versions, lengths, offsets, _ = self._runs()
        return np.repeat(versions, lengths), _token_offsets(lengths, offsets)

    def freshness_mask(self) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
        """``(mask, offsets)``: True where a token may enter the loss, its lag ``g - v + 1 <=
        T*S``; the same under every strategy (a ``wait`` batch holding stale tokens shows them)."""
        versions, lengths, offsets, _ = self._runs()
        if self.group_thresholds is None:
            mask = arrays.packed_freshness_mask(versions, lengths, self.global_steps, self._span())
        else:
            mask = np.repeat(fresh_runs(self, versions, offsets), lengths)
        return mask, _token_offsets(lengths, offsets)

    # -- balanced splits --------------------------------------------------------------------

    @overload
    def split(self, n: int, *, cost: SplitCost = "tokens", by: Literal["group"] = "group") -> list[Batch]: ...

    @overload
    def split(
        self, n: int, *, cost: SplitCost = "tokens", by: Literal["trajectory"]
    ) -> list[list[Trajectory]]: ...

    def split(
        self, n: int, *, cost: SplitCost = "tokens", by: SplitBy = "group"
    ) -> list[Batch] | list[list[Trajectory]]:
        """Split the batch into ``n`` parts of balanced cost, for ``n`` data-parallel ranks.

        ``by="group"``: ``n`` batches (same partition, step, T, S and strategy; per-group
        fields re-sliced) whose groups partition this batch's, whole groups kept together.
        ``by="trajectory"``: ``n`` lists of trajectories, groups split (for a trainer that has
        computed its advantages already). An item's cost: ``"tokens"`` (its tokens),
        ``"quadratic"`` (the sum of its trajectories' tokens squared: attention-bound work)
        or ``"groups"`` (1 each). The LPT rule assigns the items: largest cost first (ties in
        batch order), each to the least-loaded part (ties to the lowest index). Its largest
        part is within ``4/3 - 1/(3n)`` of the optimum, not optimal. Each part keeps batch
        order; a part no item reaches is empty. Items of cost 0 (no ``tokens`` given) all go
        to the lowest least-loaded part. O(k log k) for k items.

        Raises:
            TypeError: ``n`` is not an int (a bool is not), or ``cost`` or ``by`` is not a str.
            ValueError: ``n`` is below 1, or ``cost`` or ``by`` is not one of those names.
        """
        n, cost, by = check_split(n, cost, by)
        if by == "trajectory":
            trajectories = self.trajectories
            tokens = np.fromiter(map(_tokens_of, trajectories), np.int64, len(trajectories))
            costs = item_costs(tokens, None, cost)
            return [[trajectories[i] for i in part] for part in lpt_parts(costs, n)]
        return split_groups(self, n, cost)

    @staticmethod
    def padded(
        array: npt.ArrayLike, offsets: npt.ArrayLike, *, pad_to: int | None = None, fill: object = 0
    ) -> npt.NDArray[Any]:
        """A packed per-token ``array`` as ``(n_traj, L)``, each row padded with ``fill`` (``L``:
        ``pad_to`` or the longest trajectory); the dtype is ``array``'s.

        Raises:
            TypeError, ValueError: ``offsets`` are not CSR offsets ending at ``len(array)``,
                ``pad_to`` is shorter than the longest trajectory, or ``fill`` does not fit the
                dtype.
        """
        return arrays.padded(array, offsets, pad_to=pad_to, fill=fill)


def batch_runs(
    groups: tuple[Group, ...],
) -> tuple[arrays.Int64s, arrays.Int64s, arrays.Int64s, arrays.Int64s]:
    """``(run_versions, run_lengths, run_offsets, start versions)`` of the groups' trajectories,
    flattened in group order (see :mod:`stalebuf._token_arrays`): one join of the versions each
    trajectory holds packed, so the cost is C-level loops over trajectories and runs."""
    per_group = list(map(_trajectories_of, groups))
    sizes = np.fromiter(map(len, per_group), dtype=np.int64, count=len(groups))
    starts = np.fromiter(map(_start_of, groups), dtype=np.int64, count=len(groups))
    start_versions = np.repeat(starts, sizes)
    pieces = list(map(_runs_of, chain.from_iterable(per_group)))
    if b"" in pieces:  # put without versions: its tokens count at the group's start version
        if not any(pieces):  # none holds versions (tokens= only): one run each, no packing
            counted = np.fromiter(map(_tokens_of, chain.from_iterable(per_group)), np.int64, len(pieces))
            held = counted > 0
            run_offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
            np.cumsum(held, out=run_offsets[1:])
            return start_versions[held], counted[held], run_offsets, start_versions
        tokens = map(_tokens_of, chain.from_iterable(per_group))
        pieces = [
            packed or (pack_runs(((int(start), count),)) if count else b"")
            for packed, count, start in zip(pieces, tokens, start_versions.tolist(), strict=True)
        ]
    counts = np.array(list(map(len, pieces)), dtype=np.int64) // _RUN_BYTES
    # Columns as contiguous arrays: np.repeat by a strided view of lengths would copy it anyway.
    columns = np.frombuffer(b"".join(pieces), dtype=np.int64).reshape(-1, 2).T.copy()
    run_offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(counts, out=run_offsets[1:])
    return columns[0], columns[1], run_offsets, start_versions


def split_groups(batch: Batch, n: int, cost: SplitCost) -> list[Batch]:
    """``batch``'s groups split into ``n`` batches by the LPT rule (see :meth:`Batch.split`):
    each a copy of ``batch`` (every per-batch field kept) with its groups and their fields."""
    groups = batch.groups
    costs: Costs
    if cost == "groups":  # no trajectory read: lazily stored groups keep their records unbuilt
        costs = np.ones(len(groups), dtype=np.int64)
    else:
        per_group = list(map(_trajectories_of, groups))
        sizes = list(map(len, per_group))
        # One C-level pass from the records into int64: no list of ints in between.
        tokens = np.fromiter(map(_tokens_of, chain.from_iterable(per_group)), np.int64, sum(sizes))
        costs = item_costs(tokens, sizes, cost)
    thresholds = batch.group_thresholds
    parts = lpt_parts(costs, n)
    if type(batch) is not Batch:  # a subclass: its own class, through its __init__
        return [
            attrs.evolve(
                batch,
                groups=_picked(groups, part),
                group_thresholds=None if thresholds is None else _picked(thresholds, part),
            )
            for part in parts
        ]
    return [  # new_batch: what evolve builds, without its per-field __init__
        new_batch(
            batch.partition,
            batch.global_steps,
            _picked(groups, part),
            batch.parameter_sync_step,
            batch.max_off_policy_threshold,
            batch.masks,
            None if thresholds is None else _picked(thresholds, part),
        )
        for part in parts
    ]


def _picked(values: tuple[_T, ...], indices: list[int]) -> tuple[_T, ...]:
    """``tuple(values[i] for i in indices)``, by one C call when there are several."""
    if len(indices) > 1:
        picked: tuple[_T, ...] = itemgetter(*indices)(values)
        return picked
    return tuple([values[i] for i in indices])


def _token_offsets(run_lengths: arrays.Int64s, run_offsets: arrays.Int64s) -> arrays.Int64s:
    """The CSR token offsets of packed runs: trajectory ``i`` owns ``offsets[i]:offsets[i + 1]``."""
    ends = np.zeros(run_lengths.size + 1, dtype=np.int64)
    np.cumsum(run_lengths, out=ends[1:])
    offsets: arrays.Int64s = ends[run_offsets]
    return offsets


def fresh_runs(batch: Batch, run_versions: arrays.Int64s, run_offsets: arrays.Int64s) -> arrays.Bools:
    """``bool[runs]``: whether each run of ``batch``'s packed runs is fresh (lag ``<= T*S``,
    with each group's own T when it has ``group_thresholds``)."""
    g, sync_step = batch.global_steps, batch.parameter_sync_step
    thresholds = batch.group_thresholds
    if thresholds is None:
        floor = max(g + 1 - fresh_span(batch), 0)
        fresh: arrays.Bools = run_versions >= floor
        return fresh
    # The first fresh version of each group (0 without a bound), then of each trajectory and run.
    floors = [0 if t is None else max(g + 1 - t * sync_step, 0) for t in thresholds]
    sizes = [len(group.trajectories) for group in batch.groups]
    per_trajectory = np.repeat(np.array(floors, dtype=np.int64), np.array(sizes, dtype=np.int64))
    fresh = run_versions >= np.repeat(per_trajectory, np.diff(run_offsets))
    return fresh


def excluded_trajectories(
    fresh: arrays.Bools, run_lengths: arrays.Int64s, run_offsets: arrays.Int64s
) -> arrays.Bools:
    """``bool[n]``: trajectories with at least one token and no fresh one (``fresh``: per run)."""
    fresh_tokens = np.zeros(run_lengths.size + 1, dtype=np.int64)
    np.cumsum(np.where(fresh, run_lengths, 0), out=fresh_tokens[1:])
    per_trajectory = fresh_tokens[run_offsets[1:]] - fresh_tokens[run_offsets[:-1]]
    excluded: arrays.Bools = (run_offsets[1:] > run_offsets[:-1]) & (per_trajectory == 0)
    return excluded


def fresh_span(batch: Batch) -> int:
    """``T*S`` of ``batch``, or a span no lag can exceed when it has no threshold."""
    threshold = batch.max_off_policy_threshold
    return arrays.MAX_INT + 1 if threshold is None else threshold * batch.parameter_sync_step


EvictionReason = Literal["stale", "failure", "restart", "filtered"]


@attrs.frozen(eq=False, weakref_slot=False)
class EvictionEvent:
    """Groups evicted together for one reason during one ``sample`` evaluation.

    Attributes:
        partition: the partition they were evicted from.
        reason: "stale" (drop strategy; in-flight groups too with ``evict_stale_in_flight``),
            "failure" (``failure_strategy="evict"``) or "restart" (in-flight groups evicted by
            ``ReplayBuffer.restore(..., in_flight="evict")``) or "filtered" (a group filter
            rejected it as it finished).
        groups: the evicted groups, oldest first.
        global_steps: the trainer step of the ``sample`` call that evicted them (for "restart"
            and "filtered", the partition's dispatch clock).
    """

    partition: str
    reason: EvictionReason
    groups: tuple[Group, ...]
    global_steps: int


# Batch is an attrs class whose frozen __init__ routes every field through object.__setattr__
# by name; setting the slot descriptors directly takes about two thirds of that. Tests compare
# what this builds with what the class's own constructor builds.
_new = object.__new__
_set_bpartition, _set_bsteps, _set_groups, _set_sync, _set_threshold, _set_masks, _set_thresholds = (
    Batch.__dict__[field.name].__set__ for field in attrs.fields(Batch)
)


def new_batch(
    partition: str,
    global_steps: int,
    groups: tuple[Group, ...],
    parameter_sync_step: int,
    max_off_policy_threshold: int | None = None,
    masks: bool = False,
    group_thresholds: tuple[int | None, ...] | None = None,
) -> Batch:
    """Return ``Batch(partition, global_steps, groups, parameter_sync_step,
    max_off_policy_threshold, masks)``, built faster."""
    batch = _new(Batch)
    _set_bpartition(batch, partition)
    _set_bsteps(batch, global_steps)
    _set_groups(batch, groups)
    _set_sync(batch, parameter_sync_step)
    _set_threshold(batch, max_off_policy_threshold)
    _set_masks(batch, masks)
    _set_thresholds(batch, group_thresholds)
    return batch


# Documented, pickled and shown as part of stalebuf.records, where users import them from.
Batch.__module__ = EvictionEvent.__module__ = "stalebuf.records"
