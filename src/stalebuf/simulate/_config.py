"""The settings of a simulated run: :class:`SimulationConfig` (its latency distribution is
:class:`~._latency.Latency`).

It is a frozen attrs record validated on construction with the shared checks of
:mod:`stalebuf._validation`; every error is a :class:`~stalebuf.errors.ConfigError` whose
message names the field. The command line derives its ``simulate`` options from these fields.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

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
    MAX_TOKENS_PER_SECOND,
    MAX_WORKERS,
)
from ._latency import LATENCY_KINDS, Latency, LatencyKind

__all__ = [
    "LATENCY_KINDS",
    "PLAIN_STRATEGIES",
    "FailureStrategy",
    "Latency",
    "LatencyKind",
    "SimulationConfig",
    "Strategy",
]

Strategy = Literal["drop", "wait", "mask"]
#: The strategies a run without in-flight weight updates compares: without versions every token
#: of a group is at its dispatch step, so "mask" would be "drop" without in-flight eviction.
PLAIN_STRATEGIES: tuple[Strategy, ...] = ("drop", "wait")
# The simulator's default is "evict" (the buffer's is "sample"), so it lists "evict" first.
FailureStrategy = Literal["evict", "sample"]


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

    @property
    def label(self) -> str:
        """The run's name in reports: the strategy, plus ``"+admission"`` with admission."""
        return f"{self.strategy}+admission" if self.admission else self.strategy

    @property
    def dispatch_budget(self) -> int:
        """How many prompts the trainer keeps dispatched without admission:
        ``round(B * (1 + dispatch_ahead))``."""
        return max(self.batch_size, round(self.batch_size * (1.0 + self.dispatch_ahead)))

    @property
    def capacity(self) -> int | None:
        """The buffer's bound on resident groups with admission, ``T * S * B``; else None."""
        if not self.admission:
            return None
        return self.threshold * self.parameter_sync_step * self.batch_size

    def sampler_config(self) -> SamplerConfig:
        """Return the :class:`SamplerConfig` the simulated buffer is built with."""
        return SamplerConfig(
            max_off_policy_threshold=self.threshold,
            max_off_policy_strategy=self.strategy,
            parameter_sync_step=self.parameter_sync_step,
            failure_strategy=self.failure_strategy,
            admission_batch_size=self.batch_size if self.admission else None,
            evict_stale_in_flight=self.admission and self.strategy == "drop",
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the settings as JSON-ready values (the latency as its spec string); the
        settings of in-flight updates only when they are on, so that a run without them writes
        what it wrote before they existed."""
        values = attrs.asdict(self, recurse=False)
        if not self.in_flight_updates:
            for name in _IN_FLIGHT_FIELDS:
                del values[name]
        values["latency"] = str(self.latency)
        values["dispatch_budget"] = self.dispatch_budget
        values["capacity"] = self.capacity
        return values
