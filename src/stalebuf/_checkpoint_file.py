"""The older checkpoint file, the hand-written container that ``save`` wrote before it wrote the
journal's SQLite format (``_checkpoint_db``): read only, so files already written keep loading.

Layout: a magic line, then ``version (u32), flags (u32), body length (u64), sha256 (32 bytes)``,
then the body, a sequence of length-prefixed frames. Pickle files (flags 0): a manifest, then
chunks of groups, each pickled on its own (protocol 5, buffers such as numpy arrays out of band,
in their own frames). Codec files (flags 1): JSON for everything, and one frame per payload made
by the user's ``encode``; nothing in them is ever unpickled (that form is ``_checkpoint_codec``'s).
The checksum covers the header's fields and the body.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import struct
from collections.abc import Callable, Iterator
from typing import Any

from ._checkpoint_checks import checked
from ._checkpoint_codec import read_plain
from ._checkpoint_path import open_regular
from ._validation import describe, describe_error
from .checkpoint import FORMAT_VERSION, BufferCheckpoint
from .errors import CheckpointError
from .records import Group

__all__ = ["MAGIC", "PayloadCodec", "body_frames", "read_container"]


#: ``(encode, decode)``: ``encode(payload) -> bytes`` and ``decode(bytes) -> payload``.
PayloadCodec = tuple[Callable[[Any], bytes], Callable[[bytes], Any]]

MAGIC = b"STALEBUF CHECKPOINT\n"
_HEADER = struct.Struct(">IIQ32s")
_FRAME = struct.Struct(">Q")
_COUNT = struct.Struct(">I")
_PICKLE, _CODEC = 0, 1
# Bytes per read: a file is read in bounded pieces, after its header and size were checked.
_READ = 16 << 20


def read_container(path: str | os.PathLike[str], codec: PayloadCodec | None) -> BufferCheckpoint:
    """Read and verify the container file at ``path``, then check what it holds (see
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
    flags, body = _read_verified(name)
    if flags == _PICKLE and codec is not None:
        raise CheckpointError(f"{name!r} holds pickled payloads; refusing to unpickle it with a codec given")
    if flags == _CODEC and codec is None:
        raise CheckpointError(f"{name!r} was saved with a payload codec: pass payload_codec= to restore it")
    if flags not in (_PICKLE, _CODEC):
        raise CheckpointError(f"{name!r} has unknown flags {flags}")
    frames = body_frames(memoryview(body))
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


def _digest(version: int, flags: int, length: int, body: hashlib._Hash) -> bytes:
    """The checksum: the body's SHA-256, bound to the header fields (so a flipped header bit
    is caught too)."""
    return hashlib.sha256(struct.pack(">IIQ", version, flags, length) + body.digest()).digest()


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


def body_frames(body: memoryview) -> Iterator[memoryview]:
    """The length-prefixed frames of ``body``, in order (the container's and a codec blob's).

    Raises:
        CheckpointError: a frame or its length is cut.
    """
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
