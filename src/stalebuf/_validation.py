"""Every argument and configuration check, in one place.

Used by the config records, the buffer's public methods, the simulator, the CLI and the Ray
client. Each check raises before anything changes, with a message that names the argument.
Messages never call a user object's ``__repr__`` (it may raise or be huge): they show
builtin scalars and containers in a bounded form and anything else by its type.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import reprlib
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any, TypeGuard

from .errors import ConfigError, DuplicateTrajectoryError
from .records import EMPTY_TAGS

__all__ = [
    "MAX_INT",
    "MIN_STATUS_LOG_INTERVAL",
    "a_bool",
    "check_batch_request",
    "check_batch_size",
    "check_count",
    "check_generation_seconds",
    "check_group_payloads",
    "check_index",
    "check_partition",
    "check_payload_codec",
    "check_status_log_interval",
    "check_step",
    "check_tags",
    "check_timeout",
    "check_uid",
    "describe",
    "describe_error",
    "describe_typed",
    "finite_in",
    "int_at_least",
    "is_finite_number",
    "is_utf8",
    "materialise",
    "one_of",
]

#: The largest step, batch size, threshold or sync step accepted: values must fit a signed
#: 64-bit integer, so that every staleness and metric computed from them is a finite float.
MAX_INT = 2**63 - 1
#: The shortest ``status_log_interval`` accepted, in seconds: shorter ones would make the
#: status reporter the loop's main occupation.
MIN_STATUS_LOG_INTERVAL = 0.001

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlong = 40
_CONTAINERS = (list, tuple, set, frozenset, dict)
_SCALARS = (type(None), bool, int, float, str, bytes)


def describe(value: object) -> str:
    """Return a short, safe description of ``value`` for an error message.

    Builtin scalars and containers appear as a bounded repr; an int too long to print is
    described by its size; any other object by its type (its ``__repr__`` is never called).
    """
    kind = type(value)
    if kind is int:
        bits = value.bit_length()  # type: ignore[attr-defined]
        return repr(value) if bits <= 128 else f"an int of {bits} bits"
    if kind is str and len(value) <= _SHORT.maxstring:  # type: ignore[arg-type]
        text = repr(value)
        if len(text) <= _SHORT.maxstring:  # what reprlib returns, without its three calls
            return text
    if kind in _SCALARS:
        return _SHORT.repr(value)
    if kind in _CONTAINERS:
        try:
            return _SHORT.repr(value)
        except Exception:  # an element's repr raised
            return f"a {kind.__name__}"
    return f"a {kind.__name__}"


def describe_error(exc: BaseException) -> str:
    """Return ``"TypeName: message"`` for an exception, the message cut to 200 characters
    (user code may raise errors whose text is huge, or whose ``__str__`` raises)."""
    try:
        text = str(exc)
    except Exception:
        text = "(its message cannot be shown)"
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe_typed(value: object) -> str:
    """Like :func:`describe`, with the type name before a builtin value ("float 1.0")."""
    kind = type(value)
    if kind in _SCALARS or kind in _CONTAINERS:
        return f"{kind.__name__} {describe(value)}"
    return describe(value)


# -- attrs validators for config records (each raises ConfigError naming its field) -----


def int_at_least(label: str, low: int) -> Any:
    """Return a validator accepting an int in ``[low, MAX_INT]`` (bool rejected)."""

    def check(_instance: object, _attribute: object, value: object) -> None:
        if type(value) is not int or not low <= value <= MAX_INT:
            raise ConfigError(f"{label} must be an int >= {low} (and < 2**63), got {describe(value)}")

    return check


def a_bool(label: str) -> Any:
    """Return a validator accepting True or False only (not 0, 1 or other truthy values)."""

    def check(_instance: object, _attribute: object, value: object) -> None:
        if type(value) is not bool:
            raise ConfigError(f"{label} must be a bool (True or False), got {describe(value)}")

    return check


def one_of(label: str, choices: tuple[str, ...]) -> Any:
    """Return a validator accepting one of the strings ``choices``; the message lists them."""

    def check(_instance: object, _attribute: object, value: object) -> None:
        if type(value) is not str or value not in choices:
            raise ConfigError(
                f"{label} must be one of {', '.join(map(repr, choices))}; got {describe(value)}"
            )

    return check


def is_finite_number(value: object) -> TypeGuard[float]:
    """Whether ``value`` is an int or float (bool excluded) with a finite float value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def finite_in(
    label: str, low: float, high: float = math.inf, *, open_low: bool = False, open_high: bool = False
) -> Any:
    """Return a validator accepting a finite real number in ``[low, high]``; bool rejected.

    ``open_low`` / ``open_high`` exclude the bound itself; an infinite ``high`` reads as ``inf)``.
    """
    closing = ")" if open_high or math.isinf(high) else "]"
    interval = f"{'(' if open_low else '['}{low:g}, {high:g}{closing}"

    def check(_instance: object, _attribute: object, value: object) -> None:
        ok = is_finite_number(value) and (
            (low < value if open_low else low <= value) and (value < high if open_high else value <= high)
        )
        if not ok:
            raise ConfigError(f"{label} must be a finite number in {interval}, got {describe(value)}")

    return check


