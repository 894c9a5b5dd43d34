"""A seeded, scheduling-independent training run for the checkpoint acceptance test (issue 12).

The run is a trainer task that awaits ``sample(s, B)`` (it parks on asyncio or trio) and a
producer task that changes the buffer only through ``*_nowait`` calls, in *ticks*. The producer
ticks only when every other task is blocked (``anyio.wait_all_tasks_blocked``), so the trainer
evaluates exactly between two ticks and the buffer sees the same sequence of calls whatever the
scheduler does. A tick's choices come from ``random.Random(f"{seed}:{tick}")`` and the producer's
own state, which is plain JSON: the trainer saves it next to the buffer checkpoint, as a real
trainer saves its data loader's position with its model.

``tests/test_checkpoint_exactness.py`` runs it uninterrupted in the test process (saving the
buffer at step k) and ``tests/_resume_worker.py`` restores and finishes it in a fresh process.

With ``versions`` (issue 22), a producer starts each group on the newest weights (the clock, given
to ``mark_running(version=)``) and reports, for each trajectory, the versions that generated it:
runs from its start version up to the clock as weights are pushed while it decodes, now and then
one from the weights before (a restarted engine), or only a token count (an engine that reports
no versions, or a put while the group is PENDING). What it reported is part of its JSON state, so
a reissued group is generated again exactly; a resumed one (``in_flight="resume"``) keeps it.

With a task mixture (issue 23), each prompt is tagged with a task (math twice as often as code,
whose threshold is higher); with filters, the buffer runs :data:`FILTERS` (one rejects groups
whose first reward is low, one raises on some groups): code, so the fresh process passes them to
``restore`` again.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import attrs

from stalebuf import (
    Batch,
    BufferFullError,
    BufferStats,
    Group,
    GroupEvictedError,
    ReplayBuffer,
    SamplerConfig,
)

__all__ = [
    "FILTERS",
    "VARIANTS",
    "Producer",
    "Variant",
    "batch_record",
    "drive",
    "regenerate",
    "resume",
    "stats_record",
]

TICKS_PER_STEP = 400  # a step that needs more ticks than this is a hang, not a slow run


@dataclass(frozen=True)
class Variant:
    """One configuration of the acceptance test."""

    strategy: str  # "drop", "wait" or "mask"
    admission: bool
    backend: str  # "asyncio" or "trio"
    seed: int
    steps: int = 14  # n
    checkpoint_at: int = 6  # k
    batch_size: int = 4
    versions: bool = False  # producers report versions and tokens (issue 22)
    in_flight: str = "reissue"  # how the fresh process restores: "reissue" or "resume"
    mixture: str | None = None  # the task mixture's policy, "wait" or "borrow"; None: no mixture
    filters: bool = False  # the buffer runs FILTERS
    # Save after the producer's tick that follows batch k, not before it: the filters' counts
    # since the last batch are then not 0 (the resumed run starts after that tick).
    tick_before_save: bool = False
    token_cap: bool = False  # max_tokens_per_group and max_resident_tokens (issue 24)

    @property
    def id(self) -> str:
        extra = ("-versions" if self.versions else "") + ("-resume" if self.in_flight == "resume" else "")
        extra += (f"-mix-{self.mixture}" if self.mixture else "") + ("-filters" if self.filters else "")
        extra += "-token-cap" if self.token_cap else ""
        return f"{self.strategy}-{'admission' if self.admission else 'open'}-{self.backend}{extra}"

    def config(self) -> SamplerConfig:
        mixture: dict[str, Any] = {}
        if self.mixture is not None:
            mixture = {"mixture": MIXTURE, "mixture_policy": self.mixture, "task_thresholds": {"code": 3}}
        return SamplerConfig(
            max_off_policy_threshold=2,
            max_off_policy_strategy=self.strategy,  # type: ignore[arg-type]
            failure_strategy="evict",
            admission_batch_size=self.batch_size if self.admission else None,
            evict_stale_in_flight=self.strategy == "drop",
            **mixture,
            **(TOKEN_CAP if self.token_cap else {}),
        )

    def group_filters(self) -> list[Callable[[Group], bool]]:
        """The filters the buffer runs (given again to ``restore``: they are never saved)."""
        return list(FILTERS) if self.filters else []


#: (strategy, admission, in_flight, seed) of the variants with versions (seeds chosen as below).
VERSIONED_SEEDS = (
    ("drop", False, "reissue", 4),
    ("mask", True, "reissue", 1),
    ("drop", True, "resume", 2),
    ("wait", False, "resume", 0),
    ("mask", False, "resume", 1),
)

#: (strategy, admission, mixture policy, filters, versions, in_flight, seed) of the variants with
#: a task mixture or filters (issue 23; seeds chosen as below).
MIXED_SEEDS = (
    ("drop", True, "wait", True, False, "reissue", 38),
    ("drop", True, "borrow", True, False, "reissue", 41),
    ("drop", False, "borrow", True, False, "reissue", 4),
    ("wait", False, "borrow", True, False, "resume", 1),
    ("mask", False, "wait", False, True, "reissue", 0),
    ("drop", False, None, True, True, "resume", 2),
)

# Seeds chosen so that at step k some groups are in flight (PENDING and RUNNING, holding
# trajectories) and, after it, every rule fires (the test checks it, so a change of the scenario
# that loses this fails loudly rather than passing vacuously).
#: (strategy, admission, in_flight, seed) of the variants with a token cap (issue 24): M bounds the
#: largest group the producer makes (4 trajectories of at most 120 tokens), and the residency cap
#: holds 5 reservations, so it refuses prompts and reservations cross the checkpoint.
TOKEN_CAP_SEEDS = (
    ("wait", False, "resume", 3),
    ("drop", True, "reissue", 12),
)
TOKEN_CAP = {"max_tokens_per_group": 480, "max_resident_tokens": 2400}

VARIANTS: tuple[Variant, ...] = (
    tuple(
        Variant(strategy, admission, backend, seed=seed)
        for strategy, admission, seed in (
            ("drop", False, 12),
            ("drop", True, 12),
            ("wait", False, 11),
            ("wait", True, 17),
        )
        for backend in ("asyncio", "trio")
    )
    + tuple(  # with versions and tokens, restored by reissuing or by resuming the partial groups
        Variant(strategy, admission, backend, seed=seed, versions=True, in_flight=in_flight)
        for strategy, admission, in_flight, seed in VERSIONED_SEEDS
        for backend in ("asyncio", "trio")
    )
    + tuple(  # with a task mixture (both policies) and filters
        Variant(
            strategy,
            admission,
            backend,
            seed,
            versions=versions,
            in_flight=in_flight,
            mixture=mixture,
            filters=filters,
            tick_before_save=filters,
        )
        for strategy, admission, mixture, filters, versions, in_flight, seed in MIXED_SEEDS
        for backend in ("asyncio", "trio")
    )
    + tuple(  # with max_tokens_per_group and max_resident_tokens: reservations cross the checkpoint
        Variant(strategy, admission, backend, seed, versions=True, in_flight=in_flight, token_cap=True)
        for strategy, admission, in_flight, seed in TOKEN_CAP_SEEDS
        for backend in ("asyncio", "trio")
    )
)


#: The task mixture of the variants that have one: math twice as often as code.
MIXTURE = {"math": 2, "code": 1}


def low_reward(group: Group) -> bool:
    """Keep a group unless its first trajectory's reward is below 0.25 (DAPO-like, deterministic)."""
    return not group.trajectories or group.trajectories[0].payload["reward"] >= 0.25


