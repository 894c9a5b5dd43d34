"""Without versions, everything behaves exactly as before versions existed (issue 22).

Two proofs:

1. The existing model-based test (``tests/test_model_based.py``, whose reference model knows
   nothing of versions) runs again with every new parameter passed explicitly: once with
   ``versions=None, tokens=None, version=None`` everywhere, once with ``tokens=0`` (and
   ``tokens=[0, ...]`` for ``put_group``, which takes the path that builds records instead of
   storing the group lazily). Every check of that machine must still hold.
2. A differential test runs one random sequence of producer and sample calls, in lockstep,
   against buffers that differ only in how versions are given, and compares every outcome bit
   for bit (errors, keys, batches: uids, order, dispatch steps, staleness, trajectories,
   finish steps; eviction events; metrics but wall-clock seconds; every stats counter):

   - ``plain`` (no new parameter) against ``none`` (all None), ``zero`` (``tokens=0``);
   - ``at-p``: every token's version is its group's dispatch step and every start version is
     that step (``mark_running(version=p)``, ``put_group(version=p)``, ``rollout(version=p)``):
     ``drop`` and ``wait`` must behave exactly as ``plain`` (the token counters aside);
   - ``mask-at-p``: the same versions under ``mask`` behave exactly like ``plain`` under
     ``drop`` (without in-flight eviction, which ``mask`` refuses), with nothing masked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _helpers import LIMIT, resident_groups
from stalebuf import EvictionEvent, PartitionStats, ReplayBuffer, SamplerConfig
from test_model_based import PROFILE, BufferMachine

# -- 1. the existing machine, every new parameter passed explicitly ------------------------------


class Explicit:
    """A ReplayBuffer whose producer calls pass every new parameter: ``versions=None``,
    ``tokens=tokens`` (None or 0), ``version=None``. Anything else is the buffer's own."""

    def __init__(self, buffer: ReplayBuffer, tokens: int | None) -> None:
        self._buffer = buffer
        self._tokens = tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self._buffer, name)

    def _group_tokens(self, payloads: Any) -> list[int] | None:
        return None if self._tokens is None else [self._tokens] * len(payloads)

    def put_nowait(self, uid: Any, payload: Any = None, **kwargs: Any) -> str:
        return self._buffer.put_nowait(uid, payload, versions=None, tokens=self._tokens, **kwargs)

    async def put(self, uid: Any, payload: Any = None, **kwargs: Any) -> str:
        return await self._buffer.put(uid, payload, versions=None, tokens=self._tokens, **kwargs)

    def mark_running_nowait(self, uid: Any) -> None:
        self._buffer.mark_running_nowait(uid, version=None)

    async def mark_running(self, uid: Any) -> None:
        await self._buffer.mark_running(uid, version=None)

    def put_group_nowait(self, uid: Any, payloads: Any, **kwargs: Any) -> list[str]:
        tokens = self._group_tokens(payloads)
        return self._buffer.put_group_nowait(
            uid, payloads, versions=None, tokens=tokens, version=None, **kwargs
        )

    async def put_group(self, uid: Any, payloads: Any, **kwargs: Any) -> list[str]:
        tokens = self._group_tokens(payloads)
        return await self._buffer.put_group(
            uid, payloads, versions=None, tokens=tokens, version=None, **kwargs
        )

    def rollout(self, uid: str, **kwargs: Any) -> Any:
        return self._buffer.rollout(uid, version=None, **kwargs)


class ExplicitNoneMachine(BufferMachine):
    """tests/test_model_based.py's machine with ``versions=None, tokens=None, version=None``."""

    tokens: int | None = None

    @property
    def b(self) -> Any:
        assert self.buf is not None
        return Explicit(self.buf, self.tokens)


class ZeroTokensMachine(ExplicitNoneMachine):
    """The same with ``tokens=0`` (``put_group``: one 0 per trajectory, the record-building path)."""

    tokens = 0


