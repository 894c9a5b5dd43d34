"""Checkpoints of buffers with task mixtures and group filters (issue 23): each task's cell, the
ledger of selection and the filters' ledger survive a restore exactly (as a value, a pickle file
and a codec file), in every ``in_flight`` mode; what no live buffer could hold is refused, naming
the field; and a buffer with neither writes what it wrote before them."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

import stalebuf._checkpoint_codec as codec_module
from _helpers import assert_conserved
from stalebuf import CheckpointError, Group, ReplayBuffer, SamplerConfig
from stalebuf.checkpoint import (
    FILTER_COUNTERS,
    BufferCheckpoint,
    PartitionCheckpoint,
    TaskCheckpoint,
)

CODEC = (lambda payload: json.dumps(payload).encode(), lambda data: json.loads(data))


def rejects_zero(group: Group) -> bool:
    """Keep a group unless its first payload is 0."""
    return group.trajectories[0].payload != 0


def raises_on_x(group: Group) -> bool:
    """Raise on groups whose uid starts with x (kept: filters fail open)."""
    if group.uid.startswith("x"):
        raise RuntimeError("boom")
    return True


FILTERS = [raises_on_x, rejects_zero]


def mixed(policy: str = "borrow", **config: Any) -> ReplayBuffer:
    """A buffer under a mixture (a:2, b:1, b's T 3) with filters, through a few batches: a
    balance that is not 0 (borrow), a shares window, filtered groups and filter errors, one of
    each since the last batch, groups in flight in both tasks (one RUNNING with a trajectory)."""
    options: dict[str, Any] = {"max_off_policy_threshold": 2, "mixture": {"a": 2, "b": 1}}
    options.update(mixture_policy=policy, task_thresholds={"b": 3}, **config)
    buf = ReplayBuffer(SamplerConfig(**options), filters=FILTERS, status_log_interval=None)

    async def run() -> None:
        for i in range(6):
            await buf.put_group(f"a{i}", [i % 3, 1], tags={"task": "a"})
        await buf.put_group("b0", [1], tags={"task": "b"})
        await buf.sample(0, 3)
        # A filter error (kept): under borrow in task a, so that b is short and borrows.
        borrows = policy == "borrow"
        await buf.put_group("xa6" if borrows else "xb1", [5], tags={"task": "a" if borrows else "b"})
        await buf.sample(1, 3)
        await buf.put_group("b2", [0], tags={"task": "b"})  # filtered since the last batch
        await buf.put_group("xa9", [2], tags={"task": "a"})  # an error since the last batch
        buf.add_prompt_nowait("a7", tags={"task": "a"})
        buf.mark_running_nowait("a7")
        buf.put_nowait("a7", 3)
        buf.add_prompt_nowait("b8", tags={"task": "b"})
        buf.put_group_nowait("v0", [1], partition="val")  # exempt: no cells, never filtered

    anyio.run(run)
    return buf


def train(ckpt: BufferCheckpoint) -> PartitionCheckpoint:
    return next(saved for saved in ckpt.partitions if saved.name == "train")


def next_batch(buf: ReplayBuffer) -> tuple[list[str], dict[str, float]]:
    """The next batch's uids and metrics (wall-clock ones left out) after the same refill."""

    async def run() -> tuple[list[str], dict[str, float]]:
        buf.mark_finished_nowait("a7")
        buf.put_nowait("b8", 4)
        buf.mark_finished_nowait("b8")
        batch, metrics = await buf.sample(2, 3)
        return batch.uids, {key: value for key, value in metrics.items() if "seconds" not in key}

    return anyio.run(run)


@pytest.mark.parametrize("policy", ["wait", "borrow"])
def test_the_saved_state_of_a_mixture_and_filters(policy: str) -> None:
    buf = mixed(policy)
    saved = train(buf.checkpoint())
    assert saved.mixture is not None
    assert saved.filters is not None
    assert saved.generation == ()  # a mixture's cells keep their own
    tasks = {task.name: task for task in saved.mixture.tasks}
    assert set(tasks) == {"a", "b"}
    stats = buf.stats().partitions["train"]
    for name, task in tasks.items():  # each task's counters are its cell's
        assert task.counters["sampled_groups"] == stats.tasks[name].sampled
        assert task.balance == stats.tasks[name].balance
    assert {key: sum(task.counters[key] for task in tasks.values()) for key in saved.counters} == dict(
        saved.counters
    )
    assert saved.counters["admitted_groups"] == stats.admitted_groups > 0
    assert saved.counters["evicted_filtered_groups"] == stats.evicted_filtered_groups == 3
    assert (saved.filters.errors, saved.filters.recent_filtered, saved.filters.recent_errors) == (2, 1, 1)
    assert len(saved.filters.verdicts) == 10
    assert saved.mixture.batch_size == 3
    assert len(saved.mixture.shares) == 6
    assert any(task.balance for task in tasks.values()) is (policy == "borrow")
    assert train(buf.checkpoint()) == saved  # reading the ledgers changed nothing
    val = next(p for p in buf.checkpoint().partitions if p.name == "val")
    assert (val.mixture, val.filters) == (None, None)  # exempt: no cells, never filtered


def restored_from(buf: ReplayBuffer, form: str, tmp_path: Path, **options: Any) -> ReplayBuffer:
    """``buf`` restored from its checkpoint as a value, a pickle file or a codec file."""
    if form == "value":
        return ReplayBuffer.restore(buf.checkpoint(), **options).buffer
    path = tmp_path / "buffer.ckpt"
    codec = CODEC if form == "codec" else None
    anyio.run(lambda: buf.save(path, payload_codec=codec))
    return ReplayBuffer.restore(path, payload_codec=codec, **options).buffer


@pytest.mark.parametrize("form", ["value", "pickle", "codec"])
@pytest.mark.parametrize("policy", ["wait", "borrow"])
def test_a_restored_mixture_with_filters_goes_on_exactly(policy: str, form: str, tmp_path: Path) -> None:
    buf = mixed(policy)
    restored = restored_from(buf, form, tmp_path, in_flight="keep", filters=FILTERS)
    assert restored.stats() == buf.stats()  # per task too
    assert train(restored.checkpoint()) == train(buf.checkpoint())  # growth and shares too
    assert next_batch(restored) == next_batch(buf)
    assert restored.stats() == buf.stats()
    assert_conserved(restored)


@pytest.mark.parametrize("mode", ["reissue", "resume", "evict"])
def test_in_flight_groups_come_back_in_their_tasks_cells(mode: str) -> None:
    buf = mixed()
    events: list[Any] = []
    result = ReplayBuffer.restore(buf.checkpoint(), in_flight=mode, filters=FILTERS, on_evict=events.append)
    before, after = buf.stats().partitions["train"], result.buffer.stats().partitions["train"]
    ckpt = result.buffer.checkpoint()
    cells = {task.name: task.counters for task in train(ckpt).mixture.tasks}  # type: ignore[union-attr]
    if mode == "evict":
        assert [(event.reason, [group.uid for group in event.groups]) for event in events] == [
            ("restart", ["a7", "b8"])
        ]
        assert (cells["a"]["evicted_restart_groups"], cells["b"]["evicted_restart_groups"]) == (1, 1)
        assert cells["a"]["evicted_restart_trajectories"] == 1
        assert after.tasks["a"].resident == before.tasks["a"].resident - 1
    else:
        assert [group.uid for group in result.reissue] == ["a7", "b8"]
        assert after.tasks == before.tasks
        reissued = 1 if mode == "reissue" else 0
        assert (cells["a"]["reissued_groups"], cells["b"]["reissued_groups"]) == (reissued, reissued)
        assert cells["a"]["reissued_trajectories"] == reissued
    assert_conserved(result.buffer)
    # The in-flight groups are in their cells: finishing them fills their tasks' quotas.
    if mode != "evict":
        if mode == "reissue":
            result.buffer.put_nowait("a7", 3)
        uids, _ = next_batch(result.buffer)
        assert uids == next_batch(buf)[0]


def test_restore_without_the_filters_keeps_their_ledger_but_filters_nothing() -> None:
    buf = mixed()
    restored = ReplayBuffer.restore(buf.checkpoint(), in_flight="keep").buffer
    assert restored.stats() == buf.stats()  # filter_errors and evicted_filtered_* included
    uids, metrics = next_batch(restored)
    assert not any("filter_groups" in key for key in metrics)
    assert train(restored.checkpoint()).filters == train(buf.checkpoint()).filters
    assert uids == next_batch(buf)[0]


def test_a_buffer_without_mixture_or_filters_writes_what_it_wrote_before(tmp_path: Path) -> None:
    buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=2), status_log_interval=None)
    buf.put_group_nowait("g0", [1, 2])
    saved = train(buf.checkpoint())
    assert (saved.mixture, saved.filters) == (None, None)
    assert len(saved.__reduce__()[1]) == 4  # an older reader's constructor takes these
    assert not set(FILTER_COUNTERS) & set(codec_module.written_counters(saved.counters))
    assert len(codec_module._partition_row(saved)) == 4  # a row an older reader reads
    path = tmp_path / "plain.ckpt"
    anyio.run(lambda: buf.save(path, payload_codec=CODEC))
    assert ReplayBuffer.restore(path, payload_codec=CODEC).buffer.stats() == buf.stats()


