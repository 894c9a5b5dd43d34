"""Model-based test of token admission (issue 24): the buffer against a brute-force reference,
under asyncio and trio.

Random ``T``, ``S``, ``M`` (``max_tokens_per_group``) and one of four cap modes: token
admission (``admission_token_budget``), token admission with ``max_resident_tokens``, the
residency cap alone, and group admission (``admission_batch_size``) with the residency cap.
Producers add in-flight groups (clock-tagged and explicit), put trajectories with random token
counts (past ``M`` too), finish or fail them, and write whole groups; a trainer samples at
consecutive steps. The reference recomputes everything from the groups it holds, by brute force:
an in-flight group counts ``M`` at its tag and against the residency cap, a terminal group its
own tokens, a group gone nothing; a producer is admitted iff its tag is open (not ahead of the
clock, not stale at the next sample) and the room at its tag and under the residency cap is at
least what it counts. Checked after every step: every refusal (its error class, and that it
changed nothing), ``stats()``'s ``resident_tokens``/``reserved_tokens``/``tokens``,
``free_tokens``, ``capacity_tokens``, ``full``, the readiness seam ``refuses_token_group``, the
per-tag and residency bounds, the conservation laws; and a parked producer is woken by the
refund of a settling reservation (or a batch) exactly when the reference admits it.

The trainer is :class:`Trainer`: count batches under group admission, and otherwise the real
``sample(g, token_budget=K)`` (``sample_nowait``, or ``sample`` with ``timeout=0`` under the
example's backend) at consecutive steps ``g`` (a step that returned no batch is retried at the
same ``g``), ``K`` the admission budget (now and then more) or, under the residency cap alone, any
``K >= 1``. The reference's readiness rule: the wait gate open, a group sampleable, and its tokens
``>= K``, or a clock-tagged ``add_prompt`` refused at tag ``max(clock, g)`` while no group the
sample could train is in flight (the issue's rule without that last clause made batches far too
small: see ``Rules.token_batch_ready``). One rule parks a real ``sample`` and lets producers act
under it: it returns exactly when the reference says so (the call that makes it ready wakes it).

The flow-control properties, checked at every step (:meth:`TokenAdmissionMachine.flow_control`):
under token admission (``wait``), no returned group has staleness ``> T`` and nothing is evicted
as stale (the hard bound); in every token mode, a state where no group is in flight and a
clock-tagged ``add_prompt`` is refused is one where the trainer's next sample returns a batch
(no deadlock). ``tests/test_token_flow_model.py`` drives producers that always want to produce
and checks the same on the real buffer alone.

Profiles: the default runs 200 examples x 40 steps; ``STALEBUF_HYPOTHESIS_PROFILE=thorough``
runs 1000 x 100.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from _helpers import assert_conserved, refuses_token_group, resident_groups, start_call
from stalebuf import ReplayBuffer, SamplerConfig
from stalebuf.errors import BatchNotReadyError, BufferFullError, FutureTagError, TagClosedError

PROFILES = {
    "ci": settings(
        max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    ),
    "thorough": settings(
        max_examples=1000,
        stateful_step_count=100,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    ),
}
PROFILE = os.environ.get("STALEBUF_HYPOTHESIS_PROFILE", "ci")

#: The cap modes: which of admission_token_budget (K), max_resident_tokens (R), admission_batch_size (b).
MODES = ("budget", "budget+resident", "resident", "groups+resident")


@dataclass
class MGroup:
    """A resident group as the reference sees it."""

    tag: int
    seq: int
    in_flight: bool = True
    failed: bool = False
    tokens: int = 0


class Model:
    """The reference: groups by uid, the clock and the last sampled step, and the rules written
    from the issue's text, by brute force over the groups."""

    def __init__(
        self, mode: str, threshold: int, sync: int, per_group: int, budget: int, resident: int, cap: int
    ) -> None:
        self.mode = mode
        self.span = threshold * sync
        self.threshold, self.sync = threshold, sync
        self.per_group = per_group
        self.budget = budget if mode.startswith("budget") else None
        self.resident = resident if "resident" in mode else None
        self.cap = cap if mode.startswith("groups") else None
        self.tagged = self.budget is not None or self.cap is not None
        self.groups: dict[str, MGroup] = {}
        self.clock = 0
        self.last_sampled = -1
        self.seq = 0
        self.used = False  # the partition exists (a refused first call creates nothing)

    # -- counting, by brute force -----------------------------------------------------------

    def counts(self, group: MGroup) -> int:
        return self.per_group if group.in_flight else group.tokens

    def at(self, tag: int) -> int:
        return sum(self.counts(group) for group in self.groups.values() if group.tag == tag)

    def total(self) -> int:
        return sum(self.counts(group) for group in self.groups.values())

    def room(self, tag: int) -> int | None:
        rooms = []
        if self.budget is not None:
            rooms.append(self.budget - self.at(tag))
        if self.resident is not None:
            rooms.append(self.resident - self.total())
        return min(rooms) if rooms else None

    def closed(self, tag: int) -> bool:
        return self.tagged and tag < self.last_sampled + 2 - self.span

    # -- the admission rule -----------------------------------------------------------------

    def refusal(self, requested: int | None, need: int) -> type[Exception] | None:
        """The error a ``*_nowait`` producer asking for ``requested`` (None: the clock) and
        counting ``need`` tokens gets, or None if admitted."""
        tag = self.clock if requested is None else requested
        if self.tagged and tag > self.clock:
            return FutureTagError
        closed = self.closed(tag)
        if self.cap is not None and sum(1 for g in self.groups.values() if g.tag == tag) >= self.cap:
            return TagClosedError if requested is not None and closed else BufferFullError
        if closed:
            return TagClosedError if requested is not None else BufferFullError
        room = self.room(tag)
        if room is not None and room < need:
            return BufferFullError
        return None

    def admit(self, uid: str, requested: int | None, *, terminal: bool = False, tokens: int = 0) -> None:
        tag = self.clock if requested is None else requested
        self.groups[uid] = MGroup(tag, self.seq, not terminal, False, tokens)
        self.seq += 1
        self.used = True

    def free_tokens(self) -> int | None:
        if self.budget is None and self.resident is None:
            return None
        if not self.used:
            return min(c for c in (self.budget, self.resident) if c is not None)
        if self.closed(self.clock):
            return 0
        room = self.room(self.clock)
        assert room is not None
        return max(room, 0)

    def capacity_tokens(self) -> int | None:
        bounds = [c for c in (self.resident,) if c is not None]
        if self.budget is not None:
            bounds.append(self.threshold * self.sync * self.budget)
        return min(bounds) if bounds else None

    def refuses(self, tag: int) -> bool:
        if not self.used:
            return False
        if self.budget is not None and self.closed(tag):
            return True
        room = self.room(tag)
        return room is not None and room < self.per_group

    # -- the trainer's batch ----------------------------------------------------------------

    def ready(self) -> list[tuple[str, MGroup]]:
        terminal = [(uid, g) for uid, g in self.groups.items() if not g.in_flight]
        return sorted(terminal, key=lambda item: (item[1].tag, item[1].seq))

    def gate_open(self, g: int) -> bool:
        """The wait gate: no in-flight group with ``g - tag + 1 >= T*S``."""
        return all(g - x.tag + 1 < self.span for x in self.groups.values() if x.in_flight)


