"""Checkpoints of versioned trajectories (issue 22): versions, token counts and start versions
survive a save and a restore in every form, the token counters come back conserved, and
``in_flight="resume"`` keeps in-flight groups' partial prefixes for their producers to go on.

Every expected value is written out by hand from the scenario of :func:`versioned_buffer`.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from _ckpt_helpers import assert_tokens_conserved
from _helpers import LIMIT, assert_conserved
from stalebuf import (
    BatchNotReadyError,
    EvictionEvent,
    Group,
    GroupEvictedError,
    ReplayBuffer,
    SamplerConfig,
    Status,
)
from stalebuf._checkpoint_versions import checked_versions, valid_versions
from stalebuf.checkpoint import COUNTERS, IN_FLIGHT_MODES, TOKEN_COUNTERS, BufferCheckpoint
from stalebuf.errors import CheckpointError
from stalebuf.records import pack_runs

JSON_CODEC = (lambda payload: json.dumps(payload).encode(), json.loads)
CODECS = {"pickle": None, "codec": JSON_CODEC}
FINISHED, PENDING, RUNNING = Status.FINISHED, Status.PENDING, Status.RUNNING


def versioned_buffer() -> ReplayBuffer:
    """The scenario ("train", T=2, S=1, ``mask``); at the checkpoint the clock is 3 and:

    - ``m`` (step 0: 3 tokens of version 0; 1 of version 0 and 2 of version 2) was sampled at
      step 2: 6 tokens sampled, 4 masked (lag 3 > 2);
    - ``gone`` (step 2, 2 tokens of version 0) was evicted as stale by a sample at step 3 (its
      tail's lag is 4): 2 tokens evicted;
    - ``keep`` (step 3, start version 2): FINISHED, one trajectory of 5 tokens without segments;
    - ``lazyv`` (step 2, start version 3): FINISHED through put_group's fast path, no tokens;
    - ``run`` (step 3, start version 1): RUNNING, ``run_0_0`` of 2 tokens of version 1 and 1 of
      version 3, ``run_1_0`` of 4 tokens without segments;
    - ``pend`` (step 3): PENDING, ``pend_0_0`` of 6 tokens of version 2;
    - ``plain`` (step 3): RUNNING, ``plain_0_0`` with neither versions nor tokens.

    Tokens: 26 admitted, 6 sampled, 4 masked, 2 evicted, 18 resident (5 + 7 + 6).
    """
    config = SamplerConfig(max_off_policy_threshold=2, max_off_policy_strategy="mask")
    buf = ReplayBuffer(config, status_log_interval=None)
    buf.put_group_nowait("m", ["m0", "m1"], versions=[[(0, 3)], [(0, 1), (2, 2)]])
    batch, _ = buf.sample_nowait(2, 1)
    assert batch.uids == ["m"]
    buf.put_group_nowait("gone", ["g0"], versions=[[(0, 2)]])
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(3, 1)
    buf.put_group_nowait("keep", ["k0"], tokens=[5], version=2)
    buf.put_group_nowait("lazyv", ["l0", "l1"], global_steps=2, version=3)
    buf.add_prompt_nowait("run")
    buf.mark_running_nowait("run", version=1)
    buf.put_nowait("run", "r0", versions=[(1, 2), (3, 1)])
    buf.put_nowait("run", "r1", session_id=1, tokens=4)
    buf.add_prompt_nowait("pend")
    buf.put_nowait("pend", "q0", versions=[(2, 6)])
    buf.add_prompt_nowait("plain")
    buf.mark_running_nowait("plain")
    buf.put_nowait("plain", "z0")
    return buf


#: uid -> (dispatch step, status, start version, [(key, payload, versions, tokens)]).
SAVED: dict[str, tuple[Any, ...]] = {
    "keep": (3, FINISHED, 2, [("keep_0_0", "k0", (), 5)]),
    "lazyv": (2, FINISHED, 3, [("lazyv_0_0", "l0", (), 0), ("lazyv_1_0", "l1", (), 0)]),
    "run": (3, RUNNING, 1, [("run_0_0", "r0", ((1, 2), (3, 1)), 3), ("run_1_0", "r1", (), 4)]),
    "pend": (3, PENDING, 3, [("pend_0_0", "q0", ((2, 6),), 6)]),
    "plain": (3, RUNNING, 3, [("plain_0_0", "z0", (), 0)]),
}
IN_FLIGHT = ("run", "pend", "plain")
_COMMON = {"admitted_groups": 7, "admitted_trajectories": 10, "sampled_groups": 1, "sampled_trajectories": 2,
           "evicted_stale_groups": 1, "evicted_stale_trajectories": 1, "finished": 2,
           "admitted_tokens": 26, "sampled_tokens": 6, "masked_tokens": 4}  # fmt: skip
#: The counters of "train" that are not 0, per in_flight mode.
STATS: dict[str, dict[str, int]] = {
    "keep": {**_COMMON, "pending": 1, "running": 2, "trajectories": 7, "tokens": 18, "evicted_tokens": 2,
             "resident_tokens": 5},
    "resume": {**_COMMON, "pending": 3, "trajectories": 7, "tokens": 18, "evicted_tokens": 2,
             "resident_tokens": 5},
    "reissue": {**_COMMON, "pending": 3, "trajectories": 3, "tokens": 5, "evicted_tokens": 2,
                "resident_tokens": 5, "reissued_groups": 3, "reissued_trajectories": 4,
                "reissued_tokens": 13},
    "evict": {**_COMMON, "trajectories": 3, "tokens": 5, "evicted_tokens": 15, "resident_tokens": 5,
              "evicted_restart_groups": 3, "evicted_restart_trajectories": 4},
}  # fmt: skip


def view(group: Group) -> tuple[Any, ...]:
    """What :data:`SAVED` says of a group."""
    rows = [(t.key, t.payload, t.versions, t.tokens) for t in group.trajectories]
    return (group.dispatch_step, group.status, group.start_version, rows)


def saved_as(uid: str, status: Status | None = None, *, prefix: bool = True) -> tuple[Any, ...]:
    """``SAVED[uid]`` with another status, and without its trajectories (its start version then
    back at its dispatch step) unless ``prefix``."""
    step, saved, start, rows = SAVED[uid]
    return (step, saved if status is None else status, start if prefix else step, rows if prefix else [])


def save_and_restore(buf: ReplayBuffer, form: str, mode: str, directory: Path) -> Any:
    """``buf`` saved in ``form`` ("value", "pickle", "codec") and restored under ``mode``; with
    the events ``on_evict`` received."""
    events: list[EvictionEvent] = []
    source: Any = buf.checkpoint()
    codec = CODECS.get(form)
    if form != "value":
        source = directory / f"{form}.ckpt"

        async def save() -> None:
            with anyio.fail_after(LIMIT):
                await buf.save(source, payload_codec=codec)

        anyio.run(save)
    result = ReplayBuffer.restore(
        source, in_flight=mode, payload_codec=codec, on_evict=events.append, status_log_interval=None
    )
    return result, events


def train_counters(buf: ReplayBuffer) -> dict[str, int]:
    return {k: v for k, v in attrs.asdict(buf.stats().partitions["train"]).items() if v}


def test_the_scenario_counts_what_its_docstring_says() -> None:
    buf = versioned_buffer()
    assert train_counters(buf) == STATS["keep"]
    assert {g.uid: view(g) for g in buf.checkpoint().groups} == SAVED
    assert_tokens_conserved(buf)


@pytest.mark.parametrize("mode", IN_FLIGHT_MODES)
@pytest.mark.parametrize("form", ["value", "pickle", "codec"])
def test_versions_tokens_and_start_versions_come_back_under_every_mode(
    form: str, mode: str, tmp_path: Path
) -> None:
    (result, events) = save_and_restore(versioned_buffer(), form, mode, tmp_path)
    buf = result.buffer
    groups = {g.uid: view(g) for g in buf.checkpoint().groups}
    terminal = {"keep": SAVED["keep"], "lazyv": SAVED["lazyv"]}
    if mode == "keep":
        assert groups == SAVED
    elif mode == "evict":
        assert groups == terminal
    else:  # PENDING, with their prefix and start version under "resume", from scratch under "reissue"
        resumed = mode == "resume"
        assert groups == {**terminal, **{uid: saved_as(uid, PENDING, prefix=resumed) for uid in IN_FLIGHT}}
    reissue = [(g.uid, view(g)) for g in result.reissue]
    if mode in ("reissue", "resume"):  # the result lists them as the buffer holds them
        assert reissue == [(uid, groups[uid]) for uid in IN_FLIGHT]
    else:
        assert reissue == []
    restarted = [(e.reason, [(g.uid, view(g)) for g in e.groups]) for e in events]
    assert restarted == ([("restart", [(uid, SAVED[uid]) for uid in IN_FLIGHT])] if mode == "evict" else [])
    assert train_counters(buf) == STATS[mode]
    assert_conserved(buf)
    assert_tokens_conserved(buf)


@pytest.mark.parametrize("form", ["pickle", "codec"])
def test_a_file_without_versions_holds_them_as_files_before_them_did(form: str, tmp_path: Path) -> None:
    """A buffer that never saw a version writes what the release before versions wrote: group
    rows of 8 fields, trajectory rows of 4, no token counter (that release reads such a file; one
    with versions it refuses, for an unknown counter or field, so it never misreads one)."""
    buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=2), status_log_interval=None)
    buf.put_group_nowait("a", ["x", "y"], session_ids=[0, 3])
    buf.add_prompt_nowait("b")
    buf.put_nowait("b", "z")
    (result, _) = save_and_restore(buf, form, "keep", tmp_path)
    data = (tmp_path / f"{form}.ckpt").read_bytes()
    assert b"_tokens" not in data
    if form == "codec":
        rows = _codec_rows(tmp_path / "codec.ckpt")[1]
        assert [len(row) for row in rows] == [8, 8]
        assert [len(t) for row in rows for t in row[7]] == [4, 4, 4]
    assert [view(g) for g in result.buffer.checkpoint().groups] == [
        (0, FINISHED, 0, [("a_0_0", "x", (), 0), ("a_3_0", "y", (), 0)]),
        (0, PENDING, 0, [("b_0_0", "z", (), 0)]),
    ]
    counters = result.buffer.checkpoint().partitions[0].counters
    assert {key: counters[key] for key in TOKEN_COUNTERS} == dict.fromkeys(TOKEN_COUNTERS, 0)


def _codec_rows(path: Path) -> tuple[Any, list[Any]]:
    """The JSON of a codec checkpoint file (SQLite: the ``state`` key, then each group's record,
    length-prefixed frames whose first holds its row): its manifest and its group rows in order."""
    with contextlib.closing(sqlite3.connect(path)) as connection:
        (manifest,) = connection.execute("SELECT value FROM stalebuf WHERE key = 'state'").fetchone()
        records = [record for (record,) in connection.execute("SELECT record FROM groups ORDER BY gid")]
    rows = []
    for record in records:
        size = int.from_bytes(record[:8], "big")
        rows.extend(json.loads(record[8 : 8 + size]))
    return json.loads(manifest), rows


def test_a_codec_file_holds_versions_and_start_versions_only_where_they_are_not_the_defaults(
    tmp_path: Path,
) -> None:
    save_and_restore(versioned_buffer(), "codec", "keep", tmp_path)
    manifest, rows = _codec_rows(tmp_path / "codec.ckpt")
    counters = manifest["partitions"][0][2]
    assert {key: counters.get(key) for key in TOKEN_COUNTERS} == {
        "admitted_tokens": 26, "sampled_tokens": 6, "masked_tokens": 4, "evicted_tokens": 2,
        "reissued_tokens": None,  # 0: not written
    }  # fmt: skip
    by_uid = {row[0]: row for row in rows}
    assert {uid: row[8:] for uid, row in by_uid.items()} == {
        "keep": [2], "lazyv": [3], "run": [1], "pend": [], "plain": []
    }  # fmt: skip
    assert {uid: [t[4:] for t in row[7]] for uid, row in by_uid.items()} == {
        "keep": [[[], 5]],
        "lazyv": [[], []],
        "run": [[[[1, 2], [3, 1]], 3], [[], 4]],
        "pend": [[[[2, 6]], 6]],
        "plain": [[]],
    }


def hand_built(counters: dict[str, int], versions: Any, tokens: Any, runs: Any = None) -> BufferCheckpoint:
    """A checkpoint of one FINISHED group whose trajectory holds ``versions`` and ``tokens`` (and
    ``runs`` as its packed versions: by default, those of ``versions``), with these train counters
    (the group counted as admitted)."""
    ckpt = ReplayBuffer(status_log_interval=None).checkpoint()
    buf = ReplayBuffer(status_log_interval=None)
    buf.put_group_nowait("a", ["x"], session_ids=[1])
    group = buf.checkpoint().groups[0]
    trajectory = group.trajectories[0]
    packed = pack_runs(versions) if runs is None else runs
    record = group.replace(
        trajectories=(tuple.__new__(type(trajectory), (*trajectory[:5], versions, tokens, packed)),)
    )
    base = {"admitted_groups": 1, "admitted_trajectories": 1}
    partition = attrs.evolve(buf.checkpoint().partitions[0], counters={**base, **counters})
    return attrs.evolve(ckpt, groups=(record,), partitions=(partition,))


def test_a_checkpoint_without_token_counters_derives_them_from_its_groups() -> None:
    """Token counters absent (as in a file of before versions, or one built by hand from one):
    every resident token counts as admitted, none as gone, so the conservation law holds and the
    tokens are then sampled like any others."""
    buf = ReplayBuffer.restore(hand_built({}, ((4, 2), (5, 3)), 5)).buffer
    train = buf.stats().partitions["train"]
    assert (train.tokens, train.admitted_tokens, train.sampled_tokens, train.evicted_tokens) == (5, 5, 0, 0)
    batch, _ = buf.sample_nowait(5, 1)
    assert batch.token_versions()[0].tolist() == [4, 4, 5, 5, 5]
    train = buf.stats().partitions["train"]
    assert (train.tokens, train.admitted_tokens, train.sampled_tokens) == (0, 5, 5)
    assert_tokens_conserved(buf)


@pytest.mark.parametrize(
    ("counters", "conserved"),
    [
        ({"admitted_tokens": 5}, True),
        ({"admitted_tokens": 9, "sampled_tokens": 4}, True),
        ({"sampled_tokens": 0}, False),  # given, so checked: 5 resident, 0 admitted
        ({"admitted_tokens": 4}, False),
        ({"admitted_tokens": 9, "sampled_tokens": 4, "masked_tokens": 5}, False),  # masked > sampled
    ],
)
def test_token_counters_given_are_checked_against_the_groups(
    counters: dict[str, int], conserved: bool
) -> None:
    checkpoint = hand_built(counters, ((4, 2), (5, 3)), 5)
    if conserved:
        train = ReplayBuffer.restore(checkpoint).buffer.stats().partitions["train"]
        assert (train.admitted_tokens, train.sampled_tokens, train.tokens) == (
            counters["admitted_tokens"],
            counters.get("sampled_tokens", 0),
            5,
        )
    else:
        with pytest.raises(CheckpointError, match=r"partitions\[0\]\.counters"):
            ReplayBuffer.restore(checkpoint)


def test_packed_versions_that_are_not_the_versions_are_packed_again() -> None:
    """A trajectory keeps its versions packed for the batch arrays: a checkpoint whose packed copy
    says something else (built by hand, crafted) is restored with the copy packed again from the
    checked versions, so the batch hands the trainer the versions the checks passed."""
    for forged in (pack_runs(((9, 5),)), b"", bytearray(pack_runs(((4, 2), (5, 3)))), b"x" * 32):
        buf = ReplayBuffer.restore(hand_built({"admitted_tokens": 5}, ((4, 2), (5, 3)), 5, forged)).buffer
        batch, _ = buf.sample_nowait(5, 1)
        assert batch.token_versions()[0].tolist() == [4, 4, 5, 5, 5], forged


def test_versions_read_as_lists_come_back_as_tuples() -> None:
    """A JSON or hand-built form (lists) is copied into the tuples ``put`` stores."""
    buf = ReplayBuffer.restore(hand_built({"admitted_tokens": 3}, [[7, 1], [8, 2]], 3)).buffer
    (group,) = buf.checkpoint().groups
    assert group.trajectories[0].versions == ((7, 1), (8, 2))
    assert type(group.trajectories[0].versions[0]) is tuple


#: (versions, tokens): the forms a trajectory holds as ``put`` stores them, and others: invalid,
#: or valid but copied (lists).
_KEPT = [
    ((), 0),
    ((), 7),
    (((0, 1),), 1),
    (((3, 2), (1, 4)), 6),
    (((2**63 - 2, 1), (0, 2**63 - 2)), 2**63 - 1),
]
_NOT_KEPT = [
    ((), -1), ((), True), ((), 1.0), ((), 2**63), (((0, 1),), 2), (((0, 1),), 0), (((-1, 1),), 1),
    (((0, 0),), 0), (((True, 1),), 1), (((0, 1, 2),), 1), (((0,),), 0), (([0, 1],), 1), ([(0, 1)], 1),
    (((0, 2**63 - 1), (0, 1)), 0), (("ab",), 2), (((0, 1.0),), 1), (None, 0),
]  # fmt: skip


@pytest.mark.parametrize(
    ("versions", "tokens", "expected"),
    [(*case, True) for case in _KEPT] + [(*case, False) for case in _NOT_KEPT],
)
def test_the_fast_scan_passes_exactly_what_the_field_check_keeps_unchanged(
    versions: Any, tokens: Any, expected: bool
) -> None:
    """The fast scan of a checkpoint (every trajectory at once, C-level loops) may refuse more
    than the check that names the field, never less: it passes a trajectory only when that check
    keeps it as it is."""
    try:
        kept = checked_versions("t", versions, tokens) is versions
    except CheckpointError:
        kept = False
    assert kept is expected
    runs = packed_or_empty(versions)
    assert valid_versions([versions], [tokens], [runs]) is kept
    # Among valid trajectories, one bad one fails the whole scan.
    assert (
        valid_versions([((1, 2),), versions, ()], [2, tokens, 3], [pack_runs(((1, 2),)), runs, b""]) is kept
    )
    if kept and versions:  # and so does a packed copy that is not the versions'
        for forged in (b"", runs[:-1], runs[:-8] + pack_runs(((7, 7),))[:8], bytearray(runs)):
            assert not valid_versions([versions], [tokens], [forged]), forged
    if kept and not versions:
        assert not valid_versions([versions], [tokens], [pack_runs(((1, 1),))])


def packed_or_empty(versions: Any) -> bytes:
    """``versions`` packed as a trajectory keeps them, or ``b""`` where they cannot be."""
    try:
        return pack_runs(versions)
    except Exception:
        return b""


def test_the_counters_a_checkpoint_carries_include_the_cumulative_token_counters() -> None:
    assert set(TOKEN_COUNTERS) <= set(COUNTERS)
    assert set(TOKEN_COUNTERS) == {
        "admitted_tokens",
        "sampled_tokens",
        "masked_tokens",
        "evicted_tokens",
        "reissued_tokens",
    }
    assert "tokens" not in COUNTERS  # resident: derived from the groups


# -- restore(in_flight="resume") ------------------------------------------------------------------


def test_resume_lets_the_producer_go_on_after_the_prefix_and_its_lag_keeps_counting(tmp_path: Path) -> None:
    """``run`` comes back PENDING with its prefix: its producer marks it running again (keeping
    start version 1), puts after the prefix and finishes it. At step 3 the prefix's tokens of
    version 1 (and the 4 without segments, at the start version) have lag 3 > 2 and are masked
    (``run_1_0`` wholly: excluded from the loss); the new tokens of version 3 are fresh. Nothing
    was counted as reissued."""
    (result, _) = save_and_restore(versioned_buffer(), "pickle", "resume", tmp_path)
    buf = result.buffer
    (run, *_) = result.reissue
    assert [t.key for t in run.trajectories] == ["run_0_0", "run_1_0"]
    buf.mark_running_nowait("run")
    buf.put_nowait("run", "r2", session_id=2, versions=[(3, 3)])
    buf.mark_finished_nowait("run")
    for uid in ("pend", "plain"):
        buf.mark_failed_nowait(uid)
    batch, _ = buf.sample_nowait(3, 5)
    assert batch.uids == ["lazyv", "keep", "run", "pend", "plain"]
    (run,) = [group for group in batch if group.uid == "run"]
    assert (run.start_version, [t.key for t in run.trajectories]) == (1, ["run_0_0", "run_1_0", "run_2_0"])
    versions, offsets = batch.token_versions()
    # keep: 5 at its start version 2; run: 1, 1, 3, then 4 at start 1, then 3, 3, 3; pend: 6 at 2.
    assert versions.tolist() == [2] * 5 + [1, 1, 3] + [1] * 4 + [3, 3, 3] + [2] * 6
    assert offsets.tolist() == [0, 0, 0, 5, 8, 12, 15, 21, 21]
    mask, _ = batch.freshness_mask()
    assert mask.tolist() == [True] * 5 + [False, False, True] + [False] * 4 + [True] * 3 + [True] * 6
    assert batch.loss_excluded.tolist() == [False, False, False, False, True, False, False, False]
    train = buf.stats().partitions["train"]
    assert (train.reissued_groups, train.reissued_tokens, train.admitted_tokens) == (0, 0, 29)
    assert (train.sampled_tokens, train.masked_tokens) == (6 + 21, 4 + 6)
    assert_tokens_conserved(buf)


def test_resume_then_drop_judges_the_group_by_its_prefixs_oldest_token() -> None:
    """Under ``drop`` with in-flight eviction, a resumed group whose prefix holds a token of
    version 0 is evicted in flight at step 2 (lag 3 > 2), although it was dispatched at step 1
    and restarted its generation on version 2: versions are absolute, the restart changes none."""
    config = SamplerConfig(max_off_policy_threshold=2, evict_stale_in_flight=True)
    buf = ReplayBuffer(config, status_log_interval=None)
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(1, 1)
    buf.add_prompt_nowait("a")  # dispatched at step 1
    buf.mark_running_nowait("a", version=0)  # on the weights of step 0
    buf.put_nowait("a", "a0", versions=[(0, 2), (1, 2)])
    buf.add_prompt_nowait("b")
    buf.put_nowait("b", "b0", versions=[(1, 3)])
    result = ReplayBuffer.restore(buf.checkpoint(), in_flight="resume", status_log_interval=None)
    again = result.buffer
    assert [(g.uid, g.start_version) for g in result.reissue] == [("a", 0), ("b", 1)]
    again.mark_running_nowait("a", version=2)  # the producer restarts on newer weights
    with pytest.raises(BatchNotReadyError):
        again.sample_nowait(2, 1)
    with pytest.raises(GroupEvictedError):
        again.put_nowait("a", "a1", session_id=1, versions=[(2, 1)])
    assert "b" in again  # its oldest token, of version 1, has lag 2 at step 2: kept
    train = again.stats().partitions["train"]
    assert (train.evicted_in_flight_groups, train.evicted_tokens, train.tokens) == (1, 4, 3)
    assert_tokens_conserved(again)


def test_resume_keeps_the_start_version_the_wait_gate_judges_a_group_by() -> None:
    """``wait``: a group restored under ``resume`` keeps the start version its producer gave, so
    the gate judges it by that (3: lag 1 at step 3, open), not by its dispatch step (0: lag 4,
    closed), as a reissued one is."""
    config = SamplerConfig(max_off_policy_threshold=2, max_off_policy_strategy="wait")
    buf = ReplayBuffer(config, status_log_interval=None)
    buf.add_prompt_nowait("late")  # dispatched at step 0, queued
    buf.mark_running_nowait("late", version=3)  # its first token on version 3
    buf.put_group_nowait("ready", ["r"], global_steps=3)
    for mode, opens in (("resume", True), ("reissue", False)):
        again = ReplayBuffer.restore(buf.checkpoint(), in_flight=mode, status_log_interval=None).buffer
        if opens:
            batch, _ = again.sample_nowait(3, 1)
            assert batch.uids == ["ready"]
        else:
            with pytest.raises(BatchNotReadyError):
                again.sample_nowait(3, 1)
