"""The durable format: one SQLite database, written by the journal and by ``save``.

SQLite gives the atomic commit, the crash safety and the integrity check (WAL mode,
``synchronous=FULL``, ``PRAGMA integrity_check`` on open); this module only says what the
tables hold and how a group or the rest of a buffer's state becomes a blob: pickled (the
default), or JSON rows with payloads through the user's codec (no pickle anywhere).

Tables: ``stalebuf`` (key/value: format, kind, codec, the latest state, the sequence counters),
``groups`` (one row per group incarnation, ``gid`` in admission order: admitted at event
``admitted``, its latest ``record``), ``removals`` (a group that left: at event ``removed``, for
``reason``; a row of its own, so that recording it never rewrites the group's record, which
would double what the disk writes), ``samples``
(each committed ``sample`` that returned a batch: its event number, partition, step and the
state right after it), ``commits`` (event number and wall time of each commit) and ``marks``
(the trainer's ``flush(checkpoint_step=g)``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sqlite3
import struct
import threading
from collections.abc import Callable
from typing import Any, Literal

import attrs

from ._checkpoint_codec import (
    plain_manifest,
    read_plain_groups,
    read_plain_manifest,
    write_plain_groups,
    written_counters,
)
from ._checkpoint_file import MAGIC, PayloadCodec, body_frames
from ._checkpoint_path import open_regular
from ._lazy_group import LazyGroup
from ._validation import describe_error
from .checkpoint import BufferCheckpoint
from .errors import CheckpointError
from .records import Group

try:
    import fcntl
except ImportError:  # pragma: no cover (not POSIX)
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "APPLICATION_ID",
    "JOURNAL_FORMAT",
    "SQLITE_MAGIC",
    "StateCodec",
    "connect",
    "create_schema",
    "file_kind",
    "read_key",
    "write_key",
]

#: The format version of the SQLite file (journal or checkpoint); another one is refused.
JOURNAL_FORMAT = 1
#: ``PRAGMA application_id`` of a stalebuf file ("SBUF"): what tells it from another database.
APPLICATION_ID = 0x53425546
SQLITE_MAGIC = b"SQLite format 3\x00"
_FRAME = struct.Struct(">Q")
_HEADER = 100  # bytes of an SQLite file's header
_WAL_HEADER = 32  # bytes of a write-ahead log's header

_SCHEMA = (
    "CREATE TABLE stalebuf (key TEXT PRIMARY KEY, value)",
    "CREATE TABLE groups (gid INTEGER PRIMARY KEY, uid TEXT NOT NULL, partition TEXT NOT NULL, "
    "admitted INTEGER NOT NULL, record BLOB)",
    "CREATE TABLE removals (gid INTEGER PRIMARY KEY, removed INTEGER NOT NULL, reason TEXT NOT NULL)",
    "CREATE INDEX removals_removed ON removals (removed)",
    "CREATE TABLE samples (seq INTEGER PRIMARY KEY, partition TEXT NOT NULL, step TEXT NOT NULL, "
    "state BLOB NOT NULL)",
    "CREATE TABLE commits (seq INTEGER PRIMARY KEY, wall REAL NOT NULL)",
    "CREATE TABLE marks (seq INTEGER PRIMARY KEY, step TEXT NOT NULL, wall REAL NOT NULL)",
)

FileKind = Literal["absent", "empty", "journal", "checkpoint", "container"]


def file_kind(path: str) -> FileKind:
    """What the file at ``path`` is, read without changing it.

    Raises:
        CheckpointError: it is neither absent, empty, a stalebuf SQLite file of this format nor
            a checkpoint of the older container format (it stays as it was): a FIFO, a device
            or a socket among them.
        OSError: it cannot be read (IsADirectoryError: a directory).
    """
    try:  # a FIFO, a device or a socket is refused before a byte is read (a FIFO would block)
        with open_regular(path) as file:
            head = file.read(_HEADER)
    except FileNotFoundError:
        return "absent"
    if not head:
        return "empty"
    if head.startswith(MAGIC[: len(head)]) and len(head) >= 8:
        return "container"
    if not head.startswith(SQLITE_MAGIC):
        raise CheckpointError(f"{path!r} is not a stalebuf journal or checkpoint")
    # The application id is in the header: another program's database is told apart without
    # opening it (SQLite would leave -wal/-shm files beside one in WAL mode). Only while no
    # write-ahead log is beside it: a live journal's first pages may still be in its log.
    foreign = len(head) == _HEADER and int.from_bytes(head[68:72], "big") != APPLICATION_ID
    if foreign and not os.path.exists(path + "-wal"):
        raise CheckpointError(f"{path!r} is an SQLite database, but not a stalebuf journal or checkpoint")
    with contextlib.closing(connect(path, read_only=True)) as connection:
        return _stalebuf_kind(connection, path)


def _stalebuf_kind(connection: sqlite3.Connection, path: str) -> Literal["journal", "checkpoint"]:
    try:
        (application,) = connection.execute("PRAGMA application_id").fetchone()
        if application != APPLICATION_ID:
            raise CheckpointError(f"{path!r} is an SQLite database, but not a stalebuf journal or checkpoint")
        version = read_key(connection, "format")
        kind = read_key(connection, "kind")
    except sqlite3.Error as exc:
        raise CheckpointError(f"{path!r} cannot be read as a stalebuf file: {describe_error(exc)}") from exc
    if version != JOURNAL_FORMAT:
        raise CheckpointError(
            f"{path!r} has stalebuf file format {version!r}; this stalebuf reads format {JOURNAL_FORMAT}"
        )
    if kind not in ("journal", "checkpoint"):
        raise CheckpointError(f"{path!r} holds an unknown kind of stalebuf file {kind!r}")
    return kind  # type: ignore[no-any-return]


def connect(path: str, *, read_only: bool = False) -> sqlite3.Connection:
    """Open the database at ``path`` (created when absent unless ``read_only``), its integrity
    checked; a writer gets WAL mode with ``synchronous=FULL``.

    Raises:
        CheckpointError: the file is torn (not whole pages), SQLite finds it corrupt or torn,
            or cannot open it.
    """
    _check_whole_pages(path)
    lock = None if read_only else _owned(path)
    try:
        if read_only:
            uri = "file:" + _quoted(os.path.abspath(path)) + "?mode=ro"
            connection = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        else:  # a minute for another process's lock: a reader never blocks a WAL writer anyway
            connection = sqlite3.connect(
                path, isolation_level=None, timeout=60.0, check_same_thread=False, factory=_Owner
            )
            connection.release, lock = lock, None
        try:
            (verdict,) = connection.execute("PRAGMA integrity_check").fetchone()
            if verdict != "ok":
                raise CheckpointError(f"{path!r} is corrupt: {verdict}")
            if not read_only:
                connection.execute("PRAGMA journal_mode=WAL")
                connection.execute("PRAGMA synchronous=FULL")
                # After a checkpoint the log is cut back to 64 MiB: its size is not a high-water mark.
                connection.execute(f"PRAGMA journal_size_limit={64 << 20}")
        except BaseException:
            connection.close()
            raise
    except sqlite3.Error as exc:
        raise CheckpointError(f"{path!r} cannot be opened as a stalebuf file: {describe_error(exc)}") from exc
    finally:
        if lock is not None:  # (the connection was not made)
            lock()
    return connection


class _Owner(sqlite3.Connection):
    """A writer's connection: it holds its file's advisory lock until it is closed (``release``)."""

    release: Callable[[], None] | None = None

    def close(self) -> None:
        """Close the connection, then release the lock."""
        try:
            super().close()
        finally:
            release, self.release = self.release, None
            if release is not None:
                release()


#: The files this process's writers hold locked: (device, inode) -> [open file, writers].
_HELD: dict[tuple[int, int], list[Any]] = {}
_HELD_GUARD = threading.Lock()


def _forget_held() -> None:
    """In a forked child: close the inherited lock files (the parent's writers keep the lock;
    the child has none of them) and start with a new guard (the parent's may have been held)."""
    global _HELD_GUARD
    for held in _HELD.values():
        held[0].close()
    _HELD.clear()
    _HELD_GUARD = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_held)


