"""``stalebuf simulate --filter-pass-rate`` and ``--tasks``: the real zero-variance filter and a
task mixture inside the simulated pipeline, their report rows, their errors, and a default
report left as it was.

Runs use small settings so that the module takes a few seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest

from stalebuf.cli import main
from stalebuf.errors import ConfigError
from stalebuf.simulate import Latency, SimulatedTask, SimulationConfig, TaskMix, format_report, simulate

SMALL = ["--steps", "20", "--batch-size", "4", "--group-size", "2", "--workers", "8"]
TASKS = "math:0.5:lognormal:3.4,1;code:0.5:lognormal:4.0,1.2"
LABELS = ["drop", "drop+admission", "wait", "wait+admission"]
# A small run whose tasks differ only in speed: code takes about three times as long.
SLOW_CODE: dict[str, Any] = {
    "steps": 40,
    "batch_size": 4,
    "group_size": 2,
    "workers": 8,
    "train_step_seconds": 10.0,
    "tasks": TaskMix.parse("math:1:lognormal:1.6,0.5;code:1:lognormal:2.7,0.5"),
}


def run(*args: str, tmp_path: Path | None = None) -> tuple[str, dict[str, Any] | None]:
    """Run ``stalebuf simulate --no-progress`` in-process; return its report (and JSON results
    when ``tmp_path`` is given)."""
    argv = ["simulate", "--no-progress", *args]
    path = None if tmp_path is None else tmp_path / "out.json"
    if path is not None:
        argv += ["--json", str(path)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    report = out.getvalue()
    if path is None:
        return report, None
    report = report.removesuffix(f"wrote {path}\n")
    return report, json.loads(path.read_text(encoding="utf-8"))["results"]


# -- the default report is untouched ------------------------------------------------------


def test_without_the_new_flags_nothing_new_is_printed_or_written(tmp_path: Path) -> None:
    report, results = run(*SMALL, tmp_path=tmp_path)
    assert results is not None
    for line in ("filter", "task", "trainer steps per simulated hour", "pass rate"):
        assert line not in report
    for result in results.values():
        assert "filters" not in result
        assert "tasks" not in result
        for key in ("filter_pass_rate", "tasks", "mixture_policy"):
            assert key not in result["config"]


def test_a_pass_rate_of_one_is_the_default_run_byte_for_byte() -> None:
    """At P = 1 no filter is installed (every group would pass), so the report is the default's."""
    assert run(*SMALL)[0] == run(*SMALL, "--filter-pass-rate", "1")[0]
    assert (
        run(*SMALL, "--in-flight-updates")[0]
        == run(*SMALL, "--in-flight-updates", "--filter-pass-rate", "1.0")[0]
    )


# -- the filter ----------------------------------------------------------------------------


def test_the_filter_rows_and_numbers(tmp_path: Path) -> None:
    report, results = run(*SMALL, "--filter-pass-rate", "0.5", tmp_path=tmp_path)
    assert results is not None
    assert list(results) == LABELS
    assert "filter: zero_variance('score'), a finished group passes with probability 50.0%" in report
    for row in (
        "trainer steps per simulated hour",
        "groups filtered (zero variance)",
        "  pass rate observed",
    ):
        assert f"\n{row} " in report
    for result in results.values():
        filters, config = result["filters"], result["config"]
        assert config["filter_pass_rate"] == 0.5
        assert 0 < filters["filtered_groups"] < filters["judged_groups"]
        assert filters["pass_rate"] == pytest.approx(
            1 - filters["filtered_groups"] / filters["judged_groups"]
        )
        assert (
            result["trained_groups"] == config["steps"] * config["batch_size"]
        )  # exact batches all the same
        assert 0.0 < filters["filtered_fraction"] < 1.0
        assert 0.0 < filters["filtered_generation_fraction"] < 1.0


