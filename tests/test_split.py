"""Balanced splits for data-parallel ranks (issue 24): ``Batch.split`` against a reference.

The reference below is written from the issue's rule alone and shares no code with
``_split.py``: it picks, one at a time, the unassigned item of largest cost (the earliest in
the batch among equals) and gives it to the part of least load (the lowest index among
equals), scanning every item and every part each time. Costs come from the definitions:
``tokens`` (the sum of the trajectories' tokens), ``quadratic`` (the sum of their squares),
``groups`` (1 each). Hypothesis checks the exact assignment against it, with small and huge
token counts (the latter past int64 when squared), that the parts partition the batch in
selection order, that every part is a valid batch whose per-group and per-trajectory arrays
are the parent's re-sliced, and, against a brute-force optimum on tiny inputs, the
``4/3 - 1/(3n)`` bound of the LPT rule.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import LIMIT
from stalebuf import Batch, Group, ReplayBuffer, SamplerConfig, Status, Trajectory
from stalebuf.records import EMPTY_TAGS

COSTS = ("tokens", "quadratic", "groups")


# -- the reference ---------------------------------------------------------------------------


def cost_of(tokens: Sequence[int], cost: str) -> int:
    """The cost of an item made of trajectories with these token counts."""
    if cost == "groups":
        return 1
    if cost == "quadratic":
        return sum(t * t for t in tokens)
    return sum(tokens)


def reference_lpt(costs: Sequence[int], n: int) -> list[list[int]]:
    """The LPT rule, one item at a time, by full scans; each part's items in increasing order."""
    loads = [0] * n
    owner: dict[int, int] = {}
    while len(owner) < len(costs):
        item = min((i for i in range(len(costs)) if i not in owner), key=lambda i: (-costs[i], i))
        part = min(range(n), key=lambda p: (loads[p], p))
        owner[item] = part
        loads[part] += costs[item]
    return [[i for i in range(len(costs)) if owner[i] == p] for p in range(n)]


def optimum(costs: Sequence[int], n: int) -> int:
    """The least maximum load over every assignment of the items to ``n`` parts."""
    best = sum(costs)
    for assignment in itertools.product(range(n), repeat=len(costs)):
        loads = [0] * n
        for item, part in enumerate(assignment):
            loads[part] += costs[item]
        best = min(best, max(loads))
    return best


# -- batches built from records ------------------------------------------------------------------


def trajectory(uid: str, session: int, runs: tuple[tuple[int, int], ...], tokens: int) -> Trajectory:
    """A trajectory with ``runs`` as its versions, or ``tokens`` tokens and no versions."""
    total = sum(count for _, count in runs) if runs else tokens
    return Trajectory(f"{uid}_{session}_0", session, 0, EMPTY_TAGS, f"p-{uid}-{session}", runs, total)


def make_batch(
    spec: Sequence[Sequence[tuple[tuple[tuple[int, int], ...], int]]],
    *,
    global_steps: int = 6,
    sync: int = 1,
    threshold: int | None = 2,
    masks: bool = False,
    thresholds: Sequence[int | None] | None = None,
) -> Batch:
    """A batch of one group per entry of ``spec``, each a list of ``(runs, tokens)``."""
    groups = []
    for index, trajectories in enumerate(spec):
        uid = f"g{index}"
        records = tuple(trajectory(uid, s, runs, tokens) for s, (runs, tokens) in enumerate(trajectories))
        groups.append(Group(uid, "train", index % 4, Status.FINISHED, EMPTY_TAGS, records, 5, 0.0, index % 3))
    own = None if thresholds is None else tuple(thresholds)
    return Batch("train", global_steps, tuple(groups), sync, threshold, masks, own)


def token_batch(tokens: Sequence[Sequence[int]]) -> Batch:
    """A batch of groups whose trajectories have these token counts (no versions)."""
    return make_batch([[((), t) for t in group] for group in tokens])


def group_tokens(group: Group) -> list[int]:
    return [t.tokens for t in group.trajectories]


runs_st = st.lists(st.tuples(st.integers(0, 8), st.integers(1, 5)), max_size=3).map(tuple)
trajectory_st = st.tuples(runs_st, st.integers(0, 6))
spec_st = st.lists(st.lists(trajectory_st, max_size=3), max_size=9)
small_tokens = st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=9)
# Token counts whose squares (and some whose sums) leave int64: the exact Python-int path.
huge_tokens = st.lists(st.lists(st.integers(0, 2**62), max_size=3), max_size=7)


