"""stalebuf.prometheus: a collector that reads ``stats()`` on scrape, plus sample histograms.

- Every gauge and counter equals its ``stats()`` field, per partition, status and reason, for
  a buffer in which every counter moved; names and types follow Prometheus' conventions.
- The histograms count each ``sample``/``sample_nowait`` once, in the right bucket, per
  partition, and the tap holds no metrics dict past ``FOLD_AT`` unscraped samples.
- Scrapes from other threads are handed to the buffer's loop (asyncio and trio); a loop that
  does not answer in time, a wrong thread, a dead or hanging remote actor give ``up 0``,
  never an exception; a loop that ended frees the buffer again.
- ``unregister`` undoes everything; bad arguments raise before anything is installed.
- A partition name the exposition cannot encode (a lone surrogate, from a remote or custom
  ``stats()``: the local buffer refuses it) is exported escaped, never failing the scrape.

The real-Ray test starts Ray only with STALEBUF_PROMETHEUS_RAY=1 (CI sets it; Ray takes ~10 s
to start, which tests/test_ray.py pays anyway in the same session), else it reuses a Ray
that already runs, else it is skipped. Nothing here asserts on timing.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import attrs
import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.parser import text_string_to_metric_families

from _helpers import LIMIT, make, settle
from stalebuf import BufferStats, PartitionStats, ReplayBuffer, SamplerConfig, Status
from stalebuf.errors import BatchNotReadyError, BufferClosedError, BufferUnavailableError, ConfigError
from stalebuf.metrics import metric_prefix
from stalebuf.prometheus import DEFAULT_STALENESS_BUCKETS, DEFAULT_WAIT_BUCKETS, register
from stalebuf.records import EMPTY_TAGS, new_batch, new_group

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
STATUSES = ("pending", "running", "finished", "failure")
REASONS = ("stale", "failure", "restart")
# (metric, PartitionStats field) for the series labelled by partition alone; written out here
# rather than taken from the module, so that a wrong name or field there fails this test.
PER_PARTITION = (
    ("stalebuf_resident_trajectories", "trajectories"),
    ("stalebuf_waiting_samplers", "waiting_samplers"),
    ("stalebuf_waiting_producers", "waiting_producers"),
    ("stalebuf_admitted_groups_total", "admitted_groups"),
    ("stalebuf_admitted_trajectories_total", "admitted_trajectories"),
    ("stalebuf_sampled_groups_total", "sampled_groups"),
    ("stalebuf_sampled_trajectories_total", "sampled_trajectories"),
    ("stalebuf_evicted_in_flight_groups_total", "evicted_in_flight_groups"),
    ("stalebuf_reissued_groups_total", "reissued_groups"),
    ("stalebuf_reissued_trajectories_total", "reissued_trajectories"),
    ("stalebuf_cut_groups_total", "cut_groups"),
    ("stalebuf_cut_trajectories_total", "cut_trajectories"),
    ("stalebuf_resident_tokens", "tokens"),
    ("stalebuf_admitted_tokens_total", "admitted_tokens"),
    ("stalebuf_sampled_tokens_total", "sampled_tokens"),
    ("stalebuf_masked_tokens_total", "masked_tokens"),
    ("stalebuf_evicted_tokens_total", "evicted_tokens"),
    ("stalebuf_reissued_tokens_total", "reissued_tokens"),
    ("stalebuf_terminal_tokens", "resident_tokens"),
    ("stalebuf_reserved_tokens", "reserved_tokens"),
)


def scrape(registry: CollectorRegistry) -> Samples:
    """Render the registry as Prometheus text, parse it back, return every sample's value."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def expected_from(stats: BufferStats) -> Samples:
    """The gauge and counter samples ``stats`` should produce, written out independently."""
    expected: Samples = {
        ("stalebuf_up", frozenset()): 1.0,
        ("stalebuf_closed", frozenset()): float(stats.closed),
        ("stalebuf_journal_commits_total", frozenset()): stats.journal_commits,
        ("stalebuf_journal_bytes", frozenset()): stats.journal_bytes,
        ("stalebuf_journal_pending_bytes", frozenset()): stats.journal_pending_bytes,
        ("stalebuf_journal_lag_seconds", frozenset()): stats.journal_lag_seconds,
    }
    for partition, item in stats.partitions.items():
        label = ("partition", partition)
        for status in STATUSES:
            key = ("stalebuf_resident_groups", frozenset({label, ("status", status)}))
            expected[key] = getattr(item, status)
        for name, field in PER_PARTITION:
            expected[(name, frozenset({label}))] = getattr(item, field)
        for reason in REASONS:
            labels = frozenset({label, ("reason", reason)})
            expected[("stalebuf_evicted_groups_total", labels)] = getattr(item, f"evicted_{reason}_groups")
            expected[("stalebuf_evicted_trajectories_total", labels)] = getattr(
                item, f"evicted_{reason}_trajectories"
            )
        if item.capacity is not None:
            expected[("stalebuf_capacity_groups", frozenset({label}))] = item.capacity
    return expected


