"""The checkpoint file (issue 12; issue 25, "one durable format"): ``save`` writes the journal's
SQLite format, compacted (a stalebuf file of kind "checkpoint": the state, the resident groups, a
digest of both); truncated, corrupt (a flipped bit), foreign files and files of another format or
kind; a journal given to ``restore``; the older hand-written container (magic, version, checksum),
still read, from the files the last release that wrote it left (``tests/fixtures/``) and files
built here; ``payload_codec`` (a file with no pickle in it); numpy payloads; ``save`` taking its
checkpoint at once while the loop keeps serving. Issue 21: overlapping and cancelled saves
(item 2), stale temporary files (item 9), huge files and FIFOs given to ``restore`` (item 10),
symlinks and read-only files given to ``save`` (item 14). The crash tests (SIGKILL during
``save``) are in ``test_checkpoint_atomic.py``.

Every refused file raises CheckpointError with a message that names the file, and builds nothing:
the buffers here are built through a custom sampler that counts its instances.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import gc
import hashlib
import io
import json
import math
import os
import pickle
import random
import sqlite3
import stat
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from types import MappingProxyType
from typing import Any

import anyio
import attrs
import numpy as np
import pytest

from _ckpt_helpers import checkpoint_content, rich
from _helpers import EVICTED_UIDS_REMEMBERED, LIMIT, add_group, assert_conserved, make, snapshot
from stalebuf import (
    BatchNotReadyError,
    Group,
    ReplayBuffer,
    SamplerConfig,
    StalenessPolicy,
    Status,
    Trajectory,
)
from stalebuf._checkpoint_codec import plain_manifest, write_plain_groups
from stalebuf._checkpoint_path import STALE_AFTER_SECONDS, _host, _prefix
from stalebuf._journal_format import create_schema, file_kind, write_key
from stalebuf.checkpoint import FORMAT_VERSION, BufferCheckpoint, PartitionCheckpoint
from stalebuf.errors import CheckpointError, ConfigError

MAGIC = b"STALEBUF CHECKPOINT\n"  # the container's layout: magic, then version, flags, length, sha256
HEADER = struct.Struct(">IIQ32s")
SQLITE_MAGIC = b"SQLite format 3\x00"
APPLICATION_ID = 0x53425546  # "SBUF", the documented PRAGMA application_id of a stalebuf file
FIXTURES = Path(__file__).parent / "fixtures"
#: Files the last release that wrote the container wrote (``make_checkpoint_fixtures_053194f.py``).
CONTAINER = FIXTURES / "checkpoint_053194f_pickle.ckpt"
CONTAINER_CODEC = FIXTURES / "checkpoint_053194f_codec.ckpt"
JSON_CODEC = (lambda payload: json.dumps(payload).encode(), lambda data: json.loads(data))


class Counted(ReplayBuffer):
    """A custom sampler that counts how many buffers were built."""

    built = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).built += 1
        super().__init__(*args, **kwargs)


def save(buf: ReplayBuffer, path: Path, codec: Any = None) -> None:
    async def run() -> None:
        await buf.save(path, payload_codec=codec)

    anyio.run(run)


def counted_buffer() -> ReplayBuffer:
    buf = rich(custom_sampler=f"{__name__}:Counted")
    assert type(buf) is Counted
    return buf


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "buffer.ckpt"
    save(counted_buffer(), path)
    return path


def assert_refused(
    path: Path, match: str | None = None, *, names_file: bool = True, **options: Any
) -> CheckpointError:
    """Restoring ``path`` raises CheckpointError (naming it), and builds no buffer."""
    built = Counted.built
    with pytest.raises(CheckpointError, match=match) as info:
        ReplayBuffer.restore(path, **options)
    if names_file:
        assert str(path) in str(info.value)
    assert Counted.built == built, "a buffer was built from a refused file"
    return info.value


def numpy_codec() -> tuple[Any, Any]:
    def encode(array: Any) -> bytes:
        out = io.BytesIO()
        np.save(out, array, allow_pickle=False)
        return out.getvalue()

    def decode(data: bytes) -> Any:
        return np.load(io.BytesIO(data), allow_pickle=False)

    return encode, decode


@pytest.fixture
def container(tmp_path: Path) -> Path:
    """A copy of a container file the last release that wrote them saved (pickle form)."""
    path = tmp_path / "container.ckpt"
    path.write_bytes(CONTAINER.read_bytes())
    return path


def sqlite_read_only(path: Path) -> Any:
    """A read-only connection to the SQLite file at ``path`` (closed by ``contextlib.closing``)."""
    return contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True))


def sqlite_change(path: Path, *statements: str) -> None:
    """Run ``statements`` on the SQLite file at ``path`` (what another program could do to it)."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        for statement in statements:
            db.execute(statement)


def content_of(path: Path, codec: Any = None) -> Any:
    """What the file at ``path`` restores to, compared by content."""
    buf = ReplayBuffer.restore(path, in_flight="keep", payload_codec=codec, status_log_interval=None).buffer
    return checkpoint_content(buf.checkpoint())


# -- what is written and read back ---------------------------------------------------------------


@pytest.mark.parametrize("codec", [None, JSON_CODEC], ids=["pickle", "codec"])
def test_a_saved_file_restores_the_same_checkpoint(tmp_path: Path, codec: Any) -> None:
    """The documented layout: an SQLite file of the journal's schema, kind "checkpoint", in
    rollback-journal mode (complete on its own: no -wal beside it), every resident group a row in
    admission order (none removed), no history."""
    buf = counted_buffer()
    path = tmp_path / "buffer.ckpt"
    save(buf, path, codec)
    data = path.read_bytes()
    assert data.startswith(SQLITE_MAGIC)
    assert data[18:20] == b"\x01\x01"  # not WAL: the file alone holds everything
    assert int.from_bytes(data[68:72], "big") == APPLICATION_ID
    assert len(data) % int.from_bytes(data[16:18], "big") == 0  # whole pages
    assert file_kind(str(path)) == "checkpoint"
    with sqlite_read_only(path) as db:
        keys = dict(db.execute("SELECT key, value FROM stalebuf").fetchall())
        rows = db.execute("SELECT gid, uid, partition FROM groups ORDER BY gid").fetchall()
        tables = ("samples", "marks", "removals")
        history = [db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in tables]
    assert (keys["format"], keys["kind"], keys["codec"]) == (1, "checkpoint", "plain" if codec else "pickle")
    assert len(keys["digest"]) == 32
    groups = buf.checkpoint().groups
    assert rows == [(gid, g.uid, g.partition) for gid, g in enumerate(groups)]
    assert history == [0, 0, 0]
    restored = ReplayBuffer.restore(path, in_flight="keep", payload_codec=codec).buffer
    assert type(restored) is Counted
    assert snapshot(restored) == snapshot(buf)
    assert checkpoint_content(restored.checkpoint()) == checkpoint_content(buf.checkpoint())
    assert [p.name for p in tmp_path.iterdir()] == ["buffer.ckpt"]  # no temporary, -wal or -journal


def test_numpy_payloads_round_trip_through_the_default_pickle_path(tmp_path: Path) -> None:
    """Pickle protocol 5: contiguous arrays, strided ones, records, objects, all exact."""
    arrays = {
        "c": np.arange(12, dtype=np.float32).reshape(3, 4),
        "fortran": np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
        "strided": np.arange(20, dtype=np.int16)[::3],  # not contiguous
        "scalar": np.array(7.5),
        "empty": np.zeros((0, 3), dtype=np.uint8),
        "record": np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
        "objects": np.array([{"x": 1}, None], dtype=object),
        "big": np.random.default_rng(0).random(200_000),
        "when": np.array(["2026-01-01"], dtype="datetime64[D]"),
    }
    buf = ReplayBuffer(SamplerConfig(), status_log_interval=None)
    buf.put_group_nowait("g", list(arrays.values()))
    path = tmp_path / "arrays.ckpt"
    save(buf, path)
    assert path.stat().st_size < arrays["big"].nbytes * 1.05  # stored once
    restored = ReplayBuffer.restore(path).buffer
    batch, _ = anyio.run(lambda: restored.sample(0, 1, timeout=0))
    for (name, want), got in zip(arrays.items(), batch.payloads, strict=True):
        assert type(got) is np.ndarray, name
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert got.tolist() == want.tolist(), name
        assert got.flags.writeable, name
    assert batch.payloads[1].flags.f_contiguous