class Trainer:
    """How the machine's trainer takes a batch at step ``g``; returns the sampled uids, or None.

    Count batches of ``batch_size`` under group admission; otherwise the real
    ``sample(g, token_budget=K)``: ``sample_nowait``, or ``sample`` with ``timeout=0`` run under
    ``backend`` (``by_call`` picks which).
    """

    def __init__(self, model: Model, batch_size: int, budget: int, backend: str) -> None:
        self.model, self.batch_size, self.budget, self.backend = model, batch_size, budget, backend

    @property
    def by_tokens(self) -> bool:
        return self.model.cap is None

    def ready(self, g: int) -> bool:
        """The readiness rule for a sample of ``K`` tokens at ``g``, with the clock the call
        moves to: gate open, a group sampleable, and ``>= K`` tokens, or a refusal at
        ``max(clock, g)`` while no group ``sample(g)`` could train (tag ``>= g + 1 - T*S``) is
        in flight (not the issue's refusal alone: see ``Rules.token_batch_ready``)."""
        m = self.model
        ready = m.ready()
        if not ready or not m.gate_open(g):
            return False
        if sum(group.tokens for _, group in ready) >= self.budget:
            return True
        trainable = any(x.in_flight and x.tag >= g + 1 - m.span for x in m.groups.values())
        return m.refuses(max(m.clock, g)) and not trainable

    def expected(self, g: int) -> tuple[list[str], int, bool] | None:
        """The reference's batch at ``g``: ``(uids, tokens, oversized)``, or None."""
        m = self.model
        ready = m.ready()
        if not self.by_tokens:
            if len(ready) < self.batch_size or not m.gate_open(g):
                return None
            return [uid for uid, _ in ready[: self.batch_size]], 0, False
        if not self.ready(g):
            return None
        count, total, oversized = 0, 0, False
        for _, group in ready:
            if total + group.tokens > self.budget:
                if not total:  # the first group holding tokens is alone over K: it comes
                    count, total, oversized = count + 1, group.tokens, True
                break
            count, total = count + 1, total + group.tokens
        return [uid for uid, _ in ready[:count]], total, oversized

    def sample(self, buf: ReplayBuffer, g: int, by_call: bool) -> tuple[list[str] | None, Any]:
        if not self.by_tokens:
            try:
                batch, metrics = buf.sample_nowait(g, self.batch_size)
            except BatchNotReadyError:
                return None, None
            return batch.uids, metrics
        if not by_call:
            try:
                batch, metrics = buf.sample_nowait(g, token_budget=self.budget)
            except BatchNotReadyError:
                return None, None
            return batch.uids, metrics

        async def once() -> tuple[list[str] | None, Any]:
            try:
                batch, metrics = await buf.sample(g, token_budget=self.budget, timeout=0)
            except TimeoutError:
                return None, None
            return batch.uids, metrics

        return anyio.run(once, backend=self.backend)


class TokenAdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.buf: ReplayBuffer | None = None
        self.model: Model | None = None
        self.trainer: Trainer | None = None
        self.backend = "asyncio"
        self.g = 0
        self.next_uid = 0

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

    def in_flight(self) -> list[str]:
        return [uid for uid, group in self.m.groups.items() if group.in_flight]

    @initialize(
        backend=st.sampled_from(("asyncio", "trio")),
        mode=st.sampled_from((*MODES, "budget", "budget+resident")),  # token admission twice as often
        threshold=st.integers(1, 3),
        sync=st.integers(1, 2),
        per_group=st.integers(1, 12),
        budget_extra=st.integers(0, 24),
        sample_extra=st.sampled_from((0, 0, 0, 1, 5)),
        resident_extra=st.integers(0, 30),
        cap=st.integers(1, 3),
        batch_size=st.integers(1, 3),
    )
    def make_buffer(
        self,
        backend: str,
        mode: str,
        threshold: int,
        sync: int,
        per_group: int,
        budget_extra: int,
        sample_extra: int,
        resident_extra: int,
        cap: int,
        batch_size: int,
    ) -> None:
        """``K`` is the admission budget ``M + budget_extra`` (``M <= K``), and the trainer's
        budget is ``K + sample_extra``; under the residency cap alone the trainer's budget is
        ``budget_extra + 1`` (it may be below ``M``: oversized groups)."""
        budget, resident = per_group + budget_extra, per_group + resident_extra
        self.model = model = Model(mode, threshold, sync, per_group, budget, resident, cap)
        config = SamplerConfig(
            max_off_policy_threshold=threshold,
            max_off_policy_strategy="wait",
            parameter_sync_step=sync,
            max_tokens_per_group=per_group,
            admission_token_budget=model.budget,
            max_resident_tokens=model.resident,
            admission_batch_size=model.cap,
        )
        self.buf = ReplayBuffer(config, status_log_interval=None)
        sample_budget = budget + sample_extra if model.budget is not None else budget_extra + 1
        self.trainer = Trainer(model, batch_size, sample_budget, backend)
        self.backend = backend

    def attempt(self, call: Callable[[], object], error: type[Exception] | None) -> bool:
        """Run a nowait call the reference says raises ``error`` (None: succeeds); whether it did."""
        before = self.b.stats()
        event(f"{self.m.mode}: {'admitted' if error is None else error.__name__}")
        try:
            call()
        except Exception as exc:
            assert error is not None, f"refused: {exc!r}"  # noqa: PT017
            assert type(exc) is error, f"{exc!r}, expected {error.__name__}"  # noqa: PT017
            assert self.b.stats() == before, "a refused call changed the buffer"
            return False
        assert error is None, f"admitted, expected {error.__name__}"
        return True

    # -- producers ------------------------------------------------------------------------------

    @rule()
    def add_prompt_at_the_clock(self) -> None:
        uid = self.fresh()
        if self.attempt(lambda: self.b.add_prompt_nowait(uid), self.m.refusal(None, self.m.per_group)):
            self.m.admit(uid, None)

    @rule(offset=st.integers(-4, 1))
    def add_prompt_at_a_tag(self, offset: int) -> None:
        tag = max(self.m.clock + offset, 0)
        uid = self.fresh()
        error = self.m.refusal(tag, self.m.per_group)
        if self.attempt(lambda: self.b.add_prompt_nowait(uid, global_steps=tag), error):
            self.m.admit(uid, tag)

    @precondition(lambda self: self.model is not None and self.in_flight())
    @rule(pick=st.integers(0, 50), tokens=st.integers(0, 14), versions=st.booleans())
    def put(self, pick: int, tokens: int, versions: bool) -> None:
        uids = self.in_flight()
        uid = uids[pick % len(uids)]
        group = self.m.groups[uid]
        error = ValueError if group.tokens + tokens > self.m.per_group else None
        key = {"versions": [(group.tag, tokens)]} if versions and tokens else {"tokens": tokens}
        session = self.fresh()[1:]
        if self.attempt(lambda: self.b.put_nowait(uid, None, session_id=int(session), **key), error):
            group.tokens += tokens

    @precondition(lambda self: self.model is not None and self.in_flight())
    @rule(pick=st.integers(0, 50), failed=st.booleans())
    def end(self, pick: int, failed: bool) -> None:
        uids = self.in_flight()
        uid = uids[pick % len(uids)]
        (self.b.mark_failed_nowait if failed else self.b.mark_finished_nowait)(uid)
        group = self.m.groups[uid]
        group.in_flight, group.failed = False, failed

    @rule(tokens=st.lists(st.integers(0, 8), min_size=1, max_size=3), explicit=st.booleans())
    def put_group(self, tokens: list[int], explicit: bool) -> None:
        uid = self.fresh()
        requested = self.m.clock if explicit else None
        total = sum(tokens)
        error = ValueError if total > self.m.per_group else self.m.refusal(requested, total)

        def call() -> object:
            return self.b.put_group_nowait(uid, [None] * len(tokens), tokens=tokens, global_steps=requested)

        if self.attempt(call, error):
            self.m.admit(uid, requested, terminal=True, tokens=total)

    # -- the trainer ------------------------------------------------------------------------------

    def next_step(self) -> int:
        """The trainer's step: ``g + 1`` after a batch at ``g``, else ``g`` again."""
        return self.g + 1 if self.m.last_sampled == self.g else self.g

    @rule(by_call=st.booleans())
    def a_trainer_step(self, by_call: bool) -> None:
        """One step at :meth:`next_step`, through ``sample_nowait`` or ``sample(timeout=0)``: the
        batch is the reference's, and under token admission no group in it is staler than ``T``
        (the hard bound: ``g - tag + 1 <= T*S``)."""
        m, trainer = self.m, self.trainer
        assert trainer is not None
        g = self.next_step()
        if not m.used:
            return
        expected = trainer.expected(g)
        uids, metrics = trainer.sample(self.b, g, by_call)
        m.clock = max(m.clock, g)
        assert uids == (None if expected is None else expected[0]), (uids, expected)
        event(f"{m.mode}: {'a batch' if uids else 'no batch'}")
        self.g = g
        if uids is None or expected is None:
            return
        self.took(g, uids, metrics, expected)

    def took(self, g: int, uids: list[str], metrics: Any, expected: tuple[list[str], int, bool]) -> None:
        """A batch of ``uids`` came at ``g``: check the hard bound and its metrics, drop it from the
        reference."""
        m, trainer = self.m, self.trainer
        assert trainer is not None
        ages = [g - m.groups[uid].tag + 1 for uid in uids]
        if m.budget is not None:
            assert max(ages) <= m.span, f"staleness > T: ages {ages} at step {g}, T*S = {m.span}"
            event(f"{m.mode}: the oldest group's age is {max(ages)} of T*S = {m.span}")
        for uid in uids:
            del m.groups[uid]
        m.last_sampled = max(m.last_sampled, g)
        if trainer.by_tokens:
            _, tokens, oversized = expected
            assert metrics["training/batch/tokens"] == tokens
            assert metrics["training/batch/fill"] == tokens / trainer.budget
            assert metrics["training/batch/oversized_groups"] == int(oversized)
            if m.budget is not None:
                assert not oversized  # no group may hold more than M <= K tokens
        if m.budget is not None or m.resident is not None:
            assert metrics["training/admission/free_tokens"] == m.free_tokens()
            assert metrics["training/admission/reserved_tokens"] == m.per_group * len(self.in_flight())

    @precondition(lambda self: self.model is not None and self.m.used and self.trainer.by_tokens)
    @rule(fill=st.booleans())
    def a_parked_sample_wakes(self, fill: bool) -> None:
        """A real ``sample(g, token_budget=K)`` parks when the reference says no batch is ready;
        then producers act under it (clock-tagged groups admitted until one is refused, or every
        in-flight group finished): after each call it has returned exactly when the reference is
        ready, with the reference's batch."""
        m, trainer = self.m, self.trainer
        assert trainer is not None
        g = self.next_step()
        if trainer.expected(g) is not None:
            return
        done: list[tuple[list[str], Any]] = []

        async def waits() -> None:
            batch, metrics = await self.b.sample(g, token_budget=trainer.budget)
            done.append((batch.uids, metrics))

        def act() -> bool:
            """One producer call; False when there is none left to make."""
            if fill:
                uid = self.fresh()
                if m.refusal(None, m.per_group) is not None:
                    return False
                self.b.add_prompt_nowait(uid)
                m.admit(uid, None)
                return True
            uids = self.in_flight()
            if not uids:
                return False
            self.b.mark_finished_nowait(uids[0])
            m.groups[uids[0]].in_flight = False
            return True

        async def scenario() -> tuple[list[str], Any] | None:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    call = await start_call(tg, waits)
                    assert not call.done, "sample returned though the reference has no batch"
                    m.clock = max(m.clock, g)
                    expected = None
                    while expected is None and act():
                        await anyio.wait_all_tasks_blocked()
                        expected = trainer.expected(g)
                        assert bool(done) == (expected is not None), (done, expected)
                    if not done:
                        call.scope.cancel()
                        return None
                    assert expected is not None
                    assert done[0][0] == expected[0], (done, expected)
                    return expected

        expected = anyio.run(scenario, backend=self.backend)
        self.g = g
        event(f"{m.mode}: a parked sample {'woke' if expected else 'still waits'}")
        if expected is not None:
            self.took(g, done[0][0], done[0][1], expected)

    # -- waiting producers --------------------------------------------------------------------------

    @precondition(lambda self: self.model is not None and self.in_flight())
    @rule(pick=st.integers(0, 50), tokens=st.integers(0, 14))
    def a_refund_wakes_a_parked_producer(self, pick: int, tokens: int) -> None:
        """A producer refused at the clock parks; an in-flight group settles to ``tokens``: the
        producer is admitted at once iff the reference admits it after the refund."""
        m = self.m
        if m.refusal(None, m.per_group) is not BufferFullError:
            return
        uids = self.in_flight()
        settling = uids[pick % len(uids)]
        tokens = min(tokens, m.per_group - m.groups[settling].tokens)
        waiter = self.fresh()

        async def scenario() -> tuple[bool, bool]:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    call = await start_call(tg, lambda: self.b.add_prompt(waiter))
                    parked = not call.done
                    self.b.put_nowait(settling, None, session_id=999, tokens=tokens)
                    self.b.mark_finished_nowait(settling)
                    await anyio.wait_all_tasks_blocked()
                    admitted = call.returned
                    call.scope.cancel()
            return parked, admitted

        parked, admitted = anyio.run(scenario, backend=self.backend)
        assert parked, "a refused producer did not park"
        group = m.groups[settling]
        group.tokens += tokens
        group.in_flight = False
        expected = m.refusal(None, m.per_group) is None
        assert admitted == expected, (admitted, expected)
        event(f"{m.mode}: a refund {'admitted' if admitted else 'did not admit'} the parked producer")
        if admitted:
            m.admit(waiter, None)
        assert self.b.stats().partitions["train"].waiting_producers == 0

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        if self.model is None:
            return
        m, b = self.m, self.b
        views = resident_groups(b)
        assert set(views) == set(m.groups)
        for uid, view in views.items():
            group = m.groups[uid]
            assert (view.dispatch_step, view.in_flight) == (group.tag, group.in_flight), uid
            assert sum(t.tokens for t in view.trajectories) == group.tokens, uid
        assert b.free_tokens() == m.free_tokens()
        assert b.capacity_tokens() == m.capacity_tokens()
        assert refuses_token_group(b, m.clock) == m.refuses(m.clock)
        if m.budget is not None or m.resident is not None:
            free = m.free_tokens()
            assert free is not None
            assert b.full() == (free < m.per_group or (m.cap is not None and b.free_slots() == 0))
        if not m.used:
            return
        stats = b.stats().partitions["train"]
        terminal = sum(g.tokens for g in m.groups.values() if not g.in_flight)
        assert stats.resident_tokens == terminal
        assert stats.reserved_tokens == m.per_group * len(self.in_flight())
        assert stats.tokens == sum(g.tokens for g in m.groups.values())
        assert stats.admitted_tokens == stats.tokens + stats.sampled_tokens + stats.evicted_tokens
        assert_conserved(b)

    @invariant()
    def flow_control(self) -> None:
        """The flow-control properties in tokens. Hard bound: under ``wait`` nothing is evicted
        as stale (each batch's ages are checked in :meth:`took`). No deadlock: if no group is in
        flight and a clock-tagged ``add_prompt`` would be refused once the trainer's next call
        moves the clock, that call returns a batch (the reference's readiness rule, which every
        trainer step checks the buffer against)."""
        if self.model is None or not self.m.used:
            return
        m, trainer = self.m, self.trainer
        assert trainer is not None
        assert self.b.stats().partitions["train"].evicted_stale_groups == 0
        if not trainer.by_tokens or self.in_flight():
            return
        g = self.next_step()
        clock = m.clock
        m.clock = max(clock, g)
        refused = m.refusal(None, m.per_group) is not None
        m.clock = clock
        if refused:
            event(f"{m.mode}: producers stuck, nothing in flight")
            assert trainer.expected(g) is not None, f"deadlock at step {g}"

    @invariant()
    def within_the_caps(self) -> None:
        """Every producer went through admission (nothing here is put back or restored), so the
        caps hold at every step: per tag under the budget, in all under the residency cap."""
        if self.model is None:
            return
        m = self.m
        if m.resident is not None:
            assert m.total() <= m.resident
        if m.budget is not None:
            for tag in {group.tag for group in m.groups.values()}:
                assert m.at(tag) <= m.budget, tag


TokenAdmissionMachine.TestCase.settings = PROFILES[PROFILE]
TestTokenAdmissionAgainstModel = TokenAdmissionMachine.TestCase
