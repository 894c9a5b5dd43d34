"""Issue 25's promise, tested by crashing: a trainer that marks its checkpoints with
``flush(checkpoint_step=g)`` and resumes with ``recover(journal, global_steps=g)`` after a SIGKILL
at any instant loses no group that ended before the loss window, and trains no group twice.

For each seed, a child process runs the seeded producer/trainer scenario of
``_journal_crash_worker.py`` (drop and wait, with and without admission control, with and without
a filter, failed groups sampled or evicted, asyncio and trio) with a journal committing every
50 ms, and is SIGKILLed at a random instant after a random one of its marks. This process then
recovers at the child's last mark (``in_flight="reissue"``), checks the recovered buffer, and
goes on with the same scenario to its end: the reissued groups generated again, the data loader
restored to the mark's position and skipping the prompts of ``RestoreResult.kept``. Checked:

- **No group trained twice** over the resumed history: the batches the child trained up to its
  mark, then the resumed run's. (Batches the child trained after its mark are undone by the
  recovery: their groups must be resident again, or, never committed, dispatched again.)
- **Nothing lost that ended before the loss window.** A group is *durable* when, after it ended,
  the child saw the journal's writer with no hand-off in flight (``journal_pending_bytes == 0``,
  logged with each group's end) at an instant before the wall time of the journal's last commit
  (the ``commits`` table): that commit was handed off after the instant, so it holds every change
  made before it. (The wall time alone is not enough: a hand-off queued behind a commit in
  progress holds only what changed before it was queued.) Every durable group was trained up to
  the mark, evicted up to the mark (stale, failed) or by the filter, or is resident after the
  recovery, as it ended (not reissued).
- **Every prompt the run dispatched is accounted for** at the end: trained once, evicted with a
  reason, or still resident.
- The state at the journal's last commit (``recover`` without a step, from a copy) loads, keeps
  the conservation law and holds no group trained up to the mark.

``STALEBUF_CRASH_SEEDS=300`` runs 300 seeds instead of the default 32 (about 0.5 s each on 2 cores).
"""

from __future__ import annotations

import bisect
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

import stalebuf
from _helpers import assert_conserved, copy_journal, resident_groups
from _journal_crash_worker import ERROR, JOURNAL, Logs, Run, Spec, job_line, read_mark, rejected
from stalebuf import ReplayBuffer, Status

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "_journal_crash_worker.py"
SRC = Path(stalebuf.__file__).resolve().parent.parent  # the stalebuf this process imported
SEEDS = int(os.environ.get("STALEBUF_CRASH_SEEDS", "32"))
CONSUMER_REASONS = ("stale", "failure")  # evictions a sample makes (undone after the mark)


class ForkServer:
    """``_journal_crash_worker.py serve``: forks one scenario child per job."""

    def __init__(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join((str(SRC), str(TESTS))),
            "OPENBLAS_NUM_THREADS": "1",
        }
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the fork server died (exit {self.process.poll()})"
        return line

    def start(self, spec: Spec, directory: Path) -> int:
        """Start the scenario ``spec`` in ``directory``; return the child's pid."""
        assert self.process.stdin is not None
        self.process.stdin.write(job_line(spec, directory))
        self.process.stdin.flush()
        return int(self._line())

    def ended(self) -> int:
        """Wait for the child to end; its wait status."""
        return int(self._line())

    def close(self) -> None:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)
        self.process.stdout.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    forks = ForkServer()
    yield forks
    forks.close()


@dataclass
class History:
    """What one run's logs say (complete lines only: a SIGKILL may tear the last one)."""

    trained: list[tuple[int, list[str]]] = field(default_factory=list)
    ended: list[tuple[str, str, float, int]] = field(default_factory=list)  # uid, status, time, pending
    evicted: list[tuple[int, str, str]] = field(default_factory=list)  # step, reason, uid

    @classmethod
    def read(cls, directory: Path, prefix: str = "") -> History:
        history = cls()
        for step, *uids in _lines(directory / f"{prefix}trained.log"):
            history.trained.append((int(step), uids))
        for uid, status, when, pending in _lines(directory / f"{prefix}ended.log"):
            history.ended.append((uid, status, float(when), int(pending)))
        for step, reason, uid in _lines(directory / f"{prefix}evicted.log"):
            history.evicted.append((int(step), reason, uid))
        return history


