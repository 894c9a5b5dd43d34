"""Group deadlines (issue 21): no straggler can wedge a run.

``group_deadline_seconds`` (or ``group_deadline_factor`` times the rolling median generation
time) bounds how long a PENDING/RUNNING group may stay in flight: a ``sample`` cuts it (finished
with what it has under ``group_quorum``, else failed), and a ``sample`` that is blocked parks
with a timer until the first deadline. Every wait here is bounded by ``anyio.fail_after``;
deadlines are real (monotonic) time, short, with generous slack for a noisy 2-core machine.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _helpers import (
    LIMIT,
    assert_conserved,
    evaluations,
    make,
    patch_deadline_clock,
    resident_groups,
    settle,
    start_call,
    train_stats,
)
from stalebuf import (
    BatchNotReadyError,
    BufferClosedError,
    ConfigError,
    EvictionEvent,
    GroupCutError,
    ReplayBuffer,
    SamplerConfig,
    StalebufError,
    StalenessPolicy,
    Status,
)
from stalebuf._partition import GENERATION_WINDOW, MEDIAN_AFTER, PartitionState

pytestmark = pytest.mark.anyio

DEADLINE = 0.2
SLACK = 1.0  # a blocked sample returns within this after the deadline (noisy machine)


def cut_tagged(group: Any) -> bool:
    return dict(group.tags).get("stalebuf_cut") is True


async def hang(buf: ReplayBuffer, uid: str, puts: int, seen: dict[str, Any]) -> None:
    """A producer stuck in generation after ``puts`` trajectories (the SkyRL hang)."""
    async with buf.rollout(uid) as group:
        seen[uid] = group
        for index in range(puts):
            await group.put(f"{uid}-{index}", session_id=index)
        await anyio.sleep_forever()
    seen[f"{uid} exited"] = True


# -- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"group_deadline_seconds": 0}, "group_deadline_seconds"),
        ({"group_deadline_seconds": -1.0}, "group_deadline_seconds"),
        ({"group_deadline_seconds": math.nan}, "group_deadline_seconds"),
        ({"group_deadline_seconds": math.inf}, "group_deadline_seconds"),
        ({"group_deadline_seconds": True}, "group_deadline_seconds"),
        ({"group_deadline_seconds": "5"}, "group_deadline_seconds"),
        ({"group_deadline_seconds": 10**400}, "group_deadline_seconds"),
        ({"group_deadline_factor": 1}, "group_deadline_factor"),
        ({"group_deadline_factor": 0.5}, "group_deadline_factor"),
        ({"group_deadline_factor": math.nan}, "group_deadline_factor"),
        ({"group_deadline_factor": "3"}, "group_deadline_factor"),
        ({"group_deadline_seconds": 5, "group_deadline_factor": 3}, "exclusive"),
        ({"group_quorum": 0}, "group_quorum"),
        ({"group_quorum": 1.5}, "group_quorum"),
        ({"group_quorum": True}, "group_quorum"),
        ({"group_quorum": 2**63}, "group_quorum"),
    ],
)
def test_bad_deadline_fields_are_config_errors(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SamplerConfig(**fields)
    with pytest.raises(ConfigError, match=match):
        SamplerConfig.from_mapping(fields)


def test_deadline_fields_are_read_from_a_mapping() -> None:
    config = SamplerConfig.from_mapping(
        {"group_deadline_factor": 3.0, "group_quorum": 4, "max_off_policy_strategy": "wait"}
    )
    assert (config.group_deadline_seconds, config.group_deadline_factor, config.group_quorum) == (
        None,
        3.0,
        4,
    )


# -- the cut ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["wait", "drop"])
async def test_a_hung_generation_is_cut_on_time_and_the_blocked_sample_returns(strategy: str) -> None:
    """The SkyRL hang: one producer never finishes. Without a deadline ``sample(0, 4)`` waits
    forever; with one it returns soon after the deadline, holding the cut group (quorum met)."""
    buf = make(
        max_off_policy_threshold=2,
        max_off_policy_strategy=strategy,
        group_deadline_seconds=DEADLINE,
        group_quorum=1,
    )
    seen: dict[str, Any] = {}
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hang, buf, "hung", 2, seen)
            await settle()
            admitted = time.monotonic()
            for index in range(3):
                await buf.put_group(f"ok{index}", [1])
            batch, metrics = await buf.sample(0, 4)
            returned = time.monotonic()
            await settle()
    assert DEADLINE <= returned - admitted < DEADLINE + SLACK
    assert batch.uids == ["hung", "ok0", "ok1", "ok2"]
    [cut] = [group for group in batch.groups if group.uid == "hung"]
    assert cut_tagged(cut)
    assert cut.status is Status.FINISHED
    assert [t.payload for t in cut.trajectories] == ["hung-0", "hung-1"]
    assert cut.generation_seconds >= DEADLINE  # never cut before its deadline
    assert seen["hung"].cut
    assert not seen["hung"].evicted
    assert seen["hung exited"]  # the body stuck in generation was cancelled at the cut
    assert metrics["training/rollout/cut_groups"] == 1
    assert metrics["training/rollout/cut_trajectories"] == 2
    assert metrics["training/rollout/cut_generation_seconds/mean"] >= DEADLINE
    stats = buf.stats().partitions["train"]
    assert (stats.cut_groups, stats.cut_trajectories, stats.sampled_groups) == (1, 2, 4)
    assert_conserved(buf)


@pytest.mark.parametrize(
    ("quorum", "failure_strategy", "status", "evicted"),
    [
        (None, "sample", Status.FAILURE, False),
        (3, "sample", Status.FAILURE, False),
        (2, "sample", Status.FINISHED, False),
        (None, "evict", Status.FAILURE, True),
    ],
)
async def test_quorum_decides_finished_or_failed_and_failure_strategy_applies(
    quorum: int | None, failure_strategy: str, status: Status, evicted: bool
) -> None:
    events: list[EvictionEvent] = []
    buf = make(
        group_deadline_seconds=DEADLINE,
        group_quorum=quorum,
        failure_strategy=failure_strategy,
        on_evict=events.append,
    )
    seen: dict[str, Any] = {}
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hang, buf, "hung", 2, seen)
            await settle()
            await buf.put_group("ok", [1])
            await anyio.sleep(DEADLINE * 1.2)  # the sample below cuts "hung" before it selects
            batch, _ = await buf.sample(0, 1 if evicted else 2)
            await settle()
    assert seen["hung"].cut
    assert seen["hung"].evicted is evicted
    if evicted:
        assert batch.uids == ["ok"]
        [event] = events
        assert event.reason == "failure"
        assert event.groups[0].uid == "hung"
        assert cut_tagged(event.groups[0])
    else:
        [cut] = [group for group in batch.groups if group.uid == "hung"]
        assert (cut.status, cut_tagged(cut)) == (status, True)
    assert_conserved(buf)


async def test_the_cut_groups_producer_learns_it_on_its_next_write() -> None:
    """A plain producer (no rollout block) of a cut group: every write names the deadline, as
    GroupCutError (an InvalidTransitionError), until a new group reuses the uid."""
    buf = make(group_deadline_seconds=DEADLINE, group_quorum=1)
    buf.add_prompt_nowait("g")
    buf.put_nowait("g", "a")
    await buf.put_group("other", [1])
    with anyio.fail_after(LIMIT):
        batch, _ = await buf.sample(0, 2)
    assert batch.uids == ["g", "other"]
    for write in (
        lambda: buf.put_nowait("g", "late", session_id=1),
        lambda: buf.mark_running_nowait("g"),
        lambda: buf.mark_finished_nowait("g"),
        lambda: buf.mark_failed_nowait("g"),
        lambda: buf.put_group_nowait("g", ["late"]),
    ):
        with pytest.raises(GroupCutError, match=r"deadline of 0\.2 s"):
            write()
    buf.add_prompt_nowait("g")  # a new group under the uid starts afresh
    buf.put_nowait("g", "new")
    assert resident_groups(buf)["g"].status is Status.PENDING
    assert_conserved(buf)


async def test_a_resident_cut_group_refuses_late_writes_with_group_cut_error() -> None:
    buf = make(group_deadline_seconds=DEADLINE, group_quorum=1)
    buf.add_prompt_nowait("g")
    buf.put_nowait("g", "a")
    await anyio.sleep(DEADLINE)
    with anyio.fail_after(LIMIT), pytest.raises(TimeoutError):
        await buf.sample(0, 2, timeout=0)  # cuts "g" (finished, resident), one group short
    assert resident_groups(buf)["g"].status is Status.FINISHED
    with pytest.raises(GroupCutError):
        buf.put_nowait("g", "late", session_id=1)


async def test_nothing_is_cut_before_its_deadline_nor_in_an_exempt_partition() -> None:
    buf = make(group_deadline_seconds=5.0, group_quorum=1)
    buf.add_prompt_nowait("slow")
    buf.add_prompt_nowait("v", partition="val")
    await anyio.sleep(0.05)
    with pytest.raises(TimeoutError):
        await buf.sample(0, 1, timeout=0)
    with pytest.raises(TimeoutError):
        await buf.sample(0, 1, partition="val", timeout=0)
    groups = resident_groups(buf)
    assert groups["slow"].in_flight
    assert groups["v"].in_flight
    assert buf.stats().total.cut_groups == 0


# -- the deadline from the median ---------------------------------------------------------------


async def test_a_factor_deadline_needs_16_measured_groups_and_follows_their_median() -> None:
    """Only groups the buffer saw in flight and that finished uncut count (a whole group written
    by one put_group call carries no measured time); no deadline before 16 of them."""
    buf = make(group_deadline_factor=3.0, group_quorum=1)
    for index in range(40):
        await buf.put_group(f"whole{index}", [1])  # no generation time: no deadline from these
    buf.add_prompt_nowait("slow")
    buf.put_nowait("slow", "partial")
    await anyio.sleep(0.05)
    with pytest.raises(TimeoutError):
        await buf.sample(0, 41, timeout=0)
    assert resident_groups(buf)["slow"].in_flight  # no median yet: no deadline
    for index in range(16):
        buf.add_prompt_nowait(f"fast{index}")
        await anyio.sleep(0.001)
        buf.mark_finished_nowait(f"fast{index}")
    # The median is about a millisecond: "slow" (admitted 50 ms ago) is far past 3x it.
    with anyio.fail_after(LIMIT):
        batch, _ = await buf.sample(0, 57)
    [cut] = [group for group in batch.groups if group.uid == "slow"]
    assert cut_tagged(cut)
    assert cut.status is Status.FINISHED
    assert buf.stats().total.cut_groups == 1


async def test_a_blocked_sample_resets_its_timer_when_the_median_appears() -> None:
    """A sample parked before any deadline exists (fewer than 16 measured groups) still cuts the
    straggler on time once the median exists: the finishing producers ask it to set its timer."""
    buf = make(group_deadline_factor=2.0, group_quorum=1, max_off_policy_strategy="wait")
    buf.add_prompt_nowait("slow")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.sample(0, 17))
            for index in range(16):
                buf.add_prompt_nowait(f"fast{index}")
                await anyio.sleep(0.002)
                buf.mark_finished_nowait(f"fast{index}")
            await anyio.sleep(0.3)  # far past 2x the median: the timer must have fired
            assert waiting.done
    assert "slow" in waiting.result[0].uids


async def test_a_sample_parked_with_nothing_in_flight_cuts_a_group_admitted_later() -> None:
    """Defect found by the randomized runs below: a sample that parked while no group was in
    flight had no cut timer, and admitting a straggler afterwards set none, so that straggler
    was never cut and the sample waited for good. Admission now asks the parked head to set
    its timer."""
    buf = make(group_deadline_seconds=DEADLINE, max_off_policy_strategy="wait")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.sample(0, 1))  # nothing in flight: no timer
            buf.add_prompt_nowait("late")  # and it hangs
            await anyio.sleep(DEADLINE + 0.5)
            assert waiting.returned
    assert waiting.result[0].uids == ["late"]  # cut, failed (no quorum), sampled
    assert waiting.result[0].groups[0].status is Status.FAILURE


# -- restore, hooks, waiting paths ----------------------------------------------------------------


@pytest.mark.parametrize("in_flight", ["keep", "reissue"])
async def test_a_restore_starts_the_deadline_clock_again(in_flight: str) -> None:
    buf = make(group_deadline_seconds=DEADLINE, group_quorum=1)
    buf.add_prompt_nowait("g")
    buf.put_nowait("g", "a")
    await anyio.sleep(DEADLINE * 1.5)  # past its deadline while the process was "down"
    restored, _ = ReplayBuffer.restore(buf.checkpoint(), in_flight=in_flight)
    with pytest.raises(TimeoutError):
        await restored.sample(0, 1, timeout=0)
    assert resident_groups(restored)["g"].in_flight  # its producer gets a full deadline again
    await anyio.sleep(DEADLINE * 1.5)
    batch, _ = await restored.sample(0, 1, timeout=0)
    assert batch.uids == ["g"]
    assert cut_tagged(batch.groups[0])


class RaisingDeadline(StalenessPolicy):
    def group_deadline(self, partition: str, median_generation_seconds: float | None) -> float | None:
        raise RuntimeError("deadline hook")


class NonsenseDeadline(StalenessPolicy):
    def group_deadline(self, partition: str, median_generation_seconds: float | None) -> float | None:
        return -1.0  # type: ignore[return-value]


class NonsenseCut(StalenessPolicy):
    def cut_status(self, partition: str, trajectories: int) -> Status:
        return Status.RUNNING


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        (RaisingDeadline, RuntimeError, "deadline hook"),
        (NonsenseDeadline, StalebufError, r"group_deadline\('train', \.\.\.\) must return"),
        (NonsenseCut, StalebufError, r"cut_status\('train', 0\) must return"),
    ],
)
async def test_a_deadline_hook_that_raises_or_answers_nonsense_cuts_nothing(
    policy: type[StalenessPolicy], error: type[Exception], match: str
) -> None:
    config = SamplerConfig(group_deadline_seconds=0.01)
    buf = ReplayBuffer(config, policy=policy(config), status_log_interval=None)
    buf.add_prompt_nowait("g")
    await anyio.sleep(0.02)
    before = buf.stats()
    with pytest.raises(error, match=match):
        await buf.sample(0, 1, timeout=0)
    assert buf.stats() == before
    assert resident_groups(buf)["g"].in_flight


async def test_a_sample_parked_with_a_cut_timer_times_out_is_cancelled_and_is_closed() -> None:
    """Every way out of a wait with a deadline timer: timeout (before the deadline), cancellation,
    close; each leaves the queue empty and the straggler in flight."""
    buf = make(group_deadline_seconds=30.0, group_quorum=1)
    buf.add_prompt_nowait("g")
    with anyio.fail_after(LIMIT):
        with pytest.raises(TimeoutError):
            await buf.sample(0, 1, timeout=0.05)
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.sample(0, 1))
            assert buf.stats().total.waiting_samplers == 1
            waiting.scope.cancel()
            await settle()
        assert buf.stats().total.waiting_samplers == 0
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.sample(0, 1))
            buf.close()
            await settle()
        assert isinstance(waiting.error, BufferClosedError)
    assert resident_groups(buf)["g"].in_flight


async def test_a_producer_finishing_wakes_the_timed_sample_as_usual() -> None:
    """A parked sample with a cut timer still wakes at once when its batch completes."""
    buf = make(group_deadline_seconds=30.0)
    buf.add_prompt_nowait("g")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.sample(0, 1))
            buf.mark_finished_nowait("g")
            await settle()
            assert waiting.returned
    assert waiting.result[0].uids == ["g"]


# -- randomized runs against the rules ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
async def test_random_runs_never_wedge_and_cut_by_the_rules(seed: int) -> None:
    """Random deadlines, quorum, strategy, failure strategy and admission, with producers of
    which some hang for good: every sample returns within the deadline plus slack (no wedge),
    no group is cut before its deadline, every cut group is finished exactly when the quorum
    says so, conservation holds, and under wait with admission no group trains staler than T."""
    import random

    rng = random.Random(seed)
    threshold, batch_size = rng.choice((1, 2, 3)), rng.choice((1, 2, 3))
    strategy = rng.choice(("wait", "drop"))
    deadline = rng.choice((0.05, 0.1))
    quorum = rng.choice((None, 1, 2))
    admission = rng.choice((None, batch_size))
    failure = rng.choice(("sample", "evict"))
    events: list[EvictionEvent] = []
    # Without admission: a budget of 2B groups dispatched, one back per group trained or evicted.
    budget = anyio.Semaphore(2 * batch_size) if admission is None else None

    def refund(count: int) -> None:
        for _ in range(count if budget is not None else 0):
            budget.release()  # type: ignore[union-attr]

    def on_evict(event: EvictionEvent) -> None:
        events.append(event)
        refund(len(event.groups))

    buf = make(
        max_off_policy_threshold=threshold,
        max_off_policy_strategy=strategy,
        group_deadline_seconds=deadline,
        group_quorum=quorum,
        admission_batch_size=admission,
        failure_strategy=failure,
        on_evict=on_evict,
    )
    trained: list[Any] = []

    async def worker(name: str) -> None:
        for index in range(1_000):
            if budget is not None:
                # Paced by hand, as pipelines without admission are: unpaced producers can hold
                # the wait gate (T*S = 1) closed for good, deadlines or not.
                await budget.acquire()
            hung = rng.random() < 0.15
            async with buf.rollout(f"{name}x{index}") as group:
                for session in range(rng.randint(0, 3)):
                    await anyio.sleep(rng.uniform(0.0, 0.01))
                    await group.put(session, session_id=session)
                if hung:
                    await anyio.sleep_forever()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for name in ("a", "b", "c", "d"):
                tg.start_soon(worker, name)
            for step in range(12):
                started = time.monotonic()
                with anyio.fail_after(deadline + 3 * SLACK):  # no wedge
                    batch, _ = await buf.sample(step, batch_size)
                assert time.monotonic() - started < deadline + 3 * SLACK
                trained.extend(batch.groups)
                refund(len(batch))
                if strategy == "wait" and admission is not None:
                    assert max(batch.staleness.tolist()) <= threshold  # the hard bound holds
            tg.cancel_scope.cancel()
    cut = [group for group in (*trained, *(g for e in events for g in e.groups)) if cut_tagged(group)]
    for group in cut:
        assert group.generation_seconds >= deadline, "cut before its deadline"
        expected = (
            Status.FINISHED if quorum is not None and len(group.trajectories) >= quorum else Status.FAILURE
        )
        assert group.status is expected
    assert buf.stats().total.cut_groups >= len(cut)
    assert_conserved(buf)


def test_the_docs_skyrl_example_runs() -> None:
    """The "Deadlines" example of docs/flow-control.md (the SkyRL hang and its fix) runs as printed."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).parent.parent / "docs" / "flow-control.md").read_text(encoding="utf-8")
    section = page[page.index("The SkyRL hang, and its fix") :]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None
    exec(compile(block.group(1), "docs/flow-control.md (Deadlines)", "exec"), {"__name__": "docs"})


