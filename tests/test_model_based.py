"""Model-based stateful test: the real buffer against a deliberately simple reference model.

The model keeps plain lists and answers every question with a linear scan; it shares no
code with the buffer. Hypothesis drives both with random producer calls, illegal calls and
``sample`` calls, and after every step checks that they agree on every group's status,
trajectories and selection order, on every statistics counter, and on the contract's
invariants (conservation, no uid returned twice, whole batches of exactly ``batch_size``,
drop never returns ``s > T``, wait never evicts for staleness, oldest first with FIFO ties).

Flow control (issue 11) is modelled too: ``admission_batch_size`` (at most ``b`` resident groups
per dispatch step, and with ``T*S == 1`` a step closes once a sample returned at it), the
per-partition dispatch clock (``global_steps=None``), BufferFullError from the ``*_nowait``
producer calls, ``put_group``, in-flight eviction (``evict_stale_in_flight``) with
GroupEvictedError on a later write and re-admission of such a uid, and a producer that waits
for admission inside an event loop while a ``sample`` runs (it must be admitted, tagged with
the clock at admission, exactly when the model says a slot is open). After every step the
machine checks conservation, the per-step cap (and that the buffer's own slot counts match the
resident groups), the clock, ``capacity``, ``free_slots`` and ``full``.

``sample`` never depends on real time here: it is called with ``timeout=0`` (check once),
driven to completion without an event loop (it must not await when it can answer at once),
or now and then inside ``anyio.run`` with a 1 ms timeout, where nothing else can change
the state while it waits. Either way the model predicts exactly whether it returns a batch
or raises TimeoutError.

Profiles: the default runs 200 examples x 50 steps; ``STALEBUF_HYPOTHESIS_PROFILE=thorough``
runs 2000 examples x 100 steps.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, currently_in_test_context, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
)

from _helpers import admission_counts, ready_order, resident_groups, settle, start_call
from stalebuf import Batch, EvictionEvent, PartitionStats, ReplayBuffer, SamplerConfig, Status
from stalebuf.errors import (
    BufferClosedError,
    BufferFullError,
    DuplicateGroupError,
    DuplicateTrajectoryError,
    FutureTagError,
    GroupEvictedError,
    InvalidTransitionError,
    TagClosedError,
    UnknownGroupError,
)

PROFILES: dict[str, settings] = {
    "ci": settings(
        max_examples=200,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ),
    "thorough": settings(
        max_examples=2000,
        stateful_step_count=100,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ),
}
PROFILE = os.environ.get("STALEBUF_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in PROFILES:  # pragma: no cover - a typo in the environment
    raise RuntimeError(f"STALEBUF_HYPOTHESIS_PROFILE must be one of {sorted(PROFILES)}, got {PROFILE!r}")

PARTITION_SETS = (("train", "val"), ("train", "val", "aux"))
EXEMPT_SETS = (frozenset({"val"}), frozenset(), frozenset({"val", "aux"}))
COUNTER_FIELDS = (
    "admitted_groups",
    "admitted_trajectories",
    "sampled_groups",
    "sampled_trajectories",
    "evicted_stale_groups",
    "evicted_stale_trajectories",
    "evicted_failure_groups",
    "evicted_failure_trajectories",
    "evicted_in_flight_groups",
)


# -- the reference model -------------------------------------------------------------------


@dataclass
class MGroup:
    uid: str
    partition: str
    step: int
    seq: int
    status: Status = Status.PENDING
    keys: list[str] = field(default_factory=list)
    finish: int = -1  # the clock when it finished (never before its step)

    @property
    def terminal(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILURE)


@dataclass
class Model:
    """Plain lists and linear scans; nothing here is shared with the buffer."""

    config: SamplerConfig
    groups: list[MGroup] = field(default_factory=list)  # resident, in add_prompt order
    gone: dict[str, str] = field(default_factory=dict)  # uid -> "sampled" | "stale" | "failure"
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    closed: bool = False
    next_seq: int = 0
    clock: dict[str, int] = field(default_factory=dict)  # partition -> largest step sampled at
    last_sampled: dict[str, int] = field(default_factory=dict)  # largest step a batch returned at
    evicted_in_flight: dict[str, str] = field(default_factory=dict)  # remembered uid -> partition
    waiting: int = 0  # producers parked on admission (only inside producer_waits_for_a_sample)
    waited: set[str] = field(default_factory=set)  # partitions whose producers waited since a batch

    def find(self, uid: str) -> MGroup | None:
        for group in self.groups:
            if group.uid == uid:
                return group
        return None

    def touch(self, partition: str) -> dict[str, int]:
        if partition not in self.counters:
            self.counters[partition] = dict.fromkeys(COUNTER_FIELDS, 0)
        return self.counters[partition]

    def exempt(self, partition: str) -> bool:
        return partition in self.config.exempt_partitions

    def evicts_failures(self, partition: str) -> bool:
        return self.config.failure_strategy == "evict" and not self.exempt(partition)

    def limit(self) -> int:
        return self.config.max_off_policy_threshold * self.config.parameter_sync_step

    def sampleable(self, partition: str) -> list[MGroup]:
        """Terminal groups ``sample`` may select (before the drop rule), oldest first."""
        found = [
            g
            for g in self.groups
            if g.partition == partition
            and g.terminal
            and not (g.status is Status.FAILURE and self.evicts_failures(partition))
        ]
        return sorted(found, key=lambda g: (g.step, g.seq))

    def is_stale(self, g: int, group: MGroup) -> bool:
        return g - group.step + 1 > self.limit()

    def drops(self, partition: str) -> bool:
        return self.config.max_off_policy_strategy == "drop" and not self.exempt(partition)

    def cap(self, partition: str) -> int | None:
        """The per-step admission cap b of ``partition`` (None: not gated)."""
        if self.config.admission_batch_size is None or self.exempt(partition):
            return None
        return self.config.admission_batch_size

    def evicts_in_flight(self, partition: str) -> bool:
        return self.config.evict_stale_in_flight and self.drops(partition)

    def resident_at(self, partition: str, step: int) -> int:
        return sum(1 for g in self.groups if g.partition == partition and g.step == step)

    def tag(self, partition: str, step: int | None) -> int:
        """The dispatch step a group added now gets: ``step``, or the partition's clock."""
        return self.clock.get(partition, 0) if step is None else step

    def admits(self, partition: str, step: int, *, head: bool = False) -> bool:
        """Whether one more group may be admitted at ``step`` now (``head``: the first waiting
        producer asks; anybody else queues behind waiting producers)."""
        cap = self.cap(partition)
        if cap is None:
            return True
        if self.waiting and not head:
            return False
        # With T*S == 1 the step a sample returned at closes: s >= 2 at the next sample.
        closed = self.last_sampled.get(partition, -1) + 1 - step + 1 > self.limit()
        return self.resident_at(partition, step) < cap and not closed

    def closed_for_good(self, partition: str, step: int) -> bool:
        """Whether no slot at ``step`` can ever open: it is stale at the next sample, and sample
        steps only grow (a producer waiting there raises BufferFullError instead)."""
        return (
            self.cap(partition) is not None
            and self.last_sampled.get(partition, -1) + 1 - step + 1 > self.limit()
        )

    def refusal(self, partition: str, step: int | None) -> type[Exception] | None:
        """The error ``add_prompt_nowait`` at ``step`` (None: the clock) raises now, or None: a
        step ahead of the clock under admission is a FutureTagError, one that can never open a
        TagClosedError (both only for an explicit step), no slot now a BufferFullError."""
        tag = self.tag(partition, step)
        if self.cap(partition) is None:
            return None
        if tag > self.clock.get(partition, 0):
            return FutureTagError
        if self.admits(partition, tag):
            return None
        return (
            TagClosedError if step is not None and self.closed_for_good(partition, step) else BufferFullError
        )

    def free_slots(self, partition: str) -> int | None:
        cap = self.cap(partition)
        if cap is None or partition not in self.counters:
            return cap
        step = self.clock.get(partition, 0)
        return cap - self.resident_at(partition, step) if self.admits(partition, step) else 0

    def finish_step(self, group: MGroup) -> int:
        return max(self.clock.get(group.partition, 0), group.step)

    def gate_closed(self, g: int, partition: str) -> bool:
        if self.config.max_off_policy_strategy != "wait" or self.exempt(partition):
            return False
        return any(
            x.partition == partition and not x.terminal and g - x.step + 1 >= self.limit()
            for x in self.groups
        )

    def add(self, uid: str, step: int, partition: str) -> MGroup:
        group = MGroup(uid, partition, step, self.next_seq)
        self.groups.append(group)
        self.next_seq += 1
        self.touch(partition)["admitted_groups"] += 1
        self.evicted_in_flight.pop(uid, None)  # a new group: the old eviction is forgotten
        self.gone.pop(uid, None)
        return group

    def remove(self, victims: list[MGroup], reason: str) -> None:
        for victim in victims:
            self.groups.remove(victim)
            self.gone[victim.uid] = reason
            counters = self.touch(victim.partition)
            prefix = {"sampled": "sampled", "stale": "evicted_stale", "failure": "evicted_failure"}[reason]
            counters[f"{prefix}_groups"] += 1
            counters[f"{prefix}_trajectories"] += len(victim.keys)

    def expected_stats(self, partition: str) -> PartitionStats:
        mine = [g for g in self.groups if g.partition == partition]
        cap = self.cap(partition)
        return PartitionStats(
            pending=sum(g.status is Status.PENDING for g in mine),
            running=sum(g.status is Status.RUNNING for g in mine),
            finished=sum(g.status is Status.FINISHED for g in mine),
            failure=sum(g.status is Status.FAILURE for g in mine),
            trajectories=sum(len(g.keys) for g in mine),
            waiting_samplers=0,
            waiting_producers=self.waiting,
            capacity=None if cap is None else cap * self.limit(),
            **self.counters[partition],
        )

    def write_error(self, uid: object) -> type[Exception] | None:
        """The error a write/status change to ``uid`` must raise (closed buffer aside)."""
        if type(uid) is not str:
            return TypeError
        group = self.find(uid)
        if group is None:
            return GroupEvictedError if uid in self.evicted_in_flight else UnknownGroupError
        if group.terminal:
            return InvalidTransitionError
        return None


