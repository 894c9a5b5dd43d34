"""An inference server that embeds the buffer: rollouts come in over HTTP, a trainer samples.

One Starlette app, served by uvicorn, owns one ReplayBuffer on its event loop:

- ``POST /groups``: an ``async`` handler; ``await buffer.put_group(...)`` on the loop.
- ``POST /groups_sync``: a plain ``def`` handler, which Starlette runs on its worker threads
  (where blocking engine code would live); it reaches the buffer through ``buffer.threadsafe()``
  and its ``put_group_nowait``, so a full buffer answers 429 rather than holding a worker thread
  (the handle's ``put_group`` would block it until admitted, like ``queue.Queue.put``).
- ``GET /stats``: the buffer's stats and the trainer's progress as JSON (``?uids=1`` adds which
  groups were trained, evicted, or are still resident).
- ``GET /metrics``: Prometheus text, from :mod:`stalebuf.prometheus`.
- a trainer, a background task on the same loop, that samples, "trains" and logs metrics.

Both POST bodies are JSON: ``{"uid": "p1", "payloads": [...], "global_steps": 3, "status":
"finished", "partition": "train"}``. ``global_steps`` may be omitted or null (the group is
tagged with the clock), ``status`` may be "failure", and the trainer samples "train" (the
default partition). The server takes groups for a fixed set of partitions only ("train" and
"val" by default; ``create_app(partitions=...)``, ``--partitions`` or the
``STALEBUF_SERVER_PARTITIONS`` environment variable, comma-separated, set another): each one a
client could name would otherwise stay in the buffer, in ``/stats`` and in ``/metrics`` for good.

Answers: 200 ``{"keys": [...], "dispatch_step": n}``. Every refusal is a JSON body
``{"error": "<error class>", "detail": "<message>"}``: 400 for a malformed body, invalid
arguments, a uid or partition that UTF-8 cannot encode (a lone surrogate such as ``"\\udcff"``)
or a partition not served (``UnknownPartitionError``); 404/405 for an unknown path or method;
409 for a uid already in the buffer; 429 with ``Retry-After`` when admission control refuses
the group (``/groups_sync``: no slot now; ``/groups`` waits for a slot, so there only for an
explicit ``global_steps`` closed for good or ahead of the clock, errors ``TagClosedError`` and
``FutureTagError``: resend with null); 503 once closed.

Run: ``pip install 'stalebuf[examples]'`` then ``python examples/inference_server.py --port 8000``.
"""

from __future__ import annotations

import argparse
import http
import json
import logging
import os
import reprlib
import threading
from collections.abc import AsyncIterator, Collection, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.from_thread
import attrs
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import stalebuf.prometheus
from stalebuf import EvictionEvent, ReplayBuffer, SamplerConfig
from stalebuf.errors import (
    BufferClosedError,
    BufferFullError,
    DuplicateGroupError,
    GroupEvictedError,
    InvalidTransitionError,
)

logger = logging.getLogger("inference_server")

#: The example's defaults: stale groups (s > 2) are dropped, failed groups evicted.
DEFAULT_CONFIG = SamplerConfig(
    max_off_policy_threshold=2, max_off_policy_strategy="drop", failure_strategy="evict"
)
#: The partitions served when neither ``partitions=`` nor the environment names them: "train",
#: which the trainer samples, and "val", exempt by SamplerConfig's default (kept for evaluation).
DEFAULT_PARTITIONS = ("train", "val")
#: The environment variable that names the served partitions, comma-separated.
PARTITIONS_ENV = "STALEBUF_SERVER_PARTITIONS"
#: Seconds a client refused by admission control should wait: a slot opens when the trainer
#: samples, which it does every step (far below a second here; HTTP allows whole seconds only).
RETRY_AFTER = "1"


class UnknownPartitionError(ValueError):
    """The body names a partition this server does not serve."""


def served_partitions(names: object = None) -> frozenset[str]:
    """Return the partitions to serve: ``names``, else the environment's, else the defaults.

    Raises:
        ValueError: ``names`` is not a list, tuple or set, a name is not a non-empty str that
            UTF-8 can encode (the environment's may hold surrogate escapes of bad bytes), or
            "train" (the trainer's partition, and a body's default) is missing.
    """
    if names is None:
        names = split_names(os.environ.get(PARTITIONS_ENV, "")) or DEFAULT_PARTITIONS
    if isinstance(names, str) or not isinstance(names, (list, tuple, set, frozenset)):
        raise ValueError(f"partitions must be a collection of names, got {type(names).__name__}")
    for name in names:
        if type(name) is not str or not name or not _utf8(name):
            raise ValueError(f"a partition name must be a non-empty UTF-8 str, got {reprlib.repr(name)}")
    if "train" not in names:
        raise ValueError(f"the served partitions must include 'train' (the trainer's), got {sorted(names)}")
    return frozenset(names)


