"""The simulation itself: a trainer and rollout workers around a real :class:`ReplayBuffer`.

See the package docstring (:mod:`stalebuf.simulate`) for the model. Here, the run's state is
one :class:`_Run`; results are computed by walking the prompts in dispatch order, so that a
seed reproduces a run exactly whatever order trio's scheduler runs simultaneous tasks in.
trio is imported only when :func:`simulate` runs.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Literal

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..buffer import ReplayBuffer
from ..errors import ConfigError, MissingDependencyError
from ..records import EvictionEvent
from ..staleness import age as staleness_age
from ._config import SimulationConfig
from ._result import LengthBias, SimulationResult, StalenessSummary, StepRecord

__all__ = ["ProgressCallback", "simulate"]

ProgressCallback = Callable[[int, int], object]


class _Prompt:
    """A dispatched prompt; everything random about it is drawn at dispatch."""

    __slots__ = (
        "dispatch_step",
        "done",
        "fail_after",
        "fate",
        "seconds",
        "spent",
        "started",
        "trained_step",
        "uid",
    )

    def __init__(self, uid: str, dispatch_step: int, seconds: float, fail_after: float | None) -> None:
        self.uid = uid
        self.dispatch_step = dispatch_step
        self.seconds = seconds  # its length: the full generation time
        self.fail_after = fail_after  # None: it finishes; else it fails after this long
        self.started: float | None = None  # when a worker took it
        self.spent = 0.0  # generation time spent on it, once done
        self.done = False
        self.fate: Literal["trained", "stale", "failure"] | None = None
        self.trained_step = -1


class _Run:
    """The state of one simulation: the buffer, the dispatch queue and the bookkeeping.

    Results are computed by walking the prompts in dispatch order, never in the order
    events happened, so that float sums do not depend on how trio orders simultaneous tasks.
    """

    send: MemoryObjectSendStream[_Prompt]  # the dispatch queue, created inside the event loop
    receive: MemoryObjectReceiveStream[_Prompt]

    def __init__(self, config: SimulationConfig, progress: ProgressCallback | None) -> None:
        self.config = config
        self.progress = progress
        self.rng = random.Random(config.seed)
        self.dispatched: list[_Prompt] = []
        self.in_buffer: dict[str, _Prompt] = {}
        self.step_dropped = 0
        self.records: list[StepRecord] = []
        self.buffer = ReplayBuffer(config.sampler_config(), on_evict=self.on_evict, status_log_interval=None)

    def dispatch(self, step: int) -> None:
        """Take a new prompt from the dataset, tag it with ``step`` and queue it."""
        rng, config = self.rng, self.config
        seconds = config.latency.sample(rng)
        fails = rng.random() < config.failure_rate
        fraction = rng.random()  # always drawn, so prompt k is the same whatever the failure rate
        prompt = _Prompt(f"p{len(self.dispatched)}", step, seconds, seconds * fraction if fails else None)
        self.dispatched.append(prompt)
        self.in_buffer[prompt.uid] = prompt
        self.buffer.add_prompt_nowait(prompt.uid, global_steps=step)
        self.send.send_nowait(prompt)

    def on_evict(self, event: EvictionEvent) -> None:
        """Record the evicted groups and dispatch one fresh prompt for each."""
        for group in event.groups:
            self.in_buffer.pop(group.uid).fate = "stale" if event.reason == "stale" else "failure"
            self.dispatch(event.global_steps)
        if event.reason == "stale":
            self.step_dropped += len(event.groups)

    async def worker(self) -> None:
        """Generate groups one at a time, forever (until cancelled)."""
        buffer, n = self.buffer, self.config.group_size
        async for prompt in self.receive:
            uid = prompt.uid
            buffer.mark_running_nowait(uid)
            prompt.started = started = anyio.current_time()
            if prompt.fail_after is None:
                await anyio.sleep(prompt.seconds)
                for session in range(n):
                    buffer.put_nowait(uid, None, session_id=session)
                buffer.mark_finished_nowait(uid)
            else:
                await anyio.sleep(prompt.fail_after)
                for session in range(int(n * prompt.fail_after / prompt.seconds)):
                    buffer.put_nowait(uid, None, session_id=session)
                buffer.mark_failed_nowait(uid)
            prompt.spent = anyio.current_time() - started
            prompt.done = True

    async def trainer(self, origin: float) -> None:
        """Sample, refill, train; ``steps`` times."""
        config, buffer = self.config, self.buffer
        for _ in range(config.dispatch_budget):
            self.dispatch(0)
        for step in range(config.steps):
            # Let every task due at this instant run first, so that a group finishing exactly
            # when a train step ends is in the buffer whatever order trio runs them in.
            await anyio.lowlevel.checkpoint()
            self.step_dropped = 0
            sample_start = anyio.current_time() - origin
            batch, _metrics = await buffer.sample(step, config.batch_size)
            train_start = anyio.current_time() - origin
            for group in batch:
                prompt = self.in_buffer.pop(group.uid)
                prompt.fate = "trained"
                prompt.trained_step = step
            for _ in range(len(batch)):
                self.dispatch(step)
            await anyio.sleep(config.train_step_seconds)
            train_end = anyio.current_time() - origin
            self.records.append(
                StepRecord(
                    step=step,
                    sample_start=sample_start,
                    train_start=train_start,
                    train_end=train_end,
                    staleness_mean=float(batch.staleness.mean()),
                    dropped_groups=self.step_dropped,
                )
            )
            if self.progress is not None:
                self.progress(step + 1, config.steps)

    async def main(self) -> tuple[float, float]:
        """Run the workers and the trainer; return the virtual start and end times."""
        origin = anyio.current_time()
        # Unbounded: the dispatch budget bounds it, and dispatching must never block.
        self.send, self.receive = anyio.create_memory_object_stream[_Prompt](math.inf)
        with self.send, self.receive:
            async with anyio.create_task_group() as tg:
                for _ in range(self.config.workers):
                    tg.start_soon(self.worker)
                await self.trainer(origin)
                end = anyio.current_time()
                tg.cancel_scope.cancel()
        self.buffer.close()
        return origin, end

    def result(self, origin: float, end: float) -> SimulationResult:
        """Summarise the finished run."""
        config = self.config
        simulated = end - origin
        sync_step = config.parameter_sync_step
        busy = generated = wasted = 0.0
        resolved = dropped = failed = failed_resolved = 0
        ages: Counter[int] = Counter()
        trained_lengths: list[float] = []
        resolved_lengths: list[float] = []
        for prompt in self.dispatched:
            if prompt.done:
                busy += prompt.spent
                failed += prompt.fail_after is not None
            elif prompt.started is not None:
                busy += end - prompt.started
            if prompt.fate is None:
                continue
            resolved += 1
            generated += prompt.spent
            failed_resolved += prompt.fail_after is not None
            resolved_lengths.append(prompt.seconds)
            if prompt.fate == "trained":
                trained_lengths.append(prompt.seconds)
                ages[staleness_age(prompt.trained_step, prompt.dispatch_step)] += 1
            elif prompt.fate == "stale":
                dropped += 1
                wasted += prompt.spent
        trained = len(trained_lengths)
        idle = math.fsum(record.wait_seconds for record in self.records)
        return SimulationResult(
            config=config,
            simulated_seconds=simulated,
            trained_groups=trained,
            trained_groups_per_hour=trained * 3600.0 / simulated,
            trainer_idle_fraction=min(1.0, max(0.0, idle / simulated)),
            mean_wait_seconds=idle / config.steps,
            dispatched_groups=len(self.dispatched),
            dropped_groups=dropped,
            failed_groups=failed,
            resolved_groups=resolved,
            dropped_fraction=dropped / resolved,
            wasted_generation_fraction=wasted / generated if generated else 0.0,
            failed_fraction=failed_resolved / resolved,
            worker_utilization=min(1.0, busy / (config.workers * simulated)),
            staleness=_staleness_summary(ages, sync_step),
            length_bias=_length_bias(resolved_lengths, trained_lengths),
            steps=tuple(self.records),
        )


def _staleness_summary(ages: Counter[int], sync_step: int) -> StalenessSummary:
    values = sorted(ages)
    counts = np.array([ages[a] for a in values], dtype=np.int64)
    cumulative = np.cumsum(counts)
    total = int(cumulative[-1])

    def quantile(q: float) -> float:
        # The smallest observed value with at least q of the groups at or below it.
        index = int(np.searchsorted(cumulative, q * total, side="left"))
        return values[min(index, len(values) - 1)] / sync_step

    mean = float(np.dot(values, counts)) / total / sync_step
    return StalenessSummary(
        mean=mean,
        p50=quantile(0.5),
        p95=quantile(0.95),
        max=values[-1] / sync_step,
        histogram=tuple((a / sync_step, ages[a]) for a in values),
    )


def _length_bias(dispatched: list[float], trained: list[float]) -> LengthBias:
    everything = np.array(dispatched, dtype=np.float64)
    chosen = np.array(trained, dtype=np.float64)
    long_seconds = float(np.quantile(everything, 0.75))
    share_all = float(np.mean(everything >= long_seconds))
    share_trained = float(np.mean(chosen >= long_seconds))
    return LengthBias(
        long_seconds=long_seconds,
        long_share_dispatched=share_all,
        long_share_trained=share_trained,
        ratio=share_trained / share_all,
        mean_seconds_dispatched=float(everything.mean()),
        mean_seconds_trained=float(chosen.mean()),
    )


def simulate(config: SimulationConfig, *, progress: ProgressCallback | None = None) -> SimulationResult:
    """Run one simulation on trio's virtual clock and return its result.

    Args:
        config: the run's settings.
        progress: called as ``progress(steps_done, steps)`` after every trainer step.

    Raises:
        ConfigError: ``config`` is not a SimulationConfig.
        MissingDependencyError: trio is not installed (``pip install 'stalebuf[sim]'``).
        RuntimeError: called from inside a running event loop.
        Exception: whatever ``progress`` raised.
    """
    if not isinstance(config, SimulationConfig):
        raise ConfigError(f"config must be a SimulationConfig, got {type(config).__name__}")
    try:
        from trio.testing import MockClock
    except ImportError:
        raise MissingDependencyError(
            "the simulator needs trio, which is not installed: pip install 'stalebuf[sim]'"
        ) from None
    run = _Run(config, progress)
    origin, end = anyio.run(
        run.main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)}
    )
    return run.result(origin, end)
