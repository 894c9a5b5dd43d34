"""The settings of a simulated run: :class:`SimulationConfig` (its latency distribution is
:class:`~._latency.Latency`).

It is a frozen attrs record validated on construction with the shared checks of
:mod:`stalebuf._validation`; every error is a :class:`~stalebuf.errors.ConfigError` whose
message names the field. The command line derives its ``simulate`` options from these fields.
"""

from __future__ import annotations

import math
from typing import Any, Literal, cast, get_args

import attrs

from .._validation import a_bool, describe, finite_in, int_at_least, is_finite_number, one_of
from ..config import SamplerConfig
from ..errors import ConfigError
from ._bounds import (
    MAX_BATCH_SIZE,
    MAX_CHUNK_TOKENS,
    MAX_GROUP_SIZE,
    MAX_SECONDS,
    MAX_STEP_TRAJECTORIES,
    MAX_TOKEN_BUDGET,
    MAX_TOKENS_PER_SECOND,
    MAX_TRAJECTORY_TOKENS,
    MAX_WORKERS,
    MIN_FILTER_PASS_RATE,
)
from ._latency import LATENCY_KINDS, Latency, LatencyKind
from ._lengths import SHORTEST
from ._tasks import TaskMix

__all__ = [
    "LATENCY_KINDS",
    "PLAIN_STRATEGIES",
    "BatchBy",
    "FailureStrategy",
    "Latency",
    "LatencyKind",
    "MixturePolicy",
    "SimulationConfig",
    "Strategy",
]

Strategy = Literal["drop", "wait", "mask"]
#: The strategies a run without in-flight weight updates compares: without versions every token
#: of a group is at its dispatch step, so "mask" would be "drop" without in-flight eviction.
PLAIN_STRATEGIES: tuple[Strategy, ...] = ("drop", "wait")
# The simulator's default is "evict" (the buffer's is "sample"), so it lists "evict" first.
FailureStrategy = Literal["evict", "sample"]
MixturePolicy = Literal["wait", "borrow"]
#: What the trainer sizes its batches by: ``batch_size`` groups, or ``token_budget`` tokens.
BatchBy = Literal["groups", "tokens"]
#: The tag of a trajectory's score, which the run's ``zero_variance`` filter reads.
SCORE_TAG = "score"


def _int_in(label: str, low: int, high: int) -> Any:
    """Return a validator accepting an int in ``[low, high]`` (bool rejected)."""

    def check(_instance: object, _attribute: object, value: object) -> None:
        if type(value) is not int or not low <= value <= high:
            raise ConfigError(f"{label} must be an int from {low} to {high}, got {describe(value)}")

    return check


def _as_float(value: object) -> object:
    # Store every accepted number as a float; leave the rest for the validator to reject.
    return float(value) if is_finite_number(value) else value


#: The settings of in-flight weight updates: :meth:`SimulationConfig.to_dict` leaves them out
#: when ``in_flight_updates`` is off.
_IN_FLIGHT_FIELDS = ("in_flight_updates", "tokens_per_second", "chunk_tokens")
#: The settings of a task mixture: :meth:`SimulationConfig.to_dict` leaves them out without one.
_MIXTURE_FIELDS = ("tasks", "mixture_policy")
#: The settings of token counts: :meth:`SimulationConfig.to_dict` leaves them out without a
#: ``token_budget``.
_TOKEN_FIELDS = ("token_budget", "batch_by", "prompt_tokens", "max_response_tokens")


def _check_token_budget(_instance: object, _attribute: object, value: Any) -> None:
    if value is not None and (type(value) is not int or not 1 <= value <= MAX_TOKEN_BUDGET):
        raise ConfigError(
            f"token_budget must be None or an int from 1 to {MAX_TOKEN_BUDGET}, got {describe(value)}"
        )


def _check_tasks(_instance: object, _attribute: object, value: Any) -> None:
    if value is not None and not isinstance(value, TaskMix):
        raise ConfigError(
            f"tasks must be None or a TaskMix (TaskMix.parse reads a spec), got {describe(value)}"
        )


