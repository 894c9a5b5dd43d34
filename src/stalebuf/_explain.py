"""Why a parked ``sample`` waits: ``explain_wait`` and the reason its status line gives.

Everything here reads; nothing changes a part's state. :class:`Explainer` builds the answer from
what the parts own: the head of the partition's queue of parked samples (the consumer's), the
groups (the store's, in each task's cell under a mixture), the count ``sampleable_count`` gives,
the rules' wait gate, and admission's slots and refused producers.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Mapping
from typing import Protocol

import attrs

from ._admission import Admission
from ._mixture import Mixing
from ._partition import PartitionState
from ._rules import Rules
from ._sampleable import SampleableWaits
from ._status_log import ESCALATE_AFTER
from ._store import GroupStore
from ._validation import check_partition, describe, describe_error
from ._waiting import Waiter
from .stats import WaitExplanation

__all__ = ["Explainer"]


class ParkedSamples(Protocol):
    """The consumer's queues of parked samples, as the explainer reads them."""

    @property
    def waiting(self) -> Mapping[str, deque[Waiter]]:
        """The parked ``sample`` calls of each partition, in arrival order."""

    def count_waiting(self, name: str) -> int:
        """How many live ``sample`` calls wait on partition ``name``."""


class Explainer:
    """Answers ``explain_wait`` for one buffer, and the reason of its status lines (owns nothing)."""

    __slots__ = ("admission", "interval", "mixing", "parked", "rules", "sampleable", "store")

    def __init__(
        self,
        store: GroupStore,
        admission: Admission,
        rules: Rules,
        sampleable: SampleableWaits,
        parked: ParkedSamples,
        mixing: Mixing,
        interval: float | None,
    ) -> None:
        self.store = store
        self.admission = admission
        self.rules = rules
        self.sampleable = sampleable
        self.parked = parked
        self.mixing = mixing
        self.interval = interval  # the status lines' (a mixture's starvation warning counts them)

    def explain(self, partition: object) -> WaitExplanation:
        """``explain_wait``: why the head ``sample`` parked on ``partition`` waits.

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: ``partition`` is not a non-empty str.
            Exception: whatever a policy hook raised (``is_stale``, ``must_wait_for``, ``admits``).
        """
        self.store.binding.check_thread()
        name = check_partition(partition)
        waiting = self.parked.count_waiting(name)
        head = self.parked.waiting[name][0] if waiting else None
        part = self.store.partitions.get(name)
        cells = [] if part is None else [part] if part.cells is None else list(part.cells.values())
        admission = self.admission
        refusals, refused_tag = admission.refusals(name)
        idle = WaitExplanation(
            partition=name,
            reason=f"no sample waits on partition {describe(name)}",
            in_flight=sum(cell.pending + cell.running for cell in cells),
            closed_tag_refusals=refusals,
            closed_tag=refused_tag,
            admission_full=admission.free_slots(part, name) == 0 or admission.tokens.full(part, name),
            waiting_producers=admission.waiting(name),
        )
        if head is None:
            return idle
        steps, size, budget = head.global_steps, head.batch_size, head.token_budget
        sampleable = self.sampleable.fresh(name, steps)
        held_by, held_at = _gate_holder(cells, steps, self.rules)
        ready_tokens = sum(cell.ready_tokens for cell in cells)
        explanation = attrs.evolve(
            idle,
            waiting_samplers=waiting,
            global_steps=steps,
            batch_size=size if budget is None else None,
            token_budget=budget,
            waited_seconds=_waited(head),
            sampleable=sampleable,
            short_by=max(0, size - sampleable),
            short_by_tokens=0 if budget is None else max(0, budget - ready_tokens),
            gate_held_by=held_by,
            gate_staleness=None if held_at is None else (steps - held_at + 1) / self.rules.sync_step,
        )
        return attrs.evolve(explanation, reason=_reason(explanation, held_at))

    def reason(self, name: str, waiter: Waiter) -> str:
        """Why ``waiter``, parked on partition ``name``, waits: its status line's last words
        (never raises: a hook's error is named instead)."""
        try:
            reason = self.explain(name).reason
        except Exception as exc:  # a policy hook: the line is logged all the same
            return f"(unknown: explaining it raised {describe_error(exc)})"
        part = self.store.partitions.get(name)
        if part is not None and part.cells is not None and not self.rules.borrows:
            reason += self._shortages(part, waiter)
        waiters = self.parked.waiting.get(name) or ()
        ahead = next((i for i, queued in enumerate(waiters) if queued is waiter), 0)
        if ahead:
            return (
                f"{ahead} earlier sample(s) on the partition go first, and the first waits because {reason}"
            )
        return reason

    def _shortages(self, part: PartitionState, waiter: Waiter) -> str:
        """The tasks of ``part`` (a mixture under "wait") short of their quota for ``waiter``'s
        batch, as words; a task short for :data:`ESCALATE_AFTER` status intervals is reported
        as starved (a WARNING, rate-limited by the mixture)."""
        try:
            short = {task: n for task, n in self.mixing.shortages(part, waiter.batch_size).items() if n}
        except Exception:  # a policy's task_quotas: the line is logged all the same
            return ""
        interval = self.interval
        if short and interval is not None and _waited(waiter) >= (ESCALATE_AFTER - 0.5) * interval:
            for task in short:
                why = f"a sample has waited {_waited(waiter):.0f} s for its quota"
                self.mixing.warn_starved(part.name, task, waiter.batch_size, why)
        return "".join(f"; task {task!r} is short by {n} group(s) of its quota" for task, n in short.items())


