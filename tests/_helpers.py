"""What the core tests share: builders, checks, and the one window onto the buffer's internals.

Tests read private buffer state ONLY through the functions in the last section of this
module (they are the only code in tests/ that names a private attribute or imports a private
stalebuf module), so a rename inside stalebuf needs this file updated and no test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from stalebuf import Batch, Group, ReplayBuffer, SamplerConfig, StalenessPolicy, Status, Trajectory
from stalebuf._lazy_group import LazyGroup

# The index data structure itself, for the tests that model it directly (tests/test_index.py).
from stalebuf._open_group import OpenGroup
from stalebuf._partition import PartitionState
from stalebuf._store import EVICTED_UIDS_REMEMBERED
from stalebuf._stored import map_payloads

# The producer wait ledger itself, for the tests that drive it directly (tests/test_admission_waiting.py).
from stalebuf._waiting import ProducerWaits, Waiter
from stalebuf.metrics import SampleMetrics

__all__ = [
    "EVICTED_UIDS_REMEMBERED",
    "LIMIT",
    "Background",
    "GroupView",
    "LyingLen",
    "OpenGroup",
    "PartitionState",
    "ProducerWaits",
    "RaisingAdmits",
    "Waiter",
    "add_group",
    "admission_counts",
    "assert_conserved",
    "copy_journal",
    "evaluations",
    "full_snapshot",
    "group_contents",
    "in_flight_heads",
    "in_flight_heap_size",
    "in_flight_step_count",
    "make",
    "map_payloads",
    "oldest_in_flight",
    "patch_deadline_clock",
    "patch_filter_clock",
    "patch_mixture_clock",
    "producer_ledger",
    "ready_order",
    "ready_steps",
    "ready_tokens",
    "ready_uids",
    "resident_count",
    "resident_groups",
    "resident_keys",
    "resident_uids",
    "sample_now",
    "sampleable_waiters",
    "settle",
    "snapshot",
    "spent_slots",
    "start_call",
    "status_timer_running",
    "steps_of",
    "stored_groups",
    "train_stats",
    "trajectories_built",
    "version_state",
]

LIMIT = 10  # seconds; bounds every wait, so that a hang fails instead of stalling CI


# -- builders ---------------------------------------------------------------------------------


def make(*, on_evict: Any = None, status_log_interval: float | None = None, **config: Any) -> ReplayBuffer:
    """Build a buffer with ``SamplerConfig(**config)``; status lines are off unless asked for."""
    return ReplayBuffer(SamplerConfig(**config), on_evict=on_evict, status_log_interval=status_log_interval)


def add_group(
    buf: ReplayBuffer,
    uid: str,
    step: int,
    *,
    n: int = 2,
    status: Status = Status.FINISHED,
    partition: str = "train",
) -> list[str]:
    """Add a group dispatched at ``step`` with ``n`` trajectories and bring it to ``status``.

    Every status but PENDING goes through RUNNING; the payload of session ``i`` is ``i``.
    """
    buf.add_prompt_nowait(uid, global_steps=step, partition=partition)
    if status is Status.PENDING:
        keys = [buf.put_nowait(uid, i, session_id=i) for i in range(n)]
        return keys
    buf.mark_running_nowait(uid)
    keys = [buf.put_nowait(uid, i, session_id=i) for i in range(n)]
    if status is Status.FINISHED:
        buf.mark_finished_nowait(uid)
    elif status is Status.FAILURE:
        buf.mark_failed_nowait(uid)
    return keys


async def settle() -> None:
    """Let every task run until all are blocked."""
    await anyio.wait_all_tasks_blocked()


class LyingLen:
    """A collection that claims ``claimed`` items but yields ``items``."""

    def __init__(self, claimed: int, items: list[Any]) -> None:
        self.claimed, self.items = claimed, items

    def __len__(self) -> int:
        return self.claimed

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __contains__(self, item: object) -> bool:
        return item in self.items


class RaisingAdmits(StalenessPolicy):
    """The default rules, but ``admits`` raises RuntimeError("admits raised") once ``armed``."""

    armed = False

    def admits(self, tag: int, resident_at_tag: int, last_sampled: int, cap: int, partition: str) -> bool:
        if self.armed:
            raise RuntimeError("admits raised")
        return super().admits(tag, resident_at_tag, last_sampled, cap, partition)


class Background:
    """One call that may wait (a producer waiting for admission, a sample), run in a task."""

    def __init__(self, call: Callable[[], Awaitable[object]]) -> None:
        self.call = call
        self.returned = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.scope = anyio.CancelScope()

    async def run(self) -> None:
        with self.scope:
            try:
                self.result = await self.call()
                self.returned = True
            except Exception as exc:
                self.error = exc

    @property
    def done(self) -> bool:
        """Whether the call returned or raised (a cancelled call is neither)."""
        return self.returned or self.error is not None


async def start_call(tg: anyio.abc.TaskGroup, call: Callable[[], Awaitable[object]]) -> Background:
    """Start ``call`` in ``tg`` and let it run until it parks; trio starts tasks in random order,
    so starting them one by one keeps their arrival order fixed."""
    background = Background(call)
    tg.start_soon(background.run)
    await settle()
    return background


def sample_now(buf: ReplayBuffer, g: int, b: int, partition: str = "train") -> tuple[Batch, dict[str, float]]:
    """Evaluate once, without waiting, outside any event loop (raises TimeoutError if no batch)."""

    async def run() -> tuple[Batch, dict[str, float]]:
        return await buf.sample(g, b, partition=partition, timeout=0)

    return anyio.run(run)


# -- checks -----------------------------------------------------------------------------------


def train_stats(buf: ReplayBuffer) -> Any:
    """The "train" partition's :class:`~stalebuf.PartitionStats`."""
    return buf.stats().partitions["train"]


