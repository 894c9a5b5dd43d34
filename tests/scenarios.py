"""Core buffer behaviour as scenarios that run against any buffer with the ReplayBuffer API.

Each scenario is an async function taking a :class:`Harness`, registered with the config it
needs. ``tests/test_ray.py`` runs every scenario against the local ``ReplayBuffer`` and
against ``stalebuf.ray.RemoteReplayBuffer``, so both must behave the same: blocking and
waking, the drop and wait boundaries, exactly-once delivery of whole groups, FIFO among
samplers, and the same typed errors. This module does not import Ray.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from stalebuf import Batch, BufferStats, EvictionEvent, ReplayBuffer, SamplerConfig, Status
from stalebuf.errors import (
    BufferClosedError,
    DuplicateGroupError,
    DuplicateTrajectoryError,
    InvalidTransitionError,
    UnknownGroupError,
)

__all__ = ["SCENARIOS", "Harness", "LocalHarness", "Scenario"]


class Harness:
    """What a scenario needs beyond the shared async API: the sync/async differences."""

    kind = "abstract"

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer

    async def count(self, global_steps: int, partition: str = "train") -> int:
        """``sampleable_count`` (sync locally, a coroutine remotely)."""
        raise NotImplementedError

    async def stats(self) -> BufferStats:
        """``stats()`` (sync locally, a coroutine remotely)."""
        raise NotImplementedError

    async def values(self, batch: Batch) -> list[Any]:
        """The batch's payload values (remote payloads are references to resolve)."""
        raise NotImplementedError

    async def next_eviction(self) -> EvictionEvent:
        """The next eviction event (``on_evict`` locally, ``evictions()`` remotely)."""
        raise NotImplementedError

    async def dispose(self) -> None:
        """Release what the harness holds."""

    async def wait_parked(self, count: int, partition: str = "train") -> None:
        """Return once ``count`` sample calls are parked in ``partition``."""
        while True:
            part = (await self.stats()).partitions.get(partition)
            if part is not None and part.waiting_samplers == count:
                return
            await anyio.sleep(0.005)


class LocalHarness(Harness):
    """A plain ReplayBuffer in this process."""

    kind = "local"

    def __init__(self, config: SamplerConfig) -> None:
        self._events: list[EvictionEvent] = []
        self._arrived = anyio.Event()
        super().__init__(ReplayBuffer(config, on_evict=self._record, status_log_interval=None))

    def _record(self, event: EvictionEvent) -> None:
        self._events.append(event)
        self._arrived.set()

    async def count(self, global_steps: int, partition: str = "train") -> int:
        return int(self.buffer.sampleable_count(global_steps, partition))

    async def stats(self) -> BufferStats:
        stats: BufferStats = self.buffer.stats()
        return stats

    async def values(self, batch: Batch) -> list[Any]:
        return batch.payloads

    async def next_eviction(self) -> EvictionEvent:
        while not self._events:
            self._arrived = anyio.Event()
            await self._arrived.wait()
        return self._events.pop(0)

    async def dispose(self) -> None:
        await self.buffer.aclose()


ScenarioFn = Callable[[Harness], Awaitable[None]]


class Scenario:
    """A registered scenario: its function and the config its buffer is built with."""

    def __init__(self, fn: ScenarioFn, config: SamplerConfig) -> None:
        self.fn = fn
        self.config = config
        self.name = fn.__name__

    async def __call__(self, harness: Harness) -> None:
        """Run the scenario."""
        await self.fn(harness)


SCENARIOS: list[Scenario] = []


def scenario(config: SamplerConfig | None = None) -> Callable[[ScenarioFn], ScenarioFn]:
    """Register the decorated function as a scenario run with ``config``."""

    def register(fn: ScenarioFn) -> ScenarioFn:
        SCENARIOS.append(Scenario(fn, config or SamplerConfig()))
        return fn

    return register


async def expect(error: type[BaseException], call: Awaitable[Any]) -> BaseException:
    """Await ``call`` and check it raises exactly ``error`` (not a subclass or a wrapper)."""
    with pytest.raises(error) as info:
        await call
    assert type(info.value) is error, f"expected exactly {error.__name__}, got {type(info.value)!r}"
    return info.value