HISTOGRAMS = ("stalebuf_sampled_staleness_versions", "stalebuf_sample_wait_seconds")


def stats_part(samples: Samples) -> Samples:
    """The samples that do not come from the histograms."""
    return {key: value for key, value in samples.items() if not key[0].startswith(HISTOGRAMS)}


def bucket(samples: Samples, histogram: str, partition: str, le: str) -> float:
    return samples[(f"stalebuf_{histogram}_bucket", frozenset({("partition", partition), ("le", le)}))]


def count(samples: Samples, histogram: str, partition: str) -> float:
    return samples[(f"stalebuf_{histogram}_count", frozenset({("partition", partition)}))]


def in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a fresh thread and return its result (the calling thread blocks)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join(LIMIT)
    assert not thread.is_alive(), "the scrape hung"
    return result[0]


# -- what the metrics say ---------------------------------------------------------------------


async def busy_buffer() -> ReplayBuffer:
    """A buffer in which every counter moved: sampled, stale, failed and in-flight evictions,
    restart evictions and reissues (through restore), blocked samplers and producers."""
    config = SamplerConfig(
        max_off_policy_threshold=2,
        failure_strategy="evict",
        evict_stale_in_flight=True,
        admission_batch_size=2,
        exempt_partitions=frozenset({"val"}),
    )
    buffer = ReplayBuffer(config, status_log_interval=None)
    with pytest.raises(BatchNotReadyError):  # the clock to 1: admission refuses a step ahead of it
        buffer.sample_nowait(1, 1)
    buffer.put_group_nowait("old", [1, 2], global_steps=0, tokens=[3, 4])
    buffer.add_prompt_nowait("flying", global_steps=0)
    buffer.mark_running_nowait("flying")
    buffer.put_nowait("flying", 1)
    buffer.put_group_nowait("bad", [1], global_steps=1, status="failure")
    buffer.put_group_nowait("fresh", [1, 2, 3], global_steps=1, versions=[[(1, 2)], None, [(1, 1), (2, 1)]])
    buffer.put_group_nowait("v1", [1], global_steps=0, partition="val")
    buffer.sample_nowait(2, 1)  # fresh; evicts old (stale), flying (stale, in flight), bad (failure)
    buffer.add_prompt_nowait("reissued", global_steps=2)
    buffer.add_prompt_nowait("partial", global_steps=2, partition="val")
    buffer.mark_running_nowait("partial")
    buffer.put_nowait("partial", 7)
    return ReplayBuffer.restore(buffer.checkpoint(), in_flight="reissue").buffer  # both reissued


@pytest.mark.anyio
async def test_every_gauge_and_counter_equals_its_stats_field() -> None:
    buffer = await busy_buffer()
    registry = CollectorRegistry()
    register(buffer, registry)
    buffer.put_group_nowait("now", [1], global_steps=2, tokens=[5])  # fills step 2 (reissued is there too)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(until_closed, buffer.add_prompt("blocked"))  # admission: no slot at step 2
        tasks.start_soon(until_closed, buffer.sample(2, 5))  # 1 ready group: waits
        tasks.start_soon(until_closed, buffer.sample(0, 5, partition="val"))
        await settle()
        stats = buffer.stats()
        samples = stats_part(scrape(registry))
        buffer.close()
    assert stats.total.waiting_producers == 1
    assert stats.total.waiting_samplers == 2
    assert samples == expected_from(stats)
    moved = {field for part in stats.partitions.values() for field, value in vars_of(part).items() if value}
    assert moved >= {"admitted_groups", "sampled_groups", "evicted_stale_groups", "evicted_failure_groups",
                     "evicted_in_flight_groups", "reissued_groups", "reissued_trajectories",
                     "waiting_samplers", "waiting_producers", "pending", "finished", "capacity",
                     "tokens", "resident_tokens"}  # fmt: skip