MACHINE_SETTINGS = settings(
    max_examples=int(os.environ.get("STALEBUF_EQUALITY_EXAMPLES", "1000" if PROFILE == "thorough" else "50")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
ExplicitNoneMachine.TestCase.settings = MACHINE_SETTINGS
ZeroTokensMachine.TestCase.settings = MACHINE_SETTINGS
TestExplicitNoneAgainstTheModel = ExplicitNoneMachine.TestCase
TestZeroTokensAgainstTheModel = ZeroTokensMachine.TestCase


def test_the_wrapper_passes_every_new_parameter() -> None:
    """The wrapper must really pass them (else part 1 proves nothing): a bad ``tokens`` it
    passes is refused."""
    buf = ReplayBuffer(status_log_interval=None)
    wrapped = Explicit(buf, -1)
    wrapped.add_prompt_nowait("a", global_steps=0)
    with pytest.raises(ValueError, match="tokens"):
        wrapped.put_nowait("a", 1)
    with pytest.raises(ValueError, match="tokens"):
        wrapped.put_group_nowait("b", [1], global_steps=0)
    assert Explicit(buf, 0).put_nowait("a", 1) == "a_0_0"
    assert buf.stats().total.admitted_trajectories == 1


# -- 2. lockstep: the same calls, versions given differently --------------------------------------

# An op is a tuple; its first item names it. Uids are picked by index among those issued so
# far (every variant issues the same; mostly the last three), so calls on groups that left fail
# alike.
ops = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 1), st.one_of(st.none(), st.integers(-1, 4))),
    st.tuples(st.just("run"), st.integers(0, 63)),
    st.tuples(st.just("put"), st.integers(0, 63), st.integers(0, 2), st.integers(1, 4)),
    st.tuples(st.just("end"), st.integers(0, 63), st.booleans()),
    st.tuples(
        st.just("produce"),
        st.integers(0, 1),
        st.one_of(st.none(), st.integers(-1, 4)),
        st.lists(st.integers(1, 4), max_size=3),
        st.sampled_from(("finish", "finish", "fail", "stay")),
    ),
    st.tuples(
        st.just("group"),
        st.integers(0, 1),
        st.one_of(st.none(), st.integers(-1, 4)),
        st.lists(st.integers(1, 4), max_size=3),
        st.booleans(),
    ),
    st.tuples(st.just("group_into"), st.integers(0, 63), st.lists(st.integers(1, 4), min_size=1, max_size=2)),
    st.tuples(st.just("rollout"), st.integers(0, 1), st.lists(st.integers(1, 4), max_size=2)),
    st.tuples(st.just("sample"), st.integers(0, 2), st.integers(1, 3), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("sample"), st.just(2), st.integers(1, 2), st.integers(0, 1), st.just(False)),
    st.tuples(st.just("put_back"), st.integers(0, 7)),
)

TOKEN_FIELDS = frozenset(
    (
        "tokens",
        "admitted_tokens",
        "sampled_tokens",
        "masked_tokens",
        "evicted_tokens",
        "reissued_tokens",
        "resident_tokens",
        "reserved_tokens",
    )
)


@dataclass
class Variant:
    """One way of giving versions: the keyword arguments each call adds."""

    name: str
    strategy: str | None = None  # None: the base config's

    def put(self, p: int, n: int) -> dict[str, Any]:
        return {
            "plain": {},
            "none": {"versions": None, "tokens": None},
            "zero": {"tokens": 0},
            "at-p": {"versions": [(p, n)]},
            "mask-at-p": {"versions": ((p, n),), "tokens": n},
        }[self.name]

    def running(self, p: int) -> dict[str, Any]:
        return {"plain": {}, "none": {"version": None}, "zero": {}}.get(self.name, {"version": p})

    def group(self, p: int, sizes: list[int]) -> dict[str, Any]:
        if self.name == "plain":
            return {}
        if self.name == "none":
            return {"versions": None, "tokens": None, "version": None}
        if self.name == "zero":
            return {"tokens": [0] * len(sizes)}
        return {"versions": [[(p, n)] for n in sizes], "version": p}

    def rollout(self, p: int) -> dict[str, Any]:
        return self.running(p)

    @property
    def versioned(self) -> bool:
        return self.name in ("at-p", "mask-at-p")