# -- helpers ---------------------------------------------------------------------------------


def note(what: str) -> None:
    """Record a coverage event (shown by ``--hypothesis-show-statistics``), also when a test
    replays a sequence outside Hypothesis."""
    if currently_in_test_context():
        hypothesis_event(what)


class CallbackError(Exception):
    """Raised by the machine's on_evict in "raise" mode."""


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that must finish without ever awaiting; return its result."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("sample(timeout=0) awaited although it can answer at once")


def outcome(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except Exception as exc:
        return None, exc


def check_error(exc: BaseException | None, expected: type[Exception] | None, what: str) -> None:
    if expected is None:
        assert exc is None, f"{what}: unexpected {type(exc).__name__}: {exc}"
    else:
        assert exc is not None, f"{what}: expected {expected.__name__}, nothing was raised"
        assert type(exc) is expected, f"{what}: expected {expected.__name__}, got {type(exc).__name__}: {exc}"
        assert str(exc), f"{what}: {type(exc).__name__} without a message"


# Bad calls that leave the buffer untouched: (name, call, error when open, error when closed).
BadCall = tuple[str, Callable[[ReplayBuffer], Any], type[Exception], type[Exception]]
BAD_CALLS: tuple[BadCall, ...] = (
    (
        "uid with underscore",
        lambda b: b.add_prompt_nowait("a_b", global_steps=0),
        ValueError,
        BufferClosedError,
    ),
    ("empty uid", lambda b: b.add_prompt_nowait("", global_steps=0), ValueError, BufferClosedError),
    ("int uid", lambda b: b.add_prompt_nowait(3, global_steps=0), TypeError, BufferClosedError),
    ("bool step", lambda b: b.add_prompt_nowait("zz", global_steps=True), TypeError, BufferClosedError),
    ("negative step", lambda b: b.add_prompt_nowait("zz", global_steps=-1), ValueError, BufferClosedError),
    ("str step", lambda b: b.add_prompt_nowait("zz", global_steps="1"), TypeError, BufferClosedError),
    (
        "empty partition",
        lambda b: b.add_prompt_nowait("zz", global_steps=0, partition=""),
        ValueError,
        BufferClosedError,
    ),
    (
        "list tags",
        lambda b: b.add_prompt_nowait("zz", global_steps=0, tags=[1]),
        TypeError,
        BufferClosedError,
    ),
    ("int uid to running", lambda b: b.mark_running_nowait(7), TypeError, BufferClosedError),
    ("ghost uid running", lambda b: b.mark_running_nowait("ghost"), UnknownGroupError, BufferClosedError),
    ("ghost uid finished", lambda b: b.mark_finished_nowait("ghost"), UnknownGroupError, BufferClosedError),
    ("ghost uid failed", lambda b: b.mark_failed_nowait("ghost"), UnknownGroupError, BufferClosedError),
    ("ghost uid put", lambda b: b.put_nowait("ghost", 1), UnknownGroupError, BufferClosedError),
    ("bool session", lambda b: b.put_nowait("ghost", session_id=False), TypeError, BufferClosedError),
    ("negative index", lambda b: b.put_nowait("ghost", index=-2), ValueError, BufferClosedError),
    ("sample batch 0", lambda b: drive(b.sample(0, 0, timeout=0)), ValueError, ValueError),
    ("sample batch bool", lambda b: drive(b.sample(0, True, timeout=0)), ValueError, ValueError),
    ("sample batch float", lambda b: drive(b.sample(0, 2.0, timeout=0)), ValueError, ValueError),
    ("sample step -1", lambda b: drive(b.sample(-1, 1, timeout=0)), ValueError, ValueError),
    ("sample step bool", lambda b: drive(b.sample(False, 1, timeout=0)), TypeError, TypeError),
    ("sample timeout -1", lambda b: drive(b.sample(0, 1, timeout=-1)), ValueError, ValueError),
    ("sample partition 0", lambda b: drive(b.sample(0, 1, partition=0, timeout=0)), TypeError, TypeError),
    ("count step -1", lambda b: b.sampleable_count(-1), ValueError, ValueError),
    ("count partition ''", lambda b: b.sampleable_count(0, ""), ValueError, ValueError),
)


# -- the state machine -----------------------------------------------------------------------


class BufferMachine(RuleBasedStateMachine):
    """Random producer, illegal and sample calls against the buffer and the model."""

    uids = Bundle("uids")

    def __init__(self) -> None:
        super().__init__()
        self.buf: ReplayBuffer | None = None
        self.model: Model | None = None
        self.partitions: tuple[str, ...] = ()
        self.trainer_step = 0
        self.next_uid = 0
        self.returned: set[str] = set()
        self.events: list[EvictionEvent] = []
        # (uid, step, partition, admitted) per prompt on_evict re-dispatched in "refill" mode
        self.refilled: list[tuple[str, int, str, bool]] = []
        self.callback = "record"  # what on_evict does besides recording: "refill" or "raise"
        self.backend = "asyncio"
        self.sample_calls = 0

    # -- plumbing ----------------------------------------------------------------------

    def fresh_uid(self, prefix: str = "g") -> str:
        self.next_uid += 1
        return f"{prefix}{self.next_uid}"

    def on_evict(self, event: EvictionEvent) -> None:
        self.events.append(event)
        if self.callback == "raise":
            raise CallbackError(event.reason)
        if self.callback == "refill":  # re-dispatch evicted prompts, as a trainer would
            for _ in event.groups:
                uid = self.fresh_uid("r")
                assert self.buf is not None
                try:
                    self.buf.add_prompt_nowait(
                        uid, global_steps=event.global_steps, partition=event.partition
                    )
                except BufferFullError:  # admission control: the trainer tries again later
                    self.refilled.append((uid, event.global_steps, event.partition, False))
                else:
                    self.refilled.append((uid, event.global_steps, event.partition, True))

    @property
    def b(self) -> ReplayBuffer:
        assert self.buf is not None
        return self.buf

    @property
    def m(self) -> Model:
        assert self.model is not None
        return self.model

    # -- rules -------------------------------------------------------------------------

    @initialize(
        target=uids,
        strategy=st.sampled_from(("drop", "wait")),
        failure=st.sampled_from(("sample", "evict")),
        threshold=st.integers(1, 4),
        sync=st.integers(1, 3),
        partitions=st.sampled_from(PARTITION_SETS),
        exempt=st.sampled_from(EXEMPT_SETS),
        callback=st.sampled_from(("record", "refill", "raise")),
        backend=st.sampled_from(("asyncio", "trio")),
        admission=st.sampled_from((None, None, 1, 2, 3)),
        in_flight=st.booleans(),
        seeds=st.lists(
            st.tuples(
                st.integers(0, 2),
                st.integers(0, 3),
                st.sampled_from(("run-finish", "finish", "run-fail", "fail", "run", "pending")),
            ),
            max_size=8,
        ),
    )
    def make_buffer(
        self,
        strategy: str,
        failure: str,
        threshold: int,
        sync: int,
        partitions: tuple[str, ...],
        exempt: frozenset[str],
        callback: str,
        backend: str,
        admission: int | None,
        in_flight: bool,
        seeds: list[tuple[int, int, str]],
    ) -> Any:
        config = SamplerConfig(
            max_off_policy_strategy=strategy,  # type: ignore[arg-type]
            failure_strategy=failure,  # type: ignore[arg-type]
            max_off_policy_threshold=threshold,
            parameter_sync_step=sync,
            exempt_partitions=exempt,
            admission_batch_size=admission,
            evict_stale_in_flight=in_flight and strategy == "drop",
        )
        self.buf = ReplayBuffer(config, on_evict=self.on_evict, status_log_interval=None)
        self.model = Model(config)
        self.partitions = partitions
        self.callback = callback
        self.backend = backend  # a buffer binds to the backend of its first waiting sample
        # start most runs with some groups, whichever rules swarm testing disables
        return multiple(
            *[self.produce_group(partition, lag, 2, path, by_clock=False) for partition, lag, path in seeds]
        )

    @rule(
        target=uids,
        partition=st.integers(0, 2),
        lag=st.integers(-1, 3),
        arbitrary=st.one_of(st.none(), st.none(), st.none(), st.integers(0, 20)),
        by_clock=st.booleans(),
    )
    def add_prompt(self, partition: int, lag: int, arbitrary: int | None, by_clock: bool) -> Any:
        uid = self.try_add(self.fresh_uid(), partition, self.step_for(lag, arbitrary, by_clock))
        return multiple() if uid is None else uid

    def step_for(self, lag: int, arbitrary: int | None = None, by_clock: bool = False) -> int | None:
        """An explicit dispatch step ``lag`` behind the trainer (or ``arbitrary``), or None: the clock."""
        if by_clock:
            return None
        return max(0, self.trainer_step - lag) if arbitrary is None else arbitrary

    def try_add(self, uid: str, partition: int | str, step: int | None) -> str | None:
        """``add_prompt_nowait``; return the uid if the model says it was admitted."""
        name = partition if isinstance(partition, str) else self.partitions[partition % len(self.partitions)]
        _, exc = outcome(lambda: self.b.add_prompt_nowait(uid, global_steps=step, partition=name))
        if self.m.closed:
            check_error(exc, BufferClosedError, "add_prompt on closed buffer")
            return None
        tag = self.m.tag(name, step)
        refusal = self.m.refusal(name, step)
        if refusal is not None:
            check_error(exc, refusal, f"add_prompt({uid!r}) at step {tag} of {name!r}")
            note(f"add_prompt: refused, {refusal.__name__}")
            return None
        check_error(exc, None, f"add_prompt({uid!r}) at step {tag} of {name!r}")
        self.m.add(uid, tag, name)
        return uid

    @rule(
        target=uids,
        partition=st.integers(0, 2),
        lag=st.integers(-1, 3),
        trajectories=st.integers(0, 3),
        path=st.sampled_from(("run-finish", "run-finish", "finish", "run-fail", "fail", "run")),
        by_clock=st.booleans(),
    )
    def produce_group(self, partition: int, lag: int, trajectories: int, path: str, by_clock: bool) -> Any:
        """A whole producer round trip in one step, so that sampleable groups are common."""
        uid = self.try_add(self.fresh_uid(), partition, self.step_for(lag, by_clock=by_clock))
        if uid is None:
            return multiple()
        if path.startswith("run"):
            self.mark_running(uid)
        for session in range(trajectories):
            self.put(uid, session, 0)
        if path.endswith("finish"):
            self.terminate(uid, failed=False)
        elif path.endswith("fail"):
            self.terminate(uid, failed=True)
        return uid

    @rule(
        target=uids,
        partition=st.integers(0, 2),
        lag=st.integers(0, 6),
        outcomes=st.lists(st.booleans(), min_size=1, max_size=4),
        by_clock=st.booleans(),
    )
    def produce_burst(self, partition: int, lag: int, outcomes: list[bool], by_clock: bool) -> Any:
        """Several groups of one partition and dispatch step run to completion (True = failed)."""
        made = []
        for failed in outcomes:
            uid = self.try_add(self.fresh_uid(), partition, self.step_for(lag, by_clock=by_clock))
            if uid is None:
                break
            self.put(uid, 0, 0)
            self.put(uid, 1, 0)
            self.terminate(uid, failed=failed)
            made.append(uid)
        return multiple(*made)

    @rule(steps=st.integers(1, 3))
    def trainer_advances(self, steps: int) -> None:
        """Trainer steps pass elsewhere (e.g. on another partition's batches)."""
        self.trainer_step += steps

    @rule(uid=uids)
    def add_duplicate(self, uid: str) -> None:
        group = self.m.find(uid)
        if group is None:  # re-adding a sampled/evicted uid is legal; the model never does it
            return
        _, exc = outcome(lambda: self.b.add_prompt_nowait(uid, global_steps=0, partition=group.partition))
        check_error(exc, BufferClosedError if self.m.closed else DuplicateGroupError, "duplicate add_prompt")

    @rule(uid=uids, lag=st.integers(0, 2), by_clock=st.booleans())
    def readd_evicted_in_flight(self, uid: str, lag: int, by_clock: bool) -> None:
        """add_prompt with the uid of a group evicted in flight starts a new group."""
        partition = self.m.evicted_in_flight.get(uid)
        if partition is None or self.m.find(uid) is not None:
            return
        if self.try_add(uid, partition, self.step_for(lag, by_clock=by_clock)) is not None:
            note("re-added a uid evicted in flight")

    @rule(
        target=uids,
        partition=st.integers(0, 2),
        lag=st.integers(-1, 3),
        by_clock=st.booleans(),
        n=st.integers(0, 2),
        failed=st.booleans(),
    )
    def put_group_new(self, partition: int, lag: int, by_clock: bool, n: int, failed: bool) -> Any:
        """A whole new group in one call, refused with BufferFullError when there is no slot."""
        name = self.partitions[partition % len(self.partitions)]
        step = self.step_for(lag, by_clock=by_clock)
        uid = self.fresh_uid("p")
        status = "failed" if failed else "finished"
        keys, exc = outcome(
            lambda: self.b.put_group_nowait(
                uid, list(range(n)), global_steps=step, partition=name, status=status
            )
        )
        if self.m.closed:
            check_error(exc, BufferClosedError, "put_group on closed buffer")
            return multiple()
        tag = self.m.tag(name, step)
        refusal = self.m.refusal(name, step)
        if refusal is not None:
            check_error(exc, refusal, f"put_group({uid!r}) at step {tag} of {name!r}")
            note(f"put_group: refused, {refusal.__name__}")
            return multiple()
        check_error(exc, None, f"put_group({uid!r}) at step {tag} of {name!r}")
        assert keys == [f"{uid}_{i}_0" for i in range(n)]
        group = self.m.add(uid, tag, name)
        group.keys = list(keys)
        group.status = Status.FAILURE if failed else Status.FINISHED
        group.finish = self.m.finish_step(group)
        self.m.touch(name)["admitted_trajectories"] += n
        return uid

    @rule(uid=uids, n=st.integers(1, 2), step=st.sampled_from(("none", "own", "other")), failed=st.booleans())
    def put_group_existing(self, uid: str, n: int, step: str, failed: bool) -> None:
        """put_group on a resident group: never admission-gated, never waits.

        (A uid that left the buffer is skipped: put_group would add it anew, and for a uid
        evicted in flight issue 11 says it must raise GroupEvictedError instead; that case is
        tests/test_in_flight.py's.)"""
        group = self.m.find(uid)
        if group is None:
            return
        steps = {"none": None, "own": group.step, "other": group.step + 1}
        sessions = list(range(3, 3 + n))
        keys, exc = outcome(
            lambda: self.b.put_group_nowait(
                uid,
                ["x"] * n,
                global_steps=steps[step],
                partition=group.partition,
                session_ids=sessions,
                indices=[1] * n,
                status="failed" if failed else "finished",
            )
        )
        wanted = [f"{uid}_{session}_1" for session in sessions]
        if self.m.closed:
            expected: type[Exception] | None = BufferClosedError
        elif group.terminal:
            expected = InvalidTransitionError
        elif step == "other":
            expected = DuplicateGroupError
        elif set(wanted) & set(group.keys):
            expected = DuplicateTrajectoryError
        else:
            expected = None
        check_error(exc, expected, f"put_group({uid!r}) on a resident group")
        if expected is None:
            assert keys == wanted
            group.keys += wanted
            group.status = Status.FAILURE if failed else Status.FINISHED
            group.finish = self.m.finish_step(group)
            self.m.touch(group.partition)["admitted_trajectories"] += n

    @rule(
        target=uids,
        partition=st.integers(0, 2),
        lag=st.integers(0, 2),
        by_clock=st.booleans(),
        advance=st.integers(0, 2),
        batch_size=st.integers(1, 3),
    )
    def producer_waits_for_a_sample(
        self, partition: int, lag: int, by_clock: bool, advance: int, batch_size: int
    ) -> Any:
        """In an event loop: a producer's add_prompt parks on a full step; nobody may jump the
        queue; a sample runs; the producer must then be admitted (tagged by the clock at
        admission) exactly if the model has a slot for it, else it is cancelled, adding nothing."""
        m = self.m
        name = self.partitions[partition % len(self.partitions)]
        step = self.step_for(lag, by_clock=by_clock)
        if m.closed or m.cap(name) is None or name not in m.counters or m.admits(name, m.tag(name, step)):
            return multiple()
        if step is not None and (m.closed_for_good(name, step) or step > m.clock.get(name, 0)):
            return multiple()  # it would raise at once instead of parking (tests/test_admission.py)
        # Usually past the clock: a new step alone must wake the producer (with fresh slots).
        self.trainer_step = max(self.trainer_step, m.clock.get(name, 0)) + advance
        g = self.trainer_step
        uid, jumper = self.fresh_uid("w"), self.fresh_uid("j")
        self.sample_calls += 1
        self.events.clear()
        self.refilled.clear()
        before = self.b.stats()

        async def scenario() -> tuple[Any, ...]:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    waiting = await start_call(
                        tg, lambda: self.b.add_prompt(uid, global_steps=step, partition=name)
                    )
                    parked = (
                        waiting.done,
                        self.b.stats().partitions[name].waiting_producers,
                        self.b.full(name),
                    )
                    _, jumped = outcome(lambda: self.b.add_prompt_nowait(jumper, partition=name))
                    try:
                        result, exc = await self.b.sample(g, batch_size, partition=name, timeout=0), None
                    except Exception as error:
                        result, exc = None, error
                    await settle()  # a freed slot wakes the producer at once
                    if not waiting.done:
                        waiting.scope.cancel()
            return parked, jumped, result, exc, waiting.returned, waiting.error

        parked, jumped, result, exc, admitted, error = anyio.run(scenario, backend=self.backend)
        assert parked == (False, 1, True), f"the producer did not park: {parked}"
        check_error(jumped, BufferFullError, "add_prompt_nowait while a producer waits")
        m.waiting = 1
        m.waited.add(name)  # the producer was blocked when the sample ran: that sample reports it
        try:
            made = self.check_sample(name, g, batch_size, result, exc, before.total.sampled_groups, False)
        finally:
            m.waiting = 0
        m.waited.add(name)  # and the rest of its wait, after the sample, the next one
        tag = m.tag(name, step)  # the clock after the sample, if it asked for none
        expected = m.admits(name, tag, head=True)
        assert admitted == expected, f"waiting producer admitted={admitted}, model says {expected} at {tag}"
        if step is not None and not expected and m.closed_for_good(name, step):  # the sample closed it
            check_error(error, TagClosedError, f"a producer waiting at step {step}, closed for good")
            note("waiting producer: its tag closed for good, it raised")
            return made
        assert error is None, f"the waiting producer raised {error!r}"
        if not admitted:
            note("waiting producer: cancelled, still no slot")
            return made
        note("waiting producer: admitted after the sample")
        m.add(uid, tag, name)
        return multiple(*made.values, uid)

    @rule(uid=st.one_of(uids, st.just("ghost")))
    def mark_running(self, uid: str) -> None:
        _, exc = outcome(lambda: self.b.mark_running_nowait(uid))
        expected = self.m.write_error(uid)
        group = self.m.find(uid)
        if expected is None and group is not None and group.status is Status.RUNNING:
            expected = InvalidTransitionError
        if self.m.closed:
            expected = BufferClosedError
        check_error(exc, expected, f"mark_running({uid!r})")
        if expected is None:
            assert group is not None
            group.status = Status.RUNNING

    @rule(uid=st.one_of(uids, st.just("ghost")), session=st.integers(0, 2), index=st.integers(0, 1))
    def put(self, uid: str, session: int, index: int) -> None:
        payload = object()
        key, exc = outcome(lambda: self.b.put_nowait(uid, payload, session_id=session, index=index))
        expected = self.m.write_error(uid)
        group = self.m.find(uid)
        want = f"{uid}_{session}_{index}"
        if expected is None and group is not None and want in group.keys:
            expected = DuplicateTrajectoryError
        if self.m.closed:
            expected = BufferClosedError
        check_error(exc, expected, f"put({uid!r}, {session}, {index})")
        if expected is None:
            assert group is not None
            assert key == want
            group.keys.append(want)
            self.m.touch(group.partition)["admitted_trajectories"] += 1

    @rule(uid=st.one_of(uids, st.just("ghost")), failed=st.booleans())
    def terminate(self, uid: str, failed: bool) -> None:
        call = self.b.mark_failed_nowait if failed else self.b.mark_finished_nowait
        _, exc = outcome(lambda: call(uid))
        expected = BufferClosedError if self.m.closed else self.m.write_error(uid)
        check_error(exc, expected, f"mark_{'failed' if failed else 'finished'}({uid!r})")
        if expected is None:
            group = self.m.find(uid)
            assert group is not None
            group.status = Status.FAILURE if failed else Status.FINISHED
            group.finish = self.m.finish_step(group)

    # Three sampling rules, so that swarm testing (Hypothesis disables random rules in each
    # run) rarely leaves a run without any sampling.

    @rule(target=uids, batch_size=st.integers(1, 3), advance=st.integers(0, 2))
    def trainer_sample(self, batch_size: int, advance: int) -> Any:
        """The trainer: "train" partition, non-decreasing steps, check once."""
        self.trainer_step += advance
        return self.do_sample("train", self.trainer_step, batch_size, in_loop=False)

    @rule(
        target=uids,
        partition=st.integers(0, 2),
        batch_size=st.integers(1, 3),
        advance=st.integers(0, 2),
        arbitrary=st.one_of(st.none(), st.none(), st.integers(0, 20)),
    )
    def sample_any(self, partition: int, batch_size: int, advance: int, arbitrary: int | None) -> Any:
        """Any partition; usually the trainer's step, sometimes an arbitrary one (even a past one)."""
        if arbitrary is None:
            self.trainer_step += advance
        g = self.trainer_step if arbitrary is None else arbitrary
        return self.do_sample(self.partitions[partition % len(self.partitions)], g, batch_size, in_loop=False)

    @rule(target=uids, partition=st.integers(0, 2), batch_size=st.integers(1, 3), advance=st.integers(0, 2))
    def sample_in_event_loop(self, partition: int, batch_size: int, advance: int) -> Any:
        """Inside a real event loop with a 1 ms timeout (it may park and time out)."""
        self.trainer_step += advance
        name = self.partitions[partition % len(self.partitions)]
        return self.do_sample(name, self.trainer_step, batch_size, in_loop=True)

    def do_sample(self, name: str, g: int, batch_size: int, *, in_loop: bool) -> Any:
        self.sample_calls += 1
        self.events.clear()
        self.refilled.clear()
        before = self.b.stats()
        if in_loop:

            async def timed() -> Any:
                with anyio.fail_after(10):
                    return await self.b.sample(g, batch_size, partition=name, timeout=0.001)

            result, exc = outcome(lambda: anyio.run(timed, backend=self.backend))
        else:
            result, exc = outcome(lambda: drive(self.b.sample(g, batch_size, partition=name, timeout=0)))
        if self.m.closed:
            check_error(exc, BufferClosedError, "sample on closed buffer")
            assert not self.events
            return multiple()
        return self.check_sample(name, g, batch_size, result, exc, before.total.sampled_groups, in_loop)

    def check_sample(
        self,
        name: str,
        g: int,
        batch_size: int,
        result: Any,
        exc: BaseException | None,
        sampled_before: int,
        may_wait: bool,
    ) -> Any:
        m = self.m
        if may_wait:  # a sample that may wait registers its partition; timeout=0 does not
            m.touch(name)
        m.clock[name] = max(m.clock.get(name, 0), g)  # any valid sample call moves the clock
        # 1. evictions: failures first, then stale groups (in flight too, if configured)
        predicted: list[tuple[str, list[str]]] = []
        if m.evicts_failures(name):
            failed = sorted(
                (x for x in m.groups if x.partition == name and x.status is Status.FAILURE),
                key=lambda x: (x.step, x.seq),
            )
            if failed:
                predicted.append(("failure", [x.uid for x in failed]))
                m.remove(failed, "failure")
        in_flight: dict[str, MGroup] = {}
        if m.drops(name):
            stale = [x for x in m.sampleable(name) if m.is_stale(g, x)]
            if m.evicts_in_flight(name):
                ours = (x for x in m.groups if x.partition == name and not x.terminal and m.is_stale(g, x))
                in_flight = {x.uid: x for x in ours}
            if stale or in_flight:
                predicted.append(("stale", [x.uid for x in stale] + list(in_flight)))
                m.remove(stale, "stale")
                m.remove(list(in_flight.values()), "stale")
                m.touch(name)["evicted_in_flight_groups"] += len(in_flight)
                for uid, group in in_flight.items():
                    m.evicted_in_flight[uid] = name
                    group.finish = m.finish_step(group)
        actual = [(e.reason, [x.uid for x in e.groups]) for e in self.events]
        for reason, _ in predicted:
            note(f"sample evicted ({reason})")
        if in_flight:
            note("sample evicted in flight")
        # Oldest first; terminal groups in ready order. (Ties between a terminal and an in-flight
        # group of one step have no contracted order.)
        assert [(reason, sorted(uids)) for reason, uids in actual] == [
            (reason, sorted(uids)) for reason, uids in predicted
        ], f"evictions at g={g} in {name!r}: got {actual}, model says {predicted}"
        for (_, got), (_, want) in zip(actual, predicted, strict=True):
            assert [u for u in got if u not in in_flight] == [u for u in want if u not in in_flight]
        for event in self.events:
            assert event.partition == name
            assert event.global_steps == g
            steps = [x.global_steps for x in event.groups]
            assert steps == sorted(steps), f"{event.reason} event not oldest first: {steps}"
            if event.reason == "stale":
                assert m.config.max_off_policy_strategy == "drop", "wait evicted for staleness"
                assert all(g - x.global_steps + 1 > m.limit() for x in event.groups)
            for x in event.groups:
                if x.uid in in_flight:  # reported as it was: in flight, with what was put so far
                    want_group = in_flight[x.uid]
                    assert x.status is want_group.status
                    assert [t.key for t in x.trajectories] == want_group.keys
                    assert x.finish_step == want_group.finish
                else:
                    assert x.status.is_terminal
        # 2. the callback's re-dispatched prompts are admitted before selection, if there is room
        if self.callback == "raise" and predicted:  # raised after the state was consistent
            check_error(exc, CallbackError, "sample whose on_evict raised")
            return multiple()
        assert len(self.refilled) == (
            sum(len(uids) for _, uids in predicted) if self.callback == "refill" else 0
        )
        for uid, step, partition, admitted in self.refilled:
            assert admitted == m.admits(partition, step), (
                f"refill {uid!r} at step {step}: admitted={admitted}"
            )
            if admitted:
                m.add(uid, step, partition)
        refilled = [uid for uid, _, _, admitted in self.refilled if admitted]
        # 3. selection: exactly batch_size whole groups, oldest first, or TimeoutError
        candidates = [x for x in m.sampleable(name) if not (m.drops(name) and m.is_stale(g, x))]
        assert len(candidates) == len(m.sampleable(name))  # all stale ones were just evicted
        ready = len(candidates) >= batch_size and not m.gate_closed(g, name)
        note("sample: batch" if ready else "sample: timeout")
        if not ready and len(candidates) >= batch_size:
            note("sample: held by the wait gate")
        if not ready:
            check_error(exc, TimeoutError, f"sample(g={g}, b={batch_size}, {name!r})")
            assert self.b.stats().total.sampled_groups == sampled_before, "a timed-out sample took groups"
            return multiple(*refilled)
        check_error(exc, None, f"sample(g={g}, b={batch_size}, {name!r})")
        batch, metrics = result
        assert isinstance(batch, Batch)
        chosen = candidates[:batch_size]
        assert len(batch) == batch_size
        assert batch.uids == [x.uid for x in chosen], "not oldest first with FIFO ties"
        assert batch.partition == name
        assert batch.global_steps == g
        for got, want in zip(batch.groups, chosen, strict=True):
            assert got.status is want.status
            assert got.global_steps == want.step
            assert got.partition == name
            assert [t.key for t in got.trajectories] == want.keys, "group returned incomplete"
            assert got.finish_step == want.finish, f"{got.uid}: finish_step"
            assert got.uid not in self.returned, f"uid {got.uid!r} returned twice"
            self.returned.add(got.uid)
        if m.drops(name):
            ages = [g - x.global_steps + 1 for x in batch.groups]
            assert all(age <= m.limit() for age in ages), f"drop returned s > T: ages {ages}"
        expected_staleness = [(g - x.step + 1) / m.config.parameter_sync_step for x in chosen]
        assert batch.staleness.tolist() == expected_staleness
        self.check_metrics(name, g, predicted, in_flight, chosen, metrics)
        m.last_sampled[name] = max(m.last_sampled.get(name, -1), g)
        m.remove(chosen, "sampled")
        self.check_admission_metrics(name, metrics)
        return multiple(*refilled)

    def check_metrics(
        self,
        name: str,
        g: int,
        predicted: list[tuple[str, list[str]]],
        in_flight: dict[str, MGroup],
        chosen: list[MGroup],
        metrics: dict[str, float],
    ) -> None:
        prefix = "training" if name == "train" else "validation"
        stale_count = sum(len(uids) for reason, uids in predicted if reason == "stale")
        failed_count = sum(len(uids) for reason, uids in predicted if reason == "failure")
        assert metrics.get(f"{prefix}/off_policy/dropped_groups", 0.0) == stale_count
        assert metrics.get(f"{prefix}/rollout_failure/evicted_groups", 0.0) == failed_count
        assert metrics.get(f"{prefix}/off_policy/evicted_in_flight_groups", 0.0) == len(in_flight)
        assert (f"{prefix}/off_policy/dropped_generation_seconds/mean" in metrics) == (stale_count > 0)
        n = len(chosen)
        generation = sum(x.finish - x.step for x in chosen) / n
        queue = g - sum(x.finish for x in chosen) / n
        assert metrics[f"{prefix}/off_policy/sampled_generation_steps/mean"] == pytest.approx(generation)
        assert metrics[f"{prefix}/off_policy/sampled_queue_steps/mean"] == pytest.approx(queue)
        assert metrics[f"{prefix}/off_policy/sampled_generation_seconds/mean"] >= 0

    def check_admission_metrics(self, name: str, metrics: dict[str, float]) -> None:
        """Checked after the batch left the buffer (what the buffer reports)."""
        m = self.m
        prefix = "training" if name == "train" else "validation"
        free, wait = f"{prefix}/admission/free_slots", f"{prefix}/admission/producer_wait_seconds"
        if m.cap(name) is None:
            assert free not in metrics
            assert wait not in metrics
            return
        assert metrics[free] == m.free_slots(name)
        if name in m.waited:
            assert metrics[wait] >= 0
            m.waited.discard(name)
        else:
            assert metrics[wait] == 0.0, "producer wait reported, but no producer waited"

    @rule(partition=st.integers(0, 2), advance=st.integers(-2, 6))
    def sampleable_count(self, partition: int, advance: int) -> None:
        name = self.partitions[partition % len(self.partitions)]
        g = max(0, self.trainer_step + advance)
        expected = len(
            [x for x in self.m.sampleable(name) if not (self.m.drops(name) and self.m.is_stale(g, x))]
        )
        assert self.b.sampleable_count(g, name) == expected

    @rule(which=st.integers(0, len(BAD_CALLS) - 1))
    def bad_call(self, which: int) -> None:
        name, call, error_open, error_closed = BAD_CALLS[which]
        _, exc = outcome(lambda: call(self.b))
        check_error(exc, error_closed if self.m.closed else error_open, name)

    @rule(roll=st.integers(0, 39))
    def maybe_close(self, roll: int) -> None:
        if roll == 0:
            self.b.close()
            self.m.closed = True

    # -- invariants --------------------------------------------------------------------

    def teardown(self) -> None:
        """A last sample of every partition (checked like any other), then coverage notes
        (shown by ``pytest --hypothesis-show-statistics``)."""
        if self.model is None:
            return
        for name in self.partitions:
            self.do_sample(name, self.trainer_step, 1, in_loop=False)
            self.buffer_matches_model()
            self.stats_match_and_conserve()

        def bucket(n: int) -> str:
            return "0" if not n else "1-4" if n < 5 else "5-19" if n < 20 else "20+"

        note(f"sample calls: {bucket(self.sample_calls)}")
        note(f"groups admitted: {bucket(self.m.next_seq)}")
        note(f"groups returned by sample: {bucket(len(self.returned))}")
        note(f"closed: {self.m.closed}")

    @invariant()
    def buffer_matches_model(self) -> None:
        if self.buf is None:
            return
        m, b = self.m, self.b
        resident = {g.uid: g for g in m.groups}
        groups = resident_groups(b)
        assert set(groups) == set(resident), "resident uids differ"
        for uid, real in groups.items():
            want = resident[uid]
            assert real.status is want.status, f"{uid}: {real.status} != {want.status}"
            assert real.dispatch_step == want.step
            assert real.partition == want.partition
            assert [t.key for t in real.trajectories] == want.keys, f"{uid}: trajectories differ"
        for name, order in ready_order(b).items():
            assert order == [x.uid for x in m.sampleable(name)], f"ready order differs in {name!r}"

    @invariant()
    def stats_match_and_conserve(self) -> None:
        if self.buf is None:
            return
        stats = self.b.stats()
        assert stats.closed == self.m.closed
        assert set(stats.partitions) == set(self.m.counters)
        total = PartitionStats()
        for name, got in stats.partitions.items():
            assert got == self.m.expected_stats(name), f"stats of {name!r} differ"
            total = total + got
        assert stats.total == total
        for item in (*stats.partitions.values(), stats.total):
            for unit, resident in (("groups", item.groups), ("trajectories", item.trajectories)):
                admitted = getattr(item, f"admitted_{unit}")
                accounted = (
                    resident
                    + getattr(item, f"sampled_{unit}")
                    + getattr(item, f"evicted_stale_{unit}")
                    + getattr(item, f"evicted_failure_{unit}")
                )
                assert admitted == accounted, f"conservation of {unit} broken: {item}"
            if self.m.config.max_off_policy_strategy == "wait":
                assert item.evicted_stale_groups == 0, "wait evicted for staleness"
            assert item.evicted_in_flight_groups <= item.evicted_stale_groups
            if not self.m.config.evict_stale_in_flight:
                assert item.evicted_in_flight_groups == 0

    @invariant()
    def admission_matches_model(self) -> None:
        """The clock, capacity, free slots and the per-step cap; the buffer's own slot counts are
        exactly the resident groups per dispatch step (no counter can drift)."""
        if self.buf is None:
            return
        m, b = self.m, self.b
        resident = resident_groups(b)
        for name in {*self.partitions, *m.counters}:
            cap = m.cap(name)
            assert b.dispatch_step(name) == m.clock.get(name, 0), f"clock of {name!r}"
            assert b.capacity(name) == (None if cap is None else cap * m.limit())
            assert b.free_slots(name) == m.free_slots(name), f"free slots of {name!r}"
            assert b.full(name) == (m.free_slots(name) == 0)
            per_step = Counter(g.dispatch_step for g in resident.values() if g.partition == name)
            if cap is None or name not in m.counters:
                assert admission_counts(b, name) is None
                continue
            assert max(per_step.values(), default=0) <= cap, f"more than b={cap} at one step: {per_step}"
            assert admission_counts(b, name) == dict(per_step), "slot counts drifted from the groups"

    @invariant()
    def every_uid_in_one_place(self) -> None:
        if self.model is None:
            return
        resident = {g.uid for g in self.m.groups}
        assert len(resident) == len(self.m.groups)
        assert not resident & set(self.m.gone)
        sampled = {uid for uid, reason in self.m.gone.items() if reason == "sampled"}
        assert sampled == self.returned
        for uid in self.m.evicted_in_flight:
            assert self.m.gone.get(uid) == "stale"


BufferMachine.TestCase.settings = PROFILES[PROFILE]
TestBufferAgainstModel = BufferMachine.TestCase


class _Suspend:
    def __await__(self) -> Any:
        yield


def test_drive_rejects_a_coroutine_that_awaits() -> None:
    """The no-loop driver must notice a sample that would have waited."""

    async def waits() -> None:
        await _Suspend()

    with pytest.raises(AssertionError, match="awaited"):
        drive(waits())


def test_replay_a_freed_slot_wakes_the_producer_although_on_evict_raised() -> None:
    """A sequence the machine found (kept so that every run replays it): a failed group is
    evicted, on_evict raises, and the producer parked on that step must still be admitted."""
    state = BufferMachine()
    state.make_buffer(
        strategy="drop",
        failure="evict",
        threshold=1,
        sync=1,
        partitions=("train", "val"),
        exempt=frozenset({"val"}),
        callback="raise",
        backend="asyncio",
        admission=1,
        in_flight=False,
        seeds=[(0, 0, "run-fail")],
    )
    state.admission_matches_model()
    state.producer_waits_for_a_sample(partition=0, lag=0, by_clock=False, advance=0, batch_size=1)
    state.admission_matches_model()
    state.buffer_matches_model()
    state.stats_match_and_conserve()
    state.teardown()