def test_the_new_values_are_frozen_and_pickle() -> None:
    saved = train(mixed().checkpoint())
    assert pickle.loads(pickle.dumps(saved, protocol=5)) == saved
    with pytest.raises(TypeError):
        saved.mixture.tasks[0].counters["sampled_groups"] = 0  # type: ignore[index, union-attr]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        saved.filters.errors = 0  # type: ignore[misc, union-attr]


# -- what restore refuses -------------------------------------------------------------------------


def with_train(ckpt: BufferCheckpoint, **changes: Any) -> BufferCheckpoint:
    """``ckpt`` with its train partition's fields changed."""
    partitions = tuple(attrs.evolve(p, **changes) if p.name == "train" else p for p in ckpt.partitions)
    return attrs.evolve(ckpt, partitions=partitions)


def with_mixture(ckpt: BufferCheckpoint, **changes: Any) -> BufferCheckpoint:
    return with_train(ckpt, mixture=attrs.evolve(train(ckpt).mixture, **changes))  # type: ignore[misc]


def with_task(ckpt: BufferCheckpoint, which: str, **changes: Any) -> BufferCheckpoint:
    mixture = train(ckpt).mixture
    assert mixture is not None
    tasks = tuple(attrs.evolve(t, **changes) if t.name == which else t for t in mixture.tasks)
    return with_mixture(ckpt, tasks=tasks)


