"""An inference server that embeds the buffer: rollouts come in over HTTP, a trainer samples.

One Starlette app, served by uvicorn, owns one ReplayBuffer on its event loop:

- ``POST /groups``: an ``async`` handler; ``await buffer.put_group(...)`` on the loop.
- ``POST /groups_sync``: a plain ``def`` handler, which Starlette runs on its worker threads
  (where blocking engine code would live); it reaches the buffer through ``buffer.threadsafe()``.
- ``GET /stats``: the buffer's stats and the trainer's progress as JSON (``?uids=1`` adds which
  groups were trained, evicted, or are still resident).
- ``GET /metrics``: Prometheus text, from :mod:`stalebuf.prometheus`.
- a trainer, a background task on the same loop, that samples, "trains" and logs metrics.

Both POST bodies are JSON: ``{"uid": "p1", "payloads": [...], "global_steps": 3, "status":
"finished", "partition": "train"}``. ``global_steps`` may be omitted or null (the group is
tagged with the clock), ``status`` may be "failure", and the trainer samples "train" (the
default partition). Answers: 200 ``{"keys": [...], "dispatch_step": n}``, 400 for a malformed
body or invalid arguments, 409 for a uid already in the buffer, 429 when admission control has
no slot (``/groups_sync`` only: ``/groups`` waits for one), 503 once closed.

Run: ``pip install 'stalebuf[examples]'`` then ``python examples/inference_server.py --port 8000``.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.from_thread
import attrs
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import stalebuf.prometheus
from stalebuf import EvictionEvent, ReplayBuffer, SamplerConfig
from stalebuf.errors import BufferClosedError, BufferFullError, DuplicateGroupError, InvalidTransitionError

logger = logging.getLogger("inference_server")

#: The example's defaults: stale groups (s > 2) are dropped, failed groups evicted.
DEFAULT_CONFIG = SamplerConfig(
    max_off_policy_threshold=2, max_off_policy_strategy="drop", failure_strategy="evict"
)


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
    def parse(cls, body: bytes) -> GroupRequest:
        """Parse a JSON body; the buffer itself checks the values.

        Raises:
            ValueError: not JSON (or nested too deeply to parse), not a JSON object, or ``uid``
                or ``payloads`` is missing.
        """
        try:
            data = json.loads(body)
        except RecursionError:  # "[[[[...": valid JSON too deep for the parser, still a bad body
            raise ValueError("the body is nested too deeply") from None
        if not isinstance(data, dict) or "uid" not in data or "payloads" not in data:
            raise ValueError('the body must be a JSON object with "uid" and "payloads"')
        return cls(
            data["uid"],
            data["payloads"],
            data.get("global_steps"),
            data.get("status", "finished"),
            data.get("partition", "train"),
        )


def _error(status_code: int, exc: BaseException) -> JSONResponse:
    return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=status_code)


def _answer(buffer: ReplayBuffer, keys: list[str]) -> JSONResponse:
    return JSONResponse({"keys": keys, "dispatch_step": buffer.dispatch_step()})


async def post_group(request: Request) -> Response:
    """Add a whole group from the event loop (waits for admission when the buffer is full)."""
    state = request.state
    try:
        group = GroupRequest.parse(await request.body())
        keys = await state.buffer.put_group(
            group.uid,
            group.payloads,
            global_steps=group.global_steps,
            status=group.status,
            partition=group.partition,
        )
    except (DuplicateGroupError, InvalidTransitionError) as exc:  # the uid is in the buffer
        return _error(409, exc)
    except BufferClosedError as exc:
        return _error(503, exc)
    except (TypeError, ValueError) as exc:
        return _error(400, exc)
    state.ledger.accept(group.uid)
    return _answer(state.buffer, keys)


def post_group_sync(request: Request) -> Response:
    """Add a whole group from a worker thread, through the buffer's threadsafe handle."""
    state = request.state
    try:
        # Reading the body is async: run it on the loop, from this worker thread.
        group = GroupRequest.parse(anyio.from_thread.run(request.body))
        keys = state.producer.put_group(
            group.uid,
            group.payloads,
            global_steps=group.global_steps,
            status=group.status,
            partition=group.partition,
        )
    except (DuplicateGroupError, InvalidTransitionError) as exc:  # the uid is in the buffer
        return _error(409, exc)
    except BufferFullError as exc:  # the threadsafe handle never waits for admission
        return _error(429, exc)
    except BufferClosedError as exc:
        return _error(503, exc)
    except (TypeError, ValueError) as exc:
        return _error(400, exc)
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
    config: SamplerConfig = DEFAULT_CONFIG, *, batch_size: int = 8, step_seconds: float = 0.01
) -> Starlette:
    """Build the app; the buffer, its metrics and the trainer live as long as the server runs."""

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
            yield {"buffer": buffer, "producer": producer, "ledger": ledger, "registry": registry}
            buffer.close()  # wakes the trainer, which returns; blocked producers get 503
        collector.unregister()

    routes = [
        Route("/groups", post_group, methods=["POST"]),
        Route("/groups_sync", post_group_sync, methods=["POST"]),
        Route("/stats", get_stats, methods=["GET"]),
        Route("/metrics", get_metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


app = create_app()


def main() -> None:
    """Serve :data:`app` with uvicorn (port 0 picks a free port; the log line names it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
