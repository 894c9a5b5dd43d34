"""The simulator and the ``stalebuf simulate`` command line.

Runs use small settings so that the whole module takes a few seconds; one test runs the
real ``python -m stalebuf simulate`` in a subprocess, the others call ``main`` in-process.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

import stalebuf.cli
import stalebuf.errors
import stalebuf.simulate
from stalebuf.cli import main
from stalebuf.errors import ConfigError
from stalebuf.simulate import Latency, MissingDependencyError, SimulationConfig, _model, simulate
from stalebuf.simulate._bounds import MAX_BATCH_SIZE, MAX_GROUP_SIZE, MAX_STEP_TRAJECTORIES, MAX_WORKERS

SMALL = ["--steps", "30", "--batch-size", "4", "--group-size", "2", "--workers", "8"]
# Tight enough that drop evicts something and wait has to wait.
TIGHT = [*SMALL, "--threshold", "1", "--latency", "lognormal:2.3,1.0", "--train-step-seconds", "5"]
# The four runs of the default command line, in the order the report prints them.
LABELS = ["drop", "drop+admission", "wait", "wait+admission"]
README = Path(__file__).resolve().parent.parent / "README.md"
SIMULATE_PAGE = README.parent / "docs" / "simulate.md"


def run_json(tmp_path: Path, *args: str, name: str = "out.json") -> dict[str, Any]:
    """Run ``stalebuf simulate`` in-process with ``args`` and return its JSON document."""
    path = tmp_path / name
    assert main(["simulate", *args, "--json", str(path)]) == 0
    document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return document


# -- end to end -----------------------------------------------------------------------


def test_python_dash_m_runs_end_to_end(tmp_path: Path) -> None:
    path = tmp_path / "sim.json"
    proc = subprocess.run(
        [sys.executable, "-m", "stalebuf", "simulate", *SMALL, "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no progress bar when stderr is not a TTY
    assert "trained groups per simulated hour" in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if line.strip().startswith("drop"))
    assert header.split() == LABELS
    document = json.loads(path.read_text(encoding="utf-8"))
    assert list(document["results"]) == LABELS
    for label, result in document["results"].items():
        assert result["config"]["admission"] == label.endswith("+admission")


def column_headers(out: str) -> list[list[str]]:
    """The report's header lines: those made only of run labels."""
    return [line.split() for line in out.splitlines() if line.split() and set(line.split()) <= set(LABELS)]


def test_single_strategy_without_admission_prints_one_column(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL, "--strategy", "wait", "--admission", "off"]) == 0
    out = capsys.readouterr().out
    assert column_headers(out) == [["wait"]]
    assert "as many groups per hour" not in out  # the comparison needs two runs


@pytest.mark.parametrize(
    ("argv", "labels"),
    [
        (["--strategy", "wait"], ["wait", "wait+admission"]),
        (["--strategy", "drop", "--admission", "both"], ["drop", "drop+admission"]),
        (["--admission", "off"], ["drop", "wait"]),
        (["--admission", "on"], ["drop+admission", "wait+admission"]),
        (["--strategy", "drop", "--admission", "on"], ["drop+admission"]),
    ],
)
def test_strategy_and_admission_choose_the_columns(
    tmp_path: Path, argv: list[str], labels: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    document = run_json(tmp_path, *SMALL, "--steps", "5", *argv)
    out = capsys.readouterr().out
    assert column_headers(out) == [labels]
    assert list(document["results"]) == labels
    for label in labels:
        assert document["results"][label]["config"]["strategy"] == label.split("+")[0]
        assert document["results"][label]["config"]["admission"] == ("+" in label)
    if len(labels) == 2:
        fast, slow = sorted(labels, key=lambda k: -document["results"][k]["trained_groups_per_hour"])
        assert f"\n{fast} trains " in out
        assert f" as many groups per hour as {slow}.\n" in out


def test_the_four_way_verdict_names_every_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *TIGHT]) == 0
    out = capsys.readouterr().out
    verdict = out.split("\n\n")[-1].splitlines()
    assert "as many groups per hour as" in verdict[0]
    assert [line.split()[0] for line in verdict[1:]] == LABELS
    assert all(line.endswith(";") for line in verdict[1:-1])
    assert verdict[-1].endswith(".")