def with_filters(ckpt: BufferCheckpoint, **changes: Any) -> BufferCheckpoint:
    return with_train(ckpt, filters=attrs.evolve(train(ckpt).filters, **changes))  # type: ignore[misc]


def task(ckpt: BufferCheckpoint, name: str) -> TaskCheckpoint:
    return next(t for t in train(ckpt).mixture.tasks if t.name == name)  # type: ignore[union-attr]


def moved(ckpt: BufferCheckpoint, key: str, amount: int) -> BufferCheckpoint:
    """``ckpt`` with ``amount`` of task a's counter ``key`` moved to task b (the sum is kept)."""
    a, b = task(ckpt, "a").counters, task(ckpt, "b").counters
    ckpt = with_task(ckpt, "a", counters={**a, key: a[key] - amount})
    return with_task(ckpt, "b", counters={**b, key: b[key] + amount})


def more(ckpt: BufferCheckpoint, key: str) -> BufferCheckpoint:
    """``ckpt`` with one more of the train partition's counter ``key``."""
    counters = train(ckpt).counters
    return with_train(ckpt, counters={**counters, key: counters[key] + 1})


BAD: list[tuple[str, Callable[[BufferCheckpoint], BufferCheckpoint], str]] = [
    (
        "mixture type",
        lambda c: with_train(c, mixture=(1,)),
        "partitions[0].mixture must be a MixtureCheckpoint",
    ),
    ("a task twice", lambda c: with_mixture(c, tasks=(task(c, "a"), task(c, "a"))), "tasks[1].name"),
    ("a task missing", lambda c: with_mixture(c, tasks=(task(c, "a"),)), "lack the task 'b'"),
    ("an unknown task", lambda c: with_task(c, "b", name="c"), "tasks[1].name"),
    ("a task record", lambda c: with_mixture(c, tasks=(task(c, "a"), 3)), "must be a TaskCheckpoint"),
    ("an unknown counter", lambda c: with_task(c, "a", counters={"nope": 1}), "unknown counter 'nope'"),
    ("a negative counter", lambda c: with_task(c, "a", counters={"sampled_groups": -1}), "tasks[0].counters"),
    ("a bool balance", lambda c: with_task(c, "a", balance=True), "tasks[0].balance"),
    ("balances off 0", lambda c: with_task(c, "a", balance=task(c, "a").balance + 1), "do not sum to 0"),
    ("negative growth", lambda c: with_task(c, "a", growth=-1), "tasks[0].growth"),
    ("task generation", lambda c: with_task(c, "a", generation=(-1.0,)), "tasks[0].generation[0]"),
    ("a share", lambda c: with_mixture(c, shares=("a", "z")), "shares[1] must be a task"),
    ("too many shares", lambda c: with_mixture(c, shares=("a",) * 257), "holds 257 tasks"),
    ("batch size", lambda c: with_mixture(c, batch_size=0), "batch_size must be an int >= 1"),
    ("parent times", lambda c: with_train(c, generation=(1.0,)), "generation must be empty under a task"),
    (
        "task sums",
        lambda c: with_task(c, "a", counters={**task(c, "a").counters, "cut_groups": 1}),
        "cut_groups",
    ),
    (
        "task conservation",
        lambda c: moved(c, "sampled_groups", 1),
        "tasks[0].counters do not conserve groups",
    ),
    ("filter type", lambda c: with_train(c, filters=3), "partitions[0].filters must be a FilterCheckpoint"),
    ("a verdict", lambda c: with_filters(c, verdicts=(True, 1)), "verdicts[1] must be a bool"),
    ("verdicts", lambda c: with_filters(c, verdicts=(True,) * 257), "holds 257"),
    ("filter errors", lambda c: with_filters(c, errors=-1), "filters.errors"),
    ("recent filtered", lambda c: with_filters(c, recent_filtered=4), "more than the groups filtered"),
    ("recent errors", lambda c: with_filters(c, recent_errors=3), "more than the errors in all"),
    ("filtered counter", lambda c: more(c, "evicted_filtered_groups"), "[0].counters do not conserve groups"),
]


