"""Task mixtures: a batch that keeps every task at its share.

A partition under a mixture keeps one cell (a :class:`~stalebuf._partition.PartitionState`)
per task; eviction, the wait gate and admission work per cell, each with its task's threshold.
:class:`Mixing` selects a batch across the cells and owns what selection leaves behind per
partition: the borrow balances, the tasks of the last 256 sampled groups (the shares), the
starvation tracking and the batch size of the latest call (for ``shortage``).

Selection, for ``sample(g, B)`` with quotas ``q_i = q_i(B)`` (largest remainder on the weights):

- ``mixture_policy="wait"``: a batch when every task has ``q_i`` sampleable groups (and every
  cell's gate is open); it takes each task's ``q_i`` oldest.
- ``"borrow"``: a batch when the cells hold ``B`` sampleable groups in all (gates open). It
  takes, in this order: (1) every sampleable group that would be stale at step ``g + 1``
  (oldest first, at most ``B``: under admission they are at most ``B``, and taking them keeps
  the hard bound); (2) from each task, up to ``max(0, q_i + b_i)`` groups in all (its
  allowance, the groups of (1) included), oldest first among the allowances; (3) what room is
  left, oldest first from any task. Then ``b_i += q_i - taken_i`` (the balances sum to 0), each
  clipped to ``[-4B, 4B]``, the clipped amount moved onto balances of the opposite sign.

The batch lists its groups oldest first overall (dispatch step, then admission order).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice, repeat
from time import monotonic

from ._partition import PartitionState
from ._rules import Rules
from ._status_log import logger
from ._store import GroupStore
from .records import Group
from .stats import TaskStats

__all__ = ["SHARE_WINDOW", "STARVATION_LOG_INTERVAL", "Mixing"]

#: How many of a partition's latest sampled groups the shares cover.
SHARE_WINDOW = 256
#: The least time between two starvation warnings about one task.
STARVATION_LOG_INTERVAL = 60.0
#: A balance may grow this many samples in a row before the starvation warning fires.
STARVATION_SAMPLES = 3
#: Balances are clipped to ``[-BALANCE_CAP * B, BALANCE_CAP * B]``.
BALANCE_CAP = 4

Entry = tuple[int, int, Group]  # (dispatch step, admission seq, group)
#: A batch size no partition ever holds: ``has_work_for`` then answers "eviction work only".
_NEVER = 1 << 63


class _Ledger:
    """What selection left behind in one partition under a mixture."""

    __slots__ = ("balances", "batch_size", "growth", "shares", "taken", "warned")

    def __init__(self, tasks: tuple[str, ...]) -> None:
        self.balances = dict.fromkeys(tasks, 0)
        self.taken = dict.fromkeys(tasks, 0)  # groups each task gave the latest batch
        self.shares: deque[str] = deque(maxlen=SHARE_WINDOW)
        self.growth = dict.fromkeys(tasks, 0)  # samples in a row a positive balance grew
        self.warned: dict[str, float] = {}
        self.batch_size = 0  # the B of the partition's latest sample call


class Mixing:
    """Selection across the task cells of the partitions under a mixture."""

    __slots__ = ("ledgers", "rules", "store")

    def __init__(self, store: GroupStore, rules: Rules) -> None:
        self.store = store
        self.rules = rules
        self.ledgers: dict[str, _Ledger] = {}

    def ledger(self, name: str) -> _Ledger:
        """Partition ``name``'s ledger, created the first time."""
        ledger = self.ledgers.get(name)
        if ledger is None:
            ledger = self.ledgers[name] = _Ledger(self.rules.tasks)
        return ledger

    # -- readiness ------------------------------------------------------------------------

    def ready(self, part: PartitionState, global_steps: int, batch_size: int) -> bool:
        """Whether a batch may be taken now (the cells evicted what they must first).

        Raises:
            Exception: whatever a policy hook raised.
        """
        cells, rules = part.cells, self.rules
        assert cells is not None
        self.ledger(part.name).batch_size = batch_size
        if not all(rules.gate_open(cell, global_steps) for cell in cells.values()):
            return False
        if rules.borrows:
            return sum(cell.ready.count for cell in cells.values()) >= batch_size
        quotas = rules.quotas(part.name, batch_size)
        return all(cell.ready.count >= quotas[task] for task, cell in cells.items())

    def has_work(self, part: PartitionState, global_steps: int, batch_size: int) -> bool:
        """Whether a sample of ``part`` at ``global_steps`` could evict something or take a
        batch (:meth:`Rules.has_work_for`, across the cells).

        Raises:
            Exception: whatever a policy hook raised.
        """
        cells, rules = part.cells, self.rules
        assert cells is not None
        if any(rules.has_work_for(cell, global_steps, _NEVER) for cell in cells.values()):
            return True  # (a batch of _NEVER groups is never ready: eviction work only)
        return self.ready(part, global_steps, batch_size)

    def shortages(self, part: PartitionState, batch_size: int) -> dict[str, int]:
        """Each task's groups short of its quota of ``batch_size`` now (0 when it has enough)."""
        cells = part.cells
        assert cells is not None
        if not batch_size:
            return dict.fromkeys(cells, 0)
        quotas = self.rules.quotas(part.name, batch_size)
        return {task: max(quotas[task] - cell.ready.count, 0) for task, cell in cells.items()}

    # -- selection --------------------------------------------------------------------------

    def choose(self, part: PartitionState, global_steps: int, batch_size: int) -> dict[str, list[Entry]]:
        """The groups of each task a batch takes (:meth:`ready` said one may); reads only.

        Raises:
            Exception: whatever a policy hook raised.
        """
        cells, rules = part.cells, self.rules
        assert cells is not None
        quotas = rules.quotas(part.name, batch_size)
        if not rules.borrows:
            return {
                task: list(islice(cell.ready.iter_oldest(), quotas[task])) for task, cell in cells.items()
            }
        balances = self.ledger(part.name).balances
        chosen: dict[str, list[Entry]] = {task: [] for task in cells}
        room = batch_size
        # (1) what would be stale at the next step, oldest first across the tasks
        urgent = [self._stale_next(cell, global_steps) for cell in cells.values()]
        for task, entry in islice(_merged(dict(zip(cells, urgent, strict=True))), room):
            chosen[task].append(entry)
            room -= 1
        taken = {task: len(entries) for task, entries in chosen.items()}
        # (2) each task's allowance, then (3) anything, oldest first
        rest = {task: self._after(cell, chosen[task]) for task, cell in cells.items()}
        allowance = {task: max(0, quotas[task] + balances[task]) - taken[task] for task in cells}
        allowed = {task: islice(entries, max(allowance[task], 0)) for task, entries in rest.items()}
        for task, entry in islice(_merged(allowed), room):
            chosen[task].append(entry)
            room -= 1
        if room:
            rest = {task: self._after(cell, chosen[task]) for task, cell in cells.items()}
            for task, entry in islice(_merged(rest), room):
                chosen[task].append(entry)
        return chosen

    def _stale_next(self, cell: PartitionState, global_steps: int) -> list[Entry]:
        """The ready groups of ``cell`` that would be stale at ``global_steps + 1``, oldest first."""
        rules = self.rules
        if not cell.ready.count:
            return []
        if cell.judged is not None:
            stale = {id(entry[2]) for entry in rules.stale_judged(cell, global_steps + 1)}
            return [entry for entry in cell.ready.iter_oldest() if id(entry[2]) in stale]
        fresh = rules.count_fresh(cell, global_steps + 1) if rules.evicts else None
        if fresh is None:  # wait never evicts: stale at the next step by the drop rule
            return [
                entry
                for entry in islice(cell.ready.iter_oldest(), cell.ready.count)
                if rules.is_stale(global_steps + 1, entry[0], cell)
            ]
        return list(islice(cell.ready.iter_oldest(), cell.ready.count - fresh))

    @staticmethod
    def _after(cell: PartitionState, chosen: list[Entry]) -> Iterator[Entry]:
        """``cell``'s ready groups oldest first, without the ``chosen`` ones."""
        taken = {id(entry[2]) for entry in chosen}
        return (entry for entry in cell.ready.iter_oldest() if id(entry[2]) not in taken)

    def take(self, part: PartitionState, chosen: dict[str, list[Entry]], batch_size: int) -> list[Group]:
        """Remove the ``chosen`` groups from their cells, settle the balances and shares;
        return the batch, oldest first overall."""
        cells = part.cells
        assert cells is not None
        store, ledger = self.store, self.ledger(part.name)
        for task, entries in chosen.items():
            groups = [entry[2] for entry in entries]
            if not groups:
                continue
            cell = cells[task]
            store.take_batch(cell, None if cell.ready.is_oldest(groups) else groups, len(groups))
        batch = [entry[2] for entry in heapq.merge(*chosen.values(), key=lambda entry: entry[:2])]
        taken = {task: len(entries) for task, entries in chosen.items()}
        ledger.taken = taken
        ledger.shares.extend(self.rules.tasks[index] for index in _task_order(batch, self.rules))
        if self.rules.borrows:
            self._settle(part.name, ledger, taken, batch_size)
        return batch

    def _settle(self, name: str, ledger: _Ledger, taken: dict[str, int], batch_size: int) -> None:
        """Move the balances by this batch and clip them (see the module docs); warn of a task
        whose positive balance keeps growing."""
        quotas, balances = self.rules.quotas(name, batch_size), ledger.balances
        before = dict(balances)
        for task in balances:
            balances[task] += quotas[task] - taken[task]
        _clip(balances, BALANCE_CAP * batch_size)
        for task, balance in balances.items():
            grew = balance > 0 and balance > before[task]
            ledger.growth[task] = ledger.growth[task] + 1 if grew else 0
            if ledger.growth[task] >= STARVATION_SAMPLES:
                self.warn_starved(
                    name, task, batch_size, f"its balance grew {ledger.growth[task]} samples in a row"
                )

    def warn_starved(self, name: str, task: str, batch_size: int, why: str) -> None:
        """Log a WARNING that ``task`` of partition ``name`` gets less than its share (at most
        once per task per 60 s)."""
        ledger = self.ledger(name)
        now = monotonic()
        if now - ledger.warned.get(task, -STARVATION_LOG_INTERVAL) < STARVATION_LOG_INTERVAL:
            return
        ledger.warned[task] = now
        shares = ledger.shares
        share = shares.count(task) / len(shares) if shares else 0.0
        target = self.rules.quotas(name, batch_size)[task] / batch_size
        logger.warning(
            "task %r of partition %r is starved (%s): %.1f%% of the last %d sampled groups, target %.1f%%",
            task,
            name,
            why,
            100 * share,
            len(shares),
            100 * target,
        )

    # -- checkpoints ------------------------------------------------------------------------

    def saved(self, name: str) -> tuple[dict[str, int], dict[str, int], tuple[str, ...], int]:
        """Partition ``name``'s ledger as a checkpoint keeps it: each task's balance and growth
        count, the tasks of its last sampled groups, its latest batch size (not when each task
        was last warned of: a restored buffer may warn at once; nor the latest batch's takings,
        which the next batch sets before anything reads them)."""
        ledger = self.ledgers.get(name) or _Ledger(self.rules.tasks)  # (reading creates none)
        return dict(ledger.balances), dict(ledger.growth), tuple(ledger.shares), ledger.batch_size

    def restore(
        self,
        name: str,
        balances: Mapping[str, int],
        growth: Mapping[str, int],
        shares: Iterable[str],
        batch_size: int,
    ) -> None:
        """Put back partition ``name``'s ledger (a restore, of checked values, before any sample)."""
        ledger = self.ledgers[name] = _Ledger(self.rules.tasks)
        ledger.balances.update(balances)
        ledger.growth.update(growth)
        ledger.shares.extend(shares)
        ledger.batch_size = batch_size

    # -- what the trainer and stats see -------------------------------------------------

    def metrics(self, part: PartitionState, prefix: str) -> dict[str, float]:
        """``{prefix}/mixture/{task}/groups|balance|share`` after a batch of ``part``."""
        ledger = self.ledger(part.name)
        shares, rendered = ledger.shares, {}
        for task in self.rules.tasks:
            key = f"{prefix}/mixture/{task}"
            rendered[f"{key}/groups"] = float(ledger.taken.get(task, 0))
            rendered[f"{key}/balance"] = float(ledger.balances[task])
            rendered[f"{key}/share"] = shares.count(task) / len(shares) if shares else 0.0
        return rendered

    def task_stats(self, part: PartitionState) -> dict[str, TaskStats]:
        """The per-task record of ``stats().partitions[name].tasks``."""
        cells = part.cells
        assert cells is not None
        ledger = self.ledger(part.name)
        short = self.shortages(part, ledger.batch_size)
        return {
            task: TaskStats(
                resident=cell.pending + cell.running + cell.finished + cell.failure,
                sampled=cell.sampled_groups,
                balance=ledger.balances[task],
                shortage=short[task],
            )
            for task, cell in cells.items()
        }