def split_names(text: str) -> list[str]:
    """Return the comma-separated names in ``text``, stripped, without empty ones."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _utf8(text: str) -> bool:
    # A lone surrogate (json.loads('"\\udcff"') makes one) cannot be encoded: no JSON answer,
    # log line or metric could show it, so such a name is refused before the buffer sees it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Ledger:
    """What the server saw happen to the groups it accepted, for ``/stats``.

    The sync handler records acceptances from worker threads, everything else runs on the
    loop; one lock keeps ``/stats`` from reading a set while a thread adds to it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.accepted: set[str] = set()
        self.trained: list[str] = []
        self.evicted: dict[str, list[str]] = {}
        self.steps = 0

    def accept(self, uid: str) -> None:
        with self.lock:
            self.accepted.add(uid)

    def on_evict(self, event: EvictionEvent) -> None:
        with self.lock:
            self.evicted.setdefault(event.reason, []).extend(group.uid for group in event.groups)


@attrs.frozen
class GroupRequest:
    """A parsed POST body."""

    uid: Any
    payloads: Any
    global_steps: Any
    status: Any
    partition: Any

    @classmethod
    def parse(cls, body: bytes, partitions: frozenset[str] = frozenset(DEFAULT_PARTITIONS)) -> GroupRequest:
        """Parse a JSON body for a server of ``partitions`` (default: :data:`DEFAULT_PARTITIONS`);
        the buffer itself checks the rest.

        Raises:
            ValueError: not JSON (or nested too deeply to parse), not a JSON object, ``uid`` or
                ``payloads`` is missing, or ``uid`` is a str UTF-8 cannot encode.
            UnknownPartitionError: ``partition`` is not one of ``partitions``.
        """
        try:
            data = json.loads(body)
        except RecursionError:  # "[[[[...": valid JSON too deep for the parser, still a bad body
            raise ValueError("the body is nested too deeply") from None
        if not isinstance(data, dict) or "uid" not in data or "payloads" not in data:
            raise ValueError('the body must be a JSON object with "uid" and "payloads"')
        uid, partition = data["uid"], data.get("partition", "train")
        if type(uid) is str and not _utf8(uid):  # the buffer checks every other kind of bad uid
            raise ValueError(f"uid must be encodable as UTF-8 (no lone surrogate), got {reprlib.repr(uid)}")
        if type(partition) is not str or partition not in partitions:
            raise UnknownPartitionError(
                f"partition {reprlib.repr(partition)} is not served here; this server serves "
                f"{', '.join(map(repr, sorted(partitions)))}"
            )
        return cls(uid, data["payloads"], data.get("global_steps"), data.get("status", "finished"), partition)


#: The errors a bad or untimely request gets from parsing or from the buffer, and the status
#: each answers; the first match wins (DuplicateGroupError is also a ValueError).
CLIENT_ERRORS: tuple[tuple[type[Exception], int], ...] = (
    (DuplicateGroupError, 409),  # the uid is in the buffer
    (InvalidTransitionError, 409),
    (GroupEvictedError, 409),
    (BufferFullError, 429),
    (BufferClosedError, 503),
    (TypeError, 400),
    (ValueError, 400),  # UnknownPartitionError among them
)
_CLIENT_ERROR_TYPES = tuple(kind for kind, _ in CLIENT_ERRORS)


def _error(status_code: int, exc: BaseException, headers: Mapping[str, str] | None = None) -> JSONResponse:
    # Defence in depth: a message quoting a lone surrogate would make the JSON answer itself fail.
    detail = str(exc).encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": type(exc).__name__, "detail": detail}
    return JSONResponse(body, status_code=status_code, headers=headers)


def _refusal(exc: Exception) -> JSONResponse:
    """The answer to one of :data:`CLIENT_ERRORS` (429 says when to retry)."""
    status = next(code for kind, code in CLIENT_ERRORS if isinstance(exc, kind))
    return _error(status, exc, {"Retry-After": RETRY_AFTER} if status == 429 else None)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown path, wrong method) as JSON, like every other one."""
    if not isinstance(exc, HTTPException):  # registered for HTTPException only
        raise exc
    body = {"error": http.HTTPStatus(exc.status_code).phrase.replace(" ", ""), "detail": exc.detail}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _answer(buffer: ReplayBuffer, keys: list[str]) -> JSONResponse:
    return JSONResponse({"keys": keys, "dispatch_step": buffer.dispatch_step()})


async def post_group(request: Request) -> Response:
    """Add a whole group from the event loop (waits for admission when the buffer is full)."""
    state = request.state
    try:
        group = GroupRequest.parse(await request.body(), state.partitions)
        keys = await state.buffer.put_group(
            group.uid,
            group.payloads,
            global_steps=group.global_steps,
            status=group.status,
            partition=group.partition,
        )
    except _CLIENT_ERROR_TYPES as exc:  # BufferFullError: a global_steps closed for good
        return _refusal(exc)
    state.ledger.accept(group.uid)
    return _answer(state.buffer, keys)


def post_group_sync(request: Request) -> Response:
    """Add a whole group from a worker thread, through the buffer's threadsafe handle."""
    state = request.state
    try:
        # Reading the body is async: run it on the loop, from this worker thread.
        group = GroupRequest.parse(anyio.from_thread.run(request.body), state.partitions)
        keys = state.producer.put_group_nowait(  # never blocks a worker thread: 429 instead
            group.uid,
            group.payloads,
            global_steps=group.global_steps,
            status=group.status,
            partition=group.partition,
        )
    except _CLIENT_ERROR_TYPES as exc:  # BufferFullError: no slot now (put_group_nowait)
        return _refusal(exc)
    state.ledger.accept(group.uid)
    # dispatch_step reads one int: harmless from this thread, unlike calls that walk the state.
    return _answer(state.buffer, keys)


