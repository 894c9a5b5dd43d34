"""Model-based test of versioned trajectories (issue 22): the buffer against a brute-force model.

The reference model below is written from the issue's definitions alone and shares no code
with the buffer. It keeps every group's start version and every trajectory's run-length
segments, and computes everything by expanding tokens one by one:

- a token of version ``v`` sampled at ``g`` has lag ``g - v + 1``; it is stale iff the lag
  exceeds ``T*S``;
- a trajectory's head/tail is the min/max version among its segments, or the group's start
  version when it has none; a group's head is the min over its trajectories' heads and its
  start version, its tail the max over its trajectories' tails (the start version when it has
  no trajectories); a trajectory without segments contributes ``tokens`` tokens of the start
  version the group has when it is sampled;
- ``drop`` evicts a terminal group whose head is stale (and, with ``evict_stale_in_flight``, an
  in-flight one whose head is stale); ``wait`` returns no batch while an in-flight group's head
  has lag ``>= T*S``; ``mask`` evicts a terminal group whose tail is stale, never waits, and
  keeps a trajectory with tokens, all stale, out of the loss; an exempt partition does none of
  it; batches are whole groups in dispatch-step order, FIFO ties.

Hypothesis drives the buffer and the model with random ``add_prompt`` (at the clock and at
explicit steps), ``mark_running(version=)``, ``put(versions=, tokens=)`` (versions around the
trainer step, older than the dispatch step and newer; tokens only; neither; both agreeing and
disagreeing), ``mark_finished``/``mark_failed``, ``put_group(versions=, tokens=, version=)`` of
new and in-flight groups, ``rollout(version=)``, ``put_back`` and ``sample_nowait``/``sample``
at non-decreasing steps, under all three strategies, ``T`` in 1..3, ``S`` in 1..2, admission on
and off and ``evict_stale_in_flight`` on and off under ``drop``. The async calls run under the
backend the example drew (asyncio or trio).

After every ``sample`` the machine checks the evictions (which groups, which reason, oldest
first), whether a batch came back and which groups in which order, every batch array
(``token_counts``, ``head_staleness``, ``tail_staleness``, ``loss_excluded``,
``token_versions()``, ``freshness_mask()``, ``staleness``, ``target_version``) and the token
metrics; after every step it checks every resident group's start version and trajectories,
the head each in-flight group is filed under, the ready order, ``sampleable_count``, every
stats counter, the conservation of groups, trajectories and tokens, and the ``mask``
guarantee and the head rules of ``drop``/``wait`` as invariants of their own.

Profiles: the default runs 60 examples x 50 steps per strategy;
``STALEBUF_HYPOTHESIS_PROFILE=thorough`` runs 700 x 80.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, currently_in_test_context, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule

from _helpers import LIMIT, in_flight_heads, ready_order, resident_groups, version_state
from stalebuf import Batch, EvictionEvent, Group, PartitionStats, ReplayBuffer, SamplerConfig, Status
from stalebuf.errors import (
    BatchNotReadyError,
    BufferFullError,
    DuplicateTrajectoryError,
    FutureTagError,
    GroupEvictedError,
    InvalidTransitionError,
    TagClosedError,
    UnknownGroupError,
)

PROFILES: dict[str, settings] = {
    "ci": settings(
        max_examples=60,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ),
    "thorough": settings(
        max_examples=700,
        stateful_step_count=80,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ),
}
PROFILE = os.environ.get("STALEBUF_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in PROFILES:  # pragma: no cover - a typo in the environment
    raise RuntimeError(f"STALEBUF_HYPOTHESIS_PROFILE must be one of {sorted(PROFILES)}, got {PROFILE!r}")

PARTITIONS = ("train", "val")
TOKEN_METRICS = (
    "token_staleness/mean",
    "token_staleness/max",
    "masked_tokens",
    "loss_excluded_trajectories",
    "head_staleness/mean",
    "tail_staleness/mean",
)
COUNTERS = (
    "admitted_groups",
    "admitted_trajectories",
    "sampled_groups",
    "sampled_trajectories",
    "evicted_stale_groups",
    "evicted_stale_trajectories",
    "evicted_failure_groups",
    "evicted_failure_trajectories",
    "evicted_in_flight_groups",
    "admitted_tokens",
    "sampled_tokens",
    "masked_tokens",
    "evicted_tokens",
)

Segments = tuple[tuple[int, int], ...]


# -- the reference model -------------------------------------------------------------------


@dataclass
class MTraj:
    key: str
    segments: Segments  # () when put without versions
    tokens: int


@dataclass
class MGroup:
    uid: str
    partition: str
    step: int  # the dispatch step p
    seq: int
    start: int  # the start version
    status: Status = Status.PENDING
    trajs: list[MTraj] = field(default_factory=list)
    finish: int = -1

    @property
    def terminal(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILURE)

    def traj_head(self, t: MTraj) -> int:
        return min(v for v, _ in t.segments) if t.segments else self.start

    def traj_tail(self, t: MTraj) -> int:
        return max(v for v, _ in t.segments) if t.segments else self.start

    def head(self) -> int:
        return min([self.start, *(self.traj_head(t) for t in self.trajs)])

    def tail(self) -> int:
        return max(self.traj_tail(t) for t in self.trajs) if self.trajs else self.start

    def token_versions(self, t: MTraj) -> list[int]:
        """Every token's version, one by one (the brute force the buffer must never need)."""
        if t.segments:
            return [v for v, n in t.segments for _ in range(n)]
        return [self.start] * t.tokens

    def tokens(self) -> int:
        return sum(t.tokens for t in self.trajs)


