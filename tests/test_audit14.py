"""Defects found by an independent audit of issues 14 (ecosystem) and 9 (architecture).

Each test failed before its fix: a latency file or value the CLI turned into a traceback or a
hang, a report line comparing a run with itself, a policy whose config silently disagreed
with the buffer's, and an example server that answered a valid-but-deep JSON body with 500.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from stalebuf import ReplayBuffer, SamplerConfig, StalenessPolicy
from stalebuf.cli import main
from stalebuf.errors import ConfigError
from stalebuf.simulate import Latency, SimulationConfig, format_report, simulate

SMALL = ["--steps", "3", "--batch-size", "2", "--group-size", "1", "--workers", "2", "--no-progress"]
ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8", newline="")
    return str(path)


# -- stalebuf simulate: empirical latency files ----------------------------------------------


def test_a_csv_with_bare_carriage_return_line_endings_is_read(tmp_path: Path) -> None:
    """Old spreadsheet exports end rows with a lone CR; csv raised "new-line character seen
    in unquoted field" through the CLI as a traceback."""
    path = write(tmp_path, "times.csv", "uid,seconds\ra,12.5\rb,30\r")
    assert Latency.parse(f"empirical:{path}#seconds").params == (12.5, 30.0)


def test_a_csv_field_over_the_csv_size_limit_is_one_error_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "big.csv", "seconds\n" + "1" * 200_000 + "\n")
    assert main(["simulate", *SMALL, "--latency", f"empirical:{path}#seconds"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("stalebuf simulate: error: argument --latency: empirical latency")


@pytest.mark.parametrize("spec", ["fixed:1e308", "exponential:1e300"])
def test_a_huge_parametric_latency_is_refused_with_exit_2(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """fixed:1e308 used to end in an OverflowError traceback, and 1e300 in a report of
    300-digit numbers (the virtual clock had lost the train step to rounding)."""
    assert main(["simulate", *SMALL, "--latency", spec]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "argument --latency" in err


def test_a_huge_empirical_time_is_refused(tmp_path: Path) -> None:
    """An empirical file of 1e308 made `stalebuf simulate` run forever."""
    path = write(tmp_path, "times.txt", "30\n1e308\n")
    with pytest.raises(ConfigError, match=r"line 2"):
        Latency.parse(f"empirical:{path}")
    with pytest.raises(ConfigError):
        Latency("empirical", (30.0, 1e308))


def test_a_huge_train_step_is_refused() -> None:
    """--train-step-seconds 1e308 made `stalebuf simulate` run forever."""
    with pytest.raises(ConfigError, match="train_step_seconds"):
        SimulationConfig(train_step_seconds=1e308)


def test_the_largest_accepted_times_still_run() -> None:
    from stalebuf.simulate._latency import MAX_SECONDS

    config = SimulationConfig(
        steps=2,
        batch_size=2,
        group_size=1,
        workers=2,
        latency=Latency("fixed", (MAX_SECONDS,)),
        train_step_seconds=MAX_SECONDS,
    )
    assert simulate(config).staleness.max >= 1


def test_the_verdict_does_not_compare_a_run_with_itself() -> None:
    """With every column tied, the report said "drop trains 1.00x as many groups per hour as drop"."""
    common = {
        "steps": 1,
        "batch_size": 1,
        "group_size": 1,
        "workers": 1,
        "threshold": 1,
        "failure_rate": 0.0,
        "latency": Latency("fixed", (1.0,)),
        "train_step_seconds": 1.0,
        "dispatch_ahead": 0.0,
    }
    results = [
        simulate(SimulationConfig(strategy=strategy, admission=admission, **common))  # type: ignore[arg-type]
        for strategy in ("drop", "wait")
        for admission in (False, True)
    ]
    report = format_report(results)
    assert "as many groups per hour as drop." not in report
    assert " 1.00x as many groups per hour" not in report


# -- issue 9: the policy answers every rule ---------------------------------------------------


def test_a_policy_built_from_another_config_sets_the_rules_and_the_reported_staleness() -> None:
    """The policy answers every rule question; the staleness a batch and its metrics report
    used the config's S while the rules used the policy's. Now both use the policy's."""
    config = SamplerConfig(max_off_policy_threshold=2, parameter_sync_step=2)
    other = StalenessPolicy(SamplerConfig(max_off_policy_threshold=8, parameter_sync_step=4))
    buf = ReplayBuffer(config, policy=other, status_log_interval=None)
    buf.put_group_nowait("a", [1], global_steps=0)
    batch, metrics = buf.sample_nowait(7, 1)  # s = 8/4 = 2 under the policy (8/2 = 4 > 2 under config)
    assert batch.uids == ["a"]
    assert batch.parameter_sync_step == 4
    assert list(batch.staleness) == [2.0]
    assert metrics["training/off_policy/sampled_staleness/mean"] == 2.0
    # The same config, or only the policy, is fine too.
    assert ReplayBuffer(config, policy=StalenessPolicy(config)).policy.config == config
    assert ReplayBuffer(policy=other).config == other.config


# -- examples/inference_server.py ------------------------------------------------------------


def load_example() -> ModuleType:
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    name = "_audit14_inference_server"
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "inference_server.py")
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
    """``[[[[...]]]]`` is valid JSON that json.loads cannot parse (RecursionError): the server
    answered 500 and reset the connection, where its docs promise 400 for a malformed body."""
    example = load_example()
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError, match="nested too deeply"):
        example.GroupRequest.parse(deep)


def test_a_closed_stdout_is_no_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Started with stdout closed (``stalebuf simulate >&-``), Python sets ``sys.stdout`` to
    None: ``print`` drops the report, but the final flush raised AttributeError with a traceback."""
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["simulate", *SMALL]) == 0
