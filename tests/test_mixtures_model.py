"""Model-based test of task mixtures (issue 23): the buffer against a brute-force reference
written from the issue's text, under asyncio and trio.

Random tasks and weights, both policies, per-task thresholds, drop and wait, admission on and
off; producers add groups of random tasks, a trainer samples a fixed ``B`` at consecutive steps
(it retries a step that returned no batch). The reference computes every batch from the text:
quotas by the largest remainder (exact fractions, ties to the name sorting first); under
``wait`` each task's ``q_i`` oldest once every task has them; under ``borrow`` (1) what would be
stale at the next step, (2) each task's allowance ``max(0, q_i + b_i)``, (3) the rest, oldest
first, then ``b_i += q_i - taken_i``. The text leaves open how a clipped amount is spread over
the balances of the opposite sign, so after a clip the machine checks what the buffer chose
against the rule (every balance within ``±4B``, moved toward 0 and never across it, the sum
0) and adopts it. Checked after every step: the batch (exact size, oldest first overall, FIFO
per task), the evictions, the balances (sum 0, within ``±4B``), the per-task hard bound (drop,
and wait with admission: no group trained staler than its task's T), ``stats().tasks``, the
mixture metrics, ``free_slots``/``full``/``capacity``/``sampleable_count`` per task, one producer
FIFO per task, refusals that change nothing, the borrow starvation WARNING (once per task: an
example runs well under 60 s), and over a long run of fully producing tasks, shares within
``1/B`` of the weights.

Profiles: the default runs 300 examples x 50 steps; ``STALEBUF_HYPOTHESIS_PROFILE=thorough``
runs 1000 x 100.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from functools import partial
from typing import Any

import anyio
from hypothesis import HealthCheck, currently_in_test_context, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from _helpers import assert_conserved, resident_groups, start_call
from stalebuf import ReplayBuffer, SamplerConfig, Status
from stalebuf.errors import BatchNotReadyError, BufferFullError

PROFILES = {
    "ci": settings(
        max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    ),
    "thorough": settings(
        max_examples=1000,
        stateful_step_count=100,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    ),
}
PROFILE = os.environ.get("STALEBUF_HYPOTHESIS_PROFILE", "ci")

NAMES = ("art", "bio", "cs")
SHARE_WINDOW = 256
CAP_FACTOR = 4  # balances within ±4B


def note(what: str) -> None:
    if currently_in_test_context():
        hypothesis_event(what)


def reference_quotas(weights: dict[str, int], batch_size: int) -> dict[str, int]:
    """Largest remainder on the normalised weights, exact fractions, ties to the name sorting first."""
    total = sum(weights.values())
    ideal = {task: Fraction(batch_size * weight, total) for task, weight in weights.items()}
    floors = {task: value.numerator // value.denominator for task, value in ideal.items()}
    left = batch_size - sum(floors.values())
    order = sorted(ideal, key=lambda task: (-(ideal[task] - floors[task]), task))
    return {task: floors[task] + (task in order[:left]) for task in weights}


def outcome(call: Any) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except Exception as exc:
        return None, exc


@dataclass
class MGroup:
    uid: str
    task: str
    step: int
    seq: int
    status: Status = Status.PENDING

    @property
    def terminal(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILURE)


@dataclass
class Model:
    """Lists and scans from the issue's text; nothing shared with the buffer."""

    weights: dict[str, int]
    policy: str
    thresholds: dict[str, int]
    strategy: str
    failure: str
    admission: int | None
    batch_size: int
    groups: dict[str, MGroup] = field(default_factory=dict)
    clock: int = 0
    last_sampled: int = -1
    next_seq: int = 0
    used: bool = False  # the partition exists
    evaluated: bool = False  # a sample evaluated it (shortage is 0 before)
    balances: dict[str, int] = field(default_factory=dict)
    shares: deque[str] = field(default_factory=lambda: deque(maxlen=SHARE_WINDOW))
    sampled: dict[str, int] = field(default_factory=dict)
    growth: dict[str, int] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.balances = dict.fromkeys(self.weights, 0)
        self.sampled = dict.fromkeys(self.weights, 0)
        self.growth = dict.fromkeys(self.weights, 0)
        self.counters = dict.fromkeys(
            ("admitted_groups", "sampled_groups", "evicted_stale_groups", "evicted_failure_groups"), 0
        )

    @property
    def tasks(self) -> list[str]:
        return sorted(self.weights)

    def quotas(self, batch_size: int) -> dict[str, int]:
        return reference_quotas(self.weights, batch_size)

    # -- admission ---------------------------------------------------------------------------

    def cap(self, task: str) -> int | None:
        return None if self.admission is None else self.quotas(self.admission)[task]

    def resident_at(self, task: str, step: int) -> int:
        return sum(1 for g in self.groups.values() if g.task == task and g.step == step)

    def admits(self, task: str) -> bool:
        cap = self.cap(task)
        if cap is None:
            return True
        open_tag = self.clock >= self.last_sampled + 2 - self.thresholds[task]
        return open_tag and self.resident_at(task, self.clock) < cap

    def free_slots(self, task: str) -> int | None:
        cap = self.cap(task)
        if cap is None:
            return None
        return cap - self.resident_at(task, self.clock) if self.admits(task) else 0

    def add(self, uid: str, task: str) -> MGroup:
        group = MGroup(uid, task, self.clock, self.next_seq)
        self.next_seq += 1
        self.groups[uid] = group
        self.counters["admitted_groups"] += 1
        self.used = True
        return group

    # -- sampling ------------------------------------------------------------------------------

    def age(self, g: int, group: MGroup) -> int:
        return g - group.step + 1

    def sampleable(self, group: MGroup) -> bool:
        return group.terminal and not (group.status is Status.FAILURE and self.failure == "evict")

    def ready(self, task: str | None = None) -> list[MGroup]:
        found = [g for g in self.groups.values() if self.sampleable(g) and (task is None or g.task == task)]
        return sorted(found, key=lambda g: (g.step, g.seq))

    def evict(self, g: int) -> list[tuple[str, list[str]]]:
        """The evictions of a sample at ``g``: (reason, uids) per task cell, in task order."""
        events = []
        for task in self.tasks:
            failed = sorted(
                (x for x in self.groups.values() if x.task == task and x.status is Status.FAILURE),
                key=lambda x: (x.step, x.seq),
            )
            if self.failure == "evict" and failed:
                events.append(("failure", [x.uid for x in failed]))
                for x in failed:
                    del self.groups[x.uid]
                    self.counters["evicted_failure_groups"] += 1
            if self.strategy == "drop":
                stale = [x for x in self.ready(task) if self.age(g, x) > self.thresholds[task]]
                if stale:
                    events.append(("stale", [x.uid for x in stale]))
                    for x in stale:
                        del self.groups[x.uid]
                        self.counters["evicted_stale_groups"] += 1
        return events

    def gate_open(self, g: int) -> bool:
        if self.strategy != "wait":
            return True
        return not any(
            not x.terminal and self.age(g, x) >= self.thresholds[x.task] for x in self.groups.values()
        )

    def choose(self, g: int, batch_size: int) -> list[MGroup] | None:
        """The batch a sample at ``g`` takes (after the evictions), or None."""
        quotas = self.quotas(batch_size)
        by_task = {task: self.ready(task) for task in self.tasks}
        if not self.gate_open(g):
            return None
        if self.policy == "wait":
            if any(len(by_task[task]) < quotas[task] for task in self.tasks):
                return None
            chosen = [x for task in self.tasks for x in by_task[task][: quotas[task]]]
            return sorted(chosen, key=lambda x: (x.step, x.seq))
        if sum(map(len, by_task.values())) < batch_size:
            return None
        everything = self.ready()
        # (1) every group that would be stale at the next step, oldest first, at most B
        chosen = [x for x in everything if self.age(g + 1, x) > self.thresholds[x.task]][:batch_size]
        # (2) each task's allowance (the groups of (1) count), oldest first among them
        allowed = []
        for task in self.tasks:
            allowance = max(0, quotas[task] + self.balances[task]) - sum(x.task == task for x in chosen)
            rest = [x for x in by_task[task] if x not in chosen]
            allowed += rest[: max(allowance, 0)]
        allowed.sort(key=lambda x: (x.step, x.seq))
        chosen += allowed[: batch_size - len(chosen)]
        # (3) what is left, oldest first from any task
        rest = [x for x in everything if x not in chosen]
        chosen += rest[: batch_size - len(chosen)]
        return sorted(chosen, key=lambda x: (x.step, x.seq))

    def take(self, g: int, batch: list[MGroup]) -> dict[str, int]:
        """Remove ``batch`` (taken at ``g``); return the balances before clipping."""
        for x in batch:
            del self.groups[x.uid]
            self.sampled[x.task] += 1
            self.counters["sampled_groups"] += 1
            self.shares.append(x.task)
        self.last_sampled = max(self.last_sampled, g)
        if self.policy != "borrow":
            return dict(self.balances)
        quotas = self.quotas(len(batch))
        return {
            task: self.balances[task] + quotas[task] - sum(x.task == task for x in batch)
            for task in self.tasks
        }


class MixtureMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.buf: ReplayBuffer | None = None
        self.model: Model | None = None
        self.backend = "asyncio"
        self.g = 0
        self.next_uid = 0
        self.events: list[tuple[str, list[str]]] = []
        self.warnings: list[str] = []
        self.handler = _Warnings(self.warnings)
        logging.getLogger("stalebuf").addHandler(self.handler)

    def teardown(self) -> None:
        logging.getLogger("stalebuf").removeHandler(self.handler)

    @property
    def b(self) -> ReplayBuffer:
        assert self.buf is not None
        return self.buf

    @property
    def m(self) -> Model:
        assert self.model is not None
        return self.model

    def fresh(self) -> str:
        self.next_uid += 1
        return f"g{self.next_uid}"

    @initialize(
        backend=st.sampled_from(("asyncio", "trio")),
        weights=st.lists(st.integers(1, 4), min_size=2, max_size=3),
        policy=st.sampled_from(("wait", "borrow")),
        threshold=st.integers(1, 3),
        own=st.lists(st.one_of(st.none(), st.integers(1, 3)), min_size=3, max_size=3),
        strategy=st.sampled_from(("drop", "wait")),
        failure=st.sampled_from(("sample", "evict")),
        admission=st.booleans(),
        batch_size=st.integers(1, 6),
    )
    def make_buffer(
        self,
        backend: str,
        weights: list[int],
        policy: str,
        threshold: int,
        own: list[int | None],
        strategy: str,
        failure: str,
        admission: bool,
        batch_size: int,
    ) -> None:
        mixture = dict(zip(NAMES, weights, strict=False))
        while min(reference_quotas(mixture, batch_size).values()) == 0:
            batch_size += 1  # the smallest B from the drawn one that starves no task
        task_thresholds = {
            task: t for task, t in zip(NAMES, own, strict=False) if t is not None and task in mixture
        }
        config = SamplerConfig(
            max_off_policy_threshold=threshold,
            max_off_policy_strategy=strategy,  # type: ignore[arg-type]
            failure_strategy=failure,  # type: ignore[arg-type]
            admission_batch_size=batch_size if admission else None,
            mixture=mixture,
            mixture_policy=policy,  # type: ignore[arg-type]
            task_thresholds=task_thresholds,
        )
        thresholds = {task: task_thresholds.get(task, threshold) for task in mixture}
        self.model = Model(
            mixture, policy, thresholds, strategy, failure, batch_size if admission else None, batch_size
        )
        self.buf = ReplayBuffer(config, on_evict=self.on_evict, status_log_interval=None)
        self.backend = backend

    def on_evict(self, event: Any) -> None:
        self.events.append((event.reason, [group.uid for group in event.groups]))

    # -- producers ----------------------------------------------------------------------------

    @rule(
        task=st.integers(0, 2),
        how=st.sampled_from(("finished", "finished", "failed", "open", "running")),
        count=st.integers(1, 4),
    )
    def produce(self, task: int, how: str, count: int) -> None:
        m = self.m
        name = m.tasks[task % len(m.tasks)]
        for _ in range(count):
            uid = self.fresh()
            tags = {"task": name}
            if how in ("finished", "failed"):
                call: Any = partial(self.b.put_group_nowait, uid, ["x"], tags=tags, status=how)
            else:
                call = partial(self.b.add_prompt_nowait, uid, tags=tags)
            admits = m.admits(name)
            _, exc = outcome(call)
            if not admits:
                assert isinstance(exc, BufferFullError), exc
                note("produce: refused, the task is full")
                return
            assert exc is None, exc
            group = m.add(uid, name)
            if how == "finished":
                group.status = Status.FINISHED
            elif how == "failed":
                group.status = Status.FAILURE
            elif how == "running":
                self.b.mark_running_nowait(uid)
                group.status = Status.RUNNING

    @rule(only=st.one_of(st.none(), st.integers(0, 2)), failed=st.integers(0, 5))
    def produce_a_batch(self, only: int | None, failed: int) -> None:
        """Finished groups for a whole batch: each task's quota, or B of one task (``only``);
        every ``failed``-th one failed (0: none). Stops at the first refusal."""
        m = self.m
        if only is None:
            plan = [task for task, quota in m.quotas(m.batch_size).items() for _ in range(quota)]
        else:
            plan = [m.tasks[only % len(m.tasks)]] * m.batch_size
        for position, task in enumerate(plan):
            uid = self.fresh()
            status = Status.FAILURE if failed and position % failed == failed - 1 else Status.FINISHED
            admits = m.admits(task)
            _, exc = outcome(partial(self.b.put_group_nowait, uid, ["x"], tags={"task": task}, status=status))
            if not admits:
                assert isinstance(exc, BufferFullError), exc
                return
            assert exc is None, exc
            m.add(uid, task).status = status

    @rule(index=st.integers(0, 30), failed=st.booleans(), count=st.integers(1, 3))
    def end(self, index: int, failed: bool, count: int) -> None:
        for _ in range(count):
            open_groups = [g for g in self.m.groups.values() if not g.terminal]
            if not open_groups:
                return
            group = open_groups[index % len(open_groups)]
            (self.b.mark_failed_nowait if failed else self.b.mark_finished_nowait)(group.uid)
            group.status = Status.FAILURE if failed else Status.FINISHED

    @rule(
        tags=st.sampled_from(({}, {"task": "zoo"}, {"task": 3}, {"kind": "art"}, {"task": ""})),
        how=st.integers(0, 2),
    )
    def refused_without_a_task(self, tags: dict[str, Any], how: int) -> None:
        before, uids = self.b.stats(), set(resident_groups(self.b))
        uid = self.fresh()
        call = (
            lambda: self.b.add_prompt_nowait(uid, tags=tags),
            lambda: self.b.put_group_nowait(uid, ["x"], tags=tags),
            lambda: self.b.put_group_nowait(uid, ["x"], tags=tags, status="failed"),
        )[how]
        _, exc = outcome(call)
        assert type(exc) is ValueError, exc
        assert self.b.stats() == before
        assert set(resident_groups(self.b)) == uids

    # -- the trainer -----------------------------------------------------------------------------

    @rule(in_loop=st.booleans())
    def sample(self, in_loop: bool) -> None:
        m, g, batch_size = self.m, self.g, self.m.batch_size
        self.events.clear()
        m.clock = max(m.clock, g)
        if m.used:
            m.evaluated = True
            events = m.evict(g)
            chosen = m.choose(g, batch_size)
        else:
            events, chosen = [], None
        if in_loop:

            async def call() -> Any:
                return await self.b.sample(g, batch_size, timeout=0)

            result, exc = outcome(lambda: anyio.run(call, backend=self.backend))
            not_ready: type[Exception] = TimeoutError
        else:
            result, exc = outcome(lambda: self.b.sample_nowait(g, batch_size))
            not_ready = BatchNotReadyError
        assert sorted(self.events) == sorted(events), (self.events, events)
        if chosen is None:
            assert isinstance(exc, not_ready), f"expected no batch at {g}, got {exc!r} {result}"
            note("sample: no batch")
            return
        assert exc is None, f"expected {[x.uid for x in chosen]} at {g}, got {exc!r}"
        batch, metrics = result
        assert batch.uids == [x.uid for x in chosen], f"at {g}: {batch.uids} != {[x.uid for x in chosen]}"
        assert len(batch) == batch_size
        note(f"sample: a batch ({m.policy})")
        for x in chosen:  # the hard bound, per task: drop always; wait under admission
            if m.strategy == "drop" or m.admission is not None:
                assert m.age(g, x) <= m.thresholds[x.task], f"{x.uid} of {x.task} trained at s={m.age(g, x)}"
        expected = m.take(g, chosen)
        self.check_balances(metrics, expected, batch_size)
        for task in m.tasks:
            key = f"training/mixture/{task}"
            assert metrics[f"{key}/groups"] == sum(x.task == task for x in chosen)
            assert metrics[f"{key}/share"] == m.shares.count(task) / len(m.shares)
        self.g += 1  # consecutive steps: the next sample is at g + 1

    def check_balances(self, metrics: dict[str, float], expected: dict[str, int], batch_size: int) -> None:
        """The balances the buffer reports against the text's; adopt them after a clip."""
        m = self.m
        got = {task: metrics[f"training/mixture/{task}/balance"] for task in m.tasks}
        assert all(value == int(value) for value in got.values())
        got = {task: int(value) for task, value in got.items()}
        cap = CAP_FACTOR * batch_size
        assert sum(got.values()) == 0, got
        assert all(abs(value) <= cap for value in got.values()), got
        if all(abs(value) <= cap for value in expected.values()):
            assert got == expected, (got, expected)
        else:  # clipped: the text leaves the spreading open; clipping and moving what was
            # clipped onto balances of the opposite sign only ever moves a balance toward 0
            note("borrow: a balance clipped")
            for task, before in expected.items():
                after = got[task]
                assert abs(after) <= abs(before), (task, before, after)
                assert after * before >= 0, (task, before, after)
        previous = m.balances
        for task in m.tasks:
            grew = got[task] > 0 and got[task] > previous[task]
            m.growth[task] = m.growth[task] + 1 if grew else 0
            if m.growth[task] >= 3:
                m.warned.add(task)
                note("borrow: a starvation warning")
        m.balances = got

    @rule(only=st.one_of(st.none(), st.integers(0, 2)), rounds=st.integers(1, 12), in_loop=st.booleans())
    def rounds_of_production_and_sampling(self, only: int | None, rounds: int, in_loop: bool) -> None:
        """The common loop: a batch's worth is produced (every task, or only one: the others
        starve), then the trainer samples; ``rounds`` times."""
        for _ in range(rounds):
            self.produce_a_batch(only, 0)
            self.sample(in_loop)

    @rule(smaller=st.integers(1, 5))
    def a_batch_size_that_starves_a_task_is_refused(self, smaller: int) -> None:
        m = self.m
        if min(m.quotas(smaller).values()) > 0:
            return
        before, clock = self.b.stats(), self.b.dispatch_step()
        _, exc = outcome(lambda: self.b.sample_nowait(self.g, smaller))
        assert type(exc) is ValueError, exc
        assert self.b.stats() == before
        assert self.b.dispatch_step() == clock
        note("sample: a starving batch size refused")

    @rule(full=st.integers(0, 2), other=st.integers(0, 2))
    def a_producer_waits_only_behind_its_own_task(self, full: int, other: int) -> None:
        """A producer of a full task parks in add_prompt; a producer of another task with a
        free slot is admitted at once, not queued behind it."""
        m = self.m
        if m.admission is None:
            return
        a, b = m.tasks[full % len(m.tasks)], m.tasks[other % len(m.tasks)]
        open_tag = m.clock >= m.last_sampled + 2 - m.thresholds[a]
        if a == b or not open_tag or m.admits(a) or not m.admits(b):
            return
        waiter_uid, other_uid = self.fresh(), self.fresh()

        async def scenario() -> tuple[bool, int, BaseException | None]:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    waiting = await start_call(tg, lambda: self.b.add_prompt(waiter_uid, tags={"task": a}))
                    parked = not waiting.done
                    queued = self.b.stats().partitions["train"].waiting_producers
                    _, exc = outcome(lambda: self.b.add_prompt_nowait(other_uid, tags={"task": b}))
                    waiting.scope.cancel()
            return parked and queued == 1, self.b.stats().partitions["train"].waiting_producers, exc

        parked, after, exc = anyio.run(scenario, backend=self.backend)
        assert parked, "the producer of the full task did not park"
        assert exc is None, f"a producer of {b!r} was blocked behind one of {a!r}: {exc!r}"
        assert after == 0
        m.add(other_uid, b)
        note("producer FIFO per task")

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        if self.model is None:
            return
        m, b = self.m, self.b
        views = resident_groups(b)
        assert set(views) == set(m.groups)
        for uid, view in views.items():
            group = m.groups[uid]
            assert (view.status, view.dispatch_step, view.tags["task"]) == (
                group.status,
                group.step,
                group.task,
            )
        if not m.used:
            return
        stats = b.stats().partitions["train"]
        for key, value in m.counters.items():
            assert getattr(stats, key) == value, key
        quotas = m.quotas(m.batch_size)
        for task in m.tasks:
            record = stats.tasks[task]
            resident = sum(1 for x in m.groups.values() if x.task == task)
            shortage = max(quotas[task] - len(m.ready(task)), 0) if m.evaluated else 0
            expected = (resident, m.sampled[task], m.balances[task], shortage)
            assert (record.resident, record.sampled, record.balance, record.shortage) == expected, task
            fresh = [
                x for x in m.ready(task) if m.strategy != "drop" or m.age(self.g, x) <= m.thresholds[task]
            ]
            assert b.sampleable_count(self.g, task=task) == len(fresh)
        assert sum(b.balance for b in stats.tasks.values()) == 0
        assert_conserved(b)

    @invariant()
    def admission_per_task(self) -> None:
        if self.model is None:
            return
        m, b = self.m, self.b
        if m.admission is None:
            assert b.free_slots() is None
            assert b.capacity() is None
            return
        quotas = m.quotas(m.admission)
        for task in m.tasks:
            assert b.capacity(task=task) == m.thresholds[task] * quotas[task]
            if m.used:
                assert b.free_slots(task=task) == m.free_slots(task)
                assert b.full(task=task) == (m.free_slots(task) == 0)
        assert b.capacity() == sum(m.thresholds[task] * quotas[task] for task in m.tasks)
        if m.used:
            assert b.free_slots() == sum(m.free_slots(task) or 0 for task in m.tasks)
            assert b.full() == all(m.free_slots(task) == 0 for task in m.tasks)
            for task in m.tasks:  # never more resident than T_i * S * q_i(b) (under wait: under
                if m.strategy != "wait":  # drop, stragglers to be dropped may add to it, as documented)
                    break
                resident = sum(1 for x in m.groups.values() if x.task == task)
                assert resident <= m.thresholds[task] * quotas[task]

    @invariant()
    def starvation_warnings(self) -> None:
        if self.model is None:
            return
        warned = {task for task in self.m.tasks if any(repr(task) in line for line in self.warnings)}
        assert warned == self.m.warned, (warned, self.m.warned, self.warnings)
        for task in self.m.tasks:
            assert sum(repr(task) in line for line in self.warnings) <= 1  # once per task per 60 s


