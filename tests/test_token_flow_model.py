"""The flow-control properties in tokens (issue 24), driven on the real buffer under asyncio and trio.

Producers always want to produce: clock-tagged ``add_prompt`` (and now and then one at an older
tag), without waiting or parked in ``add_prompt`` (FIFO per partition: a head parked at an older
tag with too little room there holds up the clock's producers behind it), each group finishing
or failing after a delay hypothesis picks, with 0 to 2 trajectories of random tokens in
``[0, M]`` (0 included); some runs filter groups out (a quarter of them) or evict failed ones.
The trainer calls the real ``sample(g, token_budget=K)`` (``sample_nowait``, or ``sample`` with
``timeout=0``) for consecutive ``g``, all in one event loop of the example's backend. Random
``T`` in 1..3, ``S`` in 1..2, ``M`` and ``K >= M``, under ``admission_token_budget=K``, under
``max_resident_tokens`` alone (any ``K``), and under both. A deterministic scheduler: hypothesis
picks every call, and every task runs until blocked after each.

- Hard bound (token admission, ``wait``): no returned group has staleness ``> T`` (checked on
  every batch) and nothing is evicted as stale. The residency cap alone bounds memory, not
  staleness (nothing caps a step's tokens), so the bound is not claimed there.
- Fill: at T*S = 1 under token admission alone, every batch holds more than ``K - M`` tokens.
- No deadlock (every mode): whenever no group is in flight, the trainer's ``sample`` returns a
  batch or a producer (parked, or a new one at the clock) is admitted. A state where neither
  holds (every producer refused, every admitted group terminal, the sample still not ready)
  fails the test.
- Liveness: after the random prefix, producers that keep producing groups of at least one token
  that the filter keeps (greedily: admit until refused, finish what is in flight) get the trainer
  three consecutive batches within a bounded number of calls.

The regression tests at the end are the issue's counterexamples to the simpler rules.

Profiles: the default runs 300 examples x 60 calls; ``STALEBUF_HYPOTHESIS_PROFILE=thorough``
runs 3000 x 120.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import anyio
import anyio.abc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from _helpers import LIMIT, Background, make, start_call, train_stats
from stalebuf import Batch, ReplayBuffer, SamplerConfig
from stalebuf.errors import BatchNotReadyError, BufferFullError, TagClosedError

PROFILES = {
    "ci": (300, 60),
    "thorough": (3000, 120),
}
EXAMPLES, CALLS = PROFILES[os.environ.get("STALEBUF_HYPOTHESIS_PROFILE", "ci")]
MODES = ("budget", "resident", "budget+resident")
ACTIONS = ("produce", "produce", "park", "older", "park older", "finish", "finish", "finish", "train")


@dataclass
class Flow:
    """One run: the buffer, the trainer's step and what the run saw."""

    buf: ReplayBuffer
    mode: str
    span: int  # T*S
    threshold: int
    per_group: int  # M
    budget: int  # the trainer's K
    admission: int  # admission_token_budget (unused under the residency cap alone)
    backend: str
    rejected: set[str]  # the uids the buffer's filter (if any) rejects when they finish
    g: int = 0
    clock: int = 0  # the dispatch clock: the largest step the trainer asked for
    in_flight: list[str] = field(default_factory=list)
    parked: list[tuple[str, Background]] = field(default_factory=list)  # waiting add_prompt calls
    uids: int = 0
    batches: int = 0
    oldest: int = 0  # the largest age g - tag + 1 of a returned group

    @property
    def bounded(self) -> bool:
        """Whether the hard bound is claimed: under token admission."""
        return self.mode != "resident"

    @property
    def fills(self) -> bool:
        """Whether the fill bound (more than ``K - M`` tokens a batch) is claimed: at T*S = 1
        under token admission alone (a residency refusal may come at any fill)."""
        return self.mode == "budget" and self.span == 1

    def produce(self, tag: int | None = None) -> bool:
        """A producer's ``add_prompt_nowait`` at the clock (or at ``tag``): whether it was admitted."""
        self.uids += 1
        uid = f"g{self.uids}"
        try:
            self.buf.add_prompt_nowait(uid, global_steps=tag)
        except (BufferFullError, TagClosedError):
            return False
        self.in_flight.append(uid)
        return True

    def finish(self, pick: int, tokens: list[int], failed: bool, rejected: bool = False) -> None:
        """The in-flight group ``pick`` gets trajectories of ``tokens`` and ends (``rejected``: the
        filter, if the run has one, filters it out)."""
        uid = self.in_flight.pop(pick % len(self.in_flight))
        if rejected:
            self.rejected.add(uid)
        for session, count in enumerate(tokens):
            self.buf.put_nowait(uid, None, session_id=session, tokens=count)
        (self.buf.mark_failed_nowait if failed else self.buf.mark_finished_nowait)(uid)

    async def train(self, by_call: bool) -> bool:
        """The trainer's ``sample(g, token_budget=K)``, once: whether it returned a batch (checked)."""
        self.clock = max(self.clock, self.g)
        try:
            if by_call:
                batch, metrics = await self.buf.sample(self.g, token_budget=self.budget, timeout=0)
            else:
                batch, metrics = self.buf.sample_nowait(self.g, token_budget=self.budget)
        except (TimeoutError, BatchNotReadyError):
            return False
        self.check(batch, metrics)
        self.g += 1
        return True

    async def park(self, tg: anyio.abc.TaskGroup, tag: int | None) -> None:
        """A producer's waiting ``add_prompt`` at the clock (or at ``tag``), run until it parks."""
        self.uids += 1
        uid = f"g{self.uids}"
        self.parked.append((uid, await start_call(tg, lambda: self.buf.add_prompt(uid, global_steps=tag))))

    async def settle(self) -> None:
        """Let every task run; the parked producers that were admitted are in flight now."""
        await anyio.wait_all_tasks_blocked()
        waiting = []
        for uid, call in self.parked:
            if not call.done:
                waiting.append((uid, call))
            elif call.returned:
                self.in_flight.append(uid)
            else:
                assert isinstance(call.error, TagClosedError), call.error  # its tag closed
        self.parked = waiting

    def check(self, batch: Batch, metrics: dict[str, float]) -> None:
        """A batch at ``g``: the hard bound (under token admission), its tokens within ``K``."""
        ages = [self.g - group.dispatch_step + 1 for group in batch.groups]
        self.oldest = max(self.oldest, *ages)
        self.batches += 1
        if self.fills:
            tokens = metrics["training/batch/tokens"]
            assert tokens > self.admission - self.per_group, f"fill {tokens} <= K - M at T*S = 1"
        if self.bounded:
            assert max(ages) <= self.span, f"staleness > T: ages {ages} at step {self.g}, T*S = {self.span}"
            assert float(batch.staleness.max()) <= self.threshold
            assert metrics["training/batch/oversized_groups"] == 0
        tokens = sum(t.tokens for group in batch.groups for t in group.trajectories)
        assert metrics["training/batch/tokens"] == tokens
        assert metrics["training/batch/oversized_groups"] == int(tokens > self.budget)
        assert train_stats(self.buf).evicted_stale_groups == 0

    async def stuck(self, by_call: bool) -> None:
        """If nothing is in flight, the trainer's call returns a batch or a producer is admitted
        (a parked one, or a new one at the clock); neither is a deadlock."""
        await self.settle()
        if self.in_flight or await self.train(by_call):
            return
        await self.settle()  # the sample may have woken a parked producer (an eviction's refund)
        if self.in_flight or self.produce():
            return
        stats = train_stats(self.buf)
        raise AssertionError(
            f"deadlock at step {self.g}: every producer refused, nothing in flight, no batch "
            f"({stats.finished + stats.failure} groups terminal, {stats.resident_tokens} tokens resident, "
            f"free_tokens {self.buf.free_tokens()}, {stats.waiting_producers} producers parked)"
        )


