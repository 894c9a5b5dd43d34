"""One partition's token reservations: what token admission and the residency cap count.

Under ``admission_token_budget`` or ``max_resident_tokens`` (both need ``max_tokens_per_group``,
``M``), an in-flight group *reserves* ``M`` tokens at its dispatch step and against the
partition's residency; when it becomes terminal its reservation *settles* to its actual tokens
(the difference is refunded at once); a group written terminal in one call counts its actual
tokens; a group leaving the buffer takes what it counts with it. :class:`TokenLedger` keeps
those sums; its partition (:class:`~stalebuf._partition.PartitionState`) calls it from the
same transitions that keep the per-step group counts, and admission reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter

from ._lazy_group import LazyGroup
from ._validation import describe
from .errors import BufferFullError
from .records import Group

__all__ = ["UNBOUNDED", "TokenLedger", "group_tokens"]

_tokens_of = attrgetter("tokens")

#: The room a ledger reports where no cap applies (more than any group may hold).
UNBOUNDED = 1 << 63


def group_tokens(group: Group) -> int:
    """The tokens of a terminal group (a lazily stored one has none: no version was given)."""
    if group.__class__ is LazyGroup:
        return 0
    return sum(map(_tokens_of, group._peek()))  # C-level: a token batch reads every group's


class TokenLedger:
    """The tokens one partition counts against its token caps.

    Attributes (read them; change them only through the methods):
        budget: ``admission_token_budget`` (the per-dispatch-step cap), or None.
        per_group: ``max_tokens_per_group`` (``M``): an in-flight group's reservation.
        resident_cap: ``max_resident_tokens``, or None.
        at: the tokens counted at each dispatch step (reserved plus settled; kept only with a
            budget; a step that counts none is absent).
        reserved: ``M`` for each resident in-flight group.
        settled: the actual tokens of the resident terminal groups.
    """

    __slots__ = ("at", "budget", "per_group", "reserved", "resident_cap", "settled")

    def __init__(self, budget: int | None, per_group: int, resident_cap: int | None) -> None:
        self.budget = budget
        self.per_group = per_group
        self.resident_cap = resident_cap
        self.at: dict[int, int] | None = None if budget is None else {}
        self.reserved = self.settled = 0

    @property
    def gates(self) -> bool:
        """Whether a cap applies (else the ledger only bounds each group by ``M``)."""
        return self.budget is not None or self.resident_cap is not None

    # -- transitions (the partition calls these) ------------------------------------------

    def _shift(self, step: int, delta: int) -> None:
        at = self.at
        if at is not None and delta:
            count = at.get(step, 0) + delta
            if count:
                at[step] = count
            else:
                del at[step]

    def reserve(self, step: int) -> None:
        """An in-flight group was admitted at ``step``: reserve ``M`` there."""
        per_group = self.per_group
        self.reserved += per_group
        at = self.at
        if at is not None:  # _shift inline: this runs per group
            at[step] = at.get(step, 0) + per_group

    def settle(self, step: int, tokens: int) -> None:
        """An in-flight group of ``step`` became terminal with ``tokens``: refund ``M - tokens``."""
        per_group = self.per_group
        self.reserved -= per_group
        self.settled += tokens
        at = self.at
        if at is not None:  # _shift inline: this runs per group (a step keeps a reservation's M > 0 ...
            count = at[step] + tokens - per_group  # ... until it settles: present here)
            if count:
                at[step] = count
            else:
                del at[step]

    def unreserve(self, step: int) -> None:
        """An in-flight group of ``step`` left the buffer (evicted or filtered): refund ``M``."""
        self.reserved -= self.per_group
        self._shift(step, -self.per_group)

    def add(self, step: int, tokens: int) -> None:
        """A group arrived terminal at ``step`` with ``tokens`` (``put_group``, a restore)."""
        self.settled += tokens
        self._shift(step, tokens)

    def forget(self, groups: Iterable[Group]) -> int:
        """Terminal ``groups`` left the buffer: refund their tokens; return how many."""
        total = 0
        for group in groups:
            tokens = group_tokens(group)
            if tokens:
                total += tokens
                self._shift(group.dispatch_step, -tokens)
        self.settled -= total
        return total

    # -- questions (admission asks these) ---------------------------------------------------

    def at_step(self, step: int) -> int:
        """The tokens counted at dispatch step ``step`` (0 without a budget)."""
        at = self.at
        return 0 if at is None else at.get(step, 0)

    def room(self, step: int) -> int:
        """The tokens a group could still take at ``step``: the smaller of the per-step room and
        the residency room (:data:`UNBOUNDED` where neither cap applies; may be negative after
        ``put_back`` of a group past a cap)."""
        room = UNBOUNDED
        budget = self.budget
        if budget is not None:
            room = budget - self.at.get(step, 0)  # type: ignore[union-attr]  # kept with a budget
        cap = self.resident_cap
        if cap is not None:
            room = min(room, cap - self.reserved - self.settled)
        return room

    def check_put(self, uid: str, held: int, adding: int) -> None:
        """Refuse ``adding`` tokens to group ``uid``, which holds ``held``, past ``M``.

        Raises:
            ValueError: ``held + adding > max_tokens_per_group``.
        """
        if held + adding > self.per_group:
            parts = f" ({held} + {adding})" if held else ""
            raise ValueError(
                f"group {describe(uid)} would hold {held + adding} tokens{parts}, more than "
                f"max_tokens_per_group={self.per_group}"
            )

    def check_room(self, name: str, step: int, need: int | None) -> None:
        """Refuse a group of partition ``name`` that needs ``need`` tokens (None: a reservation,
        ``M``) where the ledger has less :meth:`room` at ``step``.

        Raises:
            BufferFullError: as said.
        """
        if need is None:
            need = self.per_group
        room = self.room(step)
        if room < need:
            raise BufferFullError(
                f"partition {describe(name)} has room for {max(room, 0)} more tokens at dispatch step "
                f"{step} now ({self.at_step(step)} counted there, {self.reserved} reserved in flight and "
                f"{self.settled} settled in all), and the group needs {need}"
            )
