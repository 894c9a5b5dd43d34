"""Versioned trajectories (issue 22), focused: the rules at work on hand-built cases.

Each expected value is computed from the issue's definitions (a token of version ``v`` sampled
at ``g`` has lag ``g - v + 1`` and is stale iff the lag exceeds ``T*S``; a group's head is the
min of its start version and its tokens' versions, its tail the max of its trajectories'
tails), never read from the code under test. The random exploration is
tests/test_versions_model.py's; the equality with the no-version behaviour
tests/test_versions_equality.py's; bad arguments are rows of tests/test_bad_inputs.py.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import attrs
import numpy as np
import pytest

from _helpers import LIMIT, assert_conserved, in_flight_heads, make, resident_uids, version_state
from stalebuf import (
    BatchNotReadyError,
    ConfigError,
    EvictionEvent,
    GroupEvictedError,
    InvalidTransitionError,
    ReplayBuffer,
    SamplerConfig,
    StalenessPolicy,
    Status,
    UnknownGroupError,
)

pytestmark = pytest.mark.anyio

MAX = 2**63 - 1


def versioned(
    buf: ReplayBuffer,
    uid: str,
    step: int,
    *trajectories: Any,
    start: int | None = None,
    status: Status = Status.FINISHED,
    partition: str = "train",
) -> None:
    """A group dispatched at ``step``, started at ``start``, with one trajectory per argument:
    a list of ``(version, n_tokens)`` pairs, or an int (tokens without versions)."""
    buf.add_prompt_nowait(uid, global_steps=step, partition=partition)
    if status is not Status.PENDING:
        buf.mark_running_nowait(uid, version=start)
    for session, trajectory in enumerate(trajectories):
        if isinstance(trajectory, int):
            buf.put_nowait(uid, session, session_id=session, tokens=trajectory)
        else:
            buf.put_nowait(uid, session, session_id=session, versions=trajectory)
    if status is Status.FINISHED:
        buf.mark_finished_nowait(uid)
    elif status is Status.FAILURE:
        buf.mark_failed_nowait(uid)


def tokens_conserved(buf: ReplayBuffer) -> None:
    stats = buf.stats()
    for item in (*stats.partitions.values(), stats.total):
        assert item.admitted_tokens == (
            item.sampled_tokens + item.evicted_tokens + item.reissued_tokens + item.tokens
        ), item
        assert 0 <= item.masked_tokens <= item.sampled_tokens


# -- the wait gate and in-flight eviction follow a moving head ----------------------------------


async def test_a_parked_wait_sample_returns_once_a_start_version_lifts_the_gating_head() -> None:
    """Defect (fixed): ``mark_running(version=)`` that moves an in-flight group's head newer
    reopens the ``wait`` gate, but a parked ``sample`` was not woken: it waited for good (until
    some unrelated group finished). T=2, S=1; at g=5 a PENDING group dispatched at 0 has lag 6
    >= 2 and closes the gate; started at version 5 (lag 1 < 2) it no longer does."""
    with anyio.fail_after(LIMIT):
        buf = make(max_off_policy_strategy="wait", max_off_policy_threshold=2)
        buf.put_group_nowait("ready", ["x"], global_steps=5)
        buf.add_prompt_nowait("slow", global_steps=0)
        result: list[Any] = []
        returned = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def sampler() -> None:
                result.append(await buf.sample(5, 1))
                returned.set()

            tg.start_soon(sampler)
            await anyio.wait_all_tasks_blocked()
            assert not result, "the gate must hold while the head has lag 6"
            buf.mark_running_nowait("slow", version=5)
            with anyio.fail_after(1):
                await returned.wait()
        assert result[0][0].uids == ["ready"]
        assert in_flight_heads(buf) == {"slow": 5}


async def test_a_parked_sample_evicts_in_flight_a_group_whose_new_head_is_stale() -> None:
    """Defect (fixed): under drop with ``evict_stale_in_flight``, a put with an old version (or
    ``mark_running(version=)`` with an old one) makes an in-flight group stale at a parked
    sample's step, where no later sample could return it; the parked sample was not woken, so
    the group stayed in flight and its producer kept generating (a ``rollout()`` body was not
    cancelled) until something else woke the sample. T=2: at g=5 a head of 1 has lag 5 > 2."""
    with anyio.fail_after(LIMIT):
        events: list[EvictionEvent] = []
        buf = make(max_off_policy_threshold=2, evict_stale_in_flight=True, on_evict=events.append)
        versioned(buf, "slow", 5, status=Status.RUNNING)
        versioned(buf, "late", 5, start=5, status=Status.RUNNING)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: buf.sample(5, 1))
            await anyio.wait_all_tasks_blocked()
            buf.put_nowait("slow", "x", versions=[(1, 4)])
            await anyio.wait_all_tasks_blocked()
            assert [(e.reason, [g.uid for g in e.groups]) for e in events] == [("stale", ["slow"])]
            with pytest.raises(GroupEvictedError):
                buf.put_nowait("slow", "y", session_id=1)
            buf.add_prompt_nowait("low", global_steps=5)
            await anyio.wait_all_tasks_blocked()
            buf.mark_running_nowait("low", version=2)  # lag 4 > 2
            await anyio.wait_all_tasks_blocked()
            assert [e.groups[0].uid for e in events] == ["slow", "low"]
            tg.cancel_scope.cancel()
        assert resident_uids(buf) == ["late"]
        tokens_conserved(buf)


async def test_a_parked_sample_evicts_a_group_admitted_stale_at_its_step() -> None:
    """Defect (fixed; from before versions): under drop with ``evict_stale_in_flight`` and no
    admission control, ``add_prompt`` at a step already stale at a parked sample's step (T=1:
    step 2 at g=5) admitted a group no later sample could return, and the parked sample did not
    evict it until something else woke it: its producer generated for nothing meanwhile."""
    with anyio.fail_after(LIMIT):
        events: list[EvictionEvent] = []
        buf = make(max_off_policy_threshold=1, evict_stale_in_flight=True, on_evict=events.append)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: buf.sample(5, 1))
            await anyio.wait_all_tasks_blocked()
            buf.add_prompt_nowait("old", global_steps=2)
            buf.add_prompt_nowait("fresh", global_steps=5)
            await anyio.wait_all_tasks_blocked()
            assert [[g.uid for g in e.groups] for e in events] == [["old"]]
            tg.cancel_scope.cancel()
        assert resident_uids(buf) == ["fresh"]


async def test_a_parked_sample_is_never_left_behind_by_a_producer_call() -> None:
    """Random producer calls (versions older and newer than the dispatch step, start versions,
    finishes, failures) while a sample is parked, under every strategy: after each call, once
    every task is blocked, either the sample has returned or a fresh evaluation of a copy of the
    buffer (a checkpoint restored with its in-flight groups) would neither return a batch nor
    evict anything. (It found both wake-up defects above.)"""
    for seed in range(40):
        with anyio.fail_after(LIMIT):
            await parked_sample_walk(random.Random(seed))


async def parked_sample_walk(rnd: random.Random) -> None:
    strategy = rnd.choice(["drop", "wait", "mask"])
    threshold, sync = rnd.randint(1, 3), rnd.randint(1, 2)
    config = SamplerConfig(
        max_off_policy_strategy=strategy,  # type: ignore[arg-type]
        max_off_policy_threshold=threshold,
        parameter_sync_step=sync,
        evict_stale_in_flight=strategy == "drop" and rnd.random() < 0.5,
        failure_strategy=rnd.choice(["sample", "evict"]),
    )
    buf = ReplayBuffer(config, status_log_interval=None)
    g, flying, returned = 5, [], []

    async def sampler(steps: int, size: int) -> None:
        try:
            returned.append(await buf.sample(steps, size))
        except Exception as exc:  # a policy hook's error or on_evict's: returned all the same
            returned.append(exc)

    async with anyio.create_task_group() as tg:
        steps, size = g, rnd.randint(1, 3)
        tg.start_soon(sampler, steps, size)
        for number in range(150):
            await anyio.wait_all_tasks_blocked()
            if returned:
                returned.clear()
                steps, size = g, rnd.randint(1, 3)
                tg.start_soon(sampler, steps, size)
                continue
            events: list[EvictionEvent] = []
            copy = ReplayBuffer.restore(buf.checkpoint(), in_flight="keep", on_evict=events.append).buffer
            try:
                copy.sample_nowait(steps, size)
                fresh = "returns a batch"
            except BatchNotReadyError:
                fresh = f"evicts {[[x.uid for x in e.groups] for e in events]}" if events else ""
            assert not fresh, (
                f"{config}: after call {number} a sample parked at {steps} stays, a fresh one {fresh}"
            )
            roll = rnd.random()
            try:
                if roll < 0.3:
                    uid = f"u{number}"
                    buf.add_prompt_nowait(uid, global_steps=max(0, g - rnd.randint(0, 4)))
                    flying.append(uid)
                elif roll < 0.5 and flying:
                    version = rnd.choice([None, max(0, g + rnd.randint(-6, 3))])
                    buf.mark_running_nowait(rnd.choice(flying), version=version)
                elif roll < 0.75 and flying:
                    versions = [(max(0, g + rnd.randint(-6, 2)), rnd.randint(1, 3))]
                    buf.put_nowait(rnd.choice(flying), session_id=number, versions=versions)
                elif roll < 0.95 and flying:
                    uid = flying.pop(rnd.randrange(len(flying)))
                    (buf.mark_failed_nowait if rnd.random() < 0.2 else buf.mark_finished_nowait)(uid)
                else:
                    g += 1
            except (InvalidTransitionError, UnknownGroupError):  # running twice, evicted in flight
                pass
        tg.cancel_scope.cancel()


async def test_a_put_with_an_older_version_moves_the_head_and_closes_the_wait_gate() -> None:
    """T=2, g=4: a RUNNING group dispatched at 4 (lag 1) does not hold a sample; a put of
    tokens of version 1 moves its head to 1 (lag 4 >= 2), and it does."""
    buf = make(max_off_policy_strategy="wait", max_off_policy_threshold=2)
    buf.put_group_nowait("r1", ["x"], global_steps=4)
    buf.put_group_nowait("r2", ["x"], global_steps=4)
    versioned(buf, "slow", 4, status=Status.RUNNING)
    buf.put_nowait("slow", "a", versions=[(4, 2)])
    assert in_flight_heads(buf) == {"slow": 4}
    assert buf.sample_nowait(4, 1)[0].uids == ["r1"]
    buf.put_nowait("slow", "b", session_id=1, versions=[(5, 1), (1, 3)])  # older weights, later
    assert in_flight_heads(buf) == {"slow": 1}
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(4, 1)
    buf.mark_finished_nowait("slow")
    batch, _ = buf.sample_nowait(4, 2)
    assert batch.uids == ["r2", "slow"]
    assert batch.freshness_mask()[0].tolist() == [True, True, True, False, False, False]  # lag <= 2
    assert batch.loss_excluded.tolist() == [False, False, False]


@pytest.mark.parametrize("start", [None, 2, 4, 5, 8])
async def test_drop_judges_a_group_by_the_start_version_mark_running_gives(start: int | None) -> None:
    """A group without tokens has head = tail = its start version (``mark_running(version=)``,
    else its dispatch step p = 5), older or newer than p. T=2, g=6."""
    buf = make(max_off_policy_threshold=2)
    versioned(buf, "g", 5, start=start)
    head = 5 if start is None else start
    evicted = 6 - head + 1 > 2
    assert buf.sampleable_count(6) == (0 if evicted else 1)
    if evicted:
        with pytest.raises(BatchNotReadyError):
            buf.sample_nowait(6, 1)
        assert buf.stats().total.evicted_stale_groups == 1
    else:
        batch, _ = buf.sample_nowait(6, 1)
        assert batch.groups[0].start_version == head
        assert batch.staleness.tolist() == [(6 - 5 + 1) / 1]  # still dispatch-based


async def test_drop_evicts_by_the_head_and_mask_by_the_tail() -> None:
    """T=1, S=2 (T*S = 2), g=10: versions 8 (lag 3, stale), 9 (lag 2, fresh), 10 (lag 1).
    ``a`` has tokens at 8 and 10: drop evicts it (head 8), mask returns it with the 8s masked;
    ``b`` has only 8s: both evict it; ``c`` only 9s: both return it."""
    results = {}
    for strategy in ("drop", "mask"):
        events: list[EvictionEvent] = []
        buf = make(
            max_off_policy_strategy=strategy,
            max_off_policy_threshold=1,
            parameter_sync_step=2,
            on_evict=events.append,
        )
        versioned(buf, "a", 9, [(8, 2), (10, 1)], [(10, 3)], start=9)
        versioned(buf, "b", 9, [(8, 4)], start=8)
        versioned(buf, "c", 9, [(9, 2)], start=9)
        assert buf.sampleable_count(10) == (1 if strategy == "drop" else 2)
        batch, metrics = buf.sample_nowait(10, 1)
        results[strategy] = ([g.uid for e in events for g in e.groups], batch, metrics)
        tokens_conserved(buf)
    dropped, batch, _ = results["drop"]
    assert dropped == ["a", "b"]
    assert batch.uids == ["c"]
    evicted, batch, metrics = results["mask"]
    assert evicted == ["b"]
    assert batch.uids == ["a"]
    assert batch.freshness_mask()[0].tolist() == [False, False, True, True, True, True]
    assert batch.loss_excluded.tolist() == [False, False]
    assert batch.head_staleness.tolist() == [3 / 2, 1 / 2]
    assert batch.tail_staleness.tolist() == [1 / 2, 1 / 2]
    assert metrics["training/off_policy/masked_tokens"] == 2.0
    assert metrics["training/off_policy/token_staleness/max"] == 3 / 2


async def test_mask_excludes_a_trajectory_whose_tokens_are_all_stale_and_keeps_it() -> None:
    """A trajectory with tokens, all stale, is returned with loss_excluded (for the group's
    baseline); one without tokens is never excluded; one without segments counts its tokens at
    the start version. T=1, S=1, g=5: only version 5 (and newer) is fresh."""
    buf = make(max_off_policy_strategy="mask", max_off_policy_threshold=1)
    versioned(buf, "g", 3, [(3, 2)], [(4, 1), (5, 2)], 0, 3, start=3)
    versioned(buf, "h", 3, [(5, 1)], 2, start=5)
    batch, metrics = buf.sample_nowait(5, 2)
    assert batch.uids == ["g", "h"]
    assert batch.token_counts.tolist() == [2, 3, 0, 3, 1, 2]
    versions, offsets = batch.token_versions()
    assert versions.tolist() == [3, 3, 4, 5, 5, 3, 3, 3, 5, 5, 5]
    assert offsets.tolist() == [0, 2, 5, 5, 8, 9, 11]
    assert batch.loss_excluded.tolist() == [True, False, False, True, False, False]
    mask, mask_offsets = batch.freshness_mask()
    assert mask.tolist() == [v >= 5 for v in versions.tolist()]
    assert mask_offsets.tolist() == offsets.tolist()
    assert metrics["training/off_policy/masked_tokens"] == 6.0
    assert metrics["training/off_policy/loss_excluded_trajectories"] == 2.0
    lags = [5 - v + 1 for v in versions.tolist()]
    assert metrics["training/off_policy/token_staleness/mean"] == sum(lags) / len(lags)
    assert metrics["training/off_policy/head_staleness/mean"] == (3 + 2 + 3 + 3 + 1 + 1) / 6
    assert metrics["training/off_policy/tail_staleness/mean"] == (3 + 1 + 3 + 3 + 1 + 1) / 6
    stats = buf.stats().total
    assert (stats.sampled_tokens, stats.masked_tokens) == (11, 6)
    tokens_conserved(buf)


async def test_a_batch_without_tokens_reports_no_token_metrics() -> None:
    buf = make(max_off_policy_strategy="mask")
    versioned(buf, "t", 0, [(0, 2)])
    buf.sample_nowait(0, 1)
    buf.put_group_nowait("plain", ["x"], global_steps=0)
    _, metrics = buf.sample_nowait(0, 1)
    assert not [key for key in metrics if "token" in key or "head_staleness" in key]


async def test_wait_and_drop_never_mask_but_the_mask_shows_stale_tokens() -> None:
    """``freshness_mask`` is the lag rule under every strategy; ``loss_excluded`` and the masked
    counters are mask's outcomes only. T=1, g=3: version 1 (lag 3) is stale."""
    buf = make(max_off_policy_strategy="wait", max_off_policy_threshold=1)
    versioned(buf, "g", 3, [(1, 2)], [(3, 1)], start=3)
    batch, metrics = buf.sample_nowait(3, 1)
    assert batch.freshness_mask()[0].tolist() == [False, False, True]
    assert batch.loss_excluded.tolist() == [False, False]
    assert metrics["training/off_policy/masked_tokens"] == 0.0
    assert metrics["training/off_policy/loss_excluded_trajectories"] == 0.0
    assert buf.stats().total.masked_tokens == 0


