"""Model-based test of group filters (issue 23): the buffer against a reference written from the
issue's text, under asyncio and trio.

Each group is given, when it is created, what every filter answers about it (keep, drop, a
falsy or truthy non-bool, raise, or None); the model predicts from the contract alone: a filter
runs once, in order, when a group becomes FINISHED (never on failure, never in the exempt
"val"), the first false answer filters it, raising or None keeps it and counts an error; a
filtered group is evicted at once, its "filtered" event reaches ``on_evict`` inside the call
that finished it with the partition's dispatch clock, and its admission slot is free at once
(a waiting producer of its tag is admitted). ``on_evict`` records, raises (the finishing call
raises after the state change) or refills (its refills, filtered again, are served in order by
the same call). After every step: every status and counter (conservation including
``evicted_filtered_*``), the filter metrics of every returned batch (``evicted_samples`` since
the previous batch, ``pass_rate`` over the last 256 verdicts, ``errors`` when non-zero), one
ERROR line at most per filter (an example runs well under 60 s), and ``GroupEvictedError``
saying "filtered" on a later write.

Profiles: the default runs 400 examples x 50 steps; ``STALEBUF_HYPOTHESIS_PROFILE=thorough``
runs 1000 x 80.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import anyio
from hypothesis import HealthCheck, currently_in_test_context, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from _helpers import assert_conserved, resident_groups, settle, start_call
from stalebuf import EvictionEvent, Group, ReplayBuffer, SamplerConfig, Status
from stalebuf.errors import (
    BatchNotReadyError,
    BufferFullError,
    DuplicateGroupError,
    GroupEvictedError,
    InvalidTransitionError,
    UnknownGroupError,
)

PROFILES = {
    "ci": settings(
        max_examples=400, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    ),
    "thorough": settings(
        max_examples=1000, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    ),
}
PROFILE = os.environ.get("STALEBUF_HYPOTHESIS_PROFILE", "ci")

#: What one filter answers about one group.
ANSWERS = ("keep", "keep", "drop", "drop", "zero", "truthy", "raise", "none")
PARTITIONS = ("train", "val")  # "val" is exempt
PASS_WINDOW = 256
REFILL_BUDGET = 3  # refills per on_evict-driven chain, so that a chain always ends


class CallbackError(Exception):
    """What ``on_evict`` raises in "raise" mode."""


class FilterError(Exception):
    """What a filter answering "raise" raises."""


@dataclass
class MGroup:
    uid: str
    partition: str
    step: int
    seq: int
    status: Status = Status.PENDING
    trajectories: int = 0

    @property
    def terminal(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILURE)


COUNTERS = (
    "admitted_groups",
    "admitted_trajectories",
    "sampled_groups",
    "sampled_trajectories",
    "evicted_stale_groups",
    "evicted_stale_trajectories",
    "evicted_failure_groups",
    "evicted_failure_trajectories",
    "evicted_filtered_groups",
    "evicted_filtered_trajectories",
    "filter_errors",
)


@dataclass
class Ledger:
    """What the contract says a partition remembers about its filters."""

    verdicts: deque[bool] = field(default_factory=lambda: deque(maxlen=PASS_WINDOW))
    filtered: int = 0  # since the previous returned batch
    errors: int = 0  # since the previous returned batch


@dataclass
class Model:
    """Plain dicts and scans, written from the issue; nothing shared with the buffer."""

    threshold: int
    strategy: str
    failure: str
    cap: int | None
    filters: int
    callback: str
    groups: dict[str, MGroup] = field(default_factory=dict)  # resident, in admission order
    filtered_uids: set[str] = field(default_factory=set)  # a later write says "filtered"
    gone: set[str] = field(default_factory=set)  # sampled or evicted terminal: unknown now
    answers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    ledgers: dict[str, Ledger] = field(default_factory=dict)
    clock: dict[str, int] = field(default_factory=dict)
    last_sampled: dict[str, int] = field(default_factory=dict)
    errors_by_filter: list[int] = field(default_factory=list)
    next_seq: int = 0
    waiting: int = 0  # producers parked on admission (only inside the producer scenario)

    def touch(self, partition: str) -> dict[str, int]:
        if partition not in self.counters:
            self.counters[partition] = dict.fromkeys(COUNTERS, 0)
            self.ledgers[partition] = Ledger()
        return self.counters[partition]

    def exempt(self, partition: str) -> bool:
        return partition == "val"

    def filtered_partition(self, partition: str) -> bool:
        return self.filters > 0 and not self.exempt(partition)

    # -- admission ----------------------------------------------------------------------

    def resident_at(self, partition: str, step: int) -> int:
        return sum(1 for g in self.groups.values() if g.partition == partition and g.step == step)

    def admits(self, partition: str) -> bool:
        """Whether a group dispatched at the clock may be admitted now."""
        if self.cap is None or self.exempt(partition):
            return True
        if self.waiting:
            return False
        step = self.clock.get(partition, 0)
        closed = self.last_sampled.get(partition, -1) + 1 - step + 1 > self.threshold
        return self.resident_at(partition, step) < self.cap and not closed

    def add(self, uid: str, partition: str, answers: tuple[str, ...]) -> MGroup:
        group = MGroup(uid, partition, self.clock.get(partition, 0), self.next_seq)
        self.next_seq += 1
        self.groups[uid] = group
        self.touch(partition)["admitted_groups"] += 1
        self.filtered_uids.discard(uid)
        self.gone.discard(uid)
        self.answers[uid] = answers
        return group

    def put(self, group: MGroup, count: int) -> None:
        group.trajectories += count
        self.touch(group.partition)["admitted_trajectories"] += count

    # -- the verdict ------------------------------------------------------------------------

    def judge(self, group: MGroup) -> tuple[bool, list[int]]:
        """``(kept, filters called)`` for ``group`` becoming FINISHED in a filtered partition."""
        called, kept = [], True
        ledger, counters = self.ledgers[group.partition], self.counters[group.partition]
        for index, answer in enumerate(self.answers[group.uid]):
            called.append(index)
            if answer in ("raise", "none"):  # fail-open: counted, the later filters run
                ledger.errors += 1
                counters["filter_errors"] += 1
                self.errors_by_filter[index] += 1
                continue
            if answer in ("drop", "zero"):  # bool(False), bool(0)
                kept = False
                break
        ledger.verdicts.append(kept)
        return kept, called

    def finish(self, group: MGroup, status: Status) -> tuple[list[int], MGroup | None]:
        """Make ``group`` terminal; return the filters called and the group if it was filtered."""
        group.status = status
        if status is not Status.FINISHED or not self.filtered_partition(group.partition):
            return [], None
        kept, called = self.judge(group)
        if kept:
            return called, None
        del self.groups[group.uid]
        self.filtered_uids.add(group.uid)
        counters = self.counters[group.partition]
        counters["evicted_filtered_groups"] += 1
        counters["evicted_filtered_trajectories"] += group.trajectories
        self.ledgers[group.partition].filtered += 1
        return called, group

    # -- sampling ---------------------------------------------------------------------------

    def evicts_failures(self, partition: str) -> bool:
        return self.failure == "evict" and not self.exempt(partition)

    def ready(self, partition: str) -> list[MGroup]:
        found = [
            g
            for g in self.groups.values()
            if g.partition == partition
            and g.terminal
            and not (g.status is Status.FAILURE and self.evicts_failures(partition))
        ]
        return sorted(found, key=lambda g: (g.step, g.seq))

    def stale(self, g: int, group: MGroup) -> bool:
        return g - group.step + 1 > self.threshold

    def sample(
        self, partition: str, g: int, batch_size: int
    ) -> tuple[list[tuple[str, list[str]]], list[str]]:
        """``(eviction events as (reason, uids), batch uids or [])`` of a sample at ``g`` now."""
        self.clock[partition] = max(self.clock.get(partition, 0), g)
        if partition not in self.counters:
            return [], []
        events: list[tuple[str, list[str]]] = []
        counters = self.counters[partition]
        failed = sorted(
            (
                x
                for x in self.groups.values()
                if x.partition == partition and x.status is Status.FAILURE and self.evicts_failures(partition)
            ),
            key=lambda x: (x.step, x.seq),
        )
        if failed:
            events.append(("failure", [x.uid for x in failed]))
            for x in failed:
                del self.groups[x.uid]
                self.gone.add(x.uid)
                counters["evicted_failure_groups"] += 1
                counters["evicted_failure_trajectories"] += x.trajectories
        if self.strategy == "drop" and not self.exempt(partition):
            stale = [x for x in self.ready(partition) if self.stale(g, x)]
            if stale:
                events.append(("stale", [x.uid for x in stale]))
                for x in stale:
                    del self.groups[x.uid]
                    self.gone.add(x.uid)
                    counters["evicted_stale_groups"] += 1
                    counters["evicted_stale_trajectories"] += x.trajectories
        if events and self.callback == "raise":
            return events, []  # on_evict raised: no batch
        gate = self.strategy != "wait" or self.exempt(partition)
        if not gate:
            gate = not any(
                x.partition == partition and not x.terminal and g - x.step + 1 >= self.threshold
                for x in self.groups.values()
            )
        ready = self.ready(partition)
        if not gate or len(ready) < batch_size:
            return events, []
        batch = ready[:batch_size]
        for x in batch:
            del self.groups[x.uid]
            self.gone.add(x.uid)
            counters["sampled_groups"] += 1
            counters["sampled_trajectories"] += x.trajectories
        self.last_sampled[partition] = max(self.last_sampled.get(partition, -1), g)
        return events, [x.uid for x in batch]

    def stats(self, partition: str) -> dict[str, int]:
        mine = [g for g in self.groups.values() if g.partition == partition]
        expected = dict(self.counters[partition])
        expected.update(
            pending=sum(g.status is Status.PENDING for g in mine),
            running=sum(g.status is Status.RUNNING for g in mine),
            finished=sum(g.status is Status.FINISHED for g in mine),
            failure=sum(g.status is Status.FAILURE for g in mine),
            trajectories=sum(g.trajectories for g in mine),
        )
        return expected


def note(what: str) -> None:
    """A coverage event (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        hypothesis_event(what)


def outcome(call: Any) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except Exception as exc:
        return None, exc


class ErrorLines(logging.Handler):
    """Collects the ERROR lines of the "stalebuf" logger."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class FilterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.buf: ReplayBuffer | None = None
        self.model: Model | None = None
        self.backend = "asyncio"
        self.next_uid = 0
        self.trainer_step = 0
        self.events: list[tuple[str, str, tuple[str, ...], int]] = []
        self.calls: list[tuple[int, str]] = []  # (filter index, uid) in call order
        self.refill_answers: tuple[str, ...] = ()
        self.refills_left = 0
        self.refilled = 0
        self.lines = ErrorLines()
        logging.getLogger("stalebuf").addHandler(self.lines)

    def teardown(self) -> None:
        logging.getLogger("stalebuf").removeHandler(self.lines)

    @property
    def b(self) -> ReplayBuffer:
        assert self.buf is not None
        return self.buf

    @property
    def m(self) -> Model:
        assert self.model is not None
        return self.model

    def fresh(self, prefix: str = "g") -> str:
        self.next_uid += 1
        return f"{prefix}{self.next_uid}"

    # -- what the buffer is given --------------------------------------------------------------

    def make_filter(self, index: int) -> Any:
        def group_filter(group: Group) -> object:
            self.calls.append((index, group.uid))
            answer = self.m.answers[group.uid][index]
            if answer == "raise":
                raise FilterError(f"filter {index} broke")
            return {"keep": True, "drop": False, "zero": 0, "truthy": "yes", "none": None}[answer]

        group_filter.__name__ = group_filter.__qualname__ = f"filter_{index}"
        return group_filter

    def on_evict(self, event: EvictionEvent) -> None:
        uids = tuple(group.uid for group in event.groups)
        self.events.append((event.reason, event.partition, uids, event.global_steps))
        mode = self.m.callback
        if mode == "raise":
            raise CallbackError(event.reason)
        if mode == "refill" and event.reason == "filtered":
            for _ in uids:
                if self.refills_left <= 0:
                    return
                self.refills_left -= 1
                uid = self.fresh("r")
                self.m.answers[uid] = self.refill_answers  # what the filters will say about it
                try:
                    self.b.put_group_nowait(uid, ["refill"], partition=event.partition)
                except BufferFullError:
                    self.m.answers.pop(uid)
                    self.refilled_refused.append(uid)
                else:
                    self.refilled_admitted.append(uid)

    refilled_admitted: list[str]
    refilled_refused: list[str]

    # -- the model's side of a finishing call -----------------------------------------------------

    def expect_finish(
        self, group: MGroup, status: Status, filtered_events: deque[MGroup]
    ) -> list[tuple[int, str]]:
        called, filtered = self.m.finish(group, status)
        if filtered is not None:
            filtered_events.append(filtered)
        return [(index, group.uid) for index in called]

    def deliver(
        self, filtered_events: deque[MGroup]
    ) -> tuple[list[tuple[str, str, tuple[str, ...], int]], list[tuple[int, str]], bool]:
        """The model's delivery of "filtered" events, refills served in order by the same loop:
        the events, the filter calls of the refills, and whether the call raises."""
        m = self.m
        events: list[tuple[str, str, tuple[str, ...], int]] = []
        calls: list[tuple[int, str]] = []
        raised, budget = False, REFILL_BUDGET
        while filtered_events:
            group = filtered_events.popleft()
            events.append(("filtered", group.partition, (group.uid,), m.clock.get(group.partition, 0)))
            if m.callback == "raise":
                raised = True
            if m.callback == "refill" and budget > 0:
                budget -= 1
                refill = self.pending_refills.popleft()  # the uid on_evict gives it
                if m.admits(group.partition):
                    new = m.add(refill, group.partition, self.refill_answers)
                    m.put(new, 1)
                    calls += self.expect_finish(new, Status.FINISHED, filtered_events)
        return events, calls, raised

    pending_refills: deque[str]

    def run_finishing(self, what: str, act: Any, model_side: Any) -> None:
        """Run the buffer's finishing call ``act`` and check it against the model: ``model_side``
        makes the model's state change and returns its filtered groups (a deque) and calls."""
        m = self.m
        self.events.clear()
        self.calls.clear()
        self.refilled_admitted, self.refilled_refused = [], []
        self.refills_left = REFILL_BUDGET
        # the uids the refills will get, in order (fresh() is deterministic)
        self.pending_refills = deque(f"r{self.next_uid + i + 1}" for i in range(REFILL_BUDGET))
        _, exc = outcome(act)
        filtered_events, expected_calls = model_side()
        events, refill_calls, raised = self.deliver(filtered_events)
        for _ in events:
            note("finishing call: a group filtered")
        if len(events) > 1:
            note("finishing call: a refill filtered again")
        if raised:
            note("finishing call: on_evict raised")
        if any(errors for errors in m.errors_by_filter):
            note("some filter failed open")
        expected_calls = expected_calls + refill_calls
        if raised:
            assert isinstance(exc, CallbackError), f"{what}: on_evict raised, the call did not: {exc!r}"
        else:
            assert exc is None, f"{what}: unexpected {exc!r}"
        assert self.events == events, f"{what}: events {self.events} != {events}"
        assert self.calls == expected_calls, f"{what}: filter calls {self.calls} != {expected_calls}"
        refills = [uid for uid in self.refilled_admitted + self.refilled_refused]
        assert len(refills) == len(set(refills))
        assert all(uid in m.groups or uid in m.filtered_uids for uid in self.refilled_admitted)

    # -- rules ----------------------------------------------------------------------------------

    @initialize(
        backend=st.sampled_from(("asyncio", "trio")),
        threshold=st.integers(1, 3),
        strategy=st.sampled_from(("drop", "wait")),
        failure=st.sampled_from(("sample", "evict")),
        cap=st.sampled_from((None, None, 1, 2, 3)),
        filters=st.integers(0, 3),
        callback=st.sampled_from(("record", "record", "raise", "refill")),
        refill_answers=st.lists(st.sampled_from(ANSWERS), min_size=3, max_size=3),
    )
    def make_buffer(
        self,
        backend: str,
        threshold: int,
        strategy: str,
        failure: str,
        cap: int | None,
        filters: int,
        callback: str,
        refill_answers: list[str],
    ) -> None:
        config = SamplerConfig(
            max_off_policy_threshold=threshold,
            max_off_policy_strategy=strategy,  # type: ignore[arg-type]
            failure_strategy=failure,  # type: ignore[arg-type]
            admission_batch_size=cap,
        )
        self.model = Model(threshold, strategy, failure, cap, filters, callback)
        self.model.errors_by_filter = [0] * filters
        self.refill_answers = tuple(refill_answers[:filters])
        self.buf = ReplayBuffer(
            config,
            filters=[self.make_filter(index) for index in range(filters)],
            on_evict=self.on_evict,
            status_log_interval=None,
        )
        self.backend = backend

    def pick_open(self, index: int, partition: str | None = None) -> MGroup | None:
        open_groups = [
            g
            for g in self.m.groups.values()
            if not g.terminal and (partition is None or g.partition == partition)
        ]
        return open_groups[index % len(open_groups)] if open_groups else None

    @rule(
        partition=st.sampled_from(PARTITIONS),
        answers=st.lists(st.sampled_from(ANSWERS), min_size=3, max_size=3),
    )
    def add_prompt(self, partition: str, answers: list[str]) -> None:
        uid = self.fresh()
        self.m.answers[uid] = tuple(answers[: self.m.filters])
        _, exc = outcome(lambda: self.b.add_prompt_nowait(uid, partition=partition))
        if not self.m.admits(partition):
            assert isinstance(exc, BufferFullError), exc
            return
        assert exc is None, exc
        self.m.add(uid, partition, tuple(answers[: self.m.filters]))

    @rule(answers=st.lists(st.sampled_from(ANSWERS), min_size=3, max_size=3))
    def fill_the_step(self, answers: list[str]) -> None:
        """With admission: add prompts at the clock until its step is full (at most 4)."""
        if self.m.cap is None:
            return
        for _ in range(4):
            if not self.m.admits("train"):
                break
            uid = self.fresh()
            self.b.add_prompt_nowait(uid)
            self.m.add(uid, "train", tuple(answers[: self.m.filters]))

    @rule(index=st.integers(0, 20), running=st.booleans(), puts=st.integers(0, 2))
    def write(self, index: int, running: bool, puts: int) -> None:
        group = self.pick_open(index)
        if group is None:
            return
        if running:
            _, exc = outcome(lambda: self.b.mark_running_nowait(group.uid))
            if group.status is Status.PENDING:
                assert exc is None, exc
                group.status = Status.RUNNING
            else:
                assert isinstance(exc, InvalidTransitionError), exc
        for _ in range(puts):
            self.b.put_nowait(group.uid, "p", session_id=group.trajectories)
            self.m.put(group, 1)

    @rule(index=st.integers(0, 20), failed=st.booleans())
    def end(self, index: int, failed: bool) -> None:
        group = self.pick_open(index)
        if group is None:
            return
        status = Status.FAILURE if failed else Status.FINISHED
        act = self.b.mark_failed_nowait if failed else self.b.mark_finished_nowait

        def model_side() -> tuple[deque[MGroup], list[tuple[int, str]]]:
            filtered: deque[MGroup] = deque()
            return filtered, self.expect_finish(group, status, filtered)

        self.run_finishing(f"end({group.uid}, {status.value})", lambda: act(group.uid), model_side)

    @rule(
        partition=st.sampled_from(PARTITIONS),
        n=st.integers(1, 3),
        failed=st.booleans(),
        answers=st.lists(st.sampled_from(ANSWERS), min_size=3, max_size=3),
        tagged=st.booleans(),
    )
    def put_group(self, partition: str, n: int, failed: bool, answers: list[str], tagged: bool) -> None:
        m = self.m
        uid = self.fresh()
        m.answers[uid] = tuple(answers[: m.filters])
        status = Status.FAILURE if failed else Status.FINISHED
        options: dict[str, Any] = {"partition": partition, "status": status}
        if tagged:  # the general path (the fast path takes a new finished group of default keys)
            options["trajectory_tags"] = [{"i": i} for i in range(n)]
        if not m.admits(partition):
            _, exc = outcome(lambda: self.b.put_group_nowait(uid, ["x"] * n, **options))
            assert isinstance(exc, BufferFullError), exc
            return

        def model_side() -> tuple[deque[MGroup], list[tuple[int, str]]]:
            group = m.add(uid, partition, tuple(answers[: m.filters]))
            m.put(group, n)
            filtered: deque[MGroup] = deque()
            return filtered, self.expect_finish(group, status, filtered)

        self.run_finishing(
            f"put_group({uid})", lambda: self.b.put_group_nowait(uid, ["x"] * n, **options), model_side
        )

    @rule(n=st.integers(0, 2), answers=st.lists(st.sampled_from(ANSWERS), min_size=3, max_size=3))
    def rollout(self, n: int, answers: list[str]) -> None:
        """An ``async with buf.rollout()`` block under the machine's backend: finished at its end."""
        m = self.m
        if not m.admits("train"):
            return
        uid = self.fresh()
        m.answers[uid] = tuple(answers[: m.filters])

        async def block() -> None:
            with anyio.fail_after(10):
                async with self.b.rollout(uid) as group:
                    for i in range(n):
                        await group.put(f"t{i}", session_id=i)

        def model_side() -> tuple[deque[MGroup], list[tuple[int, str]]]:
            group = m.add(uid, "train", tuple(answers[: m.filters]))
            group.status = Status.RUNNING
            m.put(group, n)
            filtered: deque[MGroup] = deque()
            return filtered, self.expect_finish(group, Status.FINISHED, filtered)

        self.run_finishing(f"rollout({uid})", lambda: anyio.run(block, backend=self.backend), model_side)

    @rule(
        advance=st.integers(0, 2),
        batch_size=st.integers(1, 3),
        partition=st.sampled_from(PARTITIONS),
        in_loop=st.booleans(),
    )
    def sample(self, advance: int, batch_size: int, partition: str, in_loop: bool) -> None:
        m = self.m
        self.trainer_step += advance
        g = self.trainer_step
        self.events.clear()
        events, batch = m.sample(partition, g, batch_size)
        not_ready: type[Exception]
        if in_loop:  # inside an event loop of the machine's backend

            async def call() -> Any:
                return await self.b.sample(g, batch_size, partition=partition, timeout=0)

            result, exc = outcome(lambda: anyio.run(call, backend=self.backend))
            not_ready = TimeoutError
        else:
            result, exc = outcome(lambda: self.b.sample_nowait(g, batch_size, partition=partition))
            not_ready = BatchNotReadyError
        assert [(reason, uids) for reason, _, uids, _ in self.events] == [(r, tuple(u)) for r, u in events]
        assert all(steps == g for _, _, _, steps in self.events)
        if events and m.callback == "raise":
            assert isinstance(exc, CallbackError), exc
            return
        if not batch:
            assert isinstance(exc, not_ready), f"expected no batch, got {exc!r} {result}"
            return
        assert exc is None, exc
        got, metrics = result
        assert got.uids == batch
        note(f"sample: a batch from {partition}")
        prefix = "training" if partition == "train" else "validation"
        keys = {key for key in metrics if "/filter_groups/" in key}
        if not m.filtered_partition(partition):
            assert keys == set(), keys
            return
        ledger = m.ledgers[partition]
        assert metrics[f"{prefix}/filter_groups/evicted_samples"] == ledger.filtered
        if ledger.verdicts:
            assert metrics[f"{prefix}/filter_groups/pass_rate"] == sum(ledger.verdicts) / len(ledger.verdicts)
        else:
            assert f"{prefix}/filter_groups/pass_rate" not in metrics
        if ledger.errors:
            assert metrics[f"{prefix}/filter_groups/errors"] == ledger.errors
        else:
            assert f"{prefix}/filter_groups/errors" not in metrics
        ledger.filtered = ledger.errors = 0

    @precondition(lambda self: self.model is not None and bool(self.model.filtered_uids))
    @rule(index=st.integers(0, 50), readd=st.booleans())
    def write_to_a_filtered_uid(self, index: int, readd: bool) -> None:
        m = self.m
        uids = sorted(m.filtered_uids)
        uid = uids[index % len(uids)]
        if uid in m.groups:  # reused since
            return
        for write in (
            lambda: self.b.put_nowait(uid, "late", session_id=99),
            lambda: self.b.mark_finished_nowait(uid),
            lambda: self.b.mark_running_nowait(uid),
        ):
            _, exc = outcome(write)
            assert isinstance(exc, GroupEvictedError), exc
            assert "filtered" in str(exc)
        if not readd:
            return
        _, exc = outcome(lambda: self.b.add_prompt_nowait(uid))
        if not m.admits("train"):
            assert isinstance(exc, BufferFullError), exc
            return
        assert exc is None, exc
        m.add(uid, "train", ("keep",) * m.filters)

    @precondition(lambda self: self.model is not None and bool(self.model.gone))
    @rule(index=st.integers(0, 50))
    def write_to_a_gone_uid(self, index: int) -> None:
        uids = sorted(self.m.gone)
        uid = uids[index % len(uids)]
        _, exc = outcome(lambda: self.b.mark_finished_nowait(uid))
        assert type(exc) is UnknownGroupError, exc

    @rule(index=st.integers(0, 20))
    def duplicate(self, index: int) -> None:
        groups = list(self.m.groups.values())
        if not groups:
            return
        group = groups[index % len(groups)]
        _, exc = outcome(lambda: self.b.add_prompt_nowait(group.uid, partition=group.partition))
        assert isinstance(exc, DuplicateGroupError), exc
        if group.terminal:
            _, exc = outcome(lambda: self.b.put_nowait(group.uid, "late", session_id=50))
            assert isinstance(exc, InvalidTransitionError), exc

    @rule(index=st.integers(0, 20))
    def filtered_slot_wakes_a_waiting_producer(self, index: int) -> None:
        """With admission: the clock's step is full; a producer parks in add_prompt; an open
        group of that step finishes: filtered, its slot admits the producer at once, else the
        producer stays parked (then is cancelled, adding nothing)."""
        m = self.m
        if m.cap is None or m.callback == "raise" or m.waiting:
            return
        step = m.clock.get("train", 0)
        closed = m.last_sampled.get("train", -1) + 1 - step + 1 > m.threshold
        candidates = [
            g for g in m.groups.values() if g.partition == "train" and not g.terminal and g.step == step
        ]
        if closed or m.resident_at("train", step) < m.cap or not candidates:
            return
        group = candidates[index % len(candidates)]
        uid = self.fresh("w")
        self.events.clear()
        self.calls.clear()
        self.refilled_admitted, self.refilled_refused = [], []
        self.refills_left = REFILL_BUDGET
        self.pending_refills = deque(f"r{self.next_uid + i + 1}" for i in range(REFILL_BUDGET))

        async def scenario() -> tuple[bool, bool, BaseException | None]:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    waiting = await start_call(tg, lambda: self.b.add_prompt(uid))
                    parked = not waiting.done
                    self.b.mark_finished_nowait(group.uid)
                    await settle()
                    if not waiting.done:
                        waiting.scope.cancel()
            return parked, waiting.returned, waiting.error

        parked, admitted, error = anyio.run(scenario, backend=self.backend)
        assert parked, "the producer did not park on a full step"
        assert error is None, error
        m.waiting = 1  # refills inside on_evict queue behind the parked producer: refused
        filtered: deque[MGroup] = deque()
        calls = self.expect_finish(group, Status.FINISHED, filtered)
        was_filtered = bool(filtered)
        events, refill_calls, _ = self.deliver(filtered)
        m.waiting = 0
        assert self.events == events
        assert self.calls == calls + refill_calls
        assert admitted == was_filtered, f"filtered={was_filtered} but admitted={admitted}"
        note(f"waiting producer: admitted={admitted}")
        if admitted:
            m.answers[uid] = ("keep",) * m.filters
            m.add(uid, "train", m.answers[uid])
            assert resident_groups(self.b)[uid].dispatch_step == step

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        if self.model is None:
            return
        m, b = self.m, self.b
        assert set(resident_groups(b)) == set(m.groups)
        stats = b.stats()
        for name in m.counters:
            expected = m.stats(name)
            actual = stats.partitions[name]
            got = {key: getattr(actual, key) for key in expected}
            assert got == expected, name
            assert actual.waiting_producers == 0
        for uid, group in resident_groups(b).items():
            mine = m.groups[uid]
            assert (group.status, group.dispatch_step, group.partition) == (
                mine.status,
                mine.step,
                mine.partition,
            )
        assert_conserved(b)
        if m.cap is not None:
            expected_free = (
                0 if not m.admits("train") else m.cap - m.resident_at("train", m.clock.get("train", 0))
            )
            if "train" in m.counters:
                assert b.free_slots() == expected_free

    @invariant()
    def one_error_line_per_filter(self) -> None:
        if self.model is None:
            return
        for index, errors in enumerate(self.m.errors_by_filter):
            lines = [line for line in self.lines.lines if f"filter_{index}" in line]
            assert len(lines) == min(errors, 1), (index, errors, lines)


FilterMachine.TestCase.settings = PROFILES[PROFILE]
TestFiltersAgainstModel = FilterMachine.TestCase
