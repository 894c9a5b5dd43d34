"""examples/inference_server.py as a real uvicorn process under 50 concurrent HTTP producers.

The producers post groups to both endpoints (the async one and the threadpool one) while the
server's trainer samples; some groups come in failed and some with an old dispatch step, so
both eviction reasons happen. Then every accepted group must be accounted for exactly once,
through ``/stats``, and ``/metrics`` must parse and agree with it.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest

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
    assert value[("stalebuf_sample_staleness_count", train)] >= stats["trainer"]["steps"]


def test_the_example_server_accounts_for_every_group_under_fifty_concurrent_producers(
    server: Server,
) -> None:
    _load_and_check(server.url)
    assert server.stop() == 0  # SIGINT: uvicorn's graceful shutdown, then the lifespan's close()
    text = server.log.read_text()
    assert re.search(r"inference_server INFO step \d+: 8 groups, staleness mean", text), text[-2000:]
    assert "trainer: buffer closed after" in text, text[-2000:]
    assert "Traceback" not in text, text[-4000:]


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
