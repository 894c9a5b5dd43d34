"""The checkpoint file as ``save`` writes it: the journal's SQLite format (``_journal_format``),
compacted; and reading any checkpoint file ``restore`` is given.

A checkpoint is a stalebuf SQLite file of kind "checkpoint": the buffer's state but its groups
(the ``state`` key), every resident group as a ``groups`` row in admission order, no removals,
samples, marks or commits history, and a ``digest``: the SHA-256 of the state and of every group's
record in order, each preceded by its length (8 bytes, big-endian). SQLite checks the file's
structure on open (``PRAGMA integrity_check``) but keeps no checksum of the values in it; the
digest catches a flipped bit in a payload, and it is checked before anything is unpickled.

A write goes to a temporary file in the same directory (``_checkpoint_path``), built with SQLite's
own journal off (the file is not in place until it is complete: the rename is the commit), one
transaction per chunk of groups (so the writer gives the GIL back and can stop between chunks),
then fsynced, renamed over the target and the directory fsynced: a crash at any moment leaves the
previous file or the new one, never a torn one, and the file is complete on its own (no ``-wal``
or ``-journal`` beside it). A path that is a symlink is resolved first: the write replaces the
link's target, not the link.

``restore`` reads this format, a journal (its state at its last commit) and the older
hand-written container (``_checkpoint_file``), telling them apart by their first bytes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ._checkpoint_checks import checked
from ._checkpoint_file import PayloadCodec, read_container
from ._checkpoint_path import (
    create_temporary,
    forget_temporary,
    fsync_directory,
    open_regular,
    plain_file_mode,
    remove_stale_temporaries,
    resolve_target,
)
from ._journal_format import (
    APPLICATION_ID,
    SQLITE_MAGIC,
    StateCodec,
    connect,
    create_schema,
    opened_kind,
    read_key,
    write_key,
)
from ._journal_recovery import read_recovery
from ._stored import peek_trajectories
from ._validation import check_payload_codec, describe, describe_error
from .checkpoint import BufferCheckpoint
from .errors import CheckpointError
from .records import Group

__all__ = ["WriteTicket", "read_checkpoint", "write_checkpoint"]

# Groups per transaction: small enough that one chunk holds the GIL for milliseconds.
_CHUNK = 256
_LENGTH = 8  # bytes of each blob's length in the digest
_HEADER = 100  # bytes of an SQLite file's header
_WAL_MODE = 2  # its read and write versions (bytes 18 and 19) in WAL mode


class WriteTicket(Protocol):
    """What a write asks of its place in an ordering of saves (``_save_order.SaveTicket``)."""

    def must_stop(self, target: str) -> bool:
        """Whether the write should give up now (cancelled, or overtaken on ``target``)."""
        ...

    def land(self, target: str, rename: Callable[[], None]) -> bool:
        """Call ``rename`` unless the write must stop; return whether it did."""
        ...


class _Stopped(Exception):
    """The write was cancelled, or overtaken by a newer save of the same buffer."""


# -- writing ------------------------------------------------------------------------------------


def write_checkpoint(
    path: str | os.PathLike[str],
    checkpoint: BufferCheckpoint,
    codec: PayloadCodec | None,
    ticket: WriteTicket | None = None,
) -> None:
    """Write ``checkpoint`` to ``path`` atomically (see the module docs).

    With a ``ticket`` (see ``_save_order``), the write stops when the ticket is cancelled or a
    newer save of the same buffer has landed at the file, and then returns without renaming;
    either way its temporary file is removed.

    Raises:
        CheckpointError: a value the format cannot hold (named): one pickle cannot hold, or with
            a codec one JSON cannot hold; or ``encode`` failed or returned something other than
            bytes; or ``path`` names something other than a regular file (a FIFO, a device), or
            a journal (left as it was).
        ConfigError: ``codec`` is not None or a pair ``(encode, decode)`` of callables.
        PermissionError: the file at ``path`` is read-only (no write permission for this
            process, or none for anyone): it is kept, not replaced.
        OSError: the file could not be written (the previous file, if any, is untouched).
    """
    check_payload_codec(codec)
    target = resolve_target(path)
    _refuse_journal(target)
    mode = plain_file_mode(target)
    remove_stale_temporaries(target)
    handle, temporary = create_temporary(target)
    stop = (lambda: False) if ticket is None else functools.partial(ticket.must_stop, target)
    try:
        try:
            _write_file(handle, temporary, mode, checkpoint, codec, stop)
            if ticket is None:
                os.replace(temporary, target)
                landed = True
            else:
                landed = ticket.land(target, functools.partial(os.replace, temporary, target))
        except _Stopped:
            landed = False
        if not landed:  # cancelled, or the file already holds a newer state: nothing to rename
            os.unlink(temporary)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    finally:
        forget_temporary(temporary)
    if landed:
        fsync_directory(os.path.dirname(target))


def _refuse_journal(target: str) -> None:
    """Refuse to replace a journal: a stalebuf file in WAL mode, or any database with a
    write-ahead log beside it (a journal killed or still journaling; a file renamed over it would
    be read with that log, and be unreadable).

    Raises:
        CheckpointError: the file at ``target`` is one.
    """
    head = b""
    with contextlib.suppress(FileNotFoundError), open(target, "rb") as file:
        head = file.read(_HEADER)
    journal = head.startswith(SQLITE_MAGIC) and len(head) == _HEADER and head[18] == _WAL_MODE
    if (journal and int.from_bytes(head[68:72], "big") == APPLICATION_ID) or os.path.exists(target + "-wal"):
        raise CheckpointError(
            f"{target!r} holds a stalebuf journal (or a database with a write-ahead log beside it): "
            "save never replaces one; recover from it, remove it, or save elsewhere"
        )


def _write_file(
    handle: int,
    temporary: str,
    mode: int,
    checkpoint: BufferCheckpoint,
    codec: PayloadCodec | None,
    stop: Callable[[], bool],
) -> None:
    """Write the whole database to the temporary file ``temporary``, open as ``handle`` (closed
    on return), and fsync it.

    Raises:
        _Stopped: ``stop`` said so between two chunks.
        CheckpointError: as ``write_checkpoint``.
        OSError: the file could not be written.
    """
    try:
        if hasattr(os, "fchmod"):  # POSIX: mkstemp's 0o600 would hide the file from other users
            # Best effort: a file system without Unix permissions (vfat, some CIFS mounts) refuses
            # chmod with EPERM, and a plain open there would not have failed either.
            with contextlib.suppress(OSError):
                os.fchmod(handle, mode)
        try:
            connection = sqlite3.connect(temporary, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise OSError(f"{temporary!r} cannot be opened by SQLite: {describe_error(exc)}") from exc
        try:
            _write_database(connection, checkpoint, codec, stop)
        except sqlite3.Error as exc:  # a full disk, an I/O error
            raise OSError(f"{temporary!r} could not be written: {describe_error(exc)}") from exc
        finally:
            connection.close()
        os.fsync(handle)  # (SQLite's own syncs are off: this one makes the whole file durable)
    finally:
        os.close(handle)


def _write_database(
    connection: sqlite3.Connection,
    checkpoint: BufferCheckpoint,
    codec: PayloadCodec | None,
    stop: Callable[[], bool],
) -> None:
    """Fill the new database on ``connection``: schema and state, the groups a chunk per
    transaction, the digest last.

    Raises:
        _Stopped, CheckpointError: as ``_write_file``.
        sqlite3.Error: SQLite could not write.
    """
    execute = connection.execute
    # The file is not in place until the rename: no rollback journal and no sync until then.
    execute("PRAGMA journal_mode=OFF")
    execute("PRAGMA synchronous=OFF")
    state_codec = StateCodec(codec)
    state = state_codec.state(checkpoint)
    digest = hashlib.sha256()
    _hash(digest, (state,))
    groups = checkpoint.groups
    execute("BEGIN")
    create_schema(connection, "checkpoint", codec)
    write_key(connection, "state", state)
    write_key(connection, "seq", 0)  # a compacted journal: no event after its state
    write_key(connection, "next_gid", len(groups))
    execute("COMMIT")
    for start in range(0, len(groups), _CHUNK):
        if stop():
            raise _Stopped
        chunk = groups[start : start + _CHUNK]
        records = [_record(state_codec, group, codec is None) for group in chunk]
        _hash(digest, records)
        rows = [
            (gid, group.uid, group.partition, record)
            for gid, group, record in zip(range(start, start + len(chunk)), chunk, records, strict=True)
        ]
        execute("BEGIN")
        connection.executemany(
            "INSERT INTO groups (gid, uid, partition, admitted, record) VALUES (?, ?, ?, 0, ?)", rows
        )
        execute("COMMIT")
    if stop():
        raise _Stopped
    execute("BEGIN")
    write_key(connection, "digest", digest.digest())
    execute("COMMIT")


def _record(state_codec: StateCodec, group: Group, pickled: bool) -> bytes:
    """``group``'s record.

    Raises:
        CheckpointError: as ``write_checkpoint`` (naming the trajectory pickle cannot hold).
    """
    try:
        return state_codec.group(group)
    except CheckpointError as exc:
        if pickled:
            raise _unpicklable(group, exc.__cause__ or exc) from exc
        raise


def _unpicklable(group: Group, error: BaseException) -> CheckpointError:
    """The error for a group pickle refused, naming its first trajectory at fault."""
    for trajectory in peek_trajectories(group):
        try:
            pickle.dumps(trajectory, protocol=5)
        except Exception:
            where = f"group {describe(group.uid)}, trajectory {describe(trajectory.key)}"
            break
    else:
        where = f"group {describe(group.uid)} (its tags)"
    return CheckpointError(
        f"{where} cannot be pickled: {describe_error(error)}; pass payload_codec= to save payloads "
        "pickle cannot hold"
    )


def _hash(digest: Any, blobs: Sequence[bytes]) -> None:
    """Add ``blobs`` to ``digest``, each preceded by its length (so blobs cannot trade bytes)."""
    digest.update(b"".join(part for blob in blobs for part in (len(blob).to_bytes(_LENGTH, "big"), blob)))


# -- reading ------------------------------------------------------------------------------------


def read_checkpoint(path: str | os.PathLike[str], codec: PayloadCodec | None) -> BufferCheckpoint:
    """Read the checkpoint file at ``path`` (a checkpoint ``save`` wrote, in this format or the
    older container, or a journal: its state at its last commit), then check what it holds (see
    ``_checkpoint_checks``: a crafted file can carry a valid digest).

    Raises:
        CheckpointError: the file is truncated, corrupt, not a stalebuf file, of another
            format, not a regular file (a FIFO, a device), a codec file read without a codec
            (or a pickle file read with one), ``decode`` failed, or a field holds what no live
            buffer could hold (the message names the file and the field). The file is opened
            read-only: it stays as it was.
        OSError: the file cannot be read (FileNotFoundError for a missing one, IsADirectoryError
            for a directory).
    """
    name = os.fspath(path)
    with contextlib.suppress(OSError, ValueError):
        remove_stale_temporaries(os.path.realpath(name))
    with open_regular(name) as file:  # a FIFO or a device refused before a byte is read
        head = file.read(len(SQLITE_MAGIC))
    if head != SQLITE_MAGIC:
        return read_container(name, codec)  # the older format, or a foreign file it refuses
    state_codec = StateCodec(codec)
    with contextlib.closing(connect(name, read_only=True)) as connection:
        try:
            kind = opened_kind(connection, name)
            state_codec.check_file(connection, name)
            if kind == "journal":
                return read_recovery(connection, state_codec, name, None, "train").checkpoint
            return _read_compacted(connection, state_codec, name)
        except CheckpointError:
            raise
        except Exception as exc:  # sqlite3.Error, or a value of another type where one belongs
            raise CheckpointError(f"{name!r} cannot be read: {describe_error(exc)}") from exc


def _read_compacted(connection: sqlite3.Connection, state_codec: StateCodec, name: str) -> BufferCheckpoint:
    """The checkpoint a file ``write_checkpoint`` wrote holds, its digest and values checked.

    Raises:
        CheckpointError: the file is truncated or corrupt, or holds what ``checked`` refuses.
    """
    (pages,) = connection.execute("PRAGMA page_count").fetchone()
    (page_size,) = connection.execute("PRAGMA page_size").fetchone()
    size = os.stat(name).st_size
    if size != pages * page_size:
        raise CheckpointError(
            f"{name!r} is truncated or has trailing data ({size} bytes for {pages} pages of {page_size})"
        )
    state, digest = read_key(connection, "state"), read_key(connection, "digest")
    rows = connection.execute("SELECT record FROM groups ORDER BY gid").fetchall()
    (removals,) = connection.execute("SELECT COUNT(*) FROM removals").fetchone()
    blobs: list[Any] = [state, *(record for (record,) in rows)]
    if any(type(blob) is not bytes for blob in blobs) or removals:
        raise CheckpointError(f"{name!r} is corrupt (a state or a group record is missing)")
    if type(digest) is not bytes or _digest_of(blobs) != digest:
        raise CheckpointError(f"{name!r} is corrupt (checksum mismatch)")
    del rows
    try:
        checkpoint = state_codec.read_state(blobs[0])
        groups = []
        for index in range(1, len(blobs)):
            record, blobs[index] = blobs[index], None  # each record freed as soon as it is read
            groups.append(state_codec.read_group(record, f"groups[{index - 1}]"))
        return checked(checkpoint, tuple(groups))
    except CheckpointError as exc:
        raise CheckpointError(f"{name!r}: {exc}") from exc


def _digest_of(blobs: Sequence[bytes]) -> bytes:
    """The digest of ``blobs``, in order (see the module docs)."""
    digest = hashlib.sha256()
    for start in range(0, len(blobs), _CHUNK):
        _hash(digest, blobs[start : start + _CHUNK])
    return digest.digest()