class Terminal(io.StringIO):
    """A stderr that says it is a terminal, so that the progress bar is drawn into it."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_names_each_run_and_shows_an_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["simulate", *SMALL, "--steps", "4"]) == 0
    frames = [frame for frame in terminal.getvalue().split("\r") if frame.strip()]
    runs = [re.match(r"(\d)/4 (.*?) +\d+%", frame) for frame in frames]
    assert all(runs), frames
    named = {(int(run[1]), run[2]) for run in runs if run}
    assert named == {(i + 1, label) for i, label in enumerate(LABELS)}  # "2/4 drop+admission"
    assert {frame.index("%") for frame in frames} == {frames[0].index("%")}  # aligned, whatever the label
    assert all(re.search(r"step \d+/16, ETA (\?|\d\d:\d\d)$", frame) for frame in frames), frames
    assert terminal.getvalue().endswith("\r")  # the bar is cleared: the report replaces it
    assert not terminal.getvalue().rstrip("\r").split("\r")[-1].strip()


def test_no_progress_bar_with_no_progress_or_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["simulate", *SMALL, "--steps", "2", "--no-progress"]) == 0
        monkeypatch.setitem(sys.modules, "tqdm", None)  # the bar is optional: no tqdm, no bar
        assert main(["simulate", *SMALL, "--steps", "2"]) == 0
    assert terminal.getvalue() == ""


def test_report_lists_every_number(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *TIGHT]) == 0
    out = capsys.readouterr().out
    for label in (
        "trained groups per simulated hour",
        "trainer idle fraction",
        "rollouts dropped as stale",
        "mean wait per step",
        "staleness of trained groups: mean",
        "p50",
        "p95",
        "max",
        "long prompts",
    ):
        assert label in out


# -- sanity laws ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--threshold", "2", "--parameter-sync-step", "2"],
        ["--failure-rate", "0.3", "--failure-strategy", "sample"],
        ["--failure-rate", "0.3", "--workers", "2", "--dispatch-ahead", "2"],
    ],
)
def test_numbers_obey_the_sanity_laws(tmp_path: Path, extra: list[str]) -> None:
    results = run_json(tmp_path, *TIGHT, *extra)["results"]
    assert list(results) == LABELS
    threshold = results["drop"]["config"]["threshold"]
    for label in ("wait", "wait+admission"):
        assert results[label]["dropped_groups"] == 0
        assert results[label]["dropped_fraction"] == 0.0
        assert results[label]["wasted_generation_fraction"] == 0.0
    # drop never trains above T; wait+admission neither (the hard bound), plain wait may.
    for label in ("drop", "drop+admission", "wait+admission"):
        assert results[label]["staleness"]["max"] <= threshold
        assert all(item["staleness"] <= threshold for item in results[label]["staleness"]["histogram"])
    for result in results.values():
        config = result["config"]
        if config["admission"]:
            assert config["capacity"] == threshold * config["parameter_sync_step"] * config["batch_size"]
            assert config["batch_size"] <= result["max_resident_groups"] <= config["capacity"]
            # A worker is always generating or waiting for admission, never idle otherwise.
            assert result["worker_utilization"] + result["admission_wait_fraction"] == pytest.approx(1.0)
        else:
            assert config["capacity"] is None
            assert result["max_resident_groups"] == config["dispatch_budget"]
            assert result["admission_wait_fraction"] == 0.0
        assert 0.0 <= result["trainer_idle_fraction"] <= 1.0
        assert 0.0 <= result["worker_utilization"] <= 1.0
        assert result["trained_groups"] == config["steps"] * config["batch_size"]
        assert sum(item["groups"] for item in result["staleness"]["histogram"]) == result["trained_groups"]
        assert result["resolved_groups"] <= result["dispatched_groups"]
        assert result["trained_groups"] + result["dropped_groups"] <= result["resolved_groups"]
        staleness = result["staleness"]
        assert 1 / config["parameter_sync_step"] <= staleness["p50"] <= staleness["p95"] <= staleness["max"]
        steps = result["steps"]
        assert steps["step"] == list(range(config["steps"]))
        assert steps["train_end"][-1] == pytest.approx(result["simulated_seconds"])
        idle = sum(e - s for s, e in zip(steps["sample_start"], steps["train_start"], strict=True))
        assert idle / result["simulated_seconds"] == pytest.approx(result["trainer_idle_fraction"])
        assert idle / config["steps"] == pytest.approx(result["mean_wait_seconds"])
        assert result["trained_groups_per_hour"] == pytest.approx(
            result["trained_groups"] * 3600 / result["simulated_seconds"]
        )


def test_the_tradeoff_shows_up() -> None:
    """With a tight threshold, drop evicts (mostly long prompts) and wait idles more."""
    settings: dict[str, Any] = {
        "threshold": 1,
        "steps": 40,
        "batch_size": 4,
        "workers": 8,
        "latency": Latency.parse("lognormal:2.3,1.0"),
        "train_step_seconds": 5.0,
    }
    drop = simulate(SimulationConfig(strategy="drop", **settings))
    wait = simulate(SimulationConfig(strategy="wait", **settings))
    assert drop.dropped_groups > 0
    assert 0.0 < drop.dropped_fraction < 1.0
    assert drop.wasted_generation_fraction > drop.dropped_fraction  # dropped groups are the long ones
    assert drop.length_bias.ratio < 1.0
    assert drop.length_bias.mean_seconds_trained < drop.length_bias.mean_seconds_dispatched
    assert wait.length_bias.ratio == pytest.approx(1.0, abs=0.25)
    assert wait.trainer_idle_fraction > drop.trainer_idle_fraction


# -- admission ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """The report and JSON results of ``stalebuf simulate`` with every default (about 4 s)."""
    path = tmp_path_factory.mktemp("default") / "default.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["simulate", "--json", str(path)]) == 0
    results: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))["results"]
    wrote = f"wrote {path}\n"
    assert out.getvalue().endswith(wrote)
    return out.getvalue().removesuffix(wrote), results


def test_admission_does_what_it_promises_at_the_default_settings(
    default_run: tuple[str, dict[str, Any]],
) -> None:
    _, results = default_run
    assert list(results) == LABELS
    threshold = results["wait+admission"]["config"]["threshold"]
    assert results["wait+admission"]["staleness"]["max"] <= threshold
    assert results["wait+admission"]["dropped_groups"] == 0
    wasted = {label: result["wasted_generation_fraction"] for label, result in results.items()}
    assert wasted["drop+admission"] < wasted["drop"]


def test_the_docs_show_the_default_run_exactly(default_run: tuple[str, dict[str, Any]]) -> None:
    """docs/simulate.md pastes the whole default report; the README an excerpt of its lines."""
    report, _ = default_run
    pasted = SIMULATE_PAGE.read_text(encoding="utf-8").split("```text\n", 1)[1].split("```", 1)[0]
    assert pasted == report
    section = README.read_text(encoding="utf-8").split("## `stalebuf simulate`", 1)[1]
    excerpt = section.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    lines = iter(report.splitlines())
    assert len(excerpt) >= 8
    assert all(line in lines for line in excerpt), "the README's excerpt is not the report's lines, in order"


def test_admission_ignores_the_dispatch_budget() -> None:
    """With admission the workers dispatch whenever the buffer admits: --dispatch-ahead is unused."""
    settings: dict[str, Any] = {"admission": True, "threshold": 2, "steps": 20, "batch_size": 4, "workers": 8}
    results = [simulate(SimulationConfig(dispatch_ahead=ahead, **settings)).to_dict() for ahead in (0, 5)]
    for result in results:
        del result["config"]
    assert results[0] == results[1]


def test_a_rollout_evicted_in_flight_frees_its_worker_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under drop with admission the buffer evicts groups that turned stale in flight; the
    rollout() block cancels their generation, so the worker spent less than the group's length."""
    runs: list[Any] = []

    class Spy(_model._Run):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            runs.append(self)

    monkeypatch.setattr(_model, "_Run", Spy)
    config = SimulationConfig(
        strategy="drop",
        admission=True,
        threshold=2,
        steps=40,
        batch_size=4,
        workers=8,
        latency=Latency.parse("lognormal:2.3,1.0"),
        train_step_seconds=5.0,
    )
    result = simulate(config)
    (run,) = runs
    stats = run.buffer.stats().partitions["train"]
    assert stats.evicted_in_flight_groups > 0
    assert stats.evicted_stale_groups == result.dropped_groups
    cut_short = [
        prompt
        for prompt in run.dispatched
        if prompt.fate == "stale"
        and prompt.spent < (prompt.seconds if prompt.fail_after is None else prompt.fail_after) - 1e-6
    ]
    assert len(cut_short) == stats.evicted_in_flight_groups
    assert all(prompt.done and not prompt.failed for prompt in cut_short)