# -- in-flight eviction by head ---------------------------------------------------------------


async def test_in_flight_eviction_judges_the_head() -> None:
    """T=1, g=6 (fresh: version >= 6). In flight: ``old-p`` dispatched at 2 but started at 6
    (head 6: kept), ``new-p`` dispatched at 6 holding a token of version 3 (head 3: evicted),
    ``plain`` dispatched at 6 (kept), ``pending`` dispatched at 4 (head 4: evicted)."""
    events: list[EvictionEvent] = []
    buf = make(max_off_policy_threshold=1, evict_stale_in_flight=True, on_evict=events.append)
    versioned(buf, "old-p", 2, [(6, 2)], start=6, status=Status.RUNNING)
    versioned(buf, "new-p", 6, [(6, 1), (3, 1)], status=Status.RUNNING)
    versioned(buf, "plain", 6, status=Status.RUNNING)
    versioned(buf, "pending", 4, status=Status.PENDING)
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(6, 1)
    assert sorted(g.uid for e in events for g in e.groups) == ["new-p", "pending"]
    assert in_flight_heads(buf) == {"old-p": 6, "plain": 6}
    stats = buf.stats().total
    assert (stats.evicted_in_flight_groups, stats.evicted_tokens, stats.tokens) == (2, 2, 2)
    tokens_conserved(buf)


