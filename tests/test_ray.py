"""stalebuf.ray: the buffer hosted by a Ray actor, with producers in other processes.

One local Ray instance (2 CPUs, no dashboard) serves the whole session. The shared
scenarios of ``tests/scenarios.py`` run against the local and the remote buffer; the rest
checks what only the remote buffer has: cross-process producers and conservation, the
starvation case, payloads in the object store, put_group, eviction streams, errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import attrs
import numpy as np
import pytest

pytest.importorskip("ray")

import ray
import ray.cloudpickle

from _helpers import LyingLen
from scenarios import SCENARIOS, Harness, LocalHarness, Scenario, expect
from stalebuf import Batch, BufferStats, EvictionEvent, ReplayBuffer, SamplerConfig, Status, WaitExplanation
from stalebuf.errors import (
    BufferClosedError,
    BufferFullError,
    BufferUnavailableError,
    CheckpointError,
    ConfigError,
    DuplicateGroupError,
    DuplicateTrajectoryError,
    FutureTagError,
    GroupCutError,
    GroupEvictedError,
    InvalidTransitionError,
)
from stalebuf.ray import (
    PayloadRef,
    RemoteReplayBuffer,
    RemoteRestoreResult,
    RemoteRolloutGroup,
    resolve,
    resolve_sync,
)
from stalebuf.ray._protocol import (
    AddPrompt,
    EndRollout,
    MarkFailed,
    MarkFinished,
    MarkRunning,
    OpenRollout,
    ProtocolError,
    Put,
    PutGroup,
    SampleRequest,
    decode_op,
    decode_sample,
    encode,
)

# Producers below run in Ray worker processes, which cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEP_TIMEOUT = 20.0


@pytest.fixture(scope="session", autouse=True)
def ray_session() -> Iterator[None]:
    """Start one local Ray instance for the session; shut it down at the end."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    if started:
        ray.shutdown()


class RemoteHarness(Harness):
    """A RemoteReplayBuffer on a fresh actor; evictions come from ``evictions()``."""

    kind = "remote"

    def __init__(self, config: SamplerConfig) -> None:
        super().__init__(RemoteReplayBuffer(config, status_log_interval=None))
        self._stream = self.buffer.evictions(from_oldest=True, poll_seconds=1.0)

    async def count(self, global_steps: int, partition: str = "train") -> int:
        return int(await self.buffer.sampleable_count(global_steps, partition))

    async def stats(self) -> BufferStats:
        stats: BufferStats = await self.buffer.stats()
        return stats

    async def values(self, batch: Batch) -> list[Any]:
        return (await resolve(batch)).payloads

    async def next_eviction(self) -> EvictionEvent:
        event: EvictionEvent = await self._stream.__anext__()
        return event

    async def dispose(self) -> None:
        self.buffer.kill()


def _harness(kind: str, config: SamplerConfig) -> Harness:
    return LocalHarness(config) if kind == "local" else RemoteHarness(config)


@pytest.mark.parametrize("kind", ["local", "remote"])
@pytest.mark.parametrize("case", SCENARIOS, ids=[case.name for case in SCENARIOS])
@pytest.mark.asyncio
async def test_scenario(case: Scenario, kind: str) -> None:
    with anyio.fail_after(STEP_TIMEOUT):
        harness = _harness(kind, case.config)
        try:
            await case(harness)
        finally:
            await harness.dispose()


# -- helpers ------------------------------------------------------------------------------


def _name() -> str:
    return f"stalebuf-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def remote() -> Iterator[RemoteReplayBuffer]:
    """A fresh remote buffer (default config), killed after the test."""
    buffer = RemoteReplayBuffer(status_log_interval=None)
    yield buffer
    buffer.kill()


async def _wait_parked(buffer: RemoteReplayBuffer, count: int) -> None:
    while True:  # the parked calls live in the actor: poll its stats
        if (await buffer.stats()).total.waiting_samplers == count:
            return
        await asyncio.sleep(0.005)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this machine) still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


async def _until_dead(pid: int) -> None:
    """Return once process ``pid`` has exited."""
    while True:  # another process: nothing to wait on but polling
        if not _alive(pid):
            return
        await asyncio.sleep(0.05)


async def _save_until_refused(buffer: RemoteReplayBuffer, path: Any) -> CheckpointError:
    """Save until the actor refuses (it learns of a payload owner's death within moments)."""
    for _ in range(100):
        try:
            await buffer.save(path)
        except CheckpointError as error:
            return error
        await asyncio.sleep(0.1)
    raise AssertionError("save kept writing payloads whose owner died")


async def _resolve_repeatedly(batch: Batch) -> None:
    for _ in range(100):
        await resolve(batch, timeout=5)
        await asyncio.sleep(0.1)


# -- producers in other processes ---------------------------------------------------------


@ray.remote(num_cpus=0)
def produce(
    target: RemoteReplayBuffer | str,
    prefix: str,
    groups: int,
    group_size: int,
    steps: list[int],
    partitions: tuple[str, ...] = ("train",),
) -> dict[str, Any]:
    """A producer process: group ``i`` is dispatched at ``steps[i % len(steps)]`` into
    ``partitions[i % len(partitions)]``; half go via put_group, half step by step; every 7th fails."""
    buffer = target if isinstance(target, RemoteReplayBuffer) else RemoteReplayBuffer.connect(target)

    async def main() -> dict[str, Any]:
        failed = []
        for i in range(groups):
            uid = f"{prefix}g{i}"
            step = steps[i % len(steps)]
            partition = partitions[i % len(partitions)]
            payloads = [np.full(4, i, dtype=np.int64) for _ in range(group_size)]
            status = "failed" if i % 7 == 6 else "finished"
            if status == "failed":
                failed.append(uid)
            if i % 2:
                await buffer.put_group(uid, payloads, global_steps=step, partition=partition, status=status)
            else:
                await buffer.add_prompt(uid, global_steps=step, partition=partition)
                await buffer.mark_running(uid)
                for session, payload in enumerate(payloads):
                    await buffer.put(uid, payload, session_id=session)
                if status == "failed":
                    await buffer.mark_failed(uid)
                else:
                    await buffer.mark_finished(uid)
        return {"pid": os.getpid(), "failed": failed}

    return asyncio.run(main())


@ray.remote(num_cpus=0)
class Producer:
    """A long-lived producer process (a Ray actor) that owns the payloads it stores."""

    def __init__(self, buffer: RemoteReplayBuffer) -> None:
        self.buffer = buffer

    async def put_group(self, uid: str, values: list[int], step: int) -> list[str]:
        payloads = [np.full(1024, v, dtype=np.int64) for v in values]
        return await self.buffer.put_group(uid, payloads, global_steps=step)

    async def pid(self) -> int:
        return os.getpid()


# -- import hygiene ---------------------------------------------------------------------


def test_import_stalebuf_does_not_import_ray() -> None:
    code = "import stalebuf, sys; assert 'ray' not in sys.modules, 'stalebuf imported ray'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- across processes -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_conservation_with_producers_in_other_processes() -> None:
    """Four producer processes (two attach by name, two get the pickled client), the trainer
    here: every admitted group ends up sampled once, evicted once or still resident."""
    name = _name()
    config = SamplerConfig(
        max_off_policy_threshold=2, max_off_policy_strategy="drop", failure_strategy="evict"
    )
    buffer = RemoteReplayBuffer(config, name=name, status_log_interval=None)
    try:
        with anyio.fail_after(45):
            stream = buffer.evictions(from_oldest=True, poll_seconds=0.5)
            groups, group_size = 40, 3
            tasks = [
                produce.remote(name if p % 2 else buffer, f"p{p}x", groups, group_size, [0, 1, 2, 3, 4])
                for p in range(4)
            ]
            reports = await asyncio.gather(*tasks)
            assert len({report["pid"] for report in reports}) >= 2  # really other processes
            assert os.getpid() not in {report["pid"] for report in reports}
            sampled: list[str] = []
            for step in range(2, 6):
                batch, _ = await buffer.sample(step, 5, timeout=10)
                assert len(batch) == 5
                sampled += batch.uids
                values = (await resolve(batch)).payloads
                assert len(values) == 5 * group_size
                for group, start in zip(batch.groups, range(0, len(values), group_size), strict=True):
                    number = int(group.uid.rpartition("g")[2])
                    assert all(int(v[0]) == number for v in values[start : start + group_size])
            await buffer.aclose()
            evicted = [group.uid for event in [e async for e in stream] for group in event.groups]
            stats = await buffer.stats()
        admitted = {f"p{p}xg{i}" for p in range(4) for i in range(groups)}
        assert len(sampled) == len(set(sampled))
        assert len(evicted) == len(set(evicted))
        assert not set(sampled) & set(evicted)
        assert stream.dropped == 0
        total = stats.total
        assert total.admitted_groups == len(admitted)
        assert total.admitted_trajectories == len(admitted) * group_size
        assert total.sampled_groups == len(sampled)
        assert total.evicted_stale_groups + total.evicted_failure_groups == len(evicted)
        assert total.admitted_groups == total.groups + total.sampled_groups + len(evicted)
        assert (
            total.admitted_trajectories
            == total.trajectories
            + total.sampled_trajectories
            + total.evicted_stale_trajectories
            + total.evicted_failure_trajectories
        )
        failed = {uid for report in reports for uid in report["failed"]}
        assert not failed & set(sampled)  # failure_strategy="evict"
        assert total.evicted_failure_groups > 0
        assert total.evicted_stale_groups > 0
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_parked_samplers_never_starve_producers() -> None:
    """20 samplers park on 20 partitions and fill every sampler slot; a 21st queues in Ray.
    Producers in another process and control calls still get through, and all 21 finish."""
    buffer = RemoteReplayBuffer(actor_options={"max_concurrency": 20}, status_log_interval=None)
    try:
        with anyio.fail_after(30):
            samplers = [asyncio.ensure_future(buffer.sample(0, 1, partition=f"q{i}")) for i in range(21)]
            await _wait_parked(buffer, 20)
            await asyncio.sleep(0.2)
            assert not any(s.done() for s in samplers)
            assert (await buffer.stats()).total.waiting_samplers == 20  # control group answers
            partitions = tuple(f"q{i}" for i in range(21))
            report = await produce.remote(buffer, "q", 21, 2, [0], partitions)
            assert report["pid"] != os.getpid()
            batches = await asyncio.gather(*samplers)
            assert sorted(batch.partition for batch, _ in batches) == sorted(f"q{i}" for i in range(21))
            assert (await buffer.stats()).total.sampled_groups == 21
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_payload_owner_death_and_actor_owned_payloads(tmp_path: Any) -> None:
    """With payloads="producer" the objects die with the producer process (and ``save`` refuses
    to write a buffer that holds them); with "actor" they survive it."""
    name = _name()
    buffer = RemoteReplayBuffer(name=name, status_log_interval=None)
    try:
        with anyio.fail_after(45):
            for mode in ("producer", "actor"):
                client = RemoteReplayBuffer.connect(name, payloads=mode)
                producer = Producer.remote(client)
                assert await producer.put_group.remote(f"{mode}x", [1, 2], 0) == [
                    f"{mode}x_0_0",
                    f"{mode}x_1_0",
                ]
                pid = await producer.pid.remote()
                ray.kill(producer)
                await _until_dead(pid)
                if mode == "producer":
                    error = await _save_until_refused(buffer, tmp_path / "lost.ckpt")
                    assert "lost" in str(error)
                else:
                    await buffer.save(tmp_path / "kept.ckpt")
                    kept = ReplayBuffer.restore(tmp_path / "kept.ckpt").buffer.sample_nowait(0, 1)[0]
                    assert [int(v[0]) for v in kept.payloads] == [1, 2]
                batch, _ = await buffer.sample(0, 1)
                if mode == "producer":  # Ray notices the owner's death within moments
                    with pytest.raises(ray.exceptions.ObjectLostError):
                        await _resolve_repeatedly(batch)
                else:
                    values = (await resolve(batch)).payloads
                    assert [int(v[0]) for v in values] == [1, 2]
    finally:
        buffer.kill()