class _Warnings(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING and "starved" in record.getMessage():
            self.lines.append(record.getMessage())


MixtureMachine.TestCase.settings = PROFILES[PROFILE]
TestMixturesAgainstModel = MixtureMachine.TestCase


# -- convergence over a long run --------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.integers(1, 5), min_size=2, max_size=3),
    batch_size=st.integers(2, 8),
    surplus=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    shortfalls=st.lists(st.tuples(st.integers(0, 199), st.integers(0, 2)), max_size=30),
)
def test_borrow_converges_when_every_task_produces_enough(
    weights: list[int], batch_size: int, surplus: list[int], shortfalls: list[tuple[int, int]]
) -> None:
    """Every task produces at least its quota each step on average (sometimes nothing for a
    step, then a catch-up): over 200 steps each task's share is within 1/B of its weight, every
    batch is exactly B, and the balances sum to 0 within ±4B."""
    mixture = dict(zip(NAMES, weights, strict=False))
    while min(reference_quotas(mixture, batch_size).values()) == 0:
        batch_size += 1
    quotas = reference_quotas(mixture, batch_size)
    buf = ReplayBuffer(
        SamplerConfig(mixture=mixture, mixture_policy="borrow", max_off_policy_threshold=None),
        status_log_interval=None,
    )
    skipped = {(step, NAMES[index % len(mixture)]) for step, index in shortfalls}
    owed = dict.fromkeys(mixture, 0)
    taken = dict.fromkeys(mixture, 0)
    uid = 0
    for step in range(200):
        for position, task in enumerate(mixture):
            produce = quotas[task] + surplus[position]
            if (step, task) in skipped:
                owed[task] += produce  # nothing this step: twice as much the next
                continue
            for _ in range(produce + owed[task]):
                uid += 1
                buf.put_group_nowait(f"g{uid}", ["x"], tags={"task": task})
            owed[task] = 0
        try:
            batch, metrics = buf.sample_nowait(step, batch_size)
        except BatchNotReadyError:  # a step where the others could not cover the skipped task
            continue
        assert len(batch) == batch_size
        for group in batch.groups:
            taken[group.tags["task"]] += 1
        balances = [metrics[f"training/mixture/{task}/balance"] for task in mixture]
        assert sum(balances) == 0
        assert max(map(abs, balances)) <= CAP_FACTOR * batch_size
    total = sum(taken.values())
    weight_total = sum(mixture.values())
    for task, weight in mixture.items():
        assert abs(Fraction(taken[task], total) - Fraction(weight, weight_total)) <= Fraction(1, batch_size)
