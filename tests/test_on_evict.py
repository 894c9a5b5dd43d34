"""``on_evict`` callbacks that raise, close the buffer or call producers.

Whatever the callback does, from a sample that returns at once or from one parked and woken,
the buffer stays consistent (conservation holds, nothing is lost or sampled twice), the
exception surfaces to the caller, and groups the callback adds, finishes or fails are
handled in the same call. Every async test is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from _helpers import LIMIT, add_group, assert_conserved, make, resident_count, resident_uids, settle
from stalebuf import EvictionEvent, ReplayBuffer, SamplerConfig, Status
from stalebuf.errors import BufferClosedError, StalebufError, UnknownGroupError


class Boom(Exception):
    pass


@pytest.mark.anyio
async def test_raising_on_evict_fast_path_leaves_buffer_consistent() -> None:
    with anyio.fail_after(LIMIT):
        seen: list[EvictionEvent] = []

        def on_evict(event: EvictionEvent) -> None:
            seen.append(event)
            raise Boom(event.reason)

        buf = make(on_evict=on_evict, max_off_policy_threshold=1)
        add_group(buf, "old", 0)
        add_group(buf, "new1", 5)
        add_group(buf, "new2", 5)
        with pytest.raises(Boom):
            await buf.sample(5, 1)
        assert [g.uid for e in seen for g in e.groups] == ["old"]
        stats = buf.stats().total
        assert (stats.evicted_stale_groups, stats.sampled_groups, stats.finished) == (1, 0, 2)
        with pytest.raises(UnknownGroupError):
            buf.put_nowait("old", 1, session_id=9)
        assert_conserved(buf)
        batch, _ = await buf.sample(5, 2, timeout=0)  # nothing left to evict: no callback
        assert batch.uids == ["new1", "new2"]
        assert len(seen) == 1


@pytest.mark.anyio
async def test_raising_on_evict_in_a_waiter_passes_the_turn_on() -> None:
    """The head waiter's callback raises: it leaves the queue and the next waiter is served."""
    with anyio.fail_after(LIMIT):

        def on_evict(event: EvictionEvent) -> None:
            raise Boom(event.reason)

        buf = make(on_evict=on_evict, max_off_policy_threshold=1, failure_strategy="evict")
        results: list[Any] = []

        async def run(step: int, batch_size: int) -> None:
            try:
                results.append((await buf.sample(step, batch_size))[0].uids)
            except Boom as exc:
                results.append(f"boom:{exc}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 5, 1)
            await settle()
            tg.start_soon(run, 5, 1)
            await settle()
            add_group(buf, "bad", 5, status=Status.FAILURE)  # wakes the head, whose callback raises
            await settle()
            assert results == ["boom:failure"]
            add_group(buf, "good", 5)
        assert results == ["boom:failure", ["good"]]
        assert buf.stats().total.evicted_failure_groups == 1
        assert_conserved(buf)


@pytest.mark.anyio
async def test_on_evict_raising_for_both_reasons_reports_all_and_raises_the_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with anyio.fail_after(LIMIT):
        reasons: list[str] = []

        def on_evict(event: EvictionEvent) -> None:
            reasons.append(event.reason)
            raise Boom(event.reason)

        buf = make(on_evict=on_evict, max_off_policy_threshold=1, failure_strategy="evict")
        add_group(buf, "failed", 5, status=Status.FAILURE)
        add_group(buf, "stale", 0)
        add_group(buf, "fresh", 5)
        with caplog.at_level(logging.ERROR, logger="stalebuf"), pytest.raises(Boom, match="failure"):
            await buf.sample(5, 1)
        assert reasons == ["failure", "stale"]
        assert any("on_evict raised again" in r.getMessage() for r in caplog.records)
        stats = buf.stats().total
        assert (stats.evicted_failure_groups, stats.evicted_stale_groups, stats.finished) == (1, 1, 1)
        assert_conserved(buf)
        assert (await buf.sample(5, 1, timeout=0))[0].uids == ["fresh"]


def closing_buffer() -> ReplayBuffer:
    """A drop buffer whose on_evict closes it."""
    holder: list[ReplayBuffer] = []
    buf = make(on_evict=lambda event: holder[0].close(), max_off_policy_threshold=1)
    holder.append(buf)
    return buf


@pytest.mark.anyio
async def test_on_evict_that_closes_the_buffer_fast_path() -> None:
    with anyio.fail_after(LIMIT):
        buf = closing_buffer()
        add_group(buf, "stale", 0)
        add_group(buf, "fresh", 5)
        with pytest.raises(BufferClosedError):
            await buf.sample(5, 1)
        assert buf.closed
        assert buf.stats().total.evicted_stale_groups == 1
        assert set(resident_uids(buf)) == {"fresh"}, "close() inside on_evict lost or sampled a group"
        assert_conserved(buf)


@pytest.mark.anyio
async def test_on_evict_that_closes_the_buffer_from_a_parked_waiter() -> None:
    with anyio.fail_after(LIMIT):
        buf = closing_buffer()
        add_group(buf, "fresh", 5)
        outcomes: list[str] = []

        async def queued() -> None:
            try:
                await buf.sample(5, 2)
            except BufferClosedError:
                outcomes.append("closed")

        async with anyio.create_task_group() as tg:
            tg.start_soon(queued)
            await settle()
            tg.start_soon(queued)
            await settle()
            add_group(buf, "stale", 0)  # wakes the head: it evicts, the callback closes
        assert outcomes == ["closed", "closed"]
        assert set(resident_uids(buf)) == {"fresh"}
        assert buf.stats().total.waiting_samplers == 0
        assert_conserved(buf)


@pytest.mark.anyio
@pytest.mark.parametrize("parked", [False, True])
async def test_on_evict_may_refill_prompts_and_finish_fresh_groups(parked: bool) -> None:
    """The documented use: on_evict re-dispatches evicted prompts through the *_nowait producers."""
    with anyio.fail_after(LIMIT):
        refills: list[str] = []
        buf: ReplayBuffer

        def on_evict(event: EvictionEvent) -> None:
            for group in event.groups:
                uid = f"re{group.uid}"
                buf.add_prompt_nowait(uid, global_steps=event.global_steps, partition=event.partition)
                buf.put_nowait(uid, "again")
                buf.mark_finished_nowait(uid)  # a fresh group: s = 1
                refills.append(uid)

        buf = make(on_evict=on_evict, max_off_policy_threshold=1)
        if parked:
            results: list[list[str]] = []

            async def run() -> None:
                results.append((await buf.sample(4, 1))[0].uids)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await settle()
                assert buf.stats().total.waiting_samplers == 1
                add_group(buf, "stale", 0)  # wakes the parked sample, which evicts and refills
            uids = results[0]
        else:
            add_group(buf, "stale", 0)
            uids = (await buf.sample(4, 1))[0].uids
        assert refills == ["restale"]
        assert uids == ["restale"]
        assert_conserved(buf)
        assert buf.stats().total.admitted_groups == 2


@pytest.mark.anyio
async def test_put_group_nowait_from_on_evict_of_a_parked_sample() -> None:
    """on_evict of a parked ``sample`` refills with put_group_nowait: the same call returns the
    fresh group, a failed refill is evicted in the same call, and a refill into another
    partition wakes the sampler parked there."""
    with anyio.fail_after(LIMIT):
        events: list[tuple[str, str, list[str]]] = []
        buf: ReplayBuffer

        def on_evict(event: EvictionEvent) -> None:
            events.append((event.partition, event.reason, [g.uid for g in event.groups]))
            if event.reason == "stale":
                buf.put_group_nowait("bad", [0], global_steps=event.global_steps, status="failed")
                buf.put_group_nowait("fresh", [1, 2], global_steps=event.global_steps)
                buf.put_group_nowait("other", [3], global_steps=0, partition="val")

        buf = make(on_evict=on_evict, max_off_policy_threshold=1, failure_strategy="evict")
        results: dict[str, list[str]] = {}

        async def run(partition: str, step: int) -> None:
            results[partition] = (await buf.sample(step, 1, partition=partition))[0].uids

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "val", 0)
            tg.start_soon(run, "train", 5)
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            assert buf.stats().total.waiting_samplers == 2
            add_group(buf, "old", 0)  # stale at g=5: wakes the train sampler, which evicts it
        assert results == {"train": ["fresh"], "val": ["other"]}
        assert events == [("train", "stale", ["old"]), ("train", "failure", ["bad"])]
        assert buf.stats().total.waiting_samplers == 0
        assert_conserved(buf)