@pytest.mark.parametrize("codec", [None, JSON_CODEC], ids=["pickle", "codec"])
def test_a_journal_given_to_restore_restores_its_state_at_its_last_commit(tmp_path: Path, codec: Any) -> None:
    """A journal is the same format with history: ``restore`` reads its last committed state (and
    leaves it a journal, for ``recover``)."""
    path = tmp_path / "journal.db"
    start = counted_buffer().checkpoint()

    async def run() -> tuple[Any, Any]:
        with anyio.fail_after(LIMIT):
            buf = ReplayBuffer.restore(
                start,
                in_flight="keep",
                journal=path,
                payload_codec=codec,
                status_log_interval=None,
            ).buffer
            buf.put_group_nowait("late", ["x", "y"], partition="val")
            buf.sample_nowait(3, 1)
            await buf.flush()
            expected = (buf.stats(), checkpoint_content(buf.checkpoint()))
            await buf.aclose()
            return expected

    stats, content = anyio.run(run)
    assert file_kind(str(path)) == "journal"
    restored = ReplayBuffer.restore(
        path, in_flight="keep", payload_codec=codec, status_log_interval=None
    ).buffer
    assert type(restored) is Counted
    assert restored.stats() == stats
    assert checkpoint_content(restored.checkpoint()) == content
    assert file_kind(str(path)) == "journal"
    assert_refused(path, "payload_codec" if codec else "pickle", payload_codec=None if codec else JSON_CODEC)


# -- refused files: the SQLite format ------------------------------------------------------------


def test_a_file_cut_at_any_offset_is_refused(saved: Path) -> None:
    data = saved.read_bytes()
    cut = saved.with_name("cut.ckpt")
    # Every offset in the first page's header and a little past it, a stride through the rest,
    # and every offset of the last page.
    page = int.from_bytes(data[16:18], "big")
    sizes = {*range(512), *range(512, len(data), 97), *range(len(data) - page, len(data))}
    assert len(sizes) > 500
    for size in sorted(sizes):
        cut.write_bytes(data[:size])
        assert_refused(cut)
    for trailing in (b"\0", bytes(page), data[:page]):
        cut.write_bytes(data + trailing)
        assert_refused(cut, "trailing data")