def flaky(group: Group) -> bool:
    """Raise on groups whose uid ends in 3 (they are kept: filters fail open, errors counted)."""
    if group.uid.endswith("3"):
        raise RuntimeError("a flaky filter")
    return True


#: The filters of the variants that have them (module-level functions: the same in every process).
FILTERS: tuple[Callable[[Group], bool], ...] = (flaky, low_reward)


def payload(seed: int, uid: str, session: int) -> dict[str, Any]:
    """What a producer generates for one session: a pure function, so it can be regenerated."""
    return {"uid": uid, "session": session, "reward": random.Random(f"{seed}/{uid}/{session}").random()}


@dataclass
class Producer:
    """The producers' side of the run: its state is JSON (``to_json`` / ``from_json``)."""

    seed: int
    versions: bool = False  # report versions and tokens (see the module docs)
    mixture: bool = False  # tag each prompt with a task of MIXTURE
    tick: int = 0
    next_prompt: int = 0
    retry: list[str] = field(default_factory=list)  # prompts refused by admission, FIFO
    # uid -> {"running": bool, "sessions": int put so far, "planned": int, "fail": bool}; with
    # versions also "start" (the start version it gave, None while PENDING) and "made" (each
    # session's [versions, tokens] as put)
    active: dict[str, dict[str, Any]] = field(default_factory=dict)
    refused: int = 0  # how many add_prompt_nowait calls raised BufferFullError
    evicted_in_flight: int = 0  # how many calls raised GroupEvictedError

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "versions": self.versions,
            "mixture": self.mixture,
            "tick": self.tick,
            "next_prompt": self.next_prompt,
            "retry": list(self.retry),
            "active": {uid: dict(plan) for uid, plan in self.active.items()},
            "refused": self.refused,
            "evicted_in_flight": self.evicted_in_flight,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Producer:
        return cls(**data)

    def step(self, buf: ReplayBuffer, *, late: bool = False) -> None:
        """One tick: retry refused prompts, dispatch new ones, advance every group in flight.

        ``late``: first dispatch one prompt a step behind the clock, which admission control
        refuses once the step before the clock was sampled (so it depends on restored state).
        """
        rng = random.Random(f"{self.seed}:{self.tick}")
        self.tick += 1
        if late:
            uid = f"p{self.next_prompt}"
            self.next_prompt += 1
            if not self._add(buf, uid, rng, shift=-1):
                self.retry.append(uid)
        while self.retry and self._add(buf, self.retry[0], rng):
            self.retry.pop(0)
        for _ in range(rng.randint(0, 3) if len(self.retry) < 6 else 0):
            uid = f"p{self.next_prompt}"
            self.next_prompt += 1
            if self.retry or not self._add(buf, uid, rng):
                self.retry.append(uid)
        for uid in list(self.active):
            try:
                self._advance(buf, uid, rng)
            except GroupEvictedError:  # evicted as stale while in flight: stop generating it
                del self.active[uid]
                self.evicted_in_flight += 1
        if rng.random() < 0.15:  # an exempt validation group, never sampled: it stays resident
            uid = f"v{self.tick}"
            buf.put_group_nowait(uid, [payload(self.seed, uid, 0)], partition="val", tags={"kind": "val"})

    def _add(self, buf: ReplayBuffer, uid: str, rng: random.Random, shift: int | None = None) -> bool:
        planned, fail = rng.randint(1, 4), rng.random() < 0.12
        # Mostly at the clock or one ahead (a pipelined trainer); now and then one behind (a late
        # dispatch), which admission refuses once the step before it was sampled.
        shift = rng.choice((-1, 0, 0, 1, 1)) if shift is None else shift
        if shift > 0 and buf.capacity() is not None:
            shift = 0  # admission refuses a step ahead of the clock: a pipelined trainer's is the clock
        step = max(0, buf.dispatch_step() + shift)
        tags: dict[str, Any] = {"planned": planned}
        if self.mixture:  # (drawn only then: the variants without a mixture keep their draws)
            tags["task"] = rng.choice(("math", "math", "code"))
        try:
            buf.add_prompt_nowait(uid, global_steps=step, tags=tags)
        except BufferFullError:
            self.refused += 1
            return False
        self.active[uid] = {"running": False, "sessions": 0, "planned": planned, "fail": fail}
        if self.versions:
            self.active[uid].update(start=None, made=[])
        return True

    def _advance(self, buf: ReplayBuffer, uid: str, rng: random.Random) -> None:
        plan, r = self.active[uid], rng.random()
        if not plan["running"]:
            if r < 0.5:
                if self.versions:  # it starts on the newest weights
                    plan["start"] = buf.dispatch_step()
                buf.mark_running_nowait(uid, version=plan.get("start"))
                plan["running"] = True
            elif r < 0.7 and plan["sessions"] < plan["planned"]:  # a put while still PENDING
                self._put(buf, uid, plan)
            return
        if plan["sessions"] < plan["planned"]:
            if r < 0.6:
                self._put(buf, uid, plan)
            return
        if r < 0.55:
            (buf.mark_failed_nowait if plan["fail"] else buf.mark_finished_nowait)(uid)
            del self.active[uid]

    def _put(self, buf: ReplayBuffer, uid: str, plan: dict[str, Any]) -> None:
        session = plan["sessions"]
        versions = tokens = None
        if self.versions:
            versions, tokens = generated(self.seed, uid, session, plan["start"], buf.dispatch_step())
            plan["made"].append([versions, tokens])
        buf.put_nowait(
            uid, payload(self.seed, uid, session), session_id=session, versions=versions, tokens=tokens
        )
        plan["sessions"] = session + 1


