"""How the actor applies its clients' producer operations to its buffer, on the home loop.

Each operation runs its ``*_nowait`` form (its record's ``apply``), so a batch of them is atomic
with respect to samplers. Two kinds wait instead of failing:

- an operation with a token that finds no admission slot is parked under its token (see
  ``_admission``) and runs its waiting form there;
- the client's ``mark_running``, ``put``, ``mark_finished`` and ``mark_failed``, whose ``*_nowait``
  forms raise BufferFullError only while the buffer's journal's writer is behind, wait for the
  writer as the local async calls do. The batch stops at the first such refusal and the rest of
  it runs one operation at a time, each waiting as its async form does (in a batch the writer's
  room only grows: nothing before the stop would have waited).
"""

from __future__ import annotations

from typing import Any

from ..buffer import ReplayBuffer
from ..errors import BufferFullError
from ._admission import AdmissionAbandonedError, AdmissionLedger
from ._protocol import (
    JOURNAL_WAITING,
    AddPrompt,
    EndRollout,
    MarkFailed,
    MarkFinished,
    Op,
    OpenRollout,
    Outcome,
    Parked,
    PutGroup,
    WaitingOp,
)
from ._watches import RolloutWatches

__all__ = ["ProducerOps"]

# Producer operations that end a group by uid (a watched rollout's watch is then released).
_ENDING = (MarkFinished, MarkFailed, PutGroup)


class ProducerOps:
    """Applies producer operations to the actor's buffer; parks those waiting for admission in
    the actor's admission ledger and tells its rollout watches what they open and end."""

    def __init__(self, buffer: ReplayBuffer, admissions: AdmissionLedger, watches: RolloutWatches) -> None:
        self._buffer = buffer
        self._admissions = admissions
        self._watches = watches

    def apply_until_behind(self, ops: list[Op]) -> tuple[list[Outcome], list[Op]]:
        """Apply ``ops`` in order until one must wait for the journal's writer; return the
        outcomes so far and the operations left (that one first), for :meth:`apply_waiting`."""
        outcomes: list[Outcome] = []
        for i, op in enumerate(ops):
            outcome = self.apply(op)
            if (
                not outcome.ok
                and isinstance(outcome.value, BufferFullError)
                and isinstance(op, JOURNAL_WAITING)
            ):
                return outcomes, ops[i:]
            outcomes.append(outcome)
        return outcomes, []

    async def apply_waiting(self, ops: list[Op]) -> list[Outcome]:
        """Apply ``ops`` in order, each waiting for the journal's writer when its async form does."""
        outcomes: list[Outcome] = []
        for op in ops:
            outcome = self.apply(op)
            if (
                not outcome.ok
                and isinstance(outcome.value, BufferFullError)
                and isinstance(op, JOURNAL_WAITING)
            ):
                try:
                    value = await op.apply_waiting(self._buffer)
                except Exception as exc:
                    outcome = Outcome(False, exc)
                else:
                    outcome = self._applied(op, value)
            outcomes.append(outcome)
        return outcomes

    def apply(self, op: Op) -> Outcome:
        """Apply one operation now: its outcome, or ``Parked(token)`` if it waits for admission."""
        if isinstance(op, EndRollout):  # by the block's token: only the group it entered
            return Outcome(True, self._watches.end(op.token, finished=op.finished))
        token = op.token if isinstance(op, (AddPrompt, PutGroup, OpenRollout)) else None
        if token is not None and not self._admissions.arrived(token):
            return Outcome(False, AdmissionAbandonedError(f"operation {token!r} was abandoned"))
        try:
            value: Any = op.apply(self._buffer)
        except BufferFullError as exc:
            if token is None:
                return Outcome(False, exc)
            assert isinstance(op, (AddPrompt, PutGroup, OpenRollout))
            self._admissions.park(token, self._admit_waiting(op))
            return Outcome(True, Parked(token))
        except Exception as exc:
            return Outcome(False, exc)
        return self._applied(op, value)

    def _applied(self, op: Op, value: Any) -> Outcome:
        """The outcome of ``op`` once applied: a rollout entered is watched, a group ended unwatched."""
        if type(op) is OpenRollout:
            value = self._watches.open(op.token, op.uid)
        elif self._watches and isinstance(op, _ENDING):
            self._watches.ended(op.uid)
        return Outcome(True, value)

    async def _admit_waiting(self, op: WaitingOp) -> Any:
        """The waiting form of ``op`` (a parked task on the home loop)."""
        value = await op.apply_waiting(self._buffer)
        if type(op) is OpenRollout:  # in the step of the loop that admitted it
            return self._watches.open(op.token, op.uid)
        return value