def test_the_observed_pass_rate_is_the_configured_one() -> None:
    """Over a long run the share of judged groups that pass is within 5 standard deviations
    (about 1 in 3.5 million to fail by chance, for a fixed seed: never) of P."""
    for rate in (0.5, 0.2):
        config = SimulationConfig(
            steps=150, batch_size=8, group_size=2, workers=16, admission=True, filter_pass_rate=rate
        )
        filters = simulate(config).filters
        assert filters is not None
        assert filters.judged_groups >= 1000
        sigma = math.sqrt(rate * (1 - rate) / filters.judged_groups)
        assert abs(filters.pass_rate - rate) <= 5 * sigma


def test_with_admission_a_filtered_group_frees_its_slot_and_workers_stay_busy() -> None:
    """With admission, filtered groups refund their slots: workers generate more of the time
    than without filtering, and every batch is still full; without admission, the hand-paced
    pipeline trains fewer steps per hour."""
    settings: dict[str, Any] = {"steps": 60, "batch_size": 4, "group_size": 2, "workers": 8}
    for strategy in ("drop", "wait"):
        kept = simulate(SimulationConfig(strategy=strategy, admission=True, **settings))
        halved = simulate(
            SimulationConfig(strategy=strategy, admission=True, filter_pass_rate=0.5, **settings)
        )
        assert halved.worker_utilization > kept.worker_utilization
        assert halved.worker_utilization + halved.admission_wait_fraction == pytest.approx(1.0)
        assert halved.trained_groups == kept.trained_groups
        plain = simulate(SimulationConfig(strategy=strategy, **settings))
        plain_halved = simulate(SimulationConfig(strategy=strategy, filter_pass_rate=0.5, **settings))
        assert plain_halved.trained_groups_per_hour < plain.trained_groups_per_hour


def test_the_filter_draws_do_not_change_the_prompts() -> None:
    """The pass draws come from their own stream: prompt k has the same generation time at
    every pass rate (so runs at two rates differ only in which groups are filtered)."""
    settings: dict[str, Any] = {
        "steps": 10,
        "batch_size": 4,
        "group_size": 2,
        "workers": 8,
        "admission": True,
    }
    one = simulate(SimulationConfig(**settings))
    half = simulate(SimulationConfig(filter_pass_rate=0.5, **settings))
    assert one.length_bias.long_seconds == half.length_bias.long_seconds
    assert one.length_bias.mean_seconds_dispatched == half.length_bias.mean_seconds_dispatched


def test_filtering_with_in_flight_updates() -> None:
    report, _ = run(*SMALL, "--in-flight-updates", "--filter-pass-rate", "0.5")
    assert "\ngroups filtered (zero variance) " in report


# -- tasks --------------------------------------------------------------------------------


def test_the_tasks_rows_and_numbers(tmp_path: Path) -> None:
    report, results = run(*SMALL, "--tasks", TASKS, tmp_path=tmp_path)
    assert results is not None
    assert list(results) == LABELS
    assert "    math: weight 0.5, 2 of 4 per batch, lognormal:3.4,1" in report
    assert "    code: weight 0.5, 2 of 4 per batch, lognormal:4,1.2" in report
    assert "task math: trained share (target 50.0%)" in report
    assert "           max staleness" in report
    for result in results.values():
        tasks = result["tasks"]
        assert list(tasks) == ["math", "code"]
        assert result["config"]["tasks"] == "math:0.5:lognormal:3.4,1;code:0.5:lognormal:4,1.2"
        assert result["config"]["mixture_policy"] == "wait"
        assert sum(task["trained_groups"] for task in tasks.values()) == result["trained_groups"]
        assert sum(task["dispatched_groups"] for task in tasks.values()) == result["dispatched_groups"]
        for task in tasks.values():
            # "wait": every batch takes each task's quota exactly.
            assert task["trained_share"] == task["target_share"] == 0.5
            assert task["staleness"]["max"] <= result["staleness"]["max"]


