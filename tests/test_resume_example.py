"""``examples/resume.py`` (issue 12): a trainer SIGKILLed mid-run restarts from its last checkpoint
and its ledger balances. CI runs the example through this test, in both ``in_flight`` modes that
suit a crashed trainer; the ledger check itself is tested on ledgers that do not balance."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import stalebuf

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "resume.py"


@pytest.mark.parametrize("in_flight", ["reissue", "evict"])
def test_the_example_crashes_resumes_and_balances(in_flight: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(stalebuf.__file__).resolve().parent.parent)}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--in-flight", in_flight],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "with SIGKILL" in out
    assert "restored step" in out
    assert "the ledger balances" in out
    assert "saved step 10" in out
    # Everything the killed trainer printed comes before the kill (it was printed before it).
    first_run, after_kill = out.split("[supervisor] killed trainer", 1)
    killed_pid = re.findall(r"\[trainer (\d+)\]", first_run)[-1]
    assert f"[trainer {killed_pid}]" not in after_kill


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("resume_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def balanced() -> dict[str, Any]:
    return {
        "dispatched": {"p0": 1, "p1": 1, "p2": 2},
        "trained": {"p0": 1, "p2": 2},
        "evicted": {"p1": "stale"},
        "twice": [],
        "reissued": ["p2"],
        "resident": 0,
        "stats": {
            "admitted_groups": 3,
            "sampled_groups": 2,
            "evicted_stale_groups": 1,
            "evicted_failure_groups": 0,
            "evicted_restart_groups": 0,
            "reissued_groups": 1,
        },
    }


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda ledger: None, None),
        (lambda ledger: ledger["twice"].append("p0"), "trained twice"),
        (lambda ledger: ledger["evicted"].pop("p1"), "neither trained nor evicted"),
        (lambda ledger: ledger["evicted"].update(p0="stale"), "trained and evicted"),
        (lambda ledger: ledger.update(resident=1), "left in the buffer"),
        (lambda ledger: ledger["stats"].update(sampled_groups=3), "sampled_groups=3"),
        (lambda ledger: ledger["trained"].update(p9=3), "never dispatched"),
    ],
)
def test_the_ledger_check_catches_what_does_not_balance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any, problem: str | None
) -> None:
    ledger = balanced()
    change(ledger)
    (tmp_path / "final.json").write_text(json.dumps(ledger))
    assert load_example().report(tmp_path) is (problem is None)
    out = capsys.readouterr().out
    if problem is None:
        assert "the ledger balances" in out
    else:
        assert "LEDGER DOES NOT BALANCE: " in out
        assert problem in out
