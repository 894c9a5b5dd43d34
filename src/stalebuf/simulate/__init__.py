"""Simulate an asynchronous RL pipeline around the real :class:`~stalebuf.ReplayBuffer`.

The model is a GRPO-style trainer fed by rollout workers:

- The trainer keeps ``round(batch_size * (1 + dispatch_ahead))`` prompts dispatched: taken
  from the dataset but not yet trained or evicted. It starts by dispatching that many at
  step 0; each step it calls ``sample(g, batch_size)`` (time spent there is *idle*),
  immediately dispatches as many new prompts as it received (tagged with step ``g``),
  trains for ``train_step_seconds`` (*busy*) and moves on to ``g + 1``.
- ``workers`` rollout workers pull prompts from an anyio memory object stream. Each prompt
  has a generation time drawn from the latency distribution when it is dispatched (its
  "length": long, hard prompts take longer); a worker marks the group running, spends that
  time, puts ``group_size`` trajectories and marks it finished. With probability
  ``failure_rate`` it instead fails part-way, after putting only some trajectories.
- Groups evicted by ``sample`` (stale ones under "drop", failed ones under
  ``failure_strategy="evict"``) are replaced with fresh prompts from ``on_evict``.

It runs on trio's virtual clock (``trio.testing.MockClock(autojump_threshold=0)``), so
simulated hours take seconds, and every random draw is made in dispatch order from one
``random.Random(seed)``, so a seed reproduces a run exactly, whatever order trio's
scheduler runs simultaneous tasks in. trio is imported only when a simulation runs.

The package reads top-down: :mod:`._config` (the validated settings), :mod:`._model` (the
simulation), :mod:`._result` (what a run returns) and :mod:`._report` (the text report and the
plot that ``stalebuf simulate`` prints and writes).
"""

from __future__ import annotations

from ..errors import MissingDependencyError
from ._config import LATENCY_KINDS, Latency, SimulationConfig
from ._model import simulate
from ._report import format_report, write_plot
from ._result import LengthBias, SimulationResult, StalenessSummary, StepRecord

__all__ = [
    "LATENCY_KINDS",
    "Latency",
    "LengthBias",
    "MissingDependencyError",
    "SimulationConfig",
    "SimulationResult",
    "StalenessSummary",
    "StepRecord",
    "format_report",
    "simulate",
    "write_plot",
]
