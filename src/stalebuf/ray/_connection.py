"""One client's link to the buffer actor: starting or attaching, and every kind of call.

:class:`~stalebuf.ray.RemoteReplayBuffer` is the API; this is its transport. Control calls go
straight to the actor, producer operations through the per-loop pipeline, and ``sample``
under a request id that makes cancelling it exact (see ``_ledger``). Every call first waits,
boundedly, for an actor that has not answered yet (see ``_start``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, cast

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from .._validation import (
    check_batch_request,
    check_count,
    check_partition,
    check_step,
    check_timeout,
    describe,
)
from ..checkpoint import NOT_GIVEN
from ..config import SamplerConfig
from ..errors import BufferUnavailableError, ConfigError
from ..records import Batch, Group
from ._actor import actor_class
from ._errors import running_loop, translate
from ._options import (
    check_options,
    check_payload_mode,
    check_remote_filters,
    check_start_timeout,
    ray_actor_options,
    requested_resources,
)
from ._pipeline import ProducerPipeline
from ._protocol import (
    JournalRequest,
    Op,
    Parked,
    RecoverRequest,
    RestoreRequest,
    SampleRequest,
    WaitingOp,
    encode,
)
from ._start import MIN_SAMPLE_START_WAIT, StartGate, blocking_seconds

__all__ = ["ActorConnection", "connect_actor", "start_actor"]

logger = logging.getLogger("stalebuf.ray")


class ActorConnection:
    """The actor handle and what one client (in one process) keeps about it.

    Args:
        handle: the actor handle.
        name, namespace: as given at creation or connection.
        payloads: the payload mode.
        start_timeout: seconds from now the actor has to answer its first call.
        resources: what the actor asked Ray for (to name a missing one), if known.
    """

    def __init__(
        self,
        handle: Any,
        name: str | None,
        namespace: str | None,
        payloads: str,
        start_timeout: float,
        resources: Mapping[str, float] | None,
    ) -> None:
        self.handle = handle
        self.name = name
        self.namespace = namespace
        self.payloads = payloads
        self.start_timeout = start_timeout
        self.resources = dict(resources or {})
        self.gate = StartGate(handle, start_timeout, resources, self.where)
        self._pipe: ProducerPipeline | None = None
        # Unique per client (and per unpickled copy), so that cancelling by request id is exact.
        self._client_id = uuid.uuid4().hex[:16]
        self._request_ids = itertools.count()

    def new_token(self) -> str:
        """Return an id no other call of any client uses (for sample requests and parked operations)."""
        return f"{self._client_id}:{next(self._request_ids)}"

    def restored(self) -> tuple[tuple[Group, ...], tuple[Group, ...], tuple[Group, ...]]:
        """Block until a restoring (or recovering) actor has built its buffer; return the groups to
        reissue, and the groups a recovery kept and dropped.

        Raises:
            What the restore raised in the actor (CheckpointError, OSError, ...), the actor
            being ended first; BufferUnavailableError: it did not start within ``start_timeout``.
        """
        error: BaseException
        try:
            self.gate.wait_blocking()
            restored: tuple[tuple[Group, ...], tuple[Group, ...], tuple[Group, ...]] = ray.get(
                self.handle.restored.remote(), timeout=blocking_seconds(self.start_timeout)
            )
            return restored
        except (RayActorError, RayTaskError) as exc:
            error = translate(exc, self.where())
        except GetTimeoutError:
            error = self.gate.unavailable()
        except BaseException:
            ray.kill(self.handle, no_restart=True)
            raise
        ray.kill(self.handle, no_restart=True)  # nothing is built
        raise error

    def pickled(self) -> tuple[Any, ...]:
        """The constructor arguments a copy in another process starts from."""
        return (self.handle, self.name, self.namespace, self.payloads, self.start_timeout, self.resources)

    def where(self) -> str:
        """Describe the actor for messages: its name, else its id."""
        if self.name is not None:
            return repr(self.name)
        actor_id = getattr(self.handle, "_actor_id", None)
        return f"id={actor_id.hex()[:12]}" if actor_id is not None else "(anonymous)"

    async def call(self, method: str, *args: Any) -> Any:
        """Call an actor method (not a producer operation) and return its translated result."""
        running_loop()
        await self.gate.wait()
        try:
            return await getattr(self.handle, method).remote(*args)
        except (RayActorError, RayTaskError) as exc:
            error = translate(exc, self.where())
        raise error  # outside the except block: no "during handling" context

    async def submit(self, op: Op) -> Any:
        """Apply a producer operation in the actor (combined with concurrent ones); return its
        result or raise its error."""
        loop = running_loop()
        pipe = self._pipe
        if pipe is None or pipe.loop is not loop:
            pipe = self._pipe = ProducerPipeline(loop, self.handle, self.payloads, self.gate, self.where)
        return await pipe.submit(op)

    async def admit(self, op: WaitingOp) -> Any:
        """Apply an operation that may wait for admission, and return its result.

        It travels with the other producer operations; when the actor finds no slot for it, it
        parks it under its token, and this waits for it with ``await_admission`` (in the actor's
        ``admission`` concurrency group). Cancelling this tells the actor to abandon the token
        (see ``_admission``).
        """
        assert op.token is not None
        try:
            result = await self.submit(op)
            if type(result) is Parked:
                result = await self.call("await_admission", result.token)
        except asyncio.CancelledError:
            self.abandon(op.token)
            raise
        return result

    def abandon(self, token: str) -> None:
        """Tell the actor, without waiting, that the call under ``token`` was cancelled."""
        _tell(self.handle.abandon, token)

    async def sample(
        self,
        global_steps: int,
        batch_size: int | None,
        partition: str,
        timeout: float | None,
        token_budget: int | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """Run ``sample`` in the actor under a fresh request id, and acknowledge what arrives.

        When the awaiting task is cancelled, the actor is told to cancel the request: it then
        takes nothing, or puts back what it took (see ``_ledger``).
        """
        running_loop()
        # Checked here, in the local buffer's order, so that bad arguments raise its errors at once
        # even when the actor is gone or has not started (the actor checks them again).
        if timeout is not None:
            timeout = check_timeout(timeout)
        check_step(global_steps)
        check_batch_request(batch_size, token_budget)
        check_partition(partition)
        if not self.gate.started:
            timeout = await self._wait_to_sample(timeout)
        request_id = self.new_token()
        handle = self.handle
        ref = handle.sample.remote(
            encode(SampleRequest(request_id, global_steps, batch_size, partition, timeout, token_budget))
        )
        try:
            result: tuple[Batch, dict[str, float]] = await ref
        except asyncio.CancelledError:
            _tell(handle.cancel_sample, request_id)
            raise
        except (RayActorError, RayTaskError) as exc:
            error = translate(exc, self.where())
        else:
            _tell(handle.acknowledge_sample, request_id)
            return result
        raise error  # outside the except block: no "during handling" context

    async def wait_for_sampleable(
        self, global_steps: int, count: int, partition: str, timeout: float | None
    ) -> int:
        """Run ``wait_for_sampleable`` in the actor; when the awaiting task is cancelled, cancel
        the actor's call too (``ray.cancel``: it takes nothing, so there is nothing to put back)."""
        running_loop()
        # Checked here, in the local buffer's order, as for sample (the actor checks them again).
        timeout = check_timeout(timeout)
        check_step(global_steps)
        check_count(count)
        check_partition(partition)
        if not self.gate.started:
            timeout = await self._wait_to_sample(timeout)
        ref = self.handle.wait_for_sampleable.remote(global_steps, count, partition, timeout)
        try:
            result: int = await ref
        except asyncio.CancelledError:
            _cancel(ref)
            raise
        except (RayActorError, RayTaskError) as exc:
            error = translate(exc, self.where())
        else:
            return result
        raise error  # outside the except block: no "during handling" context

    async def _wait_to_sample(self, limit: float | None) -> float | None:
        """Wait for a not-yet-answering actor within ``limit`` seconds; return what is left of it."""
        started = time.monotonic()
        await self.gate.wait(None if limit is None else max(limit, MIN_SAMPLE_START_WAIT))
        return None if limit is None else max(0.0, limit - (time.monotonic() - started))


