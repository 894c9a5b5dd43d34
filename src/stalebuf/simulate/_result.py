"""The outcome of a simulated run: :class:`SimulationResult` and the records it holds.

Plain frozen records filled in by the model (:mod:`._model`) and read by the report
(:mod:`._report`); every time is on the simulated (virtual) clock.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
import numpy as np

from ._config import SimulationConfig

__all__ = [
    "FilterSummary",
    "LengthBias",
    "SimulationResult",
    "StalenessSummary",
    "StepRecord",
    "TaskSummary",
    "TokenBatchSummary",
    "TokenSummary",
]


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

    @classmethod
    def from_lags(cls, lags: Counter[int], sync_step: int) -> StalenessSummary:
        """Summarise ``lags``, a count per lag ``g - p + 1`` (or ``g - v + 1``), in ``S`` units;
        all zero with an empty histogram when nothing was counted."""
        values = sorted(lag for lag, count in lags.items() if count)
        if not values:
            return cls(mean=0.0, p50=0.0, p95=0.0, max=0.0, histogram=())
        counts = np.array([lags[a] for a in values], dtype=np.int64)
        cumulative = np.cumsum(counts)
        total = int(cumulative[-1])

        def quantile(q: float) -> float:
            # The smallest observed value with at least q of the count at or below it.
            index = int(np.searchsorted(cumulative, q * total, side="left"))
            return values[min(index, len(values) - 1)] / sync_step

        mean = float(np.dot(values, counts)) / total / sync_step
        return cls(
            mean=mean,
            p50=quantile(0.5),
            p95=quantile(0.95),
            max=values[-1] / sync_step,
            histogram=tuple((a / sync_step, lags[a]) for a in values),
        )


@attrs.frozen(kw_only=True)
class LengthBias:
    """Whether long prompts reach the trainer as often as they are dispatched.

    A prompt's length is its generation time as drawn at dispatch. Both "long" and the share to
    compare with come from the first ``steps * batch_size`` dispatched prompts: every run
    dispatches those (it trains that many groups), with the same lengths for a seed, so "long"
    means the same in every run of a report, whatever its strategy and admission.

    Attributes:
        long_seconds: the 75th percentile of the lengths of those prompts; "long" means at
            least this.
        long_share_dispatched: the share of long prompts among them (about 0.25, never 0).
        long_share_trained: the share of long prompts among trained groups.
        ratio: ``long_share_trained / long_share_dispatched``: 1 is unbiased, below 1 means
            long prompts are under-represented in training.
        mean_seconds_dispatched, mean_seconds_trained: mean lengths of those prompts and of the
            trained groups.
    """

    long_seconds: float
    long_share_dispatched: float
    long_share_trained: float
    ratio: float
    mean_seconds_dispatched: float
    mean_seconds_trained: float

    @classmethod
    def between(cls, dispatched: list[float], trained: list[float]) -> LengthBias:
        """Long prompts (at least the 75th percentile of ``dispatched``) among ``trained`` versus
        ``dispatched``; the latter always holds one (its longest), so the ratio is always defined."""
        everything = np.array(dispatched, dtype=np.float64)
        chosen = np.array(trained, dtype=np.float64)
        long_seconds = float(np.quantile(everything, 0.75))
        share_all = float(np.mean(everything >= long_seconds))
        share_trained = float(np.mean(chosen >= long_seconds))
        return cls(
            long_seconds=long_seconds,
            long_share_dispatched=share_all,
            long_share_trained=share_trained,
            ratio=share_trained / share_all,
            mean_seconds_dispatched=float(everything.mean()),
            mean_seconds_trained=float(chosen.mean()),
        )


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
class TokenSummary:
    """Where the generated tokens went, in a run with in-flight weight updates.

    Counts are over the groups *resolved* by the end of the run (trained or evicted): every
    token decoded for them is trained (in the loss), masked (returned to the trainer, kept out
    of the loss by the ``mask`` strategy) or thrown away, so ``generated == trained + masked +
    thrown_away``. A token of version ``v`` sampled (or evicted) at step ``g`` is *fresh* iff
    its lag ``g - v + 1 <= T*S``.

    Attributes:
        generated: tokens decoded for resolved groups.
        trained: tokens in the loss: every token of a returned group under "drop" and "wait",
            its fresh ones under "mask".
        trained_stale: stale tokens among ``trained`` (only "wait" trains any: "drop" judges a
            group by its oldest token, "mask" masks them).
        masked: tokens returned to the trainer and kept out of the loss ("mask" only).
        thrown_away: tokens the trainer never got: those of evicted groups (stale or failed),
            put or decoded in flight, and the unfinished trajectories of failed groups.
        thrown_away_fresh: the tokens of groups evicted as stale that were fresh at the step
            that evicted them (0 under "mask", by its guarantee).
        lost_in_flight: tokens decoded and never put (a group evicted in flight, the unfinished
            trajectories of a failed one); ``thrown_away - lost_in_flight`` is the buffer's
            ``evicted_tokens``.
        trained_trajectories: trajectories returned to the trainer.
        loss_excluded_trajectories: of those, trajectories whose every token is stale, kept for
            the group's baseline and out of the loss ("mask" only).
        trained_per_hour: ``trained`` per simulated hour.
        staleness: the staleness ``(g - v + 1) / S`` of the trained tokens, its histogram in
            tokens.
        p_would_drop_groups: returned groups stale by their dispatch step ``p`` but fresh by
            their head (their oldest token, or start version): the groups measuring from ``p``
            would have dropped. None under "mask", which judges groups by their newest token.
        p_would_drop_fraction: ``p_would_drop_groups`` over the returned groups; None under "mask".
    """

    generated: int
    trained: int
    trained_stale: int
    masked: int
    thrown_away: int
    thrown_away_fresh: int
    lost_in_flight: int
    trained_trajectories: int
    loss_excluded_trajectories: int
    trained_per_hour: float
    staleness: StalenessSummary
    p_would_drop_groups: int | None
    p_would_drop_fraction: float | None

    def share(self, tokens: int) -> float:
        """``tokens`` over ``generated`` (0.0 when nothing was generated)."""
        return tokens / self.generated if self.generated else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Return every number as JSON-ready values (the histogram as a list of objects)."""
        values = attrs.asdict(self, recurse=False)
        staleness = attrs.asdict(self.staleness)
        staleness["histogram"] = [{"staleness": s, "tokens": n} for s, n in self.staleness.histogram]
        values["staleness"] = staleness
        return values


