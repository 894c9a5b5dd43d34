"""The replay buffer: producers move groups through their lifecycle, the trainer samples.

Everything that changes state is synchronous (the ``*_nowait`` methods and the evaluation
inside ``sample``), so on one event loop each call is atomic. ``sample`` is the only call
that waits: validate, try :meth:`ReplayBuffer.sample_nowait`'s path, park on a per-call
signal, re-check. The rules live in :mod:`stalebuf.policy`, the indexes in ``_index.py`` and
``_partition.py``, the waiting in ``_waiting.py`` and ``_status_log.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from types import MappingProxyType, TracebackType
from typing import Any, TypeVar

import anyio.lowlevel

from ._checkpoint_file import PayloadCodec
from ._core import EvictCallback
from ._custom_sampler import build_from_config
from ._producers import GroupStatus, Producers
from ._rollout import RolloutGroup, rollout
from ._save_order import SaveSequencer
from ._threadsafe import ThreadsafeProducer
from ._validation import (
    check_partition,
    check_payload_codec,
    check_step,
    check_timeout,
    describe,
)
from .checkpoint import NOT_GIVEN, BufferCheckpoint, InFlightMode, RestoreResult, capture, restore_buffer
from .config import SamplerConfig
from .errors import BatchNotReadyError, ConfigError, WrongThreadError
from .metrics import SampleMetrics
from .policy import StalenessPolicy
from .records import Batch
from .stats import BufferStats, PartitionStats

__all__ = ["GroupStatus", "ReplayBuffer"]

_Self = TypeVar("_Self", bound="ReplayBuffer")
_UNSET: Any = NOT_GIVEN  # an argument not given (restore_buffer knows it too)


class ReplayBuffer(Producers):
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
        status_log_interval: a ``sample`` blocked this many seconds logs one INFO line on
            the "stalebuf" logger, and again every interval after; None disables it.

    Raises:
        ConfigError: ``config`` is not a SamplerConfig or names a ``custom_sampler`` (build
            that with :meth:`from_config`), ``policy`` is not a StalenessPolicy, ``on_evict``
            is not a plain callable, or ``status_log_interval`` is not None or a number >= 0.001.
    """

    def __init__(
        self,
        config: SamplerConfig | None = None,
        *,
        policy: StalenessPolicy | None = None,
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = 60.0,
    ) -> None:
        if (
            policy is None
            and type(self) is ReplayBuffer
            and isinstance(config, SamplerConfig)
            and config.custom_sampler is not None
        ):
            raise ConfigError(
                f"config names custom_sampler {describe(config.custom_sampler)}: build the buffer with "
                "ReplayBuffer.from_config(config), which loads it"
            )
        super().__init__(config, policy, on_evict, status_log_interval)
        self._saves = SaveSequencer()  # orders overlapping saves (see save)

    @classmethod
    def from_config(
        cls,
        config: SamplerConfig | Mapping[str, Any],
        *,
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = _UNSET,
    ) -> ReplayBuffer:
        """Build a buffer from a config or verl-style mapping, honouring ``custom_sampler``.

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
        return build_from_config(cls, ReplayBuffer, config, options)

    @classmethod
    def restore(
        cls,
        source: BufferCheckpoint | str | os.PathLike[str],
        *,
        in_flight: InFlightMode = "reissue",
        on_evict: EvictCallback | None = None,
        status_log_interval: float | None = _UNSET,
        payload_codec: PayloadCodec | None = None,
    ) -> RestoreResult:
        """Build a buffer from a checkpoint (or a file :meth:`save` wrote); synchronous.

        The class built is what :meth:`from_config` builds from the saved config (``cls``
        unless it names a custom sampler). Its ``stats()`` equal the checkpointed buffer's
        (waiting callers are not saved), apart from what ``in_flight`` does with groups that
        were PENDING or RUNNING: "reissue" keeps them PENDING at their place in the order, with
        their trajectories discarded (counted in ``reissued_*``) and lists them in the result's
        ``reissue``; "keep" keeps them exactly; "evict" evicts them (reason "restart", one
        event per partition to ``on_evict``, counted in ``evicted_restart_*``).
        ``status_log_interval`` is passed to the built class only when given (its default is
        the class's own: 60 s for ``ReplayBuffer``), as :meth:`from_config` does.

        Raises:
            CheckpointError: the file is truncated, corrupt, foreign or newer, or needs (or must
                not have) a payload codec; or the checkpoint cannot be rebuilt. Nothing is built.
            ConfigError: ``in_flight``, ``on_evict`` or ``status_log_interval`` is invalid.
            OSError: the file cannot be read.
            Exception: whatever ``on_evict`` raised (under "evict").
        """
        return restore_buffer(cls, source, in_flight, on_evict, status_log_interval, payload_codec)

    def checkpoint(self) -> BufferCheckpoint:
        """Return the buffer's whole state as a frozen, picklable value; synchronous, so it is
        consistent with respect to every coroutine on the loop. It copies references only.

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
            CheckpointError: the buffer's policy was built from another config than the buffer's
                (``restore`` rebuilds it from the buffer's, so its rules would change).
        """
        self._binding.check_thread()
        return capture(self)

    async def save(self, path: str | os.PathLike[str], *, payload_codec: PayloadCodec | None = None) -> None:
        """Take :meth:`checkpoint` at once, then write it to ``path`` in a worker thread,
        atomically (the previous file or the new one survives a crash, never a torn one).
        Overlapping saves to one file end with the state of the one called last that succeeded.

        Payloads are pickled unless ``payload_codec=(encode, decode)`` is given, in which case
        the file holds no pickle at all (see the README's trust model).

        Raises:
            CheckpointError: a value the format cannot hold (the message names it): a payload
                or config value pickle cannot hold, or with a codec a value JSON cannot hold;
                or ``encode`` failed.
            ConfigError: ``payload_codec`` is not None or a pair ``(encode, decode)`` of
                callables (as for :meth:`restore`); nothing is written.
            OSError: the file could not be written (PermissionError: ``path`` is read-only).
        """
        check_payload_codec(payload_codec)
        checkpoint = self.checkpoint()
        await self._saves.write(path, checkpoint, payload_codec)

    @property
    def config(self) -> SamplerConfig:
        """The sampler config this buffer was built with."""
        return self._config

    @property
    def policy(self) -> StalenessPolicy:
        """The rule book this buffer asks (without a subclass's hook overrides)."""
        return self._policy

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def threadsafe(self) -> ThreadsafeProducer:
        """Return a handle whose producer methods may be called from any thread.

        Call it on the event loop's thread, inside the running loop (asyncio or trio): it
        binds the buffer to that loop. Each handle method (``add_prompt``, ``mark_running``,
        ``put``, ``mark_finished``, ``mark_failed``, ``put_group``) runs the ``*_nowait``
        method of that name on the loop and blocks its thread until it ran; wake-ups are
        immediate.

        Raises:
            WrongThreadError: no event loop runs in this thread, or the buffer is bound to
                the loop of another thread.
            BackendMismatchError: the buffer is bound to another async backend.
        """
        binding = self._binding
        binding.check_thread()
        binding.check_backend()
        try:
            token = anyio.lowlevel.current_token()
        except RuntimeError as exc:  # no async backend runs here (sniffio could not tell)
            raise WrongThreadError(
                "threadsafe() must be called inside the buffer's running event loop"
            ) from exc
        binding.bind()
        return ThreadsafeProducer(self, token.native_token, binding.loop_running)

    def __contains__(self, uid: object) -> bool:
        """Whether a group with this uid is in the buffer (in flight or terminal).

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
        """
        self._binding.check_thread()
        return type(uid) is str and uid in self._groups

    # -- consumer ---------------------------------------------------------------------

    def sample_nowait(
        self, global_steps: int, batch_size: int, *, partition: str = "train"
    ) -> tuple[Batch, dict[str, float]]:
        """Remove and return ``batch_size`` whole groups, oldest first, if a batch may be
        returned now; the non-waiting core of :meth:`sample` (same rules and metrics).

        It first evicts what the config says to evict, reporting it to ``on_evict``. While a
        ``sample`` on the partition waits, it takes nothing (calls are served in order).

        Raises:
            BatchNotReadyError: no batch may be returned now; only evictions happened.
            TypeError, ValueError: an argument is invalid (see :meth:`sample`).
            BufferClosedError: the buffer is or gets closed.
            WrongThreadError: called from another thread than the bound loop's.
            StalebufError: the policy's ``select`` returned an invalid choice; nothing changed.
            Exception: whatever a policy hook or ``on_evict`` raised, with the buffer consistent.
        """
        part = self._check_sample(global_steps, batch_size, partition)
        if part is not None and not part.has_live_waiter():
            metrics = SampleMetrics()
            groups = self._evaluate(part, global_steps, batch_size, metrics)
            # The clock moves once the call went through: a hook that raised changed nothing.
            self._advance_clock(partition, global_steps)
            if groups is not None:
                return self._result(part, global_steps, groups, metrics, 0.0)
        self._advance_clock(partition, global_steps)
        raise BatchNotReadyError(
            f"no batch of {batch_size} may be returned from partition {describe(partition)} now"
        )

    async def sample(
        self,
        global_steps: int,
        batch_size: int,
        *,
        partition: str = "train",
        timeout: float | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """Wait for, remove and return exactly ``batch_size`` whole groups, oldest first.

        Before selecting, evicts what the config says to evict (stale groups under "drop",
        failed groups under ``failure_strategy="evict"``), reporting them to ``on_evict``.
        Returns once ``batch_size`` groups are sampleable and, under "wait", no in-flight
        group of the partition has staleness >= threshold. Calls on one partition are served
        in arrival order: while an earlier call on the partition waits, a new call neither
        evicts nor takes anything and queues behind it. Otherwise it evaluates once before
        waiting, so ``timeout=0`` means "check once, don't wait".

        Returns:
            The batch and its metrics (see the README for the metric names).

        Raises:
            TypeError, ValueError: ``global_steps`` is not an int >= 0, ``batch_size`` not an
                int >= 1 (both below 2**63), ``partition`` not a non-empty str, or ``timeout``
                not None or a number >= 0.
            TimeoutError: ``timeout`` seconds passed first; no sampleable group was removed.
            BufferClosedError: the buffer is or gets closed.
            WrongThreadError: called from another thread than the bound loop's.
            BackendMismatchError: it may wait (``timeout != 0``) and runs under another async
                backend than the one the buffer is bound to; nothing changed.
            Exception: whatever a policy hook or ``on_evict`` raised, with the buffer consistent.
        """
        if timeout is not None:
            timeout = check_timeout(timeout)
        binding = self._binding
        if timeout != 0:
            # A call that may wait needs the bound backend: refuse another one before anything
            # changes. (One with timeout=0 never touches the backend, so any caller may check.)
            binding.check_backend()
        part = self._check_sample(global_steps, batch_size, partition)
        if part is None and timeout != 0:  # it may wait, and waiters queue on their partition
            part = self._partition(partition)
        metrics = SampleMetrics()
        if part is not None and (not part.waiters or not part.has_live_waiter()):
            groups = self._evaluate(part, global_steps, batch_size, metrics)
            self._advance_clock(partition, global_steps)  # once the call went through (not if a hook raised)
            if groups is not None:
                return self._result(part, global_steps, groups, metrics, 0.0)
        else:
            self._advance_clock(partition, global_steps)
        if timeout == 0:
            raise TimeoutError(f"no batch of {batch_size} ready in partition {describe(partition)}")
        assert part is not None  # created above for a call that may wait
        groups, waited = await self._wait_for_batch(part, global_steps, batch_size, timeout, metrics)
        return self._result(part, global_steps, groups, metrics, waited)

    def rollout(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> AbstractAsyncContextManager[RolloutGroup]:
        """Return an ``async with`` block that generates one group: the recommended producer.

        Entering waits for admission (like :meth:`add_prompt`), then the group is PENDING and
        marked RUNNING; ``group.put(...)`` adds trajectories. When the body returns the group
        is FINISHED; when it raises, FAILED, and the error propagates. If the group is evicted
        while the body runs (in-flight eviction, or ``close()``), the body is cancelled, the
        block exits without raising and ``group.evicted`` is True. Works under asyncio and trio.

        Raises:
            The errors of :meth:`add_prompt` (on entering).
        """
        return rollout(self, uid, global_steps=global_steps, partition=partition, tags=tags)

    def sampleable_count(self, global_steps: int, partition: str = "train") -> int:
        """Return how many groups ``sample`` could select from right now; changes nothing.

        Counts ready groups after the drop and failure rules at ``global_steps``; ignores the
        wait gate and the batch size.

        Raises:
            TypeError, ValueError: ``global_steps`` is not an int >= 0 or ``partition`` is not
                a non-empty str.
            WrongThreadError: called from another thread than the bound loop's.
            Exception: whatever the policy's ``is_stale`` raised.
        """
        self._binding.check_thread()
        check_step(global_steps)
        check_partition(partition)
        part = self._partitions.get(partition)
        if part is None:
            return 0
        rules = self._rules
        if not rules.drops or part.exempt:
            return part.ready.count
        name = part.name
        return part.ready.count_fresh(lambda step: rules.is_stale(global_steps, step, name))

    def stats(self) -> BufferStats:
        """Return an immutable snapshot of per-partition and total counts (works after close).

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
        """
        self._binding.check_thread()
        for part in self._partitions.values():
            part.drop_abandoned(everywhere=True)
        partitions = {
            name: part.stats(self._capacity(part, name)) for name, part in sorted(self._partitions.items())
        }
        total = PartitionStats()
        for item in partitions.values():
            total = total + item
        return BufferStats(closed=self._closed, partitions=MappingProxyType(partitions), total=total)

    # -- closing ----------------------------------------------------------------------

    def close(self) -> None:
        """Close the buffer: blocked and later ``sample`` calls and producers raise
        BufferClosedError. Groups already present stay (visible in ``stats()``). Idempotent.

        Raises:
            WrongThreadError: called from another thread than the bound loop's.
        """
        self._binding.check_thread()
        if self._closed:
            return
        self._closed = True
        for part in self._partitions.values():
            part.drop_abandoned(everywhere=True)
            for waiter in (*part.waiters, *part.producers):
                waiter.wake()
        for group in list(self._groups.values()):
            watchers = getattr(group, "watchers", None)  # in-flight groups only
            if watchers:
                for watcher in watchers:
                    watcher()

    async def aclose(self) -> None:
        """Close the buffer (see :meth:`close`) and yield once to the scheduler."""
        self.close()
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
