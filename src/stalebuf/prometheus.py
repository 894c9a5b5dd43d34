"""Prometheus metrics for a buffer, read on scrape: ``stalebuf.prometheus.register(buffer)``.

Install with ``pip install 'stalebuf[prometheus]'``. :func:`register` adds a collector to a
``prometheus_client`` registry. Nothing runs between scrapes: each scrape reads
``buffer.stats()`` (a local :class:`~stalebuf.ReplayBuffer`, or a
:class:`~stalebuf.ray.RemoteReplayBuffer` whose actor is asked within a time bound) and
renders it. Two histograms, of the staleness and of the wait of each ``sample``, are fed by a
tap on the buffer's ``sample`` methods that costs a deque append per call.

Metrics (``stalebuf`` is the default ``namespace``; labels in braces):

- ``stalebuf_up``: 1 if the last read of ``stats()`` succeeded, else 0 (then only the
  histograms follow); ``stalebuf_closed``: 1 once the buffer is closed.
- the journal's (buffer-wide; 0 without one): counter ``stalebuf_journal_commits_total``,
  gauges ``stalebuf_journal_bytes``, ``stalebuf_journal_pending_bytes`` and
  ``stalebuf_journal_lag_seconds``.
- gauges ``stalebuf_resident_groups{partition,status}`` (status: pending, running, finished,
  failure), ``stalebuf_resident_trajectories{partition}``,
  ``stalebuf_waiting_samplers{partition}``, ``stalebuf_waiting_producers{partition}``,
  ``stalebuf_capacity_groups{partition}`` (partitions under admission control only; the family
  is left out of a scrape where no partition has admission control).
- counters ``stalebuf_admitted_groups_total``, ``stalebuf_admitted_trajectories_total``,
  ``stalebuf_sampled_groups_total``, ``stalebuf_sampled_trajectories_total``,
  ``stalebuf_reissued_groups_total``, ``stalebuf_reissued_trajectories_total``,
  ``stalebuf_evicted_in_flight_groups_total``, ``stalebuf_cut_groups_total``,
  ``stalebuf_cut_trajectories_total``, the token counters ``stalebuf_admitted_tokens_total``,
  ``stalebuf_sampled_tokens_total``, ``stalebuf_masked_tokens_total``,
  ``stalebuf_evicted_tokens_total``, ``stalebuf_reissued_tokens_total`` (all ``{partition}``;
  gauges ``stalebuf_resident_tokens{partition}``, ``stalebuf_terminal_tokens{partition}``
  (``stats()``'s ``resident_tokens``: the name above was taken first, for every resident group)
  and ``stalebuf_reserved_tokens{partition}``) and
  ``stalebuf_evicted_groups_total{partition,reason}``,
  ``stalebuf_evicted_trajectories_total{partition,reason}`` (reason: stale, failure, restart).
- histograms ``stalebuf_sampled_staleness_versions{partition}`` (the staleness of each sampled
  group, ``(g - p + 1) / S`` in parameter versions, so the worst one is visible; until 0.1 it was
  ``stalebuf_sample_staleness``, one observation per call of its mean) and
  ``stalebuf_sample_wait_seconds{partition}`` (each call's wait), over the ``sample`` calls made
  in this process through this buffer object since :func:`register`. Both carry their unit the
  ``prometheus_client`` way (``unit=``: the name's suffix, and a ``# UNIT`` line in OpenMetrics).

A partition name UTF-8 cannot encode (a lone surrogate, which the buffer refuses but a remote
or custom ``stats()`` may report) is exported with Python's ``backslashreplace`` escapes, so
that it never fails a scrape.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import pairwise
from typing import Any, TypeVar

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.registry import CollectorRegistry
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # pragma: no cover - depends on the environment
    from .errors import MissingDependencyError

    raise MissingDependencyError(
        "stalebuf.prometheus needs prometheus_client: pip install 'stalebuf[prometheus]'"
    ) from exc

from ._prometheus_samples import HistogramSnapshot, SampleHistograms, tap_samples
from ._prometheus_stats import StatsReader, stats_reader
from ._validation import describe, describe_error, is_finite_number, is_utf8
from .errors import ConfigError
from .stats import BufferStats, PartitionStats

__all__ = [
    "DEFAULT_STALENESS_BUCKETS",
    "DEFAULT_WAIT_BUCKETS",
    "BufferCollector",
    "register",
]

#: Upper bounds of the ``sampled_staleness_versions`` buckets: staleness is 1 for a fully
#: on-policy group.
DEFAULT_STALENESS_BUCKETS: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
#: Upper bounds of the ``sample_wait_seconds`` buckets.
DEFAULT_WAIT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip

logger = logging.getLogger("stalebuf.prometheus")

_T = TypeVar("_T")

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_STATUSES = ("pending", "running", "finished", "failure")
_REASONS = ("stale", "failure", "restart")
# (metric name, help, PartitionStats field) of the counters labelled by partition alone.
_COUNTERS = (
    ("admitted_groups", "Groups admitted (add_prompt, put_group).", "admitted_groups"),
    ("admitted_trajectories", "Trajectories admitted.", "admitted_trajectories"),
    ("sampled_groups", "Groups returned by sample.", "sampled_groups"),
    ("sampled_trajectories", "Trajectories returned by sample.", "sampled_trajectories"),
    ("evicted_in_flight_groups", "Groups evicted as stale while in flight (among reason=stale).",
     "evicted_in_flight_groups"),
    ("reissued_groups", "In-flight groups kept as PENDING by restore(in_flight='reissue').",
     "reissued_groups"),
    ("reissued_trajectories", "Partial trajectories restore(in_flight='reissue') discarded.",
     "reissued_trajectories"),
    ("cut_groups", "In-flight groups cut at their deadline (then finished or failed).", "cut_groups"),
    ("cut_trajectories", "Trajectories of groups cut at their deadline.", "cut_trajectories"),
    ("admitted_tokens", "Tokens put (versions or tokens given to put).", "admitted_tokens"),
    ("sampled_tokens", "Tokens of the trajectories sample returned.", "sampled_tokens"),
    ("masked_tokens", "Sampled tokens the mask strategy kept out of the loss (stale).", "masked_tokens"),
    ("evicted_tokens", "Tokens of evicted groups (any reason).", "evicted_tokens"),
    ("reissued_tokens", "Tokens of partial trajectories restore(in_flight='reissue') discarded.",
     "reissued_tokens"),
)  # fmt: skip
# (metric name, help, PartitionStats field) of the gauges labelled by partition alone.
_JOURNAL_GAUGES = (
    ("journal_bytes", "The journal's size on disk, its write-ahead log included.", "journal_bytes"),
    ("journal_pending_bytes", "Encoded bytes waiting to be committed (estimated).", "journal_pending_bytes"),
    ("journal_lag_seconds", "Age of the oldest change not yet committed.", "journal_lag_seconds"),
)
_GAUGES = (
    ("resident_trajectories", "Trajectories held by resident groups.", "trajectories"),
    ("resident_tokens", "Tokens held by resident groups, in flight or not.", "tokens"),
    ("terminal_tokens", "Tokens held by resident terminal groups.", "resident_tokens"),
    (
        "reserved_tokens",
        "Tokens reserved by groups in flight under token caps (max_tokens_per_group each).",
        "reserved_tokens",
    ),
    ("waiting_samplers", "sample calls blocked now.", "waiting_samplers"),
    ("waiting_producers", "Producer calls blocked on admission now.", "waiting_producers"),
)


class BufferCollector:
    """The ``prometheus_client`` collector :func:`register` installs for one buffer.

    ``collect()`` reads the buffer's stats (never raising: a failed read gives ``up 0``) and
    ``describe()`` lists the metric names without reading anything.
    """

    def __init__(
        self,
        reader: StatsReader,
        histograms: SampleHistograms,
        namespace: str,
        staleness_buckets: tuple[float, ...],
        wait_buckets: tuple[float, ...],
    ) -> None:
        self._reader = reader
        self._histograms = histograms
        self._namespace = namespace
        self._staleness_les = [*map(floatToGoString, staleness_buckets), "+Inf"]
        self._wait_les = [*map(floatToGoString, wait_buckets), "+Inf"]
        self._was_up = True
        self._registry: Any = None
        self._untap: Any = None

    def collect(self) -> Iterator[Any]:
        """Yield the metric families of one scrape (see the module docstring)."""
        try:
            stats: BufferStats | None = self._reader()
        except Exception as exc:  # a scrape must not fail: report the buffer down instead
            if self._was_up:
                logger.warning("stalebuf.prometheus: reading stats() failed: %s", describe_error(exc))
            self._was_up = False
            stats = None
        else:
            if not self._was_up:
                logger.info("stalebuf.prometheus: reading stats() works again")
            self._was_up = True
        up = self._gauge("up", "1 if the last read of the buffer's stats succeeded, else 0.", None)
        up.add_metric([], 1.0 if stats is not None else 0.0)
        yield up
        if stats is not None:
            yield from self._stats_families(stats)
        yield from self._histogram_families(self._histograms.snapshot())

    def describe(self) -> Iterator[Any]:
        """Yield every metric family this collector emits, without samples (reads nothing)."""
        yield self._gauge("up", "", None)
        yield from self._stats_families(None)
        yield from self._histogram_families({})

    def attach(self, registry: CollectorRegistry, untap: Callable[[], None]) -> None:
        """Register in ``registry``, remembering it and how to stop the sample tap (``untap``),
        both undone by :meth:`unregister`; :func:`register` calls it.

        Raises:
            ValueError: ``registry`` already has these metric names (then nothing is kept and
                ``untap`` has been called).
        """
        try:
            registry.register(self)
        except BaseException:
            untap()
            raise
        self._registry = registry
        self._untap = untap

    def unregister(self) -> None:
        """Remove the collector from its registry and the sample tap from the buffer; idempotent.

        Raises:
            KeyError: the collector was removed from the registry by other means meanwhile.
        """
        registry, untap = self._registry, self._untap
        self._registry = self._untap = None
        if untap is not None:
            untap()
        if registry is not None:
            registry.unregister(self)

    def _name(self, name: str) -> str:
        return f"{self._namespace}_{name}"

    def _gauge(self, name: str, documentation: str, labels: Sequence[str] | None) -> GaugeMetricFamily:
        return GaugeMetricFamily(self._name(name), documentation, labels=labels)

    def _stats_families(self, stats: BufferStats | None) -> Iterator[Any]:
        """The families read from ``stats``; without samples when it is None."""
        parts: list[tuple[str, PartitionStats]] = [] if stats is None else _labelled(stats.partitions.items())
        closed = self._gauge("closed", "1 once the buffer is closed, else 0.", None)
        if stats is not None:
            closed.add_metric([], 1.0 if stats.closed else 0.0)
        yield closed
        yield from self._journal_families(stats)
        groups = self._gauge("resident_groups", "Resident groups, by status.", ["partition", "status"])
        for partition, item in parts:
            for status in _STATUSES:
                groups.add_metric([partition, status], getattr(item, status))
        yield groups
        for name, documentation, field in _GAUGES:
            gauge = self._gauge(name, documentation, ["partition"])
            for partition, item in parts:
                gauge.add_metric([partition], getattr(item, field))
            yield gauge
        capacity = self._gauge(
            "capacity_groups", "Bound on resident groups under admission control.", ["partition"]
        )
        for partition, item in parts:
            if item.capacity is not None:
                capacity.add_metric([partition], item.capacity)
        if stats is None or capacity.samples:  # no empty family without admission control
            yield capacity
        for name, documentation, field in _COUNTERS:
            counter = CounterMetricFamily(self._name(name), documentation, labels=["partition"])
            for partition, item in parts:
                counter.add_metric([partition], getattr(item, field))
            yield counter
        for unit in ("groups", "trajectories"):
            evicted = CounterMetricFamily(
                self._name(f"evicted_{unit}"), f"Evicted {unit}, by reason.", labels=["partition", "reason"]
            )
            for partition, item in parts:
                for reason in _REASONS:
                    evicted.add_metric([partition, reason], getattr(item, f"evicted_{reason}_{unit}"))
            yield evicted

    def _journal_families(self, stats: BufferStats | None) -> Iterator[Any]:
        """The journal's buffer-wide families (0 without a journal)."""
        commits = CounterMetricFamily(self._name("journal_commits"), "Commits the journal made.", labels=[])
        if stats is not None:
            commits.add_metric([], stats.journal_commits)
        yield commits
        for name, documentation, field in _JOURNAL_GAUGES:
            gauge = self._gauge(name, documentation, None)
            if stats is not None:
                gauge.add_metric([], getattr(stats, field))
            yield gauge

    def _histogram_families(
        self, snapshot: dict[str, tuple[HistogramSnapshot, HistogramSnapshot]]
    ) -> Iterator[HistogramMetricFamily]:
        staleness = HistogramMetricFamily(
            self._name("sampled_staleness"),
            "Staleness of each group sample returned, (g - p + 1) / S, in parameter versions.",
            labels=["partition"],
            unit="versions",
        )
        wait = HistogramMetricFamily(
            self._name("sample_wait"),
            "Seconds each sample call spent blocked.",
            labels=["partition"],
            unit="seconds",
        )
        for partition, ((stale_counts, stale_sum), (wait_counts, wait_sum)) in _labelled(snapshot.items()):
            stale_buckets = list(zip(self._staleness_les, stale_counts, strict=True))
            staleness.add_metric([partition], stale_buckets, stale_sum)
            wait.add_metric([partition], list(zip(self._wait_les, wait_counts, strict=True)), wait_sum)
        yield staleness
        yield wait


