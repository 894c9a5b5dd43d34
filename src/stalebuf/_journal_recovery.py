"""Reading a journal back: the state at its last commit, or at a trainer's checkpoint step.

At step ``g`` the recovery point is the last committed ``sample(g)`` on the partition that
returned a batch. What the consumers did after it is undone: groups sampled, evicted as stale
or failed, or evicted in flight by later samples are resident again, and the counters those
removals moved are moved back (each removal's reason says which: ``_partition.py`` counts them
so). What the producers did after it is kept: groups admitted, filled, finished or filtered.
The clocks, the last sampled steps and the mixture's balances are the ones the sample left.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

import attrs

from ._checkpoint_checks import checked
from ._journal_format import StateCodec, read_key, write_key
from ._journal_log import CONSUMER_REASONS
from ._stored import count_trajectories
from ._token_ledger import group_tokens
from ._validation import describe_error
from .checkpoint import COUNTERS, BufferCheckpoint, MixtureCheckpoint, PartitionCheckpoint, TaskCheckpoint
from .errors import CheckpointError
from .records import Group

__all__ = ["Recovery", "read_recovery", "void_after"]

#: A group row as a recovery reads it (a group not removed has no ``removals`` row: NULLs).
_COLUMNS = "gid, uid, admitted, removed, reason, record"

#: The counters each consumer-side removal added to (groups, trajectories, tokens), per reason.
_UNDONE: Mapping[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "sampled": (("sampled_groups",), ("sampled_trajectories",), ("sampled_tokens",)),
    "stale": (("evicted_stale_groups",), ("evicted_stale_trajectories",), ("evicted_tokens",)),
    "failure": (("evicted_failure_groups",), ("evicted_failure_trajectories",), ("evicted_tokens",)),
    "in_flight": (
        ("evicted_stale_groups", "evicted_in_flight_groups"),
        ("evicted_stale_trajectories",),
        ("evicted_tokens",),
    ),
    "restart": (("evicted_restart_groups",), ("evicted_restart_trajectories",), ("evicted_tokens",)),
}


@attrs.frozen
class Recovery:
    """What a journal holds at a recovery point.

    Attributes:
        checkpoint: the checked state to rebuild.
        gids: the journal's gid of each of its groups, by uid.
        kept: groups admitted after the point, in admission order: those in the state, and
            those filtered since (records as they were when filtered).
        dropped: older groups of a uid added again after the point (not in the state).
        point: the recovery point's event number (None: the last commit).
        undone: gids of the groups a later sample had removed, resident again.
        dropped_gids: gids of ``dropped``.
        seq, next_gid: the journal's counters.
        history: the (event number, step) of its samples and of its marks, oldest first, up to
            the point (and the marks of steps up to the recovered one after it).
    """

    checkpoint: BufferCheckpoint
    gids: dict[str, int]
    kept: tuple[Group, ...]
    dropped: tuple[Group, ...]
    point: int | None
    undone: tuple[int, ...]
    dropped_gids: tuple[int, ...]
    seq: int
    next_gid: int
    history: tuple[list[tuple[int, int]], list[tuple[int, int]]]


def read_recovery(
    connection: sqlite3.Connection, codec: StateCodec, path: str, global_steps: int | None, partition: str
) -> Recovery:
    """Read the state of the journal ``connection`` at its last commit (``global_steps`` None)
    or just after its last committed ``sample(global_steps)`` on ``partition``.

    Raises:
        CheckpointError: the journal holds no such sample (the message names the oldest and
            newest recoverable steps), or what it holds is not a state a buffer could have.
    """
    try:
        return _read(connection, codec, path, global_steps, partition)
    except CheckpointError as exc:
        raise CheckpointError(f"{path!r}: {exc}") from exc
    except sqlite3.Error as exc:
        raise CheckpointError(f"{path!r} cannot be read as a stalebuf journal: {exc}") from exc
    except Exception as exc:  # a value of another type where one belongs (a crafted file)
        raise CheckpointError(
            f"{path!r} cannot be read as a stalebuf journal: {describe_error(exc)}"
        ) from exc


def _read(
    connection: sqlite3.Connection, codec: StateCodec, path: str, global_steps: int | None, partition: str
) -> Recovery:
    blob = read_key(connection, "state")
    if blob is None:
        raise CheckpointError("the journal holds no committed state")
    latest = codec.read_state(blob)
    seq, next_gid = read_key(connection, "seq"), read_key(connection, "next_gid")
    if type(seq) is not int or type(next_gid) is not int:
        raise CheckpointError("the journal's counters are not integers")
    samples = [(s, int(step)) for s, step in connection.execute("SELECT seq, step FROM samples ORDER BY seq")]
    marks = [(s, int(step)) for s, step in connection.execute("SELECT seq, step FROM marks ORDER BY seq")]
    if global_steps is None:
        return _at_last_commit(connection, codec, latest, (seq, next_gid), (samples, marks))
    point, at_point = _point(connection, codec, global_steps, partition)
    reasons = ",".join(f"'{reason}'" for reason in sorted(CONSUMER_REASONS))
    rows = connection.execute(
        f"SELECT {_COLUMNS} FROM groups LEFT JOIN removals USING (gid) "
        f"WHERE removed IS NULL OR (removed > ? AND reason IN ({reasons})) ORDER BY gid",
        (point,),
    ).fetchall()
    groups = [(row, _group(codec, row)) for row in rows]
    newest = {group.uid: row[0] for row, group in groups}  # the last incarnation of each uid
    resident = [(row, group) for row, group in groups if newest[group.uid] == row[0]]
    dropped = [(row, group) for row, group in groups if newest[group.uid] != row[0]]
    undone = [(row[4], group) for row, group in groups if row[3] is not None]
    partitions = _partitions(latest, at_point, undone, [group for _, group in dropped])
    uids = {group.uid for _, group in resident}
    evicted = [
        (uid, why)
        for uid, why in zip(latest.evicted_in_flight, latest.evicted_reasons, strict=True)
        if uid not in uids
    ]
    state = BufferCheckpoint(
        latest.format_version,
        latest.config,
        latest.policy,
        (),
        partitions,
        dict(at_point.clocks),
        tuple(uid for uid, _ in evicted),
        tuple(why for _, why in evicted),
    )
    # The trainer's mark of the recovered step itself comes after its sample: it stays, so the
    # history since the resumed trainer's newest checkpoint is kept until it marks again.
    history = (
        [s for s in samples if s[0] <= point],
        [m for m in marks if m[0] <= point or m[1] <= global_steps],
    )
    filtered = connection.execute(
        f"SELECT {_COLUMNS} FROM groups JOIN removals USING (gid) "
        "WHERE reason = 'filtered' AND admitted > ? AND record IS NOT NULL",
        (point,),
    ).fetchall()
    kept = [(row, group) for row, group in resident if row[2] > point]
    kept += [(row, _group(codec, row)) for row in filtered]
    return Recovery(
        checked(state, tuple(group for _, group in resident)),
        {group.uid: row[0] for row, group in resident},
        tuple(group for _, group in sorted(kept, key=lambda item: item[0][0])),
        tuple(group for _, group in dropped),
        point,
        tuple(row[0] for row, group in groups if row[3] is not None and newest[group.uid] == row[0]),
        tuple(row[0] for row, _ in dropped),
        seq,
        next_gid,
        history,
    )


def _at_last_commit(
    connection: sqlite3.Connection,
    codec: StateCodec,
    latest: BufferCheckpoint,
    counters: tuple[int, int],
    history: tuple[list[tuple[int, int]], list[tuple[int, int]]],
) -> Recovery:
    """The journal's state at its last commit: ``latest`` with every group not removed."""
    rows = connection.execute(
        f"SELECT {_COLUMNS} FROM groups LEFT JOIN removals USING (gid) WHERE removed IS NULL ORDER BY gid"
    ).fetchall()
    groups = [(row, _group(codec, row)) for row in rows]
    state = checked(latest, tuple(group for _, group in groups))  # (no converter on unchecked values)
    gids = {group.uid: row[0] for row, group in groups}
    return Recovery(state, gids, (), (), None, (), (), *counters, history)


