"""The file system around a checkpoint file: the target a write replaces, its temporary files
(and the stale ones killed writers left), and opening a file to read without blocking on a FIFO.

A write resolves every symlink of its path (it replaces the link's target, never the link) and
refuses a read-only target (PermissionError) or one that is not a regular file
(CheckpointError). Its temporary file sits next to the target, named
``.stalebuf-<target>-<host>-<pid>-<random>.tmp``; the next write or read of the same target
removes those whose writer is gone (see :func:`remove_stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import re
import socket
import stat
import tempfile
import threading
import time

from .errors import CheckpointError

__all__ = [
    "STALE_AFTER_SECONDS",
    "check_regular",
    "create_temporary",
    "forget_temporary",
    "fsync_directory",
    "open_regular",
    "plain_file_mode",
    "remove_stale_temporaries",
    "resolve_target",
]


def resolve_target(path: str | os.PathLike[str]) -> str:
    """The file a write to ``path`` replaces: every symlink resolved (a link is written through,
    not replaced), and checked to be a writable regular file when it exists.

    Raises:
        CheckpointError: it is something other than a regular file or a directory.
        IsADirectoryError: it is a directory.
        PermissionError: it is read-only (see ``write_checkpoint``).
        OSError: a symlink loop, or the path cannot be examined.
    """
    given = os.fspath(path)
    target = os.path.realpath(given)
    try:
        info = os.lstat(target)
    except FileNotFoundError:  # a new file, or a dangling link's target: created, as open would
        return target
    if stat.S_ISLNK(info.st_mode):  # realpath stops resolving at a loop
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), given)
    check_regular(info.st_mode, given)
    effective = os.access in os.supports_effective_ids  # open() checks the effective ids
    # No write bit for anyone also counts: root may write anything, but a file made read-only
    # (chmod a-w) is one someone meant to keep.
    if not info.st_mode & 0o222 or not os.access(target, os.W_OK, effective_ids=effective):
        raise PermissionError(errno.EACCES, "the checkpoint file is read-only; refusing to replace it", given)
    return target


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


def plain_file_mode(target: str) -> int:
    """The permissions a plain ``open(target, "wb")`` would leave: the existing file's, or
    0o666 less the umask for a new one."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(os.stat(target).st_mode)
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (another thread
    creating a file meanwhile would get a wrong mask otherwise)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory fds: the rename is as durable as it gets
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


# A temporary file is named ".stalebuf-<target>-<host>-<pid>-<random>.tmp": <target> hashes the
# target's name (a write only ever touches temporaries of its own target), <host> hashes the
# host name and the PID namespace (a PID means something only there), <pid> is the writer's.
#: A temporary file left unmodified this long is stale whoever wrote it: a writer modifies it
#: at every frame, so only one stuck that long in a single ``encode`` (or pickle) could lose it,
#: and its rename then fails (OSError) without touching the target.
STALE_AFTER_SECONDS = 3600.0
_TEMPORARY = re.compile(r"(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]{1,10})-[a-z0-9_]+\.tmp")
# Before names carried a target, a host and a PID: stale by age only.
_LEGACY = re.compile(r"\.stalebuf-[a-z0-9_]{8}\.tmp")
# This process's temporary files being written: never stale, whatever their PID or age.
_live: set[str] = set()
_live_lock = threading.Lock()


def _forked() -> None:
    """In a forked child: another process, whose lock no other thread may hold."""
    global _live_lock
    _live_lock = threading.Lock()
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _tag(text: str) -> str:
    """A short stable hash of ``text`` for a file name (any length or character fits)."""
    return hashlib.sha256(os.fsencode(text)).hexdigest()[:8]


def _prefix(target: str) -> str:
    """The start of the names of ``target``'s temporary files."""
    return f".stalebuf-{_tag(os.path.basename(target))}-"


def _host() -> str:
    """This host and PID namespace, as a tag: where the PID in a temporary's name is meaningful."""
    namespace = ""
    with contextlib.suppress(OSError):  # Linux names the PID namespace; elsewhere the host alone
        namespace = os.readlink("/proc/self/ns/pid")
    return _tag(f"{socket.gethostname()}\0{namespace}")


def create_temporary(target: str) -> tuple[int, str]:
    """Create and register a temporary file next to ``target``: ``(fd, path)``.

    Raises:
        OSError: it cannot be created.
    """
    prefix = f"{_prefix(target)}{_host()}-{os.getpid()}-"
    with _live_lock:  # created and registered at once: a cleanup never sees it unregistered
        handle, temporary = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=os.path.dirname(target))
        _live.add(temporary)
    return handle, temporary


def forget_temporary(temporary: str) -> None:
    """Unregister a temporary file of this process (renamed or removed: no longer written)."""
    with _live_lock:
        _live.discard(temporary)


def remove_stale_temporaries(target: str) -> None:
    """Remove the temporary files of writes to ``target`` (a resolved path) whose writer is gone:
    written on this host by a dead process, or by this process but no longer being written, or
    unmodified for ``STALE_AFTER_SECONDS`` (any writer, or an older stalebuf's). Best effort:
    what cannot be examined or removed stays."""
    prefix, host, now = _prefix(target), _host(), time.time()
    try:
        with os.scandir(os.path.dirname(target)) as listing:
            entries = list(listing)
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(prefix):
            match = _TEMPORARY.fullmatch(entry.name, len(prefix))
            if match is None:  # not a name this module makes: someone else's file
                continue
        elif _LEGACY.fullmatch(entry.name):
            match = None
        else:
            continue
        with contextlib.suppress(OSError):
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode):
                continue
            if now - info.st_mtime > STALE_AFTER_SECONDS or (
                match is not None and match["host"] == host and not _alive(int(match["pid"]))
            ):
                with _live_lock:  # checked and removed at once: never one this process writes
                    if entry.path not in _live:
                        os.unlink(entry.path)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (this one counts as gone: its live temporary
    files are registered)."""
    if pid == os.getpid():
        return False
    if os.name == "nt":  # os.kill would terminate it: there, age is the only rule
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: another user's; an absurd PID: kept, aged out
        return True
    return True