def _lines(path: Path) -> list[list[str]]:
    text = path.read_text() if path.exists() else ""
    return [line.split() for line in text.split("\n")[:-1]]


def commit_walls(journal: Path, scratch: Path) -> list[float]:
    """The wall times of the journal's committed commits, read from a copy (the journal is
    recovered from untouched)."""
    scratch.mkdir()
    copy_journal(journal, scratch / JOURNAL)
    connection = sqlite3.connect(scratch / JOURNAL)
    try:
        return [wall for (wall,) in connection.execute("SELECT wall FROM commits ORDER BY seq")]
    finally:
        connection.close()


def crash(server: ForkServer, spec: Spec, directory: Path) -> dict[str, int]:
    """Run ``spec`` in a child, SIGKILL it at a random instant after a random mark; its last mark."""
    rng = random.Random(f"kill/{spec.seed}")
    after = rng.randrange(spec.mark_every - 1, spec.steps - 2)  # a step the child has marked
    delay = rng.uniform(0.0, 0.04)
    pid = server.start(spec, directory)
    deadline = time.monotonic() + 60
    try:
        while (mark := read_mark(directory)) is None or mark["step"] < after:
            assert not (directory / ERROR).exists(), (directory / ERROR).read_text()
            assert time.monotonic() < deadline, f"no mark at step {after} in 60 s"
            time.sleep(0.002)
        time.sleep(delay)
    finally:
        os.kill(pid, signal.SIGKILL)
        status = server.ended()
    assert not (directory / ERROR).exists(), (directory / ERROR).read_text()
    assert os.WIFSIGNALED(status), status
    assert os.WTERMSIG(status) == signal.SIGKILL, status
    mark = read_mark(directory)
    assert mark is not None
    return mark


@dataclass
class Coverage:
    """What one seed exercised (summed over the seeds, so the test cannot pass vacuously)."""

    durable: int = 0  # groups that ended before the loss window
    saved: int = 0  # ... of them not trained up to the mark: resident after the recovery
    window: int = 0  # groups that ended inside the loss window
    undone: int = 0  # groups the child trained after its mark (undone)
    kept: int = 0
    reissued: int = 0
    filtered: int = 0
    stale: int = 0