def check_status_log_interval(value: object) -> float | None:
    """Return ``value`` as a float if it is None or a finite number of seconds >=
    :data:`MIN_STATUS_LOG_INTERVAL`; raise ConfigError otherwise."""
    if value is None:
        return None
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        with contextlib.suppress(OverflowError):
            number = float(value)
    if not (math.isfinite(number) and number >= MIN_STATUS_LOG_INTERVAL):
        raise ConfigError(
            "status_log_interval must be None or a finite number of seconds >= "
            f"{MIN_STATUS_LOG_INTERVAL:g}, got {describe(value)}"
        )
    return number


# -- arguments of the buffer's methods (TypeError for a wrong type, ValueError for a value) --


def is_utf8(text: str) -> bool:
    """Whether ``text`` can be encoded as UTF-8, i.e. holds no lone surrogate such as "\\udcff"."""
    if text.isascii():  # the common case, without building the encoded copy
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# A name with a lone surrogate (what os.fsdecode or json.loads("\"\\udcff\"") can produce)
# cannot go into JSON, a log line, a SQLite journal or a Prometheus exposition: every such
# consumer would fail later, far from the call that let it in. So it is refused at the source.
_NOT_UTF8 = "must be encodable as UTF-8 (no lone surrogate: JSON, logs and metrics cannot hold it)"


def check_uid(uid: object) -> str:
    """Return ``uid`` if it is a non-empty str without "_" that UTF-8 can encode.

    Raises:
        TypeError: ``uid`` is not a str.
        ValueError: it is empty, holds "_", or holds a lone surrogate.
    """
    if type(uid) is not str:
        raise TypeError(f"uid must be a str, got {type(uid).__name__}")
    if not uid or "_" in uid:
        raise ValueError(
            "uid must be a non-empty str without '_' (trajectory keys are uid_session_index), "
            f"got {describe(uid)}"
        )
    if not is_utf8(uid):
        raise ValueError(f"uid {_NOT_UTF8}, got {describe(uid)}")
    return uid


def check_step(value: object, name: str = "global_steps") -> int:
    """Return ``value`` if it is an int in ``[0, MAX_INT]`` (bool rejected)."""
    if type(value) is not int:
        raise TypeError(f"{name} must be an int >= 0, got {describe_typed(value)}")
    if not 0 <= value <= MAX_INT:
        raise ValueError(f"{name} must be an int >= 0 (and < 2**63), got {describe(value)}")
    return value


check_index = check_step


