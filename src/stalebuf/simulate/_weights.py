"""Which policy version the rollout workers serve when: :class:`WeightPushes`.

With in-flight weight updates the trainer pushes new weights to the workers at every sync point:
after training step ``g`` ends, when ``g + 1`` is a multiple of ``S`` (every step at ``S = 1``),
version ``g + 1`` replaces the one they serve, mid-generation. Version ``v`` is what the trainer
trains at step ``v`` (``v`` steps done), so a token it generated, sampled at step ``g``, has lag
``g - v + 1``: the buffer's unit.

The trainer announces each push when its train step starts, for the instant the step will end.
So a worker reads the version served at any past or present instant from the history, whatever
order trio runs the tasks of one instant in, and the version served at a chunk's start is known
once the chunk has started.
"""

from __future__ import annotations

import math
from bisect import bisect_right

__all__ = ["WeightPushes"]


class WeightPushes:
    """The history of weight pushes: version 0 from the start, then each push at its instant.

    Instants are on the run's clock; pushes are announced in order of time and version.
    """

    __slots__ = ("times", "versions")

    def __init__(self) -> None:
        self.times: list[float] = [-math.inf]
        self.versions: list[int] = [0]

    def push(self, at: float, version: int) -> None:
        """Record that the workers serve ``version`` from instant ``at`` on.

        Raises:
            ValueError: ``at`` or ``version`` is not after the last push's.
        """
        if not (at > self.times[-1] and version > self.versions[-1]):
            raise ValueError(
                f"weight push of version {version} at {at} does not follow version {self.versions[-1]} "
                f"at {self.times[-1]}"
            )
        self.times.append(at)
        self.versions.append(version)

    def version_at(self, instant: float) -> int:
        """The version served at ``instant`` (a push at that very instant counts)."""
        return self.versions[bisect_right(self.times, instant) - 1]

    def changes(self, start: float, end: float) -> list[tuple[float, int]]:
        """The pushes in ``(start, end]``, as ``(instant, version)`` pairs in order."""
        times = self.times
        first = bisect_right(times, start)
        if first == len(times) or times[first] > end:  # none: most generations span no push
            return []
        last = bisect_right(times, end, first)
        return list(zip(times[first:last], self.versions[first:last], strict=True))
