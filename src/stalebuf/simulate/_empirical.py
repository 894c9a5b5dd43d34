"""Generation times read from a file: the ``empirical:PATH`` and ``empirical:PATH#COLUMN``
latency specs (see :meth:`~._latency.Latency.parse` for the formats, :mod:`._bounds` for the bound on size).

The file is checked before it is read: it must be a regular file (a FIFO would block the read
forever, a device may never end) of at most :data:`MAX_FILE_BYTES`, and it is read in bounded
chunks. Every error is a :class:`~stalebuf.errors.ConfigError` whose message is one line naming
the file (and where in it), so that the command line can print it as is: JSON nested too deeply
for the parser, or a number of more digits than ``int()`` converts, too.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import stat
from collections.abc import Iterable, Iterator
from typing import Any

from .._validation import describe
from ..errors import ConfigError
from ._bounds import MAX_FILE_BYTES, MAX_SECONDS

__all__ = ["read_times", "split_column"]

# Files are read, and their lines split, in chunks of about this many bytes (characters).
_CHUNK_BYTES = 2**20
# What a file that is not a regular one is, for the message that refuses it.
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
# Opening a FIFO for reading waits for a writer unless non-blocking (POSIX; Windows has no FIFOs).
_O_NONBLOCK: int = getattr(os, "O_NONBLOCK", 0)
# O_BINARY: on Windows, os.open would otherwise translate line ends and stop at a Ctrl-Z.
_OPEN_FLAGS = os.O_RDONLY | _O_NONBLOCK | getattr(os, "O_BINARY", 0)


class _HugeNumber:
    """A JSON int with more digits than ``int()`` converts (4,300 by default), kept as its text:
    it is no generation time, but the message must say where it is."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return f"a number of {len(self.text.lstrip('-')):,} digits"

    __repr__ = __str__  # in the description of a record that holds it


def split_column(text: str) -> tuple[str, str | None]:
    """Split ``PATH#COLUMN`` at its last ``#``, unless the whole text names an existing file.

    Raises:
        ConfigError: if the path or the column is empty.
    """
    if not text:
        raise ConfigError("empirical latency needs a file: empirical:PATH or empirical:PATH#COLUMN")
    if "#" not in text or os.path.isfile(text):
        return text, None
    path, _, column = text.rpartition("#")
    if not path or not column:
        raise ConfigError(f"empirical latency needs PATH#COLUMN with both parts, got {text!r}")
    return path, column


def read_times(path: str, column: str | None) -> tuple[float, ...]:
    """Read the generation times of ``path`` (``column`` of it, if given); see :meth:`Latency.parse`.

    Raises:
        ConfigError: if the file cannot be read or holds anything but generation times.
    """
    text = _read_text(path)
    suffix = os.path.splitext(path)[1].lower()
    cells: Iterable[tuple[str, object]]
    if suffix in (".jsonl", ".ndjson"):
        cells = _json_lines_cells(path, text, column)
    elif suffix == ".json":
        cells = _json_cells(path, text, column)
    elif column is not None:
        cells = _csv_cells(path, text, column)
    elif suffix == ".csv":
        header = _csv_header(path, text)
        raise ConfigError(f"empirical latency: {path!r} is a CSV file: {_choose(path, header)}")
    else:
        cells = ((f"line {n}", line) for n, line in enumerate(_lines(text), 1) if line.strip())
    # Text cells are parsed; JSON ones must already be numbers.
    from_text = suffix not in (".json", ".jsonl", ".ndjson")
    times = tuple(_seconds(path, where, cell, from_text) for where, cell in cells)
    if not times:
        where = f"column {column!r} of {path!r}" if column is not None else repr(path)
        raise ConfigError(f"empirical latency: {where} holds no generation times")
    return times


