"""How close P1 could get: its B=8 wake-up with parts of what ``sample`` returns left out.

P1 (``compare.py``) measures the completing ``mark_finished_nowait`` -> the parked ``sample``
returns, against a bare ``asyncio.Event`` round trip. This runs that same measurement
(``p1_wakeup.p1_side_by_side``), round by round, with four versions of the last step:

- ``as shipped``: ``sample`` returns the ``Batch`` and its metrics dict;
- ``metrics dict only``: the metrics dict has its usual seven keys, but its values are
  constants, not computed from the groups (what the computing costs);
- ``no metrics``: an empty dict instead of the metrics (what the metrics cost);
- ``no batch, no metrics``: ``sample`` hands back the list of groups and an empty dict.

The last three change what ``sample`` returns, so they are a diagnostic of where the time is,
not a way to meet a target: the ratio of the last one is a floor for any version that keeps the
API, with the completing call, the hand-over and the woken evaluation as they are. Prints each
round's ratio (median stalebuf / median bare) per version and the median over rounds.

    python benchmarks/p1_ceiling.py [B] [rounds] [reps]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from p1_wakeup import p1_side_by_side
from stalebuf import ReplayBuffer
from stalebuf._consumer import Consumer
from stalebuf.metrics import SampleMetrics


def _constant_metrics(
    self: SampleMetrics, partition: str, sampled: Sequence[Any], *args: Any, **kwargs: Any
) -> dict[str, float]:
    """The shipped metrics dict's keys with constant values: building it, without the sums."""
    return dict.fromkeys(_KEYS[partition], 1.0)


def _no_metrics(self: SampleMetrics, *args: Any, **kwargs: Any) -> dict[str, float]:
    return {}


def _groups_only(self: Consumer, part: Any, global_steps: int, groups: Any, *args: Any) -> Any:
    return groups, {}


_KEYS: dict[str, list[str]] = {}
_SHIPPED_RENDER = SampleMetrics.render
_SHIPPED_RESULT = Consumer.result
#: version -> (SampleMetrics.render, Consumer.result) it runs with.
VERSIONS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "as shipped": (_SHIPPED_RENDER, _SHIPPED_RESULT),
    "metrics dict only": (_constant_metrics, _SHIPPED_RESULT),
    "no metrics": (_no_metrics, _SHIPPED_RESULT),
    "no batch, no metrics": (_SHIPPED_RENDER, _groups_only),
}


def _learn_keys() -> None:
    """Record the keys the shipped metrics of a plain B=8 sample have (for the constant dict)."""
    buf = ReplayBuffer()
    for i in range(8):
        buf.put_group_nowait(f"k{i}", [None], global_steps=0)
    _, metrics = buf.sample_nowait(0, 8)
    _KEYS["train"] = list(metrics)


def measure(batch_size: int, rounds: int, reps: int) -> dict[str, list[float]]:
    """Return, per version, each round's P1 ratio (median stalebuf / median bare)."""
    _learn_keys()
    ratios: dict[str, list[float]] = {name: [] for name in VERSIONS}
    try:
        for r in range(rounds):
            names = list(VERSIONS) if r % 2 == 0 else list(reversed(VERSIONS))
            for name in names:
                render, result = VERSIONS[name]
                setattr(SampleMetrics, "render", render)  # noqa: B010 - replacing on purpose
                setattr(Consumer, "result", result)  # noqa: B010
                stalebuf_ns, bare_ns = asyncio.run(p1_side_by_side(asyncio.Event, reps, batch_size))
                ratios[name].append(statistics.median(stalebuf_ns) / statistics.median(bare_ns))
    finally:
        setattr(SampleMetrics, "render", _SHIPPED_RENDER)  # noqa: B010
        setattr(Consumer, "result", _SHIPPED_RESULT)  # noqa: B010
    return ratios


def main() -> None:
    batch_size = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 1500
    ratios = measure(batch_size, rounds, reps)
    print(f"P1 asyncio, B={batch_size}, {rounds} rounds of {reps} reps: stalebuf / bare asyncio.Event")
    for name, values in ratios.items():
        runs = " ".join(f"{value:.2f}" for value in values)
        print(f"  {name:<22} {runs}   median {statistics.median(values):.2f}x")


if __name__ == "__main__":
    main()