def build(data: st.DataObject) -> Flow:
    """A random config and its flow."""
    mode = data.draw(st.sampled_from(MODES), label="mode")
    threshold, sync = data.draw(st.integers(1, 3), label="T"), data.draw(st.integers(1, 2), label="S")
    per_group = data.draw(st.integers(1, 12), label="M")
    admission = per_group + data.draw(st.integers(0, 24), label="K - M")
    resident = per_group + data.draw(st.integers(0, 40), label="R - M")
    if mode == "resident":
        budget = data.draw(st.integers(1, 40), label="K (sample)")
    else:
        budget = admission + data.draw(st.sampled_from((0, 0, 0, 1, 5)), label="K (sample) - K")
    rejected: set[str] = set()
    filters = (lambda group: group.uid not in rejected,) if data.draw(st.booleans(), label="filter") else ()
    config = SamplerConfig(
        max_off_policy_threshold=threshold,
        max_off_policy_strategy="wait",
        parameter_sync_step=sync,
        failure_strategy=data.draw(st.sampled_from(("sample", "evict")), label="failure_strategy"),
        max_tokens_per_group=per_group,
        admission_token_budget=None if mode == "resident" else admission,
        max_resident_tokens=None if mode == "budget" else resident,
    )
    buf = ReplayBuffer(config, filters=filters, status_log_interval=None)
    backend = data.draw(st.sampled_from(("asyncio", "trio")), label="backend")
    return Flow(buf, mode, threshold * sync, threshold, per_group, budget, admission, backend, rejected)


