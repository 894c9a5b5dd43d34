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
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Literal

import anyio
import attrs
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._validation import int_at_least, one_of
from .buffer import ReplayBuffer
from .config import SamplerConfig
from .errors import ConfigError, MissingDependencyError
from .records import EvictionEvent
from .staleness import age as staleness_age

__all__ = [
    "LATENCY_KINDS",
    "Latency",
    "LengthBias",
    "MissingDependencyError",
    "SimulationConfig",
    "SimulationResult",
    "StalenessSummary",
    "StepRecord",
    "simulate",
]

#: Accepted latency distribution kinds (see :meth:`Latency.parse`).
LATENCY_KINDS: tuple[str, ...] = ("lognormal", "exponential", "fixed")

LatencyKind = Literal["lognormal", "exponential", "fixed"]
ProgressCallback = Callable[[int, int], object]


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _short(value: float) -> str:
    """Format ``value`` as ``%g`` when that is exact, else as its full repr."""
    text = f"{value:g}"
    return text if float(text) == value else repr(value)


def _to_params(value: object) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"latency params must be a sequence of numbers, got {value!r}")
    params = tuple(value)
    if not all(_finite(p) for p in params):
        raise ConfigError(f"latency params must be finite numbers, got {params!r}")
    return tuple(float(p) for p in params)


@attrs.frozen
class Latency:
    """A distribution of per-group generation times, in seconds.

    Attributes:
        kind: "lognormal" (params ``(mu, sigma)`` of the natural log of the seconds, with
            ``|mu| <= 30`` and ``0 <= sigma <= 5``; long-tailed), "exponential" (params
            ``(mean,)``, > 0) or "fixed" (params ``(seconds,)``, > 0).
        params: the distribution's parameters, as floats.

    Raises:
        ConfigError: on construction, for an unknown kind or invalid parameters.
    """

    kind: LatencyKind
    params: tuple[float, ...] = attrs.field(converter=_to_params)

    def __attrs_post_init__(self) -> None:
        expected = {"lognormal": 2, "exponential": 1, "fixed": 1}.get(self.kind)
        if expected is None:
            raise ConfigError(f"latency kind must be one of {', '.join(LATENCY_KINDS)}; got {self.kind!r}")
        if len(self.params) != expected:
            names = (
                "MU,SIGMA"
                if self.kind == "lognormal"
                else ("MEAN" if self.kind == "exponential" else "SECONDS")
            )
            raise ConfigError(f"{self.kind} latency needs {names}, got {len(self.params)} number(s)")
        if self.kind == "lognormal":
            mu, sigma = self.params
            if not -30 <= mu <= 30:
                raise ConfigError(f"lognormal MU (log of seconds) must be in [-30, 30], got {mu:g}")
            if not 0 <= sigma <= 5:
                raise ConfigError(f"lognormal SIGMA must be in [0, 5], got {sigma:g}")
        elif self.params[0] <= 0:
            raise ConfigError(f"{self.kind} latency must be > 0 seconds, got {self.params[0]!r}")

    @classmethod
    def parse(cls, spec: str) -> Latency:
        """Parse ``"lognormal:MU,SIGMA"``, ``"exponential:MEAN"`` or ``"fixed:SECONDS"``.

        Raises:
            ConfigError: if ``spec`` is not of one of those forms or a parameter is invalid.
        """
        kind, sep, rest = str(spec).partition(":")
        kind = kind.strip().lower()
        if not sep or kind not in LATENCY_KINDS:
            raise ConfigError(
                f"latency must look like lognormal:MU,SIGMA, exponential:MEAN or fixed:SECONDS; got {spec!r}"
            )
        try:
            params = tuple(float(part) for part in rest.split(","))
        except ValueError:
            raise ConfigError(f"latency parameters must be numbers, got {spec!r}") from None
        return cls(kind, params)  # type: ignore[arg-type]

    def sample(self, rng: random.Random) -> float:
        """Draw one generation time in seconds from ``rng`` (deterministic given its state)."""
        if self.kind == "lognormal":
            mu, sigma = self.params
            return math.exp(mu + sigma * rng.gauss(0.0, 1.0))
        u = rng.random()
        if self.kind == "exponential":
            return -self.params[0] * math.log(1.0 - u)
        return self.params[0]

    def quantile(self, q: float) -> float:
        """Return the ``q``-quantile (0 < q < 1) of the distribution, in seconds."""
        if self.kind == "lognormal":
            mu, sigma = self.params
            from statistics import NormalDist

            return math.exp(mu + sigma * NormalDist().inv_cdf(q))
        if self.kind == "exponential":
            return -self.params[0] * math.log(1.0 - q)
        return self.params[0]

    @property
    def mean(self) -> float:
        """The mean generation time in seconds."""
        if self.kind == "lognormal":
            mu, sigma = self.params
            return math.exp(mu + sigma * sigma / 2)
        return self.params[0]

    def __str__(self) -> str:
        """Return the spec form, e.g. ``lognormal:3.4,1``, which :meth:`parse` reads back exactly."""
        return f"{self.kind}:{','.join(_short(p) for p in self.params)}"


