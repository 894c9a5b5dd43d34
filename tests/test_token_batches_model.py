"""Model-based test of token batches (issue 24): the buffer against a brute-force reference
written from the issue's text, under asyncio and trio.

Random configs (``drop`` or ``wait``, ``T`` in 1..3, ``S`` in 1..2, failures sampled or
evicted), groups with random token counts (0 included), some with versions older or newer than
their dispatch step (a head below it), producers that add, fill, finish and fail groups, and a
trainer that samples by tokens (and now and then by a count) at non-decreasing steps, on the
gated "train" and the exempt "val" partition. The reference keeps plain lists and scans them:

- evaluation: evict the failed groups (``failure_strategy="evict"``) and, under ``drop``, the
  terminal groups whose head has ``g - head + 1 > T*S`` (never on "val");
- readiness: the wait gate open (under ``wait``: no in-flight head with ``g - head + 1 >= T*S``),
  at least one group sampleable, and their tokens ``>= K`` (a count: ``>= B`` groups);
- the batch: the sampleable groups by (dispatch step, admission order); the longest prefix whose
  tokens are ``<= K``, or, when the first group holding tokens is alone over ``K``, the prefix
  through it (``oversized_groups`` 1).

Checked after every sample: the batch, its order, the evictions, the three batch metrics, the
one WARNING per partition about a group of 0 tokens; after every step: the partition's running
total of ready tokens against the groups counted one by one and against the reference. One rule
parks a sample and drives producers under it, checking after each call that the sample has
returned exactly when the reference says a batch is ready (the wake-up is neither missed nor
early), and what it returned.

Profiles: the default runs 150 examples x 40 steps; ``STALEBUF_HYPOTHESIS_PROFILE=thorough``
runs 1000 x 80.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from _helpers import LIMIT, ready_tokens
from stalebuf import EvictionEvent, ReplayBuffer, SamplerConfig, Status
from stalebuf.errors import BatchNotReadyError

PROFILES = {
    "ci": settings(
        max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    ),
    "thorough": settings(
        max_examples=1000, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    ),
}
PROFILE = os.environ.get("STALEBUF_HYPOTHESIS_PROFILE", "ci")
PARTITIONS = ("train", "val")  # "val" is exempt: no gate, no eviction
TOKENS = st.integers(0, 60) | st.sampled_from([0, 0, 150])  # empty groups, and oversized ones


@dataclass
class MGroup:
    uid: str
    partition: str
    step: int
    seq: int
    head: int
    tokens: int = 0
    status: Status = Status.PENDING

    @property
    def terminal(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILURE)


@dataclass
class Model:
    """The issue's text as lists and scans; nothing shared with the buffer."""

    drops: bool
    span: int  # T*S
    evict_failures: bool
    groups: dict[str, MGroup] = field(default_factory=dict)
    seq: int = 0
    zero_selected: set[str] = field(default_factory=set)

    def resident(self, partition: str) -> list[MGroup]:
        return [g for g in self.groups.values() if g.partition == partition]

    def ready(self, partition: str) -> list[MGroup]:
        """The terminal groups a sample could take (before this sample's evictions)."""
        return [
            g
            for g in self.resident(partition)
            if g.terminal
            and not (self.evict_failures and partition == "train" and g.status is Status.FAILURE)
        ]

    def evict(self, partition: str, g: int) -> set[str]:
        if partition == "val":
            return set()
        gone = {
            m.uid
            for m in self.resident(partition)
            if m.terminal
            and (
                (self.evict_failures and m.status is Status.FAILURE)
                or (self.drops and g - m.head + 1 > self.span)
            )
        }
        for uid in gone:
            del self.groups[uid]
        return gone

    def gate_open(self, partition: str, g: int) -> bool:
        if self.drops or partition == "val":
            return True
        return not any(not m.terminal and g - m.head + 1 >= self.span for m in self.resident(partition))

    def batch(self, partition: str, g: int, budget: int | None, count: int | None) -> list[MGroup] | None:
        """What a sample finds after its evictions (which the caller ran): the batch, or None."""
        order = sorted(self.ready(partition), key=lambda m: (m.step, m.seq))
        if not self.gate_open(partition, g):
            return None
        if count is not None:
            return order[:count] if len(order) >= count else None
        assert budget is not None
        if not order or sum(m.tokens for m in order) < budget:
            return None
        taken: list[MGroup] = []
        total = 0
        for m in order:
            if total + m.tokens > budget:
                if total == 0:  # the first group holding tokens, alone over the budget
                    taken.append(m)
                break
            taken.append(m)
            total += m.tokens
        return taken

    def exact_budget(self, partition: str, budget: int, exact: int | None) -> int:
        """``budget``, or (``exact`` given) the tokens of the first ``exact + 1`` sampleable
        groups, when they hold any: a prefix that meets the budget exactly, the boundary case."""
        order = sorted(self.ready(partition), key=lambda m: (m.step, m.seq))
        if exact is None or not order:
            return budget
        total = sum(m.tokens for m in order[: exact % len(order) + 1])
        return total or budget

    def take(self, partition: str, taken: list[MGroup], by_tokens: bool) -> None:
        for m in taken:
            del self.groups[m.uid]
        if by_tokens and any(m.tokens == 0 for m in taken):  # (a count batch never warns)
            self.zero_selected.add(partition)


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "of 0 tokens" in record.getMessage():
            self.messages.append(record.getMessage())


class TokenBatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.buf: ReplayBuffer | None = None
        self.model: Model | None = None
        self.backend = "asyncio"
        self.step = 0
        self.next_uid = 0
        self.events: list[EvictionEvent] = []
        self.warnings = Warnings()
        logging.getLogger("stalebuf").addHandler(self.warnings)

    def teardown(self) -> None:
        logging.getLogger("stalebuf").removeHandler(self.warnings)

    @property
    def b(self) -> ReplayBuffer:
        assert self.buf is not None
        return self.buf

    @property
    def m(self) -> Model:
        assert self.model is not None
        return self.model

    def run(self, make: Callable[[], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            with anyio.fail_after(LIMIT):
                return await make()

        return anyio.run(main, backend=self.backend)

    def in_flight(self, which: int) -> MGroup | None:
        flying = [g for g in self.m.groups.values() if not g.terminal]
        return flying[which % len(flying)] if flying else None

    @initialize(
        drops=st.booleans(),
        threshold=st.integers(1, 3),
        sync_step=st.integers(1, 2),
        evict_failures=st.booleans(),
        backend=st.sampled_from(["asyncio", "trio"]),
    )
    def setup(self, drops: bool, threshold: int, sync_step: int, evict_failures: bool, backend: str) -> None:
        config = SamplerConfig(
            max_off_policy_threshold=threshold,
            max_off_policy_strategy="drop" if drops else "wait",
            parameter_sync_step=sync_step,
            failure_strategy="evict" if evict_failures else "sample",
        )
        self.buf = ReplayBuffer(config, on_evict=self.events.append, status_log_interval=None)
        self.model = Model(drops, threshold * sync_step, evict_failures)
        self.backend = backend

    # -- producers ------------------------------------------------------------------------

    def new_group(self, partition: str, back: int, head: int | None = None) -> MGroup:
        step = max(0, self.step - back)
        self.next_uid += 1
        self.m.seq += 1
        group = MGroup(
            f"g{self.next_uid}", partition, step, self.m.seq, step if head is None else min(head, step)
        )
        self.m.groups[group.uid] = group
        return group

    @rule(which=st.integers(0, 1), back=st.integers(0, 3))
    def add_prompt(self, which: int, back: int) -> None:
        group = self.new_group(PARTITIONS[which], back)
        self.b.add_prompt_nowait(group.uid, global_steps=group.step, partition=group.partition)

    @rule(which=st.integers(0, 63), tokens=TOKENS, version=st.none() | st.integers(0, 8))
    def put(self, which: int, tokens: int, version: int | None) -> None:
        group = self.in_flight(which)
        if group is None:
            return
        if version is None or tokens == 0:
            self.b.put_nowait(group.uid, "x", session_id=self.m.seq, tokens=tokens)
        else:
            self.b.put_nowait(group.uid, "x", session_id=self.m.seq, versions=[(version, tokens)])
            group.head = min(group.head, version)
        self.m.seq += 1  # (a fresh session id per put)
        group.tokens += tokens

    @rule(which=st.integers(0, 63), finish=st.booleans())
    def end(self, which: int, finish: bool) -> None:
        group = self.in_flight(which)
        if group is None:
            return
        if finish:
            self.b.mark_finished_nowait(group.uid)
        else:
            self.b.mark_failed_nowait(group.uid)
        group.status = Status.FINISHED if finish else Status.FAILURE

    @rule(
        which=st.integers(0, 1),
        back=st.integers(0, 3),
        tokens=st.lists(TOKENS, min_size=1, max_size=3),
        older=st.none() | st.integers(0, 4),
        finish=st.booleans(),
    )
    def put_group(self, which: int, back: int, tokens: list[int], older: int | None, finish: bool) -> None:
        step = max(0, self.step - back)
        head = None if older is None else max(0, step - older)
        group = self.new_group(PARTITIONS[which], back, head)
        versions: list[Any] = [None] * len(tokens)
        if head is not None and tokens[0]:
            versions[0] = [(head, tokens[0])]  # the first trajectory's tokens are older: the head
        else:
            group.head = step
        self.b.put_group_nowait(
            group.uid,
            ["x"] * len(tokens),
            global_steps=step,
            partition=group.partition,
            tokens=tokens,
            versions=versions,
            status="finished" if finish else "failure",
        )
        group.tokens = sum(tokens)
        group.status = Status.FINISHED if finish else Status.FAILURE

    # -- the trainer ------------------------------------------------------------------------

    @rule(
        advance=st.integers(0, 1),
        which=st.integers(0, 1),
        budget=st.integers(1, 120),
        exact=st.none() | st.integers(0, 7),
        by_count=st.none() | st.integers(1, 3),
        waits=st.booleans(),
    )
    def sample(
        self, advance: int, which: int, budget: int, exact: int | None, by_count: int | None, waits: bool
    ) -> None:
        self.step += advance
        g, partition, model = self.step, PARTITIONS[which], self.m
        gone = model.evict(partition, g)
        budget = model.exact_budget(partition, budget, exact)
        expected = model.batch(partition, g, None if by_count else budget, by_count)
        self.events.clear()
        kwargs: dict[str, Any] = {"partition": partition}
        if by_count is None:
            kwargs["token_budget"] = budget
        try:
            if waits:
                batch, metrics = self.run(lambda: self.b.sample(g, by_count, timeout=0, **kwargs))
            else:
                batch, metrics = self.b.sample_nowait(g, by_count, **kwargs)
        except (TimeoutError, BatchNotReadyError):
            batch = metrics = None
        assert {group.uid for event in self.events for group in event.groups} == gone
        if expected is None:
            assert batch is None
            return
        assert batch is not None
        assert metrics is not None
        self.check_batch(partition, expected, batch.uids, metrics, None if by_count else budget)

    def check_batch(
        self, partition: str, expected: list[MGroup], uids: list[str], metrics: Any, budget: int | None
    ) -> None:
        assert uids == [m.uid for m in expected]
        self.m.take(partition, expected, budget is not None)
        prefix = "training" if partition == "train" else "validation"
        if budget is None:
            assert f"{prefix}/batch/tokens" not in metrics
            return
        tokens = sum(m.tokens for m in expected)
        oversized = tokens > budget
        assert oversized == (len(expected) >= 1 and expected[-1].tokens > budget)
        assert metrics[f"{prefix}/batch/tokens"] == tokens
        assert metrics[f"{prefix}/batch/fill"] == tokens / budget
        assert metrics[f"{prefix}/batch/oversized_groups"] == float(oversized)

    @precondition(lambda self: self.model is not None)
    @rule(
        which=st.integers(0, 1),
        budget=st.integers(1, 120),
        exact=st.none() | st.integers(0, 7),
        ops=st.lists(
            st.tuples(st.sampled_from(["put", "finish", "fail", "group"]), st.integers(0, 63), TOKENS),
            max_size=8,
        ),
    )
    def parked_sample(
        self, which: int, budget: int, exact: int | None, ops: list[tuple[str, int, int]]
    ) -> None:
        """A sample parked by tokens, and producers under it: it returns exactly when ready."""
        g, partition, model = self.step, PARTITIONS[which], self.m
        budget = model.exact_budget(partition, budget, exact)
        outcome: dict[str, Any] = {}

        async def sampler() -> None:
            outcome["result"] = await self.b.sample(g, token_budget=budget, partition=partition)

        async def body() -> None:
            async with anyio.create_task_group() as tg:
                expected = None
                for index in range(len(ops) + 1):
                    if index:
                        self.apply(ops[index - 1], partition)
                    else:
                        tg.start_soon(sampler)
                    await anyio.wait_all_tasks_blocked()
                    model.evict(partition, g)  # each wake-up evicts what is stale
                    expected = model.batch(partition, g, budget, None)
                    assert ("result" in outcome) == (expected is not None)
                    if expected is not None:
                        batch, metrics = outcome["result"]
                        self.check_batch(partition, expected, batch.uids, metrics, budget)
                        return
                tg.cancel_scope.cancel()  # never ready: cancelled, it takes nothing

        self.run(body)

    def apply(self, op: tuple[str, int, int], partition: str) -> None:
        kind, which, tokens = op
        if kind == "group":
            group = self.new_group(partition, 0)
            self.b.put_group_nowait(
                group.uid, ["x"], global_steps=group.step, partition=partition, tokens=[tokens]
            )
            group.tokens, group.status = tokens, Status.FINISHED
        elif kind == "put":
            self.put(which, tokens, None)
        else:
            self.end(which, kind == "finish")

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def ready_tokens_are_kept_exactly(self) -> None:
        if self.model is None:
            return
        for partition in PARTITIONS:
            kept, counted = ready_tokens(self.b, partition)
            assert kept == counted == sum(m.tokens for m in self.m.ready(partition))

    @invariant()
    def one_warning_per_partition_with_a_group_of_0_tokens(self) -> None:
        if self.model is None:
            return
        warned = sorted("'val'" in message for message in self.warnings.messages)
        expected = sorted(partition == "val" for partition in self.m.zero_selected)
        assert warned == expected


TokenBatchMachine.TestCase.settings = PROFILES[PROFILE]
TestTokenBatchesAgainstModel = TokenBatchMachine.TestCase
