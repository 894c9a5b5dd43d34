"""The memory of groups the buffer ended in flight, and what a late write to one is told.

A producer whose group was evicted in flight (as stale, by a restart, by a filter) or cut at
its deadline learns why on its next write: :class:`EvictedUids` remembers the latest
:data:`EVICTED_UIDS_REMEMBERED` uids, with why, and builds the error a write to one deserves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from ._validation import describe
from .errors import GroupCutError, GroupEvictedError, InvalidTransitionError, UnknownGroupError

__all__ = ["CUT_REASON", "EVICTED_UIDS_REMEMBERED", "FILTERED_REASON", "EvictedUids"]

#: How many uids of groups evicted in flight the buffer remembers (most recent first), so that a
#: producer's late call on one raises GroupEvictedError rather than UnknownGroupError.
EVICTED_UIDS_REMEMBERED = 65_536
#: How a remembered reason for a cut starts (the deadline in seconds follows).
CUT_REASON = "cut at its deadline of "
#: Why a group a filter rejected was evicted.
FILTERED_REASON = "filtered"

_NOT_REMEMBERED = ""


class EvictedUids:
    """Uids of groups ended in flight, most recent last, each with why: None for evicted as
    stale, else "restart", "filtered" or "cut at its deadline of ..." (bounded)."""

    __slots__ = ("reasons",)

    def __init__(self) -> None:
        self.reasons: OrderedDict[str, str | None] = OrderedDict()

    def __contains__(self, uid: object) -> bool:
        return uid in self.reasons

    def __iter__(self) -> Iterator[str]:
        return iter(self.reasons)

    def __bool__(self) -> bool:
        return bool(self.reasons)

    def values(self) -> Iterator[str | None]:
        """The reasons, in the order of :meth:`__iter__`."""
        return iter(self.reasons.values())

    def remember(self, uid: str, reason: str | None) -> None:
        """Remember that ``uid`` was ended in flight for ``reason`` (the oldest is forgotten
        past the bound)."""
        reasons = self.reasons
        reasons[uid] = reason
        if len(reasons) > EVICTED_UIDS_REMEMBERED:
            reasons.popitem(last=False)

    def forget(self, uid: str) -> None:
        """Forget ``uid`` (a new group took it)."""
        if self.reasons:
            self.reasons.pop(uid, None)

    def restore(self, uids: tuple[str, ...], reasons: tuple[str | None, ...]) -> None:
        """Replace the memory with a checkpoint's (``reasons`` ``()``: all None, as older files)."""
        if reasons:
            self.reasons = OrderedDict(zip(uids, reasons, strict=True))
        else:
            self.reasons = OrderedDict.fromkeys(uids)

    def error(self, uid: str, resident: bool) -> Exception | None:
        """The error a write to ``uid`` deserves for how its group ended in flight, if it was
        (``resident``: a group under that uid is in the buffer, terminal), else None."""
        reason = self.reasons.get(uid, _NOT_REMEMBERED) if self.reasons else _NOT_REMEMBERED
        if reason and reason.startswith("cut"):  # the cut group, resident or gone, not a new one
            return GroupCutError(f"group {describe(uid)} was {reason} while in flight: stop generating")
        if resident or reason == _NOT_REMEMBERED:
            return None
        if reason == FILTERED_REASON:
            return GroupEvictedError(
                f"group {describe(uid)} was filtered (a group filter rejected it when it finished): "
                "it is gone; add_prompt starts a new group under that uid"
            )
        how = "as stale" if reason is None else "by a restart"
        return GroupEvictedError(f"group {describe(uid)} was evicted {how} while in flight: stop generating")

    def refused(self, uid: object, group: Any, action: str) -> Exception:
        """The error a write (``action``) to ``uid`` deserves when it names no in-flight group
        (``group``: the terminal record under that uid, or None).

        Returns:
            TypeError: ``uid`` is not a str. GroupCutError: it was cut at its deadline (and not
            added again since). GroupEvictedError: it was evicted in flight or filtered (and not
            added again since). UnknownGroupError: no such group. InvalidTransitionError: it is
            terminal (a late write).
        """
        if type(uid) is not str:
            return TypeError(f"uid must be a str, got {type(uid).__name__}")
        error = self.error(uid, group is not None)
        if error is not None:
            return error
        if group is None:
            return UnknownGroupError(
                f"no group {describe(uid)} in the buffer (never added, or already sampled or evicted)"
            )
        return InvalidTransitionError(
            f"cannot {action} group {describe(uid)}: it is already {group.status.value} (a late write)"
        )
