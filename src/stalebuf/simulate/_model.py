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
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, cast

import anyio

from ..buffer import ReplayBuffer
from ..errors import ConfigError, MissingDependencyError
from ..records import Batch, EvictionEvent
from ..staleness import age as staleness_age
from ._config import SimulationConfig
from ._decoding import Decoder
from ._filter_draws import FilterDraws
from ._mix_summary import filter_summary, task_summaries
from ._prompt import Fate, Prompt
from ._result import LengthBias, SimulationResult, StalenessSummary, StepRecord
from ._tasks import interleave
from ._token_ledger import TokenLedger
from ._token_work import TokenWork

if TYPE_CHECKING:
    import trio

__all__ = ["ProgressCallback", "simulate"]

ProgressCallback = Callable[[int, int], object]
#: The fate of a prompt evicted for each reason the buffer gives (any other: a failure).
_EVICTED_AS: dict[str, Fate] = {"stale": "stale", "filtered": "filtered"}


class _GenerationFailed(Exception):
    """Raised in a ``rollout()`` body to fail its group: the block marks it FAILED."""


class _Run:
    """The state of one simulation: the buffer, the dispatch queue and the bookkeeping.

    Results are computed by walking the prompts in dispatch order, never in the order
    events happened, so that float sums do not depend on how trio orders simultaneous tasks.
    """

    # Set inside the event loop, from trio itself: anyio's twins look the backend up on every
    # call, and anyio's memory stream creates an event per wait: together a sixth of a run.
    now: Callable[[], float]
    sleep: Callable[[float], Awaitable[None]]
    send: trio.MemorySendChannel[Prompt]  # the dispatch queue (without admission)
    receive: trio.MemoryReceiveChannel[Prompt]

    def __init__(self, config: SimulationConfig, progress: ProgressCallback | None) -> None:
        self.config = config
        self.progress = progress
        self.rng = random.Random(config.seed)
        self.dispatched: list[Prompt] = []
        self.in_buffer: dict[str, Prompt] = {}
        self.max_resident = 0
        self.step_dropped = 0
        self.records: list[StepRecord] = []
        self.rollouts = 0  # rollout() blocks entered, for their uids
        self.waits: list[float] = []  # each admitted prompt's wait for admission
        self.asking: dict[int, float] = {}  # worker -> since when it waits for admission
        # Filtering: the real zero_variance filter, judging the scores drawn for each prompt.
        self.draws = FilterDraws(config) if config.filtering else None
        self.buffer = ReplayBuffer(
            config.sampler_config(),
            on_evict=self.on_evict,
            status_log_interval=None,
            filters=() if self.draws is None else self.draws.filters,
        )
        # With tasks: each task's latency and group tags, and the task of each worker (admission).
        names = () if config.tasks is None else config.tasks.names
        self.latencies = {name: config.task_latency(name) for name in names}
        # One stream per task: prompt k of a task draws the same whatever order trio admits
        # producers of different tasks in (each task's are admitted in its own FIFO order).
        self.task_rngs = {
            name: random.Random(f"stalebuf simulate task {config.seed} {name}") for name in names
        }
        self.task_tags = {name: {"task": name} for name in names}
        self.worker_tasks = interleave(config.tasks.split(config.workers)) if config.tasks else []
        # With in-flight weight updates: the chunked decoding and the token counts.
        self.decoder = Decoder(config) if config.in_flight_updates else None
        self.ledger = None if self.decoder is None else TokenLedger(config, self.decoder)
        # With a token budget: the tokens of each trajectory, put with it, and of each step.
        self.work = None if config.token_budget is None else TokenWork(config)
        self.produce = self.generate if self.decoder is None else self.decode

    def new_prompt(self, uid: str, step: int, task: str | None = None) -> Prompt:
        """Take a new prompt (of ``task``) from the dataset as ``uid``, tagged ``step``, and
        draw its fate."""
        config = self.config
        rng = self.rng if task is None else self.task_rngs[task]
        seconds = (config.latency if task is None else self.latencies[task]).sample(rng)
        fails = rng.random() < config.failure_rate
        fraction = rng.random()  # always drawn, so prompt k is the same whatever the failure rate
        prompt = Prompt(uid, step, seconds, seconds * fraction if fails else None, task)
        if self.draws is not None:  # from a stream of its own: the same prompts whatever the rate
            prompt.passes = self.draws.draw(task)
        if self.decoder is not None:
            prompt.lengths = self.decoder.lengths(seconds, task)
        if self.work is not None:
            prompt.lengths = self.work.draw(seconds)
            prompt.planned_tokens = sum(prompt.lengths[: prompt.puts(config.group_size)])
            self.work.dispatched(prompt.planned_tokens)
        self.dispatched.append(prompt)
        self.in_buffer[uid] = prompt
        self.max_resident = max(self.max_resident, len(self.in_buffer))
        return prompt

    def dispatch(self, step: int, task: str | None = None) -> None:
        """Without admission: add a new prompt (of ``task``) tagged ``step`` to the buffer and
        queue it."""
        prompt = self.new_prompt(f"p{len(self.dispatched)}", step, task)
        tags = None if task is None else self.task_tags[task]
        self.buffer.add_prompt_nowait(prompt.uid, global_steps=step, tags=tags)
        self.send.send_nowait(prompt)

    def refill(self, step: int, tasks: list[str | None]) -> None:
        """Without admission: dispatch a prompt tagged ``step`` of each of ``tasks`` (the tasks
        of the groups gone); under token batches, prompts until the dispatched ones hold the
        run's ``token_dispatch_budget`` tokens (a batch of ``K`` tokens is then always in reach)."""
        if self.config.token_batches:
            while cast(TokenWork, self.work).short():
                self.dispatch(step)
            return
        for task in tasks:
            self.dispatch(step, task)

    def leave(self, uid: str) -> Prompt:
        """Take ``uid`` out of the groups in the buffer (it was trained or evicted)."""
        prompt = self.in_buffer.pop(uid)
        if self.work is not None:
            self.work.left(prompt.put_tokens, prompt.planned_tokens)
        return prompt

    def on_evict(self, event: EvictionEvent) -> None:
        """Record the evicted groups; without admission, dispatch one fresh prompt for each (of
        its task)."""
        fate = _EVICTED_AS.get(event.reason, "failure")
        evicted = [self.leave(group.uid) for group in event.groups]
        for prompt in evicted:
            prompt.fate = fate
            prompt.evicted_step = event.global_steps
        if not self.config.admission:
            self.refill(event.global_steps, [prompt.task for prompt in evicted])
        if event.reason == "stale":
            self.step_dropped += len(event.groups)

    async def generate(self, prompt: Prompt, put: Callable[..., object]) -> bool:
        """Spend the prompt's generation time and ``put`` its trajectories; return whether it
        finished (else it failed part-way, after putting some)."""
        prompt.started = self.now()
        n = self.config.group_size
        if prompt.fail_after is None:
            await self.sleep(prompt.seconds)
        else:
            await self.sleep(prompt.fail_after)
            n = prompt.puts(n)
            prompt.failed = True
        if self.work is not None:  # with the tokens of each, and scores when filtering
            tags = None if self.draws is None else self.draws.tags(prompt.passes)
            prompt.put_tokens = self.work.put(put, prompt.lengths[:n], tags)
        elif self.draws is None:
            for session in range(n):
                put(None, session_id=session)
        else:  # scored: the buffer's zero_variance filter judges the group as it finishes
            tags = self.draws.tags(prompt.passes)
            for session in range(n):
                put(None, session_id=session, tags=tags[session])
        prompt.finished = not prompt.failed
        return prompt.finished

    async def decode(self, prompt: Prompt, put: Callable[..., object]) -> bool:
        """With in-flight weight updates: decode the group in chunks (see :mod:`._decoding`) and
        ``put`` each trajectory it finished with the versions of its chunks; return whether it
        finished (else it failed part-way, after putting those it finished)."""
        decoder = cast(Decoder, self.decoder)
        prompt.started = start = self.now()
        lengths = prompt.lengths
        if prompt.fail_after is None:
            await self.sleep(prompt.seconds)
            decoded = lengths[0]
        else:
            await self.sleep(prompt.fail_after)
            decoded = decoder.position(lengths[0], prompt.fail_after, prompt.seconds)
            prompt.failed = True
        prompt.decoded = decoded
        segments = decoder.segments(start, prompt.seconds, lengths, decoded)
        tags = None if self.draws is None else self.draws.tags(prompt.passes)
        for session, (tokens, versions) in enumerate(zip(lengths, segments, strict=True)):
            if tokens <= decoded:
                if tags is None:
                    put(None, session_id=session, versions=versions)
                else:
                    put(None, session_id=session, versions=versions, tags=tags[session])
                prompt.put_tokens += tokens
        prompt.finished = not prompt.failed
        return prompt.finished

    def settle(self, prompt: Prompt) -> None:
        """Record that a worker is done with ``prompt`` (finished, failed or evicted in flight)."""
        prompt.spent = self.now() - cast(float, prompt.started)
        prompt.done = True
        if prompt.decoded < 0 and self.decoder is not None:  # evicted in flight: cut where it was
            prompt.decoded = self.decoder.position(prompt.lengths[0], prompt.spent, prompt.seconds)

    async def worker(self) -> None:
        """Without admission: generate queued prompts one at a time, forever (until cancelled)."""
        buffer = self.buffer
        pushes = None if self.decoder is None else self.decoder.pushes
        async for prompt in self.receive:
            if pushes is None:
                buffer.mark_running_nowait(prompt.uid)
            else:  # it starts on the weights served now
                buffer.mark_running_nowait(prompt.uid, version=pushes.version_at(self.now()))
            if await self.produce(prompt, partial(buffer.put_nowait, prompt.uid)):
                buffer.mark_finished_nowait(prompt.uid)
            else:
                buffer.mark_failed_nowait(prompt.uid)
            self.settle(prompt)

    async def admitted_worker(self, index: int) -> None:
        """With admission: generate one group per ``rollout()`` block, forever (until cancelled).

        Entering the block waits until the buffer admits a group; a group evicted in flight
        has its body cancelled, so the worker moves on at once.
        """
        task = self.worker_tasks[index] if self.worker_tasks else None
        tags = None if task is None else self.task_tags[task]
        while True:
            uid = f"r{self.rollouts}"
            self.rollouts += 1
            self.asking[index] = self.now()
            prompt: Prompt | None = None
            try:
                async with self.buffer.rollout(uid, tags=tags) as group:
                    # Admitted just now, in this step of the loop: draw the prompt in admission order.
                    self.waits.append(self.now() - self.asking.pop(index))
                    prompt = self.new_prompt(uid, group.global_steps, task)
                    if not await self.produce(prompt, group.put_nowait):
                        raise _GenerationFailed  # the block marks the group FAILED
            except _GenerationFailed:
                pass
            if prompt is not None:  # finished, failed, or evicted in flight (the block cancelled it)
                self.settle(prompt)

    async def trainer(self, origin: float) -> None:
        """Sample, refill (without admission), train; ``steps`` times."""
        config = self.config
        refill = not config.admission
        if refill:
            tasks: list[str | None] = [*interleave(config.dispatch_split())]
            self.refill(0, tasks or [None] * config.dispatch_budget)
        for step in range(config.steps):
            # Let every task due at this instant run first, so that a group finishing exactly
            # when a train step ends is in the buffer whatever order trio runs them in.
            await anyio.lowlevel.checkpoint()
            self.step_dropped = 0
            sample_start = self.now() - origin
            batch = await self.sample(step)
            train_start = self.now() - origin
            if self.ledger is not None:
                self.ledger.sampled(batch)
                self.ledger.decoder.trained(step, self.now() + config.train_step_seconds)
            if self.work is not None:
                self.work.sampled(batch)
            trained = [self.leave(group.uid) for group in batch]
            for prompt in trained:
                prompt.fate = "trained"
                prompt.trained_step = step
            if refill:
                self.refill(step, [prompt.task for prompt in trained])
            await self.sleep(config.train_step_seconds)
            train_end = self.now() - origin
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

    async def sample(self, step: int) -> Batch:
        """``sample(step, batch_size)`` (``sample(step, token_budget=K)`` under token batches) on
        the buffer: the batch."""
        config = self.config
        if config.token_batches:
            return (await self.buffer.sample(step, token_budget=config.token_budget))[0]
        return (await self.buffer.sample(step, config.batch_size))[0]

    async def main(self) -> tuple[float, float]:
        """Run the workers and the trainer; return the virtual start and end times."""
        import trio

        self.now, self.sleep = trio.current_time, trio.sleep
        origin = self.now()
        # Unbounded: the dispatch budget bounds it, and dispatching must never block.
        self.send, self.receive = trio.open_memory_channel[Prompt](math.inf)
        with self.send, self.receive:
            async with anyio.create_task_group() as tg:
                for index in range(self.config.workers):
                    if self.config.admission:
                        tg.start_soon(self.admitted_worker, index)
                    else:
                        tg.start_soon(self.worker)
                await self.trainer(origin)
                end = self.now()
                tg.cancel_scope.cancel()
        self.buffer.close()
        return origin, end

    def common_lengths(self) -> list[float]:
        """The lengths of the first ``steps * batch_size`` dispatched prompts.

        Every run dispatches at least that many (it trains that many groups), and prompt k draws
        the same numbers in every run with the same seed and latency, so these are the same
        prompts whatever the strategy, admission or pipeline settings: "long" cut from them
        means the same in every column of a report.
        """
        config = self.config
        if config.tasks is None:
            return [prompt.seconds for prompt in self.dispatched[: config.steps * config.batch_size]]
        # With tasks, each task's first prompts (its share of them): the order prompts of
        # different tasks were dispatched in is trio's, each task's own order is not.
        left = config.tasks.split(config.steps * config.batch_size)
        lengths = []
        for prompt in self.dispatched:
            task = cast(str, prompt.task)
            if left[task]:
                left[task] -= 1
                lengths.append(prompt.seconds)
        return lengths

    def in_order(self) -> list[Prompt]:
        """The prompts in dispatch order; with tasks, task by task, each in its own dispatch
        order (the order prompts of different tasks were dispatched in is trio's, and float sums
        depend on the order they add in)."""
        if self.config.tasks is None:
            return self.dispatched
        rank = {name: index for index, name in enumerate(self.config.tasks.names)}
        return sorted(self.dispatched, key=lambda prompt: rank[cast(str, prompt.task)])  # stable

    def length_bias(self, trained: list[float]) -> LengthBias:
        """The length bias of the ``trained`` lengths. With tasks both lists are sorted first:
        the order prompts of different tasks were dispatched in is trio's, and a float mean
        depends on the order it adds in."""
        common = self.common_lengths()
        if self.config.tasks is not None:
            common.sort()
            trained = sorted(trained)
        return LengthBias.between(common, trained)

    def result(self, origin: float, end: float) -> SimulationResult:
        """Summarise the finished run."""
        config = self.config
        simulated = end - origin
        sync_step = config.parameter_sync_step
        busy = generated = wasted = 0.0
        resolved = dropped = failed = failed_resolved = 0
        ages: Counter[int] = Counter()
        trained_lengths: list[float] = []
        prompts = self.in_order()
        for prompt in prompts:
            if prompt.done:
                busy += prompt.spent
                failed += prompt.failed
            elif prompt.started is not None:
                busy += end - prompt.started
            if prompt.fate is None:
                continue
            resolved += 1
            generated += prompt.spent
            failed_resolved += prompt.failed
            if prompt.fate == "trained":
                trained_lengths.append(prompt.seconds)
                ages[staleness_age(prompt.trained_step, prompt.dispatch_step)] += 1
            elif prompt.fate == "stale":
                dropped += 1
                wasted += prompt.spent
        trained = len(trained_lengths)
        idle = math.fsum(record.wait_seconds for record in self.records)
        # fsum is exact, so these sums do not depend on the order workers were admitted in.
        waited = math.fsum([*self.waits, *(end - since for since in self.asking.values())])
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
            admission_wait_fraction=min(1.0, waited / (config.workers * simulated)),
            max_resident_groups=self.max_resident,
            staleness=StalenessSummary.from_lags(ages, sync_step),
            length_bias=self.length_bias(trained_lengths),
            steps=tuple(self.records),
            tokens=None if self.ledger is None else self.ledger.summary(prompts, end, simulated),
            filters=filter_summary(prompts) if config.filtering else None,
            tasks=task_summaries(config, prompts) if config.tasks is not None else None,
            token_batches=None if self.work is None else self.work.summary(simulated),
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