def test_timeline_is_contiguous() -> None:
    config = SimulationConfig(steps=10, batch_size=2, workers=4, train_step_seconds=7.0)
    result = simulate(config)
    previous_end = 0.0
    for record in result.steps:
        assert record.sample_start == pytest.approx(previous_end)
        assert record.sample_start <= record.train_start
        assert record.train_end - record.train_start == pytest.approx(7.0)
        assert record.wait_seconds >= 0.0
        previous_end = record.train_end


def test_progress_is_reported_every_step() -> None:
    calls: list[tuple[int, int]] = []
    simulate(SimulationConfig(steps=5, batch_size=2, workers=2), progress=lambda d, t: calls.append((d, t)))
    assert calls == [(i, 5) for i in range(1, 6)]


# -- reproducibility ---------------------------------------------------------------------


def test_same_seed_same_json(tmp_path: Path) -> None:
    first = run_json(tmp_path, *TIGHT, "--seed", "3", name="a.json")
    second = run_json(tmp_path, *TIGHT, "--seed", "3", name="b.json")
    other = run_json(tmp_path, *TIGHT, "--seed", "4", name="c.json")
    assert first == second
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert first != other


@pytest.mark.parametrize("admission", [False, True])
@pytest.mark.parametrize("latency", ["fixed:10", "fixed:5", "exponential:10"])
def test_simultaneous_events_do_not_break_reproducibility(latency: str, admission: bool) -> None:
    """Fixed latencies make many tasks wake at the same virtual instant; trio runs those in
    a random order, which must not change the result. Reseed trio's scheduler RNG (a private
    detail, used only if present) to force different orders. With admission, more workers
    and T=2 make producers queue for admission and rollouts get evicted in flight."""
    trio_run = pytest.importorskip("trio._core._run")
    rng = getattr(trio_run, "_r", None)
    config = SimulationConfig(
        strategy="drop",
        admission=admission,
        threshold=2 if admission else 1,
        steps=25,
        batch_size=4,
        workers=12 if admission else 3,
        latency=Latency.parse(latency),
        train_step_seconds=10.0,
        failure_rate=0.3,
    )
    outcomes = []
    for seed in range(3):
        if rng is not None:
            rng.seed(seed)
        outcomes.append(simulate(config).to_dict())
    assert outcomes[0] == outcomes[1] == outcomes[2]