def _group(codec: StateCodec, row: tuple[Any, ...]) -> Group:
    gid, uid, *_, record = row
    if record is None:
        raise CheckpointError(f"group {uid!r} (row {gid}) has no record")
    return codec.read_group(record, f"group {uid!r} (row {gid})")


def _point(
    connection: sqlite3.Connection,
    codec: StateCodec,
    global_steps: int,
    partition: str,
) -> tuple[int, BufferCheckpoint]:
    """The event number of the last committed ``sample(global_steps)`` on ``partition`` and the
    state right after it.

    Raises:
        CheckpointError: there is none (naming the oldest and newest recoverable steps).
    """
    row = connection.execute(
        "SELECT seq, state FROM samples WHERE partition = ? AND step = ? ORDER BY seq DESC LIMIT 1",
        (partition, str(global_steps)),
    ).fetchone()
    if row is not None:
        return row[0], codec.read_state(row[1])
    steps = sorted(
        int(step)
        for (step,) in connection.execute("SELECT step FROM samples WHERE partition = ?", (partition,))
    )
    held = (
        f"its recoverable steps on it are {steps[0]} (oldest) to {steps[-1]} (newest)"
        if steps
        else "it holds no committed sample on it"
    )
    raise CheckpointError(
        f"no committed sample(global_steps={global_steps}) on partition {partition!r} to recover at: {held}"
    )


