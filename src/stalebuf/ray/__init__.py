"""stalebuf on Ray: the same buffer, hosted by a Ray async actor, used from any process.

Install with ``pip install 'stalebuf[ray]'``; ``import stalebuf`` never imports Ray, only
``import stalebuf.ray`` does.

- :class:`RemoteReplayBuffer` starts (or, by name, :meth:`~RemoteReplayBuffer.connect`\\ s to)
  an actor that hosts a real :class:`~stalebuf.ReplayBuffer`; the client has the same async
  methods, plus :meth:`~RemoteReplayBuffer.put_group` (a whole group in one round trip) and
  :meth:`~RemoteReplayBuffer.evictions` (eviction events as an async iterator). Admission waits
  in the actor; :meth:`~RemoteReplayBuffer.rollout` yields a :class:`RemoteRolloutGroup` whose
  body is cancelled when the group is evicted in flight; :meth:`~RemoteReplayBuffer.save` and
  :meth:`~RemoteReplayBuffer.restore` (a :class:`RemoteRestoreResult`) checkpoint the buffer, and
  with ``journal=`` the actor journals it, so that :meth:`~RemoteReplayBuffer.recover` rebuilds it
  in a new actor after the old one's process died.
- Payloads live in the Ray object store; batches carry :class:`PayloadRef`\\ s, and
  :func:`resolve` (or :func:`resolve_sync`) turns a batch into values in one call.
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401  (only to fail early with a clear message)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("stalebuf.ray needs Ray: pip install 'stalebuf[ray]'") from exc

from ._client import RemoteReplayBuffer, RemoteRestoreResult
from ._events import EvictionStream
from ._options import PayloadMode
from ._payloads import PayloadRef, resolve, resolve_sync
from ._rollout import RemoteRolloutGroup

__all__ = [
    "EvictionStream",
    "PayloadMode",
    "PayloadRef",
    "RemoteReplayBuffer",
    "RemoteRestoreResult",
    "RemoteRolloutGroup",
    "resolve",
    "resolve_sync",
]
