"""The file system around a checkpoint file: opening one to read, refusing anything but a
regular file before a byte is read (a FIFO must not block ``restore`` forever, a device must not
be read to its end).
"""

from __future__ import annotations

import errno
import io
import os
import stat

from .errors import CheckpointError

__all__ = ["check_regular", "open_regular"]


def check_regular(mode: int, name: str) -> None:
    """Refuse what is not a regular file.

    Raises:
        IsADirectoryError: a directory.
        CheckpointError: a FIFO, a device, a socket.
    """
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), name)
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise CheckpointError(f"{name!r} is {kind}, not a regular file: a checkpoint is a regular file")


def open_regular(name: str) -> io.BufferedReader:
    """Open ``name`` for reading, refusing anything but a regular file before a byte is read.

    Raises:
        CheckpointError: a FIFO, a device, a socket.
        OSError: it cannot be opened (IsADirectoryError for a directory).
    """
    check_regular(os.stat(name).st_mode, name)  # before opening: opening a device can act
    # Non-blocking: should it have become a FIFO since, opening it must not wait for a writer.
    flags = (
        os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    )
    handle = os.open(name, flags)
    try:
        check_regular(os.fstat(handle).st_mode, name)
        if hasattr(os, "set_blocking"):
            os.set_blocking(handle, True)
        return os.fdopen(handle, "rb")
    except BaseException:
        os.close(handle)
        raise
