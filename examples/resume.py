"""A trainer that crashes mid-run, restarts from its last checkpoint and finishes.

Run: python examples/resume.py [--in-flight reissue|evict] [--seed N]

The script supervises two runs of itself as a subprocess. The first trains, saving the buffer and
its ledger at the end of every step, until the supervisor kills it with SIGKILL at a random moment
(mid-generation, mid-step, perhaps mid-save). The second restores the last checkpoint, generates
the in-flight groups again (``in_flight="reissue"``; with "evict" they are evicted with reason
"restart"), and trains to the end. The supervisor then prints the ledger: every dispatched prompt
trained exactly once or evicted with a reason. It exits 1 if the ledger does not balance.

How a trainer wires it: save at the end of a step, with everything else that step's model
checkpoint covers (here, the ledger and the next prompt id); restore before the first ``sample``;
regenerate the ``reissue`` groups under their own uids. Steps after the last checkpoint are redone,
as the model's are.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from stalebuf import EvictionEvent, GroupEvictedError, ReplayBuffer, SamplerConfig, UnknownGroupError

STEPS, BATCH, GROUP_SIZE, WORKERS = 10, 4, 3, 6
CONFIG = SamplerConfig(max_off_policy_threshold=2, failure_strategy="evict", admission_batch_size=BATCH)


# -- the trainer (a subprocess) -----------------------------------------------------------------


class Run:
    """One process's training run: the buffer, the ledger, and the files in ``directory``."""

    def __init__(self, directory: Path, seed: int, in_flight: str) -> None:
        self.directory = directory
        self.rng = random.Random(seed)
        self.in_flight = in_flight
        self.ledger: dict[str, Any] = {"step": 0, "next_prompt": 0, "dispatched": {}, "trained": {},
                                       "evicted": {}, "twice": [], "reissued": []}  # fmt: skip
        self.buffer = ReplayBuffer(CONFIG, on_evict=self.evicted, status_log_interval=None)
        self.reissue: list[str] = []
        latest = directory / "LATEST"
        if latest.exists():  # a restart: the last checkpoint and the ledger saved with it
            step = int(latest.read_text())
            self.ledger = json.loads((directory / f"ledger-{step}.json").read_text())
            result = ReplayBuffer.restore(
                directory / f"buffer-{step}.ckpt",
                in_flight=in_flight,  # type: ignore[arg-type]
                on_evict=self.evicted,
                status_log_interval=None,
            )
            self.buffer = result.buffer
            self.reissue = [group.uid for group in result.reissue]
            self.ledger["reissued"] += self.reissue
            print(f"restored step {step}: {len(self.reissue)} group(s) to generate again", flush=True)

    def evicted(self, event: EvictionEvent) -> None:
        for group in event.groups:
            self.ledger["evicted"][group.uid] = event.reason

    async def rollout_worker(self, jobs: MemoryObjectReceiveStream[str]) -> None:
        buffer, rng = self.buffer, self.rng
        async for uid in jobs:
            try:
                await buffer.mark_running(uid)
                for session in range(GROUP_SIZE):
                    await anyio.sleep(rng.lognormvariate(-4.5, 0.8))  # generation, long-tailed
                    await buffer.put(uid, {"tokens": [session] * 4}, session_id=session)
                await (buffer.mark_failed if rng.random() < 0.05 else buffer.mark_finished)(uid)
            except (GroupEvictedError, UnknownGroupError):
                pass  # evicted while generating: its fate is in the ledger already

    async def dispatch(self, send: MemoryObjectSendStream[str]) -> None:
        while True:
            uid = f"p{self.ledger['next_prompt']:04d}"
            await self.buffer.add_prompt(uid)  # waits for an admission slot
            self.ledger["next_prompt"] += 1
            self.ledger["dispatched"][uid] = self.buffer.dispatch_step()
            send.send_nowait(uid)  # at once: a dispatched prompt always reaches a worker

    async def checkpoint(self, step: int) -> None:
        """Save the buffer and the ledger of the end of ``step``, then point LATEST at them."""
        ledger = json.dumps({**self.ledger, "step": step})  # taken with the buffer's checkpoint
        await self.buffer.save(self.directory / f"buffer-{step}.ckpt")
        write_atomically(self.directory / f"ledger-{step}.json", ledger)
        write_atomically(self.directory / "LATEST", str(step))
        for old in (self.directory / f"buffer-{step - 2}.ckpt", self.directory / f"ledger-{step - 2}.json"):
            old.unlink(missing_ok=True)
        print(f"saved step {step}", flush=True)

    def record(self, step: int, uids: list[str]) -> None:
        for uid in uids:
            if uid in self.ledger["trained"]:
                self.ledger["twice"].append(uid)
            self.ledger["trained"][uid] = step

    async def train(self) -> None:
        send, jobs = anyio.create_memory_object_stream[str](10_000)
        async with anyio.create_task_group() as tg:
            for _ in range(WORKERS):
                tg.start_soon(self.rollout_worker, jobs.clone())
            for uid in self.reissue:  # generate them again, under the same uid
                send.send_nowait(uid)
            dispatcher = anyio.CancelScope()

            async def dispatch() -> None:
                with dispatcher:
                    await self.dispatch(send)

            tg.start_soon(dispatch)
            for step in range(self.ledger["step"] + 1, STEPS + 1):
                batch, _ = await self.buffer.sample(step, BATCH)
                await anyio.sleep(0.02)  # the training step
                self.record(step, batch.uids)
                await self.checkpoint(step)
            dispatcher.cancel()
            send.close()  # the workers finish what they hold, then stop
            jobs.close()
        self.drain()

    def drain(self) -> None:
        """Train what is left in a last, smaller batch (stale and failed groups are evicted)."""
        buffer = self.buffer
        count = buffer.sampleable_count(STEPS)
        try:
            batch, _ = buffer.sample_nowait(STEPS, max(count, 1))
            self.record(STEPS, batch.uids)
        except Exception:
            assert count == 0  # nothing to train; the call evicted what had to go
        total = buffer.stats().total
        counters = ("admitted_groups", "sampled_groups", "evicted_stale_groups", "evicted_failure_groups",
                    "evicted_restart_groups", "reissued_groups")  # fmt: skip
        ledger = {**self.ledger, "step": STEPS, "resident": total.groups}
        ledger["stats"] = {name: getattr(total, name) for name in counters}
        write_atomically(self.directory / "final.json", json.dumps(ledger))


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