def check_batch_size(value: object) -> int:
    """Return ``value`` if it is an int in ``[1, MAX_INT]`` (bool rejected)."""
    if type(value) is not int:
        raise ValueError(f"batch_size must be an int >= 1, got {describe_typed(value)}")
    if not 1 <= value <= MAX_INT:
        raise ValueError(f"batch_size must be an int >= 1 (and < 2**63), got {describe(value)}")
    return value


def check_batch_request(batch_size: object, token_budget: object) -> None:
    """Check that exactly one of ``batch_size`` and ``token_budget`` is given, an int in
    ``[1, MAX_INT]`` (bool rejected).

    Raises:
        ValueError: neither or both given, ``batch_size`` not an int >= 1 (a ValueError, as it
            always was), or ``token_budget`` out of range.
        TypeError: ``token_budget`` is not an int.
    """
    if (batch_size is None) == (token_budget is None):
        raise ValueError(
            "give exactly one of batch_size and token_budget (an int >= 1), got "
            f"batch_size={describe(batch_size)} and token_budget={describe(token_budget)}"
        )
    if token_budget is None:
        check_batch_size(batch_size)
    elif type(token_budget) is not int:
        raise TypeError(f"token_budget must be an int >= 1, got {describe_typed(token_budget)}")
    elif not 1 <= token_budget <= MAX_INT:
        raise ValueError(f"token_budget must be an int >= 1 (and < 2**63), got {describe(token_budget)}")


def check_count(value: object) -> int:
    """Return ``value`` if it is an int in ``[1, MAX_INT]`` (bool rejected): the ``count`` of
    ``wait_for_sampleable``.

    Raises:
        TypeError: ``value`` is not an int (a bool is not).
        ValueError: it is below 1 or above ``MAX_INT``.
    """
    if type(value) is not int:
        raise TypeError(f"count must be an int >= 1, got {describe_typed(value)}")
    if not 1 <= value <= MAX_INT:
        raise ValueError(f"count must be an int >= 1 (and < 2**63), got {describe(value)}")
    return value


