"""What ``sample`` reports with a batch: the batch record and its metrics.

:class:`SampleReport` adds to what :class:`~stalebuf.metrics.SampleMetrics` renders the metrics
that other parts own the state of: admission's free slots and producer waits, the cuts since
the partition's previous batch, the filters' counts, the mixture's per-task figures and the
token metrics (counting the masked tokens into the store). It owns no state.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs

from ._admission import Admission
from ._filtering import Filtering
from ._mixture import Mixing
from ._partition import PartitionState
from ._rules import Rules
from ._status_log import logger
from ._store import GroupStore
from ._token_metrics import token_metrics
from .metrics import SampleMetrics, metric_prefix
from .records import Batch, Group, new_batch

__all__ = ["SampleReport", "cells_of"]


def cells_of(part: PartitionState) -> Iterator[PartitionState]:
    """The partitions that hold ``part``'s groups: its task cells under a mixture, else itself."""
    return iter(part.cells.values()) if part.cells is not None else iter((part,))


class SampleReport:
    """Builds a returned batch and its metrics (the parts it reads own the state)."""

    __slots__ = ("admission", "filtering", "mixing", "rules", "store")

    def __init__(
        self, store: GroupStore, admission: Admission, rules: Rules, filtering: Filtering, mixing: Mixing
    ) -> None:
        self.store = store
        self.admission = admission
        self.rules = rules
        self.filtering = filtering
        self.mixing = mixing

    def render(
        self,
        part: PartitionState,
        global_steps: int,
        groups: list[Group],
        metrics: SampleMetrics,
        wait_seconds: float,
    ) -> tuple[Batch, dict[str, float]]:
        """Return the batch of ``groups`` and its metrics (the batch is taken: nothing raises)."""
        rules = self.rules
        sync_step = rules.sync_step
        masks = rules.masks and not part.exempt
        thresholds = None
        if part.cells is not None and rules.config.task_thresholds:  # each group's task's T
            cells, tag = part.cells, rules.mixture_tag
            thresholds = tuple(cells[group.tags[tag]].threshold for group in groups)
        batch = new_batch(
            part.name, global_steps, tuple(groups), sync_step, rules.threshold, masks, thresholds
        )
        admission = None
        if part.cap is not None:
            # The batch is already taken: a policy hook that raises here must not lose it, so
            # the error is logged and the metric reports NaN (unknown).
            try:
                free: float = self.admission.free_slots(part, part.name) or 0
            except Exception:
                logger.exception("a staleness policy hook raised while counting free admission slots")
                free = math.nan
            admission = (free, self.admission.take_producer_wait(part))
        naming = rules.config.metric_names  # the renaming is metrics.py's (one table)
        rendered = metrics.render(part.name, groups, global_steps, sync_step, wait_seconds, admission, naming)
        prefix = metric_prefix(part.name)
        if part.gated and part.ledger is not None and part.ledger.gates:
            rendered.update(self._token_admission(part, prefix))
        if part.deadlines:
            rendered.update(self._cuts(part, prefix))
        recent = self.filtering.take_recent(part) if self.filtering.filters else None
        if recent is not None:
            filtered, errors, rate = recent
            rendered[f"{prefix}/filter_groups/evicted_samples"] = float(filtered)
            if rate is not None:
                rendered[f"{prefix}/filter_groups/pass_rate"] = rate
            if errors:
                rendered[f"{prefix}/filter_groups/errors"] = float(errors)
        if part.cells is not None:
            rendered.update(self.mixing.metrics(part, prefix))
        budget = metrics.token_budget
        if budget is not None:  # a sample by tokens: how full its batch is
            rendered[f"{prefix}/batch/tokens"] = float(metrics.batch_tokens)
            rendered[f"{prefix}/batch/fill"] = metrics.batch_tokens / budget
            rendered[f"{prefix}/batch/oversized_groups"] = float(metrics.oversized_groups)
        if (
            part.admitted_tokens
            if part.cells is None
            else any(c.admitted_tokens for c in part.cells.values())
        ):
            # (a partition none of whose cells ever held a token skips the token metrics)
            rendered.update(self._tokens(part, batch, prefix))
        return batch, rendered

    def _token_admission(self, part: PartitionState, prefix: str) -> dict[str, float]:
        """The token caps' metrics: free tokens at the clock's step, tokens reserved in flight,
        and (without a group cap, which reports it already) the producers' wait."""
        try:
            free: float = self.admission.tokens.free_tokens(part, part.name) or 0
        except Exception:  # the batch is taken: a hook that raises here must not lose it
            logger.exception("a staleness policy hook raised while counting free admission tokens")
            free = math.nan
        rendered = {
            f"{prefix}/admission/free_tokens": float(free),
            f"{prefix}/admission/reserved_tokens": float(part.ledger.reserved),  # type: ignore[union-attr]
        }
        if part.cap is None:
            rendered[f"{prefix}/admission/producer_wait_seconds"] = self.admission.take_producer_wait(part)
        return rendered

    def _cuts(self, part: PartitionState, prefix: str) -> dict[str, float]:
        """The cuts of ``part``'s groups since its previous batch."""
        groups = trajectories = 0
        seconds = 0.0
        for cell in cells_of(part):
            cut_groups, cut_trajectories, cut_seconds = self.store.take_recent_cuts(cell)
            groups, trajectories, seconds = (
                groups + cut_groups,
                trajectories + cut_trajectories,
                seconds + cut_seconds,
            )
        return {
            f"{prefix}/rollout/cut_groups": float(groups),
            f"{prefix}/rollout/cut_trajectories": float(trajectories),
            f"{prefix}/rollout/cut_generation_seconds/mean": seconds / groups if groups else 0.0,
        }

    def _tokens(self, part: PartitionState, batch: Batch, prefix: str) -> dict[str, float]:
        """The token metrics of ``batch``; its masked tokens are counted in their cells."""
        rendered, masked = token_metrics(batch, prefix)
        cells = part.cells
        if masked and cells is None:
            self.store.count_masked(part, masked)
        elif masked and cells is not None:
            tag = self.rules.mixture_tag
            for task, cell in cells.items():
                mine = tuple(group for group in batch.groups if group.tags[tag] == task)
                cell_masked = token_metrics(_fields(batch, mine), prefix)[1] if mine else 0
                if cell_masked:
                    self.store.count_masked(cell, cell_masked)
        return rendered


def _fields(batch: Batch, groups: tuple[Group, ...]) -> Batch:
    """``batch`` with only ``groups`` (a subset, in its order), each keeping its own T."""
    thresholds = batch.group_thresholds
    if thresholds is not None:
        own = dict(zip(map(id, batch.groups), thresholds, strict=True))
        thresholds = tuple(own[id(group)] for group in groups)
    return attrs.evolve(batch, groups=groups, group_thresholds=thresholds)