def generated(
    seed: int, uid: str, session: int, start: int | None, clock: int
) -> tuple[list[list[int]] | None, int | None]:
    """The ``(versions, tokens)`` a producer reports for one trajectory, put at ``clock`` into a
    group started at version ``start`` (None: still PENDING); a pure function of them."""
    rng = random.Random(f"{seed}/{uid}/{session}/versions")
    if start is None or rng.random() < 0.2:
        return None, rng.randint(0, 40)
    version = max(0, start - 1) if rng.random() < 0.1 else start
    runs = []
    for _ in range(rng.randint(1, 4)):
        runs.append([version, rng.randint(1, 30)])
        if version < clock and rng.random() < 0.6:
            version += 1  # new weights arrived while it decoded
    return runs, None


def regenerate(buf: ReplayBuffer, producer: Producer, reissue: tuple[Group, ...]) -> int:
    """Generate the ``reissue`` groups again as far as they had got: replay their lost puts.

    The producer may also hold groups evicted in flight that it has not heard of yet: they are
    not reissued, and it learns of them as it would have (GroupEvictedError on its next call).
    Returns how many trajectories were put again.
    """
    reissued = {group.uid for group in reissue}
    assert reissued <= set(producer.active), "a reissued group the producer does not know"
    assert not any(uid in buf for uid in set(producer.active) - reissued), "in flight, not reissued"
    again = 0
    for group in reissue:
        plan = producer.active[group.uid]
        if plan["running"]:
            buf.mark_running_nowait(group.uid, version=plan.get("start"))
        for session in range(plan["sessions"]):
            versions, tokens = plan["made"][session] if producer.versions else (None, None)
            buf.put_nowait(
                group.uid,
                payload(producer.seed, group.uid, session),
                session_id=session,
                versions=versions,
                tokens=tokens,
            )
            again += 1
    return again