@pytest.mark.parametrize(("name", "change", "message"), BAD, ids=[row[0] for row in BAD])
def test_a_checkpoint_no_live_buffer_could_hold_is_refused(
    name: str, change: Callable[[BufferCheckpoint], BufferCheckpoint], message: str
) -> None:
    ckpt = mixed().checkpoint()
    ReplayBuffer.restore(ckpt, filters=FILTERS)  # the unchanged one restores
    with pytest.raises(CheckpointError, match="the checkpoint's") as caught:
        ReplayBuffer.restore(change(ckpt), filters=FILTERS)
    assert message in str(caught.value)


def test_a_wait_mixture_holds_no_balance() -> None:
    ckpt = mixed("wait").checkpoint()
    with pytest.raises(CheckpointError, match=r"tasks\[0\] holds a balance or its growth"):
        ReplayBuffer.restore(with_task(ckpt, "a", growth=1))


def test_a_group_of_a_mixed_partition_names_its_task() -> None:
    ckpt = mixed().checkpoint()
    index = next(i for i, group in enumerate(ckpt.groups) if group.uid == "a7")
    groups = list(ckpt.groups)
    groups[index] = groups[index].replace(tags={"task": "nope"})
    with pytest.raises(CheckpointError, match=rf"groups\[{index}\].tags must name the group's task"):
        ReplayBuffer.restore(attrs.evolve(ckpt, groups=tuple(groups)))