def resident_count(buf: ReplayBuffer) -> int:
    """How many groups the buffer holds, summed over the status counts of ``stats()``."""
    total = buf.stats().total
    return total.pending + total.running + total.finished + total.failure


def steps_of(buf: ReplayBuffer, *uids: str) -> list[int]:
    """The dispatch steps the resident groups ``uids`` were tagged with."""
    groups = resident_groups(buf)
    return [groups[uid].dispatch_step for uid in uids]


def assert_conserved(buf: ReplayBuffer) -> None:
    """admitted == resident + sampled + evicted by reason (stale, failure, restart, filtered) for
    groups; for trajectories the same plus those discarded by a reissuing restore; per partition
    and in total; under a task mixture the per-task resident and sampled counts add up to their
    partition's; and the totals match what the buffer actually holds. (A buffer without filters
    counts no filtered group, so the law is the one of before filters for it.)"""
    stats = buf.stats()
    for item in (*stats.partitions.values(), stats.total):
        assert item.admitted_groups == (
            item.groups
            + item.sampled_groups
            + item.evicted_stale_groups
            + item.evicted_failure_groups
            + item.evicted_restart_groups
            + item.evicted_filtered_groups
        ), item
        assert item.admitted_trajectories == (
            item.trajectories
            + item.sampled_trajectories
            + item.evicted_stale_trajectories
            + item.evicted_failure_trajectories
            + item.evicted_restart_trajectories
            + item.evicted_filtered_trajectories
            + item.reissued_trajectories
        ), item
        if item.tasks:
            assert sum(task.resident for task in item.tasks.values()) == item.groups, item
            assert sum(task.sampled for task in item.tasks.values()) == item.sampled_groups, item
    assert stats.total.groups == len(resident_uids(buf))
    assert stats.total.trajectories == len(resident_keys(buf))


def snapshot(buf: ReplayBuffer) -> Any:
    """Everything observable about the buffer: stats, every group's contents, the ready order."""
    groups = {
        uid: (
            group.status,
            group.dispatch_step,
            dict(group.tags),
            [(t.key, t.session_id, t.index, dict(t.tags), t.payload) for t in group.trajectories],
        )
        for uid, group in resident_groups(buf).items()
    }
    return buf.stats(), groups, ready_order(buf)