def check_seed(server: ForkServer, seed: int, directory: Path) -> Coverage:
    spec = Spec.of(seed)
    directory.mkdir()
    mark = crash(server, spec, directory)
    g, position = mark["step"], mark["next_prompt"]
    child = History.read(directory)
    walls = commit_walls(directory / JOURNAL, directory / "scratch")
    coverage = Coverage()

    trained_before: dict[str, int] = {}
    for step, uids in child.trained:
        if step <= g:
            for uid in uids:
                assert uid not in trained_before, f"{uid} trained at {trained_before[uid]} and {step}"
                trained_before[uid] = step
    undone = [uid for step, uids in child.trained if step > g for uid in uids]
    evicted_before = {uid: reason for step, reason, uid in child.evicted if reason == "filtered" or step <= g}

    # The state at the last commit (from the copy): consistent (recover checks it), conserved,
    # and no group trained up to the mark in it.
    last = ReplayBuffer.recover(
        directory / "scratch" / JOURNAL, status_log_interval=None, filters=spec.group_filters()
    ).buffer
    assert_conserved(last)
    assert not set(resident_groups(last)) & set(trained_before)
    last.close()

    resumed = Logs(directory, "resumed-")
    result = ReplayBuffer.recover(
        directory / JOURNAL,
        global_steps=g,
        in_flight="reissue",
        on_evict=resumed.evicted,
        status_log_interval=None,
        filters=spec.group_filters(),
        journal_interval=spec.interval,
    )
    buffer = result.buffer
    groups = resident_groups(buffer)
    reissued = {group.uid for group in result.reissue}
    kept = {group.uid for group in result.kept}
    assert_conserved(buffer)
    assert result.dropped == ()  # no uid is added twice in this scenario
    assert reissued == {uid for uid, group in groups.items() if group.in_flight}
    assert not kept & set(trained_before), "a group admitted after the point was trained before it"

    # Trained up to the mark: never back. Trained after it: back (or never committed: dispatched again).
    assert not set(groups) & set(trained_before), "a group trained up to the mark is resident again"
    for uid in undone:
        assert uid in groups or (int(uid[1:]) >= position and uid not in kept), f"undone {uid} is lost"
    coverage.undone = len(undone)

    # Nothing durable lost.
    quiet = sorted(when for _, _, when, pending in child.ended if pending == 0)
    for uid, status, when, _ in child.ended:
        at = bisect.bisect_left(quiet, when)
        if not (at < len(quiet) and quiet[at] < walls[-1]):
            coverage.window += 1
            continue
        coverage.durable += 1
        if uid in trained_before or uid in evicted_before:
            continue
        if status == "finished" and spec.filters and rejected(uid):
            continue  # evicted by the filter as it finished (logged, unless after the last commit)
        assert uid in groups, f"{uid} ({status} at {when}, durable) is lost after recovering at {g}"
        assert not groups[uid].in_flight, f"{uid} ended durably but comes back in flight"
        expected = Status.FAILURE if status == "failed" else Status.FINISHED
        assert groups[uid].status is expected, (uid, groups[uid].status)
        coverage.saved += 1
    coverage.kept, coverage.reissued = len(kept), len(reissued)

    # Go on to the end: the reissued groups generated again, the data loader from the mark.
    async def resume() -> tuple[int, set[str]]:
        with anyio.fail_after(60):
            run = Run(spec, buffer, resumed, position, frozenset(kept))
            async with anyio.create_task_group() as tasks:
                for group in result.reissue:
                    await run.slots.acquire()
                    tasks.start_soon(run.produce, group.uid)
                tasks.start_soon(run.dispatch, tasks)
                await run.train(g + 1, spec.steps, lambda step, position: None)
                tasks.cancel_scope.cancel()
            assert_conserved(buffer)
            final = set(resident_groups(buffer))
            await buffer.aclose()
            return run.next_prompt, final

    end, final = anyio.run(resume, backend=spec.backend)
    resumed.close()
    after = History.read(directory, "resumed-")

    # The whole resumed history: no group trained twice, every dispatched prompt accounted for.
    trained = Counter(trained_before.keys())
    trained.update(uid for _, uids in after.trained for uid in uids)
    twice = [uid for uid, count in trained.items() if count > 1]
    assert not twice, f"trained twice: {twice}"
    evicted = dict(evicted_before)
    evicted.update((uid, reason) for _, reason, uid in after.evicted)
    for i in range(end):
        uid = f"p{i}"
        reason = evicted.get(uid)
        if reason in CONSUMER_REASONS:
            assert uid not in trained, f"{uid} evicted ({reason}) and trained"
        if reason == "filtered":
            assert uid not in trained, f"{uid} filtered and trained"
            assert rejected(uid), f"{uid} filtered, though the filter keeps it"
        assert uid in trained or reason is not None or uid in final, f"{uid} is lost"
    coverage.filtered = sum(reason == "filtered" for reason in evicted.values())
    coverage.stale = sum(reason == "stale" for reason in evicted.values())
    return coverage


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the scenario children are forked")
def test_a_sigkilled_run_resumed_at_its_mark_loses_nothing_durable_and_trains_nothing_twice(
    tmp_path: Path, server: ForkServer
) -> None:
    total = Coverage()
    for seed in range(SEEDS):
        try:
            coverage = check_seed(server, seed, tmp_path / f"seed{seed}")
        except AssertionError as exc:
            raise AssertionError(f"seed {seed} ({Spec.of(seed)}): {exc}") from exc
        for name, value in vars(coverage).items():
            setattr(total, name, getattr(total, name) + value)
    # Every path the promise covers was taken by some seed.
    for name, value in vars(total).items():
        assert value > 0, f"no seed exercised {name}: {total}"
