"""examples/inference_server.py: as a real uvicorn process under load, and its refusals.

The load test starts the example as a uvicorn process; 50 concurrent producers post groups to
both endpoints (the async one and the threadpool one) while the server's trainer samples; some
groups come in failed and some with an old dispatch step, so both eviction reasons happen. Then
every accepted group must be accounted for exactly once, through ``/stats``, and ``/metrics``
must parse and agree with it.

The refusal tests (issue 21, items 6 and 13) run the app in this process (its lifespan, then
requests through ``httpx.ASGITransport``): every client error is a 4xx with a JSON body, a full
buffer is 429 with ``Retry-After``, and only the configured partitions take groups.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest

from _helpers import LIMIT

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "inference_server.py"
PRODUCERS = 50
LOAD_SECONDS = 3.0
START_TIMEOUT = 30.0


class Server:
    """The example running as a uvicorn process: its URL, its log, and how to stop it."""

    def __init__(self, process: subprocess.Popen[bytes], log: Path) -> None:
        self.process = process
        self.log = log
        self.url = f"http://127.0.0.1:{self._wait_for_port()}"

    def stop(self) -> int:
        """Send SIGINT (as Ctrl+C would) and return the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:  # pragma: no cover - only if shutdown hangs
            self.process.kill()
            self.process.wait()
            raise

    def _wait_for_port(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", self.log.read_text())
            if found:
                return int(found.group(1))
            if self.process.poll() is not None:
                pytest.fail(f"the server exited with {self.process.returncode}:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.process.kill()
        pytest.fail(f"the server did not start within {START_TIMEOUT} s:\n{self.log.read_text()}")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """Start the example on a free port of 127.0.0.1 (port 0; the log names it); stop it after."""
    log = tmp_path / "server.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    with log.open("wb") as out:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--host", "127.0.0.1", "--port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        yield Server(process, log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def _produce(client: Any, index: int, stop_at: float, posted: dict[str, set[str]]) -> None:
    """Post groups until ``stop_at``, alternating endpoints; record what was accepted where."""
    rng = random.Random(index)
    step = 0
    number = 0
    while time.monotonic() < stop_at:
        uid = f"p{index}n{number}"
        number += 1
        endpoint = "/groups" if (index + number) % 2 else "/groups_sync"
        body = {
            "uid": uid,
            "payloads": [{"tokens": [number, session], "reward": rng.random()} for session in range(4)],
            # Some generations "took" several trainer steps: sent with the step they started at.
            "global_steps": max(0, step - rng.choice((0, 0, 1, 3, 5))),
            "status": "failure" if rng.random() < 0.1 else "finished",
        }
        response = await client.post(endpoint, json=body)
        assert response.status_code == 200, response.text
        step = response.json()["dispatch_step"]
        posted[endpoint].add(uid)


def _load_and_check(url: str) -> None:
    async def main() -> None:
        posted: dict[str, set[str]] = {"/groups": set(), "/groups_sync": set()}
        limits = httpx.Limits(max_connections=PRODUCERS)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30.0) as client:
            stop_at = time.monotonic() + LOAD_SECONDS
            with anyio.fail_after(LOAD_SECONDS + 60):
                async with anyio.create_task_group() as tasks:
                    for index in range(PRODUCERS):
                        tasks.start_soon(_produce, client, index, stop_at, posted)
            # "val" is exempt and the trainer never samples it: the group stays, so the second
            # post is a duplicate for sure.
            kept = {"uid": "kept", "payloads": [1], "partition": "val"}
            assert (await client.post("/groups_sync", json=kept)).status_code == 200
            posted["/groups_sync"].add("kept")
            duplicate = await client.post("/groups", json=kept)
            malformed = await client.post("/groups_sync", content=b"not json")
            stats = (await client.get("/stats", params={"uids": "1"})).json()
            assert "uids" not in (await client.get("/stats", params={"uids": "0"})).json()
            assert "uids" not in (await client.get("/stats")).json()
            metrics_text = (await client.get("/metrics")).text
        assert duplicate.status_code == 409
        assert malformed.status_code == 400
        _check_accounting(posted, stats)
        _check_metrics(metrics_text, stats, sum(map(len, posted.values())))

    anyio.run(main)


def _check_accounting(posted: dict[str, set[str]], stats: dict[str, Any]) -> None:
    # Every producer posts at least once, its first post to the endpoint of its index's parity.
    assert len(posted["/groups"]) >= PRODUCERS // 2, "the async endpoint must have been driven"
    assert len(posted["/groups_sync"]) >= PRODUCERS // 2, "the threadpool endpoint must have been driven"
    everything = posted["/groups"] | posted["/groups_sync"]
    uids = stats["uids"]
    assert set(uids["accepted"]) == everything
    trained, resident = uids["trained"], uids["resident"]
    evicted = [uid for reason_uids in uids["evicted"].values() for uid in reason_uids]
    assert set(uids["evicted"]) <= {"stale", "failure"}
    # 8 of the producers' first posts are failed groups (the seeds are fixed).
    assert uids["evicted"].get("failure"), "failed groups are evicted with reason 'failure'"
    fates = trained + evicted + resident
    assert len(fates) == len(set(fates)), "a group was trained or evicted twice"
    assert set(fates) == everything
    assert uids["lost"] == []
    assert "kept" in resident
    total = stats["total"]
    assert len(resident) == total["pending"] + total["running"] + total["finished"] + total["failure"]
    assert total["admitted_groups"] == len(everything)
    assert stats["trainer"]["steps"] > 0


def _check_metrics(text: str, stats: dict[str, Any], accepted: int) -> None:
    families = {family.name: family for family in parser.text_string_to_metric_families(text)}
    value = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families.values()
        for sample in family.samples
    }
    train = (("partition", "train"),)
    assert value[("stalebuf_up", ())] == 1.0
    assert families["stalebuf_admitted_groups"].type == "counter"
    admitted = value[("stalebuf_admitted_groups_total", train)]
    assert admitted + value[("stalebuf_admitted_groups_total", (("partition", "val"),))] == accepted
    # The trainer keeps going between /stats and /metrics: counts only grow.
    assert value[("stalebuf_sampled_groups_total", train)] >= stats["total"]["sampled_groups"]
    for reason in ("stale", "failure"):
        labels = (("partition", "train"), ("reason", reason))
        assert value[("stalebuf_evicted_groups_total", labels)] >= stats["total"][f"evicted_{reason}_groups"]
    assert families["stalebuf_sample_wait_seconds"].type == "histogram"
    assert value[("stalebuf_sample_wait_seconds_count", train)] >= stats["trainer"]["steps"]
    assert value[("stalebuf_sampled_staleness_versions_count", train)] >= stats["trainer"]["steps"]