@pytest.mark.anyio
async def test_on_evict_cannot_smuggle_a_stale_group_into_a_drop_batch() -> None:
    """Regression: _evaluate evicted once, then selected a group on_evict had just finished."""
    with anyio.fail_after(LIMIT):
        buf: ReplayBuffer

        def on_evict(event: EvictionEvent) -> None:
            if "late" in buf:
                buf.mark_finished_nowait("late")  # in flight since step 0: s = 6 > T = 1

        buf = make(on_evict=on_evict, max_off_policy_threshold=1)
        add_group(buf, "late", 0, status=Status.RUNNING)
        add_group(buf, "old", 0)
        add_group(buf, "fresh", 5)
        batch, _ = await buf.sample(5, 1)
        assert batch.staleness.max() <= 1, f"drop returned {batch.uids} with staleness {batch.staleness}"


@pytest.mark.anyio
async def test_group_failed_inside_on_evict_of_a_parked_sample_is_evicted() -> None:
    """Regression: a wake-up sent during the head's own evaluation was discarded."""
    with anyio.fail_after(LIMIT):
        seen: list[tuple[str, list[str]]] = []
        buf: ReplayBuffer

        def on_evict(event: EvictionEvent) -> None:
            seen.append((event.reason, [g.uid for g in event.groups]))
            if "sibling" in buf:
                buf.mark_failed_nowait("sibling")  # e.g. abandon the rest of a failed batch

        buf = make(on_evict=on_evict, failure_strategy="evict")
        add_group(buf, "sibling", 0, status=Status.RUNNING)
        async with anyio.create_task_group() as tg:
            tg.start_soon(buf.sample, 0, 2)
            await settle()
            add_group(buf, "first", 0, status=Status.FAILURE)  # wakes the parked sample: it evicts "first"
            await settle()
            try:
                assert seen == [("failure", ["first"]), ("failure", ["sibling"])], seen
                assert buf.stats().total.failure == 0
            finally:
                tg.cancel_scope.cancel()


