"""A checkpoint and the records it holds are values: exported, frozen, picklable (issue 12).

Pickling round-trips ``BufferCheckpoint``, ``Batch``, ``Group``, ``Trajectory`` and
``SamplerConfig`` under every protocol, and the read-only mappings (tags, ``sampler_kwargs``)
stay read-only on the other side.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import pytest

from _ckpt_helpers import checkpoint_content, group_content, rich
from _helpers import sample_now, snapshot
from stalebuf import Batch, BatchNotReadyError, Group, ReplayBuffer, SamplerConfig, Status, Trajectory
from stalebuf.checkpoint import FORMAT_VERSION, BufferCheckpoint, PartitionCheckpoint

PROTOCOLS = range(2, pickle.HIGHEST_PROTOCOL + 1)


def round_trip(value: Any, protocol: int) -> Any:
    return pickle.loads(pickle.dumps(value, protocol=protocol))


def assert_read_only(mapping: Mapping[str, Any]) -> None:
    with pytest.raises(TypeError):
        mapping["new"] = 1  # type: ignore[index]


# -- public names and value semantics ----------------------------------------------------------


def test_the_checkpoint_names_are_exported_from_stalebuf() -> None:
    """BUG (reported): issue 12 says BufferCheckpoint and RestoreResult are exported from
    stalebuf (and every other error class is). Suggested fix: import and list BufferCheckpoint,
    RestoreResult (from .checkpoint) and CheckpointError (from .errors) in stalebuf/__init__.py."""
    import stalebuf

    missing = [name for name in ("BufferCheckpoint", "RestoreResult", "CheckpointError") if
               name not in stalebuf.__all__ or not hasattr(stalebuf, name)]  # fmt: skip
    assert missing == []


def test_a_checkpoint_is_a_frozen_value_all_the_way_down() -> None:
    """BUG (reported): ``clocks`` and each partition's ``counters`` are plain dicts, so a
    "frozen" checkpoint can be changed after the fact (and a later restore differs). Suggested
    fix: freeze them as MappingProxyType on construction (an attrs converter) and pickle them as
    dicts, as records do with their tags."""
    ckpt = rich().checkpoint()
    mutations: list[Callable[[], object]] = [
        lambda: ckpt.clocks.__setitem__("train", 99),  # type: ignore[index]
        lambda: ckpt.partitions[0].counters.__setitem__("sampled_groups", 0),  # type: ignore[index]
    ]
    for mutate in mutations:
        with pytest.raises((TypeError, AttributeError)):
            mutate()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ckpt.clocks = {}  # type: ignore[misc]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_checkpoint_pickles_and_restores_like_the_original(protocol: int) -> None:
    buf = rich()
    ckpt = buf.checkpoint()
    copy = round_trip(ckpt, protocol)
    assert isinstance(copy, BufferCheckpoint)
    assert checkpoint_content(copy) == checkpoint_content(ckpt)
    for group in copy.groups:
        assert_read_only(group.tags)
        for trajectory in group.trajectories:
            assert_read_only(trajectory.tags)
    assert_read_only(copy.config.sampler_kwargs)
    restored = ReplayBuffer.restore(copy, in_flight="keep").buffer
    assert snapshot(restored) == snapshot(buf)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_records_and_the_config_pickle_with_read_only_tags(protocol: int) -> None:
    config = SamplerConfig(
        max_off_policy_threshold=3,
        max_off_policy_strategy="wait",
        exempt_partitions={"val", "eval"},
        sampler_kwargs={"alpha": [1, 2]},
        admission_batch_size=4,
    )
    copy = round_trip(config, protocol)
    assert copy == config
    assert type(copy.exempt_partitions) is frozenset
    assert_read_only(copy.sampler_kwargs)

    buf = ReplayBuffer(config, status_log_interval=None)
    with pytest.raises(BatchNotReadyError):  # the clock to 1: admission refuses a step ahead of it
        buf.sample_nowait(1, 1)
    buf.add_prompt_nowait("g", global_steps=1, tags={"kind": "math", "n": 2})
    buf.put_nowait("g", np.arange(3), session_id=0, tags={"reward": 1.5})
    buf.put_nowait("g", {"text": "hi"}, session_id=1)
    buf.mark_finished_nowait("g")
    batch, _ = sample_now(buf, 2, 1)
    trajectory = batch.groups[0].trajectories[0]
    for value, kind in ((batch, Batch), (batch.groups[0], Group), (trajectory, Trajectory)):
        assert type(round_trip(value, protocol)) is kind
    again: Batch = round_trip(batch, protocol)
    assert (again.partition, again.global_steps, again.parameter_sync_step, again.uids) == (
        "train",
        2,
        1,
        ["g"],
    )
    assert again.staleness.tolist() == batch.staleness.tolist()
    group: Group = again.groups[0]
    assert group.status is Status.FINISHED  # enum identity survives
    np.testing.assert_array_equal(group.trajectories[0].payload, np.arange(3))
    assert group_content(group.replace(trajectories=group.trajectories[1:])) == group_content(
        batch.groups[0].replace(trajectories=batch.groups[0].trajectories[1:])
    )
    assert_read_only(group.tags)
    assert dict(group.tags) == {"kind": "math", "n": 2}
    for copy_trajectory in group.trajectories:
        assert_read_only(copy_trajectory.tags)
    assert dict(group.trajectories[0].tags) == {"reward": 1.5}
    assert dict(group.trajectories[1].tags) == {}


# -- a checkpoint built by hand (issue 21, item 4) ------------------------------------------------


def hand_built(group: Group) -> BufferCheckpoint:
    """A checkpoint built by hand holding ``group`` (one trajectory), resident in "train"."""
    counters = {"admitted_groups": 1, "admitted_trajectories": len(group.trajectories)}
    partitions = (PartitionCheckpoint("train", -1, counters),)
    return BufferCheckpoint(FORMAT_VERSION, SamplerConfig(), None, (group,), partitions, {}, ())


def test_a_hand_built_records_plain_tags_are_copied_read_only() -> None:
    """Defect (issue 21, item 4): restore kept the plain dicts a hand-built record holds as its
    tags, so the restored buffer handed out tags the caller could still change (every later batch
    showed the change), where ``put`` copies tags into a read-only mapping. restore copies them
    as ``put`` does."""
    tags, trajectory_tags = {"kind": "math"}, {"reward": 1}
    trajectory = Trajectory("g_0_0", 0, 0, trajectory_tags, "payload")
    group = Group("g", "train", 0, Status.FINISHED, tags, (trajectory,))
    restored = ReplayBuffer.restore(hand_built(group), status_log_interval=None).buffer
    tags["kind"], trajectory_tags["reward"] = "changed", 2
    batch, _ = sample_now(restored, 0, 1)
    assert dict(batch.groups[0].tags) == {"kind": "math"}
    assert [dict(t) for t in batch.tags] == [{"reward": 1}]
    assert_read_only(batch.groups[0].tags)
    assert_read_only(batch.groups[0].trajectories[0].tags)


def test_a_hand_built_checkpoint_in_any_form_a_live_buffer_could_hold_restores() -> None:
    """The checks refuse only what no live buffer could hold: lists where records hold tuples,
    whole seconds as an int, counters left out (read as 0, as an older hand-built checkpoint
    would), and tags given as None restore the same state as the checkpoint they stand for."""
    original = rich()
    ckpt = original.checkpoint()
    groups = [g.replace(generation_seconds=0) if g.status.is_terminal else g for g in ckpt.groups]
    partitions = [PartitionCheckpoint(p.name, p.last_sampled, {k: v for k, v in p.counters.items() if v})
                  for p in ckpt.partitions]  # fmt: skip
    same = attrs.evolve(
        ckpt, groups=groups, partitions=partitions, evicted_in_flight=list(ckpt.evicted_in_flight)
    )
    restored = ReplayBuffer.restore(same, in_flight="keep").buffer
    assert snapshot(restored) == snapshot(original)
    untagged = Group("g", "train", 0, Status.FINISHED, None, (Trajectory("g_0_0", 0, 0, None, 1),))  # type: ignore[arg-type]
    batch, _ = sample_now(ReplayBuffer.restore(hand_built(untagged)).buffer, 0, 1)
    assert (dict(batch.groups[0].tags), dict(batch.tags[0])) == ({}, {})
