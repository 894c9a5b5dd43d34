"""Why a parked ``sample`` waits: ``explain_wait`` and the reason its status line gives.

Everything here reads; nothing changes a part's state. The answer is built from what the
parts own: the head of the partition's queue of parked samples (the consumer's), the groups
(the store's), the rules' count and wait gate, and admission's slots and refused producers.
"""

from __future__ import annotations

import contextlib
import math

import attrs

from ._admission import Admission
from ._partition import PartitionState
from ._rules import Rules
from ._validation import describe
from ._waiting import Waiter
from .stats import WaitExplanation

__all__ = ["explain_wait"]


def explain_wait(
    name: str,
    part: PartitionState | None,
    head: Waiter | None,
    waiting: int,
    rules: Rules,
    admission: Admission,
) -> WaitExplanation:
    """Explain why ``head``, the first of the ``waiting`` samples parked on partition ``name``
    (``part``, None if it does not exist yet), waits (see :class:`~stalebuf.WaitExplanation`).

    Raises:
        Exception: whatever a policy hook raised (``is_stale``, ``must_wait_for``, ``admits``).
    """
    refusals, refused_tag = admission.refusals(name)
    producers = admission.waiting(name)
    full = admission.free_slots(part, name) == 0
    in_flight = 0 if part is None else part.pending + part.running
    if head is None:
        return WaitExplanation(
            partition=name,
            reason=f"no sample waits on partition {describe(name)}",
            in_flight=in_flight,
            closed_tag_refusals=refusals,
            closed_tag=refused_tag,
            admission_full=full,
            waiting_producers=producers,
        )
    steps, size = head.global_steps, head.batch_size
    sampleable = 0 if part is None else rules.count_fresh(part, steps)
    held_by, held_at = _gate_holder(part, steps, rules)
    explanation = WaitExplanation(
        partition=name,
        reason="",
        waiting_samplers=waiting,
        global_steps=steps,
        batch_size=size,
        waited_seconds=_waited(head),
        sampleable=sampleable,
        short_by=max(0, size - sampleable),
        in_flight=in_flight,
        gate_held_by=held_by,
        gate_staleness=None if held_at is None else (steps - held_at + 1) / rules.sync_step,
        closed_tag_refusals=refusals,
        closed_tag=refused_tag,
        admission_full=full,
        waiting_producers=producers,
    )
    return attrs.evolve(explanation, reason=_reason(explanation, held_at))


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
    if e.short_by:
        causes.append(
            f"the batch is short by {e.short_by} group(s): {e.sampleable} of {e.batch_size} sampleable "
            f"at global_steps={e.global_steps}, {e.in_flight} in flight"
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


def _gate_holder(part: PartitionState | None, steps: int, rules: Rules) -> tuple[str | None, int | None]:
    """The uid and dispatch step of the in-flight group that keeps the wait gate closed for a
    sample at ``steps`` (the oldest in flight, the first admitted at its step), or Nones."""
    if part is None or rules.gate_open(part, steps):
        return None, None
    oldest = part.in_flight.oldest()
    at_step = None if oldest is None else part.in_flight.groups.get(oldest)
    if not at_step:
        return None, None
    return next(iter(at_step)), oldest


def _waited(head: Waiter) -> float:
    """Seconds ``head`` has waited, on its loop's clock (0.0 if that cannot be read here)."""
    if math.isinf(head.started):
        return 0.0
    with contextlib.suppress(RuntimeError):  # trio's clock, outside its run
        return max(0.0, head.now() - head.started)
    return 0.0
