"""The README's "Scaling out with Ray" example: rollout actors feed a remote buffer.

Run: pip install '.[ray]' && python examples/ray_quickstart.py
"""

from __future__ import annotations

import asyncio

import numpy as np
import ray

from stalebuf import SamplerConfig
from stalebuf.ray import RemoteReplayBuffer, resolve

GROUP_SIZE, BATCH, STEPS, WORKERS = 8, 16, 5, 4


@ray.remote(num_cpus=0)
class RolloutWorker:
    """A rollout process. It owns the payloads it uploads, so it lives as long as the run."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.buffer = RemoteReplayBuffer.connect("replay")  # attach to the buffer by name

    async def rollout(self, step: int, prompts: int) -> None:
        for i in range(prompts):
            samples = [np.arange(512, dtype=np.int64) + s for s in range(GROUP_SIZE)]  # token ids
            # one round trip: add the prompt, put its GROUP_SIZE trajectories, mark it finished
            await self.buffer.put_group(f"w{self.worker}s{step}p{i}", samples, global_steps=step)


async def main() -> None:
    buffer = RemoteReplayBuffer(SamplerConfig(max_off_policy_threshold=2), name="replay")
    workers = [RolloutWorker.remote(w) for w in range(WORKERS)]
    dispatched = [w.rollout.remote(0, 2 * BATCH // WORKERS) for w in workers]  # 2 batches ahead
    for step in range(STEPS):
        batch, metrics = await buffer.sample(step, BATCH)  # parks until BATCH groups qualify
        batch = await resolve(batch)  # payload refs -> numpy arrays (zero-copy, read-only)
        tokens = np.stack(batch.payloads)
        staleness = metrics["training/off_policy/sampled_staleness/mean"]
        print(f"step {step}: {len(batch)} groups, tokens {tokens.shape}, staleness {staleness:.2f}")
        dispatched += [w.rollout.remote(step + 1, BATCH // WORKERS) for w in workers]
    await asyncio.gather(*dispatched)
    print((await buffer.stats()).total)
    await buffer.aclose()


if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False)
    asyncio.run(main())
