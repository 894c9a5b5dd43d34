"""``save`` is atomic (issue 12): a process SIGKILLed at random points while it saves, again and
again to the same path, always leaves a file that restores to one of the two buffers it was
writing, never a torn one.

The killed process is ``_save_loop_worker.py`` (see there). The temporary file of an interrupted
write stays behind, named ``.stalebuf-*.tmp`` next to the target, until the next save or restore
of that path removes it (issue 21, item 9): the tests check that it never takes the target's
place, that it does not outlive the next save or restore, and that a live writer's is kept.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import stalebuf
from _save_loop_worker import SIZES, build
from stalebuf import ReplayBuffer

TESTS = Path(__file__).resolve().parent
SRC = Path(stalebuf.__file__).resolve().parent.parent  # the stalebuf this process runs
ROUNDS = 30


def content(path: Path) -> str:
    """Which buffer the file at ``path`` holds ("a" or "b"); fails on anything else."""
    buf = ReplayBuffer.restore(path, status_log_interval=None).buffer
    groups = buf.checkpoint().groups
    which = groups[0].uid[0]
    assert [group.uid for group in groups] == [f"{which}{i}" for i in range(SIZES[which])]
    assert [t.payload for t in groups[-1].trajectories] == [f"{which}-{len(groups) - 1}", len(groups) - 1]
    assert buf.stats().total.trajectories == 2 * SIZES[which]
    return which


def temporaries(directory: Path) -> list[Path]:
    """The temporary files of interrupted writes in ``directory``."""
    return sorted(p for p in directory.iterdir() if p.name.startswith(".stalebuf-"))


def worker_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]),
        "OPENBLAS_NUM_THREADS": "1",  # the worker forks: keep numpy's import from starting threads
    }


def test_a_save_killed_at_any_moment_leaves_the_old_file_or_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "buffer.ckpt"
    seen = []
    left = []
    with subprocess.Popen(
        [sys.executable, str(TESTS / "_save_loop_worker.py"), str(path), str(ROUNDS), "7"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=worker_env(),
    ) as worker:
        assert worker.stdin is not None
        assert worker.stdout is not None
        try:
            assert worker.stdout.readline() == "ready\n"
            assert content(path) == "a"
            for number in range(ROUNDS):
                worker.stdin.write("go\n")
                worker.stdin.flush()
                assert worker.stdout.readline() == f"killed {number}\n"
                # At most the temporary of this round's kill: the earlier ones were removed by
                # the restore below (and would have been by this round's first save).
                left.append(temporaries(tmp_path))
                assert len(left[-1]) <= 1, left[-1]
                assert sorted(tmp_path.iterdir()) == sorted([path, *left[-1]])
                seen.append(content(path))  # a restore: it removes the dead writer's temporary
                assert temporaries(tmp_path) == []
        finally:
            worker.kill()
    assert set(seen) == {"a", "b"}, f"the kills did not land in different phases: {seen}"
    # At least one kill must have landed mid-write for this test to have tested anything.
    assert any(left), "no kill landed in the middle of a write"
    assert all(p.name.endswith(".tmp") for found in left for p in found)


@pytest.mark.parametrize("next_call", ["save", "restore"])
def test_a_writer_killed_mid_write_leaves_a_temporary_the_next_save_or_restore_removes(
    tmp_path: Path, next_call: str
) -> None:
    """Issue 21, item 9: a SIGKILL during ``save`` left its full-size ``.stalebuf-*.tmp`` next to
    the checkpoint forever (26 files, 388 MB after 40 kills). The next save or restore of that
    path removes it; the temporary of a writer still alive is kept."""
    path = tmp_path / "buffer.ckpt"
    anyio.run(build("a").save, path)
    with subprocess.Popen(
        [sys.executable, str(TESTS / "_save_loop_worker.py"), "hang", str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=worker_env(),
    ) as writer:
        assert writer.stdout is not None
        try:
            assert writer.stdout.readline() == "writing\n"
            (temporary,) = temporaries(tmp_path)
            assert temporary.stat().st_size > 256 * 4096  # the first chunk of groups is in it
            # Its writer is alive (blocked mid-write): another save and a restore keep it.
            anyio.run(build("b").save, path)
            assert content(path) == "b"
            assert temporaries(tmp_path) == [temporary]
        finally:
            writer.kill()
    assert temporaries(tmp_path) == [temporary]  # nothing removes it by itself
    if next_call == "save":
        anyio.run(build("a").save, path)
    else:
        ReplayBuffer.restore(path, status_log_interval=None)
    assert temporaries(tmp_path) == []
    assert content(path) == ("a" if next_call == "save" else "b")