# -- on_evict that re-admits what it was just given (issue 10, item 7) --------------------------


class Runaway(Exception):
    """Raised by the test's own guard: the buffer let on_evict loop."""


def readmitting_buffer(reason: str, *, rounds: int = 100) -> tuple[ReplayBuffer, list[str]]:
    """A buffer whose on_evict puts every evicted group back as it was: at its dispatch step,
    failed again under "failure". A guard stops a runaway loop after ``rounds`` rounds."""
    seen: list[str] = []
    buf: ReplayBuffer

    def on_evict(event: EvictionEvent) -> None:
        seen.append(event.reason)
        if len(seen) > rounds:
            raise Runaway(f"{len(seen)} eviction rounds in one sample")
        for group in event.groups:
            status = "failed" if event.reason == "failure" else "finished"
            buf.put_group_nowait(group.uid, ["again"], global_steps=group.global_steps, status=status)

    buf = make(on_evict=on_evict, max_off_policy_threshold=1, failure_strategy="evict")
    if reason == "stale":
        add_group(buf, "loop", 0)  # stale at g=5 (s = 6 > T = 1)
    else:
        add_group(buf, "loop", 5, status=Status.FAILURE)
    add_group(buf, "fresh", 5)
    return buf, seen


@pytest.mark.anyio
@pytest.mark.parametrize("reason", ["stale", "failure"])
async def test_on_evict_readmitting_the_evicted_group_is_refused_not_looped(reason: str) -> None:
    with anyio.fail_after(LIMIT):
        buf, seen = readmitting_buffer(reason)
        with pytest.raises(StalebufError, match="on_evict re-admitted") as info:
            await buf.sample(5, 1)
        assert type(info.value) is StalebufError
        assert "'train'" in str(info.value)
        assert seen == [reason], "the buffer evicted the re-admitted group again"
        assert "loop" in buf, "the re-admitted group must stay in the buffer"
        assert "fresh" in buf, "a refused sample took a group"
        assert_conserved(buf)
        stats = buf.stats().total
        assert (stats.admitted_groups, stats.sampled_groups, stats.waiting_samplers) == (3, 0, 0)


