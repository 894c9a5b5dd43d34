"""The sample tap behind :mod:`stalebuf.prometheus`'s histograms: cheap on ``sample``, folded on scrape.

A ``prometheus_client.Histogram.observe`` takes a lock and walks its buckets in Python, about a
microsecond; one per sampled group, plus one per call, would cost more than the budget of the
whole tap. So the tap only appends one row per call to its partition's list (atomic, so the
scrape thread may drain it concurrently): the call's metrics dict, its step and sync step, and
the dispatch steps of its groups (never the groups: their payloads must not outlive the batch).
The rows are binned with numpy when a scrape comes, or every ``FOLD_AT`` samples so that an
unscraped process holds at most that many rows per partition. The staleness histogram observes
each sampled group, ``(g - p + 1) / S``, so its largest bucket shows the worst one; the wait
histogram observes each call.

The tap subscribes through the buffer's ``observe_samples``: nothing is replaced on the
instance (only a buffer of another library, which has no ``observe_samples``, gets its
``sample`` wrapped).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from functools import wraps
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from .metrics import metric_prefix

__all__ = ["FOLD_AT", "HistogramSnapshot", "Row", "SampleHistograms", "row_of", "tap_samples"]

#: Samples after which the tap bins what it holds itself, without waiting for a scrape.
FOLD_AT = 512

_MISSING: Any = object()

#: ``(cumulative counts per bound, then +Inf)``, sum: one partition's histogram at a scrape.
HistogramSnapshot = tuple[list[int], float]

#: What the tap keeps of one ``sample`` call: its metrics, ``global_steps``, sync step and the
#: dispatch step of each group it returned.
Row = tuple[Mapping[str, float], int, int, tuple[int, ...]]

_dispatch_step_of = attrgetter("dispatch_step")


def row_of(batch: Any, metrics: Mapping[str, float]) -> Row:
    """The row the tap keeps for a call that returned ``batch`` and ``metrics``."""
    return metrics, batch.global_steps, batch.parameter_sync_step, tuple(map(_dispatch_step_of, batch.groups))


class _Bins:
    """Counts per bucket (the last one is +Inf) and the sum of one histogram of one partition."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: npt.NDArray[np.float64]) -> None:
        self.bounds = bounds
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)
        self.total = 0.0

    def add(self, values: npt.NDArray[np.float64]) -> None:
        # side="left": a value equal to a bound belongs to that bound's bucket (Prometheus' "le").
        slots = np.searchsorted(self.bounds, values, side="left")
        self.counts += np.bincount(slots, minlength=len(self.counts))
        self.total += float(values.sum())

    def snapshot(self) -> HistogramSnapshot:
        return [int(count) for count in np.cumsum(self.counts)], self.total


class SampleHistograms:
    """Histograms of each sampled group's staleness and of each call's ``wait_seconds``, per partition.

    Args:
        staleness_bounds, wait_bounds: the upper bounds of the buckets (+Inf is implied).
    """

    def __init__(self, staleness_bounds: Sequence[float], wait_bounds: Sequence[float]) -> None:
        #: The rows not binned yet, per partition. Only the tap appends to a list;
        #: :meth:`fold` removes from them and :meth:`rows_for` adds lists, under the lock.
        self.pending: dict[str, list[Row]] = {}
        self._staleness_bounds = np.asarray(staleness_bounds, dtype=np.float64)
        self._wait_bounds = np.asarray(wait_bounds, dtype=np.float64)
        self._staleness: dict[str, _Bins] = {}
        self._wait: dict[str, _Bins] = {}
        self._wait_keys: dict[str, Callable[[Mapping[str, float]], float]] = {}
        self._lock = threading.Lock()

    def fold(self, blocking: bool = True) -> None:
        """Bin every pending observation; without ``blocking``, return at once if another
        thread is folding (it or the next fold takes what is left)."""
        if not self._lock.acquire(blocking):
            return
        try:
            for partition, rows in list(self.pending.items()):
                # The first n rows stay put while the tap appends, and each slice is atomic.
                n = len(rows)
                if n:
                    taken = rows[:n]
                    del rows[:n]
                    self._bin(partition, taken)
        finally:
            self._lock.release()

    def rows_for(self, partition: str) -> list[Row]:
        """Return the pending list of ``partition``, adding it the first time."""
        with self._lock:
            rows = self.pending.get(partition)
            if rows is None:
                rows = self.pending[partition] = []
                self._wait_keys[partition] = itemgetter(f"{metric_prefix(partition)}/off_policy/wait_seconds")
                self._staleness[partition] = _Bins(self._staleness_bounds)
                self._wait[partition] = _Bins(self._wait_bounds)
            return rows

    def snapshot(self) -> dict[str, tuple[HistogramSnapshot, HistogramSnapshot]]:
        """Fold, then return ``{partition: (staleness, wait_seconds)}`` for the partitions sampled."""
        self.fold()
        with self._lock:
            return {
                partition: (bins.snapshot(), self._wait[partition].snapshot())
                for partition, bins in sorted(self._staleness.items())
            }

    def _bin(self, partition: str, rows: list[Row]) -> None:
        wait_of = self._wait_keys[partition]
        n = len(rows)
        self._wait[partition].add(np.fromiter((wait_of(row[0]) for row in rows), np.float64, n))
        sizes = np.fromiter((len(row[3]) for row in rows), np.int64, n)
        steps = np.repeat(np.fromiter((row[1] for row in rows), np.float64, n), sizes)
        sync = np.repeat(np.fromiter((row[2] for row in rows), np.float64, n), sizes)
        dispatched = np.fromiter(chain.from_iterable(row[3] for row in rows), np.float64, int(sizes.sum()))
        # A group dispatched after the step (a journal recovered at an earlier one) counts as fresh.
        self._staleness[partition].add((steps + 1 - np.minimum(dispatched, steps)) / sync)