# -- the plot ------------------------------------------------------------------------------


def test_plot_without_matplotlib_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["simulate", *SMALL, "--plot", str(tmp_path / "sim.png")]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert "pip install 'stalebuf[plot]'" in captured.err
    assert captured.out == ""  # it fails before simulating
    assert not (tmp_path / "sim.png").exists()


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["simulate", "--strategy", "sometimes"], "--strategy"),
        (["simulate", "--admission", "yes"], "--admission"),
        (["simulate", "--admission", "true"], "--admission"),
        (["simulate", "--threshold", "0"], "--threshold"),
        (["simulate", "--threshold", "two"], "--threshold"),
        (["simulate", "--parameter-sync-step", "-1"], "--parameter-sync-step"),
        (["simulate", "--steps", "0"], "--steps"),
        (["simulate", "--batch-size", "1.5"], "--batch-size"),
        (["simulate", "--group-size", "0"], "--group-size"),
        (["simulate", "--workers", "0"], "--workers"),
        (["simulate", "--dispatch-ahead", "-0.5"], "--dispatch-ahead"),
        (["simulate", "--latency", "lognormal:3"], "--latency"),
        (["simulate", "--latency", "gamma:1,2"], "--latency"),
        (["simulate", "--latency", "lognormal:a,b"], "--latency"),
        (["simulate", "--latency", "lognormal:3,-1"], "--latency"),
        (["simulate", "--latency", "fixed:0"], "--latency"),
        (["simulate", "--train-step-seconds", "0"], "--train-step-seconds"),
        (["simulate", "--train-step-seconds", "nan"], "--train-step-seconds"),
        (["simulate", "--failure-rate", "1"], "--failure-rate"),
        (["simulate", "--failure-rate", "-0.1"], "--failure-rate"),
        (["simulate", "--failure-strategy", "retry"], "--failure-strategy"),
        (["simulate", "--seed", "-1"], "--seed"),
        (["simulate", "--no-such-option"], "unrecognized"),
        (["simulate", "--json", "/no/such/dir/out.json"], "--json"),
        (["simulate", "--plot", "/no/such/dir/out.png"], "--plot"),
        (["frobnicate"], "invalid choice"),
        ([], "missing command"),
    ],
)
def test_bad_options_give_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert needle in captured.err
    assert "Traceback" not in captured.err