def _owned(path: str) -> Callable[[], None] | None:
    """Lock the file at ``path`` (created if absent) for this process's writers and return what
    releases this writer's hold; None where the lock cannot be taken (no ``flock``, a file system
    without it, a file that cannot be opened: SQLite then says why).

    The lock is ``flock`` (not SQLite's own locks, which a WAL writer holds only while it
    writes), taken once per process: a process may recover a journal its unclosed buffer still
    holds (a crash simulated in one process), another process may not.

    Raises:
        CheckpointError: another process's buffer journals into it.
    """
    if fcntl is None:  # pragma: no cover (not POSIX)
        return None
    try:
        file = open(path, "ab")  # noqa: SIM115 (held until the last writer of the process closes)
    except OSError:
        return None
    info = os.fstat(file.fileno())
    key = (info.st_dev, info.st_ino)
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is not None:
            file.close()
            held[1] += 1
        else:
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.close()
                raise CheckpointError(
                    f"{path!r} is in use: another process's buffer journals into it (close it, "
                    "or let that process end)"
                ) from None
            except OSError:  # a file system without flock: journal without the lock, as before
                pass
            held = _HELD[key] = [file, 1]

    def release() -> None:
        with _HELD_GUARD:
            held[1] -= 1
            if held[1] == 0 and _HELD.get(key) is held:  # (a forked child forgot it)
                del _HELD[key]
                held[0].close()

    return release