# -- defects found by attacking the deadlines (each a regression test) -------------------------


async def test_a_straggler_that_on_evict_refills_inside_a_parked_sample_is_cut() -> None:
    """Defect (wedge): a parked sample woken to evict a stale group runs ``on_evict``, which
    refills a prompt (the README's pattern); the refill hangs. Admitting it asked the head sample
    to set its cut timer, but that sample was the one running (its wake-up was spent), and it
    re-parked with the timer it had: none, nothing was in flight when it parked. The refill was
    never cut and the sample waited for good."""
    buf: ReplayBuffer

    def refill(event: EvictionEvent) -> None:
        for group in event.groups:
            buf.add_prompt_nowait(f"re{group.uid}")  # at the clock; it hangs (nobody generates it)

    buf = make(max_off_policy_threshold=1, group_deadline_seconds=DEADLINE, on_evict=refill)
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.sample(5, 1))  # nothing in flight: no timer
            buf.put_group_nowait("old", [1], global_steps=0)  # stale at 5: the parked sample evicts it
            await anyio.sleep(DEADLINE + SLACK)
            assert waiting.returned, "the refill was never cut: the sample waits for good"
    assert waiting.result[0].uids == ["reold"]
    assert cut_tagged(waiting.result[0].groups[0])
    assert_conserved(buf)