# -- the supervisor -------------------------------------------------------------------------------


def run_worker(directory: Path, args: argparse.Namespace, kill_after_step: int | None) -> None:
    """Run the trainer; if ``kill_after_step`` is set, SIGKILL it at a random moment after that
    step's checkpoint."""
    command = [sys.executable, __file__, "--worker", str(directory), "--in-flight", args.in_flight,
               "--seed", str(args.seed)]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"  [trainer {proc.pid}] {line.rstrip()}")
            if kill_after_step is not None and line.strip() == f"saved step {kill_after_step}":
                kill_after_step = None
                time.sleep(random.Random(args.seed).uniform(0.0, 0.1))
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                # What it printed before dying is still in the pipe: show it before the kill.
                for rest in proc.stdout:
                    print(f"  [trainer {proc.pid}] {rest.rstrip()}")
                print(f"  [supervisor] killed trainer {proc.pid} with SIGKILL")
        proc.wait()


def report(directory: Path) -> bool:
    """Print the ledger; return whether it balances."""
    ledger = json.loads((directory / "final.json").read_text())
    dispatched, trained, evicted = ledger["dispatched"], ledger["trained"], ledger["evicted"]
    reissued = set(ledger["reissued"])
    print(f"\nledger: {len(dispatched)} prompts dispatched")
    for uid, step in sorted(dispatched.items()):
        fate = f"trained at step {trained[uid]}" if uid in trained else f"evicted ({evicted.get(uid)})"
        note = "  <- in flight at the crash, generated again" if uid in reissued else ""
        print(f"  {uid}  dispatched at {step:2d}  {fate}{note}")
    problems = []
    if ledger["twice"]:
        problems.append(f"trained twice: {sorted(set(ledger['twice']))}")
    if set(trained) & set(evicted):
        problems.append(f"trained and evicted: {sorted(set(trained) & set(evicted))}")
    lost = set(dispatched) - set(trained) - set(evicted)
    if lost:
        problems.append(f"neither trained nor evicted: {sorted(lost)}")
    if set(trained) - set(dispatched) or set(evicted) - set(dispatched):
        problems.append("trained or evicted but never dispatched")
    if ledger["resident"]:
        problems.append(f"{ledger['resident']} group(s) left in the buffer")
    stats = ledger["stats"]
    by_reason = {reason: list(evicted.values()).count(reason) for reason in ("stale", "failure", "restart")}
    counted = {"admitted_groups": len(dispatched), "sampled_groups": len(trained)}
    counted.update({f"evicted_{reason}_groups": count for reason, count in by_reason.items()})
    for name, count in counted.items():
        if stats[name] != count:
            problems.append(f"the buffer counted {name}={stats[name]}, the ledger {count}")
    reasons = sorted(set(evicted.values()))
    print(f"\ntrained {len(trained)}, evicted {len(evicted)} ({', '.join(reasons) or 'none'}), "
          f"generated again after the crash {len(reissued)}")  # fmt: skip
    print("buffer counters:", ", ".join(f"{name} {value}" for name, value in stats.items()))
    for problem in problems:
        print(f"LEDGER DOES NOT BALANCE: {problem}")
    if not problems:
        print("the ledger balances: every dispatched prompt was trained exactly once or evicted")
    return not problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", choices=["reissue", "evict"], default="reissue")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        anyio.run(Run(Path(args.worker), args.seed, args.in_flight).train)
        return
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        run_worker(directory, args, kill_after_step=STEPS // 2 - 1)
        print("  [supervisor] restarting from the last checkpoint")
        run_worker(directory, args, kill_after_step=None)
        sys.exit(0 if report(directory) else 1)


if __name__ == "__main__":
    main()