def test_mask_refuses_in_flight_eviction_with_a_config_error_saying_why() -> None:
    why = "in-flight group can always still gain fresh tokens"
    with pytest.raises(ConfigError, match=why):
        SamplerConfig(max_off_policy_strategy="mask", evict_stale_in_flight=True)
    with pytest.raises(ConfigError, match=why):
        SamplerConfig(evict_stale_in_flight=True, max_off_policy_strategy="mask")
    with pytest.raises(ConfigError, match=why):
        SamplerConfig.from_mapping({"evict_stale_in_flight": True, "max_off_policy_strategy": "mask"})
    with pytest.raises(ConfigError, match=why):
        attrs.evolve(SamplerConfig(evict_stale_in_flight=True), max_off_policy_strategy="mask")
    assert SamplerConfig.from_mapping({"max_off_policy_strategy": "mask"}).max_off_policy_strategy == "mask"


# -- put_back, the fast path, exempt partitions --------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True])
async def test_put_back_keeps_versions_tokens_and_the_start_version(lazy: bool) -> None:
    """A group put back is judged as before: by its head (drop), from its own versions and start
    version, not its dispatch step 4. ``lazy``: written by the put_group fast path with only a
    start version. T=2."""
    buf = make(max_off_policy_threshold=2)
    if lazy:
        buf.put_group_nowait("g", ["a", "b"], global_steps=4, version=2)
        expected, head, tokens = (2, [("g_0_0", (), 0), ("g_1_0", (), 0)]), 2, 0
    else:
        versioned(buf, "g", 4, [(3, 2), (5, 1)], 6, start=4)
        expected, head, tokens = (4, [("g_0_0", ((3, 2), (5, 1)), 3), ("g_1_0", (), 6)]), 3, 9
    assert version_state(buf)["g"] == expected
    batch, _ = buf.sample_nowait(head + 1, 1)  # lag 2
    before = (batch.token_versions()[0].tolist(), batch.head_staleness.tolist())
    assert buf.put_back(batch.groups[0]) is True
    assert version_state(buf)["g"] == expected
    assert buf.sampleable_count(head + 1) == 1
    assert buf.sampleable_count(head + 2) == 0  # lag 3 > 2
    again, _ = buf.sample_nowait(head + 1, 1)
    assert again.groups[0].start_version == expected[0]
    assert (again.token_versions()[0].tolist(), again.head_staleness.tolist()) == before
    stats = buf.stats().total
    assert (stats.admitted_tokens, stats.sampled_tokens) == (2 * tokens, 2 * tokens)
    tokens_conserved(buf)
    assert_conserved(buf)