async def finished(harness: Harness, uid: str, step: int, *payloads: Any, partition: str = "train") -> None:
    """Add, fill and finish one group through the step-by-step producer API."""
    buffer = harness.buffer
    await buffer.add_prompt(uid, global_steps=step, partition=partition)
    await buffer.mark_running(uid)
    for session, payload in enumerate(payloads):
        await buffer.put(uid, payload, session_id=session)
    await buffer.mark_finished(uid)


# -- scenarios --------------------------------------------------------------------------


@scenario()
async def blocks_until_the_batch_is_complete(h: Harness) -> None:
    buffer = h.buffer
    await finished(h, "a", 0, "a0")
    await buffer.add_prompt("b", global_steps=0)
    result: list[tuple[Batch, dict[str, float]]] = []

    async def trainer() -> None:
        result.append(await buffer.sample(0, 2))

    async with anyio.create_task_group() as tg:
        tg.start_soon(trainer)
        await h.wait_parked(1)
        await buffer.mark_running("b")
        await buffer.put("b", "b0")
        await anyio.sleep(0.05)
        assert not result, "sample returned before the batch was complete"
        await buffer.mark_finished("b")
    batch, metrics = result[0]
    assert batch.uids == ["a", "b"]
    assert await h.values(batch) == ["a0", "b0"]
    assert metrics["training/off_policy/wait_seconds"] > 0
    assert (await h.stats()).total.waiting_samplers == 0


@scenario()
async def returns_at_once_when_ready_and_oldest_first(h: Harness) -> None:
    await finished(h, "late", 3, 1)
    await finished(h, "early", 1, 2)
    await finished(h, "tie", 1, 3)
    batch, metrics = await h.buffer.sample(3, 3, timeout=0)
    assert batch.uids == ["early", "tie", "late"]
    assert batch.global_steps == 3
    assert list(batch.staleness) == [3.0, 3.0, 1.0]
    assert metrics["training/off_policy/wait_seconds"] == 0.0


@scenario(SamplerConfig(max_off_policy_threshold=2, max_off_policy_strategy="drop"))
async def drop_boundary_evicts_only_above_the_threshold(h: Harness) -> None:
    await finished(h, "p0", 0, "x")  # at step 2: age 3 > 2, dropped
    await finished(h, "p1", 1, "y")  # at step 2: age 2, kept
    assert await h.count(1) == 2
    assert await h.count(2) == 1
    batch, metrics = await h.buffer.sample(2, 1)
    assert batch.uids == ["p1"]
    assert metrics["training/off_policy/dropped_groups"] == 1.0
    assert metrics["training/off_policy/dropped_samples"] == 1.0
    event = await h.next_eviction()
    assert (event.reason, event.partition, event.global_steps) == ("stale", "train", 2)
    assert [group.uid for group in event.groups] == ["p0"]
    total = (await h.stats()).total
    assert (total.evicted_stale_groups, total.sampled_groups, total.groups) == (1, 1, 0)


@scenario(SamplerConfig(max_off_policy_threshold=2, max_off_policy_strategy="wait"))
async def wait_boundary_blocks_at_the_threshold(h: Harness) -> None:
    buffer = h.buffer
    await buffer.add_prompt("slow", global_steps=0)
    await buffer.mark_running("slow")
    await finished(h, "r1", 0, 1)
    await finished(h, "r2", 0, 2)
    batch, _ = await buffer.sample(0, 1, timeout=0)  # slow's age is 1 < 2: no wait
    assert batch.uids == ["r1"]
    await expect(TimeoutError, buffer.sample(1, 1, timeout=0))  # age 2 >= 2: must wait
    result: list[Batch] = []

    async def trainer() -> None:
        result.append((await buffer.sample(1, 1))[0])

    async with anyio.create_task_group() as tg:
        tg.start_soon(trainer)
        await h.wait_parked(1)
        await anyio.sleep(0.05)
        assert not result
        await buffer.mark_finished("slow")
    assert result[0].uids == ["slow"]  # oldest first once the gate opens
    assert await h.count(1) == 1