@pytest.mark.anyio
async def test_on_evict_readmitting_in_a_parked_sample_is_refused_and_the_queue_moves() -> None:
    """The woken head is refused; the next waiter, whose on_evict no longer re-admits, is served."""
    with anyio.fail_after(LIMIT):
        readmitted: set[str] = set()
        heard: list[list[str]] = []
        buf: ReplayBuffer

        def on_evict(event: EvictionEvent) -> None:
            heard.append([g.uid for g in event.groups])
            for group in event.groups:
                if group.uid not in readmitted:  # once per uid: a "retry" that repeats the mistake
                    readmitted.add(group.uid)
                    buf.put_group_nowait(group.uid, ["again"], global_steps=group.global_steps)

        buf = make(on_evict=on_evict, max_off_policy_threshold=1)
        add_group(buf, "fresh", 5)
        outcomes: list[Any] = []

        async def run(batch_size: int) -> None:
            try:
                outcomes.append((await buf.sample(5, batch_size))[0].uids)
            except StalebufError as exc:
                outcomes.append(type(exc).__name__)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 2)
            await settle()
            tg.start_soon(run, 1)
            await settle()
            assert buf.stats().total.waiting_samplers == 2
            add_group(buf, "late", 0)  # stale at g=5: wakes the head, whose on_evict re-admits it
        assert outcomes == ["StalebufError", ["fresh"]], outcomes
        assert heard == [["late"], ["late"]]  # the head's round, then the next waiter's
        assert "late" not in buf
        assert buf.stats().total.waiting_samplers == 0
        assert_conserved(buf)


@pytest.mark.anyio
async def test_on_evict_readmitting_at_the_current_step_is_served_in_the_same_call() -> None:
    """The legitimate refill: the same uid, re-dispatched at the sample's step, is fresh."""
    with anyio.fail_after(LIMIT):
        buf: ReplayBuffer

        def on_evict(event: EvictionEvent) -> None:
            for group in event.groups:
                buf.put_group_nowait(group.uid, ["again"], global_steps=event.global_steps)

        buf = make(on_evict=on_evict, max_off_policy_threshold=1)
        add_group(buf, "old", 0)
        batch, _ = await buf.sample(5, 1)
        assert batch.uids == ["old"]
        assert [t.payload for t in batch.groups[0].trajectories] == ["again"]
        assert_conserved(buf)


# -- on_evict raising a BaseException (issue 10, item 18) --------------------------------------


class Abort(BaseException):
    """Not an Exception: like KeyboardInterrupt or a backend's cancellation."""


@pytest.mark.anyio
@pytest.mark.parametrize("error", [KeyboardInterrupt, Abort])
async def test_on_evict_raising_a_base_exception_still_hears_of_every_eviction(
    error: type[BaseException],
) -> None:
    with anyio.fail_after(LIMIT):
        heard: list[tuple[str, list[str]]] = []

        def on_evict(event: EvictionEvent) -> None:
            heard.append((event.reason, [g.uid for g in event.groups]))
            if len(heard) == 1:
                raise error("stop")

        buf = make(on_evict=on_evict, max_off_policy_threshold=1, failure_strategy="evict")
        add_group(buf, "failed", 5, status=Status.FAILURE)
        add_group(buf, "stale", 0)
        add_group(buf, "fresh", 5)
        with pytest.raises(error):
            await buf.sample(5, 1)
        assert heard == [("failure", ["failed"]), ("stale", ["stale"])], "an evicted group went unreported"
        stats = buf.stats().total
        assert (stats.evicted_failure_groups, stats.evicted_stale_groups, stats.finished) == (1, 1, 1)
        assert_conserved(buf)
        assert (await buf.sample(5, 1, timeout=0))[0].uids == ["fresh"]