async def test_a_median_that_appears_while_the_parked_sample_evicts_sets_its_timer() -> None:
    """Defect (wedge): a sample parked before the factor's median existed has no cut timer. The
    16th measured group finished while a failed group (``failure_strategy="evict"``) had already
    woken it: that wake-up evicted, got no batch, and re-parked without a timer, though the
    straggler now had a deadline. It was never cut and the sample waited for good."""
    generation = 0.3
    buf = make(group_deadline_factor=2.0, group_quorum=1, failure_strategy="evict")
    for index in range(15):
        buf.add_prompt_nowait(f"m{index}")
    await anyio.sleep(generation)
    for index in range(15):
        buf.mark_finished_nowait(f"m{index}")  # 15 measured, about 0.3 s each: no median yet
    for uid in ("slow", "failed", "m15"):
        buf.add_prompt_nowait(uid)
    buf.put_nowait("slow", "partial")  # it hangs: due at about 2 x 0.3 s once the median exists
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.sample(0, 17))  # no deadline yet: no timer
            buf.mark_failed_nowait("failed")  # wakes it, to evict
            buf.mark_finished_nowait("m15")  # the 16th measured: the median exists now
            await anyio.sleep(2 * generation + 2 * SLACK)
            assert waiting.returned, "the straggler was never cut: the sample waits for good"
    [cut] = [group for group in waiting.result[0].groups if group.uid == "slow"]
    assert cut_tagged(cut)
    assert_conserved(buf)


