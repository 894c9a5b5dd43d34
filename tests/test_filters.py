"""Group filters (issue 23, first part): ``ReplayBuffer(config, filters=[...])``.

Every expected value below comes from the issue's contract, never from the code under test:
a filter runs once, synchronously, when a group becomes FINISHED (never on failure, never in an
exempt partition), in order, the first False filtering the group; ``bool(result)`` decides and
None is an error; a filtered group is evicted at once, reported to ``on_evict`` as
``reason="filtered"`` inside the call that finished it (``global_steps``: the partition's
dispatch clock), counted in ``evicted_filtered_*`` (conservation), and frees its admission slot
at once; filters fail open (counted, logged at most once per filter per 60 s); the metrics
``filter_groups/evicted_samples|pass_rate|errors``; the built-ins ``zero_variance`` and
``min_trajectories``; ``filter_groups_metric``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest

from _helpers import (
    LIMIT,
    assert_conserved,
    patch_deadline_clock,
    patch_filter_clock,
    resident_uids,
    settle,
    start_call,
    train_stats,
)
from stalebuf import (
    ConfigError,
    EvictionEvent,
    Group,
    ReplayBuffer,
    SamplerConfig,
    StalebufError,
    Status,
)
from stalebuf.errors import GroupEvictedError
from stalebuf.filters import min_trajectories, zero_variance

pytestmark = pytest.mark.anyio

PREFIX = "training"


def build(
    filters: Sequence[Callable[[Group], object]] = (),
    on_evict: Callable[[EvictionEvent], object] | None = None,
    **config: Any,
) -> ReplayBuffer:
    return ReplayBuffer(SamplerConfig(**config), filters=filters, on_evict=on_evict, status_log_interval=None)


def drop_uids(*uids: str) -> Callable[[Group], bool]:
    """A filter that rejects exactly the groups ``uids``."""

    def keep(group: Group) -> bool:
        return group.uid not in uids

    return keep


class Recorder:
    """An ``on_evict`` that records every event (and what the buffer held while it ran)."""

    def __init__(self) -> None:
        self.events: list[EvictionEvent] = []
        self.buf: ReplayBuffer | None = None
        self.resident_when_called: list[list[str]] = []

    def __call__(self, event: EvictionEvent) -> None:
        self.events.append(event)
        if self.buf is not None:
            self.resident_when_called.append(resident_uids(self.buf))

    def filtered(self) -> list[str]:
        return [group.uid for event in self.events if event.reason == "filtered" for group in event.groups]


def rewards(*values: object) -> list[dict[str, object]]:
    return [{"r": value} for value in values]


# -- when filters run -------------------------------------------------------------------------


async def test_a_rejected_group_is_evicted_at_once_and_reported_inside_the_finishing_call() -> None:
    recorder = Recorder()
    buf = build([drop_uids("bad")], recorder)
    recorder.buf = buf
    with anyio.fail_after(LIMIT):
        with pytest.raises(TimeoutError):
            await buf.sample(3, 1, timeout=0)  # the dispatch clock is 3 now
        buf.add_prompt_nowait("bad", global_steps=2)
        buf.mark_running_nowait("bad")
        buf.put_nowait("bad", "p0", session_id=0)
        buf.put_nowait("bad", "p1", session_id=1)
        assert recorder.events == []
        buf.mark_finished_nowait("bad")
        # inside the call, after the state change: the group was already gone
        assert [event.reason for event in recorder.events] == ["filtered"]
        event = recorder.events[0]
        assert (event.partition, event.global_steps) == ("train", 3)  # the partition's dispatch clock
        (group,) = event.groups
        assert (group.uid, group.status, group.dispatch_step) == ("bad", Status.FINISHED, 2)
        assert [t.payload for t in group.trajectories] == ["p0", "p1"]
        assert recorder.resident_when_called == [[]]
        assert "bad" not in buf
        stats = train_stats(buf)
        assert (stats.evicted_filtered_groups, stats.evicted_filtered_trajectories) == (1, 2)
        assert (stats.groups, stats.trajectories, stats.admitted_groups) == (0, 0, 1)
        assert_conserved(buf)


async def finish_by_mark(buf: ReplayBuffer, uid: str) -> None:
    buf.add_prompt_nowait(uid)
    buf.put_nowait(uid, "x", session_id=0)
    buf.put_nowait(uid, "y", session_id=1)
    await buf.mark_finished(uid)


async def finish_by_put_group(buf: ReplayBuffer, uid: str) -> None:
    await buf.put_group(uid, ["x", "y"])  # the fast path: a new group, default keys


async def finish_by_put_group_tagged(buf: ReplayBuffer, uid: str) -> None:
    await buf.put_group(uid, ["x", "y"], trajectory_tags=[{"r": 1}, {"r": 0}])  # the general path


async def finish_by_put_group_into_open(buf: ReplayBuffer, uid: str) -> None:
    buf.add_prompt_nowait(uid)
    buf.mark_running_nowait(uid)
    await buf.put_group(uid, ["x", "y"])


async def finish_by_rollout(buf: ReplayBuffer, uid: str) -> None:
    async with buf.rollout(uid) as group:
        group.put_nowait("x", session_id=0)
        group.put_nowait("y", session_id=1)


async def finish_by_nowait_put_group(buf: ReplayBuffer, uid: str) -> None:
    buf.put_group_nowait(uid, ("x", "y"))


FINISHING_PATHS = {
    "mark_finished": finish_by_mark,
    "put_group": finish_by_put_group,
    "put_group-tagged": finish_by_put_group_tagged,
    "put_group-into-open": finish_by_put_group_into_open,
    "put_group_nowait": finish_by_nowait_put_group,
    "rollout": finish_by_rollout,
}


@pytest.mark.parametrize("admission", [None, 1])
@pytest.mark.parametrize("path", sorted(FINISHING_PATHS))
async def test_every_call_that_finishes_a_group_runs_the_filters(path: str, admission: int | None) -> None:
    seen: list[str] = []

    def reject(group: Group) -> bool:
        seen.append(group.uid)
        assert group.status is Status.FINISHED
        assert len(group.trajectories) == 2
        return False

    recorder = Recorder()
    buf = build([reject], recorder, admission_batch_size=admission, max_off_policy_threshold=1)
    with anyio.fail_after(LIMIT):
        for uid in ("one", "two", "three"):  # with b=1 each filtered group must free its slot
            await FINISHING_PATHS[path](buf, uid)
        assert seen == ["one", "two", "three"]  # once each
        assert recorder.filtered() == ["one", "two", "three"]
        stats = train_stats(buf)
        assert (stats.evicted_filtered_groups, stats.evicted_filtered_trajectories) == (3, 6)
        assert stats.groups == 0
        if admission is not None:
            assert buf.free_slots() == 1
        assert_conserved(buf)


async def test_a_group_cut_at_its_deadline_as_finished_is_filtered(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    patch_deadline_clock(monkeypatch, lambda: now[0])
    recorder = Recorder()
    buf = build([drop_uids("slow")], recorder, group_deadline_seconds=5.0, group_quorum=1)
    with anyio.fail_after(LIMIT):
        buf.add_prompt_nowait("slow")
        buf.mark_running_nowait("slow")
        buf.put_nowait("slow", "x")
        now[0] = 10.0
        with pytest.raises(TimeoutError):
            await buf.sample(0, 1, timeout=0)  # cuts it: FINISHED with its one trajectory (quorum 1)
        assert recorder.filtered() == ["slow"]
        assert train_stats(buf).evicted_filtered_groups == 1
        assert_conserved(buf)


@pytest.mark.parametrize("how", ["mark_failed", "put_group-failed", "cut-below-quorum"])
async def test_a_failed_group_is_never_filtered(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    patch_deadline_clock(monkeypatch, lambda: now[0])
    calls: list[str] = []

    def reject(group: Group) -> bool:
        calls.append(group.uid)
        return False

    buf = build([reject], group_deadline_seconds=5.0, group_quorum=2)
    with anyio.fail_after(LIMIT):
        if how == "mark_failed":
            buf.add_prompt_nowait("g")
            buf.put_nowait("g", "x")
            buf.mark_failed_nowait("g")
        elif how == "put_group-failed":
            await buf.put_group("g", ["x"], status="failed")
        else:
            buf.add_prompt_nowait("g")
            buf.put_nowait("g", "x")
            now[0] = 10.0
            with pytest.raises(TimeoutError):
                await buf.sample(0, 5, timeout=0)
        assert calls == []
        stats = train_stats(buf)
        assert (stats.failure, stats.evicted_filtered_groups) == (1, 0)
        batch, _ = await buf.sample(0, 1, timeout=0)  # failure_strategy="sample": trained as failed
        assert batch.uids == ["g"]


async def test_filters_run_in_order_and_the_first_false_stops_the_rest() -> None:
    calls: list[str] = []

    def named(name: str, verdict: object) -> Callable[[Group], object]:
        def run(group: Group) -> object:
            calls.append(f"{name}:{group.uid}")
            return verdict if group.uid == "bad" else True

        return run

    buf = build([named("f1", True), named("f2", False), named("f3", False)])
    with anyio.fail_after(LIMIT):
        await buf.put_group("good", ["x"])
        await buf.put_group("bad", ["x"])
        assert calls == ["f1:good", "f2:good", "f3:good", "f1:bad", "f2:bad"]
        assert resident_uids(buf) == ["good"]


@pytest.mark.parametrize(
    ("verdict", "kept"),
    [(0, False), ("", False), ([], False), (0.0, False), (1, True), ("no", True), ([0], True), (2.5, True)],
)
async def test_the_truth_of_the_result_decides(verdict: object, kept: bool) -> None:
    buf = build([lambda group: verdict])
    with anyio.fail_after(LIMIT):
        await buf.put_group("g", ["x"])
        assert ("g" in buf) is kept
        stats = train_stats(buf)
        assert (stats.evicted_filtered_groups, stats.filter_errors) == (int(not kept), 0)


async def test_an_exempt_partition_is_never_filtered() -> None:
    calls: list[str] = []

    def reject(group: Group) -> bool:
        calls.append(group.uid)
        return False

    buf = build([reject])  # "val" is exempt by default
    with anyio.fail_after(LIMIT):
        await buf.put_group("v1", ["x"], partition="val")
        buf.add_prompt_nowait("v2", partition="val")
        buf.put_nowait("v2", "x")
        buf.mark_finished_nowait("v2")
        assert calls == []
        batch, metrics = await buf.sample(0, 2, partition="val", timeout=0)
        assert batch.uids == ["v1", "v2"]
        assert not any("filter_groups" in key for key in metrics)
        val = buf.stats().partitions["val"]
        assert (val.evicted_filtered_groups, val.filter_errors) == (0, 0)


# -- a filtered uid ----------------------------------------------------------------------------


async def test_a_later_write_to_a_filtered_group_says_it_was_filtered_and_add_prompt_starts_anew() -> None:
    buf = build([drop_uids("g")])
    buf.add_prompt_nowait("g")
    buf.put_nowait("g", "x")
    buf.mark_finished_nowait("g")
    for write in (
        lambda: buf.put_nowait("g", "late", session_id=1),
        lambda: buf.mark_finished_nowait("g"),
        lambda: buf.mark_failed_nowait("g"),
        lambda: buf.mark_running_nowait("g"),
    ):
        with pytest.raises(GroupEvictedError, match="filtered"):
            write()
    buf.add_prompt_nowait("g")  # a new group under the uid
    assert train_stats(buf).pending == 1
    buf.put_nowait("g", "fresh")
    assert train_stats(buf).admitted_groups == 2
    assert_conserved(buf)


async def test_a_group_written_whole_and_filtered_is_remembered_as_filtered() -> None:
    buf = build([drop_uids("g")])
    with anyio.fail_after(LIMIT):
        await buf.put_group("g", ["x", "y"])
        with pytest.raises(GroupEvictedError, match="filtered"):
            buf.put_nowait("g", "late")
        with pytest.raises(GroupEvictedError, match="filtered"):
            buf.mark_finished_nowait("g")
        buf.add_prompt_nowait("g")
        assert train_stats(buf).pending == 1
        assert_conserved(buf)


# -- admission: the slot refund -----------------------------------------------------------------


async def test_a_filtered_group_frees_its_slot_and_wakes_the_waiting_producer_of_its_tag() -> None:
    buf = build([drop_uids("first")], max_off_policy_threshold=1, admission_batch_size=1)
    with anyio.fail_after(LIMIT):
        buf.add_prompt_nowait("first")  # the only slot of step 0
        assert buf.full()
        async with anyio.create_task_group() as tg:
            waiter = await start_call(tg, lambda: buf.add_prompt("second"))
            assert not waiter.done
            assert train_stats(buf).waiting_producers == 1
            buf.put_nowait("first", "x")
            buf.mark_finished_nowait("first")  # filtered: its slot is free at once
            await settle()
            assert waiter.returned, "the filtered group's slot did not wake the waiting producer"
        assert resident_uids(buf) == ["second"]
        assert buf.full()  # admitted at step 0, in the freed slot
        assert train_stats(buf).waiting_producers == 0
        assert_conserved(buf)


@pytest.mark.parametrize("on_evict_raises", [False, True])
async def test_a_filtered_group_that_held_the_wait_gate_wakes_the_parked_sample(
    on_evict_raises: bool,
) -> None:
    """Defect (found by the filter simulation): finishing an in-flight group that a filter then
    evicted never woke a ``sample`` parked on the wait gate that group held, so the trainer
    hung although a batch was ready; also when ``on_evict`` raises from the finishing call."""

    def report(event: EvictionEvent) -> None:
        if on_evict_raises:
            raise RuntimeError("on_evict failed")

    buf = build([zero_variance("s")], report, max_off_policy_threshold=2, max_off_policy_strategy="wait")
    with anyio.fail_after(LIMIT):
        buf.add_prompt_nowait("old", global_steps=0)
        buf.mark_running_nowait("old")
        await buf.put_group("new", ["a", "b"], global_steps=1, trajectory_tags=[{"s": 0}, {"s": 1}])
        async with anyio.create_task_group() as tg:
            sampler = await start_call(tg, lambda: buf.sample(1, 1))
            assert not sampler.done, "the in-flight 'old' (s = 2 at step 1) must hold the gate"
            for index in (0, 1):
                buf.put_nowait("old", "x", index=index, tags={"s": 7})
            if on_evict_raises:
                with pytest.raises(RuntimeError, match="on_evict failed"):
                    buf.mark_finished_nowait("old")
            else:
                buf.mark_finished_nowait("old")  # all scores equal: filtered, the gate opens
            await settle()
            assert sampler.returned, "the parked sample was not woken when the gate opened"
        batch, _ = sampler.result
        assert [g.uid for g in batch.groups] == ["new"]
        assert_conserved(buf)


async def test_with_admission_producers_keep_going_until_b_groups_per_step_survive() -> None:
    """The point of the refund: at b=2 with half the groups filtered, four groups fit in step 0."""
    buf = build([zero_variance("r")], max_off_policy_threshold=1, admission_batch_size=2)
    with anyio.fail_after(LIMIT):
        for uid, scores, free in (("s1", (1, 1), 2), ("k1", (1, 0), 2), ("s2", (0, 0), 1), ("k2", (0, 1), 1)):
            assert buf.free_slots() == free  # a filtered group gave its slot back at once
            buf.put_group_nowait(uid, ["a", "b"], trajectory_tags=rewards(*scores))
        assert buf.full()
        batch, metrics = await buf.sample(0, 2, timeout=0)
        assert batch.uids == ["k1", "k2"]
        assert metrics[f"{PREFIX}/filter_groups/evicted_samples"] == 2
        assert metrics[f"{PREFIX}/filter_groups/pass_rate"] == 0.5


# -- on_evict ------------------------------------------------------------------------------------


class CallbackError(Exception):
    pass


@pytest.mark.parametrize("path", ["mark_finished", "put_group", "put_group-tagged", "rollout"])
async def test_on_evict_raising_propagates_from_the_finishing_call_and_the_group_is_evicted(
    path: str,
) -> None:
    def explode(event: EvictionEvent) -> None:
        raise CallbackError(event.reason)

    buf = build([drop_uids("g")], explode, admission_batch_size=1)
    with anyio.fail_after(LIMIT):
        with pytest.raises(CallbackError, match="filtered"):
            await FINISHING_PATHS[path](buf, "g")
        assert "g" not in buf
        stats = train_stats(buf)
        assert (stats.groups, stats.evicted_filtered_groups) == (0, 1)
        assert buf.free_slots() == 1
        with pytest.raises(GroupEvictedError, match="filtered"):
            buf.put_nowait("g", "late")
        assert_conserved(buf)


async def test_refills_that_are_filtered_again_are_served_by_a_loop_not_by_recursion() -> None:
    depth: list[int] = []
    refills = [0]
    buf: ReplayBuffer

    def refill(event: EvictionEvent) -> None:
        depth.append(len_stack())
        if refills[0] < 500:
            refills[0] += 1
            buf.put_group_nowait(f"r{refills[0]}", ["x"])  # filtered again at once

    buf = build([lambda group: group.uid == "keep"], refill)
    with anyio.fail_after(LIMIT):
        await buf.put_group("g", ["x"])
        assert refills[0] == 500
        assert len(depth) == 501  # every filtered group reported, once
        assert max(depth) == min(depth), "on_evict ran nested: refills recurse"
        assert train_stats(buf).evicted_filtered_groups == 501
        assert_conserved(buf)


def len_stack() -> int:
    frame, count = sys._getframe(1), 0
    while frame is not None:
        frame, count = frame.f_back, count + 1  # type: ignore[assignment]
    return count


async def test_endless_filtered_refills_stop_with_an_error_not_a_recursion_error() -> None:
    """5,000 refills in a row, each filtered again: bounded (the re-admission bound of sample),
    raised from the call that finished the first group, with every group counted."""
    refills = [0]
    buf: ReplayBuffer

    def refill(event: EvictionEvent) -> None:
        if refills[0] < 5000:
            refills[0] += 1
            buf.put_group_nowait(f"r{refills[0]}", ["x"])

    buf = build([lambda group: False], refill)
    limit = sys.getrecursionlimit()
    with anyio.fail_after(LIMIT):
        with pytest.raises(StalebufError) as info:
            await buf.put_group("g", ["x"])
        assert not isinstance(info.value, RecursionError)
        assert "filtered" in str(info.value)
        assert refills[0] < 5000  # it stopped before the 5,000 refills
        assert sys.getrecursionlimit() == limit
        stats = train_stats(buf)
        assert stats.groups == 0
        assert stats.evicted_filtered_groups == refills[0] + 1
        assert_conserved(buf)
        # the buffer works afterwards
        refills[0] = 5000
        buf.add_prompt_nowait("after")
        assert "after" in buf


async def test_on_evict_raising_after_a_refill_still_delivers_the_refills_event() -> None:
    """Defect: when ``on_evict`` refilled (its refill filtered again, so queued) and then raised,
    the refill's "filtered" event stayed queued: it was not delivered by the call that filtered
    it but by whichever later call filtered a group next (or never). Every event must be
    delivered before the error propagates, as ``sample`` does."""
    delivered: list[str] = []
    buf: ReplayBuffer

    def refill_then_raise(event: EvictionEvent) -> None:
        delivered.extend(group.uid for group in event.groups)
        if event.groups[0].uid == "g":
            buf.put_group_nowait("refill", ["x"])  # filtered again: queued behind this call
            raise CallbackError("after refilling")

    buf = build([lambda group: False], refill_then_raise)
    with anyio.fail_after(LIMIT):
        with pytest.raises(CallbackError):
            await buf.put_group("g", ["x"])
        assert delivered == ["g", "refill"]
        await buf.put_group("later", ["x"])
        assert delivered == ["g", "refill", "later"]


# -- fail-open -----------------------------------------------------------------------------------


async def test_a_raising_filter_keeps_the_group_and_the_later_filters_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    later: list[str] = []

    def broken(group: Group) -> bool:
        raise RuntimeError("boom in the filter")

    def second(group: Group) -> bool:
        later.append(group.uid)
        return group.uid != "rejected"

    buf = build([broken, second])
    with anyio.fail_after(LIMIT), caplog.at_level(logging.ERROR, logger="stalebuf"):
        await buf.put_group("kept", ["x"])
        await buf.put_group("rejected", ["x"])  # the later filter still rejects it
        assert later == ["kept", "rejected"]
        assert resident_uids(buf) == ["kept"]
        stats = train_stats(buf)
        assert (stats.filter_errors, stats.evicted_filtered_groups) == (2, 1)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "stalebuf"]
        assert len(errors) == 1  # once per filter per 60 s
        message = errors[0].getMessage()
        assert "broken" in message
        assert "'kept'" in message
        batch, metrics = await buf.sample(0, 1, timeout=0)
        assert batch.uids == ["kept"]
        assert metrics[f"{PREFIX}/filter_groups/errors"] == 2
        await buf.put_group("next", ["x"])
        _, metrics = await buf.sample(0, 1, timeout=0)
        assert metrics[f"{PREFIX}/filter_groups/errors"] == 1  # since the previous batch only
        assert train_stats(buf).filter_errors == 3  # cumulative


async def test_a_filter_returning_none_is_an_error_that_keeps_the_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def forgot_return(group: Group) -> None:
        group.uid.upper()

    buf = build([forgot_return])
    with anyio.fail_after(LIMIT), caplog.at_level(logging.ERROR, logger="stalebuf"):
        await buf.put_group("g", ["x"])
        assert "g" in buf
        stats = train_stats(buf)
        assert (stats.filter_errors, stats.evicted_filtered_groups) == (1, 0)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1
        assert "forgot_return" in errors[0]
        assert "None" in errors[0]
        assert "'g'" in errors[0]
        _, metrics = await buf.sample(0, 1, timeout=0)
        assert metrics[f"{PREFIX}/filter_groups/errors"] == 1
        assert metrics[f"{PREFIX}/filter_groups/pass_rate"] == 1.0


async def test_the_error_line_is_logged_at_most_once_per_filter_per_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    patch_filter_clock(monkeypatch, lambda: now[0])

    def first(group: Group) -> bool:
        raise ValueError("first broke")

    def second(group: Group) -> None:
        return None

    buf = build([first, second])
    with anyio.fail_after(LIMIT), caplog.at_level(logging.ERROR, logger="stalebuf"):

        def lines() -> list[str]:
            records = caplog.records
            return [r.getMessage() for r in records if r.levelno == logging.ERROR and r.name == "stalebuf"]

        await buf.put_group("g1", ["x"])
        assert len(lines()) == 2  # one per filter
        now[0] += 59.0
        await buf.put_group("g2", ["x"])
        assert len(lines()) == 2
        now[0] += 1.5  # 60.5 s after the first lines
        await buf.put_group("g3", ["x"])
        assert len(lines()) == 4
        assert "'g3'" in lines()[2]
        assert "'g3'" in lines()[3]
        assert train_stats(buf).filter_errors == 6  # every error counted, logged or not


# -- metrics -------------------------------------------------------------------------------------


async def test_evicted_samples_counts_the_groups_filtered_since_the_previous_returned_batch() -> None:
    buf = build([zero_variance("r")])
    with anyio.fail_after(LIMIT):
        for uid in ("s1", "s2", "s3"):
            await buf.put_group(uid, ["a", "b"], trajectory_tags=rewards(1, 1))
        with pytest.raises(TimeoutError):  # a sample that returns nothing does not start a period
            await buf.sample(0, 1, timeout=0)
        await buf.put_group("k1", ["a", "b"], trajectory_tags=rewards(1, 0))
        _, metrics = await buf.sample(0, 1, timeout=0)
        assert metrics[f"{PREFIX}/filter_groups/evicted_samples"] == 3
        assert metrics[f"{PREFIX}/filter_groups/pass_rate"] == 0.25
        assert f"{PREFIX}/filter_groups/errors" not in metrics  # only when non-zero
        await buf.put_group("k2", ["a", "b"], trajectory_tags=rewards(0, 1))
        _, metrics = await buf.sample(0, 1, timeout=0)
        assert metrics[f"{PREFIX}/filter_groups/evicted_samples"] == 0
        assert metrics[f"{PREFIX}/filter_groups/pass_rate"] == 2 / 5


async def test_the_pass_rate_covers_the_last_256_judged_groups_and_is_absent_before_any() -> None:
    buf = build([drop_uids(*(f"d{i}" for i in range(100)))], exempt_partitions=frozenset({"val"}))
    with anyio.fail_after(LIMIT):
        await buf.put_group("v", ["x"], partition="val")
        await buf.put_group("first", ["x"])
        buf.add_prompt_nowait("open")
        # no group judged on "aux" yet: no pass rate there
        await buf.put_group("a1", ["x"], partition="aux", status="failed")
        _, metrics = await buf.sample(0, 1, partition="aux", timeout=0)
        assert "validation/filter_groups/pass_rate" not in metrics  # prefix of any partition but train
        assert metrics["validation/filter_groups/evicted_samples"] == 0
        for i in range(100):
            await buf.put_group(f"d{i}", ["x"])  # filtered
        for i in range(156):
            await buf.put_group(f"k{i}", ["x"])  # kept
        # the window: the last 256 verdicts are 100 filtered and 156 kept ("first" fell out)
        _, metrics = await buf.sample(0, 1, timeout=0)
        assert metrics[f"{PREFIX}/filter_groups/pass_rate"] == 156 / 256
        for i in range(56):
            await buf.put_group(f"m{i}", ["x"])
        # now the last 256 are 44 filtered (d56..d99) and 212 kept (156 + 56)
        _, metrics = await buf.sample(0, 1, timeout=0)
        assert metrics[f"{PREFIX}/filter_groups/pass_rate"] == 212 / 256


async def test_a_buffer_without_filters_reports_no_filter_metrics() -> None:
    buf = build()
    with anyio.fail_after(LIMIT):
        await buf.put_group("g", ["x"])
        _, metrics = await buf.sample(0, 1, timeout=0)
        assert not any("filter_groups" in key for key in metrics)
        assert train_stats(buf).filter_errors == 0


# -- the built-ins ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scores", "kept"),
    [
        ((1, 1, 1), False),
        ((0, 0), False),
        ((1, 0), True),
        ((0.5, 0.5, 0.25), True),
        ((1, 1.0), False),  # equal scores, whatever their type
        ((3,), True),  # fewer than 2 trajectories: kept
        ((), True),
    ],
)
async def test_zero_variance_by_tag(scores: tuple[float, ...], kept: bool) -> None:
    buf = build([zero_variance("r")])
    buf.add_prompt_nowait("g")
    for session, score in enumerate(scores):
        buf.put_nowait("g", "x", session_id=session, tags={"r": score})
    buf.mark_finished_nowait("g")
    assert ("g" in buf) is kept
    stats = train_stats(buf)
    assert (stats.evicted_filtered_groups, stats.filter_errors) == (int(not kept), 0)


async def test_zero_variance_by_callable() -> None:
    buf = build([zero_variance(lambda trajectory: len(trajectory.payload))])
    with anyio.fail_after(LIMIT):
        await buf.put_group("same", ["ab", "cd"])
        await buf.put_group("differ", ["ab", "c"])
        assert resident_uids(buf) == ["differ"]


async def test_zero_variance_with_a_missing_tag_fails_open_naming_the_tag(
    caplog: pytest.LogCaptureFixture,
) -> None:
    buf = build([zero_variance("reward")])
    with anyio.fail_after(LIMIT), caplog.at_level(logging.ERROR, logger="stalebuf"):
        await buf.put_group("g", ["a", "b"], trajectory_tags=[{"reward": 1}, {"other": 1}])
        assert "g" in buf  # kept: fail-open
        assert train_stats(buf).filter_errors == 1
        (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert "'reward'" in line
        assert "'g'" in line


async def test_zero_variance_on_a_single_trajectory_needs_no_tag() -> None:
    buf = build([zero_variance("reward")])
    with anyio.fail_after(LIMIT):
        await buf.put_group("g", ["a"])
        assert "g" in buf
        assert train_stats(buf).filter_errors == 0


@pytest.mark.parametrize(
    ("k", "sizes", "kept"), [(2, (1, 2, 3), ["two", "three"]), (1, (1, 2), ["one", "two"])]
)
async def test_min_trajectories(k: int, sizes: tuple[int, ...], kept: list[str]) -> None:
    names = {1: "one", 2: "two", 3: "three"}
    buf = build([min_trajectories(k)])
    with anyio.fail_after(LIMIT):
        for size in sizes:
            await buf.put_group(names[size], ["x"] * size)
        assert resident_uids(buf) == kept


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None, True])
def test_min_trajectories_refuses_a_bad_k(bad: object) -> None:
    with pytest.raises(ConfigError):
        min_trajectories(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", 3, None, b"r"])
def test_zero_variance_refuses_a_bad_score(bad: object) -> None:
    with pytest.raises(ConfigError):
        zero_variance(bad)  # type: ignore[arg-type]


# -- filter_groups_metric (verl's algorithm.filter_groups) ------------------------------------------


async def test_filter_groups_metric_filters_zero_variance_groups_before_the_buffers_own_filters() -> None:
    calls: list[str] = []

    def own(group: Group) -> bool:
        calls.append(group.uid)
        return True

    buf = build([own], filter_groups_metric="acc")
    with anyio.fail_after(LIMIT):
        await buf.put_group("flat", ["a", "b"], trajectory_tags=[{"acc": 1}, {"acc": 1}])
        await buf.put_group("mixed", ["a", "b"], trajectory_tags=[{"acc": 1}, {"acc": 0}])
        assert resident_uids(buf) == ["mixed"]
        assert calls == ["mixed"]  # the metric's filter ran first and rejected "flat"


async def test_filter_groups_metric_from_a_verl_mapping() -> None:
    config = SamplerConfig.from_mapping({"filter_groups_metric": "acc"})
    assert config.filter_groups_metric == "acc"
    buf = ReplayBuffer.from_config(config, status_log_interval=None)
    with anyio.fail_after(LIMIT):
        await buf.put_group("flat", ["a", "b"], trajectory_tags=[{"acc": 0}, {"acc": 0}])
        assert "flat" not in buf
        assert train_stats(buf).evicted_filtered_groups == 1


async def test_from_config_passes_the_filters_on() -> None:
    buf = ReplayBuffer.from_config(SamplerConfig(), filters=[drop_uids("g")], status_log_interval=None)
    with anyio.fail_after(LIMIT):
        await buf.put_group("g", ["x"])
        assert "g" not in buf


# -- refused filters ---------------------------------------------------------------------------------


async def _async_filter(group: Group) -> bool:
    return True


class _AsyncCall:
    async def __call__(self, group: Group) -> bool:
        return True


@pytest.mark.parametrize(
    "filters",
    [
        pytest.param([_async_filter], id="async-def"),
        pytest.param([_AsyncCall()], id="async-__call__"),
        pytest.param([lambda group: True, _async_filter], id="async-second"),
        pytest.param([1], id="int"),
        pytest.param([None], id="None-entry"),
        pytest.param("zero_variance", id="str"),
        pytest.param(lambda group: True, id="single-callable"),
        pytest.param(None, id="None"),
        pytest.param(3, id="int-not-a-sequence"),
    ],
)
def test_filters_that_are_not_plain_callables_are_refused(filters: Any) -> None:
    with pytest.raises(ConfigError):
        ReplayBuffer(SamplerConfig(), filters=filters)
    with pytest.raises(ConfigError):
        ReplayBuffer.from_config(SamplerConfig(), filters=filters)


# -- filters under a task mixture -----------------------------------------------------------------


async def test_under_a_mixture_a_filtered_group_wakes_the_waiting_producer_of_its_own_task() -> None:
    config = SamplerConfig(mixture={"a": 1, "b": 1}, admission_batch_size=2, max_off_policy_threshold=1)
    buf = ReplayBuffer(config, filters=[drop_uids("a0")], status_log_interval=None)
    with anyio.fail_after(LIMIT):
        buf.add_prompt_nowait("a0", tags={"task": "a"})  # a's one slot at step 0
        buf.add_prompt_nowait("b0", tags={"task": "b"})  # b's
        async with anyio.create_task_group() as tg:
            waiting_a = await start_call(tg, lambda: buf.add_prompt("a1", tags={"task": "a"}))
            waiting_b = await start_call(tg, lambda: buf.add_prompt("b1", tags={"task": "b"}))
            assert train_stats(buf).waiting_producers == 2
            buf.put_nowait("a0", "x")
            buf.mark_finished_nowait("a0")  # filtered: a's slot is free
            await settle()
            assert waiting_a.returned
            assert not waiting_b.done  # b's slot is still taken by b0
            assert buf.full(task="b")
            waiting_b.scope.cancel()
        tasks = train_stats(buf).tasks
        assert (tasks["a"].resident, tasks["b"].resident) == (1, 1)
        assert train_stats(buf).evicted_filtered_groups == 1
        assert_conserved(buf)


async def test_under_a_mixture_the_filter_metrics_cover_the_whole_partition() -> None:
    config = SamplerConfig(mixture={"a": 1, "b": 1})
    buf = ReplayBuffer(config, filters=[zero_variance("r")], status_log_interval=None)
    with anyio.fail_after(LIMIT):
        await buf.put_group("a-flat", ["x", "y"], tags={"task": "a"}, trajectory_tags=rewards(1, 1))
        await buf.put_group("b-flat", ["x", "y"], tags={"task": "b"}, trajectory_tags=rewards(0, 0))
        await buf.put_group("a-ok", ["x", "y"], tags={"task": "a"}, trajectory_tags=rewards(1, 0))
        await buf.put_group("b-ok", ["x", "y"], tags={"task": "b"}, trajectory_tags=rewards(0, 1))
        batch, metrics = await buf.sample(0, 2, timeout=0)
        assert batch.uids == ["a-ok", "b-ok"]
        assert metrics[f"{PREFIX}/filter_groups/evicted_samples"] == 2
        assert metrics[f"{PREFIX}/filter_groups/pass_rate"] == 0.5
        stats = train_stats(buf)
        assert (stats.evicted_filtered_groups, stats.evicted_filtered_trajectories) == (2, 4)
        assert_conserved(buf)