@dataclass
class Model:
    """Lists and linear scans; nothing here is shared with the buffer."""

    strategy: str
    threshold: int
    sync: int
    failure: str
    admission: int | None
    evict_in_flight: bool
    exempt: frozenset[str]
    groups: list[MGroup] = field(default_factory=list)
    gone: dict[str, str] = field(default_factory=dict)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    next_seq: int = 0
    clock: dict[str, int] = field(default_factory=dict)
    last_sampled: dict[str, int] = field(default_factory=dict)
    evicted_in_flight: dict[str, str] = field(default_factory=dict)

    @property
    def span(self) -> int:
        return self.threshold * self.sync

    def lag(self, g: int, version: int) -> int:
        return g - version + 1

    def fresh(self, g: int, version: int) -> bool:
        return self.lag(g, version) <= self.span

    def is_exempt(self, partition: str) -> bool:
        return partition in self.exempt

    def find(self, uid: str) -> MGroup | None:
        for group in self.groups:
            if group.uid == uid:
                return group
        return None

    def touch(self, partition: str) -> dict[str, int]:
        return self.counters.setdefault(partition, dict.fromkeys(COUNTERS, 0))

    def evicts_failures(self, partition: str) -> bool:
        return self.failure == "evict" and not self.is_exempt(partition)

    def sampleable(self, partition: str) -> list[MGroup]:
        found = [
            x
            for x in self.groups
            if x.partition == partition
            and x.terminal
            and not (x.status is Status.FAILURE and self.evicts_failures(partition))
        ]
        return sorted(found, key=lambda x: (x.step, x.seq))

    def in_flight(self, partition: str) -> list[MGroup]:
        return [x for x in self.groups if x.partition == partition and not x.terminal]

    def evicted_by_sample(self, g: int, group: MGroup) -> bool:
        """Whether a sample at ``g`` evicts the terminal ``group`` as stale."""
        if self.is_exempt(group.partition):
            return False
        if self.strategy == "drop":
            return not self.fresh(g, group.head())
        if self.strategy == "mask":
            return not self.fresh(g, group.tail())
        return False

    def evicted_in_flight_by_sample(self, g: int, group: MGroup) -> bool:
        return (
            self.evict_in_flight
            and self.strategy == "drop"
            and not self.is_exempt(group.partition)
            and not self.fresh(g, group.head())
        )

    def gate_closed(self, g: int, partition: str) -> bool:
        if self.strategy != "wait" or self.is_exempt(partition):
            return False
        return any(self.lag(g, x.head()) >= self.span for x in self.in_flight(partition))

    def masks(self, partition: str) -> bool:
        return self.strategy == "mask" and not self.is_exempt(partition)

    # admission, as tests/test_model_based.py models it (dispatch steps only: versions never
    # enter it)

    def cap(self, partition: str) -> int | None:
        return None if self.admission is None or self.is_exempt(partition) else self.admission

    def tag(self, partition: str, step: int | None) -> int:
        return self.clock.get(partition, 0) if step is None else step

    def closed_tag(self, partition: str, step: int) -> bool:
        return self.last_sampled.get(partition, -1) + 1 - step + 1 > self.span

    def refusal(self, partition: str, step: int | None) -> type[Exception] | None:
        cap = self.cap(partition)
        if cap is None:
            return None
        tag = self.tag(partition, step)
        if tag > self.clock.get(partition, 0):
            return FutureTagError
        resident = sum(1 for x in self.groups if x.partition == partition and x.step == tag)
        if resident < cap and not self.closed_tag(partition, tag):
            return None
        return TagClosedError if step is not None and self.closed_tag(partition, step) else BufferFullError

    def finish_step(self, group: MGroup) -> int:
        return max(self.clock.get(group.partition, 0), group.step)

    # changes

    def add(self, uid: str, step: int, partition: str) -> MGroup:
        group = MGroup(uid, partition, step, self.next_seq, start=step)
        self.next_seq += 1
        self.groups.append(group)
        self.touch(partition)["admitted_groups"] += 1
        self.evicted_in_flight.pop(uid, None)
        self.gone.pop(uid, None)
        return group

    def add_trajectory(self, group: MGroup, traj: MTraj) -> None:
        group.trajs.append(traj)
        counters = self.touch(group.partition)
        counters["admitted_trajectories"] += 1
        counters["admitted_tokens"] += traj.tokens

    def end(self, group: MGroup, failed: bool) -> None:
        group.status = Status.FAILURE if failed else Status.FINISHED
        group.finish = self.finish_step(group)

    def remove(self, victims: list[MGroup], reason: str) -> None:
        prefix = {"sampled": "sampled", "stale": "evicted_stale", "failure": "evicted_failure"}[reason]
        for victim in victims:
            self.groups.remove(victim)
            self.gone[victim.uid] = reason
            counters = self.touch(victim.partition)
            counters[f"{prefix}_groups"] += 1
            counters[f"{prefix}_trajectories"] += len(victim.trajs)
            counters["sampled_tokens" if reason == "sampled" else "evicted_tokens"] += victim.tokens()

    def expected_stats(self, partition: str) -> PartitionStats:
        mine = [x for x in self.groups if x.partition == partition]
        cap = self.cap(partition)
        return PartitionStats(
            pending=sum(x.status is Status.PENDING for x in mine),
            running=sum(x.status is Status.RUNNING for x in mine),
            finished=sum(x.status is Status.FINISHED for x in mine),
            failure=sum(x.status is Status.FAILURE for x in mine),
            trajectories=sum(len(x.trajs) for x in mine),
            tokens=sum(x.tokens() for x in mine),
            resident_tokens=sum(x.tokens() for x in mine if x.terminal),  # issue 24: terminal groups' only
            capacity=None if cap is None else cap * self.span,
            **self.counters[partition],
        )

    def write_error(self, uid: str) -> type[Exception] | None:
        group = self.find(uid)
        if group is None:
            return GroupEvictedError if uid in self.evicted_in_flight else UnknownGroupError
        return InvalidTransitionError if group.terminal else None


# -- what a batch must hold, from the definitions ----------------------------------------------


@dataclass
class Expected:
    """The arrays and token metrics a batch of ``chosen`` groups sampled at ``g`` must carry."""

    token_counts: list[int]
    head: list[float]
    tail: list[float]
    excluded: list[bool]
    versions: list[int]
    offsets: list[int]
    fresh: list[bool]
    masked: int
    metrics: dict[str, float]