def _tell(method: Any, request_id: str) -> None:
    """Send a one-way message about a request (its outcome is not awaited)."""
    try:
        method.remote(request_id)
    except Exception:  # Ray is shutting down: the actor goes away with whatever it holds
        logger.debug("could not send %s(%r)", method, request_id, exc_info=True)


def _cancel(ref: Any) -> None:
    """Cancel the actor call behind ``ref`` without waiting (its coroutine is cancelled there)."""
    try:
        ray.cancel(ref)
    except Exception:  # already done, or Ray is shutting down: nothing is left to cancel
        logger.debug("could not cancel %s", ref, exc_info=True)


def connect_actor(
    name: str, namespace: str | None, payloads: object, start_timeout: object
) -> ActorConnection:
    """Return a connection to the live actor called ``name``, once it answered a ping (blocking).

    Raises:
        ConfigError: ``name`` is not a str, ``namespace`` not None or a str, or ``payloads`` or
            ``start_timeout`` is invalid.
        BufferUnavailableError: no actor has that name, it is dead, or it did not answer within
            ``start_timeout`` seconds.
    """
    if type(name) is not str:
        raise ConfigError(f"name must be a str, got {describe(name)}")
    if namespace is not None and type(namespace) is not str:
        raise ConfigError(f"namespace must be None or a str, got {describe(namespace)}")
    check_payload_mode(payloads)
    timeout = check_start_timeout(start_timeout)
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError as exc:
        where = "" if namespace is None else f" in namespace {describe(namespace)}"
        raise BufferUnavailableError(
            f"no buffer actor named {describe(name)}{where}: none was started under that name there, "
            "or it died"
        ) from exc  # (Ray's own message repeats the whole name)
    connection = ActorConnection(handle, name, namespace, cast(str, payloads), timeout, None)
    connection.gate.wait_blocking()
    return connection