def vars_of(item: PartitionStats) -> dict[str, Any]:
    return attrs.asdict(item)


async def until_closed(call: Awaitable[Any]) -> None:
    with pytest.raises(BufferClosedError):
        await call


def test_restart_evictions_and_closed_are_exported() -> None:
    buffer = make()
    buffer.add_prompt_nowait("a", global_steps=0)
    buffer.mark_running_nowait("a")
    buffer.put_nowait("a", 1)
    restored = ReplayBuffer.restore(buffer.checkpoint(), in_flight="evict").buffer
    registry = CollectorRegistry()
    register(restored, registry)
    restored.close()
    stats = restored.stats()
    samples = stats_part(scrape(registry))
    assert samples == expected_from(stats)
    restart = frozenset({("partition", "train"), ("reason", "restart")})
    assert samples[("stalebuf_evicted_groups_total", restart)] == 1
    assert samples[("stalebuf_evicted_trajectories_total", restart)] == 1
    assert samples[("stalebuf_closed", frozenset())] == 1


def test_names_types_and_labels_follow_prometheus_conventions() -> None:
    buffer = make(admission_batch_size=1)
    registry = CollectorRegistry()
    register(buffer, registry)
    buffer.put_group_nowait("a", [1], global_steps=0)
    buffer.sample_nowait(0, 1)
    text = generate_latest(registry).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    counters = {name for name, family in families.items() if family.type == "counter"}
    assert counters == {
        "stalebuf_admitted_groups", "stalebuf_admitted_trajectories", "stalebuf_sampled_groups",
        "stalebuf_sampled_trajectories", "stalebuf_evicted_groups", "stalebuf_evicted_trajectories",
        "stalebuf_evicted_in_flight_groups", "stalebuf_reissued_groups", "stalebuf_reissued_trajectories",
        "stalebuf_cut_groups", "stalebuf_cut_trajectories", "stalebuf_admitted_tokens",
        "stalebuf_sampled_tokens", "stalebuf_masked_tokens", "stalebuf_evicted_tokens",
        "stalebuf_reissued_tokens", "stalebuf_journal_commits",
    }  # fmt: skip
    for name in counters:
        assert all(sample.name == f"{name}_total" for sample in families[name].samples)
    histograms = {name for name, family in families.items() if family.type == "histogram"}
    assert histograms == {"stalebuf_sampled_staleness_versions", "stalebuf_sample_wait_seconds"}
    labels = {name: {key for s in family.samples for key in s.labels} for name, family in families.items()}
    assert labels["stalebuf_resident_groups"] == {"partition", "status"}
    assert labels["stalebuf_evicted_groups"] == {"partition", "reason"}
    assert labels["stalebuf_up"] == set()
    assert labels["stalebuf_sample_wait_seconds"] == {"partition", "le"}