def full_snapshot(buf: ReplayBuffer) -> Any:
    """:func:`snapshot` and more: each group's partition and form (in flight or terminal), its
    payloads by identity, its start version and every trajectory's versions and tokens
    (:func:`version_state`), every index's failed list, in-flight counts and the head each
    in-flight group is filed under, waiters and flags, the
    admission state (dispatch clocks, per-step slot counts, waiting producers, the last step a
    sample returned at, the uids remembered as evicted in flight), the closed flag and the next
    admission number."""
    groups = {
        uid: (
            group.in_flight,
            group.status,
            group.partition,
            group.dispatch_step,
            dict(group.tags),
            [(t.key, t.session_id, t.index, dict(t.tags), id(t.payload)) for t in group.trajectories],
        )
        for uid, group in resident_groups(buf).items()
    }
    versions = version_state(buf)
    indexes = {
        name: (
            [g.uid for g in part.ready.iter_groups()],
            sorted((entry[0], entry[1], entry[-1].uid) for entry in part.failed),
            {step: len(at) for step, at in part.in_flight.groups.items()},
            in_flight_heads(buf, name),
            len(_consumer(buf).waiting.get(name, ())),
            part.exempt,
            part.evict_failures,
            part.evict_in_flight,
            part.cap,
            admission_counts(buf, name),
            _admission(buf).waiting(name),
            _admission(buf).last_sampled(name),
        )
        for name, part in _indexes(buf).items()
    }
    admission = (dict(_admission(buf).clocks), list(_store(buf).evicted_in_flight))
    parked = sampleable_waiters(buf)
    return buf.stats(), buf.closed, groups, versions, indexes, admission, _store(buf).next_seq, parked


def group_contents(buf: ReplayBuffer) -> dict[str, tuple[Status, int, list[Any]]]:
    """Every resident group's status, dispatch step and payloads, by uid (admission order)."""
    return {
        uid: (group.status, group.dispatch_step, [t.payload for t in group.trajectories])
        for uid, group in resident_groups(buf).items()
    }


