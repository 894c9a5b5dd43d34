"""A tiny async RL loop: rollout workers feed the buffer while the trainer samples.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import random

import anyio

from stalebuf import EvictionEvent, ReplayBuffer, SamplerConfig

GROUP_SIZE = 4
BATCH_SIZE = 8
STEPS = 5


async def main() -> None:
    config = SamplerConfig(max_off_policy_threshold=2, max_off_policy_strategy="drop")
    rng = random.Random(0)
    next_uid = 0
    dispatch: anyio.abc.ObjectSendStream[tuple[str, int]]
    dispatch, jobs = anyio.create_memory_object_stream[tuple[str, int]](1000)

    def submit(global_steps: int) -> None:
        nonlocal next_uid
        uid = f"prompt{next_uid}"
        next_uid += 1
        buffer.add_prompt_nowait(uid, global_steps=global_steps)
        dispatch.send_nowait((uid, global_steps))

    def refill(event: EvictionEvent) -> None:  # evicted prompts are re-dispatched
        print(f"  evicted {len(event.groups)} group(s) as {event.reason}")
        for _ in event.groups:
            submit(event.global_steps)

    buffer = ReplayBuffer(config, on_evict=refill, status_log_interval=None)

    async def rollout_worker() -> None:
        async for uid, _step in jobs:
            await buffer.mark_running(uid)
            await anyio.sleep(rng.lognormvariate(-4.0, 1.0))  # generation time, long-tailed
            for session in range(GROUP_SIZE):
                await buffer.put(uid, {"tokens": [session] * 3}, session_id=session)
            await buffer.mark_finished(uid)

    async with buffer, anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(rollout_worker)
        for _ in range(2 * BATCH_SIZE):
            submit(0)
        for step in range(STEPS):
            batch, metrics = await buffer.sample(step, BATCH_SIZE)
            for _ in range(BATCH_SIZE):  # keep the pipeline full
                submit(step + 1)
            print(
                f"step {step}: {len(batch)} groups, {len(batch.keys)} trajectories, "
                f"staleness mean {metrics['training/off_policy/sampled_staleness/mean']:.2f}, "
                f"waited {metrics['training/off_policy/wait_seconds'] * 1000:.1f} ms"
            )
        tg.cancel_scope.cancel()
    print(buffer.stats().total)


if __name__ == "__main__":
    anyio.run(main)