# -- payloads -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_payloads_live_in_the_object_store_and_resolve_zero_copy(remote: RemoteReplayBuffer) -> None:
    with anyio.fail_after(STEP_TIMEOUT):
        arrays = [np.arange(512, dtype=np.int64) + i for i in range(8)]
        keys = await remote.put_group("a", arrays, global_steps=0, tags={"k": 1})
        assert keys == [f"a_{i}_0" for i in range(8)]
        own = ray.put("mine")
        await remote.put_group("b", [own, None], global_steps=0)
        batch, _ = await remote.sample(0, 2)
        refs = batch.payloads
        assert all(isinstance(ref, PayloadRef) for ref in refs[:8])
        assert len({ref.ref for ref in refs[:8]}) == 1  # one object for the whole group
        assert refs[8] == own
        assert refs[9] is None
        resolved = await resolve(batch)
        for got, want in zip(resolved.payloads[:8], arrays, strict=True):
            assert np.array_equal(got, want)
            assert not got.flags.writeable  # a read-only view of shared memory: zero-copy
        assert resolved.payloads[8:] == ["mine", None]
        assert resolved.uids == batch.uids
        assert resolved.keys == batch.keys
        assert resolve_sync(batch).payloads[8] == "mine"
        assert np.array_equal(refs[3].get(), arrays[3])


@pytest.mark.asyncio
async def test_split_works_on_the_clients_batch(remote: RemoteReplayBuffer) -> None:
    """Issue 24: ``Batch.split`` on what ``RemoteReplayBuffer.sample`` returns (payloads still
    references), and each part resolves on its own."""
    with anyio.fail_after(STEP_TIMEOUT):
        await remote.put_group("a", ["a0", "a1"], global_steps=0, tokens=[30, 10])
        await remote.put_group("b", ["b0"], global_steps=0, versions=[[(0, 35)]])
        await remote.put_group("c", ["c0", "c1"], global_steps=0, tokens=[2, 3])
        batch, _ = await remote.sample(0, 3)
        assert type(batch) is Batch
        assert batch.uids == ["a", "b", "c"]
        parts = batch.split(2)  # costs 40, 35, 5: a -> 0, b -> 1, c -> 1
        assert [part.uids for part in parts] == [["a"], ["b", "c"]]
        assert all(type(part) is Batch for part in parts)
        assert all(isinstance(ref, PayloadRef) for part in parts for ref in part.payloads)
        assert (await resolve(parts[1])).payloads == ["b0", "c0", "c1"]
        assert resolve_sync(parts[0]).payloads == ["a0", "a1"]
        assert parts[1].token_counts.tolist() == [35, 2, 3]
        # squared, one long trajectory weighs more: b 1225 -> 0, a 1000 -> 1, c 13 -> 1
        assert [part.uids for part in batch.split(2, cost="quadratic")] == [["b"], ["a", "c"]]
        by_trajectory = batch.split(2, by="trajectory")  # 35 | 30, then 10 -> 1, 3 -> 0, 2 -> 0
        assert [[t.key for t in part] for part in by_trajectory] == [
            ["b_0_0", "c_0_0", "c_1_0"],
            ["a_0_0", "a_1_0"],
        ]


