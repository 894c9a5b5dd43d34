"""The replay buffer's public facade: producers move groups through their lifecycle, the
trainer samples.

:class:`ReplayBuffer` holds its parts and delegates to them; it owns no rule and no state of
its own (TorchRL's buffer composes storage, sampler and writer the same way):

- the group store (``_store.py``): every group, partition, counter and remembered eviction;
- admission (``_admission.py``): dispatch clocks and producers waiting for a slot;
- the consumer (``_consumer.py``, ``_eviction.py``): evaluation, eviction, parked samples;
- the group writer (``_group_writes.py``): ``put_group``;
- the rule book (``policy.py``, asked through ``_rules.py``).

Everything that changes state is synchronous (the ``*_nowait`` methods and the evaluation
inside ``sample``), so on one event loop each call is atomic. ``sample`` is the only call
that waits: validate, try :meth:`ReplayBuffer.sample_nowait`'s path, park on a per-call
signal, re-check. Its private attributes are name-mangled, so a subclass's own attributes
and helpers (verl plugins define ``_config``, ``_groups``, ``_evict``...) never replace its
machinery.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from threading import get_ident
from types import TracebackType
from typing import Any, TypeVar

import anyio.lowlevel
import attrs

from . import _validation as checks
from ._admission import Admission
from ._checkpoint_file import PayloadCodec
from ._consumer import Consumer, EvictCallback, SampleObserver
from ._custom_sampler import build_from_config, refuse_custom_sampler
from ._eviction import check_on_evict
from ._group_writes import GroupStatus, GroupWriter
from ._journal import Journal, JournalOptions, JournalParts
from ._journal_setup import check_journal_options, open_recovery, start_journal, start_recovered
from ._open_group import GroupWatch, OpenGroup
from ._restore import build_restored, capture, policy_of, read_restore_arguments, rebuild
from ._rollout import RolloutGroup, rollout
from ._rules_build import build_rules
from ._save_order import SaveSequencer
from ._store import GroupStore
from ._threadsafe import ThreadsafeProducer
from ._token_rules import check_sample_budget
from ._versions import check_start_version, trajectory_versions
from ._waiting import LoopBinding
from .checkpoint import NOT_GIVEN, BufferCheckpoint, InFlightMode, RestoreResult
from .config import SamplerConfig
from .errors import (
    BatchNotReadyError,
    BufferClosedError,
    BufferFullError,
    CheckpointError,
    DuplicateGroupError,
    FutureTagError,
    TagClosedError,
)
from .filters import GroupFilter
from .metrics import SampleMetrics
from .policy import StalenessPolicy
from .records import EMPTY_TAGS, Batch, Group, Status
from .stats import BufferStats, WaitExplanation

__all__ = ["GroupStatus", "ReplayBuffer"]

_Self = TypeVar("_Self", bound="ReplayBuffer")
_UNSET: Any = NOT_GIVEN  # an argument not given (read_restore_arguments knows it too)
_FINISHED, _FAILURE = Status.FINISHED, Status.FAILURE
_HOOKS = ("_is_stale", "_must_wait_for", "_select")
_PENDING_BYTES = 256 * 2**20  # journal_max_pending_bytes's default


class ReplayBuffer:
    """A staleness-aware buffer of trajectory groups for asynchronous RL.

    Construction is synchronous and needs no running event loop. The first ``sample`` that
    waits binds the buffer to its async backend (asyncio or trio) and thread; it must then be
    awaited only under that backend (successive event loops of it are fine) and called only
    from that thread: producers on other threads use :meth:`threadsafe`.

    Args:
        config: the sampler config; None means the policy's, or ``SamplerConfig()``.
        policy: the rule book; None builds ``StalenessPolicy(config)``. It answers every rule
            question, and its ``sync_step`` is the S of every staleness the buffer reports; build
            it from the same config (a checkpoint keeps only ``config``). Subclasses may instead
            override ``_is_stale``, ``_must_wait_for`` and ``_select`` (see :mod:`stalebuf.policy`).
        on_evict: called synchronously with one :class:`EvictionEvent` per reason per
            eviction round, inside ``sample``, after the buffer state is consistent. It may
            call the ``*_nowait`` producer methods (e.g. to refill prompts).
        status_log_interval: a ``sample`` blocked this many seconds logs one line on the
            "stalebuf" logger, and again every interval after, saying why it waits (as
            :meth:`explain_wait` does); INFO at first, WARNING from the third line on (once one
            call has waited 3 intervals: 3 minutes at the default 60 s). None disables it.
        filters: group filters, plain callables ``filter(group) -> bool`` run in order on every
            group of a non-exempt partition that becomes FINISHED; the first that returns False
            evicts it at once (reason "filtered"), freeing its admission slot. A filter that
            raises (or returns None) keeps the group: counted in ``stats()``'s
            ``filter_errors`` and logged. See :mod:`stalebuf.filters` for built-ins.
        journal: a path to an SQLite file that every state change is journaled to (see the
            docs' Durability page); absent or empty, it starts a new journal; one that holds a
            stalebuf journal or checkpoint is refused (recover from it, or remove it). Once its
            writer stops on an error (a disk error, a payload it cannot encode), ``flush`` and
            every later producer call raise CheckpointError, changing nothing.
        journal_interval: how often (seconds, >= 0) the journal commits; 0 commits every change
            before the call returns (blocking the loop about one fsync per call).
        journal_retention_steps: history kept behind the newest sample, in trainer steps (at
            least back to the mark before the newest ``flush(checkpoint_step=g)``).
        journal_max_pending_bytes: above this many encoded bytes not yet committed, async
            producer calls wait for the writer and ``*_nowait`` ones raise BufferFullError.
        payload_codec: ``(encode, decode)`` for the journal's payloads (default: pickle).

    Raises:
        ConfigError: ``config`` is not a SamplerConfig or names a ``custom_sampler`` (build
            that with :meth:`from_config`), ``policy`` is not a StalenessPolicy, ``on_evict``
            is not a plain callable, ``status_log_interval`` is not None or a number >= 0.001,
            or ``filters`` is not a sequence of plain (synchronous) callables, or a journal
            argument is invalid.
        CheckpointError: ``journal`` names a file that is not absent or empty (it is left as
            it was), or the journal cannot record this buffer's policy.
    """

    def __init__(
        self,
        config: SamplerConfig | None = None,
        *,
        policy: StalenessPolicy | None = None,
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = 60.0,
        filters: Sequence[GroupFilter] = (),
        journal: str | os.PathLike[str] | None = None,
        journal_interval: float = 1.0,
        journal_retention_steps: int = 4,
        journal_max_pending_bytes: int = _PENDING_BYTES,
        payload_codec: PayloadCodec | None = None,
    ) -> None:
        """Check the arguments (see the class docs) and build the parts, empty."""
        if policy is None and type(self) is ReplayBuffer:
            refuse_custom_sampler(config)
        overridden = any(getattr(type(self), hook) is not getattr(ReplayBuffer, hook) for hook in _HOOKS)
        rules = build_rules(config, policy, self if overridden else None, filters)
        check_on_evict(on_evict)
        interval = checks.check_status_log_interval(status_log_interval)
        journaled = check_journal_options(
            journal, journal_interval, journal_retention_steps, journal_max_pending_bytes
        )
        checks.check_payload_codec(payload_codec)
        binding = LoopBinding()
        self.__store = store = GroupStore(rules, binding)
        self.__admission = admission = Admission(store, rules, binding)
        self.__consumer = consumer = Consumer(store, admission, rules, binding, on_evict, interval)
        self.__writer = GroupWriter(store, admission, consumer)
        self.__saves = SaveSequencer()  # orders overlapping saves (see save)
        self.__journal: Journal | None = None
        self.__sync_journal: Journal | None = None  # the journal, under journal_interval=0
        if journaled is not None:
            self.__start_journal(journaled, payload_codec)

    def __journal_parts(self) -> JournalParts:
        consumer = self.__consumer
        return JournalParts(
            self.__store, self.__admission, consumer.filtering, consumer.mixing, policy_of(self.__store)
        )

    def __start_journal(
        self, options: JournalOptions, codec: PayloadCodec | None, recovered: Any = None
    ) -> None:
        """Journal into ``options.path`` from now on: a new file, or (``recovered``: the open
        connection and the recovery read from it) the journal this buffer was recovered from."""
        if recovered is None:
            journal = start_journal(options, self.__journal_parts(), codec)
        else:
            journal = start_recovered(options, self.__journal_parts(), codec, *recovered)
        self.__journal = journal
        self.__sync_journal = journal if options.interval == 0 else None
        self.__consumer.subscribe(journal.on_sample)
        weakref.finalize(self, journal.close)  # a buffer dropped unclosed: commit, stop the thread

    @classmethod
    def from_config(
        cls,
        config: SamplerConfig | Mapping[str, Any],
        *,
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = _UNSET,
        filters: Sequence[GroupFilter] = (),
        journal: str | os.PathLike[str] | None = None,
        journal_interval: float = 1.0,
        journal_retention_steps: int = 4,
        journal_max_pending_bytes: int = _PENDING_BYTES,
        payload_codec: PayloadCodec | None = None,
    ) -> ReplayBuffer:
        """Build a buffer from a config or verl-style mapping, honouring ``custom_sampler``
        (``filters`` and the journal arguments as for the constructor; the journal starts once
        the buffer is built).

        ``custom_sampler`` may name a ``ReplayBuffer`` subclass, built as
        ``Cls(config, **config.sampler_kwargs)`` plus ``on_evict`` and ``status_log_interval``
        when given here (so its minimal constructor is ``__init__(self, config, **kwargs)``
        passing them on), or a :class:`~stalebuf.policy.StalenessPolicy` subclass, built as
        ``Cls(config, **config.sampler_kwargs)`` and given to ``cls``. Without one, ``cls``.

        Raises:
            ConfigError: for an invalid config, a custom sampler that cannot be loaded or is
                neither kind of subclass, or sampler_kwargs its constructor rejects.
        """
        options: dict[str, Any] = {} if on_evict is None else {"on_evict": on_evict}
        if status_log_interval is not _UNSET:
            options["status_log_interval"] = status_log_interval
        if filters != ():
            options["filters"] = filters
        journaled = check_journal_options(
            journal, journal_interval, journal_retention_steps, journal_max_pending_bytes
        )
        checks.check_payload_codec(payload_codec)
        built: ReplayBuffer = build_from_config(cls, ReplayBuffer, config, options)
        if journaled is not None:
            built.__start_journal(journaled, payload_codec)
        return built

    @classmethod
    def restore(
        cls,
        source: BufferCheckpoint | str | os.PathLike[str],
        *,
        in_flight: InFlightMode = "reissue",
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = _UNSET,
        payload_codec: PayloadCodec | None = None,
        filters: Sequence[GroupFilter] = (),
        journal: str | os.PathLike[str] | None = None,
        journal_interval: float = 1.0,
        journal_retention_steps: int = 4,
        journal_max_pending_bytes: int = _PENDING_BYTES,
    ) -> RestoreResult[ReplayBuffer]:
        """Build a buffer from a checkpoint (or a file :meth:`save` wrote); synchronous. With
        ``journal``, the restored buffer journals into a new file, which starts with its state.

        The class built is what :meth:`from_config` builds from the saved config (``cls``
        unless it names a custom sampler). Its ``stats()`` equal the checkpointed buffer's
        (waiting callers are not saved), apart from what ``in_flight`` does with groups that
        were PENDING or RUNNING: "reissue" keeps them PENDING at their place in the order, with
        their trajectories discarded (counted in ``reissued_*``) and their start version back
        at the dispatch step, and lists them in the result's ``reissue``; "resume" keeps them
        PENDING with their trajectories (versions and tokens) and start version, counts
        nothing as reissued, and lists them in ``reissue`` with that prefix, for their producers
        to go on after it (call ``mark_running`` again); "keep" keeps them exactly; "evict"
        evicts them (reason "restart", one event per partition to ``on_evict``, counted in
        ``evicted_restart_*``).
        ``status_log_interval`` is passed to the built class only when given (its default is
        the class's own: 60 s for ``ReplayBuffer``), as :meth:`from_config` does.

        Raises:
            CheckpointError: the file is truncated, corrupt, foreign or newer, or needs (or must
                not have) a payload codec; a field of the checkpoint is one the live API would
                refuse, or its counters do not conserve its groups (the message names the field);
                or the checkpoint cannot be rebuilt. Nothing is built.
            ConfigError: ``in_flight``, ``on_evict`` or ``status_log_interval`` is invalid.
            OSError: the file cannot be read.
            Exception: whatever ``on_evict`` raised (under "evict").
        """
        journaled = check_journal_options(
            journal, journal_interval, journal_retention_steps, journal_max_pending_bytes
        )
        checkpoint, mode, options = read_restore_arguments(
            source, in_flight, on_evict, status_log_interval, payload_codec
        )
        if filters != ():  # filters are code, never in a checkpoint: given again on restore
            options["filters"] = filters
        buffer: ReplayBuffer = build_restored(cls, ReplayBuffer, checkpoint, options)
        consumer = buffer.__consumer
        ledgers = (consumer.filtering, consumer.mixing)
        reissue = rebuild(buffer.__store, buffer.__admission, consumer.eviction, ledgers, checkpoint, mode)
        if journaled is not None:
            buffer.__start_journal(journaled, payload_codec)
        return RestoreResult(buffer, reissue)

    @classmethod
    def recover(
        cls,
        journal: str | os.PathLike[str],
        *,
        global_steps: int | None = None,
        partition: str = "train",
        in_flight: InFlightMode = "reissue",
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = _UNSET,
        payload_codec: PayloadCodec | None = None,
        filters: Sequence[GroupFilter] = (),
        journal_interval: float = 1.0,
        journal_retention_steps: int = 4,
        journal_max_pending_bytes: int = _PENDING_BYTES,
    ) -> RestoreResult[ReplayBuffer]:
        """Rebuild the buffer a journal recorded, and journal on into the same file.

        ``global_steps=None``: the state at the journal's last commit. ``global_steps=g``: the
        state just after the last committed ``sample(g)`` on ``partition`` that returned a batch
        (the trainer's checkpoint step): what samples did after it is undone on every partition
        (their groups resident again, clocks and sampled/evicted counters as they were), what
        producers did after it is kept (listed in the result's ``kept``); an older group whose
        uid was added again after it is dropped (``dropped``; counted evicted as "restart").
        Then ``in_flight`` and the other arguments work as for :meth:`restore`. History after
        the point is void: a later recovery never replays it.

        Raises:
            CheckpointError: the file is not a stalebuf journal, is torn or foreign (left as it
                was), needs (or must not have) a payload codec, or holds no committed sample
                at ``global_steps`` (the message names the oldest and newest recoverable steps);
                the journal is then unchanged.
            ConfigError: an argument is invalid.
            OSError: the file cannot be read.
            Exception: whatever ``on_evict`` raised (under "evict"; the journal is unchanged).
        """
        options = check_journal_options(
            journal, journal_interval, journal_retention_steps, journal_max_pending_bytes
        )
        connection, recovery = open_recovery(journal, payload_codec, global_steps, partition)
        try:
            result = cls.restore(
                recovery.checkpoint,
                in_flight=in_flight,
                on_evict=on_evict,
                status_log_interval=status_log_interval,
                filters=filters,
            )
        except BaseException:
            connection.close()
            raise
        buffer = result.buffer
        buffer.__start_journal(options, payload_codec, (connection, recovery))  # type: ignore[arg-type]
        return RestoreResult(buffer, result.reissue, recovery.kept, recovery.dropped)

    async def flush(self, *, checkpoint_step: int | None = None) -> None:
        """Commit the journal now and wait until it is durable; with ``checkpoint_step=g``, also
        record that the trainer's state at step ``g`` is durable (:meth:`recover` at ``g`` is
        then always possible; see the docs' Durability page). Without a journal it returns at once.

        Raises:
            TypeError, ValueError: ``checkpoint_step`` is not None or an int >= 0.
            CheckpointError: the journal's writer stopped on an error (a disk error, a payload it
                could not encode), or the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
        """
        if checkpoint_step is not None:
            checks.check_step(checkpoint_step, "checkpoint_step")
        self.__store.binding.check_thread()
        journal = self.__journal
        if journal is not None:
            await journal.flush(checkpoint_step)

    def checkpoint(self) -> BufferCheckpoint:
        """Return the buffer's whole state as a frozen, picklable value; synchronous, so it is
        consistent with respect to every coroutine on the loop. It copies references only.

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
            CheckpointError: ``restore`` would not rebuild the buffer's policy with the same
                rules: it was built from another config than the buffer's, its state differs from
                ``Cls(config, **config.sampler_kwargs)`` (compared by its ``__eq__``, else attribute
                by attribute), building that raises, or its class is defined inside a function.
        """
        self.__store.binding.check_thread()
        consumer = self.__consumer
        return capture(self.__store, self.__admission, consumer.filtering, consumer.mixing)

    async def save(self, path: str | os.PathLike[str], *, payload_codec: PayloadCodec | None = None) -> None:
        """Take :meth:`checkpoint` at once, then write it to ``path`` in a worker thread,
        atomically (the previous file or the new one survives a crash, never a torn one).
        Overlapping saves to one file end with the state of the one called last that succeeded.

        Payloads are pickled unless ``payload_codec=(encode, decode)`` is given, in which case
        the file holds no pickle at all (see the trust model on the docs' Durability page).
        Under a journal, it also compacts the journal (commits, then truncates its log). It never
        replaces a journal (its own, or any stalebuf journal or database with a write-ahead log).

        Raises:
            CheckpointError: a value the format cannot hold (the message names it): a payload
                or config value pickle cannot hold, or with a codec a value JSON cannot hold;
                or ``encode`` failed; or :meth:`checkpoint` refused the policy; or ``path`` holds a
                journal, or is not a regular file (a FIFO, a device): left as it was.
            ConfigError: ``payload_codec`` is not None or a pair ``(encode, decode)`` of
                callables (as for :meth:`restore`); nothing is written.
            OSError: the file could not be written (PermissionError: ``path`` is read-only).
        """
        checks.check_payload_codec(payload_codec)
        checkpoint = self.checkpoint()
        if self.__journal is not None:  # a save compacts the journal too (not one that stopped)
            self.__journal.compact()
        await self.__saves.write(path, checkpoint, payload_codec)

    @property
    def config(self) -> SamplerConfig:
        """The sampler config this buffer was built with."""
        return self.__store.rules.config

    @property
    def policy(self) -> StalenessPolicy:
        """The rule book this buffer asks (without a subclass's hook overrides)."""
        return self.__store.rules.base

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self.__store.closed

    def threadsafe(self) -> ThreadsafeProducer:
        """Return a handle whose producer methods may be called from any thread.

        Call it on the event loop's thread, inside the running loop (asyncio or trio): it
        binds the buffer to that loop. Each handle method runs the buffer's method of that name
        on the loop and blocks its thread until it returned; wake-ups are immediate. As
        ``queue.Queue.put`` does, ``add_prompt`` and ``put_group`` block until admitted (with
        ``timeout=``: TimeoutError, nothing added), ``add_prompt_nowait`` and
        ``put_group_nowait`` raise BufferFullError instead, and ``wait_for_sampleable`` blocks
        as the buffer's does; ``mark_running``, ``put``, ``mark_finished`` and ``mark_failed``
        never wait (they run the ``*_nowait`` methods), nor do the flow-control queries
        (``dispatch_step``, and ``capacity``, ``free_slots`` and ``full`` with ``task``).

        Raises:
            WrongThreadError: no event loop runs in this thread, or the buffer is bound to
                the loop of another thread.
            BackendMismatchError: the buffer is bound to another async backend.
        """
        return ThreadsafeProducer.bound_to(self, self.__store.binding)

    def __contains__(self, uid: object) -> bool:
        """Whether a group with this uid is in the buffer (in flight or terminal).

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
        """
        self.__store.binding.check_thread()
        return type(uid) is str and uid in self.__store.groups

    # -- checks -----------------------------------------------------------------------

    def __check_usable(self) -> None:
        """Raise unless a producer may change the buffer now: on the right thread, and open.

        Producers inline the cheap test (closed, or bound to another thread) and call this
        only when it holds: the common case costs one ``get_ident()`` comparison.
        """
        self.__store.binding.check_thread()
        if self.__store.closed:
            raise BufferClosedError("the buffer is closed")

    def __check_producer(self) -> None:
        """:meth:`__check_usable`, and under a journal, that its writer is not too far behind
        (BufferFullError; the async producer calls wait for it first instead)."""
        self.__check_usable()
        if self.__journal is not None:
            self.__journal.check_room()

    def __sampled_nothing(self) -> None:
        """A sample that returned no batch (yet) may have moved the clock: journal it (and, under
        ``journal_interval=0``, the evictions it made, before it returns)."""
        journal = self.__journal
        if journal is not None:
            journal.log.touched()
            self.__settle()

    def __sampled_then_raised(self) -> None:
        """:meth:`__sampled_nothing` for a sample that raises (a hook, a timeout, a cancellation),
        never hiding its error: a stopped journal raises at the next flush or producer call."""
        with contextlib.suppress(CheckpointError):
            self.__sampled_nothing()

    def __settle(self) -> None:
        """Under ``journal_interval=0``: commit what the call changed before it returns."""
        if self.__sync_journal is not None:
            self.__sync_journal.settle()

    # -- producers --------------------------------------------------------------------

    def add_prompt_nowait(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new group ``uid`` as PENDING, tagged ``global_steps`` (its dispatch step;
        None: the partition's dispatch clock, :meth:`dispatch_step`, at this moment).

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: ``uid``, ``global_steps``, ``partition`` or ``tags`` is invalid.
            DuplicateGroupError: a group with this uid is in the buffer.
            BufferFullError: admission control has no slot for it now, or the journal's writer
                is more than ``journal_max_pending_bytes`` behind; nothing changed.
        """
        store = self.__store
        thread = store.binding.thread
        if store.closed or store.log is not None or (thread is not None and thread != get_ident()):
            self.__check_producer()
        # The hot path: each check is inlined, the slow helpers only build the error.
        if type(uid) is not str or not uid or "_" in uid or not uid.isascii():
            checks.check_uid(uid)  # raises, unless a non-ASCII uid UTF-8 can encode
        if global_steps is not None and (type(global_steps) is not int or not 0 <= global_steps < 1 << 63):
            checks.check_step(global_steps)
        part = store.partitions.get(partition) if type(partition) is str else None
        if part is None:
            checks.check_partition(partition)
        frozen_tags = EMPTY_TAGS if tags is None else checks.check_tags(tags)
        if uid in store.groups:
            raise DuplicateGroupError(f"a group with uid {checks.describe(uid)} is already in the buffer")
        if store.rules.tasks and (part is None or part.cells is not None):
            part = store.cell(partition, frozen_tags)  # its task's cell (ValueError: no task)
        if part is None or part.gated or global_steps is None:
            global_steps = self.__admission.tag_for(partition, part, global_steps)
        self.__writer.add_prompt(uid, global_steps, part or store.partition(partition), frozen_tags)
        self.__settle()

    def mark_running_nowait(self, uid: str, *, version: int | None = None) -> None:
        """Move group ``uid`` from PENDING to RUNNING; ``version``: the policy version its
        generation started at (its first token; None keeps the start version it has, its
        dispatch step unless set or restored).

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: ``uid`` is not a str, or ``version`` not an int >= 0.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is not PENDING.
            BufferFullError: the journal's writer is more than ``journal_max_pending_bytes``
                behind; nothing changed.
        """
        store = self.__store
        thread = store.binding.thread
        if store.closed or store.log is not None or (thread is not None and thread != get_ident()):
            self.__check_producer()
        if version is None:
            store.start(uid)
        else:  # the group's head may move: a parked sample may now return, or evict it in flight
            self.__consumer.notify(store.start(uid, check_start_version(version)))
        self.__settle()

    def put_nowait(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
        versions: Sequence[tuple[int, int]] | None = None,
        tokens: int | None = None,
    ) -> str:
        """Add one trajectory to the PENDING or RUNNING group ``uid``; return its key,
        ``f"{uid}_{session_id}_{index}"``.

        ``versions``: run-length ``(version, n_tokens)`` pairs in generation order, the policy
        version that generated each run of tokens; ``tokens``: its token count when
        ``versions`` is not given (its tokens then count at the group's start version; both
        given must agree).

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: ``session_id``/``index`` is not an int >= 0, ``tags`` is
                not a mapping, ``versions`` not a non-empty sequence of ``(int >= 0, int >= 1)``
                pairs, ``tokens`` not an int >= 0, or both given and disagreeing.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is terminal (a late write).
            DuplicateTrajectoryError: the group already holds this ``(session_id, index)``.
            BufferFullError: the journal's writer is more than ``journal_max_pending_bytes``
                behind; nothing changed.
        """
        store = self.__store
        thread = store.binding.thread
        if store.closed or store.log is not None or (thread is not None and thread != get_ident()):
            self.__check_producer()
        if type(session_id) is not int or not 0 <= session_id < 1 << 63:
            checks.check_index(session_id, "session_id")
        if type(index) is not int or not 0 <= index < 1 << 63:
            checks.check_index(index, "index")
        frozen = EMPTY_TAGS if tags is None else checks.check_tags(tags)
        if versions is None and tokens is None:
            key = store.put(uid, payload, session_id, index, frozen)
        else:
            key = store.put(uid, payload, session_id, index, frozen, *trajectory_versions(versions, tokens))
            # An older version moves the group's head: a parked sample may now evict it in flight.
            self.__consumer.notify(store.cell_of(store.groups[uid]))
        self.__settle()
        return key

    def mark_finished_nowait(self, uid: str) -> None:
        """Move group ``uid`` from PENDING or RUNNING to FINISHED; it becomes sampleable.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is already terminal.
            BufferFullError: the journal's writer is more than ``journal_max_pending_bytes``
                behind; nothing changed.
        """
        self.__end(uid, _FINISHED, "mark finished")

    def mark_failed_nowait(self, uid: str) -> None:
        """Move group ``uid`` from PENDING or RUNNING to FAILURE.

        Under ``failure_strategy="sample"`` (or in an exempt partition) it becomes
        sampleable; under "evict" the next ``sample`` of its partition evicts it.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError: ``uid`` is not a str.
            UnknownGroupError: no such group (never added, or already sampled or evicted).
            InvalidTransitionError: the group is already terminal.
            BufferFullError: the journal's writer is more than ``journal_max_pending_bytes``
                behind; nothing changed.
        """
        self.__end(uid, _FAILURE, "mark failed")

    def __end(self, uid: object, status: Status, action: str) -> None:
        """End the in-flight group ``uid`` with ``status`` (the two ``mark_*_nowait``)."""
        store = self.__store
        thread = store.binding.thread
        if store.closed or store.log is not None or (thread is not None and thread != get_ident()):
            self.__check_producer()
        group = store.groups.get(uid) if type(uid) is str else None
        if type(group) is not OpenGroup:  # the lookup inlined; open_group raises the right error
            group = store.open_group(uid, action)
        consumer, clock = self.__consumer, self.__admission.clocks.get(group.partition, 0)
        if status is _FINISHED and consumer.filters:
            try:
                consumer.finish(group, status, clock)  # the filters judge it first
            finally:  # (on_evict may raise after a filter evicted it: committed all the same)
                self.__settle()
            return
        part = store.end(group, status, clock)
        if part.ledger is not None:  # its token reservation settled: the refund may admit a producer
            self.__admission.refunded(part)
        consumer.notify(part)
        self.__settle()

    def put_group_nowait(
        self,
        uid: str,
        payloads: Collection[Any],
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None = None,
        session_ids: Sequence[int] | None = None,
        indices: Sequence[int] | None = None,
        status: GroupStatus = "finished",
        versions: Sequence[Sequence[tuple[int, int]] | None] | None = None,
        tokens: Sequence[int | None] | None = None,
        version: int | None = None,
        generation_seconds: float | None = None,
    ) -> list[str]:
        """Add (if absent), fill and finish or fail a whole group in one call; return its keys.

        Does what ``add_prompt`` + one ``put`` per payload + ``mark_finished`` (or
        ``mark_failed``) would, all or nothing: everything is checked before anything changes.
        Trajectory ``i`` gets ``session_ids[i]`` (default ``i``), ``indices[i]`` (default 0)
        and ``trajectory_tags[i]``. If the group is already in flight, it must have the same
        ``global_steps`` and ``partition``, the payloads are added to what it holds, and
        ``tags`` is ignored (group tags are set when a group is added); ``global_steps=None``
        means the group's own step, or the dispatch clock for a new group. ``status`` is
        ``Status.FINISHED`` or ``Status.FAILURE`` or their values ("failed" also works).
        ``versions[i]`` and ``tokens[i]`` are trajectory ``i``'s, as for :meth:`put_nowait`
        (None entries allowed); ``version`` is the group's start version, as for
        :meth:`mark_running_nowait` (without it, a new group starts at its dispatch step).

        ``generation_seconds`` is the producer's measure of how long the group took to generate
        (a finite number >= 0): the group's ``generation_seconds`` and what the
        ``sampled_generation_seconds/mean`` metric averages. Without it the buffer measures
        from the group's admission to this call: the real time for a group already in flight
        (``add_prompt`` earlier), 0.0 for a group this call adds. Deadlines always use the
        buffer's own measure.

        Raises:
            BufferClosedError: the buffer is closed.
            WrongThreadError: called from another thread than the bound loop's.
            TypeError, ValueError: an argument is invalid, ``payloads`` is not a collection, a
                per-trajectory collection has another length than ``payloads``, ``status``
                is not a terminal status, or ``generation_seconds`` is not None or a finite
                number >= 0.
            InvalidTransitionError: the group is already terminal (a late write).
            DuplicateGroupError: the group is in flight with another step or partition.
            DuplicateTrajectoryError: two payloads, or a payload and the group, share a key.
            BufferFullError: the group is new and admission control has no slot for it now, or
                the journal's writer is more than ``journal_max_pending_bytes`` behind.
        """
        store = self.__store
        thread = store.binding.thread
        if store.closed or store.log is not None or (thread is not None and thread != get_ident()):
            self.__check_producer()
        part = store.partitions.get(partition) if type(partition) is str else None
        if (  # the common case gets a path of its own: a new, finished group of default keys
            part is not None
            and part.cells is None
            and trajectory_tags is None
            and session_ids is None
            and indices is None
            and (type(payloads) is list or type(payloads) is tuple)
            and (status is _FINISHED or (type(status) is str and status == "finished"))
            and versions is None
            and tokens is None
            and (global_steps is None or (type(global_steps) is int and 0 <= global_steps < 1 << 63))
            and type(uid) is str
            and uid
            and "_" not in uid
            and uid.isascii()  # else check_uid's UTF-8 test, on the general path
            and uid not in store.groups
            and uid not in store.evicted_in_flight  # put_group raises GroupEvictedError for those
        ):
            try:
                return self.__writer.put_new_finished(
                    part, uid, payloads, global_steps, tags, version, generation_seconds
                )
            finally:  # (on_evict may raise after a filter evicted it: committed all the same)
                self.__settle()
        try:
            return self.__writer.put(
                uid,
                payloads,
                global_steps,
                partition,
                tags,
                trajectory_tags,
                session_ids,
                indices,
                status,
                versioning=(versions, tokens, version),
                generation_seconds=generation_seconds,
            )
        finally:
            self.__settle()

    async def add_prompt(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new PENDING group; like :meth:`add_prompt_nowait`, but under admission
        control it waits (FIFO per partition, cancellable) for a slot instead of raising
        BufferFullError; with ``global_steps=None`` the group is tagged when it is admitted.

        Raises:
            The errors of :meth:`add_prompt_nowait` except BufferFullError, which it raises only
                for an explicit ``global_steps`` whose tag is closed for good (stale at the next
                ``sample``: no slot there can ever open), at once or when a sample closes it.
            BufferClosedError: the buffer was closed while it waited.
        """
        if self.__journal is not None:
            await self.__journal.wait_room()
        try:
            self.add_prompt_nowait(uid, global_steps=global_steps, partition=partition, tags=tags)
            return
        except (TagClosedError, FutureTagError):
            raise  # no slot there can ever open: waiting would be forever
        except BufferFullError:
            pass
        store = self.__store

        frozen_tags = EMPTY_TAGS if tags is None else checks.check_tags(tags)
        cell = store.cell(partition, frozen_tags)

        def admit(tag: int) -> None:
            self.__check_usable()
            if uid in store.groups:
                raise DuplicateGroupError(f"a group with uid {checks.describe(uid)} is already in the buffer")
            self.__writer.add_prompt(uid, tag, cell, frozen_tags)
            self.__settle()

        await self.__admission.wait_for_slot(cell, global_steps, admit)

    async def mark_running(self, uid: str, *, version: int | None = None) -> None:
        """Mark a group RUNNING; the async twin of :meth:`mark_running_nowait` (same errors, but
        under a journal it waits for the writer instead of raising BufferFullError)."""
        if self.__journal is not None:
            await self.__journal.wait_room()
        self.mark_running_nowait(uid, version=version)

    async def put(
        self,
        uid: str,
        payload: Any = None,
        *,
        session_id: int = 0,
        index: int = 0,
        tags: Mapping[str, Any] | None = None,
        versions: Sequence[tuple[int, int]] | None = None,
        tokens: int | None = None,
    ) -> str:
        """Add one trajectory and return its key; the async twin of :meth:`put_nowait` (same
        errors, but under a journal it waits for the writer instead of raising BufferFullError)."""
        if self.__journal is not None:
            await self.__journal.wait_room()
        if versions is None and tokens is None:  # fewer keywords to pass: this runs per trajectory
            return self.put_nowait(uid, payload, session_id=session_id, index=index, tags=tags)
        return self.put_nowait(
            uid, payload, session_id=session_id, index=index, tags=tags, versions=versions, tokens=tokens
        )

    async def mark_finished(self, uid: str) -> None:
        """Mark a group FINISHED; the async twin of :meth:`mark_finished_nowait` (same errors,
        but under a journal it waits for the writer instead of raising BufferFullError)."""
        if self.__journal is not None:
            await self.__journal.wait_room()
        self.mark_finished_nowait(uid)

    async def mark_failed(self, uid: str) -> None:
        """Mark a group FAILURE; the async twin of :meth:`mark_failed_nowait` (same errors,
        but under a journal it waits for the writer instead of raising BufferFullError)."""
        if self.__journal is not None:
            await self.__journal.wait_room()
        self.mark_failed_nowait(uid)

    async def put_group(
        self,
        uid: str,
        payloads: Collection[Any],
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        trajectory_tags: Sequence[Mapping[str, Any] | None] | None = None,
        session_ids: Sequence[int] | None = None,
        indices: Sequence[int] | None = None,
        status: GroupStatus = "finished",
        versions: Sequence[Sequence[tuple[int, int]] | None] | None = None,
        tokens: Sequence[int | None] | None = None,
        version: int | None = None,
        generation_seconds: float | None = None,
    ) -> list[str]:
        """Add (if absent), fill and end a whole group; like :meth:`put_group_nowait`, but a
        group that must be added waits under admission control (FIFO, cancellable) for a slot
        instead of raising BufferFullError. A group already in the buffer never waits.

        Raises:
            The errors of :meth:`put_group_nowait` except BufferFullError, which it raises only
                for an explicit ``global_steps`` whose tag is closed for good (stale at the next
                ``sample``: no slot there can ever open), at once or when a sample closes it.
            BufferClosedError: the buffer was closed while it waited.
        """
        if self.__journal is not None:
            await self.__journal.wait_room()
        try:
            return self.put_group_nowait(
                uid,
                payloads,
                global_steps=global_steps,
                partition=partition,
                tags=tags,
                trajectory_tags=trajectory_tags,
                session_ids=session_ids,
                indices=indices,
                status=status,
                versions=versions,
                tokens=tokens,
                version=version,
                generation_seconds=generation_seconds,
            )
        except (TagClosedError, FutureTagError):
            raise  # no slot there can ever open: waiting would be forever
        except BufferFullError:
            pass
        need = (writer := self.__writer).tokens_needed(len(payloads), versions, tokens)  # token caps

        def admit(tag: int) -> list[str]:
            self.__check_usable()
            try:
                return writer.put(
                    uid,
                    payloads,
                    global_steps,
                    partition,
                    tags,
                    trajectory_tags,
                    session_ids,
                    indices,
                    status,
                    tag,
                    (versions, tokens, version),
                    generation_seconds,
                )
            finally:  # (on_evict may raise after a filter evicted it: committed all the same)
                self.__settle()

        cell = self.__store.cell(partition, EMPTY_TAGS if tags is None else checks.check_tags(tags))
        return await self.__admission.wait_for_slot(cell, global_steps, admit, need)

    def rollout(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        version: int | None = None,
    ) -> AbstractAsyncContextManager[RolloutGroup]:
        """Return an ``async with`` block that generates one group: the recommended producer.

        Entering waits for admission (like :meth:`add_prompt`), then the group is PENDING and
        marked RUNNING; ``group.put(...)`` adds trajectories. When the body returns the group
        is FINISHED; when it raises, FAILED, and the error propagates. If the group is evicted
        while the body runs (in-flight eviction, or ``close()``), the body is cancelled, the
        block exits without raising and ``group.evicted`` is True. Works under asyncio and trio.
        ``version`` is the group's start version, given to :meth:`mark_running`.

        Raises:
            The errors of :meth:`add_prompt` (on entering), and of :meth:`mark_running` for a
                bad ``version`` (checked before waiting).
        """
        if version is not None:
            version = check_start_version(version)
        return rollout(self, uid, global_steps=global_steps, partition=partition, tags=tags, version=version)

    def watch(self, uid: str, callback: Callable[[], object]) -> GroupWatch:
        """Watch the in-flight group ``uid``: ``callback()`` runs once if that group is evicted
        while in flight or the buffer closes (inside the ``sample`` or ``close`` that does it:
        it must not raise). Returns a handle to that very group, for :meth:`end_watched`.

        For integrations that run producers elsewhere (``rollout()`` and ``stalebuf.ray`` use it).

        Raises:
            UnknownGroupError, InvalidTransitionError: as a write to ``uid`` raises them.
            WrongThreadError, BufferClosedError: as for the producer calls.
        """
        self.__check_usable()
        return GroupWatch(self.__store.watch(uid, callback))

    def end_watched(self, watch: GroupWatch, *, finished: bool) -> bool:
        """Finish (or fail) the group ``watch`` was taken on if that very group is still in
        flight; return whether it did. A group that ended, was evicted, or whose uid another
        group reuses now is left alone: a producer ends only what it started.

        Raises:
            TypeError: ``watch`` is not a GroupWatch.
            WrongThreadError: called from another thread than the bound loop's.
        """
        if not isinstance(watch, GroupWatch):
            raise TypeError(f"watch must be a GroupWatch, got {type(watch).__name__}")
        self.__store.binding.check_thread()
        try:
            return self.__writer.end_watched(watch.group, finished)
        finally:  # (on_evict may raise after a filter evicted it: committed all the same)
            self.__settle()

    def put_back(self, group: Group) -> bool:
        """Put a sampled ``group`` back, as it was (uid, partition, dispatch step, tags, status,
        generation time and trajectories), without a new admission (its slot was granted when it was first
        admitted); return False, changing nothing, if its uid is in use or the buffer closed.

        For a consumer that took a batch it cannot use (``stalebuf.ray`` puts back the batch
        of a cancelled remote ``sample``). It is counted as admitted again.

        Raises:
            TypeError: ``group`` is not a Group record.
            WrongThreadError: called from another thread than the bound loop's.
            The errors of :meth:`put_group_nowait` for values it would refuse.
        """
        self.__store.binding.check_thread()
        put = self.__writer.put_back(group)
        self.__settle()
        return put

    # -- admission --------------------------------------------------------------------

    def dispatch_step(self, partition: str = "train") -> int:
        """Return the step a group dispatched now is tagged with: the largest ``global_steps``
        any ``sample`` on ``partition`` has been called with (0 before the first).

        It reads one int, so unlike every other call it may be made from any thread (the
        example server's ``def`` handlers do).

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str.
        """
        checks.check_partition(partition)
        return self.__admission.clocks.get(partition, 0)

    def capacity(self, partition: str = "train", task: str | None = None) -> int | None:
        """Return the bound on ``partition``'s resident groups under admission control,
        ``T * S * admission_batch_size`` (under a task mixture: of ``task``, ``T_task * S *
        q_task(b)``, or summed over the tasks); None without admission or for an exempt partition.

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str, or ``task`` not a task
                of the partition's mixture.
            WrongThreadError: called from another thread than the bound loop's.
        """
        self.__store.binding.check_thread()
        self.__check_task(partition, task)
        return self.__admission.capacity(self.__store.partitions.get(partition), partition, task)

    def free_slots(self, partition: str = "train", task: str | None = None) -> int | None:
        """Return how many groups ``add_prompt`` would admit now at the clock's step without
        waiting (of ``task`` under a mixture, or summed over its tasks); None without admission
        control or for an exempt partition.

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str, or ``task`` not a task
                of the partition's mixture.
            WrongThreadError: called from another thread than the bound loop's.
            Exception: whatever the policy's ``admits`` raised.
        """
        self.__store.binding.check_thread()
        self.__check_task(partition, task)
        return self.__admission.free_slots(self.__store.partitions.get(partition), partition, task)

    def full(self, partition: str = "train", task: str | None = None) -> bool:
        """Return whether no group could be admitted now: ``free_slots(partition, task) == 0``,
        or under a mixture with ``task=None``, whether every task is full; under token caps, also
        whether ``free_tokens(partition) < max_tokens_per_group`` (never True without either).

        Raises:
            The errors of :meth:`free_slots`.
        """
        if task is None and self.__store.rules.tasks:
            self.__check_task(partition, None)
            if not self.__store.rules.policy.is_exempt(partition):
                return all(self.free_slots(partition, one) == 0 for one in self.__store.rules.tasks)
        if self.free_slots(partition, task) == 0:
            return True
        return self.__admission.tokens.full(self.__store.partitions.get(partition), partition)

    def free_tokens(self, partition: str = "train") -> int | None:
        """Return how many tokens a group could take at the clock's step now: the smaller of the
        room under ``admission_token_budget`` there and under ``max_resident_tokens`` (0 at a
        closed step); None without either, or for an exempt partition.

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str.
            WrongThreadError: called from another thread than the bound loop's.
            Exception: whatever the policy's ``is_stale`` raised.
        """
        self.__store.binding.check_thread()
        checks.check_partition(partition)
        return self.__admission.tokens.free_tokens(self.__store.partitions.get(partition), partition)

    def capacity_tokens(self, partition: str = "train") -> int | None:
        """Return the bound on ``partition``'s resident tokens, reservations included:
        ``T * S * admission_token_budget``, or ``max_resident_tokens`` if smaller; None without
        either, or for an exempt partition.

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str.
            WrongThreadError: called from another thread than the bound loop's.
        """
        self.__store.binding.check_thread()
        checks.check_partition(partition)
        return self.__admission.tokens.capacity_tokens(self.__store.partitions.get(partition), partition)

    def __check_task(self, partition: str, task: object) -> None:
        """Check ``partition`` and a ``task`` argument (None, or a task of its mixture).

        Raises:
            TypeError, ValueError: as said (an exempt partition has no tasks).
        """
        checks.check_partition(partition)
        if task is None:
            return
        rules = self.__store.rules
        if type(task) is not str:
            raise TypeError(f"task must be a str or None, got {type(task).__name__}")
        if task not in rules.tasks or rules.policy.is_exempt(partition):
            tasks = checks.describe(list(rules.tasks)) if rules.tasks else "none, no mixture"
            raise ValueError(
                f"task {checks.describe(task)} is not a task of partition {checks.describe(partition)}'s "
                f"mixture (tasks: {tasks})"
            )

    # -- consumer ---------------------------------------------------------------------

    def sample_nowait(
        self,
        global_steps: int,
        batch_size: int | None = None,
        *,
        token_budget: int | None = None,
        partition: str = "train",
    ) -> tuple[Batch, dict[str, float]]:
        """Remove and return a batch (``batch_size`` whole groups, or the groups of up to
        ``token_budget`` tokens), oldest first, if one may be returned now; the non-waiting core
        of :meth:`sample` (same rules and metrics).

        It first evicts what the config says to evict, reporting it to ``on_evict``. While a
        ``sample`` on the partition waits, it takes nothing (calls are served in order).

        Raises:
            BatchNotReadyError: no batch may be returned now; only evictions happened.
            TypeError, ValueError: an argument is invalid (see :meth:`sample`).
            ConfigError: a token budget with a policy that overrides ``select``, or on a
                partition with a task mixture; nothing changed.
            BufferClosedError: the buffer is or gets closed.
            WrongThreadError: called from another thread than the bound loop's.
            StalebufError: the policy's ``select`` returned an invalid choice; nothing changed.
            Exception: whatever a policy hook or ``on_evict`` raised, with the buffer consistent.
        """
        part = self.__check_sample(global_steps, batch_size, partition, token_budget)
        metrics = SampleMetrics()
        if token_budget is not None:  # by tokens: at least one group, as many as the budget holds
            metrics.token_budget, batch_size = token_budget, 1
        try:
            result = self.__consumer.sample_now(part, partition, global_steps, batch_size, metrics)  # type: ignore[arg-type]
        except BaseException:  # (a hook raised after evictions: journal them, as for no batch)
            self.__sampled_then_raised()
            raise
        if result is not None:
            return result
        self.__sampled_nothing()
        wanted = batch_size if token_budget is None else f"{token_budget} tokens"
        where = checks.describe(partition)
        raise BatchNotReadyError(f"no batch of {wanted} may be returned from partition {where} now")

    async def sample(
        self,
        global_steps: int,
        batch_size: int | None = None,
        *,
        token_budget: int | None = None,
        partition: str = "train",
        timeout: float | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """Wait for, remove and return exactly ``batch_size`` whole groups (or by tokens), oldest first.

        Before selecting, evicts what the config says to evict (stale groups under "drop",
        failed groups under ``failure_strategy="evict"``), reporting them to ``on_evict``.
        Returns once ``batch_size`` groups are sampleable and, under "wait", no in-flight
        group of the partition has staleness >= threshold. Calls on one partition are served
        in arrival order: while an earlier call on the partition waits, a new call neither
        evicts nor takes anything and queues behind it. Otherwise it evaluates once before
        waiting, so ``timeout=0`` means "check once, don't wait".

        With ``token_budget=K`` instead, once the gate is open and the sampleable groups hold
        ``K`` tokens, it takes the longest oldest-first prefix within ``K`` (a first group alone
        over ``K`` comes alone); see the docs' Token budgets page.

        Returns:
            The batch and its metrics (the docs' Trainers page lists every metric name).

        Raises:
            TypeError, ValueError: ``global_steps`` is not an int >= 0, not exactly one of
                ``batch_size`` and ``token_budget`` is given, an int >= 1 (both below 2**63),
                ``partition`` is not a non-empty str, or ``timeout`` not None or a number >= 0.
            ConfigError: a token budget with an overridden ``select`` (or ``_select``), or on a
                partition with a task mixture; nothing changed.
            ValueError: a count batch under ``admission_token_budget`` (or a token budget below
                it), or a token budget under ``admission_batch_size``; nothing changed.
            TimeoutError: ``timeout`` seconds passed first; no sampleable group was removed.
            BufferClosedError: the buffer is or gets closed.
            WrongThreadError: called from another thread than the bound loop's.
            BackendMismatchError: it may wait (``timeout != 0``) and runs under another async
                backend than the one the buffer is bound to; nothing changed.
            Exception: whatever a policy hook or ``on_evict`` raised, with the buffer consistent.
        """
        if timeout is not None:
            timeout = checks.check_timeout(timeout)
        if timeout != 0:
            # A call that may wait needs the bound backend: refuse another one before anything
            # changes. (One with timeout=0 never touches the backend, so any caller may check.)
            self.__store.binding.check_backend()
        part = self.__check_sample(global_steps, batch_size, partition, token_budget)
        if part is None and timeout != 0:  # it may wait, and waiters queue on their partition
            part = self.__store.partition(partition)
        consumer, metrics = self.__consumer, SampleMetrics()
        if token_budget is not None:  # by tokens: at least one group, as many as the budget holds
            metrics.token_budget, batch_size = token_budget, 1
        try:
            result = consumer.sample_now(part, partition, global_steps, batch_size, metrics)  # type: ignore[arg-type]
        except BaseException:  # (a hook raised after evictions: journal them, as for no batch)
            self.__sampled_then_raised()
            raise
        if result is not None:
            return result
        self.__sampled_nothing()
        if timeout == 0:
            wanted = batch_size if token_budget is None else f"{token_budget} tokens"
            raise TimeoutError(f"no batch of {wanted} ready in partition {checks.describe(partition)}")
        assert part is not None  # created above for a call that may wait
        try:
            groups, waited = await consumer.wait_for_batch(part, global_steps, batch_size, timeout, metrics)  # type: ignore[arg-type]
        except BaseException:  # timed out, cancelled or raised: what it cut or evicted meanwhile
            self.__sampled_then_raised()
            raise
        return consumer.result(part, global_steps, groups, metrics, waited)

    def __check_sample(
        self, global_steps: object, batch_size: object, partition: object, token_budget: object = None
    ) -> Any:
        """Validate a sample's arguments; return its partition (None if it does not exist yet)."""
        # Inlined fast checks; the helpers run (and raise) only when a value looks wrong.
        if type(global_steps) is not int or not 0 <= global_steps < 1 << 63:
            checks.check_step(global_steps)
        if token_budget is not None or type(batch_size) is not int or not 1 <= batch_size < 1 << 63:
            checks.check_batch_request(batch_size, token_budget)
        store = self.__store
        part = store.partitions.get(partition) if type(partition) is str else None
        if part is None:
            checks.check_partition(partition)
        thread = store.binding.thread
        if store.closed or (thread is not None and thread != get_ident()):
            self.__check_usable()
        rules = store.rules
        if token_budget is not None:
            self.__consumer.token_batches.check(part, partition)  # type: ignore[arg-type]
        elif rules.tasks:
            rules.check_batch_quotas(partition, batch_size, part)  # type: ignore[arg-type]
        if token_budget is not None or rules.config.admission_token_budget is not None:
            exempt = part.exempt if part is not None else rules.policy.is_exempt(partition)  # type: ignore[arg-type]
            check_sample_budget(rules.config, batch_size, token_budget, exempt=exempt)  # type: ignore[arg-type]
        return part

    def sampleable_count(self, global_steps: int, partition: str = "train", task: str | None = None) -> int:
        """Return how many groups ``sample`` could select from right now (of ``task`` only,
        under a mixture); changes nothing.

        Counts ready groups after the drop and failure rules at ``global_steps``; ignores the
        wait gate, the batch size and the quotas.

        Raises:
            TypeError, ValueError: ``global_steps`` is not an int >= 0, ``partition`` is not
                a non-empty str, or ``task`` not a task of its mixture.
            WrongThreadError: called from another thread than the bound loop's.
            Exception: whatever the policy's ``is_stale`` raised.
        """
        self.__store.binding.check_thread()
        checks.check_step(global_steps)
        self.__check_task(partition, task)
        return self.__consumer.sampleable.fresh(partition, global_steps, task)

    async def wait_for_sampleable(
        self, global_steps: int, count: int, *, partition: str = "train", timeout: float | None = None
    ) -> int:
        """Wait until at least ``count`` groups are sampleable at ``global_steps``; return how
        many are. It takes nothing and never delays or reorders a ``sample``.

        "Sampleable" is what :meth:`sampleable_count` counts (verl's ``get_sampleable_count``):
        ready groups the drop and failure rules keep at ``global_steps``, as after the drop
        eviction a ``sample`` would run (this evicts nothing); under a task mixture, every
        task's. The wait gate, the batch size and the quotas do not count, so under
        ``max_off_policy_strategy="wait"`` a ``sample`` of ``count`` groups may still wait for
        older groups in flight. Event-driven (it wakes when a group becomes sampleable, never
        polls) and cancellable; ``timeout=0`` checks once. A ``sample`` may take the groups
        before the woken call runs: it then waits on.

        Raises:
            TypeError, ValueError: ``global_steps`` is not an int >= 0, ``count`` not an int
                >= 1 (both below 2**63; bools refused), ``partition`` not a non-empty str, or
                ``timeout`` not None or a number >= 0; nothing changed.
            TimeoutError: ``timeout`` seconds passed first.
            BufferClosedError: the buffer is or gets closed.
            WrongThreadError: called from another thread than the bound loop's.
            BackendMismatchError: it may wait (``timeout != 0``) and runs under another async
                backend than the one the buffer is bound to.
            Exception: whatever the policy's ``is_stale`` raised.
        """
        return await self.__consumer.sampleable.wait(global_steps, count, partition, timeout)

    def explain_wait(self, partition: str = "train") -> WaitExplanation:
        """Return why the ``sample`` calls parked on ``partition`` wait (the first of them: they
        are served in order), as a frozen :class:`~stalebuf.WaitExplanation`; changes nothing.

        Its ``reason`` is the sentence the periodic status line of a waiting ``sample`` ends with.

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str.
            WrongThreadError: called from another thread than the bound loop's.
            Exception: whatever a policy hook raised.
        """
        return self.__consumer.explainer.explain(partition)

    def observe_samples(self, observer: SampleObserver) -> Callable[[], None]:
        """Call ``observer(batch, metrics)`` with every batch a ``sample`` (or ``sample_nowait``)
        returns, before it is returned; return a function that stops it (idempotent).

        The Prometheus collector feeds its histograms this way. An observer that raises is
        logged; the batch is returned all the same.

        Raises:
            TypeError: ``observer`` is not callable.
            WrongThreadError: called from another thread than the bound loop's.
        """
        if not callable(observer):
            raise TypeError(f"observer must be callable, got {checks.describe_typed(observer)}")
        self.__store.binding.check_thread()
        return self.__consumer.subscribe(observer)

    def stats(self) -> BufferStats:
        """Return an immutable snapshot of per-partition and total counts (works after close).

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
        """
        self.__store.binding.check_thread()
        stats = self.__consumer.stats()
        if self.__journal is None:
            return stats
        commits, size, pending, lag = self.__journal.stats()
        return attrs.evolve(
            stats,
            journal_commits=commits,
            journal_bytes=size,
            journal_pending_bytes=pending,
            journal_lag_seconds=lag,
        )

    # -- closing ----------------------------------------------------------------------

    def close(self) -> None:
        """Close the buffer: blocked and later ``sample`` calls and producers raise
        BufferClosedError. Groups already present stay (visible in ``stats()``). Idempotent.

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
        """
        self.__store.binding.check_thread()
        self.__close_parts()
        if self.__journal is not None:  # the final commit (blocking: aclose waits in a thread)
            self.__journal.close()

    def __close_parts(self) -> None:
        store = self.__store
        if store.closed:
            return
        store.close()
        self.__consumer.close()
        self.__admission.close()

    async def aclose(self) -> None:
        """Close the buffer (see :meth:`close`), its journal's final commit awaited in a worker
        thread, and yield once to the scheduler. Cancelled while it waits for that commit, the
        buffer and its journal are closed at once (the writer thread finishes the commit).

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
            CheckpointError: the journal's final commit failed (closed all the same).
        """
        self.__store.binding.check_thread()
        self.__close_parts()
        if self.__journal is not None:
            await self.__journal.aclose()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self: _Self) -> _Self:
        """Return the buffer; ``async with`` closes it on exit."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the buffer."""
        await self.aclose()

    # -- hooks for verl-style subclasses (see stalebuf.policy for the cost model) ------

    def _is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        """Whether a terminal group is dropped; defaults to ``policy.is_stale``. Must be monotone."""
        return self.__store.rules.base.is_stale(global_steps, dispatch_step, partition)

    def _must_wait_for(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        """Whether an in-flight group blocks the sample; defaults to ``policy.must_wait_for``."""
        return self.__store.rules.base.must_wait_for(global_steps, dispatch_step, partition)

    def _select(
        self, candidates: Iterator[Group], batch_size: int, global_steps: int, partition: str
    ) -> Sequence[Group]:
        """Choose the batch from ``candidates`` (oldest first, lazily); defaults to
        ``policy.select``, which takes the first ``batch_size`` in O(batch_size); any other
        choice costs O(N)."""
        return self.__store.rules.base.select(candidates, batch_size, global_steps, partition)