@attrs.frozen(kw_only=True)
class FilterSummary:
    """What the buffer's zero-variance filter did, in a run with ``filter_pass_rate`` below 1.

    Attributes:
        judged_groups: groups that finished generating, each judged by the filter once.
        filtered_groups: of those, the groups the filter evicted (reason ``"filtered"``); the
            buffer's own ``evicted_filtered_groups``.
        pass_rate: ``1 - filtered_groups / judged_groups``, the observed pass rate (0.0 when
            nothing was judged).
        filtered_fraction: ``filtered_groups`` over the groups resolved (trained or evicted).
        filtered_generation_fraction: generation time spent on filtered groups over generation
            time spent on all resolved groups.
    """

    judged_groups: int
    filtered_groups: int
    pass_rate: float
    filtered_fraction: float
    filtered_generation_fraction: float


@attrs.frozen(kw_only=True)
class TaskSummary:
    """One task of a mixed run, as the trainer received it.

    Attributes:
        name: the task.
        target_share: its quota of a batch over the batch size, ``q(B) / B``: the share each
            batch gives it under "wait".
        dispatched_groups: its prompts dispatched (refills included).
        trained_groups: its groups the trainer received.
        trained_share: ``trained_groups`` over all trained groups.
        staleness: the staleness of its trained groups.
    """

    name: str
    target_share: float
    dispatched_groups: int
    trained_groups: int
    trained_share: float
    staleness: StalenessSummary

    def to_dict(self) -> dict[str, Any]:
        """Return every number as JSON-ready values (the histogram as a list of objects)."""
        values = attrs.asdict(self, recurse=False)
        values["staleness"] = _staleness_dict(self.staleness, "groups")
        return values