def test_every_bit_flip_is_refused_or_changes_nothing(saved: Path) -> None:
    """SQLite checks a file's structure, not its values: the digest does. A flipped bit is refused
    (by the integrity check, the size, the format keys or the digest), or it fell where nothing
    is read (free space in a page, a header field SQLite ignores) and the file restores the same
    checkpoint: it never restores another one. A flip in the state or a group's record is always
    refused. (Every bit of the database header, and seeded samples of the rest.)"""
    data = saved.read_bytes()
    want = content_of(saved)
    with sqlite_read_only(saved) as db:
        blobs = [db.execute("SELECT value FROM stalebuf WHERE key = 'state'").fetchone()[0]]
        blobs += [record for (record,) in db.execute("SELECT record FROM groups")]
    starts = [data.find(blob) for blob in blobs]
    assert all(start > 0 and data.count(blob) == 1 for blob, start in zip(blobs, starts, strict=True))
    in_values = [
        8 * start + bit for blob, start in zip(blobs, starts, strict=True) for bit in range(len(blob) * 8)
    ]
    rng = random.Random(5)
    values = set(rng.sample(in_values, 300))
    bits = [*range(100 * 8), *rng.sample(range(100 * 8, len(data) * 8), 400), *sorted(values)]
    flipped = saved.with_name("flipped.ckpt")
    changed = []
    for bit in bits:
        corrupt = bytearray(data)
        corrupt[bit // 8] ^= 1 << (bit % 8)
        flipped.write_bytes(corrupt)
        try:
            got = content_of(flipped)
        except CheckpointError:
            continue
        if got != want or bit in values:
            changed.append((bit // 8, bit % 8))
    assert changed == [], "flips at (byte, bit) restored another checkpoint, or a value's without an error"


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("format", 2, "stalebuf file format 2; this stalebuf reads format 1"),
        ("format", 0, "stalebuf file format 0"),
        ("format", "'1'", "stalebuf file format '1'"),
        ("kind", "'snapshot'", "unknown kind of stalebuf file 'snapshot'"),
        ("codec", "'zstd'", "unknown payload codec 'zstd'"),
        ("digest", "x'00'", "corrupt"),
        ("state", "NULL", "corrupt"),
    ],
)
def test_a_file_of_another_stalebuf_format_or_kind_is_refused_and_kept(
    saved: Path, key: str, value: Any, match: str
) -> None:
    sqlite_change(saved, f"UPDATE stalebuf SET value = {value} WHERE key = '{key}'")
    before = saved.read_bytes()
    assert_refused(saved, match)
    assert saved.read_bytes() == before


@pytest.mark.parametrize(
    "change",
    [
        "DELETE FROM groups WHERE gid = 3",
        "INSERT INTO removals (gid, removed, reason) VALUES (3, 5, 'sampled')",
        "UPDATE groups SET gid = 100 WHERE gid = 0",  # the admission order changed
        "UPDATE groups SET record = (SELECT record FROM groups WHERE gid = 1) WHERE gid = 2",
        "INSERT INTO groups (gid, uid, partition, admitted, record) SELECT 100, uid, partition, 0, record "
        "FROM groups WHERE gid = 1",
    ],
    ids=["dropped", "removed", "reordered", "replaced", "added"],
)
def test_a_group_row_changed_by_another_program_is_refused(saved: Path, change: str) -> None:
    """Rows changed through SQLite, a valid database each time: the digest binds the groups, in
    order, to the state."""
    sqlite_change(saved, change)
    assert_refused(saved, "corrupt")


@pytest.mark.parametrize("journal_mode", ["delete", "wal", "our application id"])
def test_a_foreign_sqlite_database_is_refused_and_left_as_it_was(tmp_path: Path, journal_mode: str) -> None:
    path = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        if journal_mode == "wal":
            db.execute("PRAGMA journal_mode=WAL")
        if journal_mode == "our application id":
            db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        db.execute(
            "CREATE TABLE stalebuf (key TEXT PRIMARY KEY, value)"
            if journal_mode != "wal"
            else "CREATE TABLE t (x)"
        )
    before, listing = path.read_bytes(), names(tmp_path)
    error = assert_refused(path, "not a stalebuf" if journal_mode != "our application id" else "format None")
    assert path.read_bytes() == before
    if journal_mode != "wal":  # (a read-only reader of a WAL database may create its -shm)
        assert names(tmp_path) == listing
    assert "SQLite" in str(error) or journal_mode == "our application id"


def test_a_huge_sqlite_file_is_refused_without_reading_it(saved: Path) -> None:
    """Issue 21, item 10, for the SQLite format: a valid file followed by 3 GB (sparse) is refused
    from its declared size; SQLite reads the pages in use, not the rest (the bytes this process
    read, counted by Linux)."""
    os.truncate(saved, 3 << 30)
    io_stats = Path("/proc/self/io")
    if not io_stats.exists():
        pytest.skip("Linux counts a process's reads in /proc/self/io")

    def read_bytes() -> int:
        return int(dict(line.split(": ") for line in io_stats.read_text().splitlines())["rchar"])

    before = read_bytes()
    assert_refused(saved, "trailing data")
    assert read_bytes() - before < 16 << 20


# -- refused files: the older container ----------------------------------------------------------


def test_a_container_file_cut_at_any_offset_is_refused(container: Path) -> None:
    data = container.read_bytes()
    cut = container.with_name("cut.ckpt")
    header = len(MAGIC) + HEADER.size
    # Every offset in and just after the header and at the end; a stride through the body.
    sizes = {*range(header + 64), *range(header, len(data), 5), *range(len(data) - 64, len(data))}
    assert len(sizes) > 500
    for size in sorted(sizes):
        cut.write_bytes(data[:size])
        assert_refused(cut, "truncated|not a stalebuf checkpoint|corrupt")
    cut.write_bytes(data + b"\0")
    assert_refused(cut, "trailing data")


def test_every_single_bit_flip_of_a_container_file_is_detected(container: Path) -> None:
    """Every bit of the magic and header, and a sample of the body's, flipped one at a time: the
    checksum covers the header's fields and the body."""
    data = container.read_bytes()
    header = len(MAGIC) + HEADER.size
    bits = list(range(header * 8)) + random.Random(5).sample(range(header * 8, len(data) * 8), 400)
    flipped = container.with_name("flipped.ckpt")
    undetected = []
    for bit in bits:
        corrupt = bytearray(data)
        corrupt[bit // 8] ^= 1 << (bit % 8)
        flipped.write_bytes(corrupt)
        try:
            ReplayBuffer.restore(flipped)
        except CheckpointError:
            continue
        undetected.append((bit // 8, bit % 8))
    assert undetected == [], "flips at (byte, bit) restored without an error"


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"STALEBUF",
        MAGIC,
        MAGIC + b"\xff" * 100,
        b"hello, world\n" * 10,
        bytes(random.Random(1).getrandbits(8) for _ in range(4096)),
        pickle.dumps({"groups": [], "clocks": {}}),
        b"\x89PNG\r\n\x1a\n" + b"\0" * 64,
        SQLITE_MAGIC,
        SQLITE_MAGIC + b"\xff" * 4096,
    ],
    ids=["empty", "magic-prefix", "magic-only", "magic-junk", "text", "random", "pickle", "png",
         "sqlite-magic", "sqlite-junk"],
)  # fmt: skip
def test_a_foreign_file_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "foreign.ckpt"
    path.write_bytes(content)
    assert_refused(path)
    assert path.read_bytes() == content


def test_a_hand_pickled_checkpoint_is_not_a_checkpoint_file(tmp_path: Path) -> None:
    path = tmp_path / "pickled.ckpt"
    path.write_bytes(pickle.dumps(rich().checkpoint(), protocol=5))
    assert_refused(path, "not a stalebuf checkpoint")


def test_a_newer_container_format_is_refused_with_an_upgrade_hint(container: Path) -> None:
    data = bytearray(container.read_bytes())
    _version, flags, length, digest = HEADER.unpack_from(data, len(MAGIC))
    HEADER.pack_into(data, len(MAGIC), FORMAT_VERSION + 1, flags, length, digest)
    container.write_bytes(data)
    error = assert_refused(container, f"format {FORMAT_VERSION + 1}")
    assert "upgrade" in str(error)


def test_a_format_1_container_file_is_still_read(container: Path) -> None:
    # Format 2 only added a way to pickle lazily stored groups: a file whose header says 1 (and
    # whose checksum is bound to that header, as the documented layout says) restores.
    want = content_of(container)
    data = bytearray(container.read_bytes())
    _version, flags, length, _digest = HEADER.unpack_from(data, len(MAGIC))
    body = hashlib.sha256(data[len(MAGIC) + HEADER.size :]).digest()
    digest = hashlib.sha256(struct.pack(">IIQ", 1, flags, length) + body).digest()
    HEADER.pack_into(data, len(MAGIC), 1, flags, length, digest)
    container.write_bytes(data)
    assert content_of(container) == want


def test_unknown_container_flags_are_refused(container: Path) -> None:
    data = bytearray(container.read_bytes())
    version, _, length, digest = HEADER.unpack_from(data, len(MAGIC))
    HEADER.pack_into(data, len(MAGIC), version, 7, length, digest)
    container.write_bytes(data)
    assert_refused(container, "flags")


def test_a_missing_file_or_a_directory_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ReplayBuffer.restore(tmp_path / "nope.ckpt")
    with pytest.raises(IsADirectoryError):
        ReplayBuffer.restore(tmp_path)
    buf = rich()
    with pytest.raises(FileNotFoundError):
        save(buf, tmp_path / "no" / "such" / "dir.ckpt")
    assert list(tmp_path.iterdir()) == []


# -- payload codecs ------------------------------------------------------------------------------


def test_a_numpy_only_codec_round_trips_and_nothing_is_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = numpy_codec()
    config = SamplerConfig(sampler_kwargs={}, exempt_partitions={"val", "test"}, admission_batch_size=8)
    buf = ReplayBuffer(config, status_log_interval=None)
    tags = {"s": "x", "i": 1, "f": 0.5, "b": True, "none": None, "list": [1, [2, "3"]], "map": {"k": [1.5]}}
    with pytest.raises(BatchNotReadyError):  # the clock to 2: admission refuses a step ahead of it
        buf.sample_nowait(2, 1)
    for step in range(3):
        uid = f"g{step}"
        buf.add_prompt_nowait(uid, global_steps=step, tags=tags)
        buf.put_nowait(uid, np.full((2, 3), step, dtype=np.float16), session_id=0, tags={"r": step / 3})
        buf.put_nowait(uid, np.arange(step, dtype=np.int32), session_id=1)
        if step < 2:
            buf.mark_finished_nowait(uid)
    path = tmp_path / "numpy.ckpt"
    save(buf, path, codec)
    calls: list[str] = []
    for name in ("loads", "load"):
        monkeypatch.setattr(pickle, name, lambda *args, name=name, **kwargs: calls.append(name))
    monkeypatch.setattr(pickle, "Unpickler", lambda *args, **kwargs: calls.append("Unpickler"))
    restored = ReplayBuffer.restore(path, in_flight="keep", payload_codec=codec).buffer
    monkeypatch.undo()
    assert calls == []
    assert checkpoint_content(restored.checkpoint())[:3] == checkpoint_content(buf.checkpoint())[:3]
    for uid in ("g0", "g1", "g2"):
        restored_groups = {g.uid: g for g in restored.checkpoint().groups}
        original_groups = {g.uid: g for g in buf.checkpoint().groups}
        got, want = restored_groups[uid], original_groups[uid]
        assert dict(got.tags) == tags
        assert [dict(t.tags) for t in got.trajectories] == [dict(t.tags) for t in want.trajectories]
        for a, b in zip(got.trajectories, want.trajectories, strict=True):
            assert (a.payload.dtype, a.payload.tolist()) == (b.payload.dtype, b.payload.tolist())


@pytest.mark.parametrize(
    ("where", "bad", "kind"),
    [
        ("group", (1, 2), "tuple"),
        ("group", {1, 2}, "set"),
        ("group", object(), "object"),
        ("group", [1, (2,)], "tuple"),
        ("group", {"inner": {3: "x"}}, "int"),
        ("group", np.float64(0.5), "float64"),
        ("trajectory", ("a",), "tuple"),
        ("sampler_kwargs", (1,), "tuple"),
    ],
)
def test_a_value_json_cannot_hold_is_named_and_the_previous_file_survives(
    tmp_path: Path, where: str, bad: Any, kind: str
) -> None:
    path = tmp_path / "buffer.ckpt"
    save(rich(), path, JSON_CODEC)  # the previous file, which a failed save must leave alone
    before = path.read_bytes()
    config = SamplerConfig(sampler_kwargs={"bad": bad} if where == "sampler_kwargs" else {})
    buf = ReplayBuffer(config, policy=Lenient(config), status_log_interval=None)
    for i in range(300):  # more than one chunk of groups
        buf.put_group_nowait(f"g{i}", [i])
    buf.add_prompt_nowait("culprit", tags={"bad": bad} if where == "group" else None)
    buf.put_nowait("culprit", 1, tags={"bad": bad} if where == "trajectory" else None)
    with pytest.raises(CheckpointError, match=f"'bad'.*{kind}") as info:
        save(buf, path, JSON_CODEC)
    assert "JSON" in str(info.value)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["buffer.ckpt"]


class Lenient(StalenessPolicy):
    """A policy that accepts any sampler_kwargs (to carry a non-JSON one)."""

    def __init__(self, config: SamplerConfig, **kwargs: Any) -> None:
        super().__init__(config)


def test_encode_that_fails_or_returns_no_bytes_is_a_checkpoint_error(tmp_path: Path) -> None:
    buf = rich()
    path = tmp_path / "buffer.ckpt"

    def boom(payload: Any) -> bytes:
        raise ValueError("cannot encode")

    with pytest.raises(CheckpointError, match=r"encode failed for trajectory 'c0_0_0'.*cannot encode"):
        save(buf, path, (boom, JSON_CODEC[1]))
    with pytest.raises(CheckpointError, match="encode must return bytes, got str"):
        save(buf, path, (json.dumps, JSON_CODEC[1]))
    assert list(tmp_path.iterdir()) == []


def test_decode_that_fails_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "buffer.ckpt"
    save(counted_buffer(), path, JSON_CODEC)

    def boom(data: bytes) -> Any:
        raise ValueError("cannot decode")

    # (The message names the trajectory but not the file, unlike every other refusal.)
    assert_refused(
        path, "decode failed.*cannot decode", names_file=False, payload_codec=(JSON_CODEC[0], boom)
    )


def test_a_codec_file_needs_the_codec_and_a_pickle_file_refuses_one(
    tmp_path: Path, saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec_file = tmp_path / "codec.ckpt"
    save(counted_buffer(), codec_file, JSON_CODEC)
    assert_refused(codec_file, "payload_codec")
    calls: list[Any] = []
    monkeypatch.setattr(pickle, "loads", lambda *args, **kwargs: calls.append(args))
    assert_refused(saved, "pickle", payload_codec=JSON_CODEC)
    assert calls == [], "a pickle file was unpickled although a codec was given"


def test_a_container_codec_file_needs_the_codec_and_a_pickle_one_refuses_one(
    container: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rule for the files the older container holds (the fixtures' JSON codec)."""
    assert_refused(CONTAINER_CODEC, "payload_codec")
    calls: list[Any] = []
    monkeypatch.setattr(pickle, "loads", lambda *args, **kwargs: calls.append(args))
    assert_refused(container, "pickle", payload_codec=JSON_CODEC)
    assert calls == [], "a pickle file was unpickled although a codec was given"


@pytest.mark.parametrize("name", ["a?b#c%d.ckpt", "x%3f.ckpt", "ü ñ.ckpt", "file:y.ckpt"])
def test_a_file_name_an_sqlite_uri_would_misread_saves_and_restores(tmp_path: Path, name: str) -> None:
    """``restore`` opens the file through a read-only SQLite URI: ``?``, ``#`` and ``%`` in its
    name are escaped, not read as the URI's query, fragment or escapes."""
    path = tmp_path / name
    save(plain_buffer("a"), path)
    assert uids(path, None) == ["a"]
    assert names(tmp_path) == [name]


# -- save: at once, while the loop serves --------------------------------------------------------


@pytest.mark.anyio
async def test_save_takes_its_checkpoint_at_once_and_the_loop_keeps_serving(tmp_path: Path) -> None:
    """The writer thread is held inside ``encode`` until the loop has changed the buffer: the
    loop runs meanwhile, and the file holds the state of the moment ``save`` was called."""
    with anyio.fail_after(LIMIT):
        buf = ReplayBuffer(SamplerConfig(), status_log_interval=None)
        buf.put_group_nowait("before", ["x"])
        expected = checkpoint_content(buf.checkpoint())
        changed = threading.Event()

        def encode(payload: Any) -> bytes:
            assert changed.wait(LIMIT), "the loop did not run while save wrote"
            return json.dumps(payload).encode()

        async def change() -> None:
            buf.put_group_nowait("after", ["y"])
            await buf.sample(0, 1)  # takes "before"
            changed.set()

        path = tmp_path / "buffer.ckpt"
        async with anyio.create_task_group() as tg:
            tg.start_soon(change)
            await buf.save(path, payload_codec=(encode, JSON_CODEC[1]))
        restored = ReplayBuffer.restore(path, payload_codec=JSON_CODEC).buffer
        assert checkpoint_content(restored.checkpoint()) == expected
        assert isinstance(restored.checkpoint(), BufferCheckpoint)


# -- save refuses what restore refuses; values a file cannot hold; odd codec frames; permissions ----


def names(directory: Path) -> list[str]:
    """The files in ``directory``: no temporary file may be left behind."""
    return sorted(p.name for p in directory.iterdir())


def small() -> ReplayBuffer:
    """A buffer holding one finished group of two payloads."""
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
    """Defect: ``save`` accepted a ``payload_codec`` that ``restore`` refuses (ConfigError). It
    must refuse it before it writes anything, even when no payload would call ``encode``."""
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
    """Defect: a codec whose ``encode`` returns a memoryview of non-byte items (``ndarray.data``)
    wrote a frame length counted in items, not bytes, and the file did not restore; a strided
    view must be copied, not torn."""
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
async def test_a_codec_returning_an_empty_multidimensional_view_saves_and_restores(tmp_path: Path) -> None:
    """Defect: ``memoryview(np.zeros((0, 3)))`` cannot be cast to bytes, and save failed with a
    TypeError; it is an empty frame."""
    codec: Any = (lambda value: memoryview(value), lambda data: np.frombuffer(data))
    buf = make()
    buf.put_group_nowait("g", [np.zeros((0, 3)), np.arange(6.0).reshape(2, 3)], global_steps=0)
    path = tmp_path / "ckpt"
    with anyio.fail_after(LIMIT):
        await buf.save(path, payload_codec=codec)
    restored = ReplayBuffer.restore(path, payload_codec=codec, status_log_interval=None).buffer
    batch, _ = restored.sample_nowait(0, 1)
    payloads = [t.payload for t in batch.groups[0].trajectories]
    assert [p.tolist() for p in payloads] == [[], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["tags", "trajectory_tags"])
async def test_the_first_value_json_cannot_hold_is_named_by_its_own_group(tmp_path: Path, where: str) -> None:
    """Defect: ``save`` with a codec named the first value JSON cannot hold by the first group of
    the chunk it was written in, not by its own group."""
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
    """Defect: a payload pickle cannot hold was not a CheckpointError (the error's documented
    meaning: "a value the format cannot hold"). It must name the group and the trajectory, and
    the previous file must survive."""
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
    """The same defect in the config: a ``sampler_kwargs`` value pickle cannot hold is a
    CheckpointError naming the config, and no file is written."""

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
    """Defect: a buffer built as ``ReplayBuffer(config)`` whose config carries ``sampler_kwargs``
    (and names no custom sampler) could not be restored, from a checkpoint object or a file."""
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


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX permissions")
@pytest.mark.anyio
async def test_a_new_checkpoint_file_has_the_permissions_a_plain_open_gives(tmp_path: Path) -> None:
    """Defect: the temporary file the write goes through is made 0o600 (``mkstemp``), and the
    checkpoint file it became kept that mode instead of a plain open's."""
    buf = ReplayBuffer(status_log_interval=None)
    buf.put_group_nowait("a", [1], global_steps=0)
    path = tmp_path / "ckpt"
    with anyio.fail_after(30):
        await buf.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX permissions")
@pytest.mark.anyio
async def test_replacing_a_checkpoint_file_keeps_its_permissions(tmp_path: Path) -> None:
    """The same defect when the file exists: replacing it keeps its permissions, not the
    temporary file's 0o600."""
    buf = ReplayBuffer(status_log_interval=None)
    buf.put_group_nowait("a", [1], global_steps=0)
    path = tmp_path / "ckpt"
    path.write_bytes(b"old")
    path.chmod(0o640)
    with anyio.fail_after(30):
        await buf.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert ReplayBuffer.restore(path, status_log_interval=None).buffer.stats().total.groups == 1


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX permissions")
@pytest.mark.anyio
async def test_a_file_system_that_refuses_chmod_still_takes_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: vfat and some CIFS mounts refuse chmod (EPERM), and save failed there, though a
    plain open works; setting the file's permissions is best effort."""

    def refuse(fd: int, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    buf = make()
    add_group(buf, "a", 0)
    path = tmp_path / "ckpt"
    monkeypatch.setattr(os, "fchmod", refuse)
    with anyio.fail_after(LIMIT):
        await buf.save(path)
    assert ReplayBuffer.restore(path, status_log_interval=None).buffer.stats().total.groups == 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary file left


# -- issue 21: what the tests below share --------------------------------------------------------


class Gate:
    """A JSON codec whose first ``encode`` says it entered, then blocks until released: a save
    made slow deterministically, at a known point in the middle of its write."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.codec = (self.encode, JSON_CODEC[1])

    def encode(self, payload: Any) -> bytes:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(LIMIT), "never released"
        return JSON_CODEC[0](payload)

    async def wait_entered(self) -> None:
        assert await anyio.to_thread.run_sync(self.entered.wait, LIMIT), "the save never wrote"


def uids(path: Path, codec: Any = JSON_CODEC) -> list[str]:
    """The uids of the groups the file at ``path`` holds, in admission order."""
    buf = ReplayBuffer.restore(path, in_flight="keep", payload_codec=codec, status_log_interval=None).buffer
    return [group.uid for group in buf.checkpoint().groups]


def temporaries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith(".stalebuf-"))


def plain_buffer(*uids: str) -> ReplayBuffer:
    buf = ReplayBuffer(SamplerConfig(), status_log_interval=None)
    for uid in uids:
        buf.put_group_nowait(uid, [uid])
    return buf


def dead_pid() -> int:
    """The PID of a process that ran and was reaped."""
    with subprocess.Popen([sys.executable, "-c", ""]) as process:
        process.wait()
    return process.pid


# -- what restore opens (issue 21, item 10) -----------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_fifo_or_a_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    """Issue 21, item 10: ``restore`` of a FIFO blocked forever (and read any device to its end).
    Anything but a regular file is a CheckpointError, before a byte is read."""
    fifo = tmp_path / "pipe.ckpt"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def restore() -> None:
        try:
            ReplayBuffer.restore(fifo)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=restore, daemon=True)
    thread.start()
    thread.join(LIMIT)
    if thread.is_alive():  # opening the writing end lets the blocked open return
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(LIMIT)
        pytest.fail("restore blocked on a FIFO")
    assert len(errors) == 1
    assert isinstance(errors[0], CheckpointError)
    assert "a FIFO, not a regular file" in str(errors[0])
    assert str(fifo) in str(errors[0])
    device = tmp_path / "null.ckpt"
    device.symlink_to(os.devnull)
    assert_refused(device, "a device, not a regular file")


@pytest.mark.parametrize("head", ["foreign", "a header with another length"])
def test_a_huge_file_is_refused_from_its_header_without_reading_it(tmp_path: Path, head: str) -> None:
    """Issue 21, item 10: ``restore`` read the whole file before checking it (a 3 GB foreign
    file: MemoryError). The magic, version and size are checked first, from one small read."""
    path = tmp_path / "huge.ckpt"
    with open(path, "wb") as file:
        if head != "foreign":
            file.write(MAGIC + HEADER.pack(FORMAT_VERSION, 0, 10, b"\0" * 32))
    os.truncate(path, 3 << 30)  # sparse: costs no disk
    tracemalloc.start()
    try:
        started = time.perf_counter()
        body = (3 << 30) - len(MAGIC) - HEADER.size
        assert_refused(path, "not a stalebuf checkpoint" if head == "foreign" else f"{body} of 10 bytes")
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert elapsed < 1.0, elapsed


# -- what save replaces (issue 21, item 14) -----------------------------------------------------


def test_save_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    """Issue 21, item 14: ``save(path)`` through a symlink replaced the link with a file (its
    target went stale). The write goes to the resolved target; the links stay links."""
    real, links = tmp_path / "real", tmp_path / "links"
    real.mkdir()
    links.mkdir()
    target = real / "buffer.ckpt"
    save(plain_buffer("a"), target)
    link = links / "latest.ckpt"
    link.symlink_to(os.path.relpath(target, links))
    chain = links / "chain.ckpt"
    chain.symlink_to(link)
    save(plain_buffer("b"), chain)
    assert os.readlink(link) == os.path.relpath(target, links)
    assert os.readlink(chain) == str(link)
    assert uids(target, None) == ["b"]
    dangling = links / "next.ckpt"  # a link to a file not written yet: the file is created
    dangling.symlink_to(real / "next.ckpt")
    save(plain_buffer("c"), dangling)
    assert dangling.is_symlink()
    assert uids(real / "next.ckpt", None) == ["c"]
    assert sorted(p.name for p in real.iterdir()) == ["buffer.ckpt", "next.ckpt"]
    assert sorted(p.name for p in links.iterdir()) == ["chain.ckpt", "latest.ckpt", "next.ckpt"]


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX permissions")
@pytest.mark.parametrize("through_link", [False, True])
def test_a_read_only_checkpoint_is_kept_and_save_raises_permission_error(
    tmp_path: Path, through_link: bool
) -> None:
    """Issue 21, item 14: a read-only file at ``path`` was silently replaced. ``save`` raises
    PermissionError (as a plain open would) and leaves it as it was; root included, since a
    file nobody may write (chmod a-w) is one someone meant to keep."""
    target = tmp_path / "buffer.ckpt"
    save(plain_buffer("a"), target)
    before = target.read_bytes()
    target.chmod(0o444)
    path = target
    if through_link:
        path = tmp_path / "link.ckpt"
        path.symlink_to(target)
    with pytest.raises(PermissionError, match="read-only") as info:
        save(plain_buffer("b"), path)
    assert info.value.errno == errno.EACCES
    assert target.read_bytes() == before
    assert stat.S_IMODE(target.stat().st_mode) == 0o444
    assert path.is_symlink() == through_link
    assert temporaries(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_save_refuses_to_replace_a_fifo_or_a_symlink_loop(tmp_path: Path) -> None:
    """Issue 21, item 14: what is not a regular file is not replaced either: a FIFO is a
    CheckpointError, a symlink loop the OSError a plain open gives (ELOOP)."""
    fifo = tmp_path / "pipe.ckpt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="a FIFO, not a regular file"):
        save(plain_buffer("a"), fifo)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    first, second = tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    first.symlink_to(second)
    second.symlink_to(first)
    with pytest.raises(OSError, match="symbolic links") as info:
        save(plain_buffer("a"), first)
    assert info.value.errno == errno.ELOOP
    assert first.is_symlink()
    assert second.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.ckpt", "pipe.ckpt", "second.ckpt"]


# -- stale temporary files (issue 21, item 9) ---------------------------------------------------


@pytest.mark.parametrize("next_call", ["save", "restore"])
def test_stale_temporaries_are_removed_by_the_documented_rule(tmp_path: Path, next_call: str) -> None:
    """Issue 21, item 9: nothing removed the temporary file of a killed writer. The next save or
    restore of the path removes those of its own target whose writer is gone: on this host and
    PID namespace, a dead PID (or this process's, not being written: a restarted container's
    PID 1); anywhere, unmodified for ``STALE_AFTER_SECONDS``. Nothing else."""
    path = tmp_path / "buffer.ckpt"
    save(plain_buffer("a"), path)
    prefix, host = _prefix(os.path.realpath(path)), _host()
    other_target, other_host = _prefix(os.path.realpath(tmp_path / "other.ckpt")), "0" * 8
    dead, alive, me = dead_pid(), os.getppid(), os.getpid()
    recent = {
        f"{prefix}{host}-{dead}-aaaaaaaa.tmp": False,
        f"{prefix}{host}-{me}-bbbbbbbb.tmp": False,
        f"{prefix}{host}-{alive}-cccccccc.tmp": True,  # a live writer's
        f"{prefix}{other_host}-{dead}-dddddddd.tmp": True,  # its PID means nothing here
        f"{other_target}{host}-{dead}-eeeeeeee.tmp": True,  # another target's
        ".stalebuf-ffffffff.tmp": True,  # an older stalebuf's: by age only
        f"{prefix}not-ours.tmp": True,
        "notes.txt": True,
    }
    aged = {
        f"{prefix}{other_host}-{alive}-gggggggg.tmp": False,
        f"{prefix}{host}-{alive}-hhhhhhhh.tmp": False,
        ".stalebuf-iiiiiiii.tmp": False,
        f"{other_target}{host}-{alive}-jjjjjjjj.tmp": True,
    }
    old = time.time() - STALE_AFTER_SECONDS - 60
    for name in [*recent, *aged]:
        (tmp_path / name).write_bytes(b"x" * 100)
        if name in aged:
            os.utime(tmp_path / name, (old, old))
    (tmp_path / f"{prefix}{host}-{dead}-kkkkkkkk.tmp").mkdir()  # not a file: never removed
    if next_call == "save":
        save(plain_buffer("b"), path)
    else:
        ReplayBuffer.restore(path, status_log_interval=None)
    kept = {name for name, keep in [*recent.items(), *aged.items()] if keep}
    kept |= {"buffer.ckpt", f"{prefix}{host}-{dead}-kkkkkkkk.tmp"}
    assert {p.name for p in tmp_path.iterdir()} == kept
    assert uids(path, None) == (["b"] if next_call == "save" else ["a"])


@pytest.mark.anyio
async def test_a_temporary_this_process_is_writing_is_kept_whatever_its_age(tmp_path: Path) -> None:
    """The cleanup never takes the temporary of a live save in this process (another buffer's
    here), even one unmodified for longer than ``STALE_AFTER_SECONDS``."""
    with anyio.fail_after(LIMIT):
        path, slow = tmp_path / "buffer.ckpt", Gate()
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(plain_buffer("slow").save, path, payload_codec=slow.codec))
            await slow.wait_entered()
            (temporary,) = temporaries(tmp_path)
            old = time.time() - STALE_AFTER_SECONDS - 60
            os.utime(temporary, (old, old))
            await plain_buffer("fast").save(path, payload_codec=JSON_CODEC)
            uids(path)  # a restore too
            assert temporaries(tmp_path) == [temporary]
            slow.release.set()
        assert uids(path) == ["slow"]  # another buffer: not ordered with it, it landed last
        assert temporaries(tmp_path) == []


# -- overlapping and cancelled saves (issue 21, item 2) -----------------------------------------


@pytest.mark.anyio
async def test_a_save_overtaken_by_a_later_one_does_not_land_over_it(tmp_path: Path) -> None:
    """Issue 21, item 2: a big save started first finished after a small save started later and
    renamed the older checkpoint over the newer one (a resume then trained groups again)."""
    with anyio.fail_after(LIMIT):
        buf, path, slow = plain_buffer("old"), tmp_path / "buffer.ckpt", Gate()
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(buf.save, path, payload_codec=slow.codec))
            await slow.wait_entered()
            buf.put_group_nowait("new", ["new"])
            await buf.save(path, payload_codec=JSON_CODEC)  # started later, finishes first
            assert uids(path) == ["old", "new"]
            slow.release.set()
        assert uids(path) == ["old", "new"]
        assert temporaries(tmp_path) == []


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(3))
async def test_saves_started_every_step_end_with_the_last_state_whatever_order_they_finish_in(
    tmp_path: Path, seed: int
) -> None:
    """Issue 21, item 2: ``tg.start_soon(buffer.save, path)`` at every step, the writes finishing
    in a random order: the file ends holding the state of the save started last."""
    with anyio.fail_after(LIMIT):
        buf, path, count = plain_buffer(), tmp_path / "buffer.ckpt", 8
        gates = [Gate() for _ in range(count)]
        done = [anyio.Event() for _ in range(count)]

        async def save(step: int) -> None:
            await buf.save(path, payload_codec=gates[step].codec)
            done[step].set()

        order = random.Random(seed).sample(range(count), count)
        assert order[-1] != count - 1  # else the unordered writes would end right by chance
        async with anyio.create_task_group() as tg:
            for step in range(count):
                buf.put_group_nowait(f"g{step}", [step])
                tg.start_soon(save, step)
                await gates[step].wait_entered()
            for step in order:
                gates[step].release.set()
                await done[step].wait()
        assert uids(path) == [f"g{step}" for step in range(count)]
        assert temporaries(tmp_path) == []


@pytest.mark.anyio
async def test_a_later_save_that_fails_leaves_the_earlier_one_to_land(tmp_path: Path) -> None:
    """The order skips only a save overtaken by one that landed: when the later save fails, the
    earlier one, the newest state written, still lands."""
    with anyio.fail_after(LIMIT):
        buf, path, slow = plain_buffer("old"), tmp_path / "buffer.ckpt", Gate()
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(buf.save, path, payload_codec=slow.codec))
            await slow.wait_entered()
            buf.put_group_nowait("bad", [object()])  # JSON cannot hold it
            with pytest.raises(CheckpointError, match="encode failed"):
                await buf.save(path, payload_codec=JSON_CODEC)
            slow.release.set()
        assert uids(path) == ["old"]
        assert temporaries(tmp_path) == []


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["cancel", "fail_after"])
async def test_a_save_cancelled_mid_write_lands_nothing_and_leaves_no_temporary(
    tmp_path: Path, how: str
) -> None:
    """Issue 21, item 2: a cancelled save stops its writer (which ran to the end and renamed
    before), waits for it to remove its temporary file, and leaves the order intact."""
    with anyio.fail_after(LIMIT):
        buf, path, gate = plain_buffer("old"), tmp_path / "buffer.ckpt", Gate()
        await buf.save(path, payload_codec=JSON_CODEC)
        buf.put_group_nowait("new", ["new"])
        scope = anyio.CancelScope()
        outcome: list[str] = []
        deadlines: list[anyio.CancelScope] = []

        async def save() -> None:
            try:
                with scope, anyio.fail_after(LIMIT) as deadline:
                    deadlines.append(deadline)
                    await buf.save(path, payload_codec=gate.codec)
            except TimeoutError:
                outcome.append("timed out")
            else:
                outcome.append("cancelled" if scope.cancelled_caught else "returned")

        async with anyio.create_task_group() as tg:
            tg.start_soon(save)
            await gate.wait_entered()
            if how == "cancel":
                scope.cancel()
            else:  # the deadline passes mid-write (set then: a fixed one raced the save's start)
                deadlines[0].deadline = anyio.current_time()
            await anyio.wait_all_tasks_blocked()  # the save saw it, and waits for its writer
            assert outcome == []
            assert len(temporaries(tmp_path)) == 1
            gate.release.set()
        assert outcome == ["cancelled" if how == "cancel" else "timed out"]
        assert uids(path) == ["old"]
        assert temporaries(tmp_path) == []
        await buf.save(path, payload_codec=JSON_CODEC)
        assert uids(path) == ["old", "new"]


@pytest.mark.anyio
@pytest.mark.parametrize("then", ["a newer save lands", "the older save lands"])
async def test_a_cancelled_save_does_not_disturb_the_order(tmp_path: Path, then: str) -> None:
    """An older save in flight, a newer one cancelled: the cancelled one takes no place in the
    order (the older may land), and a save started after both still wins."""
    with anyio.fail_after(LIMIT):
        buf, path, older, cancelled = plain_buffer("a"), tmp_path / "buffer.ckpt", Gate(), Gate()
        scope = anyio.CancelScope()

        async def cancellable() -> None:
            with scope:
                await buf.save(path, payload_codec=cancelled.codec)

        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(buf.save, path, payload_codec=older.codec))
            await older.wait_entered()
            buf.put_group_nowait("b", ["b"])
            tg.start_soon(cancellable)
            await cancelled.wait_entered()
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            cancelled.release.set()
            if then == "a newer save lands":
                buf.put_group_nowait("c", ["c"])
                await buf.save(path, payload_codec=JSON_CODEC)
            older.release.set()
        assert uids(path) == (["a", "b", "c"] if then == "a newer save lands" else ["a"])
        assert temporaries(tmp_path) == []


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(4))
async def test_random_overlapping_and_cancelled_saves_end_with_the_newest_not_cancelled(
    tmp_path: Path, seed: int
) -> None:
    """Issue 21, item 2, model-based: saves started one per step, a random subset cancelled in
    the middle of their write, all finishing in a random order. The file ends holding the
    state of the newest save not cancelled, and no temporary file is left."""
    rng = random.Random(seed)
    with anyio.fail_after(LIMIT):
        buf, path, count = plain_buffer(), tmp_path / "buffer.ckpt", 10
        gates = [Gate() for _ in range(count)]
        scopes = [anyio.CancelScope() for _ in range(count)]
        done = [anyio.Event() for _ in range(count)]

        async def save(step: int) -> None:
            with scopes[step]:
                await buf.save(path, payload_codec=gates[step].codec)
            done[step].set()

        cancelled = set(rng.sample(range(count), rng.randint(1, count - 1)))
        async with anyio.create_task_group() as tg:
            for step in range(count):
                buf.put_group_nowait(f"g{step}", [step])
                tg.start_soon(save, step)
                await gates[step].wait_entered()
            for step in rng.sample(range(count), count):
                if step in cancelled:
                    scopes[step].cancel()
                    await anyio.wait_all_tasks_blocked()  # it saw it: it waits for its writer
                gates[step].release.set()
                await done[step].wait()
        newest = max(set(range(count)) - cancelled)
        assert uids(path) == [f"g{step}" for step in range(newest + 1)]
        assert temporaries(tmp_path) == []


@pytest.mark.anyio
async def test_a_buffer_still_pickles_and_deep_copies_with_its_save_order(tmp_path: Path) -> None:
    """The order's lock must not make a buffer unpicklable (it was picklable before): a copy
    starts with no save in flight, and saves on its own."""
    with anyio.fail_after(LIMIT):
        buf = plain_buffer("a")
        for number, copied in enumerate((pickle.loads(pickle.dumps(buf)), copy.deepcopy(buf))):
            path = tmp_path / f"{number}.ckpt"
            await copied.save(path)
            assert uids(path, None) == ["a"]


# -- crafted files and values: every field checked (issue 21, item 4) ----------------------------
#
# The checksum is unkeyed: anyone can recompute it, so a checksum-valid file can hold anything a
# pickle or JSON can say, and a BufferCheckpoint can be built by hand. restore must refuse every
# impossible one with a CheckpointError naming the field (and the file), and build nothing.


class Text(str):
    """A str subclass (numpy's ``str_`` is one): it can answer differently from its value."""


class Count(int):
    """An int subclass."""


class Unreadable(dict):  # type: ignore[type-arg]
    """A mapping whose reads raise (pickle still copies its items, through ``dict.items``)."""

    def __getitem__(self, key: object) -> Any:
        raise RuntimeError("read")

    def keys(self) -> Any:
        raise RuntimeError("read")

    def __iter__(self) -> Any:
        raise RuntimeError("read")


def _read_only(mapping: dict[str, Any]) -> Any:
    """What a crafted pickle calls to load a read-only mapping over ``mapping``."""
    return MappingProxyType(mapping)


def _forged(kind: type, values: tuple[Any, ...]) -> Any:
    """What a crafted pickle calls to load an attrs record with ``values`` set as they are."""
    record = object.__new__(kind)
    for field, value in zip(attrs.fields(kind), values, strict=True):
        object.__setattr__(record, field.name, value)
    return record


def forge(record: Any, **changes: Any) -> Any:
    """A copy of the attrs record ``record`` with ``changes`` set as they are (no converter, no
    validator runs): what a crafted pickle can load."""
    values = tuple(changes.get(f.name, getattr(record, f.name)) for f in attrs.fields(type(record)))
    return _forged(type(record), values)


def raw(record: Any, **changes: Any) -> Any:
    """A copy of a Group or Trajectory record (a lazily stored group too) with ``changes`` set as
    they are (for a lazily stored group, ``trajectories`` is its payloads)."""
    names = (*record._fields, "_runs") if isinstance(record, Trajectory) else record._fields
    values = dict(zip(names, tuple.__iter__(record), strict=True))
    values.update(changes)
    return tuple.__new__(type(record), tuple(values.values()))


class _Crafter(pickle.Pickler):
    """Pickles records as they are, bypassing their own pickle forms (which rebuild them through
    checks): the pickle a hostile writer would craft."""

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if isinstance(obj, (Group, Trajectory)):
            return tuple.__new__, (kind, tuple(tuple.__iter__(obj)))
        if kind is MappingProxyType:
            return _read_only, (gc.get_referents(obj)[0],)
        if kind in (BufferCheckpoint, PartitionCheckpoint, SamplerConfig):
            return _forged, (kind, tuple(getattr(obj, f.name) for f in attrs.fields(kind)))
        return NotImplemented


def crafted_pickle(value: Any) -> bytes:
    out = io.BytesIO()
    _Crafter(out, protocol=5).dump(value)
    return out.getvalue()


def write_crafted(path: Path, flags: int, frames: list[bytes]) -> None:
    """Write ``frames`` as a container file with a valid header and checksum (the documented
    layout: magic, version, flags, length, the SHA-256 of the header fields and the body's)."""
    body = b"".join(struct.pack(">Q", len(frame)) + frame for frame in frames)
    fields = struct.pack(">IIQ", FORMAT_VERSION, flags, len(body))
    digest = hashlib.sha256(fields + hashlib.sha256(body).digest()).digest()
    path.write_bytes(MAGIC + HEADER.pack(FORMAT_VERSION, flags, len(body), digest) + body)


def write_crafted_pickle(path: Path, checkpoint: BufferCheckpoint) -> None:
    groups = tuple(checkpoint.groups) if type(checkpoint.groups) in (tuple, list) else checkpoint.groups
    count = len(groups) if isinstance(groups, tuple) else 0
    manifest = crafted_pickle((forge(checkpoint, groups=()), count))
    write_crafted(path, 0, [manifest, struct.pack(">I", 0) + crafted_pickle(groups)] if count else [manifest])


def frame(data: bytes) -> bytes:
    """``data`` preceded by its length (8 bytes, big-endian): a frame of a container's body, or of
    a group's record in a codec SQLite file."""
    return len(data).to_bytes(8, "big") + data


def frames_in(blob: bytes) -> list[bytes]:
    """The frames of ``blob`` (see :func:`frame`)."""
    offset, frames = 0, []
    while offset < len(blob):
        size = int.from_bytes(blob[offset : offset + 8], "big")
        frames.append(blob[offset + 8 : offset + 8 + size])
        offset += 8 + size
    return frames


def write_crafted_db(path: Path, state: bytes, records: list[bytes], codec: Any = None) -> None:
    """Write ``state`` and ``records`` as an SQLite checkpoint file with a valid digest (the
    documented layout: the journal's schema, kind "checkpoint", one ``groups`` row per record in
    order, and the SHA-256 of the state and records, each preceded by its length)."""
    path.unlink(missing_ok=True)
    digest = hashlib.sha256(b"".join(frame(blob) for blob in (state, *records))).digest()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("BEGIN")
        create_schema(db, "checkpoint", codec)
        for key, value in (("state", state), ("seq", 0), ("next_gid", len(records)), ("digest", digest)):
            write_key(db, key, value)
        rows = [(gid, f"g{gid}", "train", record) for gid, record in enumerate(records)]
        db.executemany(
            "INSERT INTO groups (gid, uid, partition, admitted, record) VALUES (?, ?, ?, 0, ?)", rows
        )
        db.execute("COMMIT")


def write_crafted_pickle_db(path: Path, checkpoint: BufferCheckpoint) -> None:
    groups = tuple(checkpoint.groups) if type(checkpoint.groups) in (tuple, list) else ()
    write_crafted_db(path, crafted_pickle(forge(checkpoint, groups=())), [crafted_pickle(g) for g in groups])


#: How a crafted pickle file is written, in each format.
CRAFTERS = {"container": write_crafted_pickle, "sqlite": write_crafted_pickle_db}


@functools.lru_cache(maxsize=1)
def valid() -> BufferCheckpoint:
    """The rich buffer's checkpoint, plus a lazily stored group (groups[10], in "val"): groups[0]
    c0 and groups[1] c1 are FINISHED (c1 with two tagged trajectories), groups[2] c2 RUNNING with
    two; partitions train, val, other; clocks train, other and ghost; evicted b0 and b1."""
    buf = counted_buffer()
    buf.put_group_nowait("L0", ["p", "q"], partition="val")
    checkpoint = buf.checkpoint()
    assert [g.uid for g in checkpoint.groups][:3] == ["c0", "c1", "c2"]
    assert checkpoint.groups[10].uid == "L0"
    assert type(checkpoint.groups[10]) is not Group
    return checkpoint


def group(index: int, /, **changes: Any) -> Any:
    """``valid()`` with ``groups[index]``'s fields changed as they are."""
    ckpt = valid()
    groups = list(ckpt.groups)
    groups[index] = raw(groups[index], **changes)
    return forge(ckpt, groups=tuple(groups))


def trajectory(index: int, position: int, /, **changes: Any) -> Any:
    """``valid()`` with ``groups[index].trajectories[position]``'s fields changed."""
    records = list(valid().groups[index].trajectories)
    records[position] = raw(records[position], **changes)
    return group(index, trajectories=tuple(records))


def partition(index: int, /, **changes: Any) -> Any:
    ckpt = valid()
    partitions = list(ckpt.partitions)
    partitions[index] = forge(partitions[index], **changes)
    return forge(ckpt, partitions=tuple(partitions))


def counters(index: int, **changes: Any) -> Any:
    return partition(index, counters={**valid().partitions[index].counters, **changes})


def config(**changes: Any) -> Any:
    return forge(valid(), config=forge(valid().config, **changes))


def _counter(name: str, delta: int) -> Any:
    return counters(0, **{name: valid().partitions[0].counters[name] + delta})


def cases(field: str, make: Any, *values: Any) -> list[Any]:
    """One case per value: the checkpoint ``make(value)`` must be refused, naming ``field``."""
    return [
        pytest.param(functools.partial(make, value), field, id=f"{field}-{i}")
        for i, value in enumerate(values)
    ]


def first_trajectory() -> tuple[Trajectory, ...]:
    return valid().groups[1].trajectories[:1]


def train() -> PartitionCheckpoint:
    return valid().partitions[0]


def _with_group(value: Any) -> Any:
    return forge(valid(), groups=(*valid().groups[:3], value))


_BAD_STEPS = (-1, True, 1.0, "1", None, 2**63, 2**200, Count(1))
_BAD_UIDS = ("", "a_b", "\udcff", 5, None, Text("c0"), b"c0")
_BAD_TAGS = (5, "x", ["a"], Unreadable(a=1), MappingProxyType(Unreadable(a=1)))
_NOT_SEQUENCES = (None, "x", 5, {"x": 1})
_EMPTY = MappingProxyType({})

#: (how to make ``valid()`` impossible, what the error must name).
IMPOSSIBLE: list[Any] = [
    *cases("format_version", lambda v: forge(valid(), format_version=v), 0, -1, True, "2", 2.0, None,
           FORMAT_VERSION + 1, 2**100),
    *cases("config", lambda v: forge(valid(), config=v), None, {}, "config"),
    *cases("config", lambda v: config(**v), {"max_off_policy_threshold": -1},
           {"max_off_policy_strategy": "x"}, {"sampler_kwargs": {"not id": 1}}, {"exempt_partitions": "val"},
           {"admission_batch_size": 0}),
    *cases("policy", lambda v: forge(valid(), policy=v), 5, "", "module", "module:", ":Name", "a b:C",
           "m:f.<locals>.P", Text("m:P"), b"m:P",
           "stalebuf:StalenessPolicy"),  # a valid name, but the config names a custom sampler
    *cases("groups", lambda v: forge(valid(), groups=v), *_NOT_SEQUENCES),
    *cases("groups[3]", _with_group, None, 5, "g", (1, 2), Trajectory("c0_0_0", 0, 0, _EMPTY, 1),
           tuple.__new__(Group, ("c0", "train"))),
    *cases("groups[0].uid", lambda v: group(0, uid=v), *_BAD_UIDS),
    *cases("groups[11].uid", lambda i: forge(valid(), groups=(*valid().groups, valid().groups[i])), 0),
    *cases("groups[0].partition", lambda v: group(0, partition=v), "", "\udcff", 5, None, Text("train"),
           "nowhere"),
    *cases("groups[0].dispatch_step", lambda v: group(0, dispatch_step=v), *_BAD_STEPS),
    *cases("groups[0].status", lambda v: group(0, status=v), "finished", None, 1, True),
    *cases("groups[0].tags", lambda v: group(0, tags=v), *_BAD_TAGS),
    *cases("groups[0].finish_step", lambda v: group(0, finish_step=v), *_BAD_STEPS, 2),  # 2: before 3
    *cases("groups[0].generation_seconds", lambda v: group(0, generation_seconds=v), math.nan, math.inf,
           -math.inf, -1.0, "1", None, True, 10**400),
    *cases("groups[1].trajectories", lambda v: group(1, trajectories=v), None, "ab", 5, (1,),
           (Group("x", "train", 0, Status.FINISHED, _EMPTY, ()),),
           (tuple.__new__(Trajectory, ("c1_0_0", 0)),)),
    *cases("groups[10].trajectories", lambda v: group(10, trajectories=v), None, "ab", ["p", "q"]),
    *cases("groups[1].trajectories[1].key", lambda n: group(1, trajectories=first_trajectory() * n), 2),
    *cases("groups[1].trajectories[1].key", lambda v: trajectory(1, 1, key=v), "x", "c1_0_0", "c0_1_0",
           "c1_1_1", Text("c1_1_0"), 5, None),
    *cases("groups[1].trajectories[1].session_id", lambda v: trajectory(1, 1, session_id=v), *_BAD_STEPS),
    *cases("groups[1].trajectories[1].index", lambda v: trajectory(1, 1, index=v), *_BAD_STEPS),
    *cases("groups[1].trajectories[1].tags", lambda v: trajectory(1, 1, tags=v), *_BAD_TAGS),
    # Versions, tokens and start versions (issue 22): what put and mark_running would refuse,
    # tokens that disagree with their versions, and token counters that do not conserve them.
    *cases("groups[0].start_version", lambda v: group(0, start_version=v), *_BAD_STEPS),
    *cases("groups[10].start_version", lambda v: group(10, start_version=v), -1, None, True),
    *cases("groups[1].trajectories[1].versions", lambda v: trajectory(1, 1, versions=v, tokens=3), None, 5,
           "ab", {(1, 3)}, {"a": 1}, ((1,),), ((1, 2, 3),), (5,), ("ab",), ((-1, 3),), ((True, 3),),
           ((1.0, 3),), (("1", 3),), ((Count(1), 3),), ((2**63, 3),), ((1, 0),), ((1, -3),), ((1, True),),
           ((1, 3.0),), ((1, 2**63),), ((0, 1), (1, 2**63 - 1))),
    *cases("groups[1].trajectories[1].tokens",
           lambda v: trajectory(1, 1, versions=((1, 2), (0, 3)), tokens=v), 4, 6, 0, -1, True, 5.0, "5", None,
           Count(5)),
    *cases("groups[1].trajectories[1].tokens", lambda v: trajectory(1, 1, versions=(), tokens=v),
           -1, True, 1.0, "1", None, 2**63, Count(1)),
    *cases("partitions[0].counters", lambda v: _counter(*v), ("admitted_tokens", 1), ("sampled_tokens", 1),
           ("evicted_tokens", 1), ("reissued_tokens", 1), ("masked_tokens", 1)),  # masked: more than sampled
    # Tokens resident that the counters (given, all 0) never admitted.
    *cases("partitions[0].counters", lambda v: trajectory(1, 1, versions=v, tokens=2), ((7, 2),)),
    *cases("partitions", lambda v: forge(valid(), partitions=v), *_NOT_SEQUENCES),
    *cases("partitions[0]", lambda v: forge(valid(), partitions=(v,)), None, ("train", 1, {})),
    *cases("partitions[3].name", lambda i: forge(valid(), partitions=(*valid().partitions, train())), 0),
    *cases("partitions[0].name", lambda v: partition(0, name=v), "", "\udcff", 5, None, Text("train")),
    *cases("partitions[0].last_sampled", lambda v: partition(0, last_sampled=v), -2, True, "1", None, 1.0,
           2**63, 4),  # 4: past the clock, 3
    *cases("partitions[0].counters", lambda v: partition(0, counters=v), None, "x", [("sampled_groups", 1)],
           Unreadable(sampled_groups=1), {5: 1}),
    *cases("partitions[0].counters", lambda v: counters(0, **v), {"bogus": 0}, {"sampled_groups": -1},
           {"sampled_groups": True}, {"sampled_groups": "1"}, {"sampled_groups": 2**63},
           {"sampled_groups": 1.0}),
    *cases("partitions[0].counters", lambda v: _counter(*v), ("admitted_groups", 1), ("admitted_groups", -1),
           ("sampled_groups", 1), ("admitted_trajectories", 1), ("reissued_trajectories", 1),
           ("evicted_in_flight_groups", 3)),  # conservation, and in flight among the stale ones
    *cases("clocks", lambda v: forge(valid(), clocks=v), None, [("train", 3)], Unreadable(train=3),
           {"train": -1}, {"train": "3"}, {"train": True}, {"train": 2**63}, {"": 1}, {5: 1}, {"\udcff": 1},
           {Text("train"): 3}),
    *cases("evicted_in_flight", lambda v: forge(valid(), evicted_in_flight=v), None, "b0", 5, ("a_b",), ("",),
           (5,), (Text("b0"),), ("b0", "b0"), tuple(f"u{i}" for i in range(EVICTED_UIDS_REMEMBERED + 1))),
]  # fmt: skip


@pytest.mark.parametrize("form", CRAFTERS)
@pytest.mark.parametrize(("impossible", "field"), IMPOSSIBLE)
def test_an_impossible_checkpoint_is_refused_naming_its_field(
    impossible: Any, field: str, form: str, tmp_path: Path
) -> None:
    """Defect (issue 21, item 4): a checkpoint no live buffer could have taken (built by hand, or
    in a file whose unkeyed checksum was recomputed) escaped ``restore`` as TypeError,
    AttributeError or ConfigError, or restored into an impossible state (a negative counter, a
    string clock, a uid holding "_"). Each field made wrong, as a value and as a crafted pickle
    file, is a CheckpointError naming the field (and the file), and nothing is built."""
    checkpoint = impossible()
    built = Counted.built
    with pytest.raises(CheckpointError) as info:
        ReplayBuffer.restore(checkpoint)
    assert field in str(info.value)
    path = tmp_path / "crafted.ckpt"
    CRAFTERS[form](path, checkpoint)
    error = assert_refused(path)
    # A crafted pickle may fail to load at all (a converter refuses it): then the file is named.
    assert field in str(error) or "cannot be read" in str(error)
    assert Counted.built == built


def test_the_valid_checkpoint_and_its_crafted_file_restore(tmp_path: Path) -> None:
    """The crafting above changes nothing by itself: the valid checkpoint, its records copied as
    they are, restores to the same content, and so do its crafted pickle files."""
    checkpoint = valid()
    same = forge(checkpoint, groups=tuple(raw(g) for g in checkpoint.groups))
    paths = [tmp_path / f"{form}.ckpt" for form in CRAFTERS]
    for path, write in zip(paths, CRAFTERS.values(), strict=True):
        write(path, checkpoint)
    for source in (same, *paths):
        restored = ReplayBuffer.restore(source, in_flight="keep").buffer
        assert checkpoint_content(restored.checkpoint()) == checkpoint_content(checkpoint)


def positions(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path (keys and indices) of every value inside the JSON ``value``."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return []
    found = []
    for key, item in items:
        found.append((*path, key))
        found.extend(positions(item, (*path, key)))
    return found


_DROP = object()
#: What a crafted codec file puts in place of a JSON value (or _DROP: the key or item is gone).
_JSON_VALUES = (
    None,
    -1,
    2**64,
    True,
    1.5,
    math.nan,
    "x",
    "a_b",
    "",
    "\udcff",
    [],
    {},
    [1, 2],
    {"k": 1},
    _DROP,
)


def restore_or_refusal(path: Path) -> ReplayBuffer | CheckpointError:
    """The buffer restored from the codec file at ``path``, or the CheckpointError refusing it."""
    try:
        return ReplayBuffer.restore(path, in_flight="keep", payload_codec=JSON_CODEC).buffer
    except CheckpointError as exc:
        return exc


@pytest.mark.parametrize("form", ["container", "sqlite"])
def test_a_crafted_codec_file_is_refused_or_restores_a_consistent_buffer(tmp_path: Path, form: str) -> None:
    """Defect (issue 21, item 4), for the codec file's JSON: a value at any position (manifest,
    group rows, trajectory rows) replaced by one of another type or range, or dropped, with the
    checksum recomputed, escaped as a TypeError, KeyError or ValueError from the reader or the
    rebuild, or restored an impossible state. Now restore refuses it with a CheckpointError
    naming the file (building nothing), or restores a buffer that keeps the conservation law and
    whose own checkpoint restores: never anything else. (A seeded sample of the positions.) The
    container is built here as the last release wrote it (one chunk of rows); the SQLite file
    is the one ``save`` wrote, its digest recomputed."""
    buf = counted_buffer()
    buf.put_group_nowait("L0", ["p", "q"], partition="val")
    if form == "container":
        frames: list[bytes] = [plain_manifest(buf.checkpoint())]
        write_plain_groups(buf.checkpoint().groups, JSON_CODEC[0], frames.append)
        manifest, rows, *payloads = frames
        documents = {"manifest": json.loads(manifest), "rows": json.loads(rows)}
    else:
        path = tmp_path / "valid.ckpt"
        save(buf, path, JSON_CODEC)
        with sqlite_read_only(path) as db:
            state = db.execute("SELECT value FROM stalebuf WHERE key = 'state'").fetchone()[0]
            records = [frames_in(r) for (r,) in db.execute("SELECT record FROM groups ORDER BY gid")]
        documents = {"manifest": json.loads(state), "rows": [json.loads(r[0])[0] for r in records]}
    cases = [
        (where, value)
        for name, document in documents.items()
        for where in positions(document, (name,))
        for value in _JSON_VALUES
    ]
    crafted = tmp_path / "crafted.ckpt"
    refused = 0
    for where, value in random.Random(21).sample(cases, 400):
        changed = copy.deepcopy(documents)
        parent = functools.reduce(lambda node, key: node[key], where[:-1], changed)
        if value is _DROP:
            del parent[where[-1]]
        else:
            parent[where[-1]] = value
        if form == "container":
            frames = [json.dumps(changed[name]).encode() for name in ("manifest", "rows")]
            write_crafted(crafted, 1, [*frames, *payloads])
        else:  # each row in its own record, with the payloads of the group that was there
            blobs = [
                b"".join(
                    map(frame, (json.dumps([row]).encode(), *(records[i][1:] if i < len(records) else [])))
                )
                for i, row in enumerate(changed["rows"])
            ]
            write_crafted_db(crafted, json.dumps(changed["manifest"]).encode(), blobs, JSON_CODEC)
        built = Counted.built
        outcome = restore_or_refusal(crafted)
        if isinstance(outcome, CheckpointError):
            assert str(crafted) in str(outcome), (where, value)
            assert Counted.built == built, (where, value)
            refused += 1
        else:
            assert_conserved(outcome)
            ReplayBuffer.restore(outcome.checkpoint(), in_flight="keep")
    assert refused > 200  # most such changes make an impossible checkpoint
