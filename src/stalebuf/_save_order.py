"""The order of one buffer's overlapping saves: the file ends holding the newest state.

Each ``save`` draws a ticket when it takes its checkpoint (on the loop, so tickets follow the
order the calls started in) and writes in a worker thread, concurrently with the others. Just
before its rename, under a lock, a write checks whether a save that started later has already
landed at the same file: if so it removes its temporary file and returns without renaming (the
file already holds a newer state); a write that finds itself overtaken earlier stops at its next
chunk. A save that fails or is cancelled lands nothing and takes nothing from the order, so an
older save still in flight may still land (the newest state that was written wins). Nothing is
serialised: a slow save never delays a later one, and ``tg.start_soon(buffer.save, path)`` at
every step never queues up checkpoints. A cancelled save stops its writer at the next chunk and
waits until its temporary file is removed (as long as a stuck ``encode`` holds the writer).

A caller that must await something between taking the checkpoint and writing it draws the
ticket with the checkpoint (:meth:`SaveSequencer.ticket`) and passes it to ``write``; a ticket
drawn and never written must be ended (:meth:`SaveTicket.end`), or older landings are kept in
memory for good.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from ._checkpoint_db import write_checkpoint

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._checkpoint_file import PayloadCodec
    from .checkpoint import BufferCheckpoint

__all__ = ["SaveSequencer", "SaveTicket"]


class SaveTicket:
    """One save's place in its sequencer's order, and the state of its writer thread."""

    def __init__(self, sequencer: SaveSequencer, number: int) -> None:
        self._sequencer = sequencer
        self.number = number
        # The loop cancels while the writer thread starts, writes or ends: one lock orders them.
        self._lock = threading.Lock()
        self._writing = False
        self._cancelled = threading.Event()
        self._ended = threading.Event()

    def start(self) -> bool:
        """Called by the writer thread first: False when the save was cancelled before it ran."""
        with self._lock:
            self._writing = not self._cancelled.is_set()
            return self._writing

    def cancel(self) -> bool:
        """Ask the write to stop (at its next chunk, or before its rename at the latest); True
        when a writer is running, which the caller must wait for (:meth:`wait_ended`)."""
        with self._lock:
            self._cancelled.set()
            return self._writing and not self._ended.is_set()

    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    def must_stop(self, target: str) -> bool:
        """Whether the write to ``target`` (a resolved path) is cancelled or overtaken."""
        return self.cancelled() or self._sequencer.overtaken(self.number, target)

    def land(self, target: str, rename: Callable[[], None]) -> bool:
        """Call ``rename`` unless the write must stop; True when it did.

        Raises:
            OSError: what ``rename`` raised (nothing landed).
        """
        return self._sequencer.land(self, target, rename)

    def end(self) -> None:
        """Leave the order (the write is over, whatever its outcome); idempotent."""
        with self._lock:
            self._ended.set()
        self._sequencer.end(self.number)

    def wait_ended(self) -> None:
        """Block until :meth:`end` (called from a worker thread)."""
        self._ended.wait()


class SaveSequencer:
    """The order of one buffer's saves (see the module docs); one per buffer."""

    def __init__(self) -> None:
        # Tickets are drawn on the loop; landings and ends happen in worker threads.
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._running: set[int] = set()
        # The newest ticket that landed at each resolved path, kept while an older save that
        # could still land there is running.
        self._landed: dict[str, int] = {}

    def __reduce__(self) -> tuple[type[SaveSequencer], tuple[()]]:
        """A copy (pickled or deep-copied with its buffer) starts with no save in flight: the
        saves in flight belong to the original."""
        return (SaveSequencer, ())

    def ticket(self) -> SaveTicket:
        """A ticket for a save whose checkpoint is taken now (later than every earlier ticket's)."""
        with self._lock:
            number = next(self._numbers)
            self._running.add(number)
        return SaveTicket(self, number)

    async def write(
        self,
        path: str | os.PathLike[str],
        checkpoint: BufferCheckpoint,
        codec: PayloadCodec | None,
        ticket: SaveTicket | None = None,
    ) -> None:
        """Write ``checkpoint`` to ``path`` in a worker thread, in this sequencer's order.

        The ticket is drawn now unless given (so call this right after taking the checkpoint,
        with no await in between, or draw the ticket then). Cancelled, it stops the writer and
        waits for it to remove its temporary file, so nothing is left behind and nothing lands
        after the cancellation is seen.

        Raises:
            CheckpointError: as ``write_checkpoint``.
            ConfigError: as ``write_checkpoint``.
            OSError: as ``write_checkpoint``.
        """
        if ticket is None:
            ticket = self.ticket()
        drawn = ticket

        def job() -> None:
            """The worker thread's part: write, unless cancelled first; leave the order."""
            try:
                if drawn.start():  # not cancelled before the thread got to run
                    write_checkpoint(path, checkpoint, codec, drawn)
            finally:
                drawn.end()

        try:
            # Abandoned on cancel, so the cancellation reaches the writer (below) at once rather
            # than after the whole file is written.
            await anyio.to_thread.run_sync(job, abandon_on_cancel=True)
        except BaseException:
            if ticket.cancel():  # a writer runs: it stops at its next chunk; wait for its cleanup
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(ticket.wait_ended)
            else:  # it ended, or never started (and never will write): leave the order now
                ticket.end()
            raise

    def overtaken(self, number: int, target: str) -> bool:
        """Whether a save newer than ticket ``number`` has landed at ``target``."""
        with self._lock:
            return self._landed.get(target, -1) > number

    def land(self, ticket: SaveTicket, target: str, rename: Callable[[], None]) -> bool:
        """See :meth:`SaveTicket.land`.

        Raises:
            OSError: what ``rename`` raised (nothing landed).
        """
        # The check and the rename under one lock: no newer save can land in between.
        with self._lock:
            if ticket.cancelled() or self._landed.get(target, -1) > ticket.number:
                return False
            rename()
            self._landed[target] = ticket.number
            return True

    def end(self, number: int) -> None:
        """Forget ticket ``number``, and the landings no running save can be older than."""
        with self._lock:
            self._running.discard(number)
            oldest = min(self._running, default=None)
            if oldest is None:
                self._landed.clear()
            else:
                for target in [t for t, landed in self._landed.items() if landed < oldest]:
                    del self._landed[target]