def resume(buf: ReplayBuffer, producer: Producer, reissue: tuple[Group, ...]) -> int:
    """Go on with the ``reissue`` groups of an ``in_flight="resume"`` restore: each holds its
    partial prefix (checked against what the producer put), so a RUNNING one is only marked
    running again (keeping its start version). Returns how many trajectories were put again: 0."""
    assert {group.uid for group in reissue} <= set(producer.active), (
        "a resumed group the producer does not know"
    )
    for group in reissue:
        plan = producer.active[group.uid]
        assert [t.session_id for t in group.trajectories] == list(range(plan["sessions"])), group.uid
        if producer.versions:
            made = [
                [list(map(list, t.versions)) or None, None if t.versions else t.tokens]
                for t in group.trajectories
            ]
            assert made == plan["made"], group.uid
            assert group.start_version == (group.dispatch_step if plan["start"] is None else plan["start"])
        if plan["running"]:
            buf.mark_running_nowait(group.uid)
    return 0


def batch_record(batch: Batch, metrics: dict[str, float]) -> dict[str, Any]:
    """Everything a batch says that must be identical across a resume, as JSON (the per-token
    arrays of issue 22 too)."""
    versions, offsets = batch.token_versions()
    return {
        "token_counts": batch.token_counts.tolist(),
        "token_versions": versions.tolist(),
        "offsets": offsets.tolist(),
        "freshness": batch.freshness_mask()[0].tolist(),
        "loss_excluded": batch.loss_excluded.tolist(),
        "head_staleness": batch.head_staleness.tolist(),
        "tail_staleness": batch.tail_staleness.tolist(),
        "start_versions": [group.start_version for group in batch],
        "step": batch.global_steps,
        "uids": batch.uids,
        "keys": batch.keys,
        "payloads": batch.payloads,
        "statuses": [group.status.value for group in batch],
        "dispatch": [group.dispatch_step for group in batch],
        "finish": [group.finish_step for group in batch],
        "staleness": batch.staleness.tolist(),
        "metrics": {name: value for name, value in sorted(metrics.items()) if "_seconds" not in name},
    }