async def test_a_sample_that_becomes_the_head_and_evicts_sets_its_cut_timer() -> None:
    """Defect (wedge): a second sample queued behind the head has no cut timer (only the head
    has one). When the head returned, the turn passed to it with a wake-up because a stale group
    was there to evict; it evicted, got no batch and re-parked without a timer, so the straggler
    it waits for was never cut."""
    deadline = 0.5
    buf = make(max_off_policy_threshold=1, group_deadline_seconds=deadline, group_quorum=1)
    buf.add_prompt_nowait("slow", global_steps=5)  # it hangs
    buf.put_nowait("slow", "partial")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            first = await start_call(tg, lambda: buf.sample(0, 1))  # the head: its timer is slow's
            second = await start_call(tg, lambda: buf.sample(5, 1))  # queued: no timer of its own
            buf.put_group_nowait("x", [1], global_steps=0)  # the head takes it and leaves
            buf.put_group_nowait("y", [1], global_steps=0)  # stale at 5: the new head evicts it
            await anyio.sleep(deadline + SLACK)
            assert first.returned
            assert second.returned, "the straggler was never cut: the second sample waits for good"
    assert second.result[0].uids == ["slow"]
    assert_conserved(buf)


class NoDeadlineSubclass(ReplayBuffer):
    """A verl-style plugin (it overrides ``_select``) that configures no deadline."""

    def _select(self, candidates: Any, batch_size: int, global_steps: int, partition: str) -> Any:
        return super()._select(candidates, batch_size, global_steps, partition)