def expected_batch(m: Model, partition: str, g: int, chosen: list[MGroup]) -> Expected:
    s = m.sync
    counts, head, tail, excluded, versions, offsets, fresh = [], [], [], [], [], [0], []
    masked = 0
    masks = m.masks(partition)
    for group in chosen:
        for t in group.trajs:
            mine = group.token_versions(t)
            assert len(mine) == t.tokens
            counts.append(t.tokens)
            head.append(m.lag(g, group.traj_head(t)) / s)
            tail.append(m.lag(g, group.traj_tail(t)) / s)
            flags = [m.fresh(g, v) for v in mine]
            excluded.append(masks and bool(mine) and not any(flags))
            if masks:
                masked += flags.count(False)
            versions += mine
            fresh += flags
            offsets.append(len(versions))
    metrics: dict[str, float] = {}
    if versions:
        # The metrics count a version newer than g as fresh (lag 1; issue 25), the arrays do not.
        lags = [max(m.lag(g, v), 1) / s for v in versions]
        fresh_head = [max(lag, 1 / s) for lag in head]
        fresh_tail = [max(lag, 1 / s) for lag in tail]
        # exact sums of small multiples of 1/S, then one division: the float the buffer must give
        metrics = {
            "token_staleness/mean": sum(lags) / len(lags),
            "token_staleness/max": max(lags),
            "masked_tokens": float(masked),
            "loss_excluded_trajectories": float(sum(excluded)),
            "head_staleness/mean": sum(fresh_head) / len(fresh_head),
            "tail_staleness/mean": sum(fresh_tail) / len(fresh_tail),
        }
    return Expected(counts, head, tail, excluded, versions, offsets, fresh, masked, metrics)


# -- helpers ---------------------------------------------------------------------------------


def note(what: str) -> None:
    if currently_in_test_context():
        hypothesis_event(what)


class CallbackError(Exception):
    """Raised by the machine's on_evict in "raise" mode."""


class Boom(Exception):
    """A rollout body that fails."""


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


# A trajectory as drawn: (kind, tokens, segments as (offset from the trainer step, n_tokens)).
# kind: "none" (neither given), "tokens" (tokens only, 0 allowed), "versions" (versions only),
# "both" (agreeing), "mismatch" (both, disagreeing: a ValueError).
TrajSpec = tuple[str, int, list[tuple[int, int]]]
traj_specs = st.tuples(
    st.sampled_from(("none", "tokens", "tokens", "versions", "versions", "versions", "both")),
    st.integers(0, 4),
    st.lists(st.tuples(st.integers(-7, 2), st.integers(1, 4)), min_size=1, max_size=3),
)
# None, or an offset from the trainer step (older than the dispatch step, and newer)
version_offsets = st.one_of(st.none(), st.none(), st.integers(-7, 3))


# -- the state machine -----------------------------------------------------------------------