def _check_whole_pages(path: str) -> None:
    """Refuse a database file that is not a whole number of its pages: SQLite writes whole pages,
    and reads the bytes missing from a page cut short as zeros (its checks then pass). Not while
    a write-ahead log is beside it: SQLite rebuilds pages from the log.

    Raises:
        CheckpointError: the file is torn.
    """
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            head = file.read(_HEADER)
    except FileNotFoundError:  # (a new file)
        return
    log = 0
    with contextlib.suppress(OSError):
        log = os.stat(path + "-wal").st_size
    if not size or log >= _WAL_HEADER:
        return
    page = int.from_bytes(head[16:18], "big") if len(head) == _HEADER else 0
    page = 65536 if page == 1 else page
    if not page or size % page:
        raise CheckpointError(
            f"{path!r} is torn: truncated or with trailing data ({size} bytes is not a whole number "
            f"of {page}-byte pages)"
        )


def _quoted(path: str) -> str:
    """``path`` escaped for an SQLite URI (``?`` and ``#`` would end it, ``%`` start an escape)."""
    return path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")


def create_schema(connection: sqlite3.Connection, kind: str, codec: PayloadCodec | None) -> None:
    """Create the tables of a new stalebuf file of ``kind`` ("journal" or "checkpoint") inside
    the caller's transaction."""
    connection.execute("PRAGMA auto_vacuum=INCREMENTAL")  # deleted history gives its pages back
    connection.execute(f"PRAGMA application_id={APPLICATION_ID}")
    for statement in _SCHEMA:
        connection.execute(statement)
    write_key(connection, "format", JOURNAL_FORMAT)
    write_key(connection, "kind", kind)
    write_key(connection, "codec", "pickle" if codec is None else "plain")


def read_key(connection: sqlite3.Connection, key: str) -> Any:
    """The value of ``key`` in the ``stalebuf`` table (None if absent)."""
    row = connection.execute("SELECT value FROM stalebuf WHERE key = ?", (key,)).fetchone()
    return None if row is None else row[0]


def write_key(connection: sqlite3.Connection, key: str, value: Any) -> None:
    """Set ``key`` in the ``stalebuf`` table."""
    connection.execute("INSERT OR REPLACE INTO stalebuf (key, value) VALUES (?, ?)", (key, value))


