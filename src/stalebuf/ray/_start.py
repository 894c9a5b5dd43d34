"""Waiting for the buffer actor to answer: a bounded ping, and why an actor did not start.

Ray creates an actor asynchronously, and a call to an actor that can never be scheduled (a
resource no node has) waits forever. So before its first call a client waits for the actor's
``ping`` for at most ``start_timeout`` seconds after it was created (or attached), then raises
BufferUnavailableError naming the likely reason. Once the actor has answered, calls go straight
through.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import ray
from ray.exceptions import RayActorError

from .._validation import describe
from ..errors import BufferUnavailableError
from ._errors import translate
from ._protocol import PROTOCOL_VERSION, ProtocolError

__all__ = ["MIN_SAMPLE_START_WAIT", "StartGate", "blocking_seconds"]

#: A ``sample(timeout=t)`` waits at least this long (seconds) for an actor that has not
#: answered yet, even for a smaller ``t``: a live actor needs a round trip to say so.
MIN_SAMPLE_START_WAIT = 1.0


def blocking_seconds(seconds: float) -> float:
    """Return ``seconds`` (at least 0) as a timeout a blocking wait accepts: a thread's wait
    raises OverflowError beyond ``threading.TIMEOUT_MAX`` (about 292 years), which any finite
    ``start_timeout`` may exceed."""
    return min(max(0.0, seconds), threading.TIMEOUT_MAX)


class StartGate:
    """Whether the actor has answered yet, and the bounded wait until it does.

    Args:
        handle: the actor handle.
        start_timeout: seconds from now the actor has to answer.
        resources: the resources the actor asked for (to name a missing one), if known.
        where: describes the actor in messages.
    """

    def __init__(
        self,
        handle: Any,
        start_timeout: float,
        resources: Mapping[str, float] | None,
        where: Callable[[], str],
    ) -> None:
        self.started = False
        self._handle = handle
        self._start_timeout = start_timeout
        self._deadline = time.monotonic() + start_timeout
        self._resources = dict(resources or {})
        self._where = where
        self._ping: Any = None

    def ping(self) -> Any:
        """Send the ping (once) and return its ObjectRef.

        Raises:
            ProtocolError: the actor has no ``ping`` (an older stalebuf).
        """
        if self._ping is None:
            try:
                method = self._handle.ping
            except AttributeError:
                raise ProtocolError(
                    f"the buffer actor {self._where()} runs an older stalebuf (it has no ping); "
                    f"this client speaks protocol version {PROTOCOL_VERSION}"
                ) from None
            self._ping = method.remote()
        return self._ping

    async def wait(self, limit: float | None = None) -> None:
        """Return once the actor has answered.

        Raises:
            TimeoutError: ``limit`` seconds passed first (before the start deadline).
            BufferUnavailableError: the start deadline passed first, or the actor died.
            ProtocolError: the actor speaks another protocol version.
        """
        if self.started:
            return
        answer = self.ping().future()
        if not answer.done():
            remaining = max(0.0, self._deadline - time.monotonic())
            bound = remaining if limit is None else min(remaining, limit)
            try:
                await asyncio.wait_for(asyncio.wrap_future(answer), bound)
            except asyncio.TimeoutError:
                if bound < remaining:
                    raise TimeoutError(
                        f"the buffer actor {self._where()} has not started within {bound:g} s; "
                        "nothing was taken"
                    ) from None
                raise self.unavailable() from None
        self._accept(answer)

    def wait_blocking(self) -> None:
        """Block until the actor has answered (for synchronous callers such as ``connect``).

        Raises:
            BufferUnavailableError: the start deadline passed first, or the actor is dead.
            ProtocolError: the actor speaks another protocol version.
        """
        if self.started:
            return
        answer = self.ping().future()
        try:
            answer.result(timeout=blocking_seconds(self._deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise self.unavailable() from None
        except RayActorError:
            pass  # raised again, translated, by _accept
        self._accept(answer)

    def _accept(self, answer: concurrent.futures.Future[Any]) -> None:
        try:
            version = answer.result()
        except RayActorError as exc:
            raise translate(exc, self._where()) from None
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"the buffer actor {self._where()} speaks protocol version {describe(version)}, "
                f"this client {PROTOCOL_VERSION}: run the same stalebuf in every process"
            )
        self.started = True

    def unavailable(self) -> BufferUnavailableError:
        """Return the error for an actor that did not answer by the deadline, with a reason."""
        message = (
            f"the buffer actor {self._where()} did not start within start_timeout={self._start_timeout:g} s"
        )
        missing = _missing(self._resources)
        if missing:
            return BufferUnavailableError(
                f"{message}: it needs {describe(missing)} and no node of the cluster has that much "
                f"(see actor_options); kill() it or add such a node"
            )
        return BufferUnavailableError(
            f"{message}: Ray has not placed it or its process did not come up (resources all in "
            "use, a placement group, a slow runtime_env, or an actor that was never created?)"
        )


def _missing(resources: Mapping[str, float]) -> dict[str, float]:
    """The requested resources that exceed what the whole cluster has (any single node has less)."""
    if not resources:
        return {}
    cluster: dict[str, float] = {}
    with contextlib.suppress(Exception):  # best effort: only words an error message
        cluster = cast("Callable[[], dict[str, float]]", ray.cluster_resources)()
    return {
        name: amount
        for name, amount in resources.items()
        if math.isfinite(amount) and amount > cluster.get(name, 0.0)
    }