def uid_parts(parts: Sequence[Batch]) -> list[list[str]]:
    return [part.uids for part in parts]


def expected_uids(batch: Batch, n: int, cost: str) -> list[list[str]]:
    costs = [cost_of(group_tokens(group), cost) for group in batch.groups]
    return [[batch.groups[i].uid for i in part] for part in reference_lpt(costs, n)]


# -- the rule --------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(tokens=st.one_of(small_tokens, huge_tokens), n=st.integers(1, 6), cost=st.sampled_from(COSTS))
def test_split_assigns_groups_exactly_as_the_lpt_rule(tokens: list[list[int]], n: int, cost: str) -> None:
    batch = token_batch(tokens)
    parts = batch.split(n, cost=cost)  # type: ignore[arg-type]
    assert len(parts) == n
    assert all(type(part) is Batch for part in parts)
    assert uid_parts(parts) == expected_uids(batch, n, cost)
    # whole groups, each exactly once (the very records), each part in selection order
    position = {id(group): index for index, group in enumerate(batch.groups)}
    seen = sorted(position[id(group)] for part in parts for group in part.groups)
    assert seen == list(range(len(batch)))
    for part in parts:
        indices = [position[id(group)] for group in part.groups]
        assert indices == sorted(indices)


@settings(max_examples=300, deadline=None)
@given(tokens=st.one_of(small_tokens, huge_tokens), n=st.integers(1, 6), cost=st.sampled_from(COSTS))
def test_split_by_trajectory_assigns_trajectories_exactly_as_the_lpt_rule(
    tokens: list[list[int]], n: int, cost: str
) -> None:
    batch = token_batch(tokens)
    flat = batch.trajectories
    parts = batch.split(n, cost=cost, by="trajectory")  # type: ignore[call-overload]
    costs = [cost_of([t.tokens], cost) for t in flat]
    expected = [[flat[i] for i in part] for part in reference_lpt(costs, n)]
    assert len(parts) == n
    assert all(type(part) is list for part in parts)
    assert [[id(t) for t in part] for part in parts] == [[id(t) for t in part] for part in expected]


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.integers(0, 30), min_size=1, max_size=7),
    n=st.integers(1, 3),
    by=st.sampled_from(["group", "trajectory"]),
)
def test_the_largest_part_is_within_four_thirds_of_the_optimum(costs: list[int], n: int, by: str) -> None:
    batch = token_batch([[c] for c in costs])  # one trajectory per group: the same items either way
    parts: Any = batch.split(n, cost="tokens", by=by)  # type: ignore[call-overload]
    if by == "group":
        loads = [sum(t.tokens for g in part.groups for t in g.trajectories) for part in parts]
    else:
        loads = [sum(t.tokens for t in part) for part in parts]
    assert sum(loads) == sum(costs)
    # max load <= (4/3 - 1/(3n)) * OPT, in integers
    assert 3 * n * max(loads) <= (4 * n - 1) * optimum(costs, n)


def test_a_worked_example_and_the_tie_rules() -> None:
    batch = token_batch([[5], [4], [3], [3], [2]])
    # 5 -> part 0; 4 -> part 1; the first 3 -> part 1 (4 < 5); the second 3 -> part 0 (5 < 7);
    # 2 -> part 1 (7 < 8)
    assert uid_parts(batch.split(2)) == [["g0", "g3"], ["g1", "g2", "g4"]]
    # equal costs in selection order, equal loads to the lowest part: round robin
    assert uid_parts(token_batch([[1]] * 5).split(3)) == [["g0", "g3"], ["g1", "g4"], ["g2"]]
    # quadratic weighs long trajectories more: [3, 3] costs 18 < [5] at 25, but 6 > 5 tokens
    pair = token_batch([[3, 3], [5], [1]])
    assert uid_parts(pair.split(2, cost="tokens")) == [["g0"], ["g1", "g2"]]
    assert uid_parts(pair.split(2, cost="quadratic")) == [["g1"], ["g0", "g2"]]
    assert uid_parts(pair.split(2, cost="groups")) == [["g0", "g2"], ["g1"]]
    assert [[t.key for t in part] for part in pair.split(2, by="trajectory")] == [
        ["g1_0_0", "g2_0_0"],
        ["g0_0_0", "g0_1_0"],
    ]