@attrs.frozen(kw_only=True)
class TokenBatchSummary:
    """The trainer's work in tokens, in a run with a ``token_budget`` ``K`` (by token or count
    batches).

    Attributes:
        trained_tokens: the tokens of every batch the trainer received.
        trained_tokens_per_hour: ``trained_tokens`` per simulated hour.
        tokens_per_step_mean: the mean tokens of a batch.
        tokens_per_step_cv: their coefficient of variation (population standard deviation over
            mean): how much the trainer's per-step work varies.
        groups_per_step_mean, groups_per_step_cv: the same for the groups of a batch (a
            constant ``batch_size`` with count batches, so a CV of 0).
        fill_mean, fill_min: the mean and the least of a batch's tokens over ``K``.
        batches_over_budget: batches of more than ``K`` tokens (with token batches, those that
            end with a group alone over ``K``).
        max_resident_tokens: the most tokens put by the groups in the buffer at once.
        cut_groups_fraction: the share of dispatched groups whose longest response was cut at
            ``max_response_tokens``.
        step_tokens: the tokens of each step's batch.
    """

    trained_tokens: int
    trained_tokens_per_hour: float
    tokens_per_step_mean: float
    tokens_per_step_cv: float
    groups_per_step_mean: float
    groups_per_step_cv: float
    fill_mean: float
    fill_min: float
    batches_over_budget: int
    max_resident_tokens: int
    cut_groups_fraction: float
    step_tokens: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """Return every number as JSON-ready values (``step_tokens`` as a list)."""
        values = attrs.asdict(self, recurse=False)
        values["step_tokens"] = list(self.step_tokens)
        return values


def _staleness_dict(summary: StalenessSummary, unit: str) -> dict[str, Any]:
    values = attrs.asdict(summary)
    values["histogram"] = [{"staleness": s, unit: n} for s, n in summary.histogram]
    return values


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
        dropped_groups: groups evicted as stale (drop strategy), in flight ones included.
        failed_groups: groups whose generation failed (evicted or trained, by failure_strategy).
        resolved_groups: groups trained or evicted by the end of the run.
        dropped_fraction: ``dropped_groups / resolved_groups``.
        wasted_generation_fraction: generation time spent on dropped groups (up to their
            eviction, for those evicted in flight) over generation time spent on all resolved groups.
        failed_fraction: ``failed_groups`` among resolved ones, over ``resolved_groups``.
        worker_utilization: share of the workers' time spent generating, in [0, 1].
        admission_wait_fraction: share of the workers' time spent waiting for admission, in
            [0, 1]; 0 without admission.
        max_resident_groups: the most groups resident in the buffer at once (dispatched and not
            yet trained or evicted).
        staleness: the staleness of the trained groups.
        length_bias: long prompts among trained versus dispatched groups.
        steps: one record per trainer step: the trainer's busy/idle timeline.
        tokens: with in-flight weight updates, where the generated tokens went; else None.
        filters: with ``filter_pass_rate`` below 1, what the filter did; else None.
        tasks: with ``tasks``, one summary per task, in the order given; else None.
        token_batches: with a ``token_budget``, the trainer's work in tokens; else None.
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
    admission_wait_fraction: float
    max_resident_groups: int
    staleness: StalenessSummary
    length_bias: LengthBias
    steps: tuple[StepRecord, ...]
    tokens: TokenSummary | None = None
    filters: FilterSummary | None = None
    tasks: tuple[TaskSummary, ...] | None = None
    token_batches: TokenBatchSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return every number as JSON-ready values (the steps as parallel lists; ``tokens``
        only with in-flight updates, ``filters`` only when filtering, ``tasks`` only with tasks,
        ``token_batches`` only with a token budget)."""
        values: dict[str, Any] = {
            field.name: getattr(self, field.name)
            for field in attrs.fields(SimulationResult)
            if field.name not in _NESTED
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
            **({} if self.tokens is None else {"tokens": self.tokens.to_dict()}),
            **({} if self.filters is None else {"filters": attrs.asdict(self.filters)}),
            **({} if self.tasks is None else {"tasks": {task.name: task.to_dict() for task in self.tasks}}),
            **({} if self.token_batches is None else {"token_batches": self.token_batches.to_dict()}),
        }


#: The fields of :class:`SimulationResult` that ``to_dict`` writes in a form of their own.
_NESTED = ("config", "staleness", "length_bias", "steps", "tokens", "filters", "tasks", "token_batches")
