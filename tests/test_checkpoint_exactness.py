"""Issue 12's acceptance test: a checkpointed and resumed run trains exactly what the
uninterrupted run trains.

For each variant (drop and wait, with and without admission control, asyncio and trio; and,
issue 22, with versions and tokens under drop, wait and mask, restored by reissuing or by
resuming the partial groups; and, issue 23, with group filters, one of which raises, and with a
task mixture under both policies, restored with the filters given again; and, issue 24, with
``max_tokens_per_group`` and ``max_resident_tokens``, whose reservations cross the checkpoint)
the test process runs
the seeded scenario of ``_resume_scenario`` from step 1 to n, saving the buffer (and the
producer's state) to a file at the end of step k (after the producer's next tick, with filters).
One fresh process (``_resume_worker.py``) then restores every step-k file, regenerates the
reissued groups (or goes on with the resumed ones) and replays the same producer ticks to step n.
Every batch k+1..n must be identical (uids, order, keys, payloads, staleness, the per-token
arrays, every metric but the wall-clock ``*_seconds`` ones) and the final ``stats()`` equal,
except, when reissued, ``reissued_*`` and ``admitted_trajectories`` and ``admitted_tokens``,
higher by exactly ``reissued_trajectories`` and ``reissued_tokens`` (the regenerated puts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import stalebuf
from _helpers import assert_conserved
from _resume_scenario import VARIANTS, Producer, Variant, drive, stats_record
from stalebuf import Group, ReplayBuffer, Status

TESTS = Path(__file__).resolve().parent
# The stalebuf this process imported, so the fresh process runs the same code.
SRC = Path(stalebuf.__file__).resolve().parent.parent
_COUNTS = ("reissued_groups", "reissued_trajectories", "admitted_trajectories", "reissued_tokens",
           "admitted_tokens")  # fmt: skip


def run_original(variant: Variant, directory: Path) -> dict[str, Any]:
    """Run the whole scenario in this process, saving at step k; return what the test needs."""
    buf = ReplayBuffer(variant.config(), status_log_interval=None, filters=variant.group_filters())
    producer = Producer(variant.seed, versions=variant.versions, mixture=variant.mixture is not None)
    saved: dict[str, Any] = {}
    checkpoint = directory / f"{variant.id}.ckpt"
    state = directory / f"{variant.id}.producer.json"

    async def on_checkpoint() -> None:
        saved["stats"] = stats_record(buf.stats())
        saved["in_flight"] = [  # (uid, running, trajectories, tokens) of the groups in flight
            (group.uid, group.status is Status.RUNNING, len(group.trajectories), group_tokens(group))
            for group in buf.checkpoint().groups
            if group.status in (Status.PENDING, Status.RUNNING) and group.partition == "train"
        ]
        saved["producer"] = producer.to_json()
        train = next(p for p in buf.checkpoint().partitions if p.name == "train")
        saved["ledgers"] = {  # what filters and a mixture left behind, carried by the checkpoint
            "recent_filtered": 0 if train.filters is None else train.filters.recent_filtered,
            "recent_filter_errors": 0 if train.filters is None else train.filters.recent_errors,
            "balances": [] if train.mixture is None else [task.balance for task in train.mixture.tasks],
        }
        state.write_text(json.dumps(saved["producer"]))
        await buf.save(checkpoint)

    async def run() -> list[dict[str, Any]]:
        return await drive(buf, producer, variant, 1, on_checkpoint)

    batches = anyio.run(run, backend=variant.backend)
    assert_conserved(buf)
    return {
        "batches": batches,
        "checkpoint_stats": saved["stats"],
        "checkpoint_producer": saved["producer"],
        "checkpoint_in_flight": saved["in_flight"],
        "checkpoint_ledgers": saved["ledgers"],
        "final_stats": stats_record(buf.stats()),
        "producer": producer.to_json(),
        "job": {"variant": vars(variant), "checkpoint": str(checkpoint), "producer": str(state)},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every variant's uninterrupted run (here) and resumed run (in one fresh process)."""
    directory = tmp_path_factory.mktemp("resume")
    originals = {variant.id: run_original(variant, directory) for variant in VARIANTS}
    jobs, results = directory / "jobs.json", directory / "results.json"
    jobs.write_text(json.dumps([original["job"] for original in originals.values()]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    proc = subprocess.run(
        [sys.executable, str(TESTS / "_resume_worker.py"), str(jobs), str(results)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    resumed = {result["id"]: result for result in json.loads(results.read_text())}
    return {key: (originals[key], resumed[key]) for key in originals}


def group_tokens(group: Group) -> int:
    return sum(t.tokens for t in group.trajectories)


def in_flight_at_checkpoint(original: dict[str, Any]) -> tuple[int, int, int, int]:
    """(groups in flight, of which RUNNING, trajectories and tokens they held) at step k."""
    groups = original["checkpoint_in_flight"]
    return (
        len(groups),
        sum(running for _, running, _, _ in groups),
        sum(n for _, _, n, _ in groups),
        sum(tokens for *_, tokens in groups),
    )


def differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields of two PartitionStats records (as dicts) that differ."""
    return {key: (a[key], b[key]) for key in a if a[key] != b[key]}


@pytest.mark.parametrize("variant", VARIANTS, ids=[variant.id for variant in VARIANTS])
def test_resumed_run_trains_exactly_what_the_uninterrupted_run_trains(
    variant: Variant, runs: dict[str, tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    original, resumed = runs[variant.id]
    assert "error" not in resumed, resumed.get("error")
    k, n = variant.checkpoint_at, variant.steps
    groups, running, lost, lost_tokens = in_flight_at_checkpoint(original)
    # The scenario must exercise what the test is about: partial work in flight at the checkpoint
    # (with tokens, when there are versions), regenerated or resumed.
    assert (groups >= 2, running >= 1, lost >= 2) == (True, True, True), (groups, running, lost)
    assert (lost_tokens > 0) is variant.versions, lost_tokens
    assert resumed["reissued"] == [uid for uid, *_ in original["checkpoint_in_flight"]]  # in order
    reissued = variant.in_flight == "reissue"
    assert resumed["put_again"] == (lost if reissued else 0)

    expected = original["batches"][k:]
    assert [record["step"] for record in expected] == list(range(k + 1, n + 1))
    assert len(resumed["batches"]) == len(expected)
    for want, got in zip(expected, resumed["batches"], strict=True):
        assert got == want, f"step {want['step']}: the resumed batch differs"
    assert resumed["producer"] == original["producer"], "the producers did not replay the same ticks"

    # Final stats: equal, but for what reissuing counts (reissued_* and the regenerated puts).
    final, again = original["final_stats"], resumed["final_stats"]
    assert again["closed"] == final["closed"]
    assert set(again["partitions"]) == set(final["partitions"])
    for name in (*final["partitions"], "total"):
        want = final["total"] if name == "total" else final["partitions"][name]
        got = again["total"] if name == "total" else again["partitions"][name]
        train = reissued and name in ("train", "total")
        counted = (groups, lost, lost_tokens) if train else (0, 0, 0)
        assert (got["reissued_groups"], got["reissued_trajectories"], got["reissued_tokens"]) == counted, name
        assert got["admitted_trajectories"] == want["admitted_trajectories"] + counted[1], name
        assert got["admitted_tokens"] == want["admitted_tokens"] + counted[2], name
        assert differences(got, want).keys() <= set(_COUNTS), name


@pytest.mark.parametrize("variant", VARIANTS, ids=[variant.id for variant in VARIANTS])
def test_restored_and_regenerated_state_matches_the_checkpoint(
    variant: Variant, runs: dict[str, tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    original, resumed = runs[variant.id]
    assert "error" not in resumed, resumed.get("error")
    groups, running, lost, lost_tokens = in_flight_at_checkpoint(original)
    at_k = original["checkpoint_stats"]["partitions"]["train"]
    restored = resumed["restored_stats"]["partitions"]["train"]
    regenerated = resumed["regenerated_stats"]["partitions"]["train"]
    assert (at_k["pending"] + at_k["running"], at_k["running"]) == (groups, running)
    assert at_k["tokens"] >= lost_tokens
    if variant.in_flight == "resume":
        # Right after restore: in-flight groups are PENDING with their prefixes; nothing reissued.
        assert restored == {**at_k, "pending": groups, "running": 0}
        # Once their producers marked the RUNNING ones running again: exactly as saved.
        assert regenerated == at_k
    else:
        # Right after restore: in-flight groups are PENDING and empty, the rest exactly as saved.
        assert restored == {
            **at_k,
            "pending": groups,
            "running": 0,
            "trajectories": at_k["trajectories"] - lost,
            "tokens": at_k["tokens"] - lost_tokens,
            "reissued_groups": groups,
            "reissued_trajectories": lost,
            "reissued_tokens": lost_tokens,
        }
        # After regenerating them as far as they had got: as saved but for the reissue counters.
        assert regenerated == {
            **at_k,
            "admitted_trajectories": at_k["admitted_trajectories"] + lost,
            "admitted_tokens": at_k["admitted_tokens"] + lost_tokens,
            "reissued_groups": groups,
            "reissued_trajectories": lost,
            "reissued_tokens": lost_tokens,
        }
    assert resumed["restored_stats"]["partitions"]["val"] == original["checkpoint_stats"]["partitions"]["val"]


@pytest.mark.parametrize("variant", VARIANTS, ids=[variant.id for variant in VARIANTS])
def test_the_scenario_exercises_the_rules_after_the_checkpoint(
    variant: Variant, runs: dict[str, tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    """A resume that only ever saw easy steps would prove little: after step k, the drop runs
    evict stale groups (in flight too), the mask runs mask stale tokens, admission refuses
    prompts, and groups fail; one run carries evicted-in-flight groups across the checkpoint."""
    original, _ = runs[variant.id]
    at_k, final = original["checkpoint_stats"]["total"], original["final_stats"]["total"]
    after = {key: final[key] - at_k[key] for key in final if isinstance(final[key], int)}
    assert after["sampled_groups"] == variant.batch_size * (variant.steps - variant.checkpoint_at)
    assert after["evicted_failure_groups"] > 0
    if variant.strategy == "drop":
        assert after["evicted_stale_groups"] > 0
        assert after["evicted_in_flight_groups"] > 0
    elif variant.strategy == "wait":
        assert final["evicted_stale_groups"] == 0
    else:  # mask: stale tokens are trained masked; no group is evicted in flight
        assert after["masked_tokens"] > 0
        assert final["evicted_in_flight_groups"] == 0
    assert (after["sampled_tokens"] > 0) is variant.versions
    if variant.admission:
        assert original["producer"]["refused"] > original["checkpoint_producer"]["refused"]
    if variant.strategy == "drop" and not variant.admission and not variant.tick_before_save:
        # The producers hold groups evicted in flight that they hear of only after the resume,
        # through the restored memory of evicted uids (GroupEvictedError, not UnknownGroupError).
        assert len(original["checkpoint_producer"]["active"]) > len(original["checkpoint_in_flight"])
    ledgers = original["checkpoint_ledgers"]
    if variant.filters:
        # Groups are filtered after the checkpoint, a filter raises, and the counts since the
        # last batch were not 0 at the checkpoint (so the first batch after it reads restored ones).
        assert after["evicted_filtered_groups"] > 0, after
        assert after["filter_errors"] > 0, after
        assert ledgers["recent_filtered"] + ledgers["recent_filter_errors"] > 0, ledgers
    if variant.mixture is not None:
        tasks = original["final_stats"]["partitions"]["train"]["tasks"]
        at_k_tasks = original["checkpoint_stats"]["partitions"]["train"]["tasks"]
        assert all(tasks[task]["sampled"] > at_k_tasks[task]["sampled"] for task in tasks), tasks
    if variant.token_cap:  # the residency cap refuses prompts; reservations cross the checkpoint
        assert original["producer"]["refused"] > original["checkpoint_producer"]["refused"]
        assert original["checkpoint_stats"]["partitions"]["train"]["reserved_tokens"] > 0
        assert original["checkpoint_stats"]["partitions"]["train"]["resident_tokens"] > 0
    if variant.mixture == "borrow":  # a balance that is not 0 crosses the checkpoint
        assert any(ledgers["balances"]), ledgers