@pytest.mark.parametrize("strategy", ["drop", "mask"])
async def test_the_put_group_fast_path_is_judged_by_its_start_version(strategy: str) -> None:
    """``put_group(version=)`` without versions or tokens (stored lazily): head = tail = the
    start version. T=1, g=5: start 4 has lag 2 (stale), start 5 lag 1."""
    buf = make(max_off_policy_strategy=strategy, max_off_policy_threshold=1)
    buf.put_group_nowait("old", ["x"], global_steps=5, version=4)
    buf.put_group_nowait("new", ["y"], global_steps=5, version=5)
    assert buf.sampleable_count(5) == 1
    batch, _ = buf.sample_nowait(5, 1)
    assert batch.uids == ["new"]
    assert buf.stats().total.evicted_stale_groups == 1


async def test_exempt_partitions_under_mask_exclude_nothing_and_still_report_freshness() -> None:
    buf = make(max_off_policy_strategy="mask", max_off_policy_threshold=1, exempt_partitions={"val"})
    versioned(buf, "v", 0, [(0, 2)], [(0, 1), (9, 1)], partition="val")
    versioned(buf, "w", 0, [(0, 3)], partition="val")  # every token stale: still returned
    assert buf.sampleable_count(9, "val") == 2
    batch, metrics = buf.sample_nowait(9, 2, partition="val")
    assert batch.uids == ["v", "w"]
    assert batch.freshness_mask()[0].tolist() == [False, False, False, True, False, False, False]
    assert batch.loss_excluded.tolist() == [False, False, False]
    assert metrics["validation/off_policy/masked_tokens"] == 0.0
    assert metrics["validation/off_policy/loss_excluded_trajectories"] == 0.0
    assert metrics["validation/off_policy/token_staleness/max"] == 10.0
    assert buf.stats().partitions["val"].masked_tokens == 0
    assert buf.stats().partitions["val"].evicted_stale_groups == 0