def _read_text(path: str) -> str:
    """Return the text of ``path``, a regular UTF-8 file of at most ``MAX_FILE_BYTES``.

    Raises:
        ConfigError: if it cannot be opened or read, is not a regular file, is larger than
            ``MAX_FILE_BYTES`` or is not UTF-8.
    """
    if "\0" in path:  # os.stat's own ValueError words it differently on each Python version
        raise ConfigError(f"empirical latency: cannot read {path!r}: embedded null byte")
    try:
        info = os.stat(path)
    except OSError as exc:
        raise _cannot_read(path, exc) from None
    # Checked before it is opened: opening a FIFO waits for a writer, opening a device may act.
    _check_file(path, info)
    try:
        # Non-blocking, in case a FIFO replaced the file since: then the open returns at once, and
        # the check of what was opened refuses it.
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _cannot_read(path, exc) from None
    try:
        _check_file(path, os.fstat(fd))
        if _O_NONBLOCK:
            os.set_blocking(fd, True)  # a regular file: reads wait for the disk, as usual
        data = bytearray()
        while chunk := os.read(fd, _CHUNK_BYTES):
            data += chunk
            if len(data) > MAX_FILE_BYTES:  # it grew since, or its size is not its length (/proc)
                raise _too_large(path, None)
    except OSError as exc:
        raise _cannot_read(path, exc) from None
    finally:
        os.close(fd)
    try:
        # utf-8-sig: spreadsheets often start a CSV export with a byte-order mark.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ConfigError(f"empirical latency: {path!r} is not a UTF-8 text file") from None


def _lines(text: str) -> Iterator[str]:
    """Yield the lines of ``text`` as ``text.splitlines()`` lists them, a block at a time: a list
    of every line takes many times the memory of the text."""
    start = 0
    while start < len(text):
        # A block ends just after a "\n", where a line ends whatever the text around it.
        end = text.find("\n", start + _CHUNK_BYTES)
        end = len(text) if end < 0 else end + 1
        yield from text[start:end].splitlines()
        start = end


def _check_file(path: str, info: os.stat_result) -> None:
    """Refuse anything but a regular file of at most ``MAX_FILE_BYTES``.

    Raises:
        ConfigError: if ``info`` is not that of such a file.
    """
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "of another kind")
        raise ConfigError(f"empirical latency: cannot read {path!r}: it is {kind}, not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise _too_large(path, info.st_size)


def _cannot_read(path: str, exc: OSError | ValueError) -> ConfigError:
    return ConfigError(f"empirical latency: cannot read {path!r}: {getattr(exc, 'strerror', None) or exc}")


def _too_large(path: str, size: int | None) -> ConfigError:
    what = f"is {size:,} bytes, more than" if size is not None else "holds more than"
    return ConfigError(
        f"empirical latency: {path!r} {what} the {MAX_FILE_BYTES // 2**20} MiB a latency file may hold; "
        "keep only the generation times (one number per line is the smallest form)"
    )


def _choose(path: str, names: Iterable[object]) -> str:
    listed = ", ".join(describe(name) for name in list(names)[:20])
    return f"choose a column with empirical:{path}#COLUMN (it has: {listed or 'none'})"


def _seconds(path: str, where: str, cell: object, from_text: bool) -> float:
    """One generation time: a number > 0 and at most ``MAX_SECONDS``, parsed from text or a
    JSON number.

    Raises:
        ConfigError: naming ``where``, if ``cell`` is not such a number.
    """
    number = _number(cell, from_text)
    shown = str(cell) if isinstance(cell, _HugeNumber) else describe(cell)
    if not number > 0.0:  # nan too: not a number at all
        raise ConfigError(
            f"empirical latency: {path!r} {where}: expected a number of seconds > 0, got {shown}"
        )
    if number > MAX_SECONDS:  # inf too: a number too large for a float is too long as well
        raise ConfigError(
            f"empirical latency: {path!r} {where}: expected at most {MAX_SECONDS:g} seconds, got {shown}"
        )
    return number


def _number(cell: object, from_text: bool) -> float:
    """``cell`` as a float: -inf or inf if it is a number too large for one, nan if no number."""
    if isinstance(cell, _HugeNumber):
        return -math.inf if cell.text.startswith("-") else math.inf
    if from_text:
        if isinstance(cell, str):
            with contextlib.suppress(ValueError):
                return float(cell)  # a long number is inf here, never an error
        return math.nan
    if isinstance(cell, bool) or not isinstance(cell, (int, float)):
        return math.nan  # a JSON string, true or false, null, an array or an object
    try:
        return float(cell)
    except OverflowError:  # an int of more than 308 digits
        return math.inf if cell > 0 else -math.inf


def _csv_rows(text: str) -> Any:
    # newline="": a lone "\r" ends a row too (old spreadsheet exports), and quoted newlines stay.
    return csv.reader(io.StringIO(text, newline=""))


def _csv_error(path: str, line: int, exc: csv.Error) -> ConfigError:
    return ConfigError(f"empirical latency: {path!r} line {max(line, 1)} is not valid CSV: {exc}")


def _csv_header(path: str, text: str) -> list[str]:
    reader = _csv_rows(text)
    try:
        return next(reader, [])
    except csv.Error as exc:
        raise _csv_error(path, reader.line_num, exc) from None


def _csv_cells(path: str, text: str, column: str) -> Iterator[tuple[str, object]]:
    reader = _csv_rows(text)
    try:
        header: list[str] = next(reader, [])
        if column not in header:
            choose = _choose(path, header)
            raise ConfigError(f"empirical latency: {path!r} has no column {column!r}; {choose}")
        index = header.index(column)
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue  # a blank line
            where = f"line {reader.line_num}, column {column!r}"
            yield where, row[index] if index < len(row) else ""
    except csv.Error as exc:  # a field over csv's size limit, a NUL byte (before Python 3.11)
        raise _csv_error(path, reader.line_num, exc) from None


def _parse_json(path: str, text: str, line: int | None = None) -> object:
    """Parse ``text``, the whole file or its line ``line``.

    Raises:
        ConfigError: if it is not JSON, or is nested too deeply for the parser.
    """
    part = repr(path) if line is None else f"{path!r} line {line}"
    try:
        return _loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"empirical latency: {part} is not valid JSON: {exc}") from None
    except RecursionError:  # "[[[[...": valid JSON, too deep for the parser, and no list of times
        raise ConfigError(f"empirical latency: {part} nests arrays or objects too deeply to read") from None


