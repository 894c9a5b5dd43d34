"""How the client turns Ray's errors into the local buffer's, and checks for asyncio."""

from __future__ import annotations

import asyncio

from ray.exceptions import RayActorError, RayTaskError

from ..errors import BufferUnavailableError, StalebufError

__all__ = ["running_loop", "translate"]

# Errors whose remote traceback adds nothing: raised on the client without chaining.
_PLAIN_ERRORS = (StalebufError, TypeError, ValueError, TimeoutError)


def translate(exc: BaseException, where: str) -> BaseException:
    """Return what the local buffer would raise for ``exc`` (or BufferUnavailableError when the
    actor ``where`` names is gone); an error that is not Ray's comes back as it is."""
    if isinstance(exc, RayActorError):
        error = BufferUnavailableError(f"the buffer actor {where} is unavailable: {exc}")
        error.__cause__ = exc
        return error
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, BaseException):
            if not isinstance(cause, _PLAIN_ERRORS):
                cause.__cause__ = exc  # keep the remote traceback for unexpected errors
            return cause
    return exc


def running_loop() -> asyncio.AbstractEventLoop:
    """Return the running asyncio loop.

    Raises:
        RuntimeError: none runs (e.g. under trio: Ray's async API is asyncio-only).
    """
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "stalebuf.ray's RemoteReplayBuffer needs a running asyncio event loop "
            "(Ray's async API is asyncio-only)"
        ) from None
