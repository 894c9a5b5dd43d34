"""Type-check-only proof that both buffers satisfy :class:`stalebuf.protocol.AsyncReplayBuffer`.

Nothing here runs or is imported at run time. mypy (strict, in CI) checks each function below:
if a method of ``ReplayBuffer`` or ``RemoteReplayBuffer`` is renamed, removed, or changes a
parameter or result type so that it no longer fits the protocol, the return statement fails to
type-check and CI fails, naming the member that drifted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..buffer import ReplayBuffer
    from ..protocol import AsyncReplayBuffer
    from ._client import RemoteReplayBuffer

    def _local_buffer_conforms(buffer: ReplayBuffer) -> AsyncReplayBuffer:
        return buffer

    def _remote_buffer_conforms(buffer: RemoteReplayBuffer) -> AsyncReplayBuffer:
        return buffer