def _loads(text: str) -> object:
    """``json.loads(text)``, with any int of more digits than ``int()`` converts as a _HugeNumber.

    Raises:
        json.JSONDecodeError: if it is not JSON.
        RecursionError: if it is nested too deeply for the parser.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:
        # int() refused a number's digits, and the error says neither where nor which field:
        # parse again keeping such ints as text. Only this parse pays for a Python hook per int.
        return json.loads(text, parse_int=_json_int)


def _json_int(text: str) -> int | _HugeNumber:
    try:
        return int(text)
    except ValueError:  # more digits than int() converts
        return _HugeNumber(text)


def _json_cells(path: str, text: str, column: str | None) -> Iterable[tuple[str, object]]:
    document = _parse_json(path, text)
    if column is None:
        if isinstance(document, list) and not any(isinstance(item, dict) for item in document):
            return ((f"item {n}", item) for n, item in enumerate(document))
        items = document if isinstance(document, list) else [document]
        objects = [item for item in items if isinstance(item, dict)]
        if objects:
            raise ConfigError(f"empirical latency: {path!r} holds objects: {_choose(path, objects[0])}")
        raise ConfigError(f"empirical latency: {path!r} must hold a JSON array of numbers")
    if isinstance(document, dict):
        if column not in document or not isinstance(document[column], list):
            raise ConfigError(
                f"empirical latency: {path!r} has no array {column!r}; {_choose(path, document)}"
            )
        return ((f"{column}[{n}]", item) for n, item in enumerate(document[column]))
    if isinstance(document, list):
        return (_field(path, f"item {n}", item, column) for n, item in enumerate(document))
    raise ConfigError(f"empirical latency: {path!r} must hold an array of objects or an object of arrays")


def _json_lines_cells(path: str, text: str, column: str | None) -> Iterator[tuple[str, object]]:
    for n, line in enumerate(_lines(text), 1):
        if not line.strip():
            continue
        record = _parse_json(path, line, n)
        if column is None:
            if isinstance(record, dict):
                raise ConfigError(f"empirical latency: {path!r} holds objects: {_choose(path, record)}")
            yield f"line {n}", record
        else:
            yield _field(path, f"line {n}", record, column)


def _field(path: str, where: str, record: object, column: str) -> tuple[str, object]:
    if not isinstance(record, dict):
        raise ConfigError(f"empirical latency: {path!r} {where}: expected an object, got {describe(record)}")
    if column not in record:
        raise ConfigError(f"empirical latency: {path!r} {where} has no field {column!r}")
    return f"{where}, field {column!r}", record[column]