class VersionsMachine(RuleBasedStateMachine):
    uids = Bundle("uids")
    # a uid to write to: any drawn so far (most have left), an unknown one, or (an int) one of
    # the groups in flight now, picked by index
    targets = st.one_of(uids, st.just("ghost"), st.integers(0, 63), st.integers(0, 63))

    def __init__(self) -> None:
        super().__init__()
        self.buf: ReplayBuffer | None = None
        self.model: Model | None = None
        self.trainer_step = 0
        self.next_uid = 0
        self.events: list[EvictionEvent] = []
        self.callback = "record"
        self.backend = "asyncio"
        self.returned: list[Group] = []  # groups sample returned, for put_back

    @property
    def b(self) -> ReplayBuffer:
        assert self.buf is not None
        return self.buf

    @property
    def m(self) -> Model:
        assert self.model is not None
        return self.model

    def fresh_uid(self, prefix: str = "g") -> str:
        self.next_uid += 1
        return f"{prefix}{self.next_uid}"

    def on_evict(self, event: EvictionEvent) -> None:
        self.events.append(event)
        if self.callback == "raise":
            raise CallbackError(event.reason)

    def run(self, make: Callable[[], Awaitable[Any]]) -> Any:
        """Run one async call under the example's backend."""

        async def main() -> Any:
            with anyio.fail_after(LIMIT):
                return await make()

        return anyio.run(main, backend=self.backend)

    def partition(self, which: int) -> str:
        return PARTITIONS[which % len(PARTITIONS)]

    def version(self, offset: int | None) -> int | None:
        return None if offset is None else max(0, self.trainer_step + offset)

    def resolve(self, spec: TrajSpec) -> tuple[Any, Any, Segments, int, bool]:
        """``(versions=, tokens=)`` to pass, the segments and tokens the model keeps, and
        whether the call must raise ValueError (both given, disagreeing)."""
        kind, tokens, offsets = spec
        segments = tuple((max(0, self.trainer_step + d), n) for d, n in offsets)
        total = sum(n for _, n in segments)
        if kind == "none":
            return None, None, (), 0, False
        if kind == "tokens":
            return None, tokens, (), tokens, False
        as_list = [list(pair) for pair in segments]  # any sequence of pairs will do
        if kind == "versions":
            return as_list, None, segments, total, False
        if kind == "both":
            return as_list, total, segments, total, False
        return as_list, total + 1, segments, total, True

    # -- rules -------------------------------------------------------------------------

    def make_buffer(
        self,
        strategy: str,
        threshold: int,
        sync: int,
        failure: str,
        admission: int | None,
        in_flight: bool,
        exempt: frozenset[str],
        callback: str,
        backend: str,
    ) -> Any:
        in_flight = in_flight and strategy == "drop"
        config = SamplerConfig(
            max_off_policy_strategy=strategy,  # type: ignore[arg-type]
            max_off_policy_threshold=threshold,
            parameter_sync_step=sync,
            failure_strategy=failure,  # type: ignore[arg-type]
            admission_batch_size=admission,
            evict_stale_in_flight=in_flight,
            exempt_partitions=exempt,
        )
        self.buf = ReplayBuffer(config, on_evict=self.on_evict, status_log_interval=None)
        self.model = Model(strategy, threshold, sync, failure, admission, in_flight, exempt)
        self.callback, self.backend = callback, backend
        return multiple()

    def try_add(self, partition: str, step: int | None) -> str | None:
        uid = self.fresh_uid()
        _, exc = outcome(lambda: self.b.add_prompt_nowait(uid, global_steps=step, partition=partition))
        refusal = self.m.refusal(partition, step)
        check_error(exc, refusal, f"add_prompt({uid!r}, {step}) in {partition!r}")
        if refusal is not None:
            return None
        self.m.add(uid, self.m.tag(partition, step), partition)
        return uid

    def step_for(self, lag: int, by_clock: bool) -> int | None:
        return None if by_clock else max(0, self.trainer_step - lag)

    @rule(target=uids, partition=st.integers(0, 1), lag=st.integers(-1, 4), by_clock=st.booleans())
    def add_prompt(self, partition: int, lag: int, by_clock: bool) -> Any:
        uid = self.try_add(self.partition(partition), self.step_for(lag, by_clock))
        return multiple() if uid is None else uid

    def target(self, uid: str | int) -> str:
        """``uid``, or for an int one of the groups in flight now (by index)."""
        if isinstance(uid, str):
            return uid
        flying = [x for x in self.m.groups if not x.terminal]
        return flying[uid % len(flying)].uid if flying else "ghost"

    @rule(uid=targets, offset=version_offsets, in_loop=st.booleans())
    def mark_running(self, uid: str | int, offset: int | None, in_loop: bool) -> None:
        uid = self.target(uid)
        version = self.version(offset)
        if in_loop:
            _, exc = outcome(lambda: self.run(lambda: self.b.mark_running(uid, version=version)))
        else:
            _, exc = outcome(lambda: self.b.mark_running_nowait(uid, version=version))
        expected = self.m.write_error(uid)
        group = self.m.find(uid)
        if expected is None and group is not None and group.status is Status.RUNNING:
            expected = InvalidTransitionError
        check_error(exc, expected, f"mark_running({uid!r}, version={version})")
        if expected is None:
            assert group is not None
            group.status = Status.RUNNING
            if version is not None:
                group.start = version
                note("mark_running with a version")

    @rule(
        uid=targets,
        session=st.integers(0, 3),
        spec=traj_specs,
        mismatch=st.integers(0, 19),
        in_loop=st.booleans(),
    )
    def put(self, uid: str | int, session: int, spec: TrajSpec, mismatch: int, in_loop: bool) -> None:
        uid = self.target(uid)
        if mismatch == 0:
            spec = ("mismatch", *spec[1:])
        versions, tokens, segments, total, bad = self.resolve(spec)
        payload = object()

        def call() -> Any:
            if in_loop:
                return self.run(
                    lambda: self.b.put(uid, payload, session_id=session, versions=versions, tokens=tokens)
                )
            return self.b.put_nowait(uid, payload, session_id=session, versions=versions, tokens=tokens)

        key, exc = outcome(call)
        group = self.m.find(uid)
        want = f"{uid}_{session}_0"
        expected: type[Exception] | None
        if bad:
            expected = ValueError  # the arguments are checked before the group is looked up
        else:
            expected = self.m.write_error(uid)
            if expected is None and group is not None and any(t.key == want for t in group.trajs):
                expected = DuplicateTrajectoryError
        check_error(exc, expected, f"put({uid!r}, versions={versions}, tokens={tokens})")
        if expected is None:
            assert group is not None
            assert key == want
            self.m.add_trajectory(group, MTraj(want, segments, total))

    @rule(uid=targets, failed=st.booleans())
    def terminate(self, uid: str | int, failed: bool) -> None:
        uid = self.target(uid)
        call = self.b.mark_failed_nowait if failed else self.b.mark_finished_nowait
        _, exc = outcome(lambda: call(uid))
        expected = self.m.write_error(uid)
        check_error(exc, expected, f"mark_{'failed' if failed else 'finished'}({uid!r})")
        if expected is None:
            group = self.m.find(uid)
            assert group is not None
            self.m.end(group, failed)

    @rule(failed=st.integers(0, 3))
    def straggler_finishes(self, failed: int) -> None:
        """The in-flight group with the oldest head (the one the wait gate waits for) ends."""
        flying = [x for x in self.m.groups if not x.terminal]
        if flying:
            oldest = min(flying, key=lambda x: (x.head(), x.seq))
            self.terminate(oldest.uid, failed == 0)

    @rule(
        target=uids,
        partition=st.integers(0, 1),
        lag=st.integers(0, 4),
        by_clock=st.booleans(),
        offset=version_offsets,
        specs=st.lists(traj_specs, max_size=3),
        end=st.sampled_from(("finish", "finish", "finish", "fail", "stay")),
    )
    def produce_group(
        self,
        partition: int,
        lag: int,
        by_clock: bool,
        offset: int | None,
        specs: list[TrajSpec],
        end: str,
    ) -> Any:
        """A whole producer round trip in one step, so that sampleable groups are common
        (``stay``: left in flight, for the wait gate and in-flight eviction)."""
        uid = self.try_add(self.partition(partition), self.step_for(lag, by_clock))
        if uid is None:
            return multiple()
        self.mark_running(uid, offset, in_loop=False)
        for session, spec in enumerate(specs):
            self.put(uid, session, spec, mismatch=1, in_loop=False)
        if end != "stay":
            self.terminate(uid, failed=end == "fail")
        return uid

    @rule(
        target=uids,
        partition=st.integers(0, 3),
        lag=st.integers(0, 4),
        start=st.integers(-5, 2),
        runs=st.lists(
            st.lists(st.tuples(st.integers(-4, 4), st.integers(1, 3)), min_size=1, max_size=3), max_size=3
        ),
        plain=st.integers(0, 5),
        end=st.sampled_from(("finish", "finish", "fail", "stay")),
        copies=st.integers(1, 3),
    )
    def produce_versioned_groups(
        self,
        partition: int,
        lag: int,
        start: int,
        runs: list[list[tuple[int, int]]],
        plain: int,
        end: str,
        copies: int,
    ) -> Any:
        """Groups started at an explicit version (older or newer than their dispatch step)
        whose trajectories carry versions older and newer than that start (one of them, now and
        then, without segments: its tokens count at the start version); ``copies`` alike, each
        started one version later than the one before."""
        name = "train" if partition >= 2 else self.partition(partition)
        made = []
        for copy in range(copies):
            uid = self.try_add(name, self.step_for(lag, False))
            if uid is None:
                break
            version = max(0, self.trainer_step + start + copy)
            self.mark_running(uid, version - self.trainer_step, in_loop=False)
            for session, segments in enumerate(runs):
                spec: TrajSpec = (
                    ("tokens", plain, [(0, 1)])
                    if plain == session
                    else ("versions", 0, [(version - self.trainer_step + d, n) for d, n in segments])
                )
                self.put(uid, session, spec, mismatch=1, in_loop=False)
            if end != "stay":
                self.terminate(uid, failed=end == "fail")
            made.append(uid)
        return multiple(*made)

    def group_columns(self, specs: list[TrajSpec], style: int) -> tuple[Any, Any, list[MTraj], bool]:
        """put_group's ``versions=``/``tokens=`` for ``specs`` and the trajectories they make
        (keys filled in later), and whether a ValueError is due."""
        resolved = [self.resolve(spec) for spec in specs]
        versions = [r[0] for r in resolved]
        tokens = [r[1] for r in resolved]
        bad = any(r[4] for r in resolved)
        if style == 0 and all(v is None for v in versions):
            versions = None  # type: ignore[assignment]
        if style == 0 and all(t is None for t in tokens):
            tokens = None  # type: ignore[assignment]
        if style == 1:  # tuples, not lists: any sequence will do
            versions, tokens = tuple(versions), tuple(tokens)  # type: ignore[assignment]
        return versions, tokens, [MTraj("", r[2], r[3]) for r in resolved], bad

    @rule(
        target=uids,
        partition=st.integers(0, 1),
        lag=st.integers(-1, 4),
        by_clock=st.booleans(),
        specs=st.lists(traj_specs, max_size=3),
        offset=version_offsets,
        style=st.integers(0, 2),
        failed=st.booleans(),
        in_loop=st.booleans(),
        plain=st.integers(0, 2),
    )
    def put_group_new(
        self,
        partition: int,
        lag: int,
        by_clock: bool,
        specs: list[TrajSpec],
        offset: int | None,
        style: int,
        failed: bool,
        in_loop: bool,
        plain: int,
    ) -> Any:
        """A whole new group in one call (``plain == 0``: without versions or tokens, the fast
        path that stores the group lazily, with or without a start version)."""
        if plain == 0:
            specs, style, failed = [("none", 0, [(0, 1)])] * len(specs), 0, False
        name = self.partition(partition)
        step = self.step_for(lag, by_clock)
        uid = self.fresh_uid("p")
        version = self.version(offset)
        versions, tokens, trajs, bad = self.group_columns(specs, style)
        status = "failed" if failed else "finished"
        payloads = list(range(len(specs)))
        refusal = ValueError if bad else self.m.refusal(name, step)

        def call() -> Any:
            kwargs = {"global_steps": step, "partition": name, "status": status}
            if in_loop and refusal is None:  # the async twin would wait for a slot
                return self.run(
                    lambda: self.b.put_group(
                        uid, payloads, **kwargs, versions=versions, tokens=tokens, version=version
                    )
                )
            return self.b.put_group_nowait(
                uid, payloads, **kwargs, versions=versions, tokens=tokens, version=version
            )

        keys, exc = outcome(call)
        check_error(exc, refusal, f"put_group({uid!r}) at {step} in {name!r}")
        if refusal is not None:
            return multiple()
        assert keys == [f"{uid}_{i}_0" for i in range(len(specs))]
        group = self.m.add(uid, self.m.tag(name, step), name)
        if version is not None:
            group.start = version
        for key, traj in zip(keys, trajs, strict=True):
            traj.key = key
            self.m.add_trajectory(group, traj)
        self.m.end(group, failed)
        if versions is None and tokens is None and not failed:
            note("put_group: fast path" + (" with a version" if version is not None else ""))
        return uid

    @rule(
        uid=targets,
        specs=st.lists(traj_specs, min_size=1, max_size=2),
        offset=version_offsets,
        style=st.integers(0, 2),
        failed=st.booleans(),
    )
    def put_group_existing(
        self, uid: str | int, specs: list[TrajSpec], offset: int | None, style: int, failed: bool
    ) -> None:
        uid = self.target(uid)
        group = self.m.find(uid)
        if group is None:  # a uid that left: put_group would add it anew (or raise GroupEvictedError)
            return
        version = self.version(offset)
        versions, tokens, trajs, bad = self.group_columns(specs, style)
        sessions = list(range(5, 5 + len(specs)))
        keys, exc = outcome(
            lambda: self.b.put_group_nowait(
                uid,
                ["x"] * len(specs),
                partition=group.partition,
                session_ids=sessions,
                status="failed" if failed else "finished",
                versions=versions,
                tokens=tokens,
                version=version,
            )
        )
        wanted = [f"{uid}_{session}_0" for session in sessions]
        expected: type[Exception] | None
        if bad:
            expected = ValueError
        elif group.terminal:
            expected = InvalidTransitionError
        elif set(wanted) & {t.key for t in group.trajs}:
            expected = DuplicateTrajectoryError
        else:
            expected = None
        check_error(exc, expected, f"put_group({uid!r}) into a resident group")
        if expected is None:
            assert keys == wanted
            if version is not None:
                group.start = version
            for key, traj in zip(keys, trajs, strict=True):
                traj.key = key
                self.m.add_trajectory(group, traj)
            self.m.end(group, failed)

    @rule(
        target=uids,
        partition=st.integers(0, 1),
        lag=st.integers(0, 3),
        by_clock=st.booleans(),
        offset=version_offsets,
        specs=st.lists(traj_specs, max_size=3),
        failed=st.booleans(),
    )
    def rollout_group(
        self,
        partition: int,
        lag: int,
        by_clock: bool,
        offset: int | None,
        specs: list[TrajSpec],
        failed: bool,
    ) -> Any:
        """``rollout(version=)`` in an event loop: admitted, run at the version, filled, ended."""
        name = self.partition(partition)
        step = self.step_for(lag, by_clock)
        if self.m.refusal(name, step) is not None:
            return multiple()  # add_prompt would wait (or raise): tests/test_rollout.py's
        uid = self.fresh_uid("r")
        version = self.version(offset)
        resolved = [self.resolve(spec) for spec in specs]
        resolved = [r for r in resolved if not r[4]]

        async def body() -> None:
            async with self.b.rollout(uid, global_steps=step, partition=name, version=version) as group:
                for session, (versions, tokens, _, _, _) in enumerate(resolved):
                    await group.put(session, session_id=session, versions=versions, tokens=tokens)
                if failed:
                    raise Boom

        _, exc = outcome(lambda: self.run(body))
        check_error(exc, Boom if failed else None, f"rollout({uid!r})")
        group = self.m.add(uid, self.m.tag(name, step), name)
        group.status = Status.RUNNING
        if version is not None:
            group.start = version
        for session, (_, _, segments, total, _) in enumerate(resolved):
            self.m.add_trajectory(group, MTraj(f"{uid}_{session}_0", segments, total))
        self.m.end(group, failed)
        return uid

    @rule(which=st.integers(0, 7))
    def put_back(self, which: int) -> None:
        """Put a returned group back: same uid, step, status, start version, versions, tokens."""
        if not self.returned:
            return
        record = self.returned.pop(which % len(self.returned))
        assert self.b.put_back(record) is True
        group = self.m.add(record.uid, record.dispatch_step, record.partition)
        group.start = record.start_version
        for t in record.trajectories:
            self.m.add_trajectory(group, MTraj(t.key, t.versions, t.tokens))
        self.m.end(group, record.status is Status.FAILURE)
        note("put_back")

    @rule(
        target=uids,
        partition=st.integers(0, 3),
        batch_size=st.integers(1, 3),
        advance=st.integers(0, 3),
        in_loop=st.integers(0, 3),
    )
    def sample(self, partition: int, batch_size: int, advance: int, in_loop: int) -> Any:
        """Any partition (mostly "train"); the trainer step moves on by ``advance``."""
        self.trainer_step += advance
        name = "train" if partition >= 2 else self.partition(partition)
        return self.do_sample(name, self.trainer_step, batch_size, in_loop == 0)

    @rule(target=uids, batch_size=st.integers(1, 2), advance=st.integers(0, 1))
    def trainer_sample(self, batch_size: int, advance: int) -> Any:
        """The trainer: "train", small batches (a second sampling rule, so that swarm testing
        rarely leaves a run without sampling)."""
        self.trainer_step += advance
        return self.do_sample("train", self.trainer_step, batch_size, False)

    @rule(
        target=uids,
        which=st.integers(0, 63),
        edge=st.sampled_from(("head", "tail", "step")),
        delta=st.integers(-1, 1),
        batch_size=st.integers(1, 3),
        in_loop=st.integers(0, 3),
    )
    def sample_at_an_edge(self, which: int, edge: str, delta: int, batch_size: int, in_loop: int) -> Any:
        """Sample a resident group's partition at a step where the group's head, tail or
        dispatch step is one step from, at, or just past the staleness bound (if that step is
        not in the past)."""
        if not self.m.groups:
            return multiple()
        return self.sample_at(self.m.groups[which % len(self.m.groups)], edge, delta, batch_size, in_loop)

    @rule(
        target=uids,
        which=st.integers(0, 63),
        edge=st.sampled_from(("head", "head", "step")),
        delta=st.integers(-1, 1),
        batch_size=st.integers(1, 2),
    )
    def sample_at_an_in_flight_edge(self, which: int, edge: str, delta: int, batch_size: int) -> Any:
        """The same at an in-flight group's head or dispatch step: the wait gate's edge (and
        in-flight eviction's)."""
        flying = [x for x in self.m.groups if not x.terminal]
        if not flying:
            return multiple()
        return self.sample_at(flying[which % len(flying)], edge, delta, batch_size, 1)

    def sample_at(self, group: MGroup, edge: str, delta: int, batch_size: int, in_loop: int) -> Any:
        version = {"head": group.head(), "tail": group.tail(), "step": group.step}[edge]
        g = version + self.m.span - 1 + delta  # lag T*S + delta
        if g < self.trainer_step:
            return multiple()
        self.trainer_step = g
        note(f"sampled at the {edge}'s edge")
        return self.do_sample(group.partition, g, batch_size, in_loop == 0)

    def do_sample(self, name: str, g: int, batch_size: int, in_loop: bool) -> Any:
        m = self.m
        self.events.clear()
        stats_before = self.b.stats()
        if in_loop:
            result, exc = outcome(
                lambda: self.run(lambda: self.b.sample(g, batch_size, partition=name, timeout=0))
            )
        else:
            result, exc = outcome(lambda: self.b.sample_nowait(g, batch_size, partition=name))
        m.clock[name] = max(m.clock.get(name, 0), g)
        # 1. evictions: failed groups, then stale ones (terminal by head/tail, in flight by head)
        predicted: list[tuple[str, list[MGroup]]] = []
        if m.evicts_failures(name):
            failed = sorted(
                (x for x in m.groups if x.partition == name and x.status is Status.FAILURE),
                key=lambda x: (x.step, x.seq),
            )
            if failed:
                predicted.append(("failure", failed))
        stale = [x for x in m.sampleable(name) if m.evicted_by_sample(g, x)]
        in_flight = [x for x in m.in_flight(name) if m.evicted_in_flight_by_sample(g, x)]
        if stale or in_flight:
            predicted.append(("stale", stale + in_flight))
        actual = [(e.reason, [x.uid for x in e.groups]) for e in self.events]
        want = [(reason, sorted(x.uid for x in groups)) for reason, groups in predicted]
        assert [(reason, sorted(uids)) for reason, uids in actual] == want, (
            f"evictions at g={g} in {name!r}: got {actual}, model says {want}"
        )
        flying = {x.uid for x in in_flight}
        for (reason, got), (_, groups) in zip(actual, predicted, strict=True):
            terminal = [x.uid for x in groups if x.uid not in flying]
            assert [u for u in got if u not in flying] == terminal, f"{reason} event not oldest first"
            note(f"evicted ({reason}{', in flight' if flying and reason == 'stale' else ''})")
        for event in self.events:
            assert event.global_steps == g
            assert event.partition == name
            steps = [x.dispatch_step for x in event.groups]
            assert steps == sorted(steps)
            if event.reason == "stale" and m.strategy == "mask":
                note("mask evicted")
                for x in event.groups:  # the mask guarantee: not one fresh token evicted
                    assert not any(m.fresh(g, v) for t in x.trajectories for v in token_versions_of(x, t)), (
                        f"mask evicted {x.uid} holding a fresh token"
                    )
            self.check_evicted_records(event, {x.uid: x for _, groups in predicted for x in groups})
        for reason, groups in predicted:
            if reason == "stale":
                for x in in_flight:
                    m.evicted_in_flight[x.uid] = name
                m.touch(name)["evicted_in_flight_groups"] += len(in_flight)
            m.remove(groups, reason)
        if self.callback == "raise" and predicted:
            check_error(exc, CallbackError, "sample whose on_evict raised")
            return multiple()
        # 2. selection
        candidates = m.sampleable(name)
        ready = len(candidates) >= batch_size and not m.gate_closed(g, name)
        if not ready:
            if len(candidates) >= batch_size:
                note("held by the wait gate")
            check_error(exc, TimeoutError if in_loop else BatchNotReadyError, f"sample({g}, {batch_size})")
            assert self.b.stats().total.sampled_groups == stats_before.total.sampled_groups
            return multiple()
        check_error(exc, None, f"sample({g}, {batch_size}) in {name!r}")
        batch, metrics = result
        chosen = candidates[:batch_size]
        self.check_batch(name, g, batch, metrics, chosen)
        m.last_sampled[name] = max(m.last_sampled.get(name, -1), g)
        expected = expected_batch(m, name, g, chosen)
        m.remove(chosen, "sampled")
        m.touch(name)["masked_tokens"] += expected.masked
        self.returned += batch.groups
        del self.returned[:-8]
        note("sample: batch")
        return multiple()

    def check_evicted_records(self, event: EvictionEvent, by_uid: dict[str, MGroup]) -> None:
        for record in event.groups:
            want = by_uid[record.uid]
            assert record.start_version == want.start
            assert [(t.key, t.versions, t.tokens) for t in record.trajectories] == [
                (t.key, t.segments, t.tokens) for t in want.trajs
            ]

    def check_batch(
        self, name: str, g: int, batch: Batch, metrics: dict[str, float], chosen: list[MGroup]
    ) -> None:
        m = self.m
        assert isinstance(batch, Batch)
        assert batch.uids == [x.uid for x in chosen], "not in dispatch order with FIFO ties"
        assert batch.global_steps == g
        assert batch.target_version == g
        for got, want in zip(batch.groups, chosen, strict=True):
            assert got.dispatch_step == want.step
            assert got.status is want.status
            assert got.start_version == want.start
            assert got.finish_step == want.finish
            assert [(t.key, t.versions, t.tokens) for t in got.trajectories] == [
                (t.key, t.segments, t.tokens) for t in want.trajs
            ]
        # the head rules
        if m.strategy == "drop" and not m.is_exempt(name):
            assert all(m.fresh(g, x.head()) for x in chosen), "drop returned a group with a stale head"
        if m.strategy == "wait" and not m.is_exempt(name):
            assert not m.gate_closed(g, name), "wait returned while an in-flight head has lag >= T*S"
        exp = expected_batch(m, name, g, chosen)
        assert batch.staleness.tolist() == [m.lag(g, x.step) / m.sync for x in chosen]
        counts = batch.token_counts
        assert counts.dtype == "int64"
        assert counts.tolist() == exp.token_counts
        assert batch.head_staleness.dtype == "float64"
        assert batch.head_staleness.tolist() == exp.head
        assert batch.tail_staleness.tolist() == exp.tail
        excluded = batch.loss_excluded
        assert excluded.dtype == "bool"
        assert excluded.tolist() == exp.excluded
        versions, offsets = batch.token_versions()
        assert versions.dtype == "int64"
        assert offsets.dtype == "int64"
        assert versions.tolist() == exp.versions
        assert offsets.tolist() == exp.offsets
        mask, mask_offsets = batch.freshness_mask()
        assert mask.dtype == "bool"
        assert mask.tolist() == exp.fresh, "freshness_mask is not lag <= T*S per token"
        assert mask_offsets.tolist() == exp.offsets
        if exp.versions:
            note("batch with tokens" + (", some masked" if exp.masked else ""))
        prefix = ("training" if name == "train" else "validation") + "/off_policy/"
        got_metrics = {key[len(prefix) :]: value for key, value in metrics.items() if key.startswith(prefix)}
        got_metrics = {key: value for key, value in got_metrics.items() if key in TOKEN_METRICS}
        assert got_metrics == exp.metrics, f"token metrics at g={g}"

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def buffer_matches_model(self) -> None:
        if self.buf is None:
            return
        m, b = self.m, self.b
        resident = {x.uid: x for x in m.groups}
        groups = resident_groups(b)
        assert set(groups) == set(resident), "resident uids differ"
        state = version_state(b)
        for uid, real in groups.items():
            want = resident[uid]
            assert real.status is want.status, uid
            assert real.dispatch_step == want.step, uid
            assert real.partition == want.partition, uid
            start, trajs = state[uid]
            assert start == want.start, f"{uid}: start version {start}, model {want.start}"
            assert trajs == [(t.key, t.segments, t.tokens) for t in want.trajs], uid
        for name in PARTITIONS:
            heads = {x.uid: x.head() for x in m.in_flight(name)}
            assert in_flight_heads(b, name) == heads, f"in-flight groups of {name!r} not filed by head"
        for name, order in ready_order(b).items():
            assert order == [x.uid for x in m.sampleable(name)], f"ready order of {name!r}"

    @invariant()
    def stats_match_and_conserve(self) -> None:
        if self.buf is None:
            return
        stats = self.b.stats()
        assert set(stats.partitions) == set(self.m.counters)
        for name, got in stats.partitions.items():
            assert got == self.m.expected_stats(name), f"stats of {name!r}"
        for item in (*stats.partitions.values(), stats.total):
            assert item.admitted_groups == (
                item.groups + item.sampled_groups + item.evicted_stale_groups + item.evicted_failure_groups
            )
            assert item.admitted_trajectories == (
                item.trajectories
                + item.sampled_trajectories
                + item.evicted_stale_trajectories
                + item.evicted_failure_trajectories
            )
            assert item.admitted_tokens == (
                item.sampled_tokens + item.evicted_tokens + item.reissued_tokens + item.tokens
            ), f"token conservation broken: {item}"
            assert 0 <= item.masked_tokens <= item.sampled_tokens
            if self.m.strategy != "mask":
                assert item.masked_tokens == 0
            if self.m.strategy == "wait":
                assert item.evicted_stale_groups == 0

    @invariant()
    def sampleable_count_agrees(self) -> None:
        """``sampleable_count`` counts what ``sample`` would select from, now and later."""
        if self.buf is None:
            return
        for name in PARTITIONS:
            for g in (self.trainer_step, self.trainer_step + 1, self.trainer_step + 3):
                want = sum(1 for x in self.m.sampleable(name) if not self.m.evicted_by_sample(g, x))
                assert self.b.sampleable_count(g, name) == want, f"sampleable_count({g}, {name!r})"

    def teardown(self) -> None:
        if self.model is None:
            return
        for name in PARTITIONS:  # a last sample of each partition, checked like any other
            self.do_sample(name, self.trainer_step, 1, in_loop=False)
            self.buffer_matches_model()
            self.stats_match_and_conserve()