def _reason(explained: WaitExplanation, held_at: int | None) -> str:
    """The sentence of ``explained``: each cause that holds, the most decisive first."""
    e = explained
    causes = []
    if e.closed_tag_refusals and not e.in_flight:
        causes.append(
            f"nothing is in flight and {e.closed_tag_refusals} producer call(s) were refused for good "
            f"since the last batch, the latest at dispatch step {e.closed_tag} (TagClosedError or "
            "FutureTagError): under admission control producers should dispatch at the clock "
            "(global_steps=None)"
        )
    if e.short_by and e.token_budget is None:
        causes.append(
            f"the batch is short by {e.short_by} group(s): {e.sampleable} of {e.batch_size} sampleable "
            f"at global_steps={e.global_steps}, {e.in_flight} in flight"
        )
    if e.token_budget is not None and (e.short_by or e.short_by_tokens):
        causes.append(
            f"the batch of {e.token_budget} tokens is short by {e.short_by_tokens} token(s) "
            f"({e.sampleable} group(s) sampleable at global_steps={e.global_steps}, {e.in_flight} in flight)"
        )
    if e.gate_held_by is not None:
        causes.append(
            f"the wait gate is held by group {describe(e.gate_held_by)} (dispatched at step {held_at}, "
            f"still in flight, staleness {e.gate_staleness:g} at global_steps={e.global_steps})"
        )
    if e.closed_tag_refusals and e.in_flight:
        causes.append(
            f"{e.closed_tag_refusals} producer call(s) were refused for good since the last batch, "
            f"the latest at dispatch step {e.closed_tag}"
        )
    if e.admission_full:
        causes.append(f"admission is full ({e.waiting_producers} producer call(s) waiting for a slot)")
    return "; ".join(causes) if causes else "a batch may be taken now: the sample is about to wake"


def _gate_holder(cells: list[PartitionState], steps: int, rules: Rules) -> tuple[str | None, int | None]:
    """The uid and dispatch step of the in-flight group that keeps the wait gate closed for a
    sample at ``steps`` (the oldest in flight of a cell whose gate is closed, the first admitted
    at its step), or Nones."""
    held: tuple[int, str] | None = None
    for cell in cells:
        if rules.gate_open(cell, steps):
            continue
        oldest = cell.in_flight.oldest()
        at_step = None if oldest is None else cell.in_flight.groups.get(oldest)
        if oldest is not None and at_step and (held is None or oldest < held[0]):
            held = (oldest, next(iter(at_step)))
    return (None, None) if held is None else (held[1], held[0])


def _waited(head: Waiter) -> float:
    """Seconds ``head`` has waited, on its loop's clock (0.0 if that cannot be read here)."""
    if math.isinf(head.started):
        return 0.0
    with contextlib.suppress(RuntimeError):  # trio's clock, outside its run
        return max(0.0, head.now() - head.started)
    return 0.0