def test_a_namespace_prefixes_every_name_so_two_buffers_share_a_registry() -> None:
    registry = CollectorRegistry()
    register(make(), registry)
    register(make(), registry, namespace="val_buffer")
    names = {name for name, _ in scrape(registry)}
    assert {name.split("_")[0] for name in names} == {"stalebuf", "val"}
    assert ("val_buffer_up", frozenset()) in scrape(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        register(make(), registry)


# -- histograms -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_each_sample_call_is_one_observation_in_its_partition_and_bucket() -> None:
    buffer = make(max_off_policy_threshold=8)
    registry = CollectorRegistry()
    register(buffer, registry, staleness_buckets=[1, 2, 4], wait_buckets=[0.5, 1000.0])
    buffer.put_group_nowait("a", [1], global_steps=0)
    buffer.put_group_nowait("b", [1], global_steps=0)
    await buffer.sample(0, 1)  # staleness 1
    buffer.sample_nowait(2, 1)  # staleness 3
    buffer.put_group_nowait("v", [1], global_steps=0, partition="val")
    buffer.sample_nowait(1, 1, partition="val")  # staleness 2, "validation/..." metric names

    async def late_put() -> None:
        await anyio.sleep(0.01)
        buffer.put_group_nowait("c", [1], global_steps=4)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(late_put)
        _, metrics = await buffer.sample(4, 1)  # staleness 1, after a real wait
    samples = scrape(registry)
    staleness = [
        bucket(samples, "sampled_staleness_versions", "train", le) for le in ("1.0", "2.0", "4.0", "+Inf")
    ]
    assert staleness == [2, 2, 3, 3]
    assert samples[("stalebuf_sampled_staleness_versions_sum", frozenset({("partition", "train")}))] == 5
    assert [bucket(samples, "sampled_staleness_versions", "val", le) for le in ("1.0", "2.0", "+Inf")] == [
        0,
        1,
        1,
    ]
    assert count(samples, "sample_wait_seconds", "train") == 3
    assert bucket(samples, "sample_wait_seconds", "train", "0.5") + 1 >= 3  # at most the waiting one is slow
    wait_sum = samples[("stalebuf_sample_wait_seconds_sum", frozenset({("partition", "train")}))]
    assert wait_sum == pytest.approx(metrics["training/off_policy/wait_seconds"])
    assert wait_sum > 0
    assert (
        count(scrape(registry), "sampled_staleness_versions", "train") == 3
    )  # a second scrape counts nothing twice


def test_the_staleness_histogram_observes_each_group_so_the_worst_one_shows() -> None:
    """Issue 26 item 6: ``stalebuf_sample_staleness`` observed each call's mean staleness, so a
    batch of staleness 1, 1, 1 and 9 read as one observation of 3 and the 9 was invisible."""
    buffer = make(max_off_policy_threshold=100, parameter_sync_step=2)
    registry = CollectorRegistry()
    register(buffer, registry, staleness_buckets=[1, 2, 4])
    buffer.put_group_nowait("old", [1], global_steps=0)
    for uid in "abc":
        buffer.put_group_nowait(uid, [1], global_steps=8)
    _, metrics = buffer.sample_nowait(8, 4)  # ages 9, 1, 1, 1: staleness 4.5, 0.5, 0.5, 0.5 (S = 2)
    assert metrics["training/off_policy/sampled_staleness/max"] == 4.5
    samples = scrape(registry)
    assert [
        bucket(samples, "sampled_staleness_versions", "train", le) for le in ("1.0", "2.0", "4.0", "+Inf")
    ] == [
        3,
        3,
        3,
        4,
    ]
    assert count(samples, "sampled_staleness_versions", "train") == 4  # groups, not calls
    assert samples[("stalebuf_sampled_staleness_versions_sum", frozenset({("partition", "train")}))] == 6
    assert count(samples, "sample_wait_seconds", "train") == 1  # the wait is per call


def test_the_tap_keeps_no_sampled_group_alive() -> None:
    """The rows hold dispatch steps, never the groups: an unscraped tap must not pin payloads."""
    buffer = make()
    registry = CollectorRegistry()
    register(buffer, registry)
    payload = [0] * 10
    buffer.put_group_nowait("a", [payload])
    held = sys.getrefcount(payload)
    batch, _ = buffer.sample_nowait(0, 1)
    del batch
    gc.collect()
    assert sys.getrefcount(payload) < held, "the tap keeps the sampled group's payload"
    assert count(scrape(registry), "sampled_staleness_versions", "train") == 1


def test_capacity_is_omitted_without_admission_control_and_units_are_declared() -> None:
    """Issue 26 item 6: ``stalebuf_capacity_groups`` was an empty family without admission control;
    the histograms declare their units (OpenMetrics ``# UNIT``)."""
    plain, gated = CollectorRegistry(), CollectorRegistry()
    register(make(), plain)
    buffer = make(admission_batch_size=2)
    register(buffer, gated)
    buffer.put_group_nowait("a", [1])
    assert "capacity_groups" not in generate_latest(plain).decode()
    capacity = scrape(gated)[("stalebuf_capacity_groups", frozenset({("partition", "train")}))]
    assert capacity == buffer.capacity() == 16  # T * S * b = 8 * 1 * 2
    text = openmetrics_latest(gated).decode()
    assert "# UNIT stalebuf_sampled_staleness_versions versions" in text
    assert "# UNIT stalebuf_sample_wait_seconds seconds" in text


def test_a_sample_that_raises_is_not_observed() -> None:
    buffer = make()
    registry = CollectorRegistry()
    register(buffer, registry)
    with pytest.raises(BatchNotReadyError):
        buffer.sample_nowait(0, 1)
    names = {name for name, _ in scrape(registry)}
    assert not {name for name in names if name.startswith(HISTOGRAMS)}


def test_unscraped_samples_are_binned_on_the_way_and_no_metrics_dict_is_kept_for_long() -> None:
    calls = 4096  # the module bins every 512 unscraped samples
    buffer = make(max_off_policy_threshold=10**6)
    registry = CollectorRegistry()
    register(buffer, registry)
    for i in range(calls + 1):
        buffer.put_group_nowait(f"g{i}", [1], global_steps=0)
    _, first = buffer.sample_nowait(0, 1)
    held = sys.getrefcount(first)  # ours, getrefcount's argument, and the tap's pending list
    for _ in range(calls):
        buffer.sample_nowait(0, 1)
    assert sys.getrefcount(first) == held - 1, "the tap still holds the first call's metrics"
    assert count(scrape(registry), "sampled_staleness_versions", "train") == calls + 1


# -- reading stats from other threads ---------------------------------------------------------


@pytest.mark.anyio
async def test_a_scrape_from_another_thread_is_handed_to_the_buffers_loop() -> None:
    buffer = make()
    registry = CollectorRegistry()
    register(buffer, registry)  # inside the loop: it remembers it
    buffer.threadsafe()  # binds the buffer: a direct stats() from another thread would raise
    buffer.put_group_nowait("a", [1, 2], global_steps=0)
    samples = await anyio.to_thread.run_sync(scrape, registry)
    assert stats_part(samples) == expected_from(buffer.stats())


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_registered_outside_the_loop_a_scrape_from_another_thread_gives_up_0(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    buffer = make()
    registry = CollectorRegistry()
    register(buffer, registry)  # no loop runs yet: nothing to hand reads to

    async def main() -> tuple[Samples, Samples, Samples]:
        buffer.threadsafe()
        first = await anyio.to_thread.run_sync(scrape, registry)
        second = await anyio.to_thread.run_sync(scrape, registry)
        return first, second, scrape(registry)  # the loop's own thread reads directly

    with caplog.at_level(logging.INFO, logger="stalebuf.prometheus"):
        first, second, on_loop = anyio.run(main, backend=backend)
    assert first[("stalebuf_up", frozenset())] == 0
    assert ("stalebuf_closed", frozenset()) not in first
    assert second[("stalebuf_up", frozenset())] == 0
    assert on_loop[("stalebuf_up", frozenset())] == 1
    messages = [record.getMessage() for record in caplog.records]
    assert len([m for m in messages if "WrongThreadError" in m]) == 1, messages  # once, not per scrape
    assert any("works again" in m for m in messages)


@pytest.mark.anyio
async def test_a_loop_that_does_not_run_the_read_in_time_gives_up_0_then_recovers() -> None:
    buffer = make()
    registry = CollectorRegistry()
    register(buffer, registry, timeout=0.05)
    buffer.threadsafe()
    blocked = in_thread(lambda: scrape(registry))  # this loop's thread is blocked in join()
    await anyio.lowlevel.checkpoint()  # the abandoned read now runs on the loop, and does nothing
    assert blocked[("stalebuf_up", frozenset())] == 0
    later = await anyio.to_thread.run_sync(scrape, registry)
    assert later[("stalebuf_up", frozenset())] == 1


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_after_the_loop_ended_a_scrape_from_any_thread_reads_directly(backend: str) -> None:
    buffer = make()
    registry = CollectorRegistry()

    async def main() -> None:
        register(buffer, registry)
        buffer.threadsafe()
        buffer.put_group_nowait("a", [1], global_steps=0)

    anyio.run(main, backend=backend)
    samples = in_thread(lambda: scrape(registry))
    assert stats_part(samples) == expected_from(buffer.stats())


# -- remote buffers (anything with an async stats()) -------------------------------------------


class FakeRemote:
    """A buffer of another library, shaped like a RemoteReplayBuffer (async ``stats`` and ``sample``, no
    ``sample_nowait``) but without ``observe_samples``: the collector falls back to wrapping ``sample``."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats
        self.calls = 0

    async def stats(self) -> Any:
        self.calls += 1
        return await self._stats()

    async def sample(
        self, global_steps: int, batch_size: int, *, partition: str = "train", timeout: float | None = None
    ) -> Any:
        prefix = metric_prefix(partition)  # what a real buffer names them: "training" or "validation"
        metrics = {
            f"{prefix}/off_policy/sampled_staleness/mean": 2.0,
            f"{prefix}/off_policy/wait_seconds": 0.25,
        }
        group = new_group(
            "g", partition, global_steps - 1, Status.FINISHED, EMPTY_TAGS, (), global_steps, 0.0
        )
        return new_batch(partition, global_steps, (group,), 1), metrics  # its staleness: 2


async def some_stats() -> BufferStats:
    part = PartitionStats(finished=3, trajectories=6, admitted_groups=5, sampled_groups=2)
    return BufferStats(closed=False, partitions={"train": part}, total=part)


async def dead_actor() -> BufferStats:
    raise BufferUnavailableError("the buffer actor 'x' is unavailable: it died")


async def hanging_actor() -> BufferStats:
    await asyncio.sleep(LIMIT * 10)
    raise AssertionError("unreachable")


async def wrong_answer() -> Any:
    return {"not": "stats"}


def test_a_remote_buffer_is_read_through_its_async_stats_and_its_samples_are_observed() -> None:
    remote = FakeRemote(some_stats)
    registry = CollectorRegistry()
    register(remote, registry)
    assert remote.calls == 0, "registering must not read (describe() names the metrics)"
    asyncio.run(remote.sample(3, 1))
    samples = in_thread(lambda: scrape(registry))
    assert stats_part(samples) == expected_from(asyncio.run(some_stats()))
    assert bucket(samples, "sampled_staleness_versions", "train", "2.0") == 1
    assert bucket(samples, "sample_wait_seconds", "train", "0.1") == 0
    assert bucket(samples, "sample_wait_seconds", "train", "0.5") == 1


@pytest.mark.parametrize("actor", [dead_actor, hanging_actor, wrong_answer], ids=lambda f: f.__name__)
def test_a_dead_hanging_or_wrong_remote_gives_up_0_not_an_exception(actor: Callable[[], Any]) -> None:
    registry = CollectorRegistry()
    register(FakeRemote(actor), registry, timeout=0.05)
    samples = in_thread(lambda: scrape(registry))
    assert samples[("stalebuf_up", frozenset())] == 0
    assert set(stats_part(samples)) == {("stalebuf_up", frozenset())}


def test_a_remote_scrape_from_inside_a_running_asyncio_loop_works() -> None:
    registry = CollectorRegistry()
    register(FakeRemote(some_stats), registry)

    async def main() -> Samples:
        return scrape(registry)  # asyncio.run cannot nest: the read goes to a helper thread

    assert asyncio.run(main())[("stalebuf_up", frozenset())] == 1


# -- partition names the exposition cannot encode (issue 21, item 5) ---------------------------
SURROGATE = "\udcff"  # a lone surrogate: str.encode("utf-8") raises


def stats_of(*names: Any) -> Callable[[], Awaitable[BufferStats]]:
    """An ``async def stats()`` whose partitions are ``names``, the i-th holding i+1 finished groups."""
    parts = {name: PartitionStats(finished=i + 1, admitted_groups=i + 1) for i, name in enumerate(names)}

    async def stats() -> BufferStats:
        return BufferStats(closed=False, partitions=parts, total=PartitionStats())

    return stats


def finished(samples: Samples, partition: str) -> float:
    labels = frozenset({("partition", partition), ("status", "finished")})
    return samples[("stalebuf_resident_groups", labels)]


def test_a_partition_name_utf8_cannot_encode_is_exported_escaped_and_the_scrape_succeeds() -> None:
    """Issue 21 item 5: a partition named "\\udcff" made every scrape raise UnicodeEncodeError.

    Names come from a remote buffer here: the local one refuses such names since this fix.
    """
    remote = FakeRemote(stats_of("train", SURROGATE, "a\ud800b"))
    registry = CollectorRegistry()
    register(remote, registry)
    asyncio.run(remote.sample(3, 1, partition=SURROGATE))  # a histogram series for it too
    for _ in range(2):  # not just the first scrape
        samples = in_thread(lambda: scrape(registry))
        assert samples[("stalebuf_up", frozenset())] == 1
        assert finished(samples, "train") == 1
        assert finished(samples, "\\udcff") == 2  # backslashreplace: the 6 characters \udcff
        assert finished(samples, "a\\ud800b") == 3
        assert count(samples, "sampled_staleness_versions", "\\udcff") == 1


def test_a_local_buffer_refuses_the_name_so_it_never_reaches_a_scrape() -> None:
    """Issue 21 item 5: ``put_group(partition="\\udcff")`` was admitted, then every scrape of the
    buffer raised UnicodeEncodeError; the name is now refused at the source."""
    buffer = make()
    registry = CollectorRegistry()
    register(buffer, registry)
    for call in (
        lambda: buffer.put_group_nowait("a", [1], partition=SURROGATE),
        lambda: buffer.add_prompt_nowait("b", partition="x" + SURROGATE),
        lambda: buffer.sample_nowait(0, 1, partition=SURROGATE),
    ):
        with pytest.raises(ValueError, match="UTF-8"):
            call()
    assert buffer.stats().partitions == {}
    assert scrape(registry)[("stalebuf_up", frozenset())] == 1


def test_an_escaped_name_that_another_partition_has_is_dropped_not_duplicated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 21 item 5: escaping must not make two series with the same labels (a partition
    whose real name is the escaped spelling keeps it; the unencodable one is left out), and a
    non-str name (which also failed the scrape) is shown by its description."""
    registry = CollectorRegistry()
    register(FakeRemote(stats_of("\\udcff", SURROGATE, 7)), registry)
    with caplog.at_level(logging.WARNING, logger="stalebuf.prometheus"):
        text = in_thread(lambda: generate_latest(registry).decode())
    lines = [line for line in text.splitlines() if line.startswith("stalebuf_resident_groups{")]
    assert len(lines) == len(set(lines)) == 2 * len(STATUSES), lines  # "\\udcff" and "7"
    samples = scrape(registry)
    assert finished(samples, "\\udcff") == 1, "the partition really named \\udcff keeps its series"
    assert finished(samples, "7") == 3, "a non-str name (a custom stats()) is shown by its description"
    assert "is not exported" in caplog.text


@pytest.fixture(scope="session")
def ray_running() -> Iterator[Any]:
    """A Ray for the real-actor test: the session's, or one started here if asked to."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        if os.environ.get("STALEBUF_PROMETHEUS_RAY") != "1":
            pytest.skip("Ray is not running; set STALEBUF_PROMETHEUS_RAY=1 to start it (about 10 s)")
        # The settings of tests/test_ray.py, whose session fixture then reuses this instance.
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        started = True
    yield ray
    if started:
        ray.shutdown()


def test_a_real_remote_buffer_is_exported_and_a_killed_actor_gives_up_0(ray_running: Any) -> None:
    from stalebuf.ray import RemoteReplayBuffer

    async def main() -> tuple[Samples, BufferStats, Samples]:
        remote = RemoteReplayBuffer(status_log_interval=None)
        registry = CollectorRegistry()
        register(remote, registry, timeout=5.0)
        await remote.put_group("a", [1, 2], global_steps=0)
        await remote.put_group("b", [1], global_steps=0)
        await remote.sample(0, 1)
        alive = await anyio.to_thread.run_sync(scrape, registry)
        stats = await remote.stats()
        remote.kill()
        dead = await anyio.to_thread.run_sync(scrape, registry)
        return alive, stats, dead

    alive, stats, dead = asyncio.run(main())
    assert stats_part(alive) == expected_from(stats)
    assert count(alive, "sampled_staleness_versions", "train") == 1
    assert dead[("stalebuf_up", frozenset())] == 0


# -- installing and removing ------------------------------------------------------------------


def test_unregister_removes_the_collector_and_stops_observing() -> None:
    """The collector subscribes through ``observe_samples``: it replaces no method on the
    buffer, and unregistering stops its histograms from counting (architecture, round 2)."""
    buffer = make()
    registry = CollectorRegistry()
    collector = register(buffer, registry)
    assert "sample" not in vars(buffer)
    assert "sample_nowait" not in vars(buffer)
    buffer.put_group_nowait("g", [1], global_steps=0)
    buffer.sample_nowait(0, 1)
    assert (
        scrape(registry)[("stalebuf_sampled_staleness_versions_count", frozenset({("partition", "train")}))]
        == 1
    )
    collector.unregister()
    collector.unregister()  # idempotent
    assert scrape(registry) == {}
    buffer.put_group_nowait("h", [1], global_steps=0)
    buffer.sample_nowait(0, 1)  # no observer left to feed
    assert "sample_nowait" not in vars(buffer)


def test_two_collectors_on_one_buffer_both_observe_and_unwind_in_any_order() -> None:
    buffer = make()
    registry = CollectorRegistry()
    first = register(buffer, registry, namespace="a")
    second = register(buffer, registry, namespace="b")
    buffer.put_group_nowait("g", [1], global_steps=0)
    buffer.sample_nowait(0, 1)
    samples = scrape(registry)
    for namespace in ("a", "b"):
        assert (
            samples[(f"{namespace}_sampled_staleness_versions_count", frozenset({("partition", "train")}))]
            == 1
        )
    first.unregister()  # the first one out: the second still observes
    buffer.put_group_nowait("h", [1], global_steps=0)
    buffer.sample_nowait(0, 1)
    assert scrape(registry)[("b_sampled_staleness_versions_count", frozenset({("partition", "train")}))] == 2
    second.unregister()
    assert scrape(registry) == {}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"namespace": ""}, "namespace"),
        ({"namespace": "9lives"}, "namespace"),
        ({"namespace": 3}, "namespace"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"timeout": math.nan}, "timeout"),
        ({"timeout": math.inf}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"timeout": 10**400}, "timeout"),
        ({"staleness_buckets": []}, "staleness_buckets"),
        ({"staleness_buckets": [2, 1]}, "staleness_buckets"),
        ({"staleness_buckets": [1, 1]}, "staleness_buckets"),
        ({"wait_buckets": [0.1, math.inf]}, "wait_buckets"),
        ({"wait_buckets": "0.1"}, "wait_buckets"),
        ({"wait_buckets": [False, 1]}, "wait_buckets"),
    ],
)
def test_bad_options_raise_config_error_and_install_nothing(options: dict[str, Any], message: str) -> None:
    buffer = make()
    registry = CollectorRegistry()
    with pytest.raises(ConfigError, match=message):
        register(buffer, registry, **options)
    assert "sample" not in vars(buffer)
    assert scrape(registry) == {}


def test_a_buffer_of_another_kind_raises_type_error() -> None:
    with pytest.raises(TypeError, match="RemoteReplayBuffer"):
        register(object(), CollectorRegistry())


def test_a_clash_in_the_registry_installs_nothing_on_the_buffer() -> None:
    registry = CollectorRegistry()
    register(make(), registry)
    buffer = make()
    with pytest.raises(ValueError, match="Duplicated"):
        register(buffer, registry)
    assert "sample" not in vars(buffer)


def test_the_default_buckets_are_increasing() -> None:
    for bounds in (DEFAULT_STALENESS_BUCKETS, DEFAULT_WAIT_BUCKETS):
        assert list(bounds) == sorted(set(bounds))