@pytest.mark.parametrize("admission", [False, True])
def test_wait_keeps_the_shares_and_borrow_lends_to_the_fast_task(admission: bool) -> None:
    """A slow code task: "wait" trains each task at its quota, every batch; "borrow" fills
    code's shortfall from math, so math trains more than its share and the run goes faster."""
    common = {**SLOW_CODE, "admission": admission, "strategy": "drop", "threshold": 2}
    wait = simulate(SimulationConfig(mixture_policy="wait", **common))
    borrow = simulate(SimulationConfig(mixture_policy="borrow", **common))
    assert wait.tasks is not None
    assert borrow.tasks is not None
    assert [t.trained_share for t in wait.tasks] == [0.5, 0.5]
    math_share, code_share = (t.trained_share for t in borrow.tasks)
    assert math_share > 0.5 > code_share
    assert math_share + code_share == pytest.approx(1.0)
    assert borrow.trained_groups == wait.trained_groups
    assert borrow.trained_groups_per_hour > wait.trained_groups_per_hour


def test_the_hard_bound_holds_per_task_under_wait_and_admission() -> None:
    config = SimulationConfig(**SLOW_CODE, strategy="wait", admission=True, threshold=2)
    result = simulate(config)
    assert result.tasks is not None
    assert all(task.staleness.max <= config.threshold for task in result.tasks)


def test_a_task_without_a_latency_takes_the_runs() -> None:
    mix = TaskMix.parse("a:3;b:1:fixed:2")
    config = SimulationConfig(tasks=mix, latency=Latency.parse("fixed:7"), batch_size=4)
    assert config.task_latency("a") == Latency.parse("fixed:7")
    assert config.task_latency("b") == Latency.parse("fixed:2")
    assert mix.split(4) == {"a": 3, "b": 1}
    assert str(mix) == "a:3;b:1:fixed:2"
    assert TaskMix.parse(str(mix)) == mix
    assert TaskMix.parse(" a:3 ; b:1:fixed:2 ;") == mix
    with pytest.raises(KeyError):
        config.task_latency("c")


def test_tasks_and_a_filter_together_with_in_flight_updates() -> None:
    report, _ = run(
        *SMALL,
        "--in-flight-updates",
        "--tasks",
        "a:1;b:1",
        "--filter-pass-rate",
        "0.5",
        "--mixture-policy",
        "borrow",
    )
    assert "\ntask a: trained share" in report
    assert "\n  pass rate observed " in report