async def get_stats(request: Request) -> Response:
    """The buffer's stats and the trainer's progress (with ``?uids=1``, the groups' fates)."""
    state = request.state
    buffer: ReplayBuffer = state.buffer
    ledger: Ledger = state.ledger
    stats = buffer.stats()
    body: dict[str, Any] = {
        "closed": stats.closed,
        "partitions": {name: attrs.asdict(item) for name, item in stats.partitions.items()},
        "total": attrs.asdict(stats.total),
        "trainer": {"steps": ledger.steps, "trained_groups": len(ledger.trained)},
    }
    if request.query_params.get("uids", "0").lower() not in ("0", "false", "no", ""):
        with ledger.lock:  # one consistent snapshot: this handler runs on the loop, atomically
            settled = set(ledger.trained).union(*ledger.evicted.values())
            unsettled = ledger.accepted - settled
            body["uids"] = {
                "accepted": sorted(ledger.accepted),
                "trained": list(ledger.trained),
                "evicted": {reason: list(uids) for reason, uids in ledger.evicted.items()},
                "resident": sorted(uid for uid in unsettled if uid in buffer),
                "lost": sorted(uid for uid in unsettled if uid not in buffer),
            }
    return JSONResponse(body)


async def get_metrics(request: Request) -> Response:
    """Prometheus text: on the loop's thread, the collector reads ``stats()`` directly."""
    return Response(generate_latest(request.state.registry), media_type=CONTENT_TYPE_LATEST)


async def train(buffer: ReplayBuffer, ledger: Ledger, batch_size: int, step_seconds: float) -> None:
    """The trainer: sample a batch per step, "train" on it, log its metrics; stop at close."""
    step = 0
    while True:
        try:
            batch, metrics = await buffer.sample(step, batch_size)
        except BufferClosedError:
            logger.info("trainer: buffer closed after %d steps", step)
            return
        with ledger.lock:
            ledger.trained.extend(batch.uids)
            ledger.steps = step + 1
        if step % 10 == 0:
            logger.info(
                "step %d: %d groups, staleness mean %.2f, waited %.1f ms, dropped %d",
                step,
                len(batch),
                metrics["training/off_policy/sampled_staleness/mean"],
                metrics["training/off_policy/wait_seconds"] * 1000,
                metrics.get("training/off_policy/dropped_groups", 0),
            )
        await anyio.sleep(step_seconds)  # the optimizer step
        step += 1


def create_app(
    config: SamplerConfig = DEFAULT_CONFIG,
    *,
    partitions: Collection[str] | None = None,
    batch_size: int = 8,
    step_seconds: float = 0.01,
) -> Starlette:
    """Build the app; the buffer, its metrics and the trainer live as long as the server runs.

    ``partitions`` are the ones clients may post to (None: :func:`served_partitions`' default).

    Raises:
        ValueError: ``partitions`` is invalid (see :func:`served_partitions`).
    """
    served = served_partitions(partitions)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[Mapping[str, Any]]:
        ledger = Ledger()
        buffer = ReplayBuffer(config, on_evict=ledger.on_evict)
        registry = CollectorRegistry()
        # Inside the running loop: the collector and the handle both remember this loop.
        collector = stalebuf.prometheus.register(buffer, registry)
        producer = buffer.threadsafe()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(train, buffer, ledger, batch_size, step_seconds)
            yield {
                "buffer": buffer,
                "producer": producer,
                "ledger": ledger,
                "registry": registry,
                "partitions": served,
            }
            buffer.close()  # wakes the trainer, which returns; blocked producers get 503
        collector.unregister()

    routes = [
        Route("/groups", post_group, methods=["POST"]),
        Route("/groups_sync", post_group_sync, methods=["POST"]),
        Route("/stats", get_stats, methods=["GET"]),
        Route("/metrics", get_metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})


app = create_app()


def main() -> None:
    """Serve :data:`app` with uvicorn (port 0 picks a free port; the log line names it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--partitions", help=f"comma-separated partitions to serve (default: ${PARTITIONS_ENV} or train,val)"
    )
    args = parser.parse_args()
    served = app
    if args.partitions is not None:
        try:
            served = create_app(partitions=split_names(args.partitions))
        except ValueError as exc:
            parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(served, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