@attrs.frozen
class StateCodec:
    """How groups and the rest of a buffer's state become blobs: pickled when ``codec`` is None,
    else JSON rows with payloads through ``codec`` (``(encode, decode)``)."""

    codec: PayloadCodec | None

    def check_file(self, connection: sqlite3.Connection, path: str) -> None:
        """Raise CheckpointError unless the file at ``path`` was written with this kind of codec."""
        written = read_key(connection, "codec")
        if written == "pickle" and self.codec is not None:
            raise CheckpointError(
                f"{path!r} holds pickled payloads; refusing to unpickle it with a codec given"
            )
        if written == "plain" and self.codec is None:
            raise CheckpointError(
                f"{path!r} was written with a payload codec: pass payload_codec= to read it"
            )
        if written not in ("pickle", "plain"):
            raise CheckpointError(f"{path!r} names an unknown payload codec {written!r}")

    def state(self, checkpoint: BufferCheckpoint) -> bytes:
        """``checkpoint``'s state but its groups, as a blob.

        Raises:
            CheckpointError: a value the format cannot hold (named).
        """
        if self.codec is not None:
            return plain_manifest(checkpoint)
        partitions = tuple(
            attrs.evolve(p, counters=written_counters(p.counters)) for p in checkpoint.partitions
        )
        try:
            return pickle.dumps(attrs.evolve(checkpoint, groups=(), partitions=partitions), protocol=5)
        except Exception as exc:
            raise CheckpointError(f"the config cannot be pickled: {describe_error(exc)}") from exc

    def read_state(self, blob: bytes) -> BufferCheckpoint:
        """The state a :meth:`state` blob holds (its groups empty; checked later, with them).

        Raises:
            CheckpointError: the blob is not one :meth:`state` writes.
        """
        if self.codec is not None:
            return read_plain_manifest(blob)[0]
        checkpoint = _unpickled(blob, "the state")
        if type(checkpoint) is not BufferCheckpoint:
            raise CheckpointError("the file's state is not a BufferCheckpoint")
        return checkpoint

    def group(self, group: Group) -> bytes:
        """``group`` as a blob.

        Raises:
            CheckpointError: a payload the format cannot hold, or ``encode`` failed (named).
        """
        if self.codec is None:
            try:
                return pickle.dumps(group, protocol=5)
            except Exception as exc:
                raise CheckpointError(
                    f"group {group.uid!r} cannot be pickled: {describe_error(exc)}; pass payload_codec= "
                    "to journal or save payloads pickle cannot hold"
                ) from exc
        frames = bytearray()

        def frame(data: bytes | bytearray | memoryview) -> None:
            # A view of 8-byte items (``ndarray.data``) has 8x more bytes than len() says, a
            # strided one cannot be written as it is, an empty one of several dimensions not cast.
            data = memoryview(data)
            if data.itemsize != 1 or data.ndim != 1 or not data.c_contiguous:
                data = data.cast("B") if data.c_contiguous and data.nbytes else memoryview(data.tobytes())
            frames.extend(_FRAME.pack(len(data)))
            frames.extend(data)

        write_plain_groups((group,), self.codec[0], frame)
        return bytes(frames)

    def read_group(self, blob: bytes, where: str) -> Group:
        """The group a :meth:`group` blob holds (checked later, with the rest).

        Raises:
            CheckpointError: the blob is not one :meth:`group` writes, or ``decode`` failed.
        """
        if self.codec is None:
            group = _unpickled(blob, where)
            if type(group) not in (Group, LazyGroup):
                raise CheckpointError(f"{where} is not a group")
            return group  # type: ignore[no-any-return]
        frames = body_frames(memoryview(blob))

        def next_frame() -> memoryview:
            frame = next(frames, None)
            if frame is None:
                raise CheckpointError(f"{where} ends early")
            return frame

        try:
            (group,) = read_plain_groups(next_frame, self.codec[1])
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{where} cannot be read: {describe_error(exc)}") from exc
        return group


def _unpickled(blob: bytes, where: str) -> Any:
    try:
        return pickle.loads(blob)
    except Exception as exc:
        raise CheckpointError(f"{where} cannot be unpickled: {describe_error(exc)}") from exc


def size_on_disk(path: str) -> int:
    """The bytes the database at ``path`` takes now, its write-ahead log included."""
    total = 0
    for name in (path, path + "-wal"):
        with contextlib.suppress(OSError):
            total += os.stat(name).st_size
    return total


def opened_kind(connection: sqlite3.Connection, path: str) -> Literal["journal", "checkpoint"]:
    """What the SQLite file at ``path``, open on ``connection``, is (``file_kind`` without opening
    it again: its integrity check reads the whole file).

    Raises:
        CheckpointError: it is not a stalebuf file of this format (it stays as it was).
    """
    return _stalebuf_kind(connection, path)
