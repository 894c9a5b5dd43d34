"""stalebuf: an asyncio-native, staleness-aware replay buffer for asynchronous RL of LLMs.

Producers move groups of trajectories through PENDING -> RUNNING -> FINISHED/FAILURE;
the trainer's ``await buffer.sample(global_steps, batch_size)`` blocks until a whole
batch qualifies under the staleness rules, then returns it oldest first.
"""

from __future__ import annotations

from .buffer import ReplayBuffer
from .config import SamplerConfig
from .records import Batch, EvictionEvent, Group, Status, Trajectory
from .stats import BufferStats, PartitionStats

__all__ = [
    "Batch",
    "BufferStats",
    "EvictionEvent",
    "Group",
    "PartitionStats",
    "ReplayBuffer",
    "SamplerConfig",
    "Status",
    "Trajectory",
]

__version__ = "0.1.0.dev0"