# -- on_evict that re-admits stale groups under new uids: the bound on rounds in a row ------------


@pytest.mark.parametrize("pattern", ["alternating uids", "fresh uids"])
def test_on_evict_re_admitting_stale_groups_under_new_uids_is_bounded(pattern: str) -> None:
    """Defect (issue 10, item 7: "Bound the eviction rounds of one sample ... raise a clear
    StalebufError naming the cause, with the buffer consistent"): an on_evict that re-admits
    every stale group under another uid kept ``sample`` looping forever. The guard turns an
    endless loop into a test failure."""
    rounds = 0

    def on_evict(event: Any) -> None:
        nonlocal rounds
        rounds += 1
        if rounds > 5_000:
            raise AssertionError("sample looped over eviction rounds without bound")
        for group in event.groups:
            uid = ("b" if group.uid == "a" else "a") if pattern == "alternating uids" else f"x{rounds}"
            buf.put_group_nowait(uid, [1], global_steps=0)

    buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=1), on_evict=on_evict)
    buf.put_group_nowait("a", [1], global_steps=0)
    with pytest.raises(StalebufError):
        buf.sample_nowait(5, 1)
    total = buf.stats().total
    assert total.admitted_groups == resident_count(buf) + total.sampled_groups + total.evicted_stale_groups


def test_on_evict_may_retry_a_stale_group_under_new_uids_a_few_times() -> None:
    """The bound counts rounds in a row: an on_evict that re-admits at the stale step a few
    times and then stops is served, every round reported (the bound must not refuse a retry
    that ends)."""
    retries: list[str] = []

    def on_evict(event: Any) -> None:
        if len(retries) < 3:
            retries.append(f"r{len(retries)}")
            buf.put_group_nowait(retries[-1], [1], global_steps=0)

    buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=1), on_evict=on_evict)
    buf.put_group_nowait("a", [1], global_steps=0)
    buf.put_group_nowait("fresh", [1], global_steps=5)
    batch, _ = buf.sample_nowait(5, 1)
    assert batch.uids == ["fresh"]
    assert buf.stats().total.evicted_stale_groups == 4  # "a" and its three retries
    assert resident_count(buf) == 0


def test_the_readmission_bound_is_not_reset_by_groups_on_evict_added_two_rounds_back() -> None:
    """Defect: the count of rounds in a row restarted at each round whose evicted group
    on_evict had added during this sample but finished a round after adding it (so it was not
    from "the round before"), and ``sample`` never returned (the guard stops it at 5,000
    rounds)."""
    rounds: list[str] = []
    pending: list[str] = []
    buf: ReplayBuffer

    def on_evict(event: EvictionEvent) -> None:
        rounds.append(event.reason)
        if len(rounds) > 5_000:
            raise Runaway(f"{len(rounds)} eviction rounds in one sample")
        if pending:  # finish the one added in the round before: stale, evicted next round
            uid = pending[-1]
            buf.mark_running_nowait(uid)
            buf.put_nowait(uid, 1)
            buf.mark_finished_nowait(uid)
        pending.append(f"p{len(rounds)}")
        buf.add_prompt_nowait(pending[-1], global_steps=0)  # stale, but in flight: kept for now
        if len(rounds) == 1:
            add_group(buf, "kick", 0)  # stale and finished: evicted in round 2

    buf = make(on_evict=on_evict, max_off_policy_threshold=1)
    add_group(buf, "old", 0)  # stale at g=5
    add_group(buf, "fresh", 5)
    with pytest.raises(StalebufError, match="rounds in a row"):
        buf.sample_nowait(5, 1)
    assert len(rounds) < 5_000
    assert "fresh" in buf