async def test_a_verl_style_subclass_without_a_deadline_has_no_deadlines() -> None:
    """Defect: whether a partition has deadlines asked whether ``group_deadline`` is overridden
    on the rule book a subclass's hooks put in front of the policy, which always defines it. So
    every verl-style subclass (``_select``, ``_is_stale`` or ``_must_wait_for``) had deadlines
    without configuring any: every admission woke the parked sample to evaluate for nothing,
    ``sample`` reported ``rollout/cut_*`` metrics, and every in-flight group entered the deadline
    heap (which, with no deadline to cut the oldest, kept ended groups behind it)."""
    metrics: dict[str, list[str]] = {}
    with anyio.fail_after(LIMIT):
        subclass = NoDeadlineSubclass(SamplerConfig(), status_log_interval=None)
        for name, buf in (("plain", make()), ("subclass", subclass)):
            async with anyio.create_task_group() as tg:
                waiting = await start_call(tg, partial(buf.sample, 0, 1))
                before = evaluations(buf)
                for index in range(10):
                    buf.add_prompt_nowait(f"g{index}")
                await settle()
                assert evaluations(buf) == before, f"{name}: admitting groups woke the sample for nothing"
                buf.mark_finished_nowait("g0")
                await settle()
            assert waiting.returned
            metrics[name] = sorted(waiting.result[1])
    assert not [key for key in metrics["subclass"] if "/rollout/cut" in key]
    assert metrics["subclass"] == metrics["plain"]
    # Configured, or answered by its policy, a subclass's deadlines cut as any buffer's do.
    answering = NumpyDeadline(SamplerConfig())
    answering.answer = 0.01
    for buf in (
        NoDeadlineSubclass(SamplerConfig(group_deadline_seconds=0.01), status_log_interval=None),
        NoDeadlineSubclass(policy=answering, status_log_interval=None),
    ):
        buf.add_prompt_nowait("g")
        await anyio.sleep(0.02)
        batch, cut_metrics = await buf.sample(0, 1, timeout=0)
        assert cut_tagged(batch.groups[0])
        assert cut_metrics["training/rollout/cut_groups"] == 1