def _float_check(label: str, low: float, high: float | None, *, low_open: bool, high_open: bool) -> Any:
    lo = "(" if low_open else "["
    hi = "inf)" if high is None else (f"{high:g})" if high_open else f"{high:g}]")
    interval = f"{lo}{low:g}, {hi}"

    def check(_instance: object, _attribute: object, value: object) -> None:
        ok = _finite(value)
        if ok:
            v = float(value)  # type: ignore[arg-type]
            ok = (v > low if low_open else v >= low) and (
                high is None or (v < high if high_open else v <= high)
            )
        if not ok:
            raise ConfigError(f"{label} must be a finite number in {interval}, got {value!r}")

    return check


def _as_float(value: object) -> object:
    return float(value) if _finite(value) else value  # type: ignore[arg-type]


@attrs.frozen(kw_only=True)
class SimulationConfig:
    """One simulated run: the buffer's settings plus the pipeline model around it.

    Attributes:
        strategy: the buffer's ``max_off_policy_strategy``, "drop" or "wait".
        threshold: the buffer's ``max_off_policy_threshold`` ``T`` (int >= 1).
        parameter_sync_step: the buffer's ``parameter_sync_step`` ``S`` (int >= 1).
        failure_strategy: the buffer's ``failure_strategy``, "evict" (failed groups are
            evicted and replaced) or "sample" (they are trained like finished ones).
        steps: trainer steps to simulate (int >= 1).
        batch_size: groups per trainer step (int >= 1).
        group_size: trajectories per group, the GRPO ``n`` (int >= 1).
        workers: concurrent rollout workers, each generating one group at a time (int >= 1).
        dispatch_ahead: prompts dispatched beyond the batch being collected, in batches: the
            trainer keeps ``round(batch_size * (1 + dispatch_ahead))`` prompts dispatched.
        latency: the distribution of a group's generation time (its "length").
        train_step_seconds: the time one trainer step takes once it has its batch (> 0).
        failure_rate: the probability that a group's generation fails, in [0, 1).
        seed: the seed of the run's ``random.Random``.

    Raises:
        ConfigError: on construction, for any invalid value (the message names the field).
    """

    strategy: Literal["drop", "wait"] = attrs.field(
        default="drop", validator=one_of("strategy", ("drop", "wait"))
    )
    threshold: int = attrs.field(default=4, validator=int_at_least("threshold", 1))
    parameter_sync_step: int = attrs.field(default=1, validator=int_at_least("parameter_sync_step", 1))
    failure_strategy: Literal["evict", "sample"] = attrs.field(
        default="evict", validator=one_of("failure_strategy", ("evict", "sample"))
    )
    steps: int = attrs.field(default=200, validator=int_at_least("steps", 1))
    batch_size: int = attrs.field(default=32, validator=int_at_least("batch_size", 1))
    group_size: int = attrs.field(default=8, validator=int_at_least("group_size", 1))
    workers: int = attrs.field(default=64, validator=int_at_least("workers", 1))
    dispatch_ahead: float = attrs.field(
        default=1.0,
        converter=_as_float,
        validator=_float_check("dispatch_ahead", 0.0, 1000.0, low_open=False, high_open=False),
    )
    latency: Latency = attrs.field(factory=lambda: Latency("lognormal", (3.4, 1.0)))
    train_step_seconds: float = attrs.field(
        default=30.0,
        converter=_as_float,
        validator=_float_check("train_step_seconds", 0.0, None, low_open=True, high_open=True),
    )
    failure_rate: float = attrs.field(
        default=0.01,
        converter=_as_float,
        validator=_float_check("failure_rate", 0.0, 1.0, low_open=False, high_open=True),
    )
    seed: int = attrs.field(default=0, validator=int_at_least("seed", 0))

    @latency.validator
    def _check_latency(self, _attribute: object, value: object) -> None:
        if not isinstance(value, Latency):
            raise ConfigError(f"latency must be a Latency, got {value!r}")

    @property
    def dispatch_budget(self) -> int:
        """How many prompts the trainer keeps dispatched: ``round(B * (1 + dispatch_ahead))``."""
        return max(self.batch_size, round(self.batch_size * (1.0 + self.dispatch_ahead)))

    def sampler_config(self) -> SamplerConfig:
        """Return the :class:`SamplerConfig` the simulated buffer is built with."""
        return SamplerConfig(
            max_off_policy_threshold=self.threshold,
            max_off_policy_strategy=self.strategy,
            parameter_sync_step=self.parameter_sync_step,
            failure_strategy=self.failure_strategy,
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the settings as JSON-ready values (the latency as its spec string)."""
        values = attrs.asdict(self, recurse=False)
        values["latency"] = str(self.latency)
        values["dispatch_budget"] = self.dispatch_budget
        return values


@attrs.frozen(kw_only=True)
class StalenessSummary:
    """The staleness ``(g - p + 1) / S`` of the groups the trainer received.

    Attributes:
        mean, p50, p95, max: over all trained groups (the percentiles are observed values).
        histogram: ``(staleness, trained groups)`` pairs, ascending.
    """

    mean: float
    p50: float
    p95: float
    max: float
    histogram: tuple[tuple[float, int], ...]


@attrs.frozen(kw_only=True)
class LengthBias:
    """Whether long prompts reach the trainer as often as they are dispatched.

    Both sides count only prompts whose fate was decided by the end of the run (trained,
    dropped as stale or evicted as failed); prompts still in the pipeline are left out.
    A prompt's length is its generation time as drawn at dispatch.

    Attributes:
        long_seconds: the 75th percentile of those lengths; "long" means at least this.
        long_share_dispatched: the share of long prompts among them (about 0.25).
        long_share_trained: the share of long prompts among trained groups.
        ratio: ``long_share_trained / long_share_dispatched``: 1 is unbiased, below 1 means
            long prompts are under-represented in training.
        mean_seconds_dispatched, mean_seconds_trained: mean lengths of the two sets.
    """

    long_seconds: float
    long_share_dispatched: float
    long_share_trained: float
    ratio: float
    mean_seconds_dispatched: float
    mean_seconds_trained: float


@attrs.frozen(kw_only=True)
class StepRecord:
    """One trainer step on the virtual clock (seconds since the run started).

    Attributes:
        step: the trainer step ``g``.
        sample_start: when ``sample`` was called; the trainer is idle from here...
        train_start: ...to here, when ``sample`` returned and training started.
        train_end: when the step's training finished.
        staleness_mean: mean staleness of the step's batch.
        dropped_groups: groups evicted as stale during this step's ``sample``.
    """

    step: int
    sample_start: float
    train_start: float
    train_end: float
    staleness_mean: float
    dropped_groups: int

    @property
    def wait_seconds(self) -> float:
        """How long the trainer waited in ``sample`` at this step."""
        return self.train_start - self.sample_start


@attrs.frozen(kw_only=True)
class SimulationResult:
    """The outcome of :func:`simulate`; every number refers to the simulated (virtual) clock.

    Attributes:
        config: the settings of the run.
        simulated_seconds: virtual time from the start until the last step finished training.
        trained_groups: groups the trainer received (``steps * batch_size``).
        trained_groups_per_hour: trained groups per simulated hour.
        trainer_idle_fraction: share of the simulated time the trainer spent waiting in
            ``sample``, in [0, 1].
        mean_wait_seconds: mean time per step spent waiting in ``sample``.
        dispatched_groups: prompts dispatched (``add_prompt`` calls), refills included.
        dropped_groups: groups evicted as stale (drop strategy).
        failed_groups: groups whose generation failed (evicted or trained, by failure_strategy).
        resolved_groups: groups trained or evicted by the end of the run.
        dropped_fraction: ``dropped_groups / resolved_groups``.
        wasted_generation_fraction: generation time spent on dropped groups over generation
            time spent on all resolved groups.
        failed_fraction: ``failed_groups`` among resolved ones, over ``resolved_groups``.
        worker_utilization: share of the workers' time spent generating, in [0, 1].
        staleness: the staleness of the trained groups.
        length_bias: long prompts among trained versus dispatched groups.
        steps: one record per trainer step: the trainer's busy/idle timeline.
    """

    config: SimulationConfig
    simulated_seconds: float
    trained_groups: int
    trained_groups_per_hour: float
    trainer_idle_fraction: float
    mean_wait_seconds: float
    dispatched_groups: int
    dropped_groups: int
    failed_groups: int
    resolved_groups: int
    dropped_fraction: float
    wasted_generation_fraction: float
    failed_fraction: float
    worker_utilization: float
    staleness: StalenessSummary
    length_bias: LengthBias
    steps: tuple[StepRecord, ...]

    def to_dict(self) -> dict[str, Any]:
        """Return every number as JSON-ready values (the steps as parallel lists)."""
        values: dict[str, Any] = {
            field.name: getattr(self, field.name)
            for field in attrs.fields(SimulationResult)
            if field.name not in ("config", "staleness", "length_bias", "steps")
        }
        staleness = attrs.asdict(self.staleness)
        staleness["histogram"] = [{"staleness": s, "groups": n} for s, n in self.staleness.histogram]
        return {
            "config": self.config.to_dict(),
            **values,
            "staleness": staleness,
            "length_bias": attrs.asdict(self.length_bias),
            "steps": {
                field.name: [getattr(record, field.name) for record in self.steps]
                for field in attrs.fields(StepRecord)
            },
        }


# -- the model ------------------------------------------------------------------------


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
            self.in_buffer.pop(group.uid).fate = event.reason
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
