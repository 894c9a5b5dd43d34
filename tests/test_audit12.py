"""Audit of issue 12 (checkpoint and resume) by a hostile tester: the cases where ``save`` or
``restore`` did not do what the issue text says, each a regression test.

- ``save`` must refuse a ``payload_codec`` that ``restore`` refuses (ConfigError), before it
  writes anything;
- a codec whose ``encode`` returns a memoryview of non-byte items (``ndarray.data``) must still
  write a file that restores: the frame length is in bytes, not items;
- ``save`` with a codec names the first value JSON cannot hold by its own group, not by the first
  group of the chunk it was written in;
- a payload pickle cannot hold is a CheckpointError naming the group and trajectory (the error's
  documented meaning: "a value the format cannot hold"), and the previous file survives;
- a buffer built as ``ReplayBuffer(config)`` whose config carries ``sampler_kwargs`` (and names
  no custom sampler) restores;
- "restart" evictions are remembered within the same bound as stale in-flight ones.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from _helpers import EVICTED_UIDS_REMEMBERED, LIMIT
from stalebuf import ReplayBuffer, SamplerConfig, StalenessPolicy
from stalebuf.errors import (
    BatchNotReadyError,
    CheckpointError,
    ConfigError,
    GroupEvictedError,
    UnknownGroupError,
)

JSON_CODEC = (lambda payload: json.dumps(payload).encode(), lambda data: json.loads(data))


def names(directory: Path) -> list[str]:
    """The files in ``directory``: no temporary file may be left behind."""
    return sorted(p.name for p in directory.iterdir())


def small() -> ReplayBuffer:
    buf = ReplayBuffer(status_log_interval=None)
    buf.put_group_nowait("a", [1, 2])
    return buf


@pytest.mark.anyio
@pytest.mark.parametrize(
    "codec",
    [repr, ("a", "b"), (JSON_CODEC[0],), [JSON_CODEC[0], JSON_CODEC[1]], (JSON_CODEC[0], 5)],
    ids=["callable", "strings", "one", "list", "not-callable"],
)
async def test_save_refuses_a_payload_codec_that_restore_refuses(tmp_path: Path, codec: Any) -> None:
    path = tmp_path / "b.ckpt"
    with anyio.fail_after(LIMIT):
        await small().save(path)
    before = path.read_bytes()
    empty = ReplayBuffer(status_log_interval=None)  # no payload: encode is never called
    for buf in (empty, small()):
        with anyio.fail_after(LIMIT), pytest.raises(ConfigError, match="payload_codec"):
            await buf.save(path, payload_codec=codec)
        assert path.read_bytes() == before
    with pytest.raises(ConfigError, match="payload_codec"):
        ReplayBuffer.restore(path, payload_codec=codec)
    assert names(tmp_path) == ["b.ckpt"]


@pytest.mark.anyio
async def test_a_codec_may_return_a_memoryview_of_non_byte_items(tmp_path: Path) -> None:
    codec = (
        lambda a: a.data,  # a memoryview of 8-byte items (of a 2-D array, or strided)
        lambda data: np.frombuffer(data, dtype=np.float64),
    )
    buf = ReplayBuffer(status_log_interval=None)
    buf.put_group_nowait("g", [np.arange(4.0), np.ones((2, 3))])
    buf.put_group_nowait("h", [np.zeros(3)])
    buf.put_group_nowait("s", [np.arange(6.0)[::2]])  # a strided view: copied, not torn
    path = tmp_path / "m.ckpt"
    with anyio.fail_after(LIMIT):
        await buf.save(path, payload_codec=codec)
    restored = ReplayBuffer.restore(path, payload_codec=codec, status_log_interval=None).buffer
    payloads = [[t.payload.tolist() for t in g.trajectories] for g in restored.checkpoint().groups]
    assert payloads == [[[0.0, 1.0, 2.0, 3.0], [1.0] * 6], [[0.0] * 3], [[0.0, 2.0, 4.0]]]


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["tags", "trajectory_tags"])
async def test_the_first_value_json_cannot_hold_is_named_by_its_own_group(tmp_path: Path, where: str) -> None:
    buf = ReplayBuffer(status_log_interval=None)
    for i in range(5):
        bad = {"t": (1, 2)} if i == 3 else {"t": 1}
        if where == "tags":
            buf.put_group_nowait(f"g{i}", [i], tags=bad)
        else:
            buf.put_group_nowait(f"g{i}", [i], trajectory_tags=[bad])
    with anyio.fail_after(LIMIT), pytest.raises(CheckpointError) as caught:
        await buf.save(tmp_path / "j.ckpt", payload_codec=JSON_CODEC)
    message = str(caught.value)
    assert "'g3'" in message, message
    assert "'g0'" not in message, message
    assert "tuple" in message, message
    assert "'t'" in message, message


@pytest.mark.anyio
async def test_an_unpicklable_payload_is_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "p.ckpt"
    buf = small()
    with anyio.fail_after(LIMIT):
        await buf.save(path)
    before = path.read_bytes()
    for i in range(300):  # the bad one is not the first of its chunk
        buf.put_group_nowait(f"ok{i}", [i])
    buf.add_prompt_nowait("bad")
    buf.put_nowait("bad", "fine")
    buf.put_nowait("bad", threading.Lock(), session_id=1)
    with anyio.fail_after(LIMIT), pytest.raises(CheckpointError) as caught:
        await buf.save(path)
    message = str(caught.value)
    assert "'bad'" in message, message
    assert "'bad_1_0'" in message, message
    assert "pickle" in message, message
    assert path.read_bytes() == before
    assert names(tmp_path) == ["p.ckpt"]


@pytest.mark.anyio
async def test_an_unpicklable_sampler_kwarg_is_a_checkpoint_error(tmp_path: Path) -> None:
    class Kwargs(ReplayBuffer):
        def __init__(self, config: SamplerConfig, lock: Any = None, **options: Any) -> None:
            super().__init__(config, **options)

    buf = Kwargs(SamplerConfig(sampler_kwargs={"lock": threading.Lock()}), status_log_interval=None)
    with anyio.fail_after(LIMIT), pytest.raises(CheckpointError, match=r"config.*pickle"):
        await buf.save(tmp_path / "k.ckpt")
    assert names(tmp_path) == []


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["object", "pickle", "codec"])
async def test_a_plain_buffer_whose_config_has_sampler_kwargs_restores(tmp_path: Path, kind: str) -> None:
    config = SamplerConfig(max_off_policy_threshold=2, sampler_kwargs={"seed": 3})
    buf = ReplayBuffer(config, status_log_interval=None)  # the constructor accepts this config
    buf.put_group_nowait("a", [1])
    codec = JSON_CODEC if kind == "codec" else None
    source: Any = buf.checkpoint()
    if kind != "object":
        source = tmp_path / "s.ckpt"
        with anyio.fail_after(LIMIT):
            await buf.save(source, payload_codec=codec)
    restored = ReplayBuffer.restore(source, payload_codec=codec, status_log_interval=None).buffer
    assert type(restored) is ReplayBuffer
    assert restored.config == config
    assert restored.stats() == buf.stats()


def test_restart_evictions_are_remembered_within_the_bound() -> None:
    buf = ReplayBuffer(status_log_interval=None)
    count = EVICTED_UIDS_REMEMBERED + 10
    for i in range(count):
        buf.add_prompt_nowait(f"u{i}")
    restored = ReplayBuffer.restore(buf.checkpoint(), in_flight="evict", status_log_interval=None).buffer
    assert restored.stats().total.evicted_restart_groups == count
    with pytest.raises(GroupEvictedError):  # the most recent are remembered, as for stale ones
        restored.put_nowait(f"u{count - 1}", 1)
    with pytest.raises(UnknownGroupError) as caught:  # the oldest were forgotten
        restored.put_nowait("u0", 1)
    assert not isinstance(caught.value, GroupEvictedError)


def test_a_policy_built_from_another_config_than_the_buffers_is_refused_by_checkpoint() -> None:
    # restore rebuilds the policy from the one config a checkpoint keeps (the buffer's): saving
    # would let the restored buffer follow other rules, so the checkpoint is refused instead.
    buf = ReplayBuffer(
        SamplerConfig(max_off_policy_threshold=5),
        policy=StalenessPolicy(SamplerConfig(max_off_policy_threshold=1)),
        status_log_interval=None,
    )
    buf.put_group_nowait("a", [1], global_steps=0)
    with pytest.raises(CheckpointError, match="another config"):
        buf.checkpoint()
    assert buf.stats().total.groups == 1  # nothing changed


def test_a_policy_built_from_an_equal_config_checkpoints_and_keeps_its_rules() -> None:
    def build() -> ReplayBuffer:
        buf = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=1),
            policy=StalenessPolicy(SamplerConfig(max_off_policy_threshold=1)),  # equal, not the same
            status_log_interval=None,
        )
        buf.put_group_nowait("a", [1], global_steps=0)
        return buf

    original = build()
    restored = ReplayBuffer.restore(build().checkpoint(), status_log_interval=None).buffer
    assert restored.policy.threshold == original.policy.threshold == 1
    for buf in (original, restored):
        with pytest.raises(BatchNotReadyError):  # "a" is stale at step 3 under threshold 1
            buf.sample_nowait(3, 1)
        assert buf.stats().total.evicted_stale_groups == 1


def test_a_restore_result_unpacks_as_buffer_and_reissue() -> None:
    buf = ReplayBuffer(status_log_interval=None)
    buf.add_prompt_nowait("a", global_steps=0)
    result = ReplayBuffer.restore(buf.checkpoint(), status_log_interval=None)
    restored, reissue = result
    assert restored is result.buffer
    assert reissue == result.reissue
    assert [group.uid for group in reissue] == ["a"]


def test_a_remote_restore_result_unpacks_as_buffer_and_reissue() -> None:
    pytest.importorskip("ray")
    from stalebuf.ray import RemoteRestoreResult

    client: Any = object()  # stands for the client; unpacking does not touch it
    restored, reissue = RemoteRestoreResult(client, ())
    assert restored is client
    assert reissue == ()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX permissions")
@pytest.mark.anyio
async def test_a_new_checkpoint_file_has_the_permissions_a_plain_open_gives(tmp_path: Path) -> None:
    # The temporary file the write goes through is made 0o600; the file it becomes must not be.
    buf = ReplayBuffer(status_log_interval=None)
    buf.put_group_nowait("a", [1], global_steps=0)
    path = tmp_path / "ckpt"
    with anyio.fail_after(30):
        await buf.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX permissions")
@pytest.mark.anyio
async def test_replacing_a_checkpoint_file_keeps_its_permissions(tmp_path: Path) -> None:
    buf = ReplayBuffer(status_log_interval=None)
    buf.put_group_nowait("a", [1], global_steps=0)
    path = tmp_path / "ckpt"
    path.write_bytes(b"old")
    path.chmod(0o640)
    with anyio.fail_after(30):
        await buf.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert ReplayBuffer.restore(path, status_log_interval=None).buffer.stats().total.groups == 1


def test_a_write_to_a_group_a_restore_evicted_says_so() -> None:
    buf = ReplayBuffer(status_log_interval=None)
    buf.add_prompt_nowait("a", global_steps=0)
    restored = ReplayBuffer.restore(buf.checkpoint(), in_flight="evict", status_log_interval=None).buffer
    with pytest.raises(GroupEvictedError, match="'a' was evicted by a restart while in flight"):
        restored.put_nowait("a", 1)
