"""Recovering from a journal at every step, against a brute-force model (issue 25).

A seeded run of producer calls (``*_nowait``: new prompts, whole groups, runs, puts, finishes,
failures, uids sampled or evicted and added again) and ``sample(step, 1 or 2, timeout=0)`` calls
(drop and wait, failed groups sampled or evicted, in-flight eviction, a filter, admission
control, a task mixture) is recorded by a model that sees only what the buffer reports: calls that succeed,
batches, ``on_evict``. Then, for every step some ``sample`` returned at (and for the last
commit), a copy of the journal is recovered there: it must hold exactly the groups the model says
(those removed by a later sample back, the producers' side kept, the newest group of a uid added
again, the older one dropped), ``kept`` and ``dropped`` in admission order, the clock of the
point, the counters of the model (sampled and evicted up to the point, admitted and filtered in
all, the dropped ones as "restart"), and ``admitted = resident + sampled + evicted`` (all
reasons) for groups and trajectories.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from _helpers import LIMIT, assert_conserved, copy_journal, group_contents, resident_groups
from stalebuf import (
    BufferFullError,
    EvictionEvent,
    Group,
    GroupEvictedError,
    ReplayBuffer,
    SamplerConfig,
    Status,
)

pytestmark = pytest.mark.anyio
SEEDS = int(os.environ.get("STALEBUF_RECOVERY_MODEL_SEEDS", "16"))


@dataclass
class Incarnation:
    """One group of a uid, from its admission to its removal (times are the model's events)."""

    uid: str
    admitted: int
    status: str = "pending"  # "pending", "running", "finished", "failed"
    payloads: list[bytes] = field(default_factory=list)
    removed: int | None = None
    reason: str | None = None


@dataclass
class Model:
    """What a run did, observed from outside (calls, batches, ``on_evict``), and what a recovery
    at each step must therefore give."""

    time: int = 0
    groups: list[Incarnation] = field(default_factory=list)
    live: dict[str, Incarnation] = field(default_factory=dict)
    points: dict[int, tuple[int, int]] = field(default_factory=dict)  # step -> (time, clock)

    def tick(self) -> int:
        self.time += 1
        return self.time

    def admit(self, uid: str, status: str = "pending", body: list[bytes] | None = None) -> None:
        group = Incarnation(uid, self.tick(), status, list(body or ()))
        self.groups.append(group)
        self.live[uid] = group

    def forget(self, uid: str) -> None:
        """The group just admitted in the model was refused by the buffer: it never existed."""
        group = self.groups.pop()
        assert group.uid == uid
        assert self.live.pop(uid) is group

    def remove(self, uid: str, reason: str) -> None:
        group = self.live.pop(uid)
        group.removed, group.reason = self.tick(), reason

    def recovered(self, point: int) -> tuple[dict[str, Incarnation], list[Incarnation], list[Incarnation]]:
        """The groups resident after recovering at event ``point``, the kept and the dropped ones."""
        back = [
            group
            for group in self.groups
            if group.removed is None
            or (group.removed > point and group.reason in ("sampled", "stale", "failure"))
        ]
        newest = {group.uid: group for group in back}
        filtered = [g for g in self.groups if g.reason == "filtered" and g.admitted > point]
        kept = sorted(
            [*(group for group in newest.values() if group.admitted > point), *filtered],
            key=lambda g: g.admitted,
        )
        dropped = [group for group in back if newest[group.uid] is not group]
        return newest, kept, dropped

    def before(self, point: int, reason: str) -> list[Incarnation]:
        return [g for g in self.groups if g.reason == reason and g.removed is not None and g.removed <= point]


def rejects(uid: str) -> bool:
    return uid.endswith("3")


def keep(group: Group) -> bool:
    return not rejects(group.uid)


async def run_model_scenario(seed: int, path: Path) -> tuple[Model, dict[str, Any]]:
    """A seeded run of nowait producer calls and ``sample(timeout=0)`` calls; each change is
    recorded in the model as the buffer reports it."""
    rng = random.Random(seed)
    strategy = ("drop", "wait")[seed % 2]
    options: dict[str, Any] = {
        "filters": [keep] if seed % 3 != 2 else [],
        "config": SamplerConfig(
            max_off_policy_threshold=2,
            max_off_policy_strategy=strategy,  # type: ignore[arg-type]
            failure_strategy=("sample", "evict")[(seed // 2) % 2],
            evict_stale_in_flight=strategy == "drop" and seed % 4 == 0,
            admission_batch_size=3 if seed % 5 == 1 else None,
            **({"mixture": {"a": 1, "b": 1}, "mixture_policy": "borrow"} if seed % 3 == 1 else {}),
        ),
    }
    model = Model()
    gone: list[str] = []  # uids sampled or evicted: added again now and then

    def on_evict(event: EvictionEvent) -> None:
        for group in event.groups:
            model.remove(group.uid, event.reason)
            gone.append(group.uid)

    buffer = ReplayBuffer(
        options["config"],
        journal=path,
        journal_retention_steps=100,
        filters=options["filters"],
        on_evict=on_evict,
        status_log_interval=None,
    )
    count = 0
    for step in range(8):
        for _ in range(rng.randint(2, 7)):
            live = [uid for uid, group in model.live.items() if group.status in ("pending", "running")]
            roll = rng.random()
            if roll < 0.25 or (roll < 0.35 and not gone):
                uid, count = f"u{count}", count + 1
                body = [f"{uid}/{i}".encode() for i in range(rng.randint(1, 3))]
                admit(buffer, model, uid, body)
            elif roll < 0.35:
                uid = rng.choice(gone)
                gone.remove(uid)
                admit(buffer, model, uid, [b"again"])
            elif roll < 0.55 or not live:
                uid, count = f"u{count}", count + 1
                admit(buffer, model, uid, None)
            else:
                advance(buffer, model, model.live[rng.choice(live)], rng)
        if strategy == "wait":  # the producers finish what the wait gate would wait for
            for uid, group in resident_groups(buffer).items():
                if group.in_flight and group.dispatch_step < step and uid in model.live:
                    while uid in model.live and model.live[uid].status in ("pending", "running"):
                        advance(buffer, model, model.live[uid], rng, finish=True)
        for _ in range(2 if rng.random() < 0.15 else 1):  # now and then sample(step) twice
            if rng.random() < 0.8:
                try:
                    size = 2 if options["config"].mixture else rng.choice((1, 2))  # (a quota per task)
                    batch, _ = await buffer.sample(step, size, timeout=0)
                except TimeoutError:
                    continue
                for uid in batch.uids:
                    model.remove(uid, "sampled")
                    gone.append(uid)
                model.points[step] = (model.tick(), buffer.dispatch_step())
        gone[:] = [uid for uid in dict.fromkeys(gone) if uid not in model.live]
    final = group_contents(buffer)
    await buffer.aclose()
    return model, {"final": final, **options}


def admit(buffer: ReplayBuffer, model: Model, uid: str, body: list[bytes] | None) -> None:
    """Add a group (FINISHED with ``body``, else PENDING); a uid the buffer remembers as evicted
    in flight or filtered is refused ``put_group`` (GroupEvictedError), so it is added PENDING."""
    model.admit(uid, "pending" if body is None else "finished", body)  # a filter may remove it at once
    try:
        if body is None:
            buffer.add_prompt_nowait(uid, tags=task(uid))
        else:
            buffer.put_group_nowait(uid, body, tokens=[len(b) for b in body], tags=task(uid))
    except GroupEvictedError:
        model.forget(uid)
        admit(buffer, model, uid, None)
    except BufferFullError:
        model.forget(uid)


def task(uid: str) -> dict[str, str]:
    """The task tag of ``uid`` (read only under a task mixture)."""
    return {"task": "ab"[int(uid[1:]) % 2]}


def advance(
    buffer: ReplayBuffer, model: Model, group: Incarnation, rng: random.Random, finish: bool = False
) -> None:
    """Take the in-flight ``group`` one call further (a call on a group evicted in flight raises
    GroupEvictedError: on_evict told the model)."""
    try:
        _advance(buffer, group, rng.random(), finish)
    except GroupEvictedError:
        assert group.removed is not None


def _advance(buffer: ReplayBuffer, group: Incarnation, roll: float, finish: bool) -> None:
    """One call: run, put, finish or fail (``finish``: run, put one if none, then end)."""
    uid = group.uid
    if group.status == "pending" and (roll < 0.5 or finish):
        buffer.mark_running_nowait(uid)
        group.status = "running"
    elif (roll < 0.7 and not finish) or not group.payloads:
        body = f"{uid}/{len(group.payloads)}".encode()
        buffer.put_nowait(uid, body, session_id=len(group.payloads), tokens=len(body))
        group.payloads.append(body)
    elif roll < 0.92:
        buffer.mark_finished_nowait(uid)  # (a filter's on_evict may have removed it meanwhile)
        group.status = "finished"
    else:
        buffer.mark_failed_nowait(uid)
        group.status = "failed"


_STATUS = {"pending": Status.PENDING, "running": Status.PENDING, "finished": Status.FINISHED}


@pytest.mark.parametrize("seed", range(SEEDS))
async def test_recovering_at_every_sampled_step_conserves_and_matches_the_model(
    tmp_path: Path, seed: int
) -> None:
    """Recovered at each step some ``sample`` returned at, the buffer holds exactly the groups
    the model says (every group removed by a later sample back, the producers' side kept, the
    newest group of a uid added again), the counters are the model's (sampled and evicted up to
    the point, admitted and filtered in all, the dropped ones as "restart") and conserve
    ``admitted = resident + sampled + evicted`` (all reasons), for groups and trajectories."""
    with anyio.fail_after(LIMIT * 3):
        path = tmp_path / "journal.db"
        model, run = await run_model_scenario(seed, path)
        for step, (point, clock) in [*model.points.items(), (None, (model.time, None))]:
            copy = tmp_path / f"at-{step}.db"
            copy_journal(path, copy)
            result = ReplayBuffer.recover(
                copy, global_steps=step, filters=run["filters"], status_log_interval=None
            )
            buffer = result.buffer
            newest, kept, dropped = model.recovered(point)
            if step is None:
                assert group_contents(buffer) == {
                    uid: value
                    if value[0] not in (Status.PENDING, Status.RUNNING)
                    else (Status.PENDING, value[1], [])
                    for uid, value in run["final"].items()
                }
            expected = {uid: _STATUS.get(group.status, Status.FAILURE) for uid, group in newest.items()}
            assert {uid: status for uid, (status, _, _) in group_contents(buffer).items()} == expected, step
            for uid, (status, _, body) in group_contents(buffer).items():
                assert body == ([] if status is Status.PENDING else newest[uid].payloads), uid
            assert [group.uid for group in result.kept] == ([] if step is None else [g.uid for g in kept])
            assert [group.uid for group in result.dropped] == [g.uid for g in dropped]
            if clock is not None:
                assert buffer.dispatch_step() == clock
            total = buffer.stats().total
            sampled = model.before(point, "sampled")
            assert total.sampled_groups == len(sampled)
            assert total.sampled_trajectories == sum(len(g.payloads) for g in sampled)
            assert total.sampled_tokens == sum(len(b) for g in sampled for b in g.payloads)
            assert total.evicted_stale_groups == len(model.before(point, "stale"))
            assert total.evicted_failure_groups == len(model.before(point, "failure"))
            assert total.evicted_filtered_groups == len(model.before(model.time, "filtered"))
            assert total.evicted_restart_groups == len(dropped)
            assert total.admitted_groups == len(model.groups)
            assert total.reissued_groups == sum(g.status in ("pending", "running") for g in newest.values())
            assert_conserved(buffer)
            await buffer.aclose()
