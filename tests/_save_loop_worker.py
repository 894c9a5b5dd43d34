"""The crash half of the atomicity test: save two buffers in turn, get killed, again.

Usage: ``python tests/_save_loop_worker.py PATH ROUNDS SEED``. It builds buffers A and B
(:func:`build`), writes A to PATH once, prints ``ready``, then for each round waits for a line
on stdin, forks a child that saves A, B, A, B... to PATH in a loop, lets a random number (0-3)
of saves complete, SIGKILLs it at a random moment of the next and prints ``killed N``, so the test
process can check what is at PATH in between. The forking parent never runs an event loop or a
thread of its own, so forking it is safe.

``python tests/_save_loop_worker.py hang PATH`` saves a buffer whose second chunk of groups never
finishes pickling: it prints ``writing`` once the first chunk is in the temporary file, then
blocks until it is killed (a writer killed mid-write, deterministically).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from typing import Any

import anyio

from stalebuf import ReplayBuffer, SamplerConfig

SIZES = {"a": 3000, "b": 2000}  # different sizes, so a file cut at the other's length is caught


def build(which: str) -> ReplayBuffer:
    """Buffer A or B: ``SIZES[which]`` finished groups of two trajectories each."""
    buf = ReplayBuffer(SamplerConfig(), status_log_interval=None)
    for i in range(SIZES[which]):
        buf.put_group_nowait(f"{which}{i}", [f"{which}-{i}", i], tags={"which": which})
    return buf


class Hang:
    """A payload whose pickling says ``writing`` and then never returns."""

    def __reduce__(self) -> Any:
        print("writing", flush=True)
        threading.Event().wait()
        raise AssertionError("unreachable")


def hang(path: str) -> None:
    """Save 300 groups (256 to a chunk) whose last one cannot be pickled before a kill."""
    buf = ReplayBuffer(SamplerConfig(), status_log_interval=None)
    for i in range(299):
        buf.put_group_nowait(f"g{i}", [os.urandom(4096)])
    buf.put_group_nowait("hang", [Hang()])
    anyio.run(buf.save, path)


def child(path: str, buffers: list[ReplayBuffer], forever: bool, started: int | None = None) -> None:
    async def loop() -> None:
        if started is not None:  # the loop runs: from here on, every moment is inside a save
            os.write(started, b"x")
        while True:
            for buf in buffers:
                await buf.save(path)
                if started is not None:  # one more save completed
                    os.write(started, b"s")
            if not forever:
                return

    anyio.run(loop)
    os._exit(0)


def main(path: str, rounds: int, seed: int) -> None:
    a, b = build("a"), build("b")
    rng = random.Random(seed)
    pid = os.fork()
    if pid == 0:
        child(path, [a], forever=False)
    os.waitpid(pid, 0)
    print("ready", flush=True)
    for number in range(rounds):
        sys.stdin.readline()
        started, ready = os.pipe()
        pid = os.fork()
        if pid == 0:
            child(path, [a, b], forever=True, started=ready)
        os.read(started, 1)  # forking and starting a loop can take longer than a save
        # Let a random number of saves complete (so A and B both end up at PATH whatever the
        # machine's speed), then kill at a random moment of the next one.
        for _ in range(rng.randint(0, 3)):
            os.read(started, 1)
        time.sleep(rng.uniform(0.0, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.close(started)
        os.close(ready)
        os.waitpid(pid, 0)
        print(f"killed {number}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "hang":
        hang(sys.argv[2])
    else:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