def _partitions(
    latest: BufferCheckpoint,
    at_point: BufferCheckpoint,
    undone: list[tuple[str, Group]],
    dropped: list[Group],
) -> tuple[PartitionCheckpoint, ...]:
    """The latest partitions with the consumers' side after the point undone: counters moved
    back by each undone removal (and forward for each dropped group, evicted as "restart"), the
    last sampled step, masked tokens and mixture ledgers of the point."""
    then = {saved.name: saved for saved in at_point.partitions}
    tag = latest.config.mixture_tag
    deltas: dict[tuple[str, str | None], dict[str, int]] = {}
    moves = [(reason, group, -1) for reason, group in undone] + [("restart", group, 1) for group in dropped]
    for reason, group, sign in moves:
        task = group.tags.get(tag)
        keys: list[tuple[str, str | None]] = [(group.partition, None)]
        if type(task) is str:
            keys.append((group.partition, task))
        for key in keys:
            _move(deltas.setdefault(key, {}), _UNDONE[reason], group, sign)
    out = []
    for saved in latest.partitions:
        before = then.get(saved.name)
        masked = before.counters.get("masked_tokens", 0) if before is not None else 0
        counters = _counted(saved.counters, deltas.get((saved.name, None), {}), masked)
        mixture = saved.mixture
        if mixture is not None:
            mixture = _mixture(mixture, before, deltas, saved.name)
        out.append(
            attrs.evolve(
                saved,
                last_sampled=before.last_sampled if before is not None else -1,
                counters=counters,
                mixture=mixture,
            )
        )
    return tuple(out)


def _move(delta: dict[str, int], keys: tuple[tuple[str, ...], ...], group: Group, sign: int) -> None:
    for names, amount in zip(keys, (1, count_trajectories(group), group_tokens(group)), strict=True):
        for name in names:
            delta[name] = delta.get(name, 0) + sign * amount


def _counted(counters: Mapping[str, int], delta: Mapping[str, int], masked: int | None) -> dict[str, int]:
    out = {key: counters.get(key, 0) + delta.get(key, 0) for key in COUNTERS}
    if masked is not None:
        out["masked_tokens"] = masked
    return out


def _mixture(
    mixture: MixtureCheckpoint,
    before: PartitionCheckpoint | None,
    deltas: Mapping[tuple[str, str | None], Mapping[str, int]],
    name: str,
) -> MixtureCheckpoint:
    """The latest task cells with their counters moved back, and the ledger of the point."""
    old = before.mixture if before is not None else None
    old_tasks = {task.name: task for task in old.tasks} if old is not None else {}
    tasks = []
    for task in mixture.tasks:
        was = old_tasks.get(task.name)
        masked = was.counters.get("masked_tokens", 0) if was is not None else 0
        tasks.append(
            TaskCheckpoint(
                task.name,
                _counted(task.counters, deltas.get((name, task.name), {}), masked),
                task.generation,
                was.balance if was is not None else 0,
                was.growth if was is not None else 0,
            )
        )
    if old is None:
        return MixtureCheckpoint(tuple(tasks))
    return MixtureCheckpoint(tuple(tasks), old.shares, old.batch_size)


def void_after(connection: sqlite3.Connection, codec: StateCodec, recovery: Recovery, seq: int) -> None:
    """Make the journal hold the recovered state in one transaction: samples after the point
    void, and marks after it (but those of steps up to the recovered one), the undone groups
    resident again, the dropped ones removed at event ``seq`` for "restart", and the state and
    event number they imply. A crash right after it leaves a journal whose last commit is the
    recovered state (before ``in_flight`` changed it): a recovery from it gives the same buffer.

    Raises:
        CheckpointError: the state cannot be encoded (it was just decoded: not expected).
        sqlite3.Error: SQLite could not write (the journal is then as it was).
    """
    state = codec.state(attrs.evolve(recovery.checkpoint, groups=()))
    execute = connection.execute
    execute("BEGIN IMMEDIATE")
    try:
        point = recovery.point
        if point is not None:
            execute("DELETE FROM samples WHERE seq > ?", (point,))
            kept = {seq for seq, _ in recovery.history[1]}  # (no NOT IN: SQLite limits variables)
            later = execute("SELECT seq FROM marks WHERE seq > ?", (point,)).fetchall()
            connection.executemany(
                "DELETE FROM marks WHERE seq = ?", (row for row in later if row[0] not in kept)
            )
        for gid in recovery.undone:
            execute("DELETE FROM removals WHERE gid = ?", (gid,))
        for gid in recovery.dropped_gids:
            execute("INSERT OR REPLACE INTO removals VALUES (?, ?, 'restart')", (gid, seq))
        write_key(connection, "state", state)
        write_key(connection, "seq", seq)
        execute("COMMIT")
    except BaseException:
        execute("ROLLBACK")
        raise