@pytest.mark.parametrize("big", [2**20, 2**61])
def test_ties_keep_batch_order_whatever_the_largest_cost(big: int) -> None:
    """Equal costs are taken in batch order both when ``largest * count`` fits int64 and when
    it does not (while the loads still do): the two ways the items are ranked by cost."""
    batch = token_batch([[3], [big], [3], [2], [0], [0]])
    # big -> 0; the first 3 -> 1, the second -> 2; 2 -> 1 (equal loads: the lowest part); 0s -> 2
    assert uid_parts(batch.split(3)) == [["g1"], ["g0", "g3"], ["g2", "g4", "g5"]]
    for n in (2, 3, 4):
        assert uid_parts(batch.split(n)) == expected_uids(batch, n, "tokens")


def test_more_parts_than_groups_gives_empty_valid_batches() -> None:
    batch = make_batch([[(((4, 2),), 0)], [((), 3)]], masks=True, thresholds=[1, None])
    parts = batch.split(4)
    assert uid_parts(parts) == [["g1"], ["g0"], [], []]  # costs 2 and 3
    for empty in parts[2:]:
        assert len(empty) == 0
        assert (empty.partition, empty.global_steps, empty.parameter_sync_step) == ("train", 6, 1)
        assert empty.group_thresholds == ()
        assert empty.uids == empty.keys == empty.payloads == empty.trajectories == []
        assert empty.staleness.shape == empty.token_counts.shape == empty.loss_excluded.shape == (0,)
        assert empty.head_staleness.shape == empty.tail_staleness.shape == (0,)
        versions, offsets = empty.token_versions()
        mask, mask_offsets = empty.freshness_mask()
        assert versions.shape == mask.shape == (0,)
        assert offsets.tolist() == mask_offsets.tolist() == [0]
        assert empty.padded(versions, offsets).shape == (0, 0)
    assert [len(part) for part in batch.split(3, by="trajectory")] == [1, 1, 0]
    nothing = Batch("train", 0, ())
    assert [len(part) for part in nothing.split(3)] == [0, 0, 0]
    assert nothing.split(2, by="trajectory") == [[], []]


def test_groups_without_tokens_all_cost_nothing() -> None:
    """The documented pitfall: with cost "tokens", groups put without tokens all tie at load 0
    and go to part 0; cost "groups" spreads them."""
    batch = token_batch([[0, 0], [0], [0]])
    assert uid_parts(batch.split(2)) == [["g0", "g1", "g2"], []]
    assert uid_parts(batch.split(2, cost="groups")) == [["g0", "g2"], ["g1"]]


def test_one_part_is_the_whole_batch() -> None:
    batch = make_batch([[((), 2)], [(((3, 1),), 0)]], thresholds=[None, 1], masks=True)
    (part,) = batch.split(1, cost="quadratic")
    assert part is not batch
    assert part.groups == batch.groups
    assert part.group_thresholds == batch.group_thresholds
    assert [t.key for t in batch.split(1, by="trajectory")[0]] == batch.keys


# -- each part is a valid batch: the parent's metadata, re-sliced --------------------------------


def _per_token(packed: np.ndarray, offsets: np.ndarray) -> list[list[Any]]:
    return [packed[offsets[i] : offsets[i + 1]].tolist() for i in range(offsets.size - 1)]


