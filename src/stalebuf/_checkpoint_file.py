"""The checkpoint file: its header, checksum, frames, atomic write and the pickle form of its body.

Layout: a magic line, then ``version (u32), flags (u32), body length (u64), sha256 (32 bytes)``,
then the body, a sequence of length-prefixed frames. Pickle files (flags 0): a manifest, then
chunks of groups, each pickled on its own (protocol 5, buffers such as numpy arrays out of band,
in their own frames), so the writer never holds the GIL for long. Codec files (flags 1): JSON for
everything, and one frame per payload made by the user's ``encode``; nothing in them is ever
unpickled (that form is ``_checkpoint_codec``'s). A write goes to a temporary file in the same
directory, is flushed and fsynced, then renamed over the target and the directory fsynced: a crash
at any moment leaves the previous file or the new one, never a torn one. A path that is a symlink
is resolved first: the write replaces the link's target, not the link. Temporary files a killed
writer left behind are removed by the next write or read of the same path (see
``_checkpoint_path``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import pickle
import struct
from collections.abc import Callable, Iterator
from typing import IO, Any, Protocol

import attrs

from ._checkpoint_checks import checked
from ._checkpoint_codec import read_plain, write_plain, written_counters
from ._checkpoint_path import (
    create_temporary,
    forget_temporary,
    fsync_directory,
    open_regular,
    plain_file_mode,
    remove_stale_temporaries,
    resolve_target,
)
from ._stored import peek_trajectories
from ._validation import check_payload_codec, describe, describe_error
from .checkpoint import FORMAT_VERSION, BufferCheckpoint
from .errors import CheckpointError
from .records import Group

__all__ = ["PayloadCodec", "WriteTicket", "read_checkpoint", "write_checkpoint"]


class WriteTicket(Protocol):
    """What a write asks of its place in an ordering of saves (``_save_order.SaveTicket``)."""

    def must_stop(self, target: str) -> bool:
        """Whether the write should give up now (cancelled, or overtaken on ``target``)."""
        ...

    def land(self, target: str, rename: Callable[[], None]) -> bool:
        """Call ``rename`` unless the write must stop; return whether it did."""
        ...


#: ``(encode, decode)``: ``encode(payload) -> bytes`` and ``decode(bytes) -> payload``.
PayloadCodec = tuple[Callable[[Any], bytes], Callable[[bytes], Any]]

MAGIC = b"STALEBUF CHECKPOINT\n"
_HEADER = struct.Struct(">IIQ32s")
_FRAME = struct.Struct(">Q")
_COUNT = struct.Struct(">I")
_PICKLE, _CODEC = 0, 1
# Groups per pickled or JSON chunk: small enough that one chunk holds the GIL for milliseconds.
_CHUNK = 256
# Bytes per read: a file is read in bounded pieces, after its header and size were checked.
_READ = 16 << 20


# -- writing ------------------------------------------------------------------------------------


class _Stopped(Exception):
    """The write was cancelled, or overtaken by a newer save of the same buffer."""


class _Body:
    """Frames written to a file, hashed on the way."""

    def __init__(self, file: IO[bytes], stop: Callable[[], bool]) -> None:
        self.file = file
        self.digest = hashlib.sha256()
        self.length = 0
        self.stop = stop

    def chunks(self, groups: tuple[Group, ...]) -> Iterator[tuple[Group, ...]]:
        """``groups`` in chunks of ``_CHUNK``, checking before each whether to stop.

        Raises:
            _Stopped: the write must stop.
        """
        for start in range(0, len(groups), _CHUNK):
            if self.stop():
                raise _Stopped
            yield groups[start : start + _CHUNK]

    def frame(self, data: bytes | bytearray | memoryview) -> None:
        if type(data) is memoryview and (data.itemsize != 1 or data.ndim != 1 or not data.c_contiguous):
            # A length prefix counts bytes: a view of 8-byte items (``ndarray.data``) has 8x
            # more bytes than len() says, and a prefix of len() would tear the file; a strided
            # view cannot be written at all; an empty one of several dimensions cannot be cast.
            data = data.cast("B") if data.c_contiguous and data.nbytes else memoryview(data.tobytes())
        for piece in (_FRAME.pack(len(data)), data):
            self.file.write(piece)
            self.digest.update(piece)
            self.length += len(piece)


def write_checkpoint(
    path: str | os.PathLike[str],
    checkpoint: BufferCheckpoint,
    codec: PayloadCodec | None,
    ticket: WriteTicket | None = None,
) -> None:
    """Write ``checkpoint`` to ``path`` atomically (see the module docs).

    With a ``ticket`` (see ``_save_order``), the write stops when the ticket is cancelled or a
    newer save of the same buffer has landed at the file, and then returns without renaming;
    either way its temporary file is removed.

    Raises:
        CheckpointError: a value the format cannot hold (named): one pickle cannot hold, or with
            a codec one JSON cannot hold; or ``encode`` failed or returned something other than
            bytes; or ``path`` names something other than a regular file (a FIFO, a device).
        ConfigError: ``codec`` is not None or a pair ``(encode, decode)`` of callables.
        PermissionError: the file at ``path`` is read-only (no write permission for this
            process, or none for anyone): it is kept, not replaced.
        OSError: the file could not be written (the previous file, if any, is untouched).
    """
    check_payload_codec(codec)
    target = resolve_target(path)
    mode = plain_file_mode(target)
    remove_stale_temporaries(target)
    handle, temporary = create_temporary(target)
    stop = (lambda: False) if ticket is None else functools.partial(ticket.must_stop, target)
    try:
        try:
            _write_file(handle, mode, checkpoint, codec, stop)
            if ticket is None:
                os.replace(temporary, target)
                landed = True
            else:
                landed = ticket.land(target, functools.partial(os.replace, temporary, target))
        except _Stopped:
            landed = False
        if not landed:  # cancelled, or the file already holds a newer state: nothing to rename
            os.unlink(temporary)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    finally:
        forget_temporary(temporary)
    if landed:
        fsync_directory(os.path.dirname(target))


def _write_file(
    handle: int, mode: int, checkpoint: BufferCheckpoint, codec: PayloadCodec | None, stop: Callable[[], bool]
) -> None:
    """Write the whole file to the open temporary ``handle`` (closed on return), and fsync it.

    Raises:
        _Stopped: ``stop`` said so between two chunks.
        CheckpointError: as ``write_checkpoint``.
        OSError: the file could not be written.
    """
    if hasattr(os, "fchmod"):  # POSIX: mkstemp's 0o600 would hide the file from other users
        # Best effort: a file system without Unix permissions (vfat, some CIFS mounts) refuses
        # chmod with EPERM, and a plain open there would not have failed either.
        with contextlib.suppress(OSError):
            os.fchmod(handle, mode)
    with os.fdopen(handle, "wb") as file:
        file.write(MAGIC + b"\0" * _HEADER.size)  # the header is filled in at the end
        body = _Body(file, stop)
        if codec is None:
            _write_pickled(body, checkpoint)
        else:
            write_plain(checkpoint, codec[0], body.frame, body.chunks)
        file.seek(len(MAGIC))
        flags = _PICKLE if codec is None else _CODEC
        digest = _digest(FORMAT_VERSION, flags, body.length, body.digest)
        file.write(_HEADER.pack(FORMAT_VERSION, flags, body.length, digest))
        file.flush()
        os.fsync(file.fileno())


def _digest(version: int, flags: int, length: int, body: hashlib._Hash) -> bytes:
    """The checksum: the body's SHA-256, bound to the header fields (so a flipped header bit
    is caught too)."""
    return hashlib.sha256(struct.pack(">IIQ", version, flags, length) + body.digest()).digest()


def _write_pickled(body: _Body, checkpoint: BufferCheckpoint) -> None:
    partitions = tuple(attrs.evolve(p, counters=written_counters(p.counters)) for p in checkpoint.partitions)
    manifest = attrs.evolve(checkpoint, groups=(), partitions=partitions)
    try:
        body.frame(pickle.dumps((manifest, len(checkpoint.groups)), protocol=5))
    except Exception as exc:
        raise CheckpointError(f"the config cannot be pickled: {describe_error(exc)}") from exc
    for chunk in body.chunks(checkpoint.groups):
        buffers: list[pickle.PickleBuffer] = []
        try:
            data = pickle.dumps(chunk, protocol=5, buffer_callback=buffers.append)
        except Exception as exc:
            raise _unpicklable(chunk, exc) from exc
        body.frame(_COUNT.pack(len(buffers)) + data)
        for buffer in buffers:
            body.frame(buffer.raw())


def _unpicklable(chunk: tuple[Group, ...], error: Exception) -> CheckpointError:
    """The error for a chunk pickle refused, naming its first group (and trajectory) at fault."""
    for group in chunk:
        try:
            pickle.dumps(group, protocol=5, buffer_callback=lambda _: None)
        except Exception as exc:
            for trajectory in peek_trajectories(group):
                try:
                    pickle.dumps(trajectory, protocol=5, buffer_callback=lambda _: None)
                except Exception:
                    where = f"group {describe(group.uid)}, trajectory {describe(trajectory.key)}"
                    break
            else:
                where = f"group {describe(group.uid)} (its tags)"
            return CheckpointError(
                f"{where} cannot be pickled: {describe_error(exc)}; pass payload_codec= to save "
                "payloads pickle cannot hold"
            )
    return CheckpointError(f"the groups cannot be pickled: {describe_error(error)}")


# -- reading ------------------------------------------------------------------------------------


def read_checkpoint(path: str | os.PathLike[str], codec: PayloadCodec | None) -> BufferCheckpoint:
    """Read and verify the checkpoint file at ``path``, then check what it holds (see
    ``_checkpoint_checks``: a crafted file can carry a valid checksum).

    Raises:
        CheckpointError: the file is truncated, corrupt, not a checkpoint, of a newer format,
            not a regular file (a FIFO, a device), a codec file read without a codec (or a
            pickle file read with one), ``decode`` failed, or a field holds what no live buffer
            could hold (the message names the file and the field).
        OSError: the file cannot be read (FileNotFoundError for a missing one, IsADirectoryError
            for a directory).
    """
    name = os.fspath(path)
    with contextlib.suppress(OSError, ValueError):
        remove_stale_temporaries(os.path.realpath(name))
    flags, body = _read_verified(name)
    if flags == _PICKLE and codec is not None:
        raise CheckpointError(f"{name!r} holds pickled payloads; refusing to unpickle it with a codec given")
    if flags == _CODEC and codec is None:
        raise CheckpointError(f"{name!r} was saved with a payload codec: pass payload_codec= to restore it")
    if flags not in (_PICKLE, _CODEC):
        raise CheckpointError(f"{name!r} has unknown flags {flags}")
    frames = _frames(memoryview(body))
    try:
        if codec is None:
            manifest, groups = _read_pickled(frames)
        else:
            manifest, groups = read_plain(functools.partial(_next, frames), codec[1])
        if next(frames, None) is not None:
            raise CheckpointError("the file holds data past its last group")
        return checked(manifest, groups)
    except CheckpointError as exc:
        raise CheckpointError(f"{name!r}: {exc}") from exc
    except Exception as exc:  # a checksum-valid file that does not parse: written by something else
        raise CheckpointError(f"{name!r} cannot be read: {describe_error(exc)}") from exc


def _read_verified(name: str) -> tuple[int, bytearray]:
    """The file's flags and body, its magic, version, size and checksum checked: the header and
    the size before the body is read (a foreign file of any size costs one small read).

    Raises:
        CheckpointError: as ``read_checkpoint``, for the file itself.
        OSError: the file cannot be read.
    """
    start = len(MAGIC) + _HEADER.size
    with open_regular(name) as file:
        head = file.read(start)
        if not head.startswith(MAGIC):
            raise CheckpointError(f"{name!r} is not a stalebuf checkpoint")
        if len(head) < start:
            raise CheckpointError(f"{name!r} is truncated (no complete header)")
        version, flags, length, digest = _HEADER.unpack_from(head, len(MAGIC))
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{name!r} has checkpoint format {version}; this stalebuf reads formats up to "
                f"{FORMAT_VERSION}: upgrade it"
            )
        size = os.fstat(file.fileno()).st_size - start
        if size != length:
            raise CheckpointError(f"{name!r} is truncated or has trailing data ({size} of {length} bytes)")
        body, hashed = _read_body(file, length, name)
    if version < 1 or _digest(version, flags, length, hashed) != digest:
        raise CheckpointError(f"{name!r} is corrupt (checksum mismatch)")
    return flags, body


def _read_body(file: io.BufferedReader, length: int, name: str) -> tuple[bytearray, hashlib._Hash]:
    """The next ``length`` bytes of ``file``, read (and hashed) in pieces of at most ``_READ``.

    Raises:
        CheckpointError: the file is shorter or longer than that (it changed while read).
        OSError: it cannot be read.
    """
    body = bytearray(length)
    view = memoryview(body)
    hashed = hashlib.sha256()
    done = 0
    while done < length:
        count = file.readinto(view[done : done + _READ])
        if not count:
            break
        hashed.update(view[done : done + count])
        done += count
    if done < length or file.read(1):
        raise CheckpointError(f"{name!r} is truncated or has trailing data (it changed while read)")
    return body, hashed


def _frames(body: memoryview) -> Iterator[memoryview]:
    offset = 0
    while offset < len(body):
        if offset + _FRAME.size > len(body):
            raise CheckpointError("the file is corrupt (a frame header is cut)")
        (size,) = _FRAME.unpack_from(body, offset)
        offset += _FRAME.size
        if offset + size > len(body):
            raise CheckpointError("the file is corrupt (a frame is cut)")
        yield body[offset : offset + size]
        offset += size


def _next(frames: Iterator[memoryview]) -> memoryview:
    """The next frame.

    Raises:
        CheckpointError: there is none (the file ends before what its manifest announced).
    """
    frame = next(frames, None)
    if frame is None:
        raise CheckpointError("the file ends before its last group")
    return frame


def _read_pickled(frames: Iterator[memoryview]) -> tuple[BufferCheckpoint, tuple[Group, ...]]:
    manifest, count = pickle.loads(_next(frames))
    if type(manifest) is not BufferCheckpoint:
        raise CheckpointError("the file's manifest is not a BufferCheckpoint")
    if type(count) is not int or count < 0:
        raise CheckpointError(f"the file's group count must be an int >= 0, got {describe(count)}")
    groups: list[Group] = []
    while len(groups) < count:
        frame = _next(frames)
        (buffers,) = _COUNT.unpack_from(frame)
        oob = [_next(frames) for _ in range(buffers)]
        chunk = pickle.loads(frame[_COUNT.size :], buffers=oob)
        if type(chunk) is not tuple:  # the writer pickles each chunk of groups as a tuple
            raise CheckpointError(f"the file holds a {type(chunk).__name__} where a chunk of groups belongs")
        groups.extend(chunk)
    if len(groups) != count:
        raise CheckpointError(f"the file holds {len(groups)} groups where its manifest says {count}")
    return manifest, tuple(groups)
