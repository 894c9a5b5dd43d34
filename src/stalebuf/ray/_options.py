"""The options of :class:`~stalebuf.ray.RemoteReplayBuffer`: their checks, and Ray's actor options."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, cast

import ray.cloudpickle

from .._checkpoint_file import PayloadCodec
from .._journal_setup import check_journal_options
from .._restore import check_in_flight
from .._validation import (
    check_payload_codec,
    check_status_log_interval,
    describe,
    describe_error,
    finite_in,
    int_at_least,
    one_of,
)
from ..checkpoint import NOT_GIVEN
from ..errors import ConfigError
from ..filters import GroupFilter, check_filters
from ._protocol import JournalRequest, RecoverRequest, RestoreRequest

__all__ = [
    "PAYLOAD_MODES",
    "PayloadMode",
    "buffer_options",
    "check_options",
    "check_payload_mode",
    "check_remote_filters",
    "check_start_timeout",
    "journal_request",
    "ray_actor_options",
    "recover_request",
    "requested_resources",
    "restore_request",
]

#: Where payload values given to ``put``/``put_group`` go (see :class:`RemoteReplayBuffer`).
PayloadMode = Literal["producer", "actor", "inline"]
PAYLOAD_MODES: tuple[str, ...] = ("producer", "actor", "inline")

#: How Ray pickles what it sends to an actor (untyped in Ray: typed here).
_ray_dumps: Callable[[Any], bytes] = ray.cloudpickle.dumps

_check_payload_mode = one_of("payloads", PAYLOAD_MODES)
_check_start_timeout = finite_in("start_timeout", 0.0, math.inf, open_low=True)
_check_queue_size = int_at_least("eviction_queue_size", 1)


def check_payload_mode(payloads: object) -> None:
    """Raise ConfigError unless ``payloads`` is one of :data:`PAYLOAD_MODES`."""
    _check_payload_mode(None, None, payloads)


def check_start_timeout(start_timeout: object) -> float:
    """Return ``start_timeout`` as a float; raise ConfigError unless it is a finite number > 0."""
    _check_start_timeout(None, None, start_timeout)
    return float(cast("float", start_timeout))


def check_options(
    *,
    status_log_interval: float | None,
    payloads: object,
    eviction_queue_size: object,
    keep_evicted_payloads: object,
    on_evict: object,
    name: object,
    namespace: object,
    actor_options: object,
    start_timeout: object,
) -> None:
    """Check the constructor's options before any actor starts.

    Raises:
        ConfigError: naming the first invalid option.
    """
    if on_evict is not None:
        raise ConfigError(
            "on_evict cannot cross process boundaries; iterate `remote.evictions()` instead "
            "(an async iterator of EvictionEvents)"
        )
    if status_log_interval is not NOT_GIVEN:
        check_status_log_interval(status_log_interval)
    check_payload_mode(payloads)
    _check_queue_size(None, None, eviction_queue_size)
    check_start_timeout(start_timeout)
    if type(keep_evicted_payloads) is not bool:
        raise ConfigError(f"keep_evicted_payloads must be a bool, got {describe(keep_evicted_payloads)}")
    if name is not None and (type(name) is not str or not name):
        raise ConfigError(f"name must be None or a non-empty str, got {describe(name)}")
    if namespace is not None and (type(namespace) is not str or not namespace or name is None):
        raise ConfigError(
            f"namespace must be None or a non-empty str given with a name, got {describe(namespace)}"
        )
    if actor_options is not None and not isinstance(actor_options, Mapping):
        raise ConfigError(f"actor_options must be a mapping or None, got {type(actor_options).__name__}")


def check_remote_filters(filters: object) -> tuple[GroupFilter, ...]:
    """Return ``filters`` as ReplayBuffer checks them, once each pickles as Ray sends it to the
    actor (where the filters run): refused here, before any actor starts.

    Raises:
        ConfigError: ``filters`` is not a sequence of plain (synchronous) callables, or one of
            them cannot be pickled (named).
    """
    checked = check_filters(filters)
    for position, group_filter in enumerate(checked):
        _check_pickles(group_filter, f"filters[{position}]", "filters run")
    return checked


def _check_pickles(value: object, name: str, runs: str) -> None:
    """Raise ConfigError unless ``value`` pickles as Ray sends it to the actor (``runs``: what of
    a remote buffer runs there, for the message)."""
    try:
        _ray_dumps(value)
    except Exception as exc:
        raise ConfigError(
            f"{name} cannot be pickled ({describe_error(exc)}), and a remote buffer's {runs} in its "
            "actor: use a function or a small class that pickles"
        ) from exc


def journal_request(
    journal: object,
    interval: object,
    retention_steps: object,
    max_pending_bytes: object,
    payload_codec: object,
    payloads: object,
) -> JournalRequest | None:
    """Return the journal the client asks its actor's buffer to write (None without one), its
    path made absolute against the caller's working directory, as ``ReplayBuffer`` checks the
    arguments; ``payload_codec`` must also pickle (it runs in the actor).

    Raises:
        ConfigError: a journal argument is invalid, ``payload_codec`` is not None or a pair of
            callables, or does not pickle.
    """
    checked = check_journal_options(journal, interval, retention_steps, max_pending_bytes)
    codec: PayloadCodec | None = check_payload_codec(payload_codec)
    if codec is not None:
        _check_pickles(codec, "payload_codec", "journal is written")
    if checked is None:
        return None
    return JournalRequest(
        os.path.abspath(checked.path),
        checked.interval,
        checked.retention_steps,
        checked.max_pending_bytes,
        codec,
        payloads != "inline",
    )


def restore_request(
    path: object, in_flight: object, payload_codec: object, payloads: object
) -> RestoreRequest:
    """Return what ``RemoteReplayBuffer.restore`` restores from: ``path`` made absolute against the
    caller's working directory, payloads stored again unless ``payloads="inline"``.

    Raises:
        ConfigError: ``in_flight`` is not a mode, or ``payload_codec`` not None or a pair of callables.
        TypeError: ``path`` is not a path.
    """
    codec: PayloadCodec | None = check_payload_codec(payload_codec)
    target = os.path.abspath(os.fspath(cast("str", path)))
    return RestoreRequest(target, check_in_flight(in_flight), codec, payloads != "inline")


def recover_request(
    journal: JournalRequest | None, global_steps: object, partition: object, in_flight: object
) -> RecoverRequest:
    """Return where ``RemoteReplayBuffer.recover`` recovers in ``journal`` (its checked journal
    arguments), checked as ``ReplayBuffer.recover`` checks it.

    Raises:
        ConfigError: ``journal`` is None, ``global_steps`` is not None or an int >= 0,
            ``partition`` is not a str, or ``in_flight`` is not a mode.
    """
    if journal is None:
        raise ConfigError("journal must be a path, got None")
    if global_steps is not None and (type(global_steps) is not int or global_steps < 0):
        raise ConfigError(f"global_steps must be None or an int >= 0, got {describe(global_steps)}")
    if type(partition) is not str:
        raise ConfigError(f"partition must be a str, got {describe(partition)}")
    return RecoverRequest(global_steps, partition, check_in_flight(in_flight))


def buffer_options(
    status_log_interval: tuple[float | None, ...], filters: tuple[GroupFilter, ...]
) -> dict[str, Any]:
    """The keyword options the actor builds its buffer with: ``status_log_interval`` when the
    client gave one (``(interval,)``; ``()`` leaves the built class's own default) and
    ``filters`` when there are some (a custom sampler's constructor need take neither)."""
    options: dict[str, Any] = {"status_log_interval": status_log_interval[0]} if status_log_interval else {}
    if filters:
        options["filters"] = filters
    return options


def ray_actor_options(
    name: str | None, namespace: str | None, get_if_exists: bool, user_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Return the options for ``ray.remote(...).options()``: ours, then the user's, then the name.

    Raises:
        ConfigError: the user's options name the actor (pass ``name=`` etc. instead).
    """
    user = dict(user_options or {})
    for key in ("name", "namespace", "get_if_exists"):
        if key in user:
            raise ConfigError(f"pass {key}= to RemoteReplayBuffer itself, not inside actor_options")
    user.pop("concurrency_groups", None)  # given to ray.remote, see actor_class
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000}
    options.update(user)
    if name is not None:
        options["name"] = name
        options["get_if_exists"] = get_if_exists
        if namespace is not None:
            options["namespace"] = namespace
    return options


def requested_resources(options: Mapping[str, Any]) -> dict[str, float]:
    """Return the resources an actor with these options asks Ray for, by Ray's names (for saying
    which one no node has); values that are not numbers are left out."""
    wanted: dict[str, Any] = {
        "CPU": options.get("num_cpus"),
        "GPU": options.get("num_gpus"),
        "memory": options.get("memory"),
    }
    extra = options.get("resources")
    if isinstance(extra, Mapping):
        wanted.update(extra)
    return {
        str(key): float(value)
        for key, value in wanted.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    }