class Payload:
    """A payload a test can hold a weak reference to."""


async def test_trained_groups_are_not_kept_alive_by_the_deadline_heap() -> None:
    """Defect (memory): the deadline heap was cleaned from its top only, so while one group stayed
    in flight within its deadline, every group admitted after it stayed in the heap once it ended,
    trajectories and all: the payloads of every trained group were kept alive for as long as the
    deadline (an hour of rollouts with ``group_deadline_seconds=3600``)."""
    buf = make(group_deadline_seconds=3600.0)
    buf.add_prompt_nowait("slow")  # one long generation, well within its deadline
    refs = []
    for index in range(1_000):
        uid = f"g{index}"
        buf.add_prompt_nowait(uid)
        payload = Payload()
        refs.append(weakref.ref(payload))
        buf.put_nowait(uid, payload)
        del payload
        buf.mark_finished_nowait(uid)
        batch, _ = buf.sample_nowait(0, 1)
        assert batch.uids == [uid]
        del batch  # trained: the buffer holds nothing of it now
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert alive <= 100, f"{alive} of 1000 trained groups' payloads are still alive"


def test_cutting_one_group_costs_the_same_with_many_groups_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect (performance): to find the overdue groups, a cut read (and filtered) the whole deadline
    heap, so with N groups in flight every sample that cut one cost O(N): with 50,000 in flight,
    milliseconds per sample instead of microseconds. Groups are admitted one clock unit apart and
    each sample finds exactly one more overdue; its cost must not grow with the groups in flight."""
    now = [0.0]
    patch_deadline_clock(monkeypatch, lambda: now[0])

    def seconds_per_cut(in_flight: int) -> float:
        buf = make(group_deadline_seconds=float(in_flight), max_off_policy_threshold=10**6)
        for index in range(in_flight):
            now[0] = float(index)
            buf.add_prompt_nowait(f"g{index}")
        spent = []
        for index in range(200):
            now[0] = float(in_flight + index)  # g{index} is due now, and only it
            started = time.perf_counter()
            with pytest.raises(BatchNotReadyError):
                buf.sample_nowait(0, in_flight)
            spent.append(time.perf_counter() - started)
        assert train_stats(buf).cut_groups == 200
        return statistics.median(spent)  # a noisy machine's pauses do not count

    few, many = min(seconds_per_cut(1_000) for _ in range(2)), seconds_per_cut(50_000)
    assert many < 10 * few, f"{many * 1e6:.0f} us per cut with 50,000 in flight, {few * 1e6:.0f} with 1,000"


async def test_a_cut_groups_producer_hears_group_cut_error_after_a_restore(tmp_path: Path) -> None:
    """Defect: a checkpoint keeps the uids of groups the buffer ended in flight, not why. After a
    restore, a producer that survived the restart (a Ray worker, a remote client) and writes to its
    cut group heard ``GroupEvictedError`` "evicted as stale" (an UnknownGroupError, not an
    InvalidTransitionError) for a group that was cut and trained, or a plain late write for a cut
    group still resident, instead of ``GroupCutError`` naming the deadline. The checkpoint keeps
    the reasons now (``evicted_reasons``), in files of both forms."""
    buf = make(group_deadline_seconds=DEADLINE, group_quorum=1)
    for uid in ("trained", "resident"):
        buf.add_prompt_nowait(uid)
        buf.put_nowait(uid, "partial")
    await anyio.sleep(DEADLINE * 1.5)
    batch, _ = await buf.sample(0, 1, timeout=0)  # cuts both, trains the first
    assert batch.uids == ["trained"]
    restored, _ = ReplayBuffer.restore(buf.checkpoint())
    await buf.save(tmp_path / "pickle.ckpt")
    codec = (lambda value: json.dumps(value).encode(), json.loads)
    await buf.save(tmp_path / "codec.ckpt", payload_codec=codec)
    from_pickle, _ = ReplayBuffer.restore(tmp_path / "pickle.ckpt")
    from_codec, _ = ReplayBuffer.restore(tmp_path / "codec.ckpt", payload_codec=codec)
    for each in (buf, restored, from_pickle, from_codec):
        for uid in ("trained", "resident"):
            with pytest.raises(GroupCutError, match="deadline"):
                each.put_nowait(uid, "late", session_id=1)


async def test_a_restore_keeps_the_measured_median_so_a_factor_deadline_still_cuts(tmp_path: Path) -> None:
    """Found by the hostile review: a restore dropped the measured generation times, so a factor
    deadline was off until 16 new groups finished: a server still dead after the restart wedged
    the run again. The checkpoint keeps each partition's window now."""
    buf = make(group_deadline_factor=2.0, group_quorum=1)
    for index in range(16):
        buf.add_prompt_nowait(f"fast{index}")
        buf.mark_finished_nowait(f"fast{index}")
    await buf.save(tmp_path / "window.ckpt")
    restored, _ = ReplayBuffer.restore(tmp_path / "window.ckpt")
    restored.add_prompt_nowait("stuck")
    restored.put_nowait("stuck", "partial")
    await anyio.sleep(0.05)  # far past twice a median of microseconds
    with anyio.fail_after(LIMIT):
        batch, _ = await restored.sample(0, 17)
    assert "stuck" in batch.uids
    assert restored.stats().total.cut_groups == 1