# -- hooks: on_evict, custom policies -----------------------------------------------------------


async def test_an_on_evict_that_raises_under_mask_leaves_the_buffer_consistent() -> None:
    seen: list[tuple[str, list[str]]] = []

    def hostile(event: EvictionEvent) -> None:
        seen.append((event.reason, [g.uid for g in event.groups]))
        raise RuntimeError("on_evict raised")

    buf = make(
        max_off_policy_strategy="mask", max_off_policy_threshold=1, failure_strategy="evict", on_evict=hostile
    )
    versioned(buf, "old", 0, [(0, 4)])
    versioned(buf, "mix", 0, [(0, 2), (5, 3)], start=5)
    versioned(buf, "bad", 0, 7, status=Status.FAILURE)
    with pytest.raises(RuntimeError, match="on_evict raised"):
        buf.sample_nowait(5, 1)
    assert seen == [("failure", ["bad"]), ("stale", ["old"])]  # every event delivered
    stats = buf.stats().total
    assert (stats.admitted_tokens, stats.evicted_tokens, stats.tokens) == (16, 11, 5)
    batch, metrics = buf.sample_nowait(5, 1)
    assert batch.uids == ["mix"]
    assert metrics["training/off_policy/masked_tokens"] == 2.0
    assert buf.stats().total.masked_tokens == 2
    tokens_conserved(buf)
    assert_conserved(buf)