def test_mixture_state_without_a_mixture_and_the_other_way_round_are_refused() -> None:
    ckpt = mixed().checkpoint()
    plain = attrs.evolve(ckpt.config, mixture=None, task_thresholds={})
    with pytest.raises(CheckpointError, match="holds a task mixture's state, but the config has no mixture"):
        ReplayBuffer.restore(attrs.evolve(ckpt, config=plain))
    with pytest.raises(
        CheckpointError, match="'train' is under the task mixture, but its saved state is not"
    ):
        ReplayBuffer.restore(with_train(ckpt, mixture=None))
    exempt = attrs.evolve(ckpt.config, exempt_partitions={"val", "train"})
    with pytest.raises(
        CheckpointError, match="'train' is not under the task mixture, but its saved state is"
    ):
        ReplayBuffer.restore(attrs.evolve(ckpt, config=exempt))


def test_the_filtered_reasons_are_kept_and_others_refused() -> None:
    buf = mixed()
    buf.add_prompt_nowait("a20", tags={"task": "a"})
    buf.put_nowait("a20", 0)
    buf.mark_finished_nowait("a20")  # filtered in flight: remembered
    ckpt = buf.checkpoint()
    assert dict(zip(ckpt.evicted_in_flight, ckpt.evicted_reasons, strict=True))["a20"] == "filtered"
    restored = ReplayBuffer.restore(ckpt, filters=FILTERS).buffer
    with pytest.raises(Exception, match="filtered"):  # GroupEvictedError saying why
        restored.put_nowait("a20", 1)
    bad = attrs.evolve(ckpt, evicted_reasons=("filtred",) * len(ckpt.evicted_reasons))
    with pytest.raises(CheckpointError, match=r"evicted_reasons\[0\] must be None, 'restart', 'filtered'"):
        ReplayBuffer.restore(bad)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (lambda row: [*row[:4], {"other": 1}], "may hold only the keys mixture and filters"),
        (lambda row: [*row[:4], []], r"partitions\[0\]\[4\] must be a JSON object"),
        (lambda row: [*row[:4], {**row[4], "mixture": [1, 2]}], r"mixture must be a JSON list of 3"),
        (lambda row: [*row[:4], {**row[4], "filters": [[], 0, 0]}], r"filters must be a JSON list of 4"),
    ],
)
def test_a_codec_file_with_a_misshapen_partition_row_is_refused(
    row: Callable[[list[Any]], list[Any]], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = mixed()
    written = codec_module._partition_row
    monkeypatch.setattr(
        codec_module, "_partition_row", lambda saved: row(written(saved)) if saved.mixture else written(saved)
    )
    path = tmp_path / "bad.ckpt"
    anyio.run(lambda: buf.save(path, payload_codec=CODEC))
    with pytest.raises(CheckpointError, match=message):
        ReplayBuffer.restore(path, payload_codec=CODEC)


def test_borrowing_takes_each_group_from_its_own_task() -> None:
    """A regression: borrow selection credited every group to the last task and raised KeyError."""
    config = SamplerConfig(max_off_policy_threshold=2, mixture={"a": 1, "b": 1}, mixture_policy="borrow")
    buf = ReplayBuffer(config)

    async def run() -> list[str]:
        for uid, task_name in (("a0", "a"), ("a1", "a"), ("a2", "a"), ("b0", "b")):
            await buf.put_group(uid, [1], tags={"task": task_name})
        batch, _ = await buf.sample(0, 4)
        return batch.uids

    assert anyio.run(run) == ["a0", "a1", "a2", "b0"]
    tasks = buf.stats().partitions["train"].tasks
    assert {name: item.sampled for name, item in tasks.items()} == {"a": 3, "b": 1}