# -- reproducibility -------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--in-flight-updates"]])
def test_same_seed_same_json_with_the_new_flags(tmp_path: Path, extra: list[str]) -> None:
    """Producers of different tasks admitted at one instant run in trio's order: each task
    draws from streams of its own, and the result walks the prompts task by task."""
    args = [*SMALL, *extra, "--tasks", TASKS, "--filter-pass-rate", "0.5", "--mixture-policy", "borrow"]
    for name in "abc":
        (tmp_path / name).mkdir()
    first = run(*args, "--seed", "3", tmp_path=tmp_path / "a")
    second = run(*args, "--seed", "3", tmp_path=tmp_path / "b")
    other = run(*args, "--seed", "4", tmp_path=tmp_path / "c")
    assert first == second
    assert first[1] != other[1]


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--filter-pass-rate", "0"], "argument --filter-pass-rate: filter_pass_rate must be"),
        (["--filter-pass-rate", "0.001"], "argument --filter-pass-rate: filter_pass_rate must be"),
        (["--filter-pass-rate", "1.5"], "argument --filter-pass-rate: filter_pass_rate must be"),
        (["--filter-pass-rate", "nan"], "argument --filter-pass-rate: filter_pass_rate must be"),
        (["--filter-pass-rate", "half"], "argument --filter-pass-rate: invalid float value"),
        (
            ["--filter-pass-rate", "0.5", "--group-size", "1"],
            "filter_pass_rate below 1 needs group_size >= 2",
        ),
        (["--tasks", ""], "argument --tasks: tasks must be NAME:WEIGHT[:LATENCY]"),
        (["--tasks", ";"], "argument --tasks: tasks must be NAME:WEIGHT[:LATENCY]"),
        (["--tasks", "math"], "argument --tasks: task 'math' must be NAME:WEIGHT"),
        (["--tasks", "math:heavy"], "argument --tasks: task 'math': weight must be a number > 0"),
        (["--tasks", "math:0"], "argument --tasks: task weight must be a finite number > 0"),
        (["--tasks", "math:-1"], "argument --tasks: task weight must be a finite number > 0"),
        (["--tasks", "math:inf"], "argument --tasks: task weight must be a finite number > 0"),
        (["--tasks", ":1"], "argument --tasks: task name must be a non-empty str"),
        (["--tasks", "math:1:gamma:2"], "argument --tasks: task 'math': latency must look like"),
        (
            ["--tasks", "math:1:lognormal:3"],
            "argument --tasks: task 'math': lognormal latency needs MU,SIGMA",
        ),
        (["--tasks", "a:1;a:2"], "argument --tasks: tasks must have distinct names, got 'a' twice"),
        (["--tasks", ";".join(f"t{i}:1" for i in range(65))], "argument --tasks: tasks must name 1 to 64"),
        (["--tasks", "a:1;b:0.01"], "tasks: task 'b' gets none of the 4 groups of a batch"),
        (
            ["--tasks", "a:1;b:0.1", "--batch-size", "16", "--workers", "4"],
            "tasks: task 'b' gets none of the 4 workers",
        ),
        (["--mixture-policy", "sometimes"], "argument --mixture-policy: invalid choice"),
        (["--mixture-policy", "borrow"], "argument --mixture-policy: only with --tasks"),
        (["--mixture-policy", "wait"], "argument --mixture-policy: only with --tasks"),
    ],
)
def test_bad_values_are_one_line_naming_the_flag_and_exit_2(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *SMALL, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("stalebuf simulate: error: "), captured.err
    assert needle in captured.err, captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    "kwargs",
    [
        {"filter_pass_rate": 0.0},
        {"filter_pass_rate": 1.01},
        {"filter_pass_rate": "0.5"},
        {"filter_pass_rate": True},
        {"tasks": "a:1"},  # a spec: TaskMix.parse reads it
        {"tasks": {"a": 1}},
        {"mixture_policy": "sometimes"},
        {"mixture_policy": "borrow"},  # without tasks
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    (field,) = kwargs
    with pytest.raises(ConfigError, match=f"^{field} "):  # the message names the field
        SimulationConfig(**kwargs)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: SimulatedTask("a", 0), "task weight"),
        (lambda: SimulatedTask("a", True), "task weight"),
        (lambda: SimulatedTask("a;b", 1), "task name"),
        (lambda: SimulatedTask(" a", 1), "task name"),
        (lambda: SimulatedTask("a", 1, "fixed:1"), "task latency"),
        (lambda: TaskMix(()), "tasks must name 1 to"),
        (lambda: TaskMix("a:1"), "tasks must be a sequence"),
        (lambda: TaskMix(5), "tasks must be a sequence"),
        (lambda: TaskMix(("a",)), "tasks must hold SimulatedTask"),
    ],
)
def test_task_records_reject_bad_values(make: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make()


def test_the_help_lists_the_new_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--filter-pass-rate P" in text
    assert "(default: 1.0)" in text
    assert "--tasks SPECS" in text
    assert "NAME:WEIGHT[:LATENCY]" in text
    assert "--mixture-policy {wait,borrow}" in text
    assert "(default: wait)" in text


def test_format_report_puts_the_rows_of_both() -> None:
    config = SimulationConfig(
        steps=5, batch_size=2, group_size=2, workers=4, tasks=TaskMix.parse("a:1;b:1"), filter_pass_rate=0.5
    )
    report = format_report([simulate(config)])
    assert "\ntask b:" in report
    assert "\ngroups filtered" in report