class Recording(StalenessPolicy):
    """The default rules, recording every ``(rule, global_steps, version)`` asked."""

    def __init__(self, config: SamplerConfig) -> None:
        super().__init__(config)
        self.asked: list[tuple[str, int, int]] = []

    def is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        self.asked.append(("is_stale", global_steps, dispatch_step))
        return super().is_stale(global_steps, dispatch_step, partition)

    def must_wait_for(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        self.asked.append(("must_wait_for", global_steps, dispatch_step))
        return super().must_wait_for(global_steps, dispatch_step, partition)


@pytest.mark.parametrize(
    ("strategy", "asked", "returned"),
    [
        ("drop", [("is_stale", 10, 5)], []),  # the terminal group's head: min(7, 5, 9, 8)
        ("mask", [("is_stale", 10, 9)], ["a"]),  # its tail: max(9, 8)
        ("wait", [("must_wait_for", 10, 4)], []),  # the in-flight group's head: min(6, 4)
    ],
)
async def test_a_custom_policy_is_asked_about_the_head_or_the_tail(
    strategy: str, asked: list[tuple[str, int, int]], returned: list[str]
) -> None:
    policy = Recording(SamplerConfig(max_off_policy_strategy=strategy, max_off_policy_threshold=2))
    buf = ReplayBuffer(policy=policy, status_log_interval=None)
    versioned(buf, "a", 10, [(5, 1), (9, 2)], [(8, 1)], start=7)
    versioned(buf, "f", 10, [(4, 1)], start=6, status=Status.RUNNING)
    policy.asked.clear()
    try:
        batch, _ = buf.sample_nowait(10, 1)
        got = batch.uids
    except BatchNotReadyError:
        got = []
    assert policy.asked == asked
    assert got == returned


async def test_a_subclass_is_stale_hook_is_asked_about_the_head() -> None:
    asked: list[int] = []

    class Verl(ReplayBuffer):
        def _is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
            asked.append(dispatch_step)
            return global_steps - dispatch_step + 1 > 3

    buf = Verl(SamplerConfig(max_off_policy_threshold=3), status_log_interval=None)
    versioned(buf, "a", 10, [(6, 1), (10, 1)], start=10)
    assert buf.sampleable_count(10) == 0  # head 6: lag 5 > 3
    assert asked[-1] == 6


# -- arrays and bounds --------------------------------------------------------------------------


async def test_huge_versions_and_steps_never_overflow() -> None:
    """Versions and steps up to 2**63 - 1: every array is exact in int64 and the staleness is
    the lag over S as float64 (a lag of 2**63 or a negative one included; the metrics clip a
    negative one to a fresh group's, 1 / S)."""
    buf = make(max_off_policy_strategy="mask", max_off_policy_threshold=1, parameter_sync_step=2)
    versioned(buf, "h", MAX, [(MAX, 3), (0, 2)], start=MAX)
    batch, metrics = buf.sample_nowait(MAX, 1)
    versions, offsets = batch.token_versions()
    assert versions.tolist() == [MAX] * 3 + [0] * 2
    assert offsets.tolist() == [0, 5]
    assert batch.freshness_mask()[0].tolist() == [True] * 3 + [False] * 2
    assert batch.head_staleness.tolist() == [float(2**63) / 2]
    assert batch.tail_staleness.tolist() == [0.5]
    assert batch.staleness.tolist() == [0.5]
    assert metrics["training/off_policy/masked_tokens"] == 2.0
    buf = make(max_off_policy_threshold=3, parameter_sync_step=2)
    versioned(buf, "n", 0, [(MAX, 3)], start=0)  # newer than g: a negative lag, fresh
    batch, metrics = buf.sample_nowait(0, 1)
    assert batch.freshness_mask()[0].tolist() == [True] * 3
    # the group's head is its start version 0, its trajectory's head its oldest token's
    assert batch.head_staleness.tolist() == [float(-(MAX - 1)) / 2]
    assert batch.tail_staleness.tolist() == [float(-(MAX - 1)) / 2]
    # The metrics count a version newer than the step as fresh, 1 / S (issue 25: a journal
    # recovered at an earlier step holds such groups); the batch's arrays keep the true lag.
    assert metrics["training/off_policy/token_staleness/max"] == 0.5
    assert metrics["training/off_policy/head_staleness/mean"] == 0.5


async def test_batch_staleness_is_exact_at_steps_near_2_63() -> None:
    """Defect (fixed): ``Batch.staleness`` computed ``g + 1 - p`` in float64, which rounds to
    0 for steps near 2**63: groups dispatched at 2**63 - 6 and 2**63 - 1, sampled at
    2**63 - 1, reported staleness 0 and 0 instead of 6 and 1."""
    buf = make(max_off_policy_threshold=8)
    buf.put_group_nowait("a", ["x"], global_steps=MAX - 5)
    buf.put_group_nowait("b", ["x"], global_steps=MAX)
    batch, metrics = buf.sample_nowait(MAX, 2)
    assert batch.staleness.tolist() == [6.0, 1.0]
    assert metrics["training/off_policy/sampled_staleness/max"] == 6.0
    assert metrics["training/off_policy/sampled_staleness/min"] == 1.0


async def test_the_mean_sampled_staleness_is_exact_at_steps_near_2_63() -> None:
    """Defect (fixed): sample's dispatch-based metrics computed (g + 1 - sum(p) / n) / S and
    g - sum(finish) / n in float64, which lose everything near 2**63 (the mean staleness was 0.0
    where the min was 1.0 and the max 6.0)."""

    def metrics_at(top: int) -> dict[str, float]:
        buf = make(max_off_policy_threshold=8)
        buf.put_group_nowait("a", ["x"], global_steps=top - 5)
        buf.put_group_nowait("b", ["x"], global_steps=top)
        return buf.sample_nowait(top, 2)[1]

    near, small = metrics_at(MAX), metrics_at(10)  # the same run, shifted: the same metrics
    assert near["training/off_policy/sampled_staleness/mean"] == (6 + 1) / 2
    assert near["training/off_policy/sampled_queue_steps/mean"] == (5 + 0) / 2  # finished at dispatch
    assert {k: v for k, v in near.items() if "seconds" not in k} == {
        k: v for k, v in small.items() if "seconds" not in k
    }


async def test_a_batch_of_more_than_2_63_tokens_is_not_lost() -> None:
    """Defect (fixed): each trajectory holds at most 2**63 - 1 tokens, but a group (or a batch)
    may hold more: the token metrics summed them in int64 and raised ValueError (or wrapped),
    after the groups were taken. A sample must return its batch, or raise having taken nothing."""
    buf = make(max_off_policy_strategy="mask")
    versioned(buf, "a", 0, 2**62, 2**62)
    try:
        batch, _ = buf.sample_nowait(0, 1)
    except ValueError:
        assert "a" in buf, "sample raised after taking the batch: the group is lost"
    else:
        assert batch.token_counts.tolist() == [2**62, 2**62]


def test_padded_keeps_the_dtype_and_refuses_a_short_pad_to() -> None:
    buf = make()
    versioned(buf, "p", 0, [(0, 3)], [(1, 1)])
    batch, _ = buf.sample_nowait(1, 1)
    versions, offsets = batch.token_versions()
    small = batch.padded(versions.astype(np.int16), offsets, fill=-1)
    assert small.dtype == np.int16
    assert small.tolist() == [[0, 0, 0], [1, -1, -1]]
    mask, _ = batch.freshness_mask()
    wide = batch.padded(mask, offsets, pad_to=5, fill=False)
    assert wide.dtype == np.bool_
    assert wide.shape == (2, 5)
    with pytest.raises(ValueError, match="pad_to=2 is shorter than the longest trajectory"):
        batch.padded(versions, offsets, pad_to=2)


# -- restore and token counters -----------------------------------------------------------------


def restored(buf: ReplayBuffer, in_flight: str) -> ReplayBuffer:
    return ReplayBuffer.restore(buf.checkpoint(), in_flight=in_flight).buffer  # type: ignore[arg-type]


def a_buffer_with_history() -> ReplayBuffer:
    """Tokens sampled (3, 1 of them masked), evicted (2), resident in flight (8) and ready (2)."""
    buf = make(max_off_policy_strategy="mask", max_off_policy_threshold=1)
    versioned(buf, "s", 2, [(1, 1), (2, 2)])
    versioned(buf, "e", 2, [(0, 2)])
    buf.sample_nowait(2, 1)
    versioned(buf, "k", 3, [(1, 2), (4, 1)], 5, start=1, status=Status.RUNNING)
    versioned(buf, "t", 3, [(2, 2)], start=2)
    return buf


async def test_a_restore_that_keeps_in_flight_groups_keeps_their_versions_and_heads() -> None:
    buf = a_buffer_with_history()
    again = restored(buf, "keep")
    assert version_state(again) == version_state(buf)
    assert in_flight_heads(again) == in_flight_heads(buf) == {"k": 1}
    tokens_conserved(again)


async def test_a_restore_keeps_the_cumulative_token_counters() -> None:
    """(Failed on 96ae3cc, before checkpoints carried the token counters.)"""
    buf = a_buffer_with_history()
    before = buf.stats().total
    assert (before.sampled_tokens, before.masked_tokens, before.evicted_tokens) == (3, 1, 2)
    after = restored(buf, "keep").stats().total
    assert (after.admitted_tokens, after.sampled_tokens, after.masked_tokens, after.evicted_tokens) == (
        before.admitted_tokens,
        3,
        1,
        2,
    )


async def test_token_conservation_holds_after_a_restore_that_evicts_in_flight_groups() -> None:
    """(Failed on 96ae3cc: the evicted prefixes' tokens were counted evicted, never admitted.)"""
    again = restored(a_buffer_with_history(), "evict")
    tokens_conserved(again)


async def test_a_reissuing_restore_counts_the_discarded_tokens() -> None:
    """The issue: ``reissued_tokens`` counts the tokens of discarded partial trajectories (it
    stayed 0 on 96ae3cc)."""
    again = restored(a_buffer_with_history(), "reissue")
    assert again.stats().total.reissued_tokens == 8  # k's 3 + 5


# -- mixtures (issue 23) ------------------------------------------------------------------------


async def test_the_mask_guarantee_holds_for_a_task_with_its_own_threshold() -> None:
    """Defect (fixed): the batch masked every token with the global T, not its task's.
    T=4, but the "math" task has T=1: at g=5 a math token of version 3 (lag 3 > 1) is stale,
    and mask evicts a math group whose tail is 3 for it. In a math group returned for its fresh
    tail, those tokens must be masked too; in a code group (T=4) they are fresh."""
    buf = make(
        max_off_policy_strategy="mask",
        max_off_policy_threshold=4,
        mixture={"math": 1, "code": 1},
        task_thresholds={"math": 1},
    )
    for uid, task in (("m", "math"), ("c", "code")):
        buf.add_prompt_nowait(uid, global_steps=5, tags={"task": task})
        buf.mark_running_nowait(uid, version=5)
        buf.put_nowait(uid, versions=[(3, 2), (5, 1)])
        buf.mark_finished_nowait(uid)
    batch, metrics = buf.sample_nowait(5, 2)
    assert batch.uids == ["m", "c"]
    assert batch.freshness_mask()[0].tolist() == [False, False, True, True, True, True]
    assert metrics["training/off_policy/masked_tokens"] == 2.0
    assert buf.stats().partitions["train"].masked_tokens == 2