@pytest.mark.asyncio
async def test_inline_payloads_travel_by_value() -> None:
    buffer = RemoteReplayBuffer(payloads="inline", status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await buffer.put_group("a", [{"x": 1}, [2]], global_steps=0)
            batch, _ = await buffer.sample(0, 1)
            assert batch.payloads == [{"x": 1}, [2]]
            assert await resolve(batch) is batch
    finally:
        buffer.kill()


# -- put_group ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_put_group_is_atomic(remote: RemoteReplayBuffer) -> None:
    with anyio.fail_after(STEP_TIMEOUT):
        await remote.add_prompt("open", global_steps=3, partition="val")
        await remote.put("open", 1, session_id=0)
        await remote.put_group("done", [1], global_steps=0)
        before = await remote.stats()
        bad_calls = [
            (DuplicateTrajectoryError, remote.put_group("new", [1, 2], global_steps=0, session_ids=[1, 1])),
            (DuplicateTrajectoryError, remote.put_group("open", [1], global_steps=3, partition="val")),
            (
                DuplicateGroupError,
                remote.put_group("open", [1], global_steps=4, partition="val", session_ids=[5]),
            ),
            (InvalidTransitionError, remote.put_group("done", [2], global_steps=0, session_ids=[3])),
            (ValueError, remote.put_group("new", [1, 2], global_steps=0, session_ids=[0])),
            (ValueError, remote.put_group("new", [1], global_steps=0, status="running")),  # type: ignore[arg-type]
            (ValueError, remote.put_group("new", [1], global_steps=0, indices=[-1])),
            (TypeError, remote.put_group("new", [1], global_steps=0, trajectory_tags=[5])),  # type: ignore[list-item]
            (ValueError, remote.put_group("bad_uid", [1], global_steps=0)),
            (TypeError, remote.put_group("new", 5, global_steps=0)),  # type: ignore[arg-type]
        ]
        for error, call in bad_calls:
            await expect(error, call)
        assert await remote.stats() == before
        keys = await remote.put_group(
            "open",
            ["a", "b"],
            global_steps=3,
            partition="val",
            session_ids=[1, 1],
            indices=[0, 1],
            trajectory_tags=[{"r": 1}, None],
            status="failed",
        )
        assert keys == ["open_1_0", "open_1_1"]
        batch, _ = await remote.sample(3, 1, partition="val")
        assert batch.keys == ["open_0_0", "open_1_0", "open_1_1"]
        assert batch.groups[0].status.value == "failure"
        assert (await resolve(batch)).payloads == [1, "a", "b"]
        assert [dict(t) for t in batch.tags] == [{}, {"r": 1}, {}]


class RaisingIter:
    """A collection whose iteration raises (a user's broken container)."""

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("iteration raised")

    def __contains__(self, item: object) -> bool:
        return False


@pytest.mark.asyncio
async def test_put_group_refuses_lying_collections_like_the_local_buffer(remote: RemoteReplayBuffer) -> None:
    """Issue 10 item 4 on the client: a collection whose ``len()`` disagrees with what it yields
    is a ValueError, one whose iteration raises a TypeError, and nothing is added (the client
    used to copy it with ``list()`` and send whatever it yielded)."""
    local = ReplayBuffer(status_log_interval=None)
    with anyio.fail_after(STEP_TIMEOUT):
        before = await remote.stats()
        calls: list[tuple[type[BaseException], dict[str, Any]]] = [
            (ValueError, {"payloads": LyingLen(5, [1, 2])}),
            (ValueError, {"payloads": [1, 2], "session_ids": LyingLen(2, [0, 1, 2])}),
            (ValueError, {"payloads": [1], "indices": LyingLen(1, [])}),
            (ValueError, {"payloads": [1], "trajectory_tags": LyingLen(1, [None, None])}),
            (TypeError, {"payloads": RaisingIter()}),
            (TypeError, {"payloads": [1], "trajectory_tags": RaisingIter()}),
        ]
        for error, kwargs in calls:
            with pytest.raises(error) as local_error:
                await local.put_group("lying", global_steps=0, **kwargs)
            remote_error = await expect(error, remote.put_group("lying", global_steps=0, **kwargs))
            assert str(remote_error) == str(local_error.value)
            await expect(error, remote.put_group_nowait("lying", global_steps=0, **kwargs))
        assert await remote.stats() == before
        assert local.stats().total.admitted_groups == 0


@pytest.mark.asyncio
async def test_concurrent_producer_calls_share_round_trips(remote: RemoteReplayBuffer) -> None:
    """Many concurrent put_group calls from one client: each gets its own result or error."""
    with anyio.fail_after(STEP_TIMEOUT):
        await remote.add_prompt("dup", global_steps=0)
        calls = [remote.put_group(f"g{i}", [np.zeros(8)] * 4, global_steps=0) for i in range(200)]
        calls.append(remote.add_prompt("dup", global_steps=0))
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(result == [f"g{i}_{s}_0" for s in range(4)] for i, result in enumerate(results[:200]))
        assert type(results[200]) is DuplicateGroupError
        assert await remote.sampleable_count(0) == 200
        info = await remote.info()
        assert info["closed"] is False
        assert info["buffer_class"] == "stalebuf.buffer.ReplayBuffer"


# -- requeue ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_cancelled_request_puts_its_taken_batch_back_once(remote: RemoteReplayBuffer) -> None:
    """What the actor does when a client cancels a sample that had already taken its batch:
    the groups go back, whole, exactly once; a group whose uid was reused meanwhile cannot."""
    with anyio.fail_after(STEP_TIMEOUT):
        await remote.put_group("a", ["x", "y"], global_steps=2, tags={"t": 1})
        await remote.put_group("b", ["z"], global_steps=1, status="failed")
        handle = remote.handle
        batch, _ = await handle.sample.remote(encode(SampleRequest("r1", 2, 2, "train", None)))
        assert batch.uids == ["b", "a"]  # taken; this "client" never acknowledges it
        await remote.add_prompt("b", global_steps=9)  # the uid was reused meanwhile
        await handle.cancel_sample.remote("r1")
        await handle.cancel_sample.remote("r1")  # a second cancel puts nothing back again
        await handle.acknowledge_sample.remote("r1")  # nor does a late acknowledgement matter
        counts = (await remote.info())["sample_requests"]
        assert (counts["requeued"], counts["running"], counts["unacknowledged"]) == (1, 0, 0)
        again, _ = await remote.sample(2, 1)
        assert again.uids == ["a"]
        assert again.keys == ["a_0_0", "a_1_0"]
        assert (await resolve(again)).payloads == ["x", "y"]
        assert dict(again.groups[0].tags) == {"t": 1}
        assert await remote.sampleable_count(2) == 0
        stats = (await remote.stats()).total
        assert (stats.admitted_groups, stats.sampled_groups, stats.groups) == (4, 3, 1)


# -- cancelling a sample -----------------------------------------------------------------------


async def _settled(buffer: RemoteReplayBuffer) -> dict[str, int]:
    """Wait until the actor has decided every sample request (cancels and acknowledgements are
    one-way messages); return its counters."""
    while True:  # the messages are on their way to another process: poll
        counts: dict[str, int] = (await buffer.info())["sample_requests"]
        if counts["running"] == counts["unacknowledged"] == counts["early_cancels_pending"] == 0:
            return counts
        await asyncio.sleep(0.01)


async def _cancel_after(task: asyncio.Future[Any], delay: float) -> None:
    await asyncio.sleep(delay)
    task.cancel()


@pytest.mark.asyncio
async def test_cancelled_samples_lose_and_duplicate_nothing(remote: RemoteReplayBuffer) -> None:
    """1,000 samples, each cancelled 0-2.5 ms after the call (the issue's reproduction lost
    half of the batches taken that way), while producers keep adding groups and some samples
    park: every group ends up delivered exactly once or still in the buffer."""
    rng = random.Random(10)
    admitted: list[str] = []
    delivered: list[str] = []
    with anyio.fail_after(90):
        for wave in range(25):  # 40 samples, 2 of them on a partition that never fills up
            uids = [f"w{wave}g{i}" for i in range(30)]
            admitted += uids
            samples = [asyncio.ensure_future(remote.sample(0, 1)) for _ in range(38)]
            samples += [asyncio.ensure_future(remote.sample(0, 1, partition="idle")) for _ in range(2)]
            puts = [remote.put_group(uid, [uid], global_steps=0) for uid in uids]
            await asyncio.gather(*puts, *(_cancel_after(task, rng.uniform(0, 0.0025)) for task in samples))
            for task in samples:
                with contextlib.suppress(asyncio.CancelledError):
                    delivered += (await task)[0].uids
        counts = await _settled(remote)
        rest = await remote.sampleable_count(0)
        left = (await remote.sample(0, rest, timeout=0))[0].uids if rest else []
        stats = (await remote.stats()).total
    print(f"cancel fuzz: {len(delivered)} delivered, {len(left)} left, actor {counts}")
    assert len(delivered) == len(set(delivered)), "a group was delivered twice"
    assert not set(delivered) & set(left), "a delivered group is still in the buffer"
    assert sorted(delivered + left) == sorted(admitted), "a group was lost"
    assert counts["requeued"] > 0  # the race the test is about did happen
    assert counts["cancelled_waiting"] > 0  # the "idle" samples park
    assert stats.admitted_groups == len(admitted) + stats.sampled_groups - len(delivered) - len(left)
    assert stats.groups == 0


# -- starting and connecting ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_actor_that_cannot_start_fails_within_start_timeout() -> None:
    """An actor no node can host: calls raise BufferUnavailableError naming the missing resource
    once ``start_timeout`` has passed, and ``sample(timeout=)`` bounds its own wait before that."""
    options = {"resources": {"no_such_resource": 1}}
    hopeless = RemoteReplayBuffer(actor_options=options, start_timeout=1.0, status_log_interval=None)
    patient = RemoteReplayBuffer(actor_options=options, status_log_interval=None)  # 60 s to start
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            error = await expect(BufferUnavailableError, hopeless.info())
            assert "start_timeout=1 s" in str(error)
            assert "no_such_resource" in str(error)
            await expect(BufferUnavailableError, hopeless.put_group("a", [1], global_steps=0))
            await expect(BufferUnavailableError, hopeless.sample(0, 1))
            await expect(BufferUnavailableError, hopeless.evictions().__anext__())
            error = await expect(TimeoutError, patient.sample(0, 1, timeout=1.5))
            assert "has not started" in str(error)
    finally:
        hopeless.kill()
        patient.kill()
    with pytest.raises(ConfigError, match="start_timeout"):
        RemoteReplayBuffer(start_timeout=0)


@pytest.mark.asyncio
async def test_connect_refuses_an_actor_whose_process_was_killed() -> None:
    name = _name()
    buffer = RemoteReplayBuffer(name=name, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            pid = await buffer.handle.__ray_call__.remote(lambda _host: os.getpid())
            assert RemoteReplayBuffer.connect(name).name == name  # alive: attaches
            os.kill(pid, signal.SIGKILL)
            for _ in range(5):  # right after the kill, and while Ray still lists the name
                with pytest.raises(BufferUnavailableError):
                    RemoteReplayBuffer.connect(name, start_timeout=10)
                await asyncio.sleep(0.2)
    finally:
        buffer.kill()


# -- payload memory ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_each_group_has_its_own_object_freed_when_the_group_leaves() -> None:
    """Three groups sent in one actor call: the sampled and the evicted group's payload objects
    are freed while the third group is still resident (one object per call pinned all three)."""
    config = SamplerConfig(max_off_policy_threshold=1, max_off_policy_strategy="drop")
    buffer = RemoteReplayBuffer(config, status_log_interval=None)
    owner = ray._private.worker.global_worker.core_worker  # the producer owns payloads by default

    def alive(ids: set[bytes]) -> set[bytes]:
        return ids & set(owner.get_all_reference_counts())

    async def freed(ids: set[bytes]) -> None:
        while True:  # the owner learns asynchronously that the actor dropped its references
            if not alive(ids):
                return
            await asyncio.sleep(0.02)

    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await buffer.info()  # started: later objects are ours
            before = set(owner.get_all_reference_counts())
            big = [np.full(2**17, value, dtype=np.int64) for value in range(3)]  # 1 MiB each
            await asyncio.gather(  # concurrent calls from one client: one actor call
                buffer.put_group("stale", [big[0]], global_steps=0),
                buffer.put_group("taken", [big[1]], global_steps=5),
                buffer.put_group("resident", [big[2]], global_steps=5),
            )
            stored = alive(set(owner.get_all_reference_counts()) - before)
            batch, metrics = await buffer.sample(5, 1)
            assert batch.uids == ["taken"]
            assert metrics["training/off_policy/dropped_groups"] == 1
            taken = batch.payloads[0].ref.hex().encode()
            del batch
            await freed({taken})  # while "resident", sent in the same call, is still in the buffer
            batch, _ = await buffer.sample(5, 1)
            resident = batch.payloads[0].ref.hex().encode()
            assert resident != taken
            assert np.array_equal((await resolve(batch)).payloads[0], big[2])
            await freed(stored - {resident})  # the evicted group's object too
            assert len(stored) >= 3
    finally:
        buffer.kill()


# -- evictions ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_eviction_stream_counts_overflow_and_never_blocks_sample() -> None:
    config = SamplerConfig(max_off_policy_threshold=1, max_off_policy_strategy="drop")
    buffer = RemoteReplayBuffer(
        config, eviction_queue_size=2, keep_evicted_payloads=True, status_log_interval=None
    )
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            stream = buffer.evictions(poll_seconds=1.0)
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.3)  # let the stream subscribe

            async def evict_one(i: int) -> None:
                await buffer.put_group(f"old{i}", [i], global_steps=0)
                await buffer.put_group(f"new{i}", [i], global_steps=10 + i)
                batch, metrics = await buffer.sample(10 + i, 1, timeout=5)
                assert batch.uids == [f"new{i}"]
                assert metrics["training/off_policy/dropped_groups"] == 1

            await evict_one(0)
            assert [g.uid for g in (await first).groups] == ["old0"]
            for i in range(1, 6):  # nobody reads: the ring of 2 overflows, sample never waits
                await evict_one(i)
            rest = [await stream.__anext__(), await stream.__anext__()]
            assert [e.groups[0].uid for e in rest] == ["old4", "old5"]
            assert stream.dropped == 3
            assert (await resolve(Batch("train", 0, rest[1].groups))).payloads == [5]  # payload kept
            info = await buffer.info()
            assert (info["evictions_emitted"], info["evictions_overflowed"]) == (6, 4)
            late = buffer.evictions(from_oldest=True)
            assert [(await late.__anext__()).groups[0].uid for _ in range(2)] == ["old4", "old5"]
            await buffer.aclose()
            assert [e async for e in stream] == []
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_evicted_payloads_are_stripped_by_default() -> None:
    config = SamplerConfig(max_off_policy_threshold=1, max_off_policy_strategy="drop")
    buffer = RemoteReplayBuffer(config, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            stream = buffer.evictions(from_oldest=True)
            await buffer.put_group("old", ["big"], global_steps=0)
            await expect(TimeoutError, buffer.sample(5, 1, timeout=0))
            event = await stream.__anext__()
            assert event.reason == "stale"
            assert event.groups[0].trajectories[0].payload is None
    finally:
        buffer.kill()


# -- flow control: admission, the dispatch clock, rollout() --------------------------------------


async def _until_waiting(buffer: RemoteReplayBuffer, count: int) -> None:
    """Return once ``count`` producers wait for admission in the actor."""
    while True:  # they wait in the actor: poll
        if (await buffer.stats()).total.waiting_producers == count:
            return
        await asyncio.sleep(0.01)


async def _until_stats(buffer: RemoteReplayBuffer, field: str, value: int) -> None:
    """Return once the buffer's total ``field`` is ``value``."""
    while True:  # the change happens in another process: poll
        if getattr((await buffer.stats()).total, field) == value:
            return
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_admission_waits_in_the_actor_in_order_and_a_cancelled_wait_adds_nothing() -> None:
    """One group per dispatch step (b=1, T=2). Three producers park in the actor, whose admission
    group has two slots (one result call queues in Ray): writes to the admitted group, control
    calls and ``sample`` still go through. A cancelled wait adds nothing; a freed slot goes to
    the head producer, tagged with the clock when it is admitted, not when it called."""
    config = SamplerConfig(max_off_policy_threshold=2, admission_batch_size=1)
    buffer = RemoteReplayBuffer(
        config, actor_options={"concurrency_groups": {"admission": 2}}, status_log_interval=None
    )
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await buffer.add_prompt("a")
            waiting = {uid: asyncio.ensure_future(buffer.add_prompt(uid)) for uid in ("p1", "p2", "p3")}
            await _until_waiting(buffer, 3)
            await buffer.mark_running("a")
            assert await buffer.put("a", "x") == "a_0_0"
            await buffer.mark_finished("a")
            assert await buffer.sampleable_count(0) == 1
            assert (await buffer.full(), await buffer.free_slots(), await buffer.capacity()) == (True, 0, 2)
            waiting["p2"].cancel()
            await _until_waiting(buffer, 2)
            batch, _ = await buffer.sample(1, 1)  # the clock moves to 1: one slot, for the head
            assert batch.uids == ["a"]
            await waiting["p1"]
            await _until_waiting(buffer, 1)
            assert not waiting["p3"].done()
            await buffer.mark_finished("p1")
            batch, _ = await buffer.sample(2, 1)
            assert batch.uids == ["p1"]
            assert batch.groups[0].dispatch_step == 1  # called at clock 0, admitted at clock 1
            await waiting["p3"]
            late = asyncio.ensure_future(buffer.put_group("p4", [1]))
            await _until_waiting(buffer, 1)
            await buffer.aclose()
            await expect(BufferClosedError, late)
            stats = (await buffer.stats()).total
            info = await buffer.info()
        assert waiting["p2"].cancelled()
        assert (stats.admitted_groups, stats.sampled_groups, stats.pending) == (3, 2, 1)  # never p2
        assert info["admissions"]["cancelled_waiting"] == 1
        assert info["admissions"]["waiting"] == 0
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_the_token_flow_queries_ask_the_actor() -> None:
    config = SamplerConfig(max_off_policy_threshold=2, admission_token_budget=100, max_tokens_per_group=60)
    buffer = RemoteReplayBuffer(config, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            assert [await buffer.free_tokens(), await buffer.capacity_tokens(), await buffer.full()] == [
                100,
                200,
                False,
            ]
            await buffer.add_prompt_nowait("a")
            assert [await buffer.free_tokens(), await buffer.full()] == [40, True]
            error = await expect(BufferFullError, buffer.add_prompt_nowait("b"))
            assert "room for 40 more tokens" in str(error)
            assert (await buffer.stats()).partitions["train"].reserved_tokens == 60
            assert [await buffer.free_tokens("val"), await buffer.capacity_tokens("val")] == [None, None]
            await expect(ValueError, buffer.free_tokens(""))
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_nowait_producers_raise_buffer_full_error_and_flow_queries_are_coroutines() -> None:
    config = SamplerConfig(max_off_policy_threshold=2, admission_batch_size=2)
    buffer = RemoteReplayBuffer(config, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            flow = [buffer.dispatch_step(), buffer.capacity(), buffer.free_slots(), buffer.full()]
            assert [await query for query in flow] == [0, 4, 2, False]
            await buffer.add_prompt_nowait("a", tags={"k": 1})
            assert await buffer.put_group_nowait("b", [1, 2]) == ["b_0_0", "b_1_0"]
            before = await buffer.stats()
            error = await expect(BufferFullError, buffer.add_prompt_nowait("c"))
            assert "at most 2 per step" in str(error)
            await expect(BufferFullError, buffer.put_group_nowait("c", [1], global_steps=0))
            assert await buffer.stats() == before
            assert await buffer.full()
            assert await buffer.put_group_nowait("a", [3]) == ["a_0_0"]  # in the buffer: never gated
            assert [await buffer.capacity("val"), await buffer.free_slots("val")] == [None, None]
            assert not await buffer.full("val")
            await buffer.put_group_nowait("v", [1], partition="val")  # exempt: never gated
            await expect(ValueError, buffer.capacity(""))
            await expect(TypeError, buffer.dispatch_step(5))  # type: ignore[arg-type]
            batch, _ = await buffer.sample(1, 2)
            assert batch.uids == ["a", "b"]
            assert await buffer.dispatch_step() == 1
            await buffer.add_prompt_nowait("d")  # tagged with the clock: 1
            await buffer.put_group("d", ["x"])
            await buffer.put_group("e", ["y"], global_steps=1)  # an explicit tag (never ahead of it)
            batch, _ = await buffer.sample(2, 2)
            assert [(g.uid, g.dispatch_step) for g in batch.groups] == [("d", 1), ("e", 1)]
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_wait_for_sampleable_explain_wait_and_generation_seconds_in_the_actor(
    remote: RemoteReplayBuffer,
) -> None:
    """Issue 26: the remote ``wait_for_sampleable`` wakes on the producer call that reaches the
    count and takes nothing, times out and ends on close as the local one; ``explain_wait`` and
    ``put_group(generation_seconds=)`` reach the actor with the local buffer's answers and errors."""
    buffer = remote
    with anyio.fail_after(STEP_TIMEOUT):
        for bad, error in (
            ({"count": 0}, ValueError),
            ({"count": True}, TypeError),
            ({"partition": ""}, ValueError),
        ):
            arguments: dict[str, Any] = {"count": 1, "partition": "train", **bad}
            await expect(
                error, buffer.wait_for_sampleable(0, arguments["count"], partition=arguments["partition"])
            )
        waiting = asyncio.ensure_future(buffer.wait_for_sampleable(0, 2))
        await buffer.put_group("a", [1], generation_seconds=2.0)
        await buffer.stats()  # a round trip after the write: the wait saw it and waits on
        assert not waiting.done()
        await buffer.put_group_nowait("b", [1], generation_seconds=1.0)
        assert await waiting == 2
        assert await buffer.sampleable_count(0) == 2  # it took nothing
        await expect(TimeoutError, buffer.wait_for_sampleable(0, 3, timeout=0.05))
        await expect(TimeoutError, buffer.wait_for_sampleable(0, 3, timeout=0))
        before = await buffer.stats()
        await expect(ValueError, buffer.put_group("c", [1], generation_seconds=-1.0))
        await expect(TypeError, buffer.put_group_nowait("c", [1], generation_seconds="1"))  # type: ignore[arg-type]
        assert await buffer.stats() == before  # nothing added
        parked = asyncio.ensure_future(buffer.sample(0, 3))
        await _wait_parked(buffer, 1)
        explanation = await buffer.explain_wait()
        assert isinstance(explanation, WaitExplanation)
        assert (explanation.waiting_samplers, explanation.sampleable, explanation.short_by) == (1, 2, 1)
        assert "the batch is short by 1 group(s)" in explanation.reason
        assert (await buffer.explain_wait("val")).reason == "no sample waits on partition 'val'"
        await expect(ValueError, buffer.explain_wait(""))
        await buffer.put_group("c", [1])
        batch, metrics = await parked
        assert [group.generation_seconds for group in batch] == [2.0, 1.0, 0.0]
        assert metrics["training/off_policy/sampled_generation_seconds/mean"] == 1.0
        closing = asyncio.ensure_future(buffer.wait_for_sampleable(0, 1))
        await asyncio.sleep(0.2)  # (it reached the actor, or it raises there on arrival)
        await buffer.aclose()
        await expect(BufferClosedError, closing)
        await expect(BufferClosedError, buffer.wait_for_sampleable(0, 1))


@pytest.mark.asyncio
async def test_a_cancelled_remote_wait_for_sampleable_frees_its_actor_slot() -> None:
    """Cancelling the client's wait cancels the actor's (``ray.cancel``): with two default-group
    slots, two cancelled waits would otherwise hold both and queue every ``sample`` behind them."""
    buffer = RemoteReplayBuffer(actor_options={"max_concurrency": 2}, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await buffer.stats()  # the actor is up
            waits = [asyncio.ensure_future(buffer.wait_for_sampleable(0, 5)) for _ in range(2)]
            await asyncio.sleep(0.5)  # (they reach the actor; a cancel before that works too)
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            await buffer.put_group("a", [1])
            batch, _ = await buffer.sample(0, 1)  # needs a default-group slot
            assert batch.uids == ["a"]
    finally:
        buffer.kill()


@ray.remote(num_cpus=0)
def rollout_producer(buffer: RemoteReplayBuffer, uid: str) -> dict[str, Any]:
    """A producer process: one rollout whose body writes once, then generates for a minute."""

    async def main() -> dict[str, Any]:
        reached_end = False
        async with buffer.rollout(uid, tags={"kind": "long"}) as group:
            await group.put("first")
            await asyncio.sleep(60)  # cancelled when the group is evicted in flight
            reached_end = True
        return {
            "evicted": group.evicted,
            "reached_end": reached_end,
            "step": group.global_steps,
            "cut": group.cut,
        }

    return asyncio.run(main())


@pytest.mark.asyncio
async def test_in_flight_eviction_cancels_a_remote_rollout_body_in_another_process() -> None:
    """The trainer evicts a group whose producer (another process) is inside ``rollout()``: the
    body is cancelled at once (the actor answers the block's parked watch), the block exits
    quietly, and later writes raise GroupEvictedError. A rollout cancelled while it waits for
    admission adds nothing, even once a slot opens."""
    config = SamplerConfig(max_off_policy_threshold=1, admission_batch_size=1, evict_stale_in_flight=True)
    buffer = RemoteReplayBuffer(config, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            stream = buffer.evictions(from_oldest=True)
            report = rollout_producer.remote(buffer, "old")
            await _until_stats(buffer, "trajectories", 1)
            sampling = asyncio.ensure_future(buffer.sample(2, 1))  # s = 2 > T: "old" can never train
            await _wait_parked(buffer, 1)  # the clock is at 2: "fresh" is tagged 2 (never ahead of it)
            await buffer.put_group_nowait("fresh", ["f"])
            batch, metrics = await sampling
            assert batch.uids == ["fresh"]
            assert metrics["training/off_policy/evicted_in_flight_groups"] == 1
            assert await report == {"evicted": True, "reached_end": False, "step": 0, "cut": False}
            event = await stream.__anext__()
            [group] = event.groups
            assert (event.reason, group.uid, group.status, len(group.trajectories)) == (
                "stale",
                "old",
                Status.RUNNING,
                1,
            )
            error = await expect(GroupEvictedError, buffer.put("old", "late", session_id=1))
            assert "in flight" in str(error)
            # Step 2 is closed (T*S = 1 and sample(2) returned): this rollout waits.
            before = (await buffer.stats()).total
            entering = asyncio.ensure_future(buffer.rollout("never").__aenter__())
            await _until_waiting(buffer, 1)
            entering.cancel()
            await _until_waiting(buffer, 0)
            await expect(TimeoutError, buffer.sample(3, 1, timeout=0))  # step 3 opens: a free slot
            after = (await buffer.stats()).total
            assert (after.admitted_groups, after.groups) == (before.admitted_groups, before.groups)
            assert after.evicted_in_flight_groups == 1
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_a_deadline_cut_in_the_actor_cancels_a_remote_rollout_body() -> None:
    """Group deadlines on a remote buffer (issue 21): the actor enforces them; a producer in
    another process stuck in generation is cancelled at the cut (``group.cut``), its group is
    finished with what it has (quorum 1) and trained, and a late write raises GroupCutError."""
    config = SamplerConfig(max_off_policy_strategy="wait", group_deadline_seconds=0.5, group_quorum=1)
    buffer = RemoteReplayBuffer(config, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            report = rollout_producer.remote(buffer, "hung")
            await _until_stats(buffer, "trajectories", 1)
            batch, metrics = await buffer.sample(0, 1)  # parks with a timer: cuts "hung" on time
            assert batch.uids == ["hung"]
            assert dict(batch.groups[0].tags)["stalebuf_cut"] is True
            assert metrics["training/rollout/cut_groups"] == 1
            assert await report == {"evicted": False, "reached_end": False, "step": 0, "cut": True}
            error = await expect(GroupCutError, buffer.put("hung", "late", session_id=1))
            assert "deadline" in str(error)
            assert (await buffer.stats()).total.cut_groups == 1
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_a_remote_producer_is_refused_a_step_ahead_of_the_clock_at_once() -> None:
    """Issue 21 item 11 across the boundary: under admission every remote producer call with a
    step ahead of the actor's dispatch clock raises FutureTagError at once, also while another
    producer waits in the actor (none parks for a slot that could never open); the clock's own
    step is admitted."""
    config = SamplerConfig(max_off_policy_threshold=2, admission_batch_size=1)
    buffer = RemoteReplayBuffer(config, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            assert await buffer.dispatch_step() == 0  # the actor answers: timeout=0 reaches it below
            with contextlib.suppress(TimeoutError):
                await buffer.sample(3, 1, timeout=0)  # the clock to 3
            assert await buffer.dispatch_step() == 3
            await buffer.add_prompt("at-clock", global_steps=3)
            queued = asyncio.ensure_future(buffer.add_prompt("queued"))  # step 3 is full: it parks
            await _until_waiting(buffer, 1)
            for call in (
                lambda: buffer.add_prompt("a", global_steps=4),
                lambda: buffer.add_prompt_nowait("a", global_steps=4),
                lambda: buffer.put_group("b", [1], global_steps=4),
                lambda: buffer.put_group_nowait("b", [1], global_steps=4),
            ):
                await expect(FutureTagError, call())

            async def enter() -> None:
                async with buffer.rollout("c", global_steps=4):
                    raise AssertionError("entered")

            await expect(FutureTagError, enter())
            assert not queued.done()
            stats = (await buffer.stats()).total
            assert (stats.admitted_groups, stats.waiting_producers) == (1, 1)
            queued.cancel()
    finally:
        buffer.kill()


class Boom(Exception):
    """A rollout body's own error."""


@pytest.mark.asyncio
async def test_a_remote_rollout_block_ends_its_group_like_the_local_one(remote: RemoteReplayBuffer) -> None:
    """Body returns: FINISHED. Body raises: FAILED, the error propagates. Body ended the group
    itself: left alone. Block cancelled from outside: FAILED. Buffer closed while the body runs:
    the body is cancelled, the block exits quietly with ``evicted``."""
    with anyio.fail_after(STEP_TIMEOUT):
        async with remote.rollout("ok", tags={"k": 1}) as group:
            assert isinstance(group, RemoteRolloutGroup)
            assert (group.uid, group.partition, group.global_steps, group.evicted) == (
                "ok",
                "train",
                0,
                False,
            )
            assert await group.put("x", session_id=1, tags={"r": 2}) == "ok_1_0"

        async def fail() -> None:
            async with remote.rollout("boom") as group:
                await group.put("y")
                raise Boom

        with pytest.raises(Boom):
            await fail()
        async with remote.rollout("self"):
            await remote.mark_failed("self")
        started = asyncio.Event()

        async def generate(uid: str) -> RemoteRolloutGroup:
            async with remote.rollout(uid) as group:
                started.set()
                await asyncio.sleep(60)
            return group

        cancelled = asyncio.ensure_future(generate("cancelled"))
        await started.wait()
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await _until_stats(remote, "running", 0)  # the actor is told without waiting
        batch, _ = await remote.sample(0, 4)
        assert [(g.uid, g.status) for g in batch.groups] == [
            ("ok", Status.FINISHED),
            ("boom", Status.FAILURE),
            ("self", Status.FAILURE),
            ("cancelled", Status.FAILURE),
        ]
        resolved = await resolve(batch)
        assert resolved.payloads == ["x", "y"]
        assert dict(batch.groups[0].tags) == {"k": 1}
        timing = [(g.finish_step, g.generation_seconds) for g in batch.groups]
        assert [(g.finish_step, g.generation_seconds) for g in resolved.groups] == timing
        assert timing[0][1] > 0  # resolve kept it (it used to reset it to 0)
        started = asyncio.Event()
        closing = asyncio.ensure_future(generate("closing"))
        await started.wait()
        await remote.aclose()
        group = await closing
        assert group.evicted
        await expect(BufferClosedError, remote.rollout("after").__aenter__())
        assert (await remote.info())["watched_rollouts"] == 0


async def _until_abandon_reached(buffer: RemoteReplayBuffer) -> None:
    """Return once the actor has handled the one abandon a cancelled block sent without waiting
    (its group had already ended, so the actor keeps the token as abandoned early)."""
    while True:  # a one-way message to another process: poll
        if (await buffer.info())["admissions"]["abandoned_early"] == 1:
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("how", ["returns", "raises", "cancelled"])
@pytest.mark.asyncio
async def test_a_remote_rollout_exit_never_ends_a_later_group_that_reuses_its_uid(
    remote: RemoteReplayBuffer, how: str
) -> None:
    """Issue 21 item 1, remotely: a body ends its own group, the trainer samples it, and another
    producer's rollout admits a new group under the same uid; when the first block exits (its
    body returns, raises, or it is cancelled from outside) the new group stays RUNNING, still
    watched, and its producer's next put and its own exit work."""
    ended_own, reused, entered, go = (asyncio.Event() for _ in range(4))

    async def first() -> RemoteRolloutGroup:
        async with remote.rollout("u") as group:
            await group.put("first")
            await remote.mark_finished("u")  # the body ends its own group (supported)
            ended_own.set()
            await reused.wait()
            if how == "raises":
                raise Boom
            if how == "cancelled":
                await asyncio.sleep(60)
        return group

    async def second() -> RemoteRolloutGroup:
        async with remote.rollout("u") as group:
            entered.set()
            await go.wait()
            await group.put("second")
        return group

    with anyio.fail_after(STEP_TIMEOUT):
        block = asyncio.ensure_future(first())
        await ended_own.wait()
        batch, _ = await remote.sample(0, 1)  # the trainer samples the first group
        assert [(g.uid, g.status) for g in batch.groups] == [("u", Status.FINISHED)]
        other = asyncio.ensure_future(second())
        await entered.wait()
        reused.set()
        if how == "cancelled":
            block.cancel()
            with pytest.raises(asyncio.CancelledError):
                await block
            await _until_abandon_reached(remote)
        elif how == "raises":
            with pytest.raises(Boom):
                await block
        else:
            assert not (await block).evicted
        total = (await remote.stats()).total
        assert (total.running, total.finished, total.failure) == (1, 0, 0)
        assert (await remote.info())["watched_rollouts"] == 1  # the new group's watch is intact
        go.set()
        assert not (await other).evicted
        batch, _ = await remote.sample(0, 1)
        assert [(g.uid, g.status) for g in batch.groups] == [("u", Status.FINISHED)]
        assert (await resolve(batch)).payloads == ["second"]
        assert (await remote.info())["watched_rollouts"] == 0


# -- checkpoint and resume ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_save_and_restore_round_trip_with_object_ref_payloads(tmp_path: Any) -> None:
    """Payloads held as references (producer-owned, actor-owned, a user's ObjectRef) and by value
    are saved by value; the restored actor has the same counters, clock and order, stores the
    payloads itself, and lists the in-flight groups for reissue."""
    name = _name()
    config = SamplerConfig(max_off_policy_threshold=3, admission_batch_size=8)
    buffer = RemoteReplayBuffer(config, name=name, status_log_interval=None)
    restored: RemoteReplayBuffer | None = None
    arrays = [np.arange(4) + i for i in range(3)]
    try:
        with anyio.fail_after(2 * STEP_TIMEOUT):
            await buffer.put_group("z", ["gone"])
            await buffer.sample(1, 1)  # counters and the clock move
            await buffer.put_group("a", arrays[:2], tags={"k": 1})  # producer-owned
            await RemoteReplayBuffer.connect(name, payloads="actor").put_group("b", [arrays[2]])
            await RemoteReplayBuffer.connect(name, payloads="inline").put_group("c", [{"v": 1}])
            await buffer.put_group("d", [ray.put("own"), None])  # the user's own ObjectRef
            await buffer.add_prompt("e")
            await buffer.mark_running("e")
            await buffer.put("e", "half")  # in flight: discarded on reissue
            await buffer.add_prompt("f", partition="val", tags={"p": 2})
            before = await buffer.stats()
            path = tmp_path / "buffer.ckpt"
            await buffer.save(path)
            assert await buffer.stats() == before  # saving changes nothing
            local = ReplayBuffer.restore(path)  # the file holds values, not references
            assert isinstance(local.buffer.sample_nowait(1, 4)[0].payloads[0], np.ndarray)
            result = RemoteReplayBuffer.restore(path, name=_name(), status_log_interval=None)
            restored = result.buffer
            assert isinstance(result, RemoteRestoreResult)
            assert [
                (g.uid, g.partition, g.dispatch_step, g.status, g.trajectories) for g in result.reissue
            ] == [
                ("e", "train", 1, Status.PENDING, ()),
                ("f", "val", 0, Status.PENDING, ()),
            ]
            assert dict(result.reissue[1].tags) == {"p": 2}
            assert await restored.dispatch_step() == 1
            after = await restored.stats()
            for field in (
                "admitted_groups",
                "admitted_trajectories",
                "sampled_groups",
                "finished",
                "capacity",
            ):
                assert getattr(after.total, field) == getattr(before.total, field), field
            assert (after.total.pending, after.total.running) == (2, 0)
            assert (after.total.reissued_groups, after.total.reissued_trajectories) == (2, 1)
            await restored.mark_running("e")  # regenerate the reissued groups under their uids
            await restored.put("e", "whole")
            await restored.mark_finished("e")
            await restored.put_group("f", ["v"], partition="val")
            batch, _ = await restored.sample(1, 5)
            assert batch.uids == ["a", "b", "c", "d", "e"]  # the original order
            assert isinstance(batch.payloads[0], PayloadRef)  # stored again, by the new actor
            values = (await resolve(batch)).payloads
            assert all(np.array_equal(got, want) for got, want in zip(values[:3], arrays, strict=True))
            assert values[3:] == [{"v": 1}, "own", None, "whole"]
            val, _ = await restored.sample(1, 1, partition="val")
            assert (await resolve(val)).payloads == ["v"]
    finally:
        buffer.kill()
        if restored is not None:
            restored.kill()


def _gated_encode(signals: str, value: Any) -> bytes:
    """A payload codec's encode that holds the payload "slow" until the file ``release`` appears
    in ``signals`` (it runs in the actor's process, so only a file can reach it); bounded."""
    if value == "slow":
        open(os.path.join(signals, "started"), "w").close()
        deadline = time.monotonic() + STEP_TIMEOUT
        while not os.path.exists(os.path.join(signals, "release")):
            if time.monotonic() > deadline:
                raise TimeoutError("the test never released the slow save")
            time.sleep(0.01)
    return pickle.dumps(value)


async def _until_exists(path: Any) -> None:
    """Return once ``path`` exists."""
    while True:  # another process creates it: poll
        if await anyio.Path(path).exists():
            return
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_overlapping_remote_saves_end_with_the_state_of_the_later_one(
    remote: RemoteReplayBuffer, tmp_path: Any
) -> None:
    """Issue 21 item 2, in the actor: a slow save started first and a later save of a newer
    state overlap on one file; the later one lands first, and the slow one, when it ends, must
    not replace it (the file holds the newer state and no temporary file is left)."""
    codec = (functools.partial(_gated_encode, str(tmp_path)), pickle.loads)
    path = tmp_path / "buffer.ckpt"
    with anyio.fail_after(2 * STEP_TIMEOUT):
        await remote.put_group("a", ["slow"])
        slow = asyncio.ensure_future(remote.save(path, payload_codec=codec))
        await _until_exists(tmp_path / "started")  # its checkpoint holds "a"; it is writing
        batch, _ = await remote.sample(0, 1)
        assert batch.uids == ["a"]
        await remote.put_group("b", ["fast"])
        await remote.save(path, payload_codec=codec)  # a newer state, landed first
        (tmp_path / "release").touch()
        await slow  # overtaken: it lands nothing, and that is no error
        result = ReplayBuffer.restore(path, payload_codec=codec)
        assert result.buffer.stats().total.groups == 1
        batch, _ = result.buffer.sample_nowait(0, 1)
        assert (batch.uids, batch.payloads) == (["b"], ["fast"])
        assert sorted(os.listdir(tmp_path)) == ["buffer.ckpt", "release", "started"]


@pytest.mark.asyncio
async def test_restore_evicts_in_flight_groups_and_refuses_bad_files(tmp_path: Any) -> None:
    """A codec file restored with ``in_flight="evict"``: the "restart" eviction is the first
    event the new actor's readers get. A corrupt or missing file raises its error and leaves no
    actor behind."""
    codec = (pickle.dumps, pickle.loads)
    source = RemoteReplayBuffer(status_log_interval=None)
    restored: RemoteReplayBuffer | None = None
    try:
        with anyio.fail_after(2 * STEP_TIMEOUT):
            await source.put_group("done", ["d"])
            await source.add_prompt("open")
            await source.put("open", "partial")
            path = tmp_path / "codec.ckpt"
            await source.save(path, payload_codec=codec)
            result = RemoteReplayBuffer.restore(
                path, in_flight="evict", payload_codec=codec, payloads="inline"
            )
            restored = result.buffer
            assert result.reissue == ()
            event = await restored.evictions(from_oldest=True).__anext__()
            assert (event.reason, [g.uid for g in event.groups]) == ("restart", ["open"])
            stats = (await restored.stats()).total
            assert (stats.evicted_restart_groups, stats.evicted_restart_trajectories) == (1, 1)
            batch, _ = await restored.sample(0, 1)
            assert batch.payloads == ["d"]  # inline: kept by value
            corrupt = tmp_path / "corrupt.ckpt"
            corrupt.write_bytes(b"not a checkpoint")
            name = _name()
            with pytest.raises(CheckpointError, match="not a stalebuf checkpoint"):
                RemoteReplayBuffer.restore(corrupt, name=name)
            with pytest.raises(BufferUnavailableError):
                RemoteReplayBuffer.connect(name, start_timeout=5)  # nothing was built
            with pytest.raises(FileNotFoundError):
                RemoteReplayBuffer.restore(tmp_path / "missing.ckpt")
            with pytest.raises(ConfigError, match="in_flight"):
                RemoteReplayBuffer.restore(path, in_flight="drop")  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match="payload_codec"):
                RemoteReplayBuffer.restore(path, payload_codec=pickle.dumps)  # type: ignore[arg-type]
    finally:
        source.kill()
        if restored is not None:
            restored.kill()


# -- errors, naming, lifecycle --------------------------------------------------------------


@pytest.mark.asyncio
async def test_dead_actor_is_one_clear_error_never_a_hang() -> None:
    buffer = RemoteReplayBuffer(status_log_interval=None)
    with anyio.fail_after(STEP_TIMEOUT):
        await buffer.put_group("a", [1], global_steps=0)
        parked = asyncio.ensure_future(buffer.sample(0, 5))
        stream = buffer.evictions()
        polling = asyncio.ensure_future(stream.__anext__())
        await _wait_parked(buffer, 1)
        buffer.kill()
        started = time.monotonic()
        await expect(BufferUnavailableError, parked)
        await expect(BufferUnavailableError, polling)
        assert time.monotonic() - started < 10
        await expect(BufferUnavailableError, buffer.put_group("b", [1], global_steps=0))
        await expect(BufferUnavailableError, buffer.add_prompt("c", global_steps=0))
        await expect(BufferUnavailableError, buffer.stats())
        await expect(BufferUnavailableError, buffer.aclose())
    with pytest.raises(BufferUnavailableError):
        RemoteReplayBuffer.connect(_name())


@pytest.mark.asyncio
async def test_bad_sample_arguments_fail_on_the_client_like_the_local_buffer() -> None:
    """A sample with bad arguments raises the local buffer's TypeError or ValueError on the client,
    even when the actor is gone or has not started (not BufferUnavailableError, nor a TimeoutError
    saying the actor has not started)."""
    dead = RemoteReplayBuffer(status_log_interval=None)
    waiting = RemoteReplayBuffer(
        actor_options={"resources": {"no_such_resource": 1}}, status_log_interval=None
    )
    local = ReplayBuffer(status_log_interval=None)
    bad: list[tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]] = [
        (ValueError, (0, 0), {}),
        (TypeError, ("0", 1), {}),
        (ValueError, (-1, 1), {}),
        (ValueError, (0, 10**5000), {}),
        (TypeError, (0, 1), {"partition": 5}),
        (ValueError, (0, 1), {"partition": ""}),
        (ValueError, (0, 1), {"timeout": -1}),
        (ValueError, (0, 1), {"timeout": float("nan")}),
        (ValueError, (0,), {}),
        (ValueError, (0, 1), {"token_budget": 5}),
        (TypeError, (0,), {"token_budget": 1.5}),
        (TypeError, (0,), {"token_budget": True}),
        (ValueError, (0,), {"token_budget": 0}),
    ]
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await dead.info()
            dead.kill()
            for error, args, kwargs in bad:
                with pytest.raises(error) as local_error:
                    await local.sample(*args, **{"timeout": 0, **kwargs})
                for buffer in (dead, waiting):
                    started = time.monotonic()
                    remote_error = await expect(error, buffer.sample(*args, **{"timeout": 0, **kwargs}))
                    assert str(remote_error) == str(local_error.value)
                    assert time.monotonic() - started < 0.5  # no wait for an actor that has not started
    finally:
        waiting.kill()


@pytest.mark.asyncio
async def test_a_huge_start_timeout_is_a_long_wait_not_an_overflow(tmp_path: Any) -> None:
    """``start_timeout`` accepts any finite number > 0; the blocking waits of ``connect`` and
    ``restore`` used to raise OverflowError for a huge one, even for a live actor."""
    name = _name()
    buffer = RemoteReplayBuffer(name=name, status_log_interval=None)
    restored: RemoteReplayBuffer | None = None
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await buffer.put_group("a", [1], global_steps=0)
            await buffer.save(tmp_path / "ckpt")
            other = RemoteReplayBuffer.connect(name, start_timeout=1e300)
            assert await other.sampleable_count(0) == 1
            restored, reissue = RemoteReplayBuffer.restore(tmp_path / "ckpt", start_timeout=1e300)
            assert reissue == ()
            assert await restored.sampleable_count(0) == 1
    finally:
        buffer.kill()
        if restored is not None:
            restored.kill()


@pytest.mark.asyncio
async def test_a_relative_save_path_is_the_callers(remote: RemoteReplayBuffer, tmp_path: Any) -> None:
    """``await remote.save("ckpt")`` on the caller's node writes ``./ckpt`` as ``ReplayBuffer.save``
    does, and ``RemoteReplayBuffer.restore("ckpt")`` reads it from there."""
    before = os.getcwd()
    os.chdir(tmp_path)
    restored: RemoteReplayBuffer | None = None
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await remote.put_group("a", [1], global_steps=0)
            await remote.save("relative.ckpt")
            assert (tmp_path / "relative.ckpt").exists()
            restored = RemoteReplayBuffer.restore("relative.ckpt").buffer
            assert (await restored.stats()).total.groups == 1
    finally:
        if restored is not None:
            restored.kill()
        os.chdir(before)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(before, "relative.ckpt"))


@pytest.mark.asyncio
async def test_named_actor_is_shared_and_the_client_pickles() -> None:
    name = _name()
    buffer = RemoteReplayBuffer(
        SamplerConfig(max_off_policy_threshold=3), name=name, namespace="stalebuf-tests"
    )
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            with pytest.raises(ConfigError, match="cannot start"):
                RemoteReplayBuffer(name=name, namespace="stalebuf-tests")
            same = RemoteReplayBuffer(name=name, namespace="stalebuf-tests", get_if_exists=True)
            other = RemoteReplayBuffer.connect(name, "stalebuf-tests")
            copy = pickle.loads(pickle.dumps(buffer))
            assert repr(copy) == repr(buffer)
            assert copy.name == name
            assert copy.namespace == "stalebuf-tests"
            await same.add_prompt("a", global_steps=0)
            await other.mark_finished("a")
            assert await copy.sampleable_count(0) == 1
            assert (await buffer.info())["config"].max_off_policy_threshold == 3
    finally:
        buffer.kill()


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="evictions"):
        RemoteReplayBuffer(on_evict=print)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        RemoteReplayBuffer({"max_off_policy_threshold": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown sampler config key"):
        RemoteReplayBuffer.from_config({"nope": 1})
    with pytest.raises(ConfigError, match="payloads"):
        RemoteReplayBuffer(payloads="elsewhere")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="status_log_interval"):
        RemoteReplayBuffer(status_log_interval=0)
    with pytest.raises(ConfigError, match="status_log_interval"):
        RemoteReplayBuffer(status_log_interval=0.0005)  # below the 1 ms minimum
    with pytest.raises(ConfigError, match="start_timeout"):
        RemoteReplayBuffer(start_timeout=float("inf"))
    with pytest.raises(ConfigError, match="start_timeout"):
        RemoteReplayBuffer.connect("anything", start_timeout=-1)
    with pytest.raises(ConfigError, match="name must be a str, got 123"):
        RemoteReplayBuffer.connect(123)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="namespace must be None or a str"):
        RemoteReplayBuffer.connect("anything", namespace=b"ns")  # type: ignore[arg-type]
    with pytest.raises(BufferUnavailableError) as unknown:
        RemoteReplayBuffer.connect("x" * 100_000)
    assert len(str(unknown.value)) < 2_000  # the name is shortened in the message
    with pytest.raises(ConfigError, match="eviction_queue_size"):
        RemoteReplayBuffer(eviction_queue_size=0)
    with pytest.raises(ConfigError, match="name="):
        RemoteReplayBuffer(actor_options={"name": "x"})
    with pytest.raises(ConfigError, match="namespace"):
        RemoteReplayBuffer(namespace="ns")
    with pytest.raises(ConfigError, match="concurrency_groups"):
        RemoteReplayBuffer(actor_options={"concurrency_groups": {"producer": 0}})
    with pytest.raises(ConfigError, match="cannot start"):
        RemoteReplayBuffer(actor_options={"no_such_option": 1})


@pytest.mark.asyncio
async def test_custom_sampler_errors_surface_as_config_error() -> None:
    buffer = RemoteReplayBuffer.from_config(
        {"custom_sampler": "stalebuf_no_such_module:Sampler"}, status_log_interval=None
    )
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            error = await expect(ConfigError, buffer.info())
            assert "stalebuf_no_such_module" in str(error)
            await expect(ConfigError, buffer.add_prompt("a", global_steps=0))
            await expect(ConfigError, buffer.sample(0, 1))
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_a_verl_style_custom_sampler_starts_and_restores_in_the_actor(tmp_path: Any) -> None:
    """Its constructor takes no ``status_log_interval``: from_config and restore pass one to
    the actor's buffer only when the caller gave one (issue 10, item 12)."""
    sampler = f"{os.path.join(os.path.dirname(__file__), 'samplers.py')}:VerlStyle"
    config = {"custom_sampler": sampler, "sampler_kwargs": {"label": "y"}}
    buffer = RemoteReplayBuffer.from_config(config)
    restored: RemoteReplayBuffer | None = None
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await buffer.put_group("a", [1], global_steps=0)
            path = str(tmp_path / "verl.ckpt")
            await buffer.save(path)
            restored, reissue = RemoteReplayBuffer.restore(path)
            assert reissue == ()
            for remote in (buffer, restored):
                assert (await remote.info())["config"].custom_sampler == sampler
                batch, _ = await remote.sample(0, 1)
                assert batch.uids == ["a"]
    finally:
        buffer.kill()
        if restored is not None:
            restored.kill()


@pytest.mark.asyncio
async def test_from_config_with_a_mapping_and_async_with() -> None:
    buffer = RemoteReplayBuffer.from_config(
        {"max_off_policy_threshold": 4, "max_off_policy_strategy": "wait"},
        actor_options={"concurrency_groups": {"producer": 4}},
        status_log_interval=None,
    )
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            async with buffer as same:
                assert same is buffer
                config = (await buffer.info())["config"]
                assert (config.max_off_policy_threshold, config.max_off_policy_strategy) == (4, "wait")
                await buffer.put_group("a", [1], global_steps=0)
            await expect(BufferClosedError, buffer.put_group("b", [1], global_steps=0))
            stats = await buffer.stats()
            assert stats.closed
            assert stats.total.finished == 1
    finally:
        buffer.kill()


def test_protocol_records_round_trip_and_refuse_what_they_do_not_know() -> None:
    ops = [
        AddPrompt(None, "a", 3, "val", {"k": 1}),
        AddPrompt("token", "a", None, "train", None),
        MarkRunning("a", None),
        MarkRunning("a", 3),
        Put("a", [1, 2], 0, 4, None, None, None),
        Put("a", None, 0, 0, None, ((2, 3), (3, 1)), 4),
        MarkFinished("a"),
        MarkFailed("a"),
        PutGroup("t", "b", [1], 0, "train", None, None, [2], None, "failed", None, None, None, 1.5),
        PutGroup(
            "t",
            "b",
            [1, 2],
            0,
            "train",
            None,
            None,
            None,
            None,
            "finished",
            [((1, 2),), None],
            [2, 5],
            1,
            None,
        ),
        OpenRollout("t2", "c", None, "train", {"k": 2}, None),
        OpenRollout("t3", "c", None, "train", None, 7),
        EndRollout("t2", False),
    ]
    for op in ops:
        wire = encode(op)
        assert type(wire) is tuple
        assert type(wire[0]) is int
        decoded = decode_op(pickle.loads(pickle.dumps(wire)))
        assert (type(decoded), decoded) == (type(op), op)
    request = SampleRequest("id", 1, 2, "train", 0.5)
    assert decode_sample(encode(request)) == request
    by_tokens = SampleRequest("id", 1, None, "train", None, 100)
    assert decode_sample(encode(by_tokens)) == by_tokens
    # A request as protocol 7 sent it (no token_budget) is refused, not misread.
    with pytest.raises(ProtocolError, match="same stalebuf"):
        decode_sample(encode(request)[:-1])
    # (1, "a") and (2, "a", None, 0, 0, None): mark_running and put as protocol 4 sent them.
    olds = [(1, "a"), (2, "a", None, 0, 0, None)]
    for bad in [("put", "a"), (99, "a"), (1,), (1, "a", None, "extra"), [1, "a"], encode(request), *olds]:
        with pytest.raises(ProtocolError, match="same stalebuf"):
            decode_op(bad)
    with pytest.raises(ProtocolError):
        decode_sample(encode(MarkRunning("a", None)))


def test_client_needs_asyncio() -> None:
    trio = pytest.importorskip("trio")
    buffer = RemoteReplayBuffer(status_log_interval=None)
    try:

        async def main() -> None:
            await buffer.stats()

        with pytest.raises(RuntimeError, match="asyncio"):
            trio.run(main)
    finally:
        buffer.kill()


def test_host_without_a_running_loop_uses_a_private_home_loop() -> None:
    """The actor's state also works when constructed outside an event loop (older Rays run
    async actors' ``__init__`` that way): buffer calls then hop onto a private loop thread."""
    from stalebuf.ray._actor import BufferHost

    host = BufferHost(None, False, (None,), 8, False)
    try:

        async def main() -> None:
            ops = [AddPrompt(None, "a", 0, "train", None), MarkFinished("a"), MarkFinished("a")]
            outcomes = await host.submit([encode(op) for op in ops], False)
            assert outcomes[:2] == [(True, None), (True, None)]
            assert type(outcomes[2].value) is InvalidTransitionError
            batch, _ = await host.sample(encode(SampleRequest("r", 0, 1, "train", None)))
            assert batch.uids == ["a"]
            assert (await host.stats()).total.sampled_groups == 1

        asyncio.run(main())
    finally:
        loop = host._home
        loop.call_soon_threadsafe(loop.stop)
        while loop.is_running():
            time.sleep(0.01)
        loop.close()


def test_an_end_message_that_crosses_the_eviction_answer_still_hears_evicted() -> None:
    """The block's end message can cross the watch's "evicted" answer on the wire (the body
    returned as the group was evicted): after the watch call collected it, the end still hears
    "evicted", and it ends nothing, not even a group that reuses the uid by then. A block whose
    body ended its own group hears "gone", as does an unknown token."""
    from stalebuf.ray._watches import RolloutWatches

    async def main() -> None:
        config = SamplerConfig(max_off_policy_threshold=1, evict_stale_in_flight=True)
        buffer = ReplayBuffer(config, status_log_interval=None)
        watches = RolloutWatches(buffer)
        for uid in ("old", "own"):
            buffer.add_prompt_nowait(uid, global_steps=0)
            buffer.mark_running_nowait(uid)
            watches.open(f"t-{uid}", uid)
        buffer.mark_finished_nowait("own")  # the body ends its group; the actor then says so:
        watches.ended("own")
        buffer.put_group_nowait("fresh", ["f"], global_steps=2)
        batch, _ = buffer.sample_nowait(2, 1)  # "old" can never be trained: evicted in flight
        assert batch.uids == ["fresh"]
        assert await watches.watch("t-old") == "evicted"
        buffer.add_prompt_nowait("old", global_steps=2)  # another producer reuses the uid
        assert watches.end("t-old", finished=True) == "evicted"
        assert watches.end("t-own", finished=True) == "gone"
        assert watches.end("t-unknown", finished=False) == "gone"
        total = buffer.stats().total
        assert (total.pending, total.finished, total.failure) == (1, 0, 0)
        assert len(watches) == 0

    asyncio.run(main())


# -- the remote restore result ----------------------------------------------------------------------


def test_a_remote_restore_result_unpacks_as_buffer_and_reissue() -> None:
    """Guards against a RemoteRestoreResult that does not unpack: like the local RestoreResult,
    ``buffer, reissue = RemoteReplayBuffer.restore(...)`` gives the client and the reissue."""
    client: Any = object()  # stands for the client; unpacking does not touch it
    restored, reissue = RemoteRestoreResult(client, ())
    assert restored is client
    assert reissue == ()


# -- versions, tokens and start versions (issue 22) ---------------------------------------------------


@pytest.mark.asyncio
async def test_versions_tokens_and_start_versions_travel_to_the_actor_and_back_in_the_batch() -> None:
    """Every producer call takes them as the local buffer does (numpy versions too: the client
    copies them into int pairs); the client's batch holds them, knows T and the strategy (its
    per-token arrays work there), and keeps both through ``resolve``."""
    config = SamplerConfig(max_off_policy_threshold=2, max_off_policy_strategy="mask")
    buffer = RemoteReplayBuffer(config, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await buffer.add_prompt("a", global_steps=0)
            await buffer.mark_running("a", version=2)
            await buffer.put("a", "a0", versions=[(2, 3), (3, 1)])
            await buffer.put("a", "a1", session_id=1, tokens=2)
            await buffer.mark_finished("a")
            await buffer.put_group(
                "b", ["b0", "b1"], global_steps=0, versions=[[(1, 2)], None], tokens=[None, 3], version=3
            )
            await buffer.put_group_nowait("c", ["c0"], global_steps=0, versions=[np.array([[3, 2]])])
            async with buffer.rollout("d", global_steps=0, version=3) as group:
                await group.put("d0", versions=[(np.int64(3), 1)])
            batch, _ = await buffer.sample(3, 4)
            assert (batch.max_off_policy_threshold, batch.parameter_sync_step, batch.masks) == (2, 1, True)
            assert [(g.uid, g.start_version) for g in batch] == [("a", 2), ("b", 3), ("c", 0), ("d", 3)]
            expected = [
                ("a_0_0", ((2, 3), (3, 1)), 4),
                ("a_1_0", (), 2),
                ("b_0_0", ((1, 2),), 2),
                ("b_1_0", (), 3),
                ("c_0_0", ((3, 2),), 2),
                ("d_0_0", ((3, 1),), 1),
            ]
            for current in (batch, await resolve(batch)):
                assert [(t.key, t.versions, t.tokens) for t in current.trajectories] == expected
                assert (current.max_off_policy_threshold, current.masks) == (2, True)
                versions, offsets = current.token_versions()
                assert versions.tolist() == [2, 2, 2, 3, 2, 2, 1, 1, 3, 3, 3, 3, 3, 3]
                assert offsets.tolist() == [0, 4, 6, 8, 11, 13, 14]
                # At step 3 (T=2) version 1 has lag 3: b_0_0 is all stale, kept out of the loss.
                assert current.freshness_mask()[0].tolist() == [True] * 6 + [False] * 2 + [True] * 6
                assert current.loss_excluded.tolist() == [False, False, True, False, False, False]
            assert (await resolve(batch)).payloads == ["a0", "a1", "b0", "b1", "c0", "d0"]
            total = (await buffer.stats()).total
            assert (total.admitted_tokens, total.sampled_tokens, total.masked_tokens, total.tokens) == (
                14,
                14,
                2,
                0,
            )
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_a_remote_sample_takes_a_token_budget_like_the_local_buffer() -> None:
    """``sample(token_budget=K)`` travels to the actor: the longest prefix within K, its metrics."""
    buffer = RemoteReplayBuffer(status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            for uid, tokens in (("a", 60), ("b", 40), ("c", 30)):
                await buffer.put_group(uid, [uid], global_steps=0, tokens=[tokens])
            batch, metrics = await buffer.sample(0, token_budget=100)
            assert batch.uids == ["a", "b"]
            keys = ("training/batch/tokens", "training/batch/fill", "training/batch/oversized_groups")
            assert [metrics[key] for key in keys] == [100.0, 1.0, 0.0]
            await expect(TimeoutError, buffer.sample(0, token_budget=100, timeout=0))  # 30 < 100
            batch, _ = await buffer.sample(0, token_budget=10)  # "c" alone is over 10: it goes
            assert batch.uids == ["c"]
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_bad_versions_tokens_or_start_versions_fail_on_the_client_and_change_nothing(
    remote: RemoteReplayBuffer,
) -> None:
    with anyio.fail_after(STEP_TIMEOUT):
        await remote.add_prompt("run")
        before = await remote.stats()
        calls: list[tuple[Any, type[Exception]]] = [
            (lambda: remote.mark_running("run", version=-1), ValueError),
            (lambda: remote.mark_running("run", version=1.5), TypeError),
            (lambda: remote.put("run", 1, versions=[(0, 0)]), ValueError),
            (lambda: remote.put("run", 1, versions=[(0, 2)], tokens=3), ValueError),
            (lambda: remote.put("run", 1, tokens="2"), TypeError),
            (lambda: remote.put_group("new", [1, 2], tokens=[1]), ValueError),
            (lambda: remote.put_group_nowait("new", [1], versions=[[("a", 1)]]), TypeError),
            (lambda: remote.put_group("new", [1], version=True), TypeError),
        ]
        for call, error in calls:
            with pytest.raises(error):
                await call()
        with pytest.raises(ValueError, match="version"):
            remote.rollout("new", version=-3)  # refused on the call, before entering
        assert await remote.stats() == before  # nothing added, nothing started or put


@pytest.mark.asyncio
async def test_a_remote_restore_can_resume_in_flight_groups_with_their_prefixes(tmp_path: Any) -> None:
    """``RemoteReplayBuffer.restore(in_flight="resume")``: the in-flight group comes back PENDING
    with its prefix (versions, tokens, start version; its payload stored by the new actor) and is
    listed with it; its producer goes on after the prefix; nothing is counted as reissued."""
    config = SamplerConfig(max_off_policy_threshold=2, max_off_policy_strategy="mask")
    buffer = RemoteReplayBuffer(config, status_log_interval=None)
    restored: RemoteReplayBuffer | None = None
    try:
        with anyio.fail_after(2 * STEP_TIMEOUT):
            await buffer.add_prompt("e", global_steps=0)
            await buffer.mark_running("e", version=1)
            await buffer.put("e", "half", versions=[(1, 2), (2, 3)])
            path = tmp_path / "buffer.ckpt"
            await buffer.save(path)
            result = RemoteReplayBuffer.restore(path, in_flight="resume", status_log_interval=None)
            restored = result.buffer
            (group,) = result.reissue
            assert (group.uid, group.status, group.dispatch_step, group.start_version) == (
                "e",
                Status.PENDING,
                0,
                1,
            )
            assert [(t.key, t.versions, t.tokens) for t in group.trajectories] == [
                ("e_0_0", ((1, 2), (2, 3)), 5)
            ]
            assert isinstance(group.trajectories[0].payload, PayloadRef)  # stored by the new actor
            await restored.mark_running("e")  # keeps start version 1
            await restored.put("e", "rest", session_id=1, versions=[(2, 4)])
            await restored.mark_finished("e")
            batch, _ = await restored.sample(2, 1)
            assert (batch.groups[0].start_version, batch.keys) == (1, ["e_0_0", "e_1_0"])
            assert batch.token_versions()[0].tolist() == [1, 1, 2, 2, 2, 2, 2, 2, 2]
            assert (await resolve(batch)).payloads == ["half", "rest"]
            total = (await restored.stats()).total
            assert (total.reissued_groups, total.reissued_tokens) == (0, 0)
            assert (total.admitted_tokens, total.sampled_tokens) == (9, 9)
    finally:
        buffer.kill()
        if restored is not None:
            restored.kill()


# -- filters and task mixtures (issue 23) -----------------------------------------------------------


def keep_unless_first_is_bad(group: Any) -> bool:
    """A filter (pickled by value: this module is registered so) that runs in the actor."""
    return group.trajectories[0].tags.get("bad") is not True


MIXED = SamplerConfig(max_off_policy_threshold=2, admission_batch_size=3, mixture={"a": 2, "b": 1})


def test_filters_that_cannot_run_in_the_actor_are_refused_before_it_starts(tmp_path: Any) -> None:
    lock = threading.Lock()

    def holds_a_lock(group: Any) -> bool:  # a closure over a lock: pickle refuses it
        with lock:
            return True

    async def is_async(group: Any) -> bool:
        return True

    for make_buffer in (
        lambda filters: RemoteReplayBuffer(filters=filters),
        lambda filters: RemoteReplayBuffer.from_config({}, filters=filters),
        lambda filters: RemoteReplayBuffer.restore(tmp_path / "none.ckpt", filters=filters),
    ):
        with pytest.raises(ConfigError, match=r"filters\[1\] cannot be pickled .*run in its actor"):
            make_buffer([keep_unless_first_is_bad, holds_a_lock])
        with pytest.raises(ConfigError, match=r"filters\[0\] is async"):
            make_buffer([is_async])
        with pytest.raises(ConfigError, match="filters must be a sequence"):
            make_buffer(keep_unless_first_is_bad)


@pytest.mark.asyncio
async def test_filters_run_in_the_actor_and_the_filtered_reason_reaches_evictions() -> None:
    buffer = RemoteReplayBuffer(MIXED, status_log_interval=None, filters=[keep_unless_first_is_bad])
    local = ReplayBuffer(MIXED, status_log_interval=None, filters=[keep_unless_first_is_bad])
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            stream = buffer.evictions(from_oldest=True, poll_seconds=1.0)
            for target in (buffer, local):
                for uid, task, bad in (("a0", "a", True), ("a1", "a", False), ("a2", "a", False)):
                    # a0 is filtered at once, so its slot is free again: a2 is admitted without waiting
                    await target.put_group(uid, [uid], tags={"task": task}, trajectory_tags=[{"bad": bad}])
                async with target.rollout("b0", tags={"task": "b"}) as group:
                    await group.put("b0", tags={"bad": True})  # filtered when the block ends
            event = await stream.__anext__()
            assert (event.reason, [g.uid for g in event.groups]) == ("filtered", ["a0"])
            event = await stream.__anext__()
            assert (event.reason, [g.uid for g in event.groups]) == ("filtered", ["b0"])
            stats = await buffer.stats()
            assert stats == local.stats()
            assert (stats.total.evicted_filtered_groups, stats.partitions["train"].tasks["a"].resident) == (
                2,
                2,
            )
            await expect(GroupEvictedError, buffer.put("b0", "late"))  # it says why: filtered
            await buffer.put_group("b1", ["b1"], tags={"task": "b"})
            batch, metrics = await buffer.sample(1, 3)
            assert batch.uids == ["a1", "a2", "b1"]
            assert metrics["training/filter_groups/evicted_samples"] == 2
            assert metrics["training/mixture/b/groups"] == 1
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_flow_queries_and_sampleable_count_take_a_task_like_the_local_buffer() -> None:
    buffer = RemoteReplayBuffer(MIXED, status_log_interval=None)
    local = ReplayBuffer(MIXED, status_log_interval=None)
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            for target in (buffer, local):
                await target.put_group("a0", [1], tags={"task": "a"})
                await target.put_group("a1", [1], tags={"task": "a"})
                await target.put_group("b0", [1], tags={"task": "b"})
            for task in (None, "a", "b"):
                remote = [
                    await buffer.capacity(task=task),
                    await buffer.free_slots(task=task),
                    await buffer.full(task=task),
                    await buffer.sampleable_count(0, task=task),
                ]
                mine = [local.capacity(task=task), local.free_slots(task=task), local.full(task=task)]
                assert remote == [*mine, local.sampleable_count(0, task=task)], task
            assert [await buffer.capacity(task="a"), await buffer.full(task="a"), await buffer.full()] == [
                4,
                True,
                True,
            ]
            assert await buffer.sampleable_count(0, "train", "b") == 1
            await expect(ValueError, buffer.free_slots(task="c"))
            await expect(TypeError, buffer.full(task=3))  # type: ignore[arg-type]
            await expect(ValueError, buffer.sampleable_count(0, "val", "a"))  # exempt: no tasks
    finally:
        buffer.kill()


@pytest.mark.asyncio
async def test_a_remote_restore_takes_the_filters_again_and_keeps_the_mixtures_state(tmp_path: Any) -> None:
    config = attrs.evolve(MIXED, mixture_policy="borrow")
    buffer = RemoteReplayBuffer(config, status_log_interval=None, filters=[keep_unless_first_is_bad])
    path = tmp_path / "mixed.ckpt"
    restored: RemoteReplayBuffer | None = None
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            await buffer.put_group("a0", [1], tags={"task": "a"}, trajectory_tags=[{"bad": True}])
            for uid in ("a1", "a2"):
                await buffer.put_group(uid, [uid], tags={"task": "a"})
            batch, _ = await buffer.sample(0, 2)  # b has none: a lends it its slot, b is owed one
            assert batch.uids == ["a1", "a2"]
            await buffer.save(path)
            before = await buffer.stats()
            assert before.partitions["train"].tasks["b"].balance == 1
            restored, _ = RemoteReplayBuffer.restore(
                path, status_log_interval=None, filters=[keep_unless_first_is_bad]
            )
            assert await restored.stats() == before  # per task, balances and filter counts too
            await restored.put_group("b0", [0], tags={"task": "b"}, trajectory_tags=[{"bad": True}])
            assert (await restored.stats()).total.evicted_filtered_groups == 2  # still filtered
    finally:
        buffer.kill()
        if restored is not None:
            restored.kill()