def check_generation_seconds(value: object) -> float | None:
    """Return ``value`` as a float if it is None or a finite real number >= 0 (bool rejected):
    a producer's measured generation time.

    Raises:
        TypeError: ``value`` is not None or a real number.
        ValueError: it is negative, NaN, infinite, or too large for a float.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"generation_seconds must be None or a number >= 0, got {describe_typed(value)}")
    try:
        number = float(value)
    except Exception:  # an int too large for a float, or a Real whose __float__ raises
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"generation_seconds must be a finite number of seconds >= 0, got {describe(value)}")
    return number


def check_partition(value: object) -> str:
    """Return ``value`` if it is a non-empty str that UTF-8 can encode.

    Raises:
        TypeError: ``value`` is not a str.
        ValueError: it is empty or holds a lone surrogate.
    """
    if type(value) is not str:
        raise TypeError(f"partition must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError("partition must be a non-empty str")
    if not is_utf8(value):
        raise ValueError(f"partition {_NOT_UTF8}, got {describe(value)}")
    return value


def check_tags(tags: object) -> Mapping[str, Any]:
    """Return a private read-only copy of ``tags`` (None gives the shared empty mapping)."""
    if tags is None:
        return EMPTY_TAGS
    if not isinstance(tags, Mapping):
        raise TypeError(f"tags must be a mapping or None, got {type(tags).__name__}")
    try:
        copied = dict(tags)
    except Exception as exc:  # a user mapping whose iteration or lookup raises
        raise TypeError(f"tags could not be copied: {type(exc).__name__}") from exc
    return MappingProxyType(copied) if copied else EMPTY_TAGS


def check_timeout(value: object) -> float | None:
    """Return ``value`` as a float if it is None or a real >= 0 that fits a float (inf allowed)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {describe_typed(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.nan
    if math.isnan(number) or number < 0:
        raise ValueError(
            f"timeout must be None or a number of seconds >= 0 that fits a float, got {describe(value)}"
        )
    return number


def check_payload_codec(value: object) -> Any:
    """Return ``value`` if it is None or a pair ``(encode, decode)`` of callables; raise
    ConfigError otherwise (the message is the one ``ReplayBuffer.restore`` uses)."""
    if value is not None and not (isinstance(value, tuple) and len(value) == 2 and all(map(callable, value))):
        raise ConfigError("payload_codec must be None or a pair (encode, decode) of callables")
    return value


def check_group_payloads(
    uid: str,
    payloads: object,
    trajectory_tags: object,
    session_ids: object,
    indices: object,
) -> tuple[list[str], tuple[tuple[str, int, int, Mapping[str, Any], Any], ...]]:
    """Check ``put_group``'s per-trajectory arguments; return the keys and one row per
    trajectory ``(key, session_id, index, tags, payload)``.

    Every collection is copied into a tuple first, so one whose iteration raises or whose
    ``len()`` disagrees with what it yields fails here, before anything changes.

    Raises:
        TypeError: ``payloads`` is a str, bytes or mapping, or a collection cannot be iterated.
        ValueError: a per-trajectory collection has another length than ``payloads``, or a
            session id or index is not an int >= 0.
        DuplicateTrajectoryError: two trajectories share a key.
    """
    if isinstance(payloads, (str, bytes, Mapping)) or not isinstance(payloads, Collection):
        raise TypeError(f"payloads must hold one item per trajectory, got {type(payloads).__name__}")
    items = materialise("payloads", payloads)
    n = len(items)
    sessions = tuple(range(n)) if session_ids is None else materialise("session_ids", session_ids)
    positions = (0,) * n if indices is None else materialise("indices", indices)
    tags = (EMPTY_TAGS,) * n if trajectory_tags is None else materialise("trajectory_tags", trajectory_tags)
    for name, values in (("session_ids", sessions), ("indices", positions), ("trajectory_tags", tags)):
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} items for {n} payloads")
    if trajectory_tags is not None:
        tags = tuple(check_tags(t) for t in tags)
    if session_ids is None and indices is None:  # the common case: sessions 0..n-1, distinct
        keys = [f"{uid}_{session_id}_0" for session_id in sessions]
    else:
        keys = []
        for session_id, index in zip(sessions, positions, strict=True):
            check_index(session_id, "session_id")
            check_index(index, "index")
            keys.append(f"{uid}_{session_id}_{index}")
        if len(set(keys)) != n:
            duplicate = next(key for key in keys if keys.count(key) > 1)
            raise DuplicateTrajectoryError(
                f"put_group for {describe(uid)} names trajectory {describe(duplicate)} twice"
            )
    return keys, tuple(zip(keys, sessions, positions, tags, items, strict=True))


def materialise(name: str, values: object) -> tuple[Any, ...]:
    """Copy a collection into a tuple, turning any error of its iteration into a TypeError.

    Raises:
        TypeError: ``values`` is not a collection, or its iteration or ``len()`` raised.
        ValueError: its ``len()`` disagrees with what it yields (a collection that lies).
    """
    if type(values) is tuple or type(values) is list:
        return tuple(values)
    if isinstance(values, (str, bytes)) or not hasattr(type(values), "__iter__"):
        raise TypeError(f"{name} must be a collection with one item per trajectory, got {describe(values)}")
    try:
        # len() before iterating: a collection that empties as it is read said the truth then.
        claimed = len(values) if hasattr(type(values), "__len__") else None  # type: ignore[arg-type]
        items: tuple[Any, ...] = tuple(values)  # type: ignore[arg-type]
    except Exception as exc:
        raise TypeError(f"{name} could not be iterated: {type(exc).__name__}") from exc
    if claimed is not None and claimed != len(items):
        raise ValueError(f"{name} says len() is {claimed} but yielded {len(items)} items")
    return items