def copy_journal(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Copy a journal file with its write-ahead log, if one is there (a journal killed mid-run,
    or read while open): the copy opens as the journal's last commit, the journal untouched."""
    for suffix in ("", "-wal"):
        if os.path.exists(f"{os.fspath(source)}{suffix}"):
            shutil.copyfile(f"{os.fspath(source)}{suffix}", f"{os.fspath(target)}{suffix}")


# -- reading the buffer's internals (the only code that does) -----------------------------------


@dataclass(frozen=True)
class GroupView:
    """A resident group as the tests see it, whether in flight or terminal."""

    uid: str
    partition: str
    dispatch_step: int
    status: Status
    tags: Mapping[str, Any]
    trajectories: tuple[Trajectory, ...]  # in put order
    in_flight: bool  # still open (PENDING or RUNNING), not yet a terminal record


def resident_groups(buf: ReplayBuffer) -> dict[str, GroupView]:
    """Every resident group by uid, in admission order. Reads the group store's ``groups``."""
    views = {}
    for uid, group in _groups(buf).items():
        if isinstance(group, OpenGroup):
            partition, trajectories = group.partition, tuple(group.trajectories.values())
        else:
            partition, trajectories = group.partition, group.trajectories
        views[uid] = GroupView(
            uid,
            partition,
            group.dispatch_step,
            group.status,
            group.tags,
            trajectories,
            isinstance(group, OpenGroup),
        )
    return views


def resident_uids(buf: ReplayBuffer) -> list[str]:
    """The uids of every resident group, in admission order. Reads the group store's ``groups``."""
    return list(_groups(buf))


def resident_keys(buf: ReplayBuffer) -> list[str]:
    """The keys of every trajectory held by a resident group. Reads the group store's ``groups``."""
    return [t.key for group in resident_groups(buf).values() for t in group.trajectories]


def ready_uids(buf: ReplayBuffer, partition: str = "train") -> list[str]:
    """The sampleable groups of ``partition`` in selection order (oldest first, FIFO ties).

    Reads the partition's index (the group store's ``partitions``): its ready buckets and step heap.
    """
    return [g.uid for g in _indexes(buf)[partition].ready.iter_groups()]


def ready_tokens(buf: ReplayBuffer, partition: str = "train") -> tuple[int, int]:
    """``(kept, counted)``: the partition's running total of its ready groups' tokens (what a
    token-budget sample reads for its readiness) and the same total counted group by group.
    Reads the partition's ``ready_tokens`` and its ready buckets."""
    part = _indexes(buf).get(partition)
    if part is None:
        return 0, 0
    counted = sum(t.tokens for group in part.ready.iter_groups() for t in group.trajectories)
    return part.ready_tokens, counted


def ready_order(buf: ReplayBuffer) -> dict[str, list[str]]:
    """:func:`ready_uids` of every partition the buffer knows. Reads the group store's ``partitions``."""
    return {name: [g.uid for g in part.ready.iter_groups()] for name, part in _indexes(buf).items()}


def ready_steps(buf: ReplayBuffer, partition: str = "train") -> list[int]:
    """The dispatch steps that have a bucket of ready groups, ascending. Reads the ready buckets."""
    return sorted(_indexes(buf)[partition].ready.buckets)


def spent_slots(buf: ReplayBuffer, partition: str, step: int) -> list[Any]:
    """What the taken (spent) slots at the front of a ready bucket still hold: the group
    each slot references, or None once it was freed. Reads the bucket's members and head."""
    bucket = _indexes(buf)[partition].ready.buckets[step]
    return bucket.members[: bucket.head]


def oldest_in_flight(buf: ReplayBuffer, partition: str = "train") -> int | None:
    """The oldest dispatch step among PENDING/RUNNING groups, as the wait gate reads it."""
    return _indexes(buf)[partition].in_flight.oldest()


def in_flight_heads(buf: ReplayBuffer, partition: str = "train") -> dict[str, int]:
    """The version each in-flight group of ``partition`` is filed under in the in-flight index
    (its head, which the wait gate and in-flight eviction read), by uid. Reads ``in_flight``."""
    part = _indexes(buf).get(partition)
    if part is None:
        return {}
    return {uid: head for head, at in part.in_flight.groups.items() for uid in at}


def version_state(buf: ReplayBuffer) -> dict[str, tuple[int, list[tuple[str, Any, int]]]]:
    """Every resident group's start version and its trajectories' ``(key, versions, tokens)``,
    in flight or terminal, by uid. Reads the group store's ``groups``."""
    state = {}
    for uid, group in _groups(buf).items():
        trajectories = group.trajectories.values() if isinstance(group, OpenGroup) else group.trajectories
        state[uid] = (group.start_version, [(t.key, t.versions, t.tokens) for t in trajectories])
    return state


def in_flight_heap_size(buf: ReplayBuffer, partition: str = "train") -> int:
    """How many entries the lazily cleaned in-flight step heap holds. Reads ``in_flight_steps``."""
    return len(_indexes(buf)[partition].in_flight.steps)


def in_flight_step_count(buf: ReplayBuffer, partition: str = "train") -> int:
    """How many distinct dispatch steps have groups in flight. Reads ``in_flight``."""
    return len(_indexes(buf)[partition].in_flight.groups)


def admission_counts(buf: ReplayBuffer, partition: str = "train") -> dict[int, int] | None:
    """The admission slots in use per dispatch step, as the buffer counts them (None without
    admission control). Reads the partition's ``resident_at``."""
    part = _indexes(buf).get(partition)
    if part is None or part.resident_at is None:
        return None
    return dict(part.resident_at)


def patch_deadline_clock(monkeypatch: Any, clock: Callable[[], float]) -> None:
    """Make ``clock`` the deadline clock of every buffer (the ``time.monotonic`` that the modules
    measuring admission times and deadlines imported), so a test sets when each group was admitted
    and when a sample evaluates. Patches the store's, the deadlines' and the consumer's."""
    import stalebuf._consumer
    import stalebuf._deadlines
    import stalebuf._store

    for module in (stalebuf._store, stalebuf._deadlines, stalebuf._consumer):
        monkeypatch.setattr(module, "monotonic", clock)


def sampleable_waiters(buf: ReplayBuffer) -> dict[str, int]:
    """How many ``wait_for_sampleable`` calls are parked, per partition with any. Reads the
    consumer's ``sampleable`` part."""
    return {name: len(waiters) for name, waiters in _consumer(buf).sampleable.waiting.items()}


def patch_filter_clock(monkeypatch: Any, clock: Callable[[], float]) -> None:
    """Make ``clock`` the clock the group filters rate-limit their ERROR lines with (the
    ``time.monotonic`` that ``stalebuf._filtering`` imported)."""
    import stalebuf._filtering

    monkeypatch.setattr(stalebuf._filtering, "monotonic", clock)


def patch_mixture_clock(monkeypatch: Any, clock: Callable[[], float]) -> None:
    """Make ``clock`` the clock the task mixture rate-limits its starvation WARNINGs with (the
    ``time.monotonic`` that ``stalebuf._mixture`` imported)."""
    import stalebuf._mixture

    monkeypatch.setattr(stalebuf._mixture, "monotonic", clock)


def evaluations(buf: ReplayBuffer) -> int:
    """How many times a sample evaluated a partition (evicted/selected); the consumer's counter."""
    return _consumer(buf).evaluations


def status_timer_running(buf: ReplayBuffer) -> bool:
    """Whether the asyncio status-line timer is scheduled. Reads the consumer's status timer."""
    status_log = _consumer(buf).status_log
    return status_log is not None and status_log.timer is not None


def stored_groups(buf: ReplayBuffer) -> dict[str, Group]:
    """The resident terminal group records by uid, as stored (reading them builds nothing).
    Reads the group store's ``groups``."""
    return {uid: group for uid, group in _groups(buf).items() if isinstance(group, Group)}


def trajectories_built(group: Group) -> bool:
    """Whether ``group``'s trajectory records exist (a put_group fast-path group builds them
    on first read). Reads ``LazyGroup._built``."""
    return not isinstance(group, LazyGroup) or group._built is not None


def producer_ledger(buf: ReplayBuffer, partition: str = "train") -> tuple[int, int, float, float]:
    """``(counted, queued, starts, expected)``: the producers the wait ledger counts and those in
    the admission queue, the ledger's sum of wait starts and the sum the queue implies. Reads
    admission's ``ProducerQueue`` of the partition."""
    queue = _admission(buf).queues.get(partition)
    if queue is None:  # not created yet: nobody waits there
        return 0, 0, 0.0, 0.0
    waits = queue.waits
    expected = sum(max(waiter.started, waits.reported_at) for waiter in queue.producers)
    return waits.parked, len(queue.producers), waits.starts, expected


# The facade's parts are name-mangled private attributes (a subclass cannot clobber them); these
# white-box helpers are the only test code outside the facade that reads them (benchmarks/soak.py
# and benchmarks/workloads.py read two counters the same way).


def _store(buf: ReplayBuffer) -> Any:
    return buf._ReplayBuffer__store  # type: ignore[attr-defined]


def _admission(buf: ReplayBuffer) -> Any:
    return buf._ReplayBuffer__admission  # type: ignore[attr-defined]


def _consumer(buf: ReplayBuffer) -> Any:
    return buf._ReplayBuffer__consumer  # type: ignore[attr-defined]


def _groups(buf: ReplayBuffer) -> Mapping[str, Any]:
    groups: Mapping[str, Any] = _store(buf).groups
    return groups


def _indexes(buf: ReplayBuffer) -> Mapping[str, PartitionState]:
    partitions: Mapping[str, PartitionState] = _store(buf).partitions
    return partitions


def refuses_token_group(buf: ReplayBuffer, tag: int, partition: str = "train") -> bool:
    """Admission's token-batch readiness seam: would a clock-tagged add_prompt be refused at ``tag``."""
    refused: bool = _admission(buf).tokens.refuses_group(_indexes(buf).get(partition), partition, tag)
    return refused


def whitebox_sample(
    buf: ReplayBuffer, g: int, count: int, partition: str = "train"
) -> tuple[Batch, dict[str, float]] | None:
    """What ``sample_nowait(g, count)`` does, past the facade's argument checks: a stand-in for a
    token-budget sample (which picks ``count`` itself) until the buffer has one; None if no batch."""
    part = _indexes(buf).get(partition)
    result: tuple[Batch, dict[str, float]] | None = _consumer(buf).sample_now(
        part, partition, g, count, SampleMetrics()
    )
    return result
