"""stalebuf: an anyio-native, staleness-aware replay buffer for asynchronous RL of LLMs.

Producers move groups of trajectories through PENDING -> RUNNING -> FINISHED/FAILURE;
the trainer's ``await buffer.sample(global_steps, batch_size)`` blocks until a whole
batch qualifies under the staleness rules, then returns it oldest first.
"""

from __future__ import annotations

from ._open_group import GroupWatch
from ._rollout import RolloutGroup
from ._threadsafe import ThreadsafeProducer
from ._version import __version__ as __version__
from .buffer import GroupStatus, ReplayBuffer
from .checkpoint import BufferCheckpoint, RestoreResult
from .config import SamplerConfig
from .errors import (
    BackendMismatchError,
    BatchNotReadyError,
    BufferClosedError,
    BufferFullError,
    BufferUnavailableError,
    CheckpointError,
    ConfigError,
    DuplicateGroupError,
    DuplicateTrajectoryError,
    FutureTagError,
    GroupCutError,
    GroupEvictedError,
    InvalidTransitionError,
    MissingDependencyError,
    StalebufError,
    TagClosedError,
    UnknownGroupError,
    WrongThreadError,
)
from .policy import StalenessPolicy
from .protocol import AsyncReplayBuffer
from .records import Batch, EvictionEvent, Group, Status, Trajectory
from .stats import BufferStats, PartitionStats, WaitExplanation

__all__ = [
    "AsyncReplayBuffer",
    "BackendMismatchError",
    "Batch",
    "BatchNotReadyError",
    "BufferCheckpoint",
    "BufferClosedError",
    "BufferFullError",
    "BufferStats",
    "BufferUnavailableError",
    "CheckpointError",
    "ConfigError",
    "DuplicateGroupError",
    "DuplicateTrajectoryError",
    "EvictionEvent",
    "FutureTagError",
    "Group",
    "GroupCutError",
    "GroupEvictedError",
    "GroupStatus",
    "GroupWatch",
    "InvalidTransitionError",
    "MissingDependencyError",
    "PartitionStats",
    "ReplayBuffer",
    "RestoreResult",
    "RolloutGroup",
    "SamplerConfig",
    "StalebufError",
    "StalenessPolicy",
    "Status",
    "TagClosedError",
    "ThreadsafeProducer",
    "Trajectory",
    "UnknownGroupError",
    "WaitExplanation",
    "WrongThreadError",
]
