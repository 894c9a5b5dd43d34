"""The scenario of the journal's crash-exactness test (issue 25's "Promise"), and the process that
runs it until it is SIGKILLed.

A run is a trainer that samples ``batch_size`` groups a step, logs each batch (its step and uids)
to an append-only file, fsynced, and every ``mark_every`` steps marks its checkpoint:
``await buffer.flush(checkpoint_step=g)``, then, once that returned, records in a side file
(written atomically) that its state at step ``g`` is saved, with its data loader's position: the
number of prompts dispatched when it called ``flush``. One dispatcher task takes prompts
``p0, p1, ...`` from that data loader in order and admits them (``add_prompt``: under admission
control it waits for a slot); at most ``workers`` groups are generated at once, each a seeded
number of puts with seeded pauses, then finished or failed. Each group that ends is logged with
when it ended and whether the journal's writer had hand-offs in flight then
(``stats().journal_pending_bytes``): see ``tests/test_journal_crash.py`` for how the test finds
the loss window from them and the journal's commit times. Evictions (``on_evict``) are logged
with their step and reason. Every log line is one ``write`` to an ``O_APPEND`` file, so a SIGKILL
loses none (only the trainer's log is fsynced: the machine does not crash).

The test process drives this file as a fork server (``python _journal_crash_worker.py serve``):
it reads one job a line on stdin (JSON: a :class:`Spec` and a directory), forks a child that
runs the scenario in that directory with a journal there (stalebuf, anyio and trio are imported
once, so a child starts in milliseconds), prints the child's pid, and when the child has ended
(the test SIGKILLs it mid-run) its wait status. A child that raises writes its traceback to
``error.txt`` and exits 1. The test process then recovers at the child's last mark and goes on
with the same :class:`Run` code to the end.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from stalebuf import EvictionEvent, Group, GroupEvictedError, ReplayBuffer, SamplerConfig

__all__ = ["Logs", "Run", "Spec", "payload", "plan", "read_mark", "rejected"]

JOURNAL = "journal.db"
MARK = "mark.json"
ERROR = "error.txt"


@dataclass(frozen=True)
class Spec:
    """One seeded crash scenario."""

    seed: int
    backend: str  # "asyncio" or "trio"
    strategy: str  # "drop" or "wait"
    admission: bool  # admission control (admission_batch_size = batch_size)
    filters: bool  # the buffer runs the ``keep`` filter
    failure_strategy: str  # "sample" or "evict"
    evict_in_flight: bool  # evict_stale_in_flight (drop only)
    mark_every: int  # the trainer marks its checkpoint every this many steps
    steps: int = 14
    batch_size: int = 4
    workers: int = 6
    interval: float = 0.05  # journal_interval

    @classmethod
    def of(cls, seed: int) -> Spec:
        """The scenario of ``seed``: every combination of the switches comes up over 24 seeds."""
        strategy = ("drop", "wait")[(seed // 2) % 2]
        return cls(
            seed,
            backend=("asyncio", "trio")[seed % 2],
            strategy=strategy,
            admission=(seed // 4) % 2 == 0,
            filters=seed % 3 == 0,
            failure_strategy=("sample", "evict")[(seed // 3) % 2],
            evict_in_flight=strategy == "drop" and (seed // 8) % 2 == 1,
            mark_every=1 + seed % 3,
        )

    def config(self) -> SamplerConfig:
        return SamplerConfig(
            max_off_policy_threshold=2,
            max_off_policy_strategy=self.strategy,  # type: ignore[arg-type]
            failure_strategy=self.failure_strategy,  # type: ignore[arg-type]
            admission_batch_size=self.batch_size if self.admission else None,
            evict_stale_in_flight=self.evict_in_flight,
        )

    def group_filters(self) -> list[Callable[[Group], bool]]:
        """The buffer's filters (code: given again to ``recover``)."""
        return [keep] if self.filters else []


def rejected(uid: str) -> bool:
    """Whether the ``keep`` filter rejects the group ``uid`` (a pure function of it)."""
    return random.Random(f"rejected/{uid}").random() < 0.15


def keep(group: Group) -> bool:
    """The scenario's filter: rejects about 15% of the groups, the same ones in every process."""
    return not rejected(group.uid)


@dataclass(frozen=True)
class Plan:
    """How the group of one prompt is generated: a pure function of the seed and uid, so a
    reissued group is generated again the same way."""

    pauses: tuple[float, ...]  # one per session, before its put
    fail: bool


def plan(seed: int, uid: str) -> Plan:
    rng = random.Random(f"{seed}/{uid}")
    pauses = tuple(rng.uniform(0.0, 0.004) for _ in range(rng.randint(1, 4)))
    return Plan(pauses, rng.random() < 0.1)


def payload(uid: str, session: int) -> bytes:
    return f"{uid}/{session};".encode() * 8