class Runner:
    """One buffer driven by the op sequence; ``log`` records every observable outcome."""

    def __init__(self, config: SamplerConfig, variant: Variant, backend: str) -> None:
        if variant.strategy is not None:
            config = attrs.evolve(config, max_off_policy_strategy=variant.strategy)
        self.variant = variant
        self.backend = backend
        self.events: list[EvictionEvent] = []
        self.buf = ReplayBuffer(config, on_evict=self.events.append, status_log_interval=None)
        self.step = 0
        self.returned: list[Any] = []

    def dispatch(self, uid: str) -> int:
        """The dispatch step of resident ``uid`` (0 for one that left: its calls fail alike)."""
        group = resident_groups(self.buf).get(uid)
        return 0 if group is None else group.dispatch_step

    def tag(self, name: str, step: int | None) -> int:
        return self.buf.dispatch_step(name) if step is None else step

    def run(self, call: Callable[[], Any]) -> Any:
        async def main() -> Any:
            with anyio.fail_after(LIMIT):
                return await call()

        return anyio.run(main, backend=self.backend)

    def apply(self, op: tuple[Any, ...], uids: list[str], fresh: str) -> Any:
        """Run ``op``; return what it observably did (the uid ``fresh`` for a new group)."""
        v, buf, kind = self.variant, self.buf, op[0]

        def pick(i: int) -> str:
            if not uids:
                return "ghost"
            return uids[-1 - i % min(3, len(uids))] if i < 40 else uids[i % len(uids)]

        name = ("train", "val", "train")[op[1] % 3] if kind in ("add", "produce", "group", "rollout") else ""
        if kind == "add":
            return buf.add_prompt_nowait(fresh, global_steps=self.at(op[2]), partition=name)
        if kind == "run":
            uid = pick(op[1])
            return buf.mark_running_nowait(uid, **v.running(self.dispatch(uid)))
        if kind == "put":
            uid = pick(op[1])
            return buf.put_nowait(uid, op[2], session_id=op[2], **v.put(self.dispatch(uid), op[3]))
        if kind == "end":
            uid = pick(op[1])
            return (buf.mark_failed_nowait if op[2] else buf.mark_finished_nowait)(uid)
        if kind == "produce":
            buf.add_prompt_nowait(fresh, global_steps=self.at(op[2]), partition=name)
            p = self.dispatch(fresh)
            buf.mark_running_nowait(fresh, **v.running(p))
            for session, n in enumerate(op[3]):
                buf.put_nowait(fresh, session, session_id=session, **v.put(p, n))
            if op[4] != "stay":
                (buf.mark_failed_nowait if op[4] == "fail" else buf.mark_finished_nowait)(fresh)
            return None
        if kind == "group":
            step = self.at(op[2])
            extra = v.group(self.tag(name, step), op[3])
            status = "failed" if op[4] else "finished"
            return buf.put_group_nowait(
                fresh, list(op[3]), global_steps=step, partition=name, status=status, **extra
            )
        if kind == "group_into":
            uid = pick(op[1])
            sessions = list(range(7, 7 + len(op[2])))
            # a uid that left is added anew, at the clock
            p = self.dispatch(uid) if uid in resident_groups(buf) else buf.dispatch_step("train")
            extra = v.group(p, op[2])
            return buf.put_group_nowait(uid, list(op[2]), session_ids=sessions, **extra)
        if kind == "rollout":
            return self.rollout(fresh, name, op[2])
        if kind == "sample":
            return self.sample(op)
        if kind == "put_back":
            if not self.returned:
                return None
            return buf.put_back(self.returned.pop(op[1] % len(self.returned)))
        raise AssertionError(kind)

    def at(self, lag: int | None) -> int | None:
        return None if lag is None else max(0, self.step - lag)

    def rollout(self, uid: str, name: str, sizes: list[int]) -> Any:
        """``rollout(version=)`` at the clock in an event loop (skipped when admission has no
        slot there: it would wait)."""
        p = self.buf.dispatch_step(name)

        async def body() -> None:
            async with self.buf.rollout(uid, partition=name, **self.variant.rollout(p)) as group:
                for session, n in enumerate(sizes):
                    await group.put(session, session_id=session, **self.variant.put(p, n))

        if self.buf.free_slots(name) == 0:
            return "skipped"
        return self.run(body)

    def sample(self, op: tuple[Any, ...]) -> Any:
        _, which, batch_size, advance, in_loop = op
        self.step += advance
        name = ("train", "val", "train")[which]
        if in_loop:
            batch, metrics = self.run(
                lambda: self.buf.sample(self.step, batch_size, partition=name, timeout=0)
            )
        else:
            batch, metrics = self.buf.sample_nowait(self.step, batch_size, partition=name)
        self.returned += batch.groups
        del self.returned[:-8]
        if self.variant.versioned:  # every token at its dispatch step: never masked, never excluded
            assert not batch.loss_excluded.any()
            assert metrics.get(f"{prefix(name)}/off_policy/masked_tokens", 0.0) == 0.0
        return batch, metrics


def prefix(name: str) -> str:
    return "training" if name == "train" else "validation"


def observe(result: Any, exc: BaseException | None, runner: Runner, compare_tokens: bool) -> Any:
    """What a call did, as comparable plain data."""
    events = [(e.reason, [g.uid for g in e.groups], e.global_steps) for e in runner.events]
    runner.events.clear()
    stats = runner.buf.stats()
    parts: dict[str, PartitionStats] = dict(stats.partitions)
    if not compare_tokens:
        parts = {k: attrs.evolve(s, **dict.fromkeys(TOKEN_FIELDS, 0)) for k, s in parts.items()}
    error = None if exc is None else (type(exc), str(exc))
    if isinstance(result, tuple) and len(result) == 2 and hasattr(result[0], "uids"):
        batch, metrics = result
        shown = {
            k: v for k, v in metrics.items() if "seconds" not in k and (compare_tokens or not token_metric(k))
        }
        result = (
            batch.uids,
            [g.dispatch_step for g in batch.groups],
            batch.staleness.tolist(),
            [g.finish_step for g in batch.groups],
            [g.status for g in batch.groups],
            [[(t.key, t.payload) for t in g.trajectories] for g in batch.groups],
            shown,
        )
    return result, error, events, parts