def token_versions_of(group: Group, t: Any) -> list[int]:
    """A returned record's token versions, one by one (from the definitions)."""
    if t.versions:
        return [v for v, n in t.versions for _ in range(n)]
    return [group.start_version] * t.tokens


# The buffer's configuration, drawn once per run (the strategy is each machine's own, so that
# every strategy gets a third of the examples).
CONFIGS = {
    "threshold": st.integers(1, 3),
    "sync": st.integers(1, 2),
    "failure": st.sampled_from(("sample", "evict")),
    "admission": st.sampled_from((None, None, None, 1, 2)),
    "in_flight": st.booleans(),
    "exempt": st.sampled_from((frozenset(), frozenset({"val"}))),
    "callback": st.sampled_from(("record", "record", "raise")),
    "backend": st.sampled_from(("asyncio", "trio")),
}


class DropMachine(VersionsMachine):
    @initialize(target=VersionsMachine.uids, **CONFIGS)
    def make_drop_buffer(self, **config: Any) -> Any:
        return self.make_buffer("drop", **config)


class WaitMachine(VersionsMachine):
    @initialize(target=VersionsMachine.uids, **CONFIGS)
    def make_wait_buffer(self, **config: Any) -> Any:
        return self.make_buffer("wait", **config)


class MaskMachine(VersionsMachine):
    @initialize(target=VersionsMachine.uids, **CONFIGS)
    def make_mask_buffer(self, **config: Any) -> Any:
        return self.make_buffer("mask", **config)