@attrs.frozen(kw_only=True)
class SimulationConfig:
    """One simulated run: the buffer's settings plus the pipeline model around it.

    Attributes:
        strategy: the buffer's ``max_off_policy_strategy``, "drop", "wait" or "mask" ("mask"
            only with ``in_flight_updates``).
        admission: whether the buffer paces the producers (its ``admission_batch_size`` is
            ``batch_size``; under "drop" it also evicts stale groups in flight). With it, each
            worker loops ``async with buffer.rollout(...)`` and ``dispatch_ahead`` is unused;
            without it, the trainer keeps ``dispatch_budget`` prompts dispatched.
        threshold: the buffer's ``max_off_policy_threshold`` ``T`` (int >= 1).
        parameter_sync_step: the buffer's ``parameter_sync_step`` ``S`` (int >= 1).
        failure_strategy: the buffer's ``failure_strategy``, "evict" (failed groups are
            evicted and replaced) or "sample" (they are trained like finished ones).
        steps: trainer steps to simulate (int >= 1).
        batch_size: groups per trainer step, in ``[1, MAX_BATCH_SIZE]`` (16,384).
        group_size: trajectories per group, the GRPO ``n``, in ``[1, MAX_GROUP_SIZE]`` (4,096);
            ``batch_size * group_size`` is at most ``MAX_STEP_TRAJECTORIES`` (2**20).
        workers: concurrent rollout workers, each generating one group at a time, in
            ``[1, MAX_WORKERS]`` (100,000).
        dispatch_ahead: without admission, prompts dispatched beyond the batch being collected,
            in batches, in ``[0, 1000]``: the trainer keeps ``round(batch_size * (1 +
            dispatch_ahead))`` prompts dispatched.
        latency: the distribution of a group's generation time (its "length").
        train_step_seconds: the time one trainer step takes once it has its batch (> 0, at most
            ``MAX_SECONDS``, 1e12).
        failure_rate: the probability that a group's generation fails, in [0, 1).
        seed: the seed of the run's ``random.Random`` (int >= 0).
        in_flight_updates: the trainer pushes new weights to the workers at every sync point
            (after every step at ``S = 1``), and they take them mid-generation: each group is
            decoded in chunks of ``chunk_tokens``, each chunk by the weights served when it
            starts, and its trajectories are put with those ``versions`` (see
            :mod:`stalebuf.simulate._decoding`).
        tokens_per_second: with ``in_flight_updates``, the decoding speed of one trajectory: the
            group's longest trajectory has ``round(seconds * tokens_per_second)`` tokens (at
            most ``MAX_TRAJECTORY_TOKENS``), in ``(0, MAX_TOKENS_PER_SECOND]``.
        chunk_tokens: with ``in_flight_updates``, the tokens decoded between two looks at the
            weights version, in ``[1, MAX_CHUNK_TOKENS]``.
        filter_pass_rate: the probability that a finished group passes the buffer's
            ``zero_variance`` filter, in ``[MIN_FILTER_PASS_RATE, 1]`` (0.01 to 1): below 1, each
            prompt draws at dispatch (from a stream of its own, seeded by ``seed``) whether its
            trajectories get distinct scores or all the same, and the buffer, built with
            ``filters=[zero_variance("score")]``, evicts the latter as they finish (``group_size``
            must then be at least 2). At 1 no filter is installed: every group would pass.
        tasks: None, or the tasks of a mixed run (:class:`~._tasks.TaskMix`): the buffer's
            ``mixture`` is their weights, each group is tagged with its task and drawn from its
            task's latency. Without admission each task keeps its share of the dispatched prompts
            (at least its quota of a batch), a trained or evicted group being replaced by one of
            its task; with admission the workers are split among the tasks by the same quotas,
            each looping ``rollout()`` for its task. Each task's quota of ``batch_size`` (and with
            admission, of ``workers``) must be at least 1.
        mixture_policy: the buffer's ``mixture_policy``, "wait" or "borrow"; "borrow" only
            with ``tasks``.
        token_budget: None, or the tokens ``K`` of a token batch, in ``[1, MAX_TOKEN_BUDGET]``:
            every trajectory is then put with ``tokens=``, ``prompt_tokens`` plus its response's
            tokens, drawn by :class:`~._lengths.TrajectoryLengths` (the group's longest response
            has ``round(seconds * tokens_per_second)`` tokens, cut at ``max_response_tokens``),
            and the result counts the tokens of each step. Not with ``tasks`` (the buffer refuses
            token budgets under a mixture) nor ``in_flight_updates``.
        batch_by: "tokens" (the default with a ``token_budget``): the trainer calls
            ``sample(g, token_budget=K)``, with admission the buffer counts tokens
            (``admission_token_budget=K``, ``max_tokens_per_group`` the bound of
            :attr:`max_tokens_per_group`), and without admission the trainer keeps prompts of
            :attr:`token_dispatch_budget` tokens dispatched; or "groups" (the default without):
            batches of ``batch_size`` groups, the tokens only counted, so that one report can put
            both side by side.
        prompt_tokens: with ``token_budget``, the tokens of each trajectory's prompt, in
            ``[0, MAX_TRAJECTORY_TOKENS]``.
        max_response_tokens: with ``token_budget``, the longest response the engine generates
            (its ``max_tokens``), in ``[1, MAX_TRAJECTORY_TOKENS]``: a response the latency would
            make longer is cut there (the generation time is not), so no group exceeds
            :attr:`max_tokens_per_group`, whatever the latency (a lognormal is unbounded).

    Raises:
        ConfigError: on construction, for any invalid value (the message names the field), if
            ``batch_size * group_size`` is over ``MAX_STEP_TRAJECTORIES``, or for "mask"
            without ``in_flight_updates``.
    """

    strategy: Strategy = attrs.field(default="drop", validator=one_of("strategy", get_args(Strategy)))
    admission: bool = attrs.field(default=False, validator=a_bool("admission"))
    threshold: int = attrs.field(default=4, validator=int_at_least("threshold", 1))
    parameter_sync_step: int = attrs.field(default=1, validator=int_at_least("parameter_sync_step", 1))
    failure_strategy: FailureStrategy = attrs.field(
        default="evict", validator=one_of("failure_strategy", get_args(FailureStrategy))
    )
    steps: int = attrs.field(default=200, validator=int_at_least("steps", 1))
    batch_size: int = attrs.field(default=32, validator=_int_in("batch_size", 1, MAX_BATCH_SIZE))
    group_size: int = attrs.field(default=8, validator=_int_in("group_size", 1, MAX_GROUP_SIZE))
    workers: int = attrs.field(default=64, validator=_int_in("workers", 1, MAX_WORKERS))
    dispatch_ahead: float = attrs.field(
        default=1.0, converter=_as_float, validator=finite_in("dispatch_ahead", 0.0, 1000.0)
    )
    latency: Latency = attrs.field(factory=lambda: Latency("lognormal", (3.4, 1.0)))
    train_step_seconds: float = attrs.field(
        default=30.0,
        converter=_as_float,
        validator=finite_in("train_step_seconds", 0.0, MAX_SECONDS, open_low=True),
    )
    failure_rate: float = attrs.field(
        default=0.01, converter=_as_float, validator=finite_in("failure_rate", 0.0, 1.0, open_high=True)
    )
    seed: int = attrs.field(default=0, validator=int_at_least("seed", 0))
    in_flight_updates: bool = attrs.field(default=False, validator=a_bool("in_flight_updates"))
    tokens_per_second: float = attrs.field(
        default=50.0,
        converter=_as_float,
        validator=finite_in("tokens_per_second", 0.0, MAX_TOKENS_PER_SECOND, open_low=True),
    )
    chunk_tokens: int = attrs.field(default=256, validator=_int_in("chunk_tokens", 1, MAX_CHUNK_TOKENS))
    filter_pass_rate: float = attrs.field(
        default=1.0,
        converter=_as_float,
        validator=finite_in("filter_pass_rate", MIN_FILTER_PASS_RATE, 1.0),
    )
    tasks: TaskMix | None = attrs.field(default=None, validator=_check_tasks)
    mixture_policy: MixturePolicy = attrs.field(
        default="wait", validator=one_of("mixture_policy", get_args(MixturePolicy))
    )
    token_budget: int | None = attrs.field(default=None, validator=_check_token_budget)
    batch_by: BatchBy = attrs.field(validator=one_of("batch_by", get_args(BatchBy)))
    prompt_tokens: int = attrs.field(
        default=256, validator=_int_in("prompt_tokens", 0, MAX_TRAJECTORY_TOKENS)
    )
    max_response_tokens: int = attrs.field(
        default=8192, validator=_int_in("max_response_tokens", 1, MAX_TRAJECTORY_TOKENS)
    )

    @batch_by.default
    def _batch_by_default(self) -> BatchBy:
        return "groups" if self.token_budget is None else "tokens"

    @latency.validator
    def _check_latency(self, _attribute: object, value: object) -> None:
        if not isinstance(value, Latency):
            raise ConfigError(f"latency must be a Latency, got {describe(value)}")

    def __attrs_post_init__(self) -> None:
        trajectories = self.batch_size * self.group_size
        if trajectories > MAX_STEP_TRAJECTORIES:
            raise ConfigError(
                f"batch_size * group_size must be at most {MAX_STEP_TRAJECTORIES} trajectories per "
                f"trainer step, got {self.batch_size} * {self.group_size} = {trajectories}"
            )
        if self.strategy == "mask" and not self.in_flight_updates:
            raise ConfigError(
                "strategy 'mask' needs in_flight_updates: without versions every token of a group is "
                "at its dispatch step, so no group has both stale and fresh tokens and mask would be "
                "drop without in-flight eviction"
            )
        self._check_mixture_and_filter()
        self._check_tokens()

    def _check_tokens(self) -> None:
        """The rules of token counts across fields."""
        budget = self.token_budget
        if budget is None:
            if self.batch_by == "tokens":
                raise ConfigError("batch_by 'tokens' needs a token_budget (the tokens of a batch)")
            return
        for other, why in (
            ("tasks", "the buffer refuses token budgets under a task mixture, whose quotas count groups"),
            ("in_flight_updates", "their trajectories count the tokens they decode, without a prompt"),
        ):
            if getattr(self, other) not in (None, False):
                raise ConfigError(f"token_budget cannot be used with {other}: {why}")
        if not self.token_batches:
            return
        bound = self.max_tokens_per_group
        if self.admission and budget < bound:
            raise ConfigError(
                f"token_budget {budget} is below max_tokens_per_group = group_size * (prompt_tokens + "
                f"max_response_tokens) = {bound}: with admission a step must admit at least one group "
                "(raise token_budget, or lower max_response_tokens)"
            )
        groups = budget / self.mean_group_tokens
        if groups > MAX_BATCH_SIZE:
            raise ConfigError(
                f"token_budget {budget} holds about {groups:.0f} groups of the mean latency's "
                f"{self.mean_group_tokens:.0f} tokens: at most {MAX_BATCH_SIZE} groups per batch"
            )

    def _check_mixture_and_filter(self) -> None:
        """The rules of the filter and the task mixture across fields."""
        if self.filtering and self.group_size < 2:
            raise ConfigError(
                "filter_pass_rate below 1 needs group_size >= 2: zero_variance keeps every group of "
                f"fewer than two trajectories, got group_size {self.group_size}"
            )
        if self.tasks is None:
            if self.mixture_policy != "wait":
                raise ConfigError(f"mixture_policy {self.mixture_policy!r} needs tasks (a mixture)")
            return
        counts = [("groups of a batch", "batch_size", self.batch_size)]
        if self.admission:
            counts.append(("workers", "workers", self.workers))
        for what, field, number in counts:
            for name, share in self.tasks.split(number).items():
                if share == 0:
                    raise ConfigError(
                        f"tasks: task {name!r} gets none of the {number} {what} (largest remainder on "
                        f"the weights): raise {field} or its weight"
                    )

    @property
    def label(self) -> str:
        """The run's name in reports: the strategy, plus ``"+admission"`` with admission and
        ``"+tokens"`` with token batches."""
        label = f"{self.strategy}+admission" if self.admission else self.strategy
        return f"{label}+tokens" if self.token_batches else label

    @property
    def token_batches(self) -> bool:
        """Whether the trainer samples by tokens (``batch_by == "tokens"``)."""
        return self.batch_by == "tokens"

    @property
    def max_tokens_per_group(self) -> int:
        """The most tokens a group may have, ``group_size * (prompt_tokens +
        max_response_tokens)``: the buffer's ``max_tokens_per_group`` under token admission."""
        return self.group_size * (self.prompt_tokens + self.max_response_tokens)

    @property
    def mean_group_tokens(self) -> float:
        """About how many tokens a group of the latency's mean generation time has (its other
        responses average ``(1 + SHORTEST) / 2`` of its longest)."""
        longest = min(self.max_response_tokens, max(1.0, self.latency.mean * self.tokens_per_second))
        others = (self.group_size - 1) * longest * (1.0 + SHORTEST) / 2.0
        return self.group_size * self.prompt_tokens + longest + others

    @property
    def token_dispatch_budget(self) -> int:
        """How many tokens the trainer keeps dispatched without admission under token batches:
        ``ceil(token_budget * (1 + dispatch_ahead))`` (0 without a token budget)."""
        if self.token_budget is None:
            return 0
        return math.ceil(self.token_budget * (1.0 + self.dispatch_ahead))

    @property
    def dispatch_budget(self) -> int:
        """How many prompts the trainer keeps dispatched without admission:
        ``round(B * (1 + dispatch_ahead))``."""
        return max(self.batch_size, round(self.batch_size * (1.0 + self.dispatch_ahead)))

    @property
    def capacity(self) -> int | None:
        """The buffer's bound on resident groups with group admission, ``T * S * B``; else None
        (without admission, or with token admission, whose bound is :attr:`capacity_tokens`)."""
        if not self.admission or self.token_batches:
            return None
        return self.threshold * self.parameter_sync_step * self.batch_size

    @property
    def capacity_tokens(self) -> int | None:
        """The buffer's bound on resident tokens with token admission, ``T * S * K``; else None."""
        if not (self.admission and self.token_batches):
            return None
        return self.threshold * self.parameter_sync_step * cast(int, self.token_budget)

    @property
    def filtering(self) -> bool:
        """Whether the run filters groups: ``filter_pass_rate`` below 1."""
        return self.filter_pass_rate < 1.0

    def task_latency(self, name: str) -> Latency:
        """Return the generation-time distribution of task ``name`` (its own, or ``latency``).

        Raises:
            KeyError: the run has no task ``name``.
        """
        if self.tasks is not None:
            for task in self.tasks.tasks:
                if task.name == name:
                    return self.latency if task.latency is None else task.latency
        raise KeyError(name)

    def dispatch_split(self) -> dict[str, int]:
        """Without admission, how many prompts each task keeps dispatched: its quota of
        ``dispatch_budget``, and at least its quota of a batch (so that "wait" can always fill
        it); empty without tasks."""
        if self.tasks is None:
            return {}
        budget, batch = self.tasks.split(self.dispatch_budget), self.tasks.split(self.batch_size)
        return {name: max(budget[name], batch[name]) for name in budget}

    def sampler_config(self) -> SamplerConfig:
        """Return the :class:`SamplerConfig` the simulated buffer is built with."""
        mixture: dict[str, Any] = {}
        if self.tasks is not None:
            mixture = {"mixture": self.tasks.weights(), "mixture_policy": self.mixture_policy}
        admission: dict[str, Any] = {"admission_batch_size": self.batch_size if self.admission else None}
        if self.admission and self.token_batches:  # admission counts tokens
            admission = {
                "admission_token_budget": self.token_budget,
                "max_tokens_per_group": self.max_tokens_per_group,
            }
        return SamplerConfig(
            max_off_policy_threshold=self.threshold,
            max_off_policy_strategy=self.strategy,
            parameter_sync_step=self.parameter_sync_step,
            failure_strategy=self.failure_strategy,
            evict_stale_in_flight=self.admission and self.strategy == "drop",
            **admission,
            **mixture,
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the settings as JSON-ready values (the latency as its spec string); the
        settings of in-flight updates only when they are on, the filter's only when it filters and
        the mixture's only with tasks, the token counts' only with a token budget, so that a run
        without them writes what it wrote before they existed."""
        values = attrs.asdict(self, recurse=False)
        if not self.in_flight_updates:
            for name in _IN_FLIGHT_FIELDS:
                if name != "tokens_per_second" or self.token_budget is None:
                    del values[name]
        if self.token_budget is None:
            for name in _TOKEN_FIELDS:
                del values[name]
        else:
            values["max_tokens_per_group"] = self.max_tokens_per_group
            values["capacity_tokens"] = self.capacity_tokens
        if not self.filtering:
            del values["filter_pass_rate"]
        if self.tasks is None:
            for name in _MIXTURE_FIELDS:
                del values[name]
        else:
            values["tasks"] = str(self.tasks)
        values["latency"] = str(self.latency)
        values["dispatch_budget"] = self.dispatch_budget
        values["capacity"] = self.capacity
        return values