def register(
    buffer: Any,
    registry: CollectorRegistry = prometheus_client.REGISTRY,
    *,
    namespace: str = "stalebuf",
    timeout: float = 5.0,
    staleness_buckets: Sequence[float] = DEFAULT_STALENESS_BUCKETS,
    wait_buckets: Sequence[float] = DEFAULT_WAIT_BUCKETS,
) -> BufferCollector:
    """Export ``buffer``'s stats to ``registry``, read on each scrape; return the collector.

    ``buffer`` is a :class:`~stalebuf.ReplayBuffer` or a
    :class:`~stalebuf.ray.RemoteReplayBuffer`. The histograms observe its samples through
    ``buffer.observe_samples`` (another library's buffer without it has ``sample`` wrapped on
    the instance); ``collector.unregister()`` undoes both.
    Scrapes may come from any thread. For a local buffer, call ``register`` inside its running
    event loop if they will come from other threads while the loop runs (it then hands each
    read to the loop, waiting at most ``timeout`` seconds); reads on the loop's thread are
    direct. A remote buffer's actor gets ``timeout`` seconds to answer (a scrape from inside
    a running event loop blocks that loop meanwhile). A read that fails gives ``up 0``. Use one
    ``namespace`` per buffer in a registry.

    Raises:
        TypeError: ``buffer`` is neither a ReplayBuffer nor has an ``async def stats()``.
        ConfigError: ``namespace`` is not a valid metric name prefix, ``timeout`` is not a
            finite number > 0, or a bucket list is not increasing finite numbers (at least one).
        ValueError: ``registry`` already has these metric names (another buffer in the same
            namespace); nothing was installed.
    """
    if type(namespace) is not str or not _NAME.match(namespace):
        raise ConfigError(f"namespace must be a valid Prometheus metric name, got {describe(namespace)}")
    if not is_finite_number(timeout) or timeout <= 0:
        raise ConfigError(f"timeout must be a finite number > 0, got {describe(timeout)}")
    staleness = _check_buckets("staleness_buckets", staleness_buckets)
    waits = _check_buckets("wait_buckets", wait_buckets)
    histograms = SampleHistograms(staleness, waits)
    collector = BufferCollector(stats_reader(buffer, float(timeout)), histograms, namespace, staleness, waits)
    collector.attach(registry, tap_samples(buffer, histograms))
    return collector