def test_the_example_server_accounts_for_every_group_under_fifty_concurrent_producers(
    server: Server,
) -> None:
    _load_and_check(server.url)
    assert server.stop() == 0  # SIGINT: uvicorn's graceful shutdown, then the lifespan's close()
    text = server.log.read_text()
    assert re.search(r"inference_server INFO step \d+: 8 groups, staleness mean", text), text[-2000:]
    assert "trainer: buffer closed after" in text, text[-2000:]
    assert "Traceback" not in text, text[-4000:]


# -- refusals, in process (issue 21, items 6 and 13) ------------------------------------------

SURROGATE = "\udcff"  # a lone surrogate: what json.loads makes of the 6 characters \\udcff


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """The example module, imported from its file (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("inference_server_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[Any]:
    """Run ``app``'s lifespan (its buffer and trainer) and yield an httpx client that calls it."""
    async with app.router.lifespan_context(app) as state:

        async def with_state(scope: Any, receive: Any, send: Any) -> None:
            scope["state"] = dict(state)  # what uvicorn hands each request from the lifespan
            await app(scope, receive, send)

        # raise_app_exceptions=False: a handler that raises answers 500, as under uvicorn.
        transport = httpx.ASGITransport(app=with_state, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://example") as client:
            yield client


async def post(client: Any, path: str, body: dict[str, Any]) -> Any:
    """POST ``body`` as ASCII JSON (a lone surrogate travels as the escape \\udcff, as a
    hostile client would send it; httpx's ``json=`` could not encode it)."""
    return await client.post(path, content=json.dumps(body).encode("ascii"))


def refused(response: Any, status: int, error: str) -> dict[str, Any]:
    """Check ``response`` is a JSON refusal ``{"error": error, "detail": ...}``; return it."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json", response.headers
    body: dict[str, Any] = response.json()
    assert body["error"] == error, body
    assert isinstance(body.get("detail"), str), body
    return body


async def still_answers(client: Any) -> tuple[dict[str, Any], str]:
    """``/stats?uids=1`` and ``/metrics`` still answer 200; return the stats and the metrics text."""
    stats, metrics = await client.get("/stats", params={"uids": "1"}), await client.get("/metrics")
    assert stats.status_code == 200, stats.text
    assert metrics.status_code == 200, metrics.text
    return stats.json(), metrics.text


ENDPOINTS = ("/groups", "/groups_sync")


@pytest.mark.anyio
async def test_a_lone_surrogate_uid_is_400_and_stats_keeps_answering(example: ModuleType) -> None:
    """Item 6: a uid "\\udcff" was admitted, its answer was a 500, and /stats?uids=1 a 500 for good."""
    async with serving(example.create_app()) as client:
        for path in ENDPOINTS:
            for uid in (SURROGATE, "a" + SURROGATE):
                body = refused(await post(client, path, {"uid": uid, "payloads": [1]}), 400, "ValueError")
                assert "UTF-8" in body["detail"]
        stats, _ = await still_answers(client)
    assert stats["uids"]["accepted"] == []
    assert stats["total"]["admitted_groups"] == 0


@pytest.mark.anyio
async def test_a_lone_surrogate_partition_is_400_and_metrics_keeps_answering(example: ModuleType) -> None:
    """Item 6: a partition "\\udcff" was admitted, then /metrics and /stats answered 500 for good."""
    async with serving(example.create_app()) as client:
        for path in ENDPOINTS:
            body = {"uid": f"u{len(path)}", "payloads": [1], "partition": SURROGATE}
            refused(await post(client, path, body), 400, "UnknownPartitionError")
        stats, _ = await still_answers(client)
    assert set(stats["partitions"]) <= {"train", "val"}


def admission(example: ModuleType) -> Any:
    """An app under admission control, T=1 and one group per step, that trains one group a step."""
    config = example.SamplerConfig(max_off_policy_threshold=1, admission_batch_size=1)
    return example.create_app(config, batch_size=1, step_seconds=0.0)


@pytest.mark.anyio
async def test_an_old_global_steps_under_admission_is_429_with_retry_after(example: ModuleType) -> None:
    """Item 6: under admission, /groups with a global_steps closed for good raised
    BufferFullError out of the handler: a 500 (and /groups_sync's 429 had no Retry-After)."""
    async with serving(admission(example)) as client:
        with anyio.fail_after(LIMIT):
            step = number = 0
            while step < 3:  # the trainer takes each group: the clock moves on
                number += 1
                response = await post(client, "/groups", {"uid": f"g{number}", "payloads": [1]})
                assert response.status_code == 200, response.text
                step = response.json()["dispatch_step"]
        for path in ENDPOINTS:
            response = await post(client, path, {"uid": "late", "payloads": [1], "global_steps": 0})
            # The error names the subclass: a client can tell "closed for good" from "full now".
            assert "closed for good" in refused(response, 429, "TagClosedError")["detail"]
            assert response.headers["retry-after"] == example.RETRY_AFTER
        await still_answers(client)


@pytest.mark.anyio
async def test_no_slot_now_on_the_sync_endpoint_is_429_with_retry_after(example: ModuleType) -> None:
    """Item 6: a full buffer must say when to retry (the sync endpoint's 429 had no Retry-After)."""
    config = example.SamplerConfig(max_off_policy_threshold=1, admission_batch_size=1)
    # The trainer waits for 1000 groups: step 0 stays the clock's, and its one slot stays taken.
    async with serving(example.create_app(config, batch_size=1000)) as client:
        assert (await post(client, "/groups_sync", {"uid": "first", "payloads": [1]})).status_code == 200
        response = await post(client, "/groups_sync", {"uid": "second", "payloads": [1]})
        refused(response, 429, "BufferFullError")
        assert int(response.headers["retry-after"]) >= 1


@pytest.mark.anyio
async def test_a_partition_not_served_is_400_and_creates_nothing(example: ModuleType) -> None:
    """Item 13: any partition a client named was created: 3,000 POSTs left 3,000 untrainable
    groups and grew /metrics a thousandfold, for good."""
    async with serving(example.create_app()) as client:
        for index in range(40):
            path = ENDPOINTS[index % 2]
            body = {"uid": f"u{index}", "payloads": [1], "partition": f"p{index}"}
            detail = refused(await post(client, path, body), 400, "UnknownPartitionError")["detail"]
            assert f"'p{index}'" in detail
            assert "'train', 'val'" in detail
        for partition in (None, ["train"], {"train": 1}, 7, ""):
            body = {"uid": "odd", "payloads": [1], "partition": partition}
            refused(await post(client, "/groups", body), 400, "UnknownPartitionError")
        for partition in ("train", "val"):
            response = await post(
                client, "/groups", {"uid": partition, "payloads": [1], "partition": partition}
            )
            assert response.status_code == 200, response.text
        stats, after = await still_answers(client)
    assert set(stats["partitions"]) <= {"train", "val"}
    assert stats["uids"]["accepted"] == ["train", "val"]
    labels = {
        sample.labels.get("partition")
        for family in parser.text_string_to_metric_families(after)
        for sample in family.samples
    }
    assert labels == {None, "train", "val"}, "a partition no client may use reached /metrics"


@pytest.mark.anyio
async def test_the_served_partitions_are_configurable(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 13: the fixed set of partitions comes from ``partitions=``, else the environment."""
    monkeypatch.setenv(example.PARTITIONS_ENV, " train , eval ,")
    for app, served, refused_partition in (
        (example.create_app(partitions=["train", "math"]), "math", "val"),
        (example.create_app(), "eval", "val"),
    ):
        async with serving(app) as client:
            body = {"uid": "a", "payloads": [1], "partition": served}
            assert (await post(client, "/groups_sync", body)).status_code == 200
            body["partition"] = refused_partition
            refused(await post(client, "/groups", body), 400, "UnknownPartitionError")


@pytest.mark.parametrize(
    "partitions",
    [["val"], ["train", ""], ["train", SURROGATE], "train", ["train", 3], []],
    ids=["no-train", "empty-name", "surrogate", "a-str", "an-int", "none"],
)
def test_a_bad_set_of_partitions_is_refused_when_the_app_is_built(
    example: ModuleType, partitions: Any
) -> None:
    """Item 13: the served set is checked once, up front (the trainer needs "train")."""
    with pytest.raises(ValueError, match="partition"):
        example.create_app(partitions=partitions)


@pytest.mark.parametrize("value", ["val,eval", "train,\udcff"], ids=["no-train", "a-bad-byte"])
def test_a_bad_partition_list_in_the_environment_is_refused(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """Item 13: the environment's list is checked like ``partitions=`` (a byte that is not
    UTF-8 reaches Python as a lone surrogate)."""
    monkeypatch.setenv(example.PARTITIONS_ENV, value)
    with pytest.raises(ValueError, match="partition"):
        example.create_app()


def test_a_bad_partitions_option_is_a_usage_error(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 13: ``--partitions`` without "train" exits 2 with a usage message, not a traceback."""
    monkeypatch.setattr(sys, "argv", ["inference_server.py", "--partitions", "val,eval"])
    with pytest.raises(SystemExit) as exit_info:
        example.main()
    assert exit_info.value.code == 2


@pytest.mark.anyio
async def test_every_refusal_is_json(example: ModuleType) -> None:
    """Item 6: every client error is a 4xx with a JSON body (an unknown path or method was
    Starlette's plain text)."""
    async with serving(example.create_app()) as client:
        refused(await client.get("/nope"), 404, "NotFound")
        refused(await client.get("/groups"), 405, "MethodNotAllowed")
        for path in ENDPOINTS:
            refused(await client.post(path, content=b"not json"), 400, "JSONDecodeError")
            refused(await client.post(path, content=b"\xff\xfe not json"), 400, "UnicodeDecodeError")
            refused(await client.post(path, content=b"[1]"), 400, "ValueError")
            refused(await client.post(path, content=b"[" * 100_000), 400, "ValueError")
            refused(await post(client, path, {"uid": 7, "payloads": [1]}), 400, "TypeError")
            refused(await post(client, path, {"uid": "a_b", "payloads": [1]}), 400, "ValueError")
            refused(
                await post(client, path, {"uid": "s", "payloads": [1], "status": SURROGATE}),
                400,
                "ValueError",
            )
            refused(
                await post(client, path, {"uid": "g", "payloads": [1], "global_steps": 1.5}), 400, "TypeError"
            )
        kept = {"uid": "v", "payloads": [1], "partition": "val"}  # exempt, never trained: it stays
        assert (await post(client, "/groups", kept)).status_code == 200
        for path in ENDPOINTS:
            refused(await post(client, path, kept), 409, "InvalidTransitionError")  # a late write


# -- the example's request parser, in-process --------------------------------------------------------


def load_example() -> ModuleType:
    """Import examples/inference_server.py as a module (it is not a package)."""
    name = "_inference_server_example"
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # attrs looks the module up by name
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_the_example_answers_a_deeply_nested_body_with_a_value_error() -> None:
    """Defect: ``[[[[...]]]]`` is valid JSON that json.loads cannot parse (RecursionError): the
    server answered 500 and reset the connection, where its docs promise 400 for a malformed
    body."""
    example = load_example()
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError, match="nested too deeply"):
        example.GroupRequest.parse(deep)