def draw_tokens(data: st.DataObject, per_group: int, least: int = 0) -> list[int]:
    """0 to 2 trajectories (at least one if ``least``) whose tokens sum to at most ``per_group``."""
    first = data.draw(st.integers(least, per_group))
    n = data.draw(st.integers(1 if least else 0, 2))
    if n == 0:
        return []
    if n == 1:
        return [first]
    return [first, data.draw(st.integers(0, per_group - first))]


async def run_calls(flow: Flow, data: st.DataObject, tg: anyio.abc.TaskGroup) -> None:
    """The random prefix: ``CALLS`` calls hypothesis picks, the deadlock check after each."""
    for _ in range(CALLS):
        action = data.draw(st.sampled_from(ACTIONS))
        by_call = data.draw(st.booleans())
        if action == "produce":
            flow.produce()
        elif action == "park":
            await flow.park(tg, None)
        elif action in ("older", "park older"):
            tag = max(flow.clock - data.draw(st.integers(0, 3)), 0)
            await flow.park(tg, tag) if action == "park older" else flow.produce(tag)
        elif action == "finish" and flow.in_flight:
            failed, rejected = data.draw(st.integers(0, 5)) == 0, data.draw(st.integers(0, 3)) == 0
            flow.finish(data.draw(st.integers(0, 50)), draw_tokens(data, flow.per_group), failed, rejected)
        elif action == "train":
            await flow.train(by_call)
        await flow.stuck(by_call)


async def drain(flow: Flow, data: st.DataObject, steps: int = 3) -> None:
    """Greedy producers of groups of at least one token: each of ``steps`` consecutive samples
    returns within a bounded number of calls (every finished group adds a ready token, and the
    sample is ready at ``K`` tokens or a refusal)."""
    for _ in range(steps):
        start, calls = flow.g, 0
        while flow.g == start:
            calls += 1
            assert calls <= 6 * (flow.budget + 2) + 20, f"the sample at step {start} did not return"
            await flow.settle()
            if await flow.train(data.draw(st.booleans())):
                break
            if flow.in_flight:
                flow.finish(0, draw_tokens(data, flow.per_group, least=1), failed=False)
            else:
                assert flow.produce() or flow.parked, f"deadlock at step {flow.g}"
                while flow.produce():
                    pass


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_flow_control_properties_hold_in_tokens(data: st.DataObject) -> None:
    flow = build(data)

    async def main() -> None:
        with anyio.fail_after(LIMIT * 6):
            async with anyio.create_task_group() as tg:
                await run_calls(flow, data, tg)
                if flow.budget <= 40:
                    await drain(flow, data)
                tg.cancel_scope.cancel()

    anyio.run(main, backend=flow.backend)
    event(f"{flow.mode}: {min(flow.batches, 5)}{'+' if flow.batches >= 5 else ''} batches")
    if flow.bounded:
        event(f"{flow.mode}: the oldest group reached age T*S" if flow.oldest == flow.span else "below T*S")