def stats_record(stats: BufferStats) -> dict[str, Any]:
    """``stats()`` as JSON: per partition and total."""
    return {
        "closed": stats.closed,
        "partitions": {name: attrs.asdict(item) for name, item in stats.partitions.items()},
        "total": attrs.asdict(stats.total),
    }


async def drive(
    buf: ReplayBuffer,
    producer: Producer,
    variant: Variant,
    first: int,
    on_checkpoint: Callable[[], Any] | None = None,
) -> list[dict[str, Any]]:
    """Train steps ``first..variant.steps``; return their batch records.

    After each batch the producer ticks once before the next ``sample`` (it dispatches at the
    clock the batch left behind, so the restored clock and admission state are exercised); at the
    end of step ``variant.checkpoint_at`` ``await on_checkpoint()`` runs first (after that tick
    with ``variant.tick_before_save``), with the producer paused (it saves the buffer and the
    producer's state). A resumed run (``first > 1``) starts with that tick (unless it was saved).
    """
    records: list[dict[str, Any]] = []
    done = paused = False
    resumed = anyio.Event()
    limit = producer.tick + TICKS_PER_STEP * (variant.steps - first + 1)

    async def produce() -> None:
        while True:
            await anyio.wait_all_tasks_blocked()
            if done:
                return
            if paused:
                await resumed.wait()
                continue
            if producer.tick >= limit:
                raise RuntimeError(f"no batch after {producer.tick} ticks: the scenario hangs")
            producer.step(buf)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            if first > 1 and not variant.tick_before_save:
                producer.step(buf, late=True)  # the tick that followed the batch before the checkpoint
            for step in range(first, variant.steps + 1):
                batch, metrics = await buf.sample(step, variant.batch_size)
                records.append(batch_record(batch, metrics))
                ticked = step == variant.checkpoint_at and variant.tick_before_save
                if ticked:
                    producer.step(buf, late=True)
                if step == variant.checkpoint_at and on_checkpoint is not None:
                    paused = True  # nothing changes the buffer while it is saved
                    await on_checkpoint()
                    paused = False
                    resumed.set()
                if step < variant.steps and not ticked:
                    producer.step(buf, late=True)
            done = True
    return records