# A partition name UTF-8 cannot encode (a lone surrogate such as "\udcff") makes
# generate_latest raise UnicodeEncodeError, which fails the whole scrape. The buffer refuses such
# names, but a remote actor of an older version, a custom stats() or an old checkpoint may still
# hold one, and a scrape must never fail. Of the two defences, escaping the name (Python's
# backslashreplace: the 6 characters \udcff) is the stronger: every number of every partition is
# still exported and the name stays recognisable, where skipping the family would hide the series
# of every partition. The one case escaping cannot serve, another partition whose real name is
# that escaped spelling, drops the escaped partition's series rather than export two series with
# the same labels (a duplicate the Prometheus server would discard anyway).
def _labelled(items: Iterable[tuple[str, _T]]) -> list[tuple[str, _T]]:
    """Return the ``(partition, value)`` pairs, each name as a label value the exposition can encode."""
    pairs = list(items)
    if all(type(name) is str and is_utf8(name) for name, _ in pairs):  # always, unless checks were bypassed
        return pairs
    taken = {name for name, _ in pairs if type(name) is str and is_utf8(name)}
    safe: list[tuple[str, _T]] = []
    for name, value in pairs:
        if type(name) is not str or not is_utf8(name):
            # A custom stats() may even key a partition by a non-str: its bounded description.
            label = name.encode("utf-8", "backslashreplace").decode() if type(name) is str else describe(name)
            if label in taken:
                logger.warning(
                    "stalebuf.prometheus: partition %s is not exported: its escaped name is taken",
                    describe(name),
                )
                continue
            taken.add(label)
            name = label
        safe.append((name, value))
    return safe


def _check_buckets(label: str, bounds: object) -> tuple[float, ...]:
    values = tuple(bounds) if isinstance(bounds, (list, tuple)) else ()
    if not values or not all(map(is_finite_number, values)) or any(a >= b for a, b in pairwise(values)):
        raise ConfigError(
            f"{label} must be a non-empty list of increasing finite numbers, got {describe(bounds)}"
        )
    return tuple(float(value) for value in values)