# -- the counterexamples ------------------------------------------------------------------


def test_waiting_for_K_tokens_would_deadlock_the_refusal_makes_the_batch() -> None:
    """T*S = 1, K = 100, M = 60: one group is admitted and settles to 50; the free 50 cannot take
    another reservation of 60, so a sample that waited for 100 tokens would wait forever. The
    readiness rule sees the refusal and returns the 50-token group."""
    buf = make(
        max_off_policy_threshold=1,
        max_off_policy_strategy="wait",
        admission_token_budget=100,
        max_tokens_per_group=60,
    )
    buf.add_prompt_nowait("a")
    buf.put_nowait("a", None, session_id=0, tokens=50)
    buf.mark_finished_nowait("a")
    assert buf.free_tokens() == 50
    with pytest.raises(BufferFullError):
        buf.add_prompt_nowait("b")
    batch, metrics = buf.sample_nowait(0, token_budget=100)
    assert batch.uids == ["a"]
    assert metrics["training/batch/tokens"] == 50
    assert metrics["training/batch/fill"] == 0.5


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_waiting_sample_wakes_when_the_refusal_comes(anyio_backend: str) -> None:
    """The same counterexample with the sample parked first (the gate shut while ``a`` is in
    flight): ``a`` settling to 50 opens the gate and leaves 50 < M of room, and that one
    transition wakes the sample with the refusal true."""
    buf = make(
        max_off_policy_threshold=1,
        max_off_policy_strategy="wait",
        admission_token_budget=100,
        max_tokens_per_group=60,
    )
    buf.add_prompt_nowait("a")
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            call = await start_call(tg, lambda: buf.sample(0, token_budget=100))
            assert not call.done  # a is in flight: the gate is shut at T*S = 1
            buf.put_nowait("a", None, session_id=0, tokens=50)
            buf.mark_finished_nowait("a")
            await anyio.wait_all_tasks_blocked()
            assert call.returned
    batch, _ = call.result
    assert batch.uids == ["a"]


@pytest.mark.parametrize(("settles", "ready"), [(40, False), (41, True)])
def test_the_fill_at_one_step_of_staleness_is_more_than_K_minus_M(settles: int, ready: bool) -> None:
    """At T*S = 1 (K = 100, M = 60) a batch holds more than K - M = 40 tokens: a group settling to
    41 leaves 59 < M of room, so the refusal lets the 41 go; one settling to 40 leaves room for
    another reservation, so the sample waits for it (the flow test checks the bound on every
    batch at T*S = 1)."""
    buf = make(
        max_off_policy_threshold=1,
        max_off_policy_strategy="wait",
        admission_token_budget=100,
        max_tokens_per_group=60,
    )
    buf.add_prompt_nowait("a")
    buf.put_nowait("a", None, session_id=0, tokens=settles)
    buf.mark_finished_nowait("a")
    if not ready:
        with pytest.raises(BatchNotReadyError):
            buf.sample_nowait(0, token_budget=100)
        buf.add_prompt_nowait("b")  # the room the sample waits to see filled
        return
    batch, metrics = buf.sample_nowait(0, token_budget=100)
    assert batch.uids == ["a"]
    assert metrics["training/batch/tokens"] == 41