def start_actor(
    config: SamplerConfig | None,
    use_factory: bool,
    *,
    on_evict: object,
    status_log_interval: float | None,
    name: str | None,
    namespace: str | None,
    get_if_exists: bool,
    actor_options: Mapping[str, Any] | None,
    payloads: str,
    eviction_queue_size: int,
    keep_evicted_payloads: bool,
    start_timeout: float,
    restore: RestoreRequest | RecoverRequest | None = None,
    filters: object = (),
    journal: JournalRequest | None = None,
) -> ActorConnection:
    """Check the options, start the actor (without waiting for it) and return the connection;
    with ``restore``, the actor restores its buffer from that checkpoint file (or recovers it from
    ``journal`` at that point); ``filters`` (checked here, picklable) run in the actor; with
    ``journal`` (checked by the caller), its buffer journals into that file.

    Raises:
        ConfigError: an invalid option (``filters`` not plain callables that pickle), or Ray
            refused the actor (e.g. its name is taken).
    """
    check_options(
        status_log_interval=status_log_interval,
        payloads=payloads,
        eviction_queue_size=eviction_queue_size,
        keep_evicted_payloads=keep_evicted_payloads,
        on_evict=on_evict,
        name=name,
        namespace=namespace,
        actor_options=actor_options,
        start_timeout=start_timeout,
    )
    checked = check_remote_filters(filters)
    # Across the process boundary "not given" (the built class's own default, which a custom
    # sampler's constructor need not take) travels as an empty tuple.
    interval = () if status_log_interval is NOT_GIVEN else (status_log_interval,)
    options = ray_actor_options(name, namespace, get_if_exists, actor_options)
    groups = (actor_options or {}).get("concurrency_groups") or {}
    if not isinstance(groups, Mapping):
        raise ConfigError(
            f"actor_options['concurrency_groups'] must be a mapping, got {type(groups).__name__}"
        )
    arguments = (config, use_factory, interval, eviction_queue_size, keep_evicted_payloads)
    try:
        handle = actor_class(groups).options(**options).remote(*arguments, restore, checked, journal)
    except (TypeError, ValueError) as exc:  # bad options, or the name is taken
        raise ConfigError(f"cannot start the buffer actor: {exc}") from exc
    connection = ActorConnection(
        handle, name, namespace, payloads, float(start_timeout), requested_resources(options)
    )
    connection.gate.ping()  # the actor's answer is on its way while the caller goes on
    return connection