for _machine in (DropMachine, WaitMachine, MaskMachine):
    _machine.TestCase.settings = PROFILES[PROFILE]
TestDropAgainstModel = DropMachine.TestCase
TestWaitAgainstModel = WaitMachine.TestCase
TestMaskAgainstModel = MaskMachine.TestCase


def test_the_model_expands_tokens_by_the_definitions() -> None:
    """The reference itself, on the issue's worked numbers: T=1, S=1, g=2, a trajectory of
    versions ((0, 3), (2, 2)) has lags 3,3,3,1,1: three stale tokens, two fresh; a trajectory
    without segments of 5 tokens counts at the start version."""
    m = Model("mask", 1, 1, "sample", None, False, frozenset())
    group = MGroup("a", "train", 0, 0, start=1)
    group.trajs = [MTraj("a_0_0", ((0, 3), (2, 2)), 5), MTraj("a_1_0", (), 5), MTraj("a_2_0", (), 0)]
    assert (group.head(), group.tail()) == (0, 2)
    exp = expected_batch(m, "train", 2, [group])
    assert exp.versions == [0, 0, 0, 2, 2, 1, 1, 1, 1, 1]
    assert exp.fresh == [False] * 3 + [True] * 2 + [False] * 5
    assert exp.excluded == [False, True, False]
    assert exp.masked == 8
    assert exp.offsets == [0, 5, 10, 10]
    assert exp.metrics["token_staleness/max"] == 3.0
    assert exp.metrics["head_staleness/mean"] == pytest.approx((3 + 2 + 2) / 3)