def test_json_path_that_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL, "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "field"),
    [
        ("--threshold", "99999999999999999999999", "threshold"),  # an int, but not a 64-bit one
        ("--seed", "99999999999999999999999", "seed"),
        ("--train-step-seconds", "nan", "train_step_seconds"),
        ("--dispatch-ahead", "1e400", "dispatch_ahead"),
    ],
)
def test_a_value_the_config_rejects_is_one_line_and_exit_2(
    option: str, value: str, field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse reads these as numbers; only SimulationConfig knows they are out of range."""
    number: Any = int(value) if value.isdigit() else float(value)
    with pytest.raises(ConfigError) as rejected:
        SimulationConfig(**{field: number})
    assert main(["simulate", *SMALL, option, value]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"stalebuf simulate: error: argument {option}: {rejected.value}\n"


# Each size just past its bound, with the others small: without the bound the run would go
# ahead (and finish, at these sizes), so only the bound can make these exit 2.
PAST_THE_SIZE_BOUNDS = [
    ("--group-size", MAX_GROUP_SIZE + 1, "group_size must be an int from 1 to 4096"),
    ("--batch-size", MAX_BATCH_SIZE + 1, "batch_size must be an int from 1 to 16384"),
    ("--workers", MAX_WORKERS + 1, "workers must be an int from 1 to 100000"),
]


@pytest.mark.parametrize(("option", "value", "needle"), PAST_THE_SIZE_BOUNDS)
def test_a_size_past_its_bound_is_one_line_and_exit_2(
    option: str, value: int, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 21 item 12: --group-size, --batch-size and --workers were accepted up to 2**63-1,
    and a large one ran out of memory with a traceback; each is bounded to what fits."""
    tiny = ["--steps", "1", "--batch-size", "1", "--group-size", "1", "--workers", "1"]
    argv = ["simulate", *tiny, "--strategy", "drop", "--admission", "off", "--no-progress"]
    assert main([*argv, option, str(value)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"stalebuf simulate: error: argument {option}: {needle}, got {value}\n"
    assert main(["simulate", option, str(2**63 - 1)]) == 2  # the value the issue found accepted
    assert f"argument {option}: " in capsys.readouterr().err


def test_batch_size_times_group_size_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 21 item 12: each size within its bound can still multiply to more trajectories
    than fit in memory (16384 groups of 4096); their product is bounded too, in one line."""
    argv = ["simulate", "--steps", "1", "--workers", "1", "--no-progress"]
    assert main([*argv, "--batch-size", "257", "--group-size", "4096"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "stalebuf simulate: error: batch_size * group_size must be at most 1048576 trajectories "
        "per trainer step, got 257 * 4096 = 1052672\n"
    )
    assert SimulationConfig(batch_size=256, group_size=MAX_GROUP_SIZE).group_size == MAX_GROUP_SIZE
    assert SimulationConfig(batch_size=MAX_BATCH_SIZE, group_size=64).batch_size == MAX_BATCH_SIZE


def test_the_size_bounds_are_in_the_help_and_the_docs(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 21 item 12: the bounds are documented where the options are (docs/simulate.md)."""
    assert main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at any space
    readme = " ".join(SIMULATE_PAGE.read_text(encoding="utf-8").split())
    for option, bound in (
        ("--batch-size B groups per trainer step, at most", MAX_BATCH_SIZE),
        ("--group-size N trajectories per group (GRPO n), at most", MAX_GROUP_SIZE),
        ("batch-size * group-size at most", MAX_STEP_TRAJECTORIES),
        ("--workers W rollout workers, one group at a time each, at most", MAX_WORKERS),
    ):
        assert re.search(rf"{re.escape(option)} {bound}(?!\d)", text), option
    for bound in (MAX_BATCH_SIZE, MAX_GROUP_SIZE, MAX_STEP_TRAJECTORIES, MAX_WORKERS):
        assert f"{bound:,}" in readme, bound


def test_a_rule_across_fields_is_one_line_naming_no_single_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config rule about several fields: each value is fine alone, so no option is blamed."""

    @attrs.frozen(kw_only=True)
    class Picky(SimulationConfig):
        def __attrs_post_init__(self) -> None:
            if self.workers < self.batch_size:
                raise ConfigError(f"workers ({self.workers}) must be >= batch_size ({self.batch_size})")

    monkeypatch.setattr(stalebuf.cli, "SimulationConfig", Picky)
    assert main(["simulate", *SMALL, "--workers", "2", "--batch-size", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "stalebuf simulate: error: workers (2) must be >= batch_size (4)\n"


# A non-default command-line value for every SimulationConfig field, and what it must set the
# field to. A new field must appear here, or in NOT_ON_THE_COMMAND_LINE with the reason.
EVERY_FIELD: dict[str, tuple[list[str], object]] = {
    "strategy": (["--strategy", "wait"], "wait"),
    "admission": (["--admission", "on"], True),
    "threshold": (["--threshold", "3"], 3),
    "parameter_sync_step": (["--parameter-sync-step", "2"], 2),
    "failure_strategy": (["--failure-strategy", "sample"], "sample"),
    "steps": (["--steps", "6"], 6),
    "batch_size": (["--batch-size", "3"], 3),
    "group_size": (["--group-size", "2"], 2),
    "workers": (["--workers", "5"], 5),
    "dispatch_ahead": (["--dispatch-ahead", "0.5"], 0.5),
    "latency": (["--latency", "exponential:7"], "exponential:7"),
    "train_step_seconds": (["--train-step-seconds", "4"], 4.0),
    "failure_rate": (["--failure-rate", "0.25"], 0.25),
    "seed": (["--seed", "9"], 9),
    "in_flight_updates": (["--in-flight-updates"], True),
    "tokens_per_second": (["--tokens-per-second", "80"], 80.0),
    "chunk_tokens": (["--chunk-tokens", "64"], 64),
    "filter_pass_rate": (["--filter-pass-rate", "0.5"], 0.5),
    "tasks": (["--tasks", "a:2;b:1:fixed:3"], "a:2;b:1:fixed:3"),
    "mixture_policy": (["--mixture-policy", "borrow"], "borrow"),
}
NOT_ON_THE_COMMAND_LINE: dict[str, str] = {}
#: The fields of token counts: not with --tasks or --in-flight-updates, so they take a run of their own.
TOKEN_FIELDS: dict[str, tuple[list[str], object]] = {
    "token_budget": (["--token-budget", "400000"], 400000),
    "batch_by": (["--batch-by", "groups"], "groups"),
    "prompt_tokens": (["--prompt-tokens", "100"], 100),
    "max_response_tokens": (["--max-response-tokens", "1000"], 1000),
    "tokens_per_second": (["--tokens-per-second", "80"], 80.0),
}


def test_every_config_field_is_reachable_from_the_command_line(tmp_path: Path) -> None:
    fields = {field.name for field in attrs.fields(SimulationConfig)}
    assert set(EVERY_FIELD) | set(TOKEN_FIELDS) | set(NOT_ON_THE_COMMAND_LINE) == fields
    assert not set(EVERY_FIELD) & set(NOT_ON_THE_COMMAND_LINE)
    # to_dict lists the settings of in-flight updates only when they are on, the filter's only
    # when it filters, the mixture's only with tasks.
    defaults = {
        **SimulationConfig(in_flight_updates=True).to_dict(),
        "in_flight_updates": False,
        "filter_pass_rate": 1.0,
        "tasks": None,
        "mixture_policy": "wait",
    }
    argv = [arg for args, _ in EVERY_FIELD.values() for arg in args]
    config = run_json(tmp_path, *argv)["results"]["wait+admission"]["config"]
    for name, (_, value) in EVERY_FIELD.items():
        assert value != defaults[name], name  # else an ignored option would go unnoticed
        assert config[name] == value, name
    token_defaults = SimulationConfig(token_budget=1).to_dict()
    argv = [arg for args, _ in TOKEN_FIELDS.values() for arg in args]
    config = run_json(tmp_path, *argv, "--steps", "2")["results"]["wait+admission"]["config"]
    for name, (_, value) in TOKEN_FIELDS.items():
        assert value != token_defaults[name], name
        assert config[name] == value, name


def test_help_and_version_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--help"]) == 0
    assert "--latency" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("stalebuf ")


def test_missing_trio_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "trio", None)
    monkeypatch.setitem(sys.modules, "trio.testing", None)
    assert main(["simulate", *SMALL]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert "pip install 'stalebuf[sim]'" in captured.err
    with pytest.raises(MissingDependencyError):
        simulate(SimulationConfig(steps=1))


def test_simulate_module_imports_without_trio() -> None:
    code = (
        "import sys; sys.modules['trio'] = None\n"
        "import stalebuf.simulate, stalebuf.cli\n"
        "assert stalebuf.simulate.SimulationConfig().strategy == 'drop'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr


# -- the API -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"strategy": "sometimes"},
        {"admission": 1},
        {"admission": "on"},
        {"admission": None},
        {"threshold": 0},
        {"threshold": True},
        {"steps": 2.0},
        {"batch_size": 0},
        {"dispatch_ahead": -1.0},
        {"train_step_seconds": float("inf")},
        {"failure_rate": 1.0},
        {"failure_strategy": "retry"},
        {"latency": "lognormal:3,1"},
        {"seed": -1},
        {"seed": 2**63},
        {"dispatch_ahead": 1000.5},
        {"dispatch_ahead": True},
        {"train_step_seconds": 0},
        {"train_step_seconds": 10**400},  # too large for a float: still a ConfigError
        {"failure_rate": float("nan")},
        # Issue 21 item 12: the sizes the simulator allocates memory by are bounded.
        {"batch_size": MAX_BATCH_SIZE + 1},
        {"batch_size": 2**63 - 1},
        {"group_size": MAX_GROUP_SIZE + 1},
        {"group_size": 2**63 - 1},
        {"workers": MAX_WORKERS + 1},
        {"workers": 2**63 - 1},
        {"workers": True},
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    (field,) = kwargs
    with pytest.raises(ConfigError, match=f"^{field} "):  # the message names the field
        SimulationConfig(**kwargs)


def test_config_accepts_its_boundaries_and_stores_floats() -> None:
    low = SimulationConfig(dispatch_ahead=0, train_step_seconds=1e-9, failure_rate=0, seed=0)
    high = SimulationConfig(dispatch_ahead=1000, failure_rate=0.999, threshold=2**63 - 1)
    widest = SimulationConfig(batch_size=MAX_BATCH_SIZE, group_size=1, workers=MAX_WORKERS)
    assert (widest.batch_size, widest.workers) == (MAX_BATCH_SIZE, MAX_WORKERS)
    assert (low.dispatch_ahead, low.failure_rate, high.dispatch_ahead) == (0.0, 0.0, 1000.0)
    assert all(type(v) is float for v in (low.dispatch_ahead, low.failure_rate, high.dispatch_ahead))


@pytest.mark.parametrize(
    ("kind", "params", "needle"),
    [
        ("gamma", (1.0,), "latency kind"),
        ("lognormal", (3.0,), "lognormal latency needs MU,SIGMA"),
        ("lognormal", (31.0, 1.0), "lognormal latency MU"),
        ("lognormal", (3.0, 5.5), "lognormal latency SIGMA"),
        ("exponential", (0.0,), "exponential latency MEAN"),
        ("fixed", (-1.0,), "fixed latency SECONDS"),
        ("fixed", (10**400,), "latency params must be finite"),
        ("fixed", "10", "latency params must be a sequence"),
    ],
)
def test_latency_rejects_bad_values(kind: str, params: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Latency(kind, params)  # type: ignore[arg-type]


def test_the_package_keeps_every_public_name() -> None:
    before_the_split = {
        "LATENCY_KINDS",
        "Latency",
        "LengthBias",
        "MissingDependencyError",
        "SimulationConfig",
        "SimulationResult",
        "StalenessSummary",
        "StepRecord",
        "simulate",
    }
    assert before_the_split <= set(stalebuf.simulate.__all__)
    assert all(hasattr(stalebuf.simulate, name) for name in stalebuf.simulate.__all__)
    assert stalebuf.simulate.MissingDependencyError is stalebuf.errors.MissingDependencyError


def test_latency_parse_and_str_round_trip() -> None:
    for spec in ("lognormal:3.4,1", "exponential:40", "fixed:12.5"):
        assert str(Latency.parse(spec)) == spec
    lognormal = Latency.parse("lognormal:3.4,1")
    assert lognormal.quantile(0.5) == pytest.approx(30.0, rel=0.01)
    assert lognormal.mean > lognormal.quantile(0.5)
    with pytest.raises(ConfigError):
        Latency("lognormal", ("a", 1))


def test_simulate_rejects_a_non_config() -> None:
    with pytest.raises(ConfigError):
        simulate({"strategy": "drop"})  # type: ignore[arg-type]


# -- huge times, and a verdict with every column tied -----------------------------------------------


def test_a_huge_train_step_is_refused() -> None:
    """Defect: --train-step-seconds 1e308 made ``stalebuf simulate`` run forever."""
    with pytest.raises(ConfigError, match="train_step_seconds"):
        SimulationConfig(train_step_seconds=1e308)


def test_the_largest_accepted_times_still_run() -> None:
    """The bound that refuses huge times must not refuse the largest time it accepts: a run at
    the bound, for both the latency and the train step, completes."""
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
    """Defect: with every column tied, the report said "drop trains 1.00x as many groups per
    hour as drop"."""
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
    report = stalebuf.simulate.format_report(results)
    assert "as many groups per hour as drop." not in report
    assert " 1.00x as many groups per hour" not in report
