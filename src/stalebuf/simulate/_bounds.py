"""The bounds on what the simulator accepts, and why: times, sizes and latency files.

The simulator holds everything it models in memory and runs on a float virtual clock, so each
bound is what keeps one run finite and within a few GB (sizes measured on CPython 3.11, with
the other settings at their defaults), far above any real pipeline's. :mod:`._latency`,
:mod:`._empirical` and :mod:`._config` check them; the command line quotes them in its help.
"""

from __future__ import annotations

__all__ = [
    "MAX_BATCH_SIZE",
    "MAX_CHUNK_TOKENS",
    "MAX_FILE_BYTES",
    "MAX_GROUP_SIZE",
    "MAX_SECONDS",
    "MAX_STEP_TRAJECTORIES",
    "MAX_TOKENS_PER_SECOND",
    "MAX_TOKEN_BUDGET",
    "MAX_TRAJECTORY_TOKENS",
    "MAX_WORKERS",
    "MIN_FILTER_PASS_RATE",
]

#: The longest time, in seconds, a fixed or exponential latency, an empirical value or a train step
#: may be (about 31,700 years). The virtual clock is a float: much larger times lose the train
#: step to rounding (the run never ends) or overflow to infinity (it fails).
MAX_SECONDS = 1e12

#: The largest ``empirical:`` file read, in bytes: 32 MiB holds millions of generation times
#: (three million of ten characters a line), and at worst (one character a value) its values
#: take about 0.8 GB once parsed. A larger file is refused before it is read, so that a file
#: given by mistake (a 3 GB checkpoint) costs neither memory nor minutes; one that grows past it
#: while it is read is refused there.
MAX_FILE_BYTES = 32 * 2**20

#: The most groups per trainer step: the simulator keeps a record of every prompt it dispatches
#: (about 250 B each, ``steps * batch_size`` of them at least) and a few KB per group in flight
#: (``batch_size * (1 + dispatch_ahead)`` of them without admission).
MAX_BATCH_SIZE = 16_384
#: The most trajectories per group: each trajectory in flight costs about 200 B.
MAX_GROUP_SIZE = 4_096
#: The most trajectories per trainer step, ``batch_size * group_size`` (about 200 MB of them in
#: flight per step's worth): each bound alone does not keep their product in memory.
MAX_STEP_TRAJECTORIES = 2**20
#: The most rollout workers: each is a task of about 10 KB (1 GB for all of them).
MAX_WORKERS = 100_000

#: With in-flight weight updates, the fastest decoding of one trajectory, in tokens per second
#: (a thousand times a fast engine's): a run costs the same whatever the speed, since tokens are
#: counted in runs of one version, never one by one.
MAX_TOKENS_PER_SECOND = 1e6
#: The most tokens a trajectory may have (a longer generation is cut there): 2**32 tokens in each
#: of ``MAX_STEP_TRAJECTORIES`` trajectories keep every token total of a batch, which the buffer
#: sums in int64, below 2**63.
MAX_TRAJECTORY_TOKENS = 2**32
#: The largest ``token_budget``: with the most groups a batch may hold (``MAX_BATCH_SIZE``, which
#: the config checks against the mean group's tokens), every token total stays below 2**63.
MAX_TOKEN_BUDGET = 2**48
#: The largest chunk, in tokens: a chunk of a whole trajectory (or more) is the engine that never
#: takes new weights mid-generation.
MAX_CHUNK_TOKENS = MAX_TRAJECTORY_TOKENS

#: The lowest ``filter_pass_rate``: each trained group then costs up to 1 / 0.01 = 100 generated
#: ones, and the simulator keeps a record of every one (``steps * batch_size / rate`` of them).
MIN_FILTER_PASS_RATE = 0.01
