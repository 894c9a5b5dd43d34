"""The buffer a Ray actor hosts, and how the actor builds it: new (``ReplayBuffer(...)`` or
``ReplayBuffer.from_config``), restored from a checkpoint file, or recovered from a journal.

With a journal (the client's :class:`~stalebuf.ray._protocol.JournalRequest`), the buffer writes
it with a :class:`~stalebuf.ray._payloads.JournalCodec`: the buffer holds most payloads as object
references, which mean nothing after the actor's death, so the journal holds their values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from .._checkpoint_db import read_checkpoint
from ..buffer import ReplayBuffer
from ..config import SamplerConfig
from ..records import EvictionEvent, Group
from ._payloads import JournalCodec, stored_checkpoint
from ._protocol import JournalRequest, RecoverRequest, RestoreRequest

__all__ = ["HostedBuffer", "build_buffer"]

#: ``(reissue, kept, dropped)``: what a restored or recovered buffer lists (see HostedBuffer).
Restored = tuple[tuple[Group, ...], tuple[Group, ...], tuple[Group, ...]]


@attrs.frozen
class HostedBuffer:
    """The actor's buffer and what its restore or recovery listed (empty for a new buffer).

    Attributes:
        buffer: the buffer.
        reissue: the groups ``restore`` or ``recover`` lists for reissue.
        kept, dropped: what ``recover`` at a step lists in its result's ``kept`` and ``dropped``.
    """

    buffer: ReplayBuffer
    reissue: tuple[Group, ...] = ()
    kept: tuple[Group, ...] = ()
    dropped: tuple[Group, ...] = ()

    def restored(self) -> Restored:
        """Return ``(reissue, kept, dropped)``."""
        return (self.reissue, self.kept, self.dropped)


def build_buffer(
    config: SamplerConfig | Mapping[str, Any] | None,
    use_factory: bool,
    options: Mapping[str, Any],
    on_evict: Callable[[EvictionEvent], object],
    restore: RestoreRequest | RecoverRequest | None,
    journal: JournalRequest | None,
) -> HostedBuffer:
    """Build the actor's buffer with the client's ``options`` (``status_log_interval``, ``filters``)
    and journal: new from ``config`` (with ``ReplayBuffer.from_config`` if ``use_factory``),
    restored from the checkpoint file ``restore`` names, or recovered from ``journal`` at the
    point a RecoverRequest names.

    Raises:
        What the ReplayBuffer constructor, ``from_config``, ``restore`` or ``recover`` raise
        (ConfigError, CheckpointError, OSError, ...).
    """
    if isinstance(restore, RecoverRequest):
        assert journal is not None  # the client sends a RecoverRequest only with its journal
        return _recovered(restore, journal, on_evict, options)
    options = {**options, **_journal_options(journal)}
    if restore is not None:
        return _restored(restore, on_evict, options)
    if use_factory:
        assert config is not None
        return HostedBuffer(ReplayBuffer.from_config(config, on_evict=on_evict, **options))
    assert config is None or isinstance(config, SamplerConfig)
    return HostedBuffer(ReplayBuffer(config, on_evict=on_evict, **options))


def _journal_options(journal: JournalRequest | None) -> dict[str, Any]:
    """The keyword arguments that give a ReplayBuffer the client's journal (none without one)."""
    if journal is None:
        return {}
    return {"journal": journal.path, **_journal_settings(journal)}


def _journal_settings(journal: JournalRequest) -> dict[str, Any]:
    """The journal's keyword arguments but its path (what ``recover`` takes besides it)."""
    return {
        "journal_interval": journal.interval,
        "journal_retention_steps": journal.retention_steps,
        "journal_max_pending_bytes": journal.max_pending_bytes,
        "payload_codec": JournalCodec(journal.payload_codec, journal.store).pair(),
    }


def _restored(
    request: RestoreRequest, on_evict: Callable[[EvictionEvent], object], options: Mapping[str, Any]
) -> HostedBuffer:
    """Read the checkpoint file, store its payloads (unless ``request.store`` is False) and restore the
    buffer (``options``: ``status_log_interval`` and ``filters`` if given, the journal's); return it
    and the groups to reissue.

    Raises:
        What ``ReplayBuffer.restore`` raises (CheckpointError, ConfigError, OSError, ...).
    """
    checkpoint = read_checkpoint(request.path, request.payload_codec)
    if request.store:  # (in-flight groups keep their trajectories only under "keep" and "resume")
        checkpoint = stored_checkpoint(checkpoint, keep_in_flight=request.in_flight in ("keep", "resume"))
    result = ReplayBuffer.restore(checkpoint, in_flight=request.in_flight, on_evict=on_evict, **options)
    return HostedBuffer(result.buffer, result.reissue)


def _recovered(
    request: RecoverRequest,
    journal: JournalRequest,
    on_evict: Callable[[EvictionEvent], object],
    options: Mapping[str, Any],
) -> HostedBuffer:
    """Recover the buffer from ``journal`` at the point ``request`` names (its payloads stored
    again as they are read, unless ``journal.store`` is False), journaling on into the same file.

    Raises:
        What ``ReplayBuffer.recover`` raises (CheckpointError, ConfigError, OSError, ...).
    """
    result = ReplayBuffer.recover(
        journal.path,
        global_steps=request.global_steps,
        partition=request.partition,
        in_flight=request.in_flight,
        on_evict=on_evict,
        **options,
        **_journal_settings(journal),
    )
    return HostedBuffer(result.buffer, result.reissue, result.kept, result.dropped)