def token_metric(key: str) -> bool:
    return any(key.endswith(f"/off_policy/{m}") for m in TOKEN_METRICS)


TOKEN_METRICS = (
    "token_staleness/mean",
    "token_staleness/max",
    "masked_tokens",
    "loss_excluded_trajectories",
    "head_staleness/mean",
    "tail_staleness/mean",
)


def lockstep(config: SamplerConfig, variants: list[Variant], sequence: list[Any], backend: str) -> None:
    runners = [Runner(config, variant, backend) for variant in variants]
    compare_tokens = not any(variant.versioned for variant in variants)
    uids: list[str] = []
    for number, op in enumerate(sequence):
        fresh = f"u{number}"
        seen = []
        for runner in runners:
            try:
                result, exc = runner.apply(op, uids, fresh), None
            except Exception as error:
                result, exc = None, error
            seen.append(observe(result, exc, runner, compare_tokens))
        base = seen[0]
        for runner, got in zip(runners[1:], seen[1:], strict=True):
            assert got == base, f"op {number} {op}: {runner.variant.name} differs from {variants[0].name}"
        if op[0] in ("add", "produce", "group", "rollout"):
            uids.append(fresh)
    for runner in runners:  # the token counters are conserved, and nothing was masked
        for item in runner.buf.stats().partitions.values():
            assert item.admitted_tokens == item.sampled_tokens + item.evicted_tokens + item.tokens
            assert item.masked_tokens == 0
            if not runner.variant.versioned:
                assert item.admitted_tokens == 0


configs = st.builds(
    lambda strategy, threshold, sync, failure, admission, in_flight: SamplerConfig(
        max_off_policy_strategy=strategy,
        max_off_policy_threshold=threshold,
        parameter_sync_step=sync,
        failure_strategy=failure,
        admission_batch_size=admission,
        evict_stale_in_flight=in_flight and strategy == "drop",
        exempt_partitions=frozenset({"val"}),
    ),
    strategy=st.sampled_from(("drop", "wait")),
    threshold=st.integers(1, 3),
    sync=st.integers(1, 2),
    failure=st.sampled_from(("sample", "evict")),
    admission=st.sampled_from((None, None, 1, 2)),
    in_flight=st.booleans(),
)
LOCKSTEP = settings(
    max_examples=1000 if PROFILE == "thorough" else 120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@LOCKSTEP
@given(
    config=configs,
    sequence=st.lists(ops, min_size=20, max_size=60),
    backend=st.sampled_from(("asyncio", "trio")),
)
def test_without_versions_every_outcome_is_identical(
    config: SamplerConfig, sequence: list[Any], backend: str
) -> None:
    """No new parameter, all of them None, or ``tokens=0``: identical, counters included; and
    versions all at the dispatch step with start versions at it: identical under drop and wait
    (the token counters aside)."""
    variants = [Variant("plain"), Variant("none"), Variant("zero")]
    lockstep(config, variants, sequence, backend)
    lockstep(config, [Variant("plain"), Variant("at-p")], sequence, backend)


@LOCKSTEP
@given(
    config=configs,
    sequence=st.lists(ops, min_size=20, max_size=60),
    backend=st.sampled_from(("asyncio", "trio")),
)
def test_mask_with_every_version_at_the_dispatch_step_behaves_like_drop(
    config: SamplerConfig, sequence: list[Any], backend: str
) -> None:
    """Versions all at the dispatch step: a group's tail is its head, so ``mask`` evicts what
    ``drop`` evicts, never waits, and returns the same batches with nothing masked."""
    drop = attrs.evolve(config, max_off_policy_strategy="drop", evict_stale_in_flight=False)
    lockstep(drop, [Variant("plain"), Variant("mask-at-p", strategy="mask")], sequence, backend)


def test_lockstep_notices_a_difference() -> None:
    """The comparison is not vacuous: a variant whose versions are older than the dispatch step
    is judged by them under drop, and the lockstep says so."""

    class Older(Variant):
        def put(self, p: int, n: int) -> dict[str, Any]:
            return {"versions": [(max(0, p - 3), n)]}

    config = SamplerConfig(max_off_policy_threshold=1)
    sequence = [("produce", 0, None, [2], "finish"), ("sample", 0, 1, 1, False)]
    with pytest.raises(AssertionError, match="differs"):
        lockstep(config, [Variant("plain"), Older("older")], sequence, "asyncio")


def test_fields_the_token_comparison_leaves_out_exist() -> None:
    names = {f.name for f in attrs.fields(PartitionStats)}
    assert names >= TOKEN_FIELDS