def tap_samples(buffer: Any, histograms: SampleHistograms) -> Callable[[], None]:
    """Subscribe ``histograms`` to every batch ``buffer`` returns (its ``observe_samples``);
    return the function that unsubscribes.

    The observer only appends the call's row to its partition's list (the scrape bins it).
    A buffer without ``observe_samples`` (another implementation of the protocol) has its
    ``sample`` wrapped on the instance instead.
    """
    observe = getattr(buffer, "observe_samples", None)
    if observe is None:
        return _wrap_samples(buffer, histograms)
    pending = histograms.pending
    rows_for = histograms.rows_for
    fold = histograms.fold

    def observed(batch: Any, metrics: Mapping[str, float]) -> None:
        partition = batch.partition
        rows = pending.get(partition)
        if rows is None:
            rows = rows_for(partition)
        rows.append(row_of(batch, metrics))
        if len(rows) >= FOLD_AT:
            fold(False)

    stop: Callable[[], None] = observe(observed)
    return stop


def _wrap_samples(buffer: Any, histograms: SampleHistograms) -> Callable[[], None]:
    """Wrap ``buffer.sample`` (and ``sample_nowait`` if it has one) on the instance so that each
    returned batch is recorded in ``histograms``; return a function that undoes it. Only for a
    buffer of another library that has no ``observe_samples``.

    The wrappers spell out the signatures the buffers share (see
    :class:`stalebuf.protocol.AsyncReplayBuffer`): forwarding ``*args, **kwargs`` would cost a
    dict per call. Undoing restores what was there before, unless something wrapped the methods
    again since: then the tap stays (it still folds every ``FOLD_AT`` samples, so it holds
    nothing unbounded).
    """
    pending = histograms.pending
    rows_for = histograms.rows_for
    fold = histograms.fold

    def record(partition: str, result: Any) -> Any:
        rows = pending.get(partition)
        if rows is None:
            rows = rows_for(partition)
        rows.append(row_of(*result))
        if len(rows) >= FOLD_AT:
            fold(False)
        return result

    previous = {"sample": buffer.__dict__.get("sample", _MISSING)}
    installed: dict[str, Any] = {"sample": _observed_sample(buffer.sample, record)}
    sample_nowait = getattr(buffer, "sample_nowait", None)
    if sample_nowait is not None:
        previous["sample_nowait"] = buffer.__dict__.get("sample_nowait", _MISSING)
        installed["sample_nowait"] = _observed_sample_nowait(sample_nowait, record)
    for name, method in installed.items():
        setattr(buffer, name, method)

    def untap() -> None:
        for name, method in installed.items():
            if buffer.__dict__.get(name) is not method:
                continue  # wrapped again by someone else: leave the chain intact
            if previous[name] is _MISSING:
                delattr(buffer, name)
            else:
                setattr(buffer, name, previous[name])

    return untap


def _observed_sample(sample: Any, record: Callable[[str, Any], Any]) -> Callable[..., Any]:
    """``sample`` wrapped to pass each result through ``record(partition, result)``."""

    @wraps(sample)
    async def observed_sample(
        global_steps: int,
        batch_size: int | None = None,
        *,
        token_budget: int | None = None,
        partition: str = "train",
        timeout: float | None = None,
    ) -> Any:
        if token_budget is None:  # (a buffer of another library may not take the keyword)
            result = await sample(global_steps, batch_size, partition=partition, timeout=timeout)
        else:
            result = await sample(
                global_steps, batch_size, token_budget=token_budget, partition=partition, timeout=timeout
            )
        return record(partition, result)

    return observed_sample


def _observed_sample_nowait(sample_nowait: Any, record: Callable[[str, Any], Any]) -> Callable[..., Any]:
    """``sample_nowait`` wrapped to pass each result through ``record(partition, result)``."""

    @wraps(sample_nowait)
    def observed_sample_nowait(
        global_steps: int,
        batch_size: int | None = None,
        *,
        token_budget: int | None = None,
        partition: str = "train",
    ) -> Any:
        if token_budget is None:
            result = sample_nowait(global_steps, batch_size, partition=partition)
        else:
            result = sample_nowait(global_steps, batch_size, token_budget=token_budget, partition=partition)
        return record(partition, result)

    return observed_sample_nowait
