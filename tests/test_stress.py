"""Concurrency stress: many producers, concurrent samplers, a trainer step counter.

32+ producer tasks create thousands of groups (random latency, ~10% failures, 4-8
trajectories each) in two partitions ("train", subject to the staleness rules, and the
exempt "val"), while two samplers per partition take batches and the "train" samplers
advance the trainer step. Every batch is checked as it is returned (exactly ``batch_size``
whole groups, oldest first, the staleness rule of the strategy); at the end the samplers are
cancelled, a fresh sample drains what is left, and every trajectory must be accounted for
exactly once: sampled or evicted, never both, never twice, never lost.

Runs on asyncio and trio; every run is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import pytest

from _helpers import resident_groups, resident_uids
from stalebuf import Batch, EvictionEvent, ReplayBuffer, SamplerConfig, Status

pytestmark = pytest.mark.anyio

LIMIT = 60  # seconds; generous for a noisy 2-core machine, a hang still fails


@dataclass(frozen=True)
class Scenario:
    strategy: str
    failure_strategy: str
    threshold: int
    sync_step: int
    producers: int = 32
    groups: int = 2000
    batch_sizes: tuple[int, int] = (8, 4)  # train, val
    seed: int = 0


SCENARIOS = [
    Scenario("drop", "sample", threshold=2, sync_step=1, seed=1),
    Scenario("wait", "evict", threshold=2, sync_step=1, seed=2),
    Scenario("drop", "evict", threshold=1, sync_step=2, producers=48, seed=3),
    Scenario("wait", "sample", threshold=3, sync_step=1, groups=3000, seed=4),
]


@dataclass
class Ledger:
    """What the test saw: every admitted key, and where each one went."""

    admitted_keys: list[str] = field(default_factory=list)
    admitted_uids: list[str] = field(default_factory=list)
    order: dict[str, int] = field(default_factory=dict)  # uid -> add_prompt order
    keys_by_uid: dict[str, list[str]] = field(default_factory=dict)
    sampled_keys: list[str] = field(default_factory=list)
    sampled_uids: list[str] = field(default_factory=list)
    evicted_keys: Counter[str] = field(default_factory=Counter)
    evicted_uids: Counter[tuple[str, str]] = field(default_factory=Counter)  # (uid, reason)
    batches: int = 0
    failed: int = 0


class Stress:
    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.rng = random.Random(scenario.seed)
        self.limit = scenario.threshold * scenario.sync_step
        self.ledger = Ledger()
        self.buf = ReplayBuffer(
            SamplerConfig(
                max_off_policy_strategy=scenario.strategy,  # type: ignore[arg-type]
                failure_strategy=scenario.failure_strategy,  # type: ignore[arg-type]
                max_off_policy_threshold=scenario.threshold,
                parameter_sync_step=scenario.sync_step,
            ),
            on_evict=self.on_evict,
            status_log_interval=None,
        )
        self.step = 0  # the trainer's step counter
        self.to_dispatch = scenario.groups
        self.next_uid = 0

    def on_evict(self, event: EvictionEvent) -> None:
        assert event.reason in ("stale", "failure")
        if event.reason == "stale":
            assert self.s.strategy == "drop", "wait evicted for staleness"
            assert event.partition == "train", "an exempt partition evicted something"
        for group in event.groups:
            assert group.status.is_terminal
            self.ledger.evicted_uids[(group.uid, event.reason)] += 1
            self.ledger.evicted_keys.update(t.key for t in group.trajectories)

    async def latency(self) -> None:
        roll = self.rng.random()
        if roll < 0.5:
            await anyio.lowlevel.checkpoint()
        elif roll < 0.95:
            await anyio.sleep(self.rng.uniform(0, 0.0005))
        else:
            await anyio.sleep(self.rng.uniform(0.001, 0.004))  # a straggler

    async def producer(self) -> None:
        buf, rng, ledger = self.buf, self.rng, self.ledger
        while self.to_dispatch > 0:
            self.to_dispatch -= 1
            self.next_uid += 1
            uid = f"u{self.next_uid}"
            partition = "val" if rng.random() < 0.25 else "train"
            await buf.add_prompt(uid, global_steps=self.step, partition=partition, tags={"n": self.next_uid})
            ledger.order[uid] = len(ledger.order)
            ledger.admitted_uids.append(uid)
            ledger.keys_by_uid[uid] = []
            await self.latency()
            failure = rng.random() < 0.1
            if failure and rng.random() < 0.3:  # fails before it even starts
                await buf.mark_failed(uid)
                ledger.failed += 1
                continue
            await buf.mark_running(uid)
            n = rng.randint(4, 8)
            for session in range(n):
                await self.latency()
                if failure and session == n // 2:
                    break
                for index in range(rng.choice((1, 1, 2))):  # multi-turn pieces now and then
                    key = await buf.put(
                        uid, {"uid": uid, "session": session}, session_id=session, index=index
                    )
                    ledger.keys_by_uid[uid].append(key)
                    ledger.admitted_keys.append(key)
            if failure:
                await buf.mark_failed(uid)
                ledger.failed += 1
            else:
                await buf.mark_finished(uid)

    def check_batch(self, batch: Batch, partition: str, g: int, batch_size: int) -> None:
        """Checked right after ``sample`` returned, before any other task ran."""
        ledger = self.ledger
        assert batch.partition == partition
        assert len(batch) == batch_size
        assert batch.global_steps == g
        order = [(group.global_steps, ledger.order[group.uid]) for group in batch.groups]
        assert order == sorted(order), "batch not oldest first with FIFO ties"
        for group in batch.groups:
            assert group.partition == partition
            assert group.status.is_terminal
            assert [t.key for t in group.trajectories] == ledger.keys_by_uid[group.uid], "partial group"
            if group.status is Status.FAILURE:
                assert self.s.failure_strategy == "sample" or partition == "val"
        if partition == "train" and self.s.strategy == "drop":
            ages = [g - group.global_steps + 1 for group in batch.groups]
            assert max(ages) <= self.limit, f"drop returned s > T: ages {ages}"
        if partition == "train" and self.s.strategy == "wait":
            for group in resident_groups(self.buf).values():
                if group.in_flight and group.partition == partition:
                    assert g - group.dispatch_step + 1 < self.limit, "wait returned with a blocking group"
        ledger.batches += 1
        ledger.sampled_uids.extend(batch.uids)
        ledger.sampled_keys.extend(batch.keys)

    async def sampler(self, partition: str) -> None:
        batch_size = self.s.batch_sizes[partition == "val"]
        while True:
            g = self.step
            batch, metrics = await self.buf.sample(g, batch_size, partition=partition)
            self.check_batch(batch, partition, g, batch_size)
            assert (
                metrics[f"{'training' if partition == 'train' else 'validation'}/off_policy/wait_seconds"]
                >= 0
            )
            if partition == "train":
                self.step = max(self.step, g + 1)
            await anyio.lowlevel.checkpoint()

    async def run(self) -> None:
        async with anyio.create_task_group() as samplers:
            for partition in ("train", "train", "val", "val"):
                samplers.start_soon(self.sampler, partition)
            async with anyio.create_task_group() as producers:
                for _ in range(self.s.producers):
                    producers.start_soon(self.producer)
            await anyio.wait_all_tasks_blocked()
            # cancelled while parked: they must take nothing with them
            before = self.buf.stats()
            samplers.cancel_scope.cancel()
        after = self.buf.stats()
        assert after.total.waiting_samplers == 0
        assert after.total.groups == before.total.groups, "cancelled samplers removed groups"
        await self.drain()

    async def drain(self) -> None:
        """A fresh sample per partition takes everything the cancelled samplers did not."""
        for partition in ("train", "val"):
            g = self.step
            count = self.buf.sampleable_count(g, partition)
            try:
                batch, _ = await self.buf.sample(g, max(count, 1), partition=partition, timeout=0)
            except TimeoutError:
                assert count == 0
            else:
                self.check_batch(batch, partition, g, count)


@pytest.mark.parametrize(
    "scenario", SCENARIOS, ids=lambda s: f"{s.strategy}-{s.failure_strategy}-seed{s.seed}"
)
async def test_every_trajectory_is_accounted_for_exactly_once(scenario: Scenario) -> None:
    with anyio.fail_after(LIMIT):
        stress = Stress(scenario)
        await stress.run()
    buf, ledger = stress.buf, stress.ledger
    stats = buf.stats()
    # the run did what it claims: thousands of groups, failures, many batches, evictions by policy
    assert len(ledger.admitted_uids) == scenario.groups
    assert ledger.failed > scenario.groups * 0.05
    assert ledger.batches > 50
    # nothing left behind: every group is terminal and the drain took all that was sampleable
    assert not resident_uids(buf), f"{len(resident_uids(buf))} groups left after the drain"
    assert stats.total.groups == stats.total.trajectories == stats.total.waiting_samplers == 0
    # every trajectory in exactly one place
    sampled, evicted = Counter(ledger.sampled_keys), ledger.evicted_keys
    assert max(sampled.values(), default=1) == 1, "a trajectory was returned twice"
    assert max(evicted.values(), default=1) == 1, "a trajectory was evicted twice"
    assert not set(sampled) & set(evicted), "a trajectory was both sampled and evicted"
    assert sampled + evicted == Counter(ledger.admitted_keys), "a trajectory was lost"
    # every group too (including failed ones that never got a trajectory)
    evicted_uids = Counter(uid for uid, _ in ledger.evicted_uids.elements())
    assert Counter(ledger.sampled_uids) + evicted_uids == Counter(ledger.admitted_uids)
    # the counters agree with the ledger
    total = stats.total
    assert total.admitted_groups == len(ledger.admitted_uids)
    assert total.admitted_trajectories == len(ledger.admitted_keys)
    assert total.sampled_groups == len(ledger.sampled_uids)
    assert total.sampled_trajectories == len(ledger.sampled_keys)
    assert total.evicted_stale_groups == sum(n for (_, r), n in ledger.evicted_uids.items() if r == "stale")
    assert total.evicted_failure_groups == sum(
        n for (_, r), n in ledger.evicted_uids.items() if r == "failure"
    )
    assert total.evicted_stale_trajectories + total.evicted_failure_trajectories == sum(evicted.values())
    for item in (*stats.partitions.values(), total):
        assert (
            item.admitted_groups
            == item.sampled_groups + item.evicted_stale_groups + item.evicted_failure_groups
        )
    val = stats.partitions["val"]
    assert val.evicted_stale_groups == val.evicted_failure_groups == 0, "the exempt partition evicted"
    if scenario.strategy == "wait":
        assert total.evicted_stale_groups == 0
    if scenario.failure_strategy == "evict":
        assert stats.partitions["train"].evicted_failure_groups > 0