def _merged(sources: Mapping[str, Iterable[Entry]]) -> Iterator[tuple[str, Entry]]:
    """``(task, entry)`` from every task's entries (each oldest first), oldest first overall."""
    # zip binds each task now: a generator expression would read ``task`` when it runs, after
    # the loop ended, and label every entry with the last task.
    streams = [zip(entries, repeat(task)) for task, entries in sources.items()]
    for entry, task in heapq.merge(*streams, key=lambda item: item[0][:2]):
        yield task, entry


def _task_order(batch: list[Group], rules: Rules) -> Iterator[int]:
    """The index in ``rules.tasks`` of each group's task, in batch order."""
    index = {task: position for position, task in enumerate(rules.tasks)}
    tag = rules.mixture_tag
    return (index[group.tags[tag]] for group in batch)


def _clip(balances: dict[str, int], cap: int) -> None:
    """Clip every balance to ``[-cap, cap]`` and move what was clipped onto balances of the
    opposite sign, so that they still sum to 0."""
    excess = 0
    for task, balance in balances.items():
        clipped = min(max(balance, -cap), cap)
        excess += balance - clipped
        balances[task] = clipped
    # excess > 0: positive mass was removed; give it back to the negative balances (toward 0)
    for task in sorted(balances, key=lambda name: balances[name] if excess > 0 else -balances[name]):
        if not excess:
            break
        balance = balances[task]
        if excess > 0 and balance < 0:
            moved = min(excess, -balance)
        elif excess < 0 and balance > 0:
            moved = -min(-excess, balance)
        else:
            continue
        balances[task] = balance + moved
        excess -= moved