class NumpyDeadline(StalenessPolicy):
    """Answers the deadline as numpy computes it (a float32 median, an int64 setting)."""

    answer: Any = None

    def group_deadline(self, partition: str, median_generation_seconds: float | None) -> float | None:
        return self.answer  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["float32", "int64", "Fraction"])
async def test_a_deadline_hook_may_answer_any_real_number(kind: str) -> None:
    """Defect: ``group_deadline`` answers were checked as Python ints and floats only, so a policy
    that computes its deadline with numpy (``np.float32``, ``np.int64``: ``admission_batch_size``
    accepts numpy's integers) or a ``Fraction`` made every sample raise StalebufError."""
    import fractions

    import numpy as np

    config = SamplerConfig(group_deadline_seconds=60.0, group_quorum=1)
    policy = NumpyDeadline(config)
    answers = {"float32": np.float32(0.01), "int64": np.int64(1), "Fraction": fractions.Fraction(1, 100)}
    policy.answer = answers[kind]
    buf = ReplayBuffer(config, policy=policy, status_log_interval=None)
    buf.add_prompt_nowait("g")
    buf.put_nowait("g", "partial")
    await anyio.sleep(0.02 if kind != "int64" else 1.05)
    batch, _ = await buf.sample(0, 1, timeout=0)
    assert batch.uids == ["g"]
    assert cut_tagged(batch.groups[0])
    buf.add_prompt_nowait("h")  # in flight: each sample asks the hook
    for nonsense in (np.float32("nan"), np.float64(-1.0), np.int64(0), np.bool_(True), np.float32("inf")):
        policy.answer = nonsense
        with pytest.raises(StalebufError, match=r"group_deadline\('train', \.\.\.\) must return"):
            await buf.sample(0, 1, timeout=0)


