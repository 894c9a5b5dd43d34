"""The tasks of a mixed run (``stalebuf simulate --tasks``): :class:`SimulatedTask` and
:class:`TaskMix`, and the spec they are parsed from.

A spec is ``NAME:WEIGHT[:LATENCY]`` entries separated by ``;``, e.g.
``math:0.5:lognormal:3.4,1;code:0.5:lognormal:4.0,1.2``: each task's name (the group tag
``task`` the buffer's mixture reads), its weight (a number > 0; the weights are normalised) and
its generation time, a ``--latency`` spec (:meth:`~._latency.Latency.parse`); a task without one
takes the run's ``latency``. Every error is a one-line :class:`~stalebuf.errors.ConfigError`.

The simulated buffer gets the weights as its ``SamplerConfig.mixture``; the simulator splits
whole numbers of prompts or workers among the tasks by the buffer's own quotas (the
largest-remainder method of :mod:`stalebuf._quotas`), so that every count it hands a task is the
count the buffer's quotas would give it.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from .._quotas import normalised, quotas
from .._validation import describe
from ..errors import ConfigError
from ._latency import Latency, _short

__all__ = ["MAX_TASKS", "SimulatedTask", "TaskMix", "interleave"]

#: The most tasks a mixed run may have: every batch holds at least one group of each, so a run
#: with more tasks than this would need batches of that many groups anyway.
MAX_TASKS = 64
_FORM = "NAME:WEIGHT[:LATENCY] entries separated by ';' (e.g. math:0.5:lognormal:3.4,1;code:0.5)"


def _check_name(_instance: object, _attribute: object, value: Any) -> None:
    if type(value) is not str or not value or value != value.strip() or any(c in value for c in ":;"):
        raise ConfigError(
            f"task name must be a non-empty str without ':', ';' or surrounding spaces, got {describe(value)}"
        )


def _check_weight(_instance: object, _attribute: object, value: Any) -> None:
    if type(value) is not float or not math.isfinite(value) or value <= 0.0:
        raise ConfigError(f"task weight must be a finite number > 0, got {describe(value)}")


def _check_latency(_instance: object, _attribute: object, value: Any) -> None:
    if value is not None and not isinstance(value, Latency):
        raise ConfigError(f"task latency must be None or a Latency, got {describe(value)}")


def _to_weight(value: Any) -> Any:
    # Store ints as floats; leave the rest (bools included) for the validator to reject.
    return float(value) if type(value) is int else value


@attrs.frozen
class SimulatedTask:
    """One task of a mixed run.

    Attributes:
        name: the task's name, its groups' ``task`` tag (non-empty, without ``:`` or ``;``).
        weight: its weight in the mixture (> 0; the weights are normalised).
        latency: its generation time per group, or None: the run's ``latency``.

    Raises:
        ConfigError: on construction, for an invalid value (the message names it).
    """

    name: str = attrs.field(validator=_check_name)
    weight: float = attrs.field(converter=_to_weight, validator=_check_weight)
    latency: Latency | None = attrs.field(default=None, validator=_check_latency)

    def __str__(self) -> str:
        """The task's spec entry, ``NAME:WEIGHT[:LATENCY]``."""
        entry = f"{self.name}:{_short(self.weight)}"
        return entry if self.latency is None else f"{entry}:{self.latency}"


def _to_tasks(value: Any) -> tuple[SimulatedTask, ...]:
    if isinstance(value, (str, bytes)):
        raise ConfigError(
            f"tasks must be a sequence of SimulatedTask (TaskMix.parse reads a spec), got {describe(value)}"
        )
    try:
        return tuple(value)
    except TypeError:
        raise ConfigError(f"tasks must be a sequence of SimulatedTask, got {describe(value)}") from None


@attrs.frozen
class TaskMix:
    """The tasks of a mixed run, in the order given.

    Attributes:
        tasks: one :class:`SimulatedTask` per task, 1 to :data:`MAX_TASKS` of them, with
            distinct names.

    Raises:
        ConfigError: on construction, for an empty, too long or duplicated list, or an entry
            that is not a SimulatedTask.
    """

    tasks: tuple[SimulatedTask, ...] = attrs.field(converter=_to_tasks)

    def __attrs_post_init__(self) -> None:
        if not 1 <= len(self.tasks) <= MAX_TASKS:
            raise ConfigError(f"tasks must name 1 to {MAX_TASKS} tasks, got {len(self.tasks)}")
        for task in self.tasks:
            if not isinstance(task, SimulatedTask):
                raise ConfigError(f"tasks must hold SimulatedTask records, got {describe(task)}")
        names = [task.name for task in self.tasks]
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise ConfigError(f"tasks must have distinct names, got {describe(duplicated[0])} twice")

    @classmethod
    def parse(cls, spec: str) -> TaskMix:
        """Parse ``NAME:WEIGHT[:LATENCY]`` entries separated by ``;`` (a trailing ``;`` is
        allowed; spaces around entries are ignored).

        Raises:
            ConfigError: the spec is not of that form, a weight is not a number > 0, a latency
                spec is invalid (the message names the task), or the tasks are not valid together.
        """
        entries = [entry.strip() for entry in str(spec).split(";")]
        if entries and not entries[-1]:
            entries.pop()
        if not entries or not all(entries):
            raise ConfigError(f"tasks must be {_FORM}; got {spec!r}")
        return cls(tuple(_parse_entry(entry) for entry in entries))

    def __str__(self) -> str:
        """The spec, which :meth:`parse` reads back."""
        return ";".join(str(task) for task in self.tasks)

    @property
    def names(self) -> tuple[str, ...]:
        """The task names, in the order given."""
        return tuple(task.name for task in self.tasks)

    def weights(self) -> dict[str, float]:
        """The buffer's ``SamplerConfig.mixture``: each task's weight, by name."""
        return {task.name: task.weight for task in self.tasks}

    def split(self, count: int) -> dict[str, int]:
        """Split ``count`` things (a batch, prompts, workers) among the tasks as the buffer's
        quotas split a batch of that size (largest remainder on the weights); by name, in the
        order given."""
        split = quotas(normalised(self.weights()), count)
        return {name: split[name] for name in self.names}


def interleave(counts: dict[str, int]) -> list[str]:
    """Each name ``counts[name]`` times, spread evenly: the k-th of ``n`` at position
    ``(k + 1/2) / n`` (ties by name), so every prefix holds each name about in proportion."""
    slots = [((k + 0.5) / n, name) for name, n in counts.items() for k in range(n)]
    return [name for _, name in sorted(slots)]


def _parse_entry(entry: str) -> SimulatedTask:
    """Parse one ``NAME:WEIGHT[:LATENCY]`` entry."""
    parts = entry.split(":", 2)
    if len(parts) < 2:
        raise ConfigError(f"task {entry!r} must be NAME:WEIGHT or NAME:WEIGHT:LATENCY")
    name, weight_text = parts[0].strip(), parts[1].strip()
    try:
        weight = float(weight_text)
    except ValueError:
        raise ConfigError(f"task {name!r}: weight must be a number > 0, got {weight_text!r}") from None
    latency = None
    if len(parts) == 3:
        try:
            latency = Latency.parse(parts[2].strip())
        except ConfigError as exc:
            raise ConfigError(f"task {name!r}: {exc}") from None
    return SimulatedTask(name, weight, latency)
