"""Simulate an asynchronous RL pipeline around the real :class:`~stalebuf.ReplayBuffer`.

The model is a GRPO-style trainer fed by rollout workers. Each step the trainer calls
``sample(g, batch_size)`` (time spent there is *idle*) and trains for ``train_step_seconds``
(*busy*). Each prompt has a generation time drawn from the latency distribution when it is
dispatched (its "length": long, hard prompts take longer); a worker generates one group at a
time: it spends that time, puts ``group_size`` trajectories and finishes the group, or with
probability ``failure_rate`` fails it part-way, after putting only some trajectories. How
prompts are dispatched depends on ``admission``:

- Without admission the trainer keeps ``round(batch_size * (1 + dispatch_ahead))`` prompts
  dispatched: taken from the dataset but not yet trained or evicted. It dispatches that many at
  step 0 and, after each ``sample``, as many as it received (tagged with step ``g``); groups
  evicted by ``sample`` (stale ones under "drop", failed ones under ``failure_strategy="evict"``)
  are replaced from ``on_evict``. Workers pull prompts from a memory channel in dispatch order.
- With admission the buffer paces the producers (``admission_batch_size = batch_size``; under
  "drop" also ``evict_stale_in_flight``): each worker loops ``async with buffer.rollout(uid)``,
  which waits until the buffer admits a group and tags it with the trainer's current step. A
  group evicted while it generates has its body cancelled, which frees the worker at once.

With ``in_flight_updates`` (``stalebuf simulate --in-flight-updates``) the trainer also pushes
new weights to the workers at every sync point (after every step at ``S = 1``), PipelineRL-style,
and they take them mid-generation: a worker marks its group running at the version it starts on
(``mark_running(version=)``; a ``rollout()`` group starts at its admission step, which is the
version served then at ``S = 1``), decodes its trajectories in chunks, each by the version served
when it starts, and puts each trajectory with the ``versions`` of its chunks. The result then
counts tokens (:class:`TokenSummary`): trained, masked and thrown away, their staleness, and the
groups measuring from the dispatch step would have dropped. Its strategies are drop, wait and
mask.

With ``filter_pass_rate`` below 1 (``--filter-pass-rate``) the buffer is built with the real
``filters=[zero_variance("score")]``: each prompt draws whether its trajectories get distinct
scores, so finished groups are filtered (evicted at once, their admission slot refunded) with
probability ``1 - filter_pass_rate``. With ``tasks`` (``--tasks``) the buffer's
``SamplerConfig.mixture`` is the tasks' weights: each group is tagged with its task and takes
its task's generation time; without admission each task keeps its share of the dispatched
prompts, with admission each worker serves one task. The result then says what the filter did
(:class:`FilterSummary`) and what each task got (:class:`TaskSummary`).

With ``token_budget`` (``--token-budget K``) every trajectory is put with ``tokens=``: the
prompt's ``prompt_tokens`` plus a response drawn from the group's generation time (times
``tokens_per_second``, cut at ``max_response_tokens``). With ``batch_by="tokens"`` (its default)
the trainer calls ``sample(g, token_budget=K)``, admission counts tokens
(``admission_token_budget``, ``max_tokens_per_group``), and without admission the trainer keeps
prompts of ``K * (1 + dispatch_ahead)`` tokens dispatched; ``batch_by="groups"`` only counts the
tokens of count batches. The result then holds the trainer's work in tokens
(:class:`TokenBatchSummary`).

It runs on trio's virtual clock (``trio.testing.MockClock(autojump_threshold=0)``), so
simulated hours take seconds, and every random draw is made in dispatch order (admission
order, with admission) from one ``random.Random(seed)`` (the filter's pass draws from a second
stream seeded from ``seed``; with tasks, each task draws from streams of its own, in its own
dispatch order), so a seed reproduces a run exactly,
whatever order trio's scheduler runs simultaneous tasks in. trio is imported only when a
simulation runs.

The package reads top-down: :mod:`._bounds` (what it accepts, and why), :mod:`._latency`
(generation-time distributions, parametric, fitted or read from a file by :mod:`._empirical`),
:mod:`._tasks` (the tasks of a mixed run), :mod:`._config` (the validated settings),
:mod:`._lengths` (the tokens of a group's trajectories), :mod:`._prompt` (a dispatched prompt),
:mod:`._filter_draws` (the scores the filter judges), :mod:`._weights` and :mod:`._decoding` (which weights
the workers serve when, and the versions of what they decode, with in-flight updates),
:mod:`._model` (the simulation), :mod:`._result` (what a run returns), :mod:`._token_ledger`
(where the tokens went, with in-flight updates), :mod:`._token_work` (the tokens put and trained,
with a token budget), :mod:`._mix_summary` (the filter's and each
task's share), :mod:`._text` (the pieces of a text report),
:mod:`._mix_report` (the rows of the filter and the tasks), :mod:`._token_report` (those of
token counts), and :mod:`._report` and
:mod:`._versions_report` (the text reports and the plot that
``stalebuf simulate`` prints and writes).
"""

from __future__ import annotations

from ..errors import MissingDependencyError
from ._config import SimulationConfig
from ._latency import LATENCY_KINDS, Latency
from ._model import simulate
from ._report import format_report, write_plot
from ._result import (
    FilterSummary,
    LengthBias,
    SimulationResult,
    StalenessSummary,
    StepRecord,
    TaskSummary,
    TokenBatchSummary,
    TokenSummary,
)
from ._tasks import SimulatedTask, TaskMix

__all__ = [
    "LATENCY_KINDS",
    "FilterSummary",
    "Latency",
    "LengthBias",
    "MissingDependencyError",
    "SimulatedTask",
    "SimulationConfig",
    "SimulationResult",
    "StalenessSummary",
    "StepRecord",
    "TaskMix",
    "TaskSummary",
    "TokenBatchSummary",
    "TokenSummary",
    "format_report",
    "simulate",
    "write_plot",
]