@scenario(SamplerConfig(max_off_policy_threshold=1000))
async def concurrent_producers_and_samplers_exactly_once(h: Harness) -> None:
    buffer = h.buffer
    producers, per_producer, group_size, batch_size = 4, 15, 3, 6
    total = producers * per_producer
    seen: list[str] = []

    async def producer(p: int) -> None:
        for i in range(per_producer):
            uid = f"p{p}g{i}"
            await buffer.add_prompt(uid, global_steps=0)
            await buffer.mark_running(uid)
            for session in range(group_size):
                await buffer.put(uid, (uid, session), session_id=session)
                await anyio.lowlevel.checkpoint()
            await buffer.mark_finished(uid)

    async def sampler() -> None:
        for _ in range(total // batch_size // 2):
            batch, _ = await buffer.sample(0, batch_size)
            assert len(batch) == batch_size
            for group, values in zip(batch.groups, _chunks(await h.values(batch), group_size), strict=True):
                assert group.status is Status.FINISHED
                assert [t.key for t in group.trajectories] == [
                    f"{group.uid}_{s}_0" for s in range(group_size)
                ]
                assert values == [(group.uid, s) for s in range(group_size)]
            seen.extend(batch.uids)

    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(sampler)
        for p in range(producers):
            tg.start_soon(producer, p)
    assert len(seen) == total
    assert sorted(seen) == sorted(f"p{p}g{i}" for p in range(producers) for i in range(per_producer))
    stats = (await h.stats()).total
    assert stats.admitted_groups == stats.sampled_groups == total
    assert stats.admitted_trajectories == stats.sampled_trajectories == total * group_size
    assert stats.groups == stats.trajectories == 0


def _chunks(values: list[Any], size: int) -> list[list[Any]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


@scenario()
async def samplers_are_served_in_arrival_order(h: Harness) -> None:
    buffer = h.buffer
    order: list[tuple[str, list[str]]] = []

    async def trainer(name: str) -> None:
        batch, _ = await buffer.sample(0, 1)
        order.append((name, batch.uids))

    async with anyio.create_task_group() as tg:
        tg.start_soon(trainer, "first")
        await h.wait_parked(1)
        tg.start_soon(trainer, "second")
        await h.wait_parked(2)
        await finished(h, "a", 0)
        await finished(h, "b", 0)
    assert order == [("first", ["a"]), ("second", ["b"])]


@scenario()
async def typed_errors_leave_the_buffer_unchanged(h: Harness) -> None:
    buffer = h.buffer
    await expect(UnknownGroupError, buffer.mark_running("nope"))
    await expect(UnknownGroupError, buffer.put("nope", 1))
    await expect(UnknownGroupError, buffer.mark_finished("nope"))
    await expect(UnknownGroupError, buffer.mark_failed("nope"))
    await buffer.add_prompt("a", global_steps=0)
    await buffer.put("a", 1, session_id=0)
    before = await h.stats()
    await expect(DuplicateGroupError, buffer.add_prompt("a", global_steps=0))
    await expect(DuplicateTrajectoryError, buffer.put("a", 2, session_id=0))
    await expect(TypeError, buffer.add_prompt(7, global_steps=0))
    await expect(ValueError, buffer.add_prompt("has_underscore", global_steps=0))
    await expect(ValueError, buffer.add_prompt("b", global_steps=-1))
    await expect(TypeError, buffer.add_prompt("b", global_steps=0, tags=[1]))
    await expect(ValueError, buffer.put("a", 3, session_id=-1))
    await expect(ValueError, buffer.sample(0, 0))
    await expect(ValueError, buffer.sample(0, 1, timeout=-1))
    await expect(TypeError, buffer.sample(0, 1, partition=3))
    await expect(TimeoutError, buffer.sample(0, 1, timeout=0))
    await expect(TimeoutError, buffer.sample(0, 1, timeout=0.05))
    assert await h.stats() == before
    await buffer.mark_running("a")
    await expect(InvalidTransitionError, buffer.mark_running("a"))
    await buffer.mark_finished("a")
    await expect(InvalidTransitionError, buffer.mark_finished("a"))
    await expect(InvalidTransitionError, buffer.mark_failed("a"))
    await expect(InvalidTransitionError, buffer.put("a", 4, session_id=1))
    error = await expect(UnknownGroupError, buffer.put("gone", 1))
    assert "gone" in str(error)


@scenario()
async def timeout_takes_nothing(h: Harness) -> None:
    await finished(h, "a", 0, "v")
    await expect(TimeoutError, h.buffer.sample(0, 2, timeout=0.1))
    assert await h.count(0) == 1
    batch, _ = await h.buffer.sample(0, 1)
    assert batch.uids == ["a"]


@scenario()
async def cancelled_sampler_loses_nothing(h: Harness) -> None:
    buffer = h.buffer
    async with anyio.create_task_group() as tg:
        tg.start_soon(buffer.sample, 0, 1)
        await h.wait_parked(1)
        tg.cancel_scope.cancel()
    await h.wait_parked(0)
    await finished(h, "a", 0, "v")
    batch, _ = await buffer.sample(0, 1, timeout=5)
    assert batch.uids == ["a"]
    assert (await h.stats()).total.sampled_groups == 1


@scenario()
async def close_wakes_samplers_and_keeps_stats(h: Harness) -> None:
    buffer = h.buffer
    await buffer.add_prompt("kept", global_steps=0)
    errors: list[BaseException] = []

    async def trainer() -> None:
        try:
            await buffer.sample(0, 1)
        except BufferClosedError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(trainer)
        await h.wait_parked(1)
        await buffer.aclose()
    assert len(errors) == 1
    assert type(errors[0]) is BufferClosedError
    await expect(BufferClosedError, buffer.add_prompt("x", global_steps=0))
    await expect(BufferClosedError, buffer.mark_finished("kept"))
    await expect(BufferClosedError, buffer.sample(0, 1))
    stats = await h.stats()
    assert stats.closed
    assert stats.total.pending == 1
    await buffer.aclose()  # idempotent


@scenario(SamplerConfig(failure_strategy="evict"))
async def failed_groups_are_evicted_under_evict(h: Harness) -> None:
    buffer = h.buffer
    await buffer.add_prompt("bad", global_steps=0)
    await buffer.put("bad", "x")
    await buffer.mark_failed("bad")
    await finished(h, "good", 0, "y")
    batch, metrics = await buffer.sample(0, 1)
    assert batch.uids == ["good"]
    assert metrics["training/rollout_failure/evicted_groups"] == 1.0
    event = await h.next_eviction()
    assert event.reason == "failure"
    assert [group.uid for group in event.groups] == ["bad"]
    assert (await h.stats()).total.evicted_failure_trajectories == 1


@scenario()
async def failed_groups_are_sampled_under_sample(h: Harness) -> None:
    await h.buffer.add_prompt("bad", global_steps=0, tags={"why": "oom"})
    await h.buffer.mark_failed("bad")
    batch, _ = await h.buffer.sample(0, 1)
    assert batch.groups[0].status is Status.FAILURE
    assert dict(batch.groups[0].tags) == {"why": "oom"}


@scenario(SamplerConfig(max_off_policy_threshold=1, max_off_policy_strategy="drop"))
async def partitions_are_independent_and_val_is_exempt(h: Harness) -> None:
    await finished(h, "v", 0, 1, partition="val")
    await finished(h, "t", 0, 2)
    assert await h.count(50, partition="val") == 1
    batch, metrics = await h.buffer.sample(50, 1, partition="val")
    assert batch.uids == ["v"]
    assert batch.partition == "val"
    assert "validation/off_policy/sampled_staleness/mean" in metrics
    assert await h.count(50) == 0  # "t" is stale in train
    stats = await h.stats()
    assert set(stats.partitions) == {"train", "val"}
    assert stats.partitions["val"].sampled_groups == 1


@scenario()
async def keys_tags_and_payloads_round_trip(h: Harness) -> None:
    buffer = h.buffer
    await buffer.add_prompt("a", global_steps=4, tags={"prompt": "2+2"})
    key = await buffer.put("a", {"tokens": [1, 2, 3]}, session_id=2, index=1, tags={"reward": 1.0})
    assert key == "a_2_1"
    assert await buffer.put("a", None, session_id=2, index=0) == "a_2_0"
    await buffer.mark_finished("a")
    batch, _ = await buffer.sample(4, 1)
    (group,) = batch.groups
    assert (group.uid, group.partition, group.global_steps) == ("a", "train", 4)
    assert dict(group.tags) == {"prompt": "2+2"}
    assert batch.keys == ["a_2_1", "a_2_0"]
    assert [dict(t) for t in batch.tags] == [{"reward": 1.0}, {}]
    assert await h.values(batch) == [{"tokens": [1, 2, 3]}, None]