class Logs:
    """The append-only logs of one run (``prefix`` tells the crashed run's from the resumed one's)."""

    def __init__(self, directory: Path, prefix: str = "") -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self._trained = os.open(directory / f"{prefix}trained.log", flags, 0o644)
        self._ended = os.open(directory / f"{prefix}ended.log", flags, 0o644)
        self._evicted = os.open(directory / f"{prefix}evicted.log", flags, 0o644)

    def trained(self, step: int, uids: list[str]) -> None:
        os.write(self._trained, f"{step} {' '.join(uids)}\n".encode())
        os.fsync(self._trained)

    def ended(self, uid: str, status: str, buffer: ReplayBuffer) -> None:
        """Log that ``uid`` ended; with whether hand-offs were in flight at that moment, then the time."""
        pending = buffer.stats().journal_pending_bytes
        os.write(self._ended, f"{uid} {status} {time.time()!r} {pending}\n".encode())

    def evicted(self, event: EvictionEvent) -> None:
        """The ``on_evict`` callback: one line per evicted group."""
        lines = "".join(f"{event.global_steps} {event.reason} {group.uid}\n" for group in event.groups)
        os.write(self._evicted, lines.encode())

    def close(self) -> None:
        for fd in (self._trained, self._ended, self._evicted):
            os.close(fd)


def write_mark(directory: Path, step: int, next_prompt: int) -> None:
    """Record, atomically and durably, that the trainer's checkpoint holds step ``step``."""
    temporary = directory / f"{MARK}.tmp"
    with open(temporary, "w") as file:
        json.dump({"step": step, "next_prompt": next_prompt}, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, directory / MARK)


def read_mark(directory: Path) -> dict[str, int] | None:
    """The trainer's last checkpoint (None before the first)."""
    try:
        with open(directory / MARK) as file:
            return json.load(file)  # type: ignore[no-any-return]
    except FileNotFoundError:
        return None


class Run:
    """The producers and the trainer of a run on ``buffer``, its data loader at ``next_prompt``
    (prompts in ``skip`` are not dispatched: they were already, before a crash)."""

    def __init__(
        self,
        spec: Spec,
        buffer: ReplayBuffer,
        logs: Logs,
        next_prompt: int,
        skip: frozenset[str] = frozenset(),
    ) -> None:
        self.spec, self.buffer, self.logs = spec, buffer, logs
        self.next_prompt = next_prompt
        self.skip = skip
        self.slots = anyio.Semaphore(spec.workers)  # groups generated at once
        self.rng = random.Random(f"{spec.seed}/trainer/{next_prompt}")

    async def produce(self, uid: str) -> None:
        """Generate the PENDING group ``uid`` (its slot is taken): run, put, finish or fail."""
        buffer, work = self.buffer, plan(self.spec.seed, uid)
        try:
            await buffer.mark_running(uid)
            for session, pause in enumerate(work.pauses):
                await anyio.sleep(pause)
                await buffer.put(uid, payload(uid, session), session_id=session)
            if work.fail:
                await buffer.mark_failed(uid)
            else:
                await buffer.mark_finished(uid)
            self.logs.ended(uid, "failed" if work.fail else "finished", buffer)
        except GroupEvictedError:  # evicted as stale while in flight: it will not be trained
            pass
        finally:
            self.slots.release()

    async def dispatch(self, tasks: anyio.abc.TaskGroup) -> None:
        """Dispatch the data loader's prompts in order, forever."""
        while True:
            uid = f"p{self.next_prompt}"
            if uid in self.skip:
                self.next_prompt += 1
                continue
            await self.slots.acquire()
            await self.buffer.add_prompt(uid)
            self.next_prompt += 1
            tasks.start_soon(self.produce, uid)

    def dispatched(self) -> int:
        """The data loader's position: prompts before it are all in the buffer's history (the
        one the dispatcher waits on may have been admitted without the dispatcher running yet)."""
        return self.next_prompt + (f"p{self.next_prompt}" in self.buffer)

    async def train(self, first: int, last: int, on_mark: Callable[[int, int], object]) -> None:
        """Train steps ``first`` to ``last - 1``, marking a checkpoint every ``mark_every`` steps."""
        buffer, spec = self.buffer, self.spec
        for step in range(first, last):
            batch, _ = await buffer.sample(step, spec.batch_size)
            self.logs.trained(step, batch.uids)
            await anyio.sleep(self.rng.uniform(0.0, 0.003))  # the optimizer step
            if (step + 1) % spec.mark_every == 0:
                position = self.dispatched()
                await buffer.flush(checkpoint_step=step)
                on_mark(step, position)


def run_child(spec: Spec, directory: Path) -> None:
    """The crashed run: from scratch, journaled, until it is killed."""
    logs = Logs(directory)
    buffer = ReplayBuffer(
        spec.config(),
        journal=directory / JOURNAL,
        journal_interval=spec.interval,
        status_log_interval=None,
        filters=spec.group_filters(),
        on_evict=logs.evicted,
    )

    async def main() -> None:
        run = Run(spec, buffer, logs, 0)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(run.dispatch, tasks)
            await run.train(0, spec.steps, lambda step, position: write_mark(directory, step, position))
            tasks.cancel_scope.cancel()
        await anyio.sleep_forever()  # the test kills it before it gets here (or here)

    anyio.run(main, backend=spec.backend)


def _child(job: dict[str, Any]) -> int:
    """In the forked child: run the job with stdout and stderr in its directory; the exit code."""
    directory = Path(job["workdir"])
    out = os.open(directory / "child.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    try:
        run_child(Spec(**job["spec"]), directory)
    except BaseException:
        (directory / ERROR).write_text(traceback.format_exc())
        return 1
    return 0


def serve() -> None:
    """The fork server loop (see the module docs)."""
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(job)
            finally:
                os._exit(code)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(status, flush=True)


def job_line(spec: Spec, directory: Path) -> str:
    """The stdin line of one job."""
    return json.dumps({"spec": asdict(spec), "workdir": str(directory)}) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["serve"]:
        raise SystemExit("usage: _journal_crash_worker.py serve")
    serve()