def test_a_zero_median_generation_time_gives_no_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: groups that finish within one tick of the clock (a coarse ``time.monotonic()``:
    15.6 ms on Windows before Python 3.13; instant generations in a test) measure 0 s, and with
    half of the window at 0 the default policy answered ``factor * 0 = 0.0``, which the buffer
    refuses: every sample raised StalebufError naming ``StalenessPolicy.group_deadline``, the
    default rules. A median of 0 gives no deadline (a deadline of 0 would cut every group)."""
    now = [100.0]
    patch_deadline_clock(monkeypatch, lambda: now[0])
    buf = make(group_deadline_factor=3.0)
    for index in range(16):
        buf.add_prompt_nowait(f"g{index}")
        buf.mark_finished_nowait(f"g{index}")  # within one tick: 0 s measured
    buf.add_prompt_nowait("slow")
    now[0] += 1.0
    batch, _ = buf.sample_nowait(0, 16)
    assert len(batch) == 16
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(0, 1)
    assert resident_groups(buf)["slow"].in_flight  # no deadline: nothing is cut
    for index in range(16):  # measured times above 0: the median gives a deadline again
        buf.add_prompt_nowait(f"h{index}")
        now[0] += 0.01
        buf.mark_finished_nowait(f"h{index}")
    now[0] += 1.0
    batch, _ = buf.sample_nowait(0, 17)
    [cut] = [group for group in batch.groups if group.uid == "slow"]
    assert cut_tagged(cut)


@given(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 1e-9, 1e9]) | st.floats(0, 100), max_size=600))
def test_the_rolling_median_is_the_median_of_the_last_256_measured_times(times: list[float]) -> None:
    """The window is kept sorted as times come and go (a sort per finish cost 13 µs while a sample
    waited): its median equals a brute-force median of the last 256, and None before 16."""
    part = PartitionState("train", exempt=False, evict_failures=False, deadlines=True)
    for index, seconds in enumerate(times):
        part.record_generation(seconds)
        window = times[max(0, index + 1 - GENERATION_WINDOW) : index + 1]
        expected = statistics.median(window) if len(window) >= MEDIAN_AFTER else None
        assert part.median_generation() == expected


async def test_a_sample_whose_first_cut_leaves_it_short_parks_again_for_the_next_deadline() -> None:
    """A timed wait that fires, cuts one straggler, still has no batch and parks again: on asyncio
    the expired cancel scope cancels the waiter's bare future, which must be armed afresh (awaiting
    it again would raise CancelledError out of the sample). The second deadline then cuts the
    second straggler and the sample returns both."""
    buf = make(group_deadline_seconds=DEADLINE)  # no quorum: cut groups fail, and are sampleable
    buf.add_prompt_nowait("first")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            waiting = await start_call(tg, lambda: buf.sample(0, 2))
            await anyio.sleep(DEADLINE / 2)
            buf.add_prompt_nowait("second")  # its deadline comes half a deadline later
            await anyio.sleep(DEADLINE * 2 + 0.3)
            assert waiting.returned, waiting.error
    assert waiting.result[0].uids == ["first", "second"]
    assert [group.status for group in waiting.result[0].groups] == [Status.FAILURE] * 2
    assert buf.stats().total.cut_groups == 2
