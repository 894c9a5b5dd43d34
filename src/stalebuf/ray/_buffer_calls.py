"""The ReplayBuffer side of :class:`~stalebuf.ray.RemoteReplayBuffer`: each method the local buffer
also has, as a call through the client's connection to its actor.

:class:`BufferCalls` owns the client's ``ActorConnection`` (its constructor is the one place it is
set) and holds the methods that mirror ReplayBuffer's, documented as members of
RemoteReplayBuffer, which inherits them: the producer calls (their arguments copied as the local
buffer copies them, then sent as protocol records), ``rollout``, ``sample``, the queries and flow
control, ``save``, ``flush`` and ``aclose`` (the operations the producer calls send are built in
``_ops``). What only a remote buffer has (starting, attaching and
restoring, the actor's identity, ``info``, ``kill``, ``evictions``, pickling) is
RemoteReplayBuffer's own, in ``_client``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, cast

from .._checkpoint_file import PayloadCodec
from .._status_log import logger
from .._validation import check_step
from .._versions import check_start_version
from ..buffer import GroupStatus
from ..records import Batch
from ..stats import BufferStats, WaitExplanation
from ._connection import ActorConnection
from ._ops import add_prompt_op, plain_tags, put_group_op
from ._protocol import MarkFailed, MarkFinished, MarkRunning, put_op
from ._rollout import RemoteRolloutGroup, rollout

__all__ = ["BufferCalls"]


class BufferCalls:
    """The methods a :class:`~stalebuf.ray.RemoteReplayBuffer` shares with ReplayBuffer, each a call
    through the client's connection to its actor (see the module's docstring).

    Args:
        connection: the connection every call goes through (set here and nowhere else).
    """

    def __init__(self, connection: ActorConnection) -> None:
        self._connection = connection
        # This client's sample observers (observe_samples); each client object has its own.
        self._observers: list[Callable[[Batch, Mapping[str, float]], object]] = []

    # -- producers --------------------------------------------------------------------

    async def add_prompt(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new PENDING group, as :meth:`ReplayBuffer.add_prompt`: under admission control
        it waits in the actor (FIFO per partition) for a slot, and ``global_steps=None`` tags the
        group with the actor's dispatch clock when it is admitted.

        Cancelling it while it waits adds nothing; a group the actor admitted before the
        cancellation reached it stays, as for any producer call cancelled after it was sent.

        Raises:
            The same errors as ReplayBuffer.add_prompt; BufferUnavailableError when the actor
            is gone.
        """
        connection = self._connection
        await connection.admit(add_prompt_op(connection.new_token(), uid, global_steps, partition, tags))

    async def add_prompt_nowait(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        """Admit a new PENDING group, as :meth:`ReplayBuffer.add_prompt_nowait`: a coroutine here
        (it asks the actor), but it never waits for admission.

        Raises:
            BufferFullError: admission control has no slot for it now; nothing changed.
            The other errors of ReplayBuffer.add_prompt_nowait; BufferUnavailableError.
        """
        await self._connection.submit(add_prompt_op(None, uid, global_steps, partition, tags))

    async def mark_running(self, uid: str, *, version: int | None = None) -> None:
        """Move a group from PENDING to RUNNING, as :meth:`ReplayBuffer.mark_running`;
        ``version``: the policy version its generation started at.

        Raises:
            The same errors as ReplayBuffer.mark_running (a bad ``version`` before the actor is
            asked); BufferUnavailableError.
        """
        checked = None if version is None else check_start_version(version)
        await self._connection.submit(MarkRunning(uid, checked))

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
        """Add one trajectory and return its key, as :meth:`ReplayBuffer.put` (``versions``:
        the run-length ``(version, n_tokens)`` pairs that generated it; ``tokens``: its count).

        The payload is stored as the client's ``payloads`` mode says (by default in the object
        store, owned by this process); the buffer keeps a reference.

        Raises:
            The same errors as ReplayBuffer.put (bad ``versions`` or ``tokens`` before the actor
            is asked); BufferUnavailableError.
        """
        op = put_op(uid, payload, session_id, index, tags, versions, tokens)
        result: str = await self._connection.submit(op)
        return result

    async def mark_finished(self, uid: str) -> None:
        """Mark a group FINISHED, as :meth:`ReplayBuffer.mark_finished`.

        Raises:
            The same errors as ReplayBuffer.mark_finished; BufferUnavailableError.
        """
        await self._connection.submit(MarkFinished(uid))

    async def mark_failed(self, uid: str) -> None:
        """Mark a group FAILURE, as :meth:`ReplayBuffer.mark_failed`.

        Raises:
            The same errors as ReplayBuffer.mark_failed; BufferUnavailableError.
        """
        await self._connection.submit(MarkFailed(uid))

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
        """Add (if absent), fill and finish or fail a whole group in one round trip; return its
        keys, as :meth:`ReplayBuffer.put_group` (all or nothing, in the actor). A new group waits
        in the actor for admission like :meth:`add_prompt`. Pass ``generation_seconds`` (as locally):
        without it a group written in one call measures 0.0.

        Raises:
            The same errors as ReplayBuffer.put_group; BufferUnavailableError.
        """
        connection = self._connection
        op = put_group_op(
            connection.new_token(),
            uid,
            payloads,
            global_steps,
            partition,
            tags,
            trajectory_tags,
            session_ids,
            indices,
            status,
            (versions, tokens, version),
            generation_seconds,
        )
        result: list[str] = await connection.admit(op)
        return result

    async def put_group_nowait(
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
        """Add (if absent), fill and end a whole group in one round trip, as
        :meth:`ReplayBuffer.put_group_nowait`: a coroutine here, but it never waits for admission.

        Raises:
            BufferFullError: the group is new and admission control has no slot for it now.
            The other errors of ReplayBuffer.put_group_nowait; BufferUnavailableError.
        """
        op = put_group_op(
            None,
            uid,
            payloads,
            global_steps,
            partition,
            tags,
            trajectory_tags,
            session_ids,
            indices,
            status,
            (versions, tokens, version),
            generation_seconds,
        )
        result: list[str] = await self._connection.submit(op)
        return result

    def rollout(
        self,
        uid: str,
        *,
        global_steps: int | None = None,
        partition: str = "train",
        tags: Mapping[str, Any] | None = None,
        version: int | None = None,
    ) -> AbstractAsyncContextManager[RemoteRolloutGroup]:
        """Return an ``async with`` block that generates one group, as :meth:`ReplayBuffer.rollout`.

        Entering waits in the actor for admission, then the group is PENDING and marked RUNNING;
        ``await group.put(...)`` adds trajectories (there is no ``put_nowait`` remotely). When
        the body returns the group is FINISHED; when it raises, FAILED, and the error propagates.
        If the group is evicted while the body runs (in-flight eviction, or ``aclose()``), the
        actor answers a call the block parked there and the body is cancelled: the block exits
        without raising and ``group.evicted`` is True (also when the body's write was refused
        with GroupEvictedError or BufferClosedError first). A block cancelled from outside
        fails its group (the actor is told without waiting). Each entered block holds one slot
        of the actor's ``watch`` concurrency group.

        ``version`` is the group's start version, given to ``mark_running`` in the actor.

        Raises:
            The errors of :meth:`add_prompt` (on entering), and of :meth:`mark_running` for a
                bad ``version`` (checked before the actor is asked).
        """
        checked = None if version is None else check_start_version(version)
        return rollout(self._connection, uid, global_steps, partition, plain_tags(tags), checked)

    # -- consumer ---------------------------------------------------------------------

    async def sample(
        self,
        global_steps: int,
        batch_size: int | None = None,
        *,
        token_budget: int | None = None,
        partition: str = "train",
        timeout: float | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """Wait for, remove and return a batch of whole groups (``batch_size`` of them, or those
        of up to ``token_budget`` tokens), as :meth:`ReplayBuffer.sample`.

        Payloads in the batch are PayloadRefs (or ObjectRefs given by producers, or values in
        "inline" mode); ``await stalebuf.ray.resolve(batch)`` fetches them. ``timeout`` is
        applied in the actor, so a TimeoutError guarantees no group was taken; before the
        actor has answered for the first time, it also bounds the wait for the actor to start
        (by at least 1 s: a live actor needs a round trip to say so). Cancelling is safe: the
        actor is told to cancel this very call, and if it had already taken a batch that never
        reached this client, it puts the groups back, exactly once (re-admitted, so counted
        once more in ``admitted_*``; a group whose uid was reused meanwhile, or any group once
        the buffer is closed, cannot go back and is logged by the actor).

        Raises:
            The same errors as ReplayBuffer.sample (TypeError and ValueError for bad arguments
            are raised by the client, before it contacts the actor); BufferUnavailableError when
            the actor is gone (also while waiting) or did not start within ``start_timeout``.
        """
        result = await self._connection.sample(global_steps, batch_size, partition, timeout, token_budget)
        for observer in self._observers:
            try:
                observer(*result)
            except Exception:
                logger.exception("a sample observer raised; the batch is returned all the same")
        return result

    def observe_samples(self, observer: Callable[[Batch, Mapping[str, float]], object]) -> Callable[[], None]:
        """Call ``observer(batch, metrics)`` with every batch a ``sample`` through this client
        returns, before it is returned; return a function that stops it (idempotent). As
        :meth:`ReplayBuffer.observe_samples`, but only this client's calls are observed.

        Raises:
            TypeError: ``observer`` is not callable.
        """
        if not callable(observer):
            raise TypeError(f"observer must be callable, got {type(observer).__name__}")
        observers = self._observers
        observers.append(observer)

        def stop() -> None:
            if observer in observers:
                observers.remove(observer)

        return stop

    async def wait_for_sampleable(
        self, global_steps: int, count: int, *, partition: str = "train", timeout: float | None = None
    ) -> int:
        """Wait until at least ``count`` groups are sampleable; return how many, as
        :meth:`ReplayBuffer.wait_for_sampleable` (it takes nothing). It waits in the actor's default
        concurrency group, as ``sample`` does; cancelling it cancels it there; ``timeout`` is applied
        in the actor and bounds the wait for a starting actor as for :meth:`sample`.

        Raises:
            The errors of ReplayBuffer.wait_for_sampleable (bad arguments raised by the client);
            BufferUnavailableError when the actor is gone or did not start within ``start_timeout``.
        """
        return await self._connection.wait_for_sampleable(global_steps, count, partition, timeout)

    async def explain_wait(self, partition: str = "train") -> WaitExplanation:
        """Return why the ``sample`` calls parked on ``partition`` in the actor wait, as
        :meth:`ReplayBuffer.explain_wait` (a coroutine here: it asks the actor).

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str; BufferUnavailableError.
        """
        return cast(WaitExplanation, await self._connection.call("flow", "explain_wait", partition))

    async def sampleable_count(
        self, global_steps: int, partition: str = "train", task: str | None = None
    ) -> int:
        """Return how many groups ``sample`` could select right now (of ``task`` only, under a
        mixture), as :meth:`ReplayBuffer.sampleable_count` (a coroutine here: it asks the actor).

        Raises:
            TypeError, ValueError: as ReplayBuffer.sampleable_count; BufferUnavailableError.
        """
        return cast(int, await self._connection.call("sampleable_count", global_steps, partition, task))

    # -- queries and flow control -----------------------------------------------------

    async def stats(self) -> BufferStats:
        """Return the buffer's :class:`~stalebuf.BufferStats`, as :meth:`ReplayBuffer.stats`
        (a coroutine here: it asks the actor).

        Raises:
            BufferUnavailableError: the actor is gone.
        """
        result: BufferStats = await self._connection.call("stats")
        return result

    async def dispatch_step(self, partition: str = "train") -> int:
        """Return the actor's dispatch clock for ``partition``, as :meth:`ReplayBuffer.dispatch_step`
        (a coroutine here: it asks the actor).

        Raises:
            TypeError, ValueError: ``partition`` is not a non-empty str; BufferUnavailableError.
        """
        result: int = await self._connection.call("flow", "dispatch_step", partition)
        return result

    async def capacity(self, partition: str = "train", task: str | None = None) -> int | None:
        """Return the bound on ``partition``'s resident groups (of ``task``, or summed over the tasks
        of a mixture), as :meth:`ReplayBuffer.capacity` (a coroutine here).

        Raises:
            TypeError, ValueError: a bad ``partition`` or ``task``; BufferUnavailableError.
        """
        return cast("int | None", await self._connection.call("flow", "capacity", partition, task))

    async def free_slots(self, partition: str = "train", task: str | None = None) -> int | None:
        """Return how many groups ``add_prompt`` would admit now without waiting (of ``task``, or all
        tasks), as :meth:`ReplayBuffer.free_slots` (a coroutine here; may be stale on arrival).

        Raises:
            TypeError, ValueError: a bad ``partition`` or ``task``; BufferUnavailableError.
        """
        return cast("int | None", await self._connection.call("flow", "free_slots", partition, task))

    async def full(self, partition: str = "train", task: str | None = None) -> bool:
        """Return whether ``free_slots(partition, task) == 0``, as :meth:`ReplayBuffer.full` (awaited).

        Raises:
            TypeError, ValueError: as :meth:`free_slots`; BufferUnavailableError.
        """
        return cast(bool, await self._connection.call("flow", "full", partition, task))

    async def free_tokens(self, partition: str = "train") -> int | None:
        """Return the tokens a group could take at the clock's step now, as
        :meth:`ReplayBuffer.free_tokens` (a coroutine here; may be stale on arrival). A flow query
        like ``free_slots``.

        Raises:
            TypeError, ValueError: a bad ``partition``; BufferUnavailableError.
        """
        return cast("int | None", await self._connection.call("flow", "free_tokens", partition))

    async def capacity_tokens(self, partition: str = "train") -> int | None:
        """Return the bound on ``partition``'s resident tokens, as :meth:`ReplayBuffer.capacity_tokens`
        (a coroutine here).

        Raises:
            TypeError, ValueError: a bad ``partition``; BufferUnavailableError.
        """
        return cast("int | None", await self._connection.call("flow", "capacity_tokens", partition))

    # -- checkpoint and closing -------------------------------------------------------

    async def save(self, path: str | os.PathLike[str], *, payload_codec: PayloadCodec | None = None) -> None:
        """Checkpoint the hosted buffer at once and write it to ``path``, as :meth:`ReplayBuffer.save`,
        from the actor: ``path`` is on the actor's node (a relative one is made absolute here,
        against the caller's working directory, as a local ``save`` would read it).

        Payloads held as object references (PayloadRefs, ObjectRefs) are fetched into the actor
        and stored by value: while it saves, the actor holds every resident payload in memory at
        once (numpy arrays on its node as zero-copy views, other objects as copies), on top of
        the buffer. ``payload_codec`` travels to the actor (it must pickle with cloudpickle).

        Raises:
            CheckpointError: a payload object is lost (e.g. its producer died), or with a codec a
                value JSON cannot hold; nothing is written.
            OSError: the file could not be written; BufferUnavailableError.
        """
        target = os.path.abspath(os.fspath(path))  # noqa: ASYNC240 - one getcwd(), no file I/O
        await self._connection.call("save", target, payload_codec)

    async def flush(self, *, checkpoint_step: int | None = None) -> None:
        """Commit the actor's journal now and wait until it is durable, as :meth:`ReplayBuffer.flush`
        (with ``checkpoint_step=g``, also record that the trainer's state at step ``g`` is durable);
        without a journal it returns once the actor answered.

        Raises:
            TypeError, ValueError: ``checkpoint_step`` is not None or an int >= 0 (raised here).
            CheckpointError: the journal's writer stopped on an error, or the buffer is closed;
                BufferUnavailableError.
        """
        if checkpoint_step is not None:
            check_step(checkpoint_step, "checkpoint_step")
        await self._connection.call("flush", checkpoint_step)

    async def aclose(self) -> None:
        """Close the hosted buffer, as :meth:`ReplayBuffer.aclose` (for every client: parked and
        later ``sample`` calls and producers raise BufferClosedError; ``stats`` still works).
        The actor keeps running; :meth:`kill` ends it. Idempotent.

        Raises:
            BufferUnavailableError: the actor is gone.
        """
        await self._connection.call("close")
