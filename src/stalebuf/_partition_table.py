"""The partitions of a buffer, created on first use, and the task cells of a mixture.

:class:`PartitionTable` owns the partitions by name. A partition is created the first time a
group or a sample names it, with the rule book's answers for it; under a task mixture a
non-exempt partition gets one cell (a :class:`~stalebuf._partition.PartitionState` with its
task's threshold and quota of the admission cap) per task, and a group lands in its task's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._open_group import OpenGroup
from ._partition import PartitionState
from ._rules import Rules
from ._token_ledger import TokenLedger
from .records import Group

__all__ = ["PartitionTable"]


class PartitionTable:
    """Partitions by name (read ``partitions``; only :meth:`partition` adds to it)."""

    __slots__ = ("partitions", "rules")

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.partitions: dict[str, PartitionState] = {}

    def partition(self, name: str) -> PartitionState:
        """Return partition ``name``, creating it (asking the rules its settings) if new.

        Raises:
            Exception: whatever a policy hook raised (nothing is created then).
        """
        part = self.partitions.get(name)
        if part is not None:
            return part
        rules = self.rules
        exempt, evict_failures, evict_in_flight, cap, deadlines = rules.settings(name)
        config = rules.config
        per_group = None if exempt else config.max_tokens_per_group

        def state(
            cap: int | None, threshold: int | None, span: int, task: str | None = None
        ) -> PartitionState:
            return PartitionState(
                name,
                exempt=exempt,
                evict_failures=evict_failures,
                evict_in_flight=evict_in_flight,
                cap=cap,
                deadlines=deadlines,
                judge=rules.judge,
                threshold=threshold,
                span=span,
                task=task,
                ledger=None
                if per_group is None
                else TokenLedger(config.admission_token_budget, per_group, config.max_resident_tokens),
            )

        cells = {}
        if rules.tasks and not exempt:  # a task mixture: one cell per task
            for task in rules.tasks:
                cells[task] = state(*rules.cell_settings(name, task, cap), task)
        part = state(cap, rules.threshold, rules.span)
        if cells:
            part.cells = cells
        self.partitions[name] = part
        return part

    def cell(self, name: str, tags: Mapping[str, Any]) -> PartitionState:
        """The partition a new group of partition ``name`` with ``tags`` lands in: ``name``'s
        own, or under a task mixture its task's cell (the partition is created if new).

        Raises:
            ValueError: under a mixture, the tags name no task of it (nothing is created).
            Exception: whatever a policy hook raised creating the partition.
        """
        part = self.partitions.get(name)
        rules = self.rules
        if part is None:
            if rules.tasks and not rules.policy.is_exempt(name):
                rules.task_of(tags)  # refused before the partition is created
            part = self.partition(name)
        cells = part.cells
        return part if cells is None else cells[rules.task_of(tags)]

    def cell_of(self, group: OpenGroup | Group) -> PartitionState:
        """The partition (or task cell) that holds ``group``."""
        part = self.partitions[group.partition]
        cells = part.cells
        if cells is None:
            return part
        task = group.task if type(group) is OpenGroup else group.tags[self.rules.mixture_tag]
        return cells[task]  # type: ignore[index]  # a group in a cell has its task
