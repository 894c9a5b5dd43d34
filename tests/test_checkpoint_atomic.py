"""``save`` is atomic (issue 12): a process SIGKILLed at random points while it saves, again and
again to the same path, always leaves a file that restores to one of the two buffers it was
writing, never a torn one.

The killed process is ``_save_loop_worker.py`` (see there). The temporary files of interrupted
writes stay behind, named ``.stalebuf-*.tmp`` next to the target: the test checks that they never
take the target's place and counts them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import stalebuf
from _save_loop_worker import SIZES
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


def test_a_save_killed_at_any_moment_leaves_the_old_file_or_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "buffer.ckpt"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]),
        "OPENBLAS_NUM_THREADS": "1",  # the worker forks: keep numpy's import from starting threads
    }
    seen = []
    with subprocess.Popen(
        [sys.executable, str(TESTS / "_save_loop_worker.py"), str(path), str(ROUNDS), "7"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
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
                seen.append(content(path))
        finally:
            worker.kill()
    assert set(seen) == {"a", "b"}, f"the kills did not land in different phases: {seen}"
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p != path)
    assert all(name.startswith(".stalebuf-") and name.endswith(".tmp") for name in leftovers), leftovers
    # Interrupted writes leave their temporary file (nothing can remove it after a SIGKILL); at
    # least one kill must have landed mid-write for this test to have tested anything.
    assert 1 <= len(leftovers) <= ROUNDS, leftovers
    assert content(path) in ("a", "b")  # the leftovers never disturb the target