@settings(max_examples=200, deadline=None)
@given(
    spec=spec_st,
    n=st.integers(1, 5),
    cost=st.sampled_from(COSTS),
    sync=st.integers(1, 2),
    threshold=st.one_of(st.none(), st.integers(1, 3)),
    masks=st.booleans(),
    per_group=st.booleans(),
    data=st.data(),
)
def test_every_part_carries_the_parents_fields_and_arrays_re_sliced(
    spec: list[Any],
    n: int,
    cost: str,
    sync: int,
    threshold: int | None,
    masks: bool,
    per_group: bool,
    data: st.DataObject,
) -> None:
    thresholds = None
    if per_group:
        thresholds = data.draw(
            st.lists(st.one_of(st.none(), st.integers(1, 3)), min_size=len(spec), max_size=len(spec))
        )
    batch = make_batch(spec, sync=sync, threshold=threshold, masks=masks, thresholds=thresholds)
    parts = batch.split(n, cost=cost)  # type: ignore[arg-type]
    index = {id(group): i for i, group in enumerate(batch.groups)}
    traj_index = {id(t): i for i, t in enumerate(batch.trajectories)}
    parent_versions = _per_token(*batch.token_versions())
    parent_mask = _per_token(*batch.freshness_mask())
    for part in parts:
        assert (part.partition, part.global_steps, part.parameter_sync_step) == ("train", 6, sync)
        assert (part.max_off_policy_threshold, part.masks) == (threshold, masks)
        groups = [index[id(group)] for group in part.groups]
        if thresholds is None:
            assert part.group_thresholds is None
        else:
            assert part.group_thresholds == tuple(thresholds[i] for i in groups)
        assert part.staleness.tolist() == batch.staleness[groups].tolist()
        rows = [traj_index[id(t)] for t in part.trajectories]
        assert part.keys == [batch.keys[i] for i in rows]
        assert part.payloads == [batch.payloads[i] for i in rows]
        for name in ("token_counts", "head_staleness", "tail_staleness", "loss_excluded"):
            assert getattr(part, name).tolist() == getattr(batch, name)[rows].tolist(), name
        assert _per_token(*part.token_versions()) == [parent_versions[i] for i in rows]
        assert _per_token(*part.freshness_mask()) == [parent_mask[i] for i in rows]


def test_a_part_pickles_and_prints_as_a_batch() -> None:
    batch = make_batch([[((), 2)], [((), 5)]], thresholds=[1, 2])
    part = batch.split(2)[0]
    again = pickle.loads(pickle.dumps(part))
    assert type(again) is Batch
    assert again.uids == ["g1"]
    assert again.group_thresholds == (2,)
    assert repr(part).startswith("Batch(")


def test_a_subclass_of_batch_splits_into_its_own_class() -> None:
    """Parts of a subclass keep its class and its own fields (built through its __init__)."""

    @attrs.frozen(eq=False)
    class Noted(Batch):
        note: str = ""

    plain = make_batch([[((), 2)], [((), 5)], [((), 4)]], thresholds=[1, 2, None])
    batch = Noted(*attrs.astuple(plain, recurse=False), note="rank-local")
    parts = batch.split(2)
    assert [type(part) for part in parts] == [Noted, Noted]
    assert [part.note for part in parts] == ["rank-local", "rank-local"]
    assert uid_parts(parts) == uid_parts(plain.split(2)) == [["g1"], ["g0", "g2"]]
    assert [part.group_thresholds for part in parts] == [(2,), (1, None)]


# -- batches the buffer returns ---------------------------------------------------------------


@pytest.mark.anyio
async def test_split_a_sampled_batch_with_lazily_stored_groups_and_versions() -> None:
    with anyio.fail_after(LIMIT):
        buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=3), status_log_interval=None)
        buf.put_group_nowait("plain", ["a", "b"])  # stored lazily: no tokens
        buf.put_group_nowait("long", ["c"], tokens=[40])
        buf.put_group_nowait("mixed", ["d", "e"], versions=[[(0, 10)], None], tokens=[None, 20])
        buf.put_group_nowait("short", ["f", "g", "h"], tokens=[1, 2, 3])
        batch, _ = await buf.sample(0, 4, timeout=0)
        assert batch.uids == ["plain", "long", "mixed", "short"]
        parts = batch.split(2)  # costs 0, 40, 30, 6: long -> 0, mixed -> 1, short and plain -> 1
        assert uid_parts(parts) == [["long"], ["plain", "mixed", "short"]]
        assert parts[0].payloads == ["c"]
        assert parts[1].payloads == ["a", "b", "d", "e", "f", "g", "h"]
        assert parts[1].token_counts.tolist() == [0, 0, 10, 20, 1, 2, 3]
        assert uid_parts(batch.split(2, cost="quadratic")) == [["long"], ["plain", "mixed", "short"]]
        assert uid_parts(batch.split(3, cost="groups")) == [["plain", "short"], ["long"], ["mixed"]]
        by_trajectory = batch.split(3, by="trajectory")  # 40 | 20 | 10, 3, 2, 1, then the 0s
        assert [[t.key for t in part] for part in by_trajectory] == [
            ["long_0_0"],
            ["mixed_1_0"],
            ["plain_0_0", "plain_1_0", "mixed_0_0", "short_0_0", "short_1_0", "short_2_0"],
        ]
