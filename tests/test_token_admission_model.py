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

The trainer is :class:`Trainer`: count batches where admission allows them, and, under token
admission, a white-box stand-in for ``sample(g, token_budget=K)`` that takes the longest prefix
of the oldest ready groups within ``K`` through the buffer's own sample path. Once the buffer has
token batches, a subclass of :class:`Trainer` that calls ``sample(g, token_budget=K)`` (and a
reference readiness rule) plugs in here, and the hard bound under ``wait`` becomes one more
invariant (see :meth:`TokenAdmissionMachine.a_trainer_step`).

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

from _helpers import assert_conserved, refuses_token_group, resident_groups, start_call, whitebox_sample
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

    Count batches of ``batch_size`` where admission allows them; under token admission, the
    longest prefix of the oldest ready groups whose tokens fit ``budget`` (at least one group),
    taken through the buffer's own sample path (:func:`_helpers.whitebox_sample`).
    """

    def __init__(self, model: Model, batch_size: int, budget: int) -> None:
        self.model, self.batch_size, self.budget = model, batch_size, budget

    def expected(self, g: int) -> list[str] | None:
        """The reference's batch at ``g`` (None: none)."""
        m = self.model
        ready = m.ready()
        if m.budget is None:
            count = self.batch_size
        else:
            count, total = 0, 0
            for _, group in ready:
                if count and total + group.tokens > self.budget:
                    break
                count, total = count + 1, total + group.tokens
        if not count or len(ready) < count or not m.gate_open(g):
            return None
        return [uid for uid, _ in ready[:count]]

    def sample(self, buf: ReplayBuffer, g: int, expected: list[str] | None) -> tuple[list[str] | None, Any]:
        m = self.model
        if m.budget is None:
            try:
                batch, metrics = buf.sample_nowait(g, self.batch_size)
            except BatchNotReadyError:
                return None, None
            return batch.uids, metrics
        result = whitebox_sample(buf, g, len(expected) if expected else max(len(m.ready()), 1))
        return (None, None) if result is None else (result[0].uids, result[1])


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
        mode=st.sampled_from(MODES),
        threshold=st.integers(1, 3),
        sync=st.integers(1, 2),
        per_group=st.integers(1, 12),
        budget_factor=st.integers(1, 3),
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
        budget_factor: int,
        resident_extra: int,
        cap: int,
        batch_size: int,
    ) -> None:
        budget, resident = per_group * budget_factor, per_group + resident_extra
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
        self.trainer = Trainer(model, batch_size, budget)
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

    @rule()
    def a_trainer_step(self) -> None:
        """One step at ``g + 1`` (a step that returned no batch is retried at the same ``g``).
        Hard bound under ``wait``: add ``max staleness <= T`` here once token batches exist."""
        m, trainer = self.m, self.trainer
        assert trainer is not None
        g = self.g + 1 if m.last_sampled == self.g else self.g
        if not m.used:
            return
        expected = trainer.expected(g)
        uids, metrics = trainer.sample(self.b, g, expected)
        m.clock = max(m.clock, g)
        assert uids == expected, (uids, expected)
        event(f"{m.mode}: {'a batch' if uids else 'no batch'}")
        if uids is None:
            self.g = g
            return
        for uid in uids:
            del m.groups[uid]
        m.last_sampled = max(m.last_sampled, g)
        self.g = g
        if m.budget is not None or m.resident is not None:
            assert metrics["training/admission/free_tokens"] == m.free_tokens()
            assert metrics["training/admission/reserved_tokens"] == m.per_group * len(self.in_flight())

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
