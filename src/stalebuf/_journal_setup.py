"""Starting a journal: checking its arguments, creating its file, or reopening one to recover
from it (the facade calls these; ``_journal.py`` runs the journal once started)."""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
from typing import Any

from ._checkpoint_file import PayloadCodec
from ._journal import Journal, JournalOptions, JournalParts
from ._journal_format import StateCodec, connect, create_schema, file_kind
from ._journal_recovery import Recovery, read_recovery, void_after
from ._journal_writer import JournalWriter
from ._open_group import OpenGroup
from ._validation import MAX_INT, check_payload_codec, describe, describe_error, is_utf8
from .errors import CheckpointError, ConfigError

__all__ = ["check_journal_options", "open_recovery", "start_journal", "start_recovered"]


def check_journal_options(
    journal: object, interval: object, retention_steps: object, max_pending_bytes: object
) -> JournalOptions | None:
    """Return the checked journal arguments (None without a journal).

    Raises:
        ConfigError: ``journal`` is not None, a str or a path (non-empty, without NUL);
            ``journal_interval`` is not a finite number >= 0; ``journal_retention_steps`` is not
            an int >= 0; ``journal_max_pending_bytes`` is not an int >= 1.
    """
    if (
        not isinstance(interval, (int, float))
        or type(interval) is bool
        or not math.isfinite(interval)
        or interval < 0
    ):
        raise ConfigError(
            f"journal_interval must be a finite number >= 0 (seconds), got {describe(interval)}"
        )
    if type(retention_steps) is not int or retention_steps < 0:
        raise ConfigError(f"journal_retention_steps must be an int >= 0, got {describe(retention_steps)}")
    if type(max_pending_bytes) is not int or max_pending_bytes < 1:
        raise ConfigError(f"journal_max_pending_bytes must be an int >= 1, got {describe(max_pending_bytes)}")
    if journal is None:
        return None
    if not isinstance(journal, (str, os.PathLike)):
        raise ConfigError(f"journal must be None or a path, got {describe(journal)}")
    path = os.fspath(journal)
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ConfigError(f"journal must be a non-empty str path without NUL, got {describe(journal)}")
    return JournalOptions(path, float(interval), retention_steps, max_pending_bytes)


def _writer(
    connection: sqlite3.Connection,
    options: JournalOptions,
    codec: StateCodec,
    history: tuple[list[tuple[int, int]], list[tuple[int, int]]],
) -> Any:
    def build(on_commit: Any) -> JournalWriter:
        return JournalWriter(connection, options.path, codec, options.retention_steps, history, on_commit)

    return build


def start_journal(
    options: JournalOptions, parts: JournalParts, payload_codec: PayloadCodec | None
) -> Journal:
    """Create the journal file (it must be absent or empty) and start journaling into it, its
    first commit holding the buffer's state now (a restored buffer's groups).

    Raises:
        CheckpointError: the file already holds a stalebuf journal or checkpoint ("recover from
            it, or remove it"), or is something else (left as it was), or cannot be created.
        ConfigError: ``payload_codec`` is not None or a pair of callables.
        OSError: the file cannot be read.
    """
    check_payload_codec(payload_codec)
    path = options.path
    kind = file_kind(path)
    if kind not in ("absent", "empty"):
        raise CheckpointError(
            f"{path!r} already holds a stalebuf {'checkpoint' if kind == 'container' else kind}: recover "
            "from it, or remove it (ReplayBuffer.recover; a new journal never overwrites one)"
        )
    codec = StateCodec(payload_codec)
    connection = connect(path)
    try:
        connection.execute("BEGIN IMMEDIATE")
        create_schema(connection, "journal", payload_codec)
        connection.execute("COMMIT")
    except BaseException:
        connection.close()
        with contextlib.suppress(OSError):
            if kind == "absent":
                os.unlink(path)
        raise
    journal = Journal(options, parts, _writer(connection, options, codec, ([], [])), 0, 0)
    parts.store.journal_to(journal.log)
    for uid, group in parts.store.groups.items():
        journal.log.admitted(uid, group.partition)
    _first_commit(journal)
    return journal


def _first_commit(journal: Journal) -> None:
    """Commit the journal's starting state before the buffer is handed out.

    Raises:
        CheckpointError: it could not be written (the journal is closed then).
    """
    try:
        journal.writer.wait_committed(journal.hand_off())
    except BaseException:
        journal.close()
        raise


def open_recovery(
    path: object, payload_codec: PayloadCodec | None, global_steps: object, partition: object
) -> tuple[sqlite3.Connection, Recovery]:
    """Open the journal at ``path`` and read its state at the recovery point (nothing written).

    Raises:
        CheckpointError: the file is not a stalebuf journal (a checkpoint file: restore it), is
            torn, foreign or of another format, needs (or must not have) a payload codec, or
            holds no such recovery point.
        ConfigError: a bad argument.
        OSError: the file cannot be read.
    """
    check_payload_codec(payload_codec)
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"journal must be a path, got {describe(path)}")
    if global_steps is not None and (type(global_steps) is not int or not 0 <= global_steps <= MAX_INT):
        raise ConfigError(
            f"global_steps must be None or an int >= 0 (and < 2**63), got {describe(global_steps)}"
        )
    if type(partition) is not str or not is_utf8(partition):
        raise ConfigError(f"partition must be a str UTF-8 can encode, got {describe(partition)}")
    name = os.fspath(path)
    kind = file_kind(name)
    if kind != "journal":
        what = {"absent": "does not exist", "empty": "is empty"}.get(
            kind, f"is a stalebuf {kind}, not a journal"
        )
        if kind in ("absent", "empty"):
            raise CheckpointError(f"{name!r} {what}: there is no journal to recover from")
        raise CheckpointError(f"{name!r} {what}: restore it with ReplayBuffer.restore")
    codec = StateCodec(payload_codec)
    connection = connect(name)
    try:
        codec.check_file(connection, name)
        return connection, read_recovery(connection, codec, name, global_steps, partition)
    except BaseException:
        connection.close()
        raise


def start_recovered(
    options: JournalOptions,
    parts: JournalParts,
    payload_codec: PayloadCodec | None,
    connection: sqlite3.Connection,
    recovery: Recovery,
) -> Journal:
    """Void the journal's history after the recovery point and journal the recovered buffer on
    into it: its first commit removes the groups the restore evicted ("restart"), writes its
    in-flight ones again (which ``in_flight`` may have changed) and those ``on_evict`` added
    meanwhile, with the state after all three.

    Raises:
        CheckpointError: the journal could not be written.
    """
    store = parts.store
    codec = StateCodec(payload_codec)
    seq = recovery.seq + 1
    try:
        try:
            void_after(connection, codec, recovery, seq)
        except sqlite3.Error as exc:  # (rolled back: the journal is as it was)
            raise CheckpointError(f"{options.path!r} could not be written: {describe_error(exc)}") from exc
        journal = Journal(
            options, parts, _writer(connection, options, codec, recovery.history), recovery.next_gid, seq
        )
    except BaseException:
        connection.close()
        raise
    journal.log.seed(recovery.gids)
    restarted = [uid for uid in recovery.gids if uid not in store.groups]
    if restarted:  # in the first commit, with the counters they moved
        journal.log.left(restarted, "restart", restarted)
    store.journal_to(journal.log)
    for uid, group in store.groups.items():
        if uid not in recovery.gids:  # added by ``on_evict`` as the restore evicted
            journal.log.admitted(uid, group.partition)
        elif type(group) is OpenGroup:
            journal.log.changed(uid)
    _first_commit(journal)
    return journal
