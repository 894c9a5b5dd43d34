"""The journal's commit timer (issue 25): every change is committed within ``journal_interval``
of being made while an event loop runs, wherever the first uncommitted change was made.

No timing is asserted: each test waits (bounded by ``anyio.fail_after``) for the commit the
timer owes, and checks what a recovery from a copy of the file then holds.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from _helpers import LIMIT, copy_journal
from stalebuf import ReplayBuffer, SamplerConfig

pytestmark = pytest.mark.anyio


async def committed_uids(buffer: ReplayBuffer, path: Path, copy: Path, commits: int) -> list[str]:
    """Wait until the journal has made more than ``commits`` commits; the uids a recovery from a
    copy of the file then holds."""
    while buffer.stats().journal_commits <= commits:  # noqa: ASYNC110 (no event tells of a commit)
        await anyio.sleep(0.01)
    await anyio.to_thread.run_sync(copy_journal, path, copy)
    result = ReplayBuffer.recover(copy, status_log_interval=None)
    uids = sorted(group.uid for group in result.buffer.checkpoint().groups)
    result.buffer.close()
    return uids


def test_a_change_made_before_the_loop_runs_is_committed_by_the_timer_once_it_runs(
    tmp_path: Path, anyio_backend: str
) -> None:
    """A group put before ``anyio.run`` (no loop to schedule a commit on), then one put on the
    loop: the timer commits both, without a flush. (The change made with no loop used to leave
    the log armed with no timer: nothing was committed until a flush or close.)"""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(SamplerConfig(), journal=path, journal_interval=0.01, status_log_interval=None)
    buffer.put_group_nowait("before", [b"b"])
    commits = buffer.stats().journal_commits

    async def main() -> list[str]:
        with anyio.fail_after(LIMIT):
            await buffer.put_group("on-the-loop", [b"l"])
            return await committed_uids(buffer, path, tmp_path / "copy.db", commits)

    assert anyio.run(main, backend=anyio_backend) == ["before", "on-the-loop"]
    buffer.close()


async def test_a_change_on_the_loop_is_committed_by_the_timer(tmp_path: Path) -> None:
    with anyio.fail_after(LIMIT):
        path = tmp_path / "journal.db"
        buffer = ReplayBuffer(SamplerConfig(), journal=path, journal_interval=0.01, status_log_interval=None)
        commits = buffer.stats().journal_commits
        await buffer.put_group("a", [b"a"])
        assert await committed_uids(buffer, path, tmp_path / "copy.db", commits) == ["a"]
        await buffer.aclose()


async def test_changes_made_in_loop_callbacks_arm_the_timer(tmp_path: Path, anyio_backend: str) -> None:
    """Defect (found with Ray): a change made in a plain loop callback (what the thread handle
    and the Ray actor run producer calls as) found no running loop through anyio, so no commit
    was ever timed and nothing committed until flush() or close()."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=0.01)
    handle = buffer.threadsafe()
    await anyio.to_thread.run_sync(lambda: handle.put_group_nowait("a", [b"x"]))
    with anyio.fail_after(10):
        while buffer.stats().journal_commits < 2:  # noqa: ASYNC110 (the writer thread changes it)
            await anyio.sleep(0.01)
    assert "a" in ReplayBuffer.recover(path).buffer
    await buffer.aclose()


def test_a_change_on_a_second_loop_is_committed_though_the_first_loop_armed_the_timer(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Defect (found by review): a change on one loop armed the timer on that loop; the loop
    ended before the timer fired, and a change on the next loop (``asyncio.run`` twice) found the
    log armed, so no commit was timed on the new loop: it stayed uncommitted until a later
    change, a flush or a close (forever for a loop that then only waits)."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(SamplerConfig(), journal=path, journal_interval=0.05, status_log_interval=None)
    commits = buffer.stats().journal_commits

    async def first() -> None:
        buffer.put_group_nowait("first", [b"f"])  # arms the timer on this loop, which ends now

    async def second() -> list[str]:
        with anyio.fail_after(LIMIT):
            buffer.put_group_nowait("second", [b"s"])
            return await committed_uids(buffer, path, tmp_path / "copy.db", commits)

    anyio.run(first, backend=anyio_backend)
    assert anyio.run(second, backend=anyio_backend) == ["first", "second"]
    buffer.close()


def test_an_interval_beyond_what_a_thread_can_wait_keeps_the_writer_running(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Defect (found by review): ``journal_interval=1e10`` (finite, accepted) made the writer
    thread wait longer than ``threading`` can (OverflowError): the writer stopped at the first
    change and every flush raised CheckpointError."""
    path = tmp_path / "journal.db"
    buffer = ReplayBuffer(journal=path, journal_interval=1e10)

    async def main() -> None:
        with anyio.fail_after(LIMIT):
            await buffer.put_group("a", [b"a"])
            await anyio.sleep(0.05)  # the writer waits for the timer meanwhile
            await buffer.flush()

    anyio.run(main, backend=anyio_backend)
    buffer.close()
    assert "a" in ReplayBuffer.recover(path).buffer
