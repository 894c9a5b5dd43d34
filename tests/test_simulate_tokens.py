"""``stalebuf simulate --token-budget K``: token counts on every trajectory, token batches and
token admission inside the simulated pipeline, their report rows, their errors, and a default
report left as it was.

Runs use small settings so that the module takes a few seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from stalebuf.cli import main
from stalebuf.errors import ConfigError
from stalebuf.simulate import Latency, SimulationConfig, TaskMix, TokenBatchSummary, simulate
from stalebuf.simulate._lengths import SHORTEST, TrajectoryLengths
from stalebuf.simulate._token_report import token_header, token_rows
from stalebuf.simulate._token_work import TokenWork

SMALL = ["--steps", "20", "--batch-size", "4", "--group-size", "2", "--workers", "8"]
# About four groups of the default latency's mean (4,531 tokens), and above M = 2 * (256 + 8192).
BUDGET = "18000"
SETTINGS: dict[str, Any] = {
    "steps": 40,
    "batch_size": 8,
    "group_size": 2,
    "workers": 16,
    "train_step_seconds": 10.0,
}
# Eight groups of the mean: the count batches' size, in tokens.
K = 36_208
TOKEN_ROWS = (
    "trained tokens per simulated hour",
    "tokens per step: mean",
    "  coefficient of variation",
    "batch fill (tokens / K): mean",
    "max resident tokens",
    "groups cut at max-response-tokens",
)


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


def work(config: SimulationConfig) -> TokenBatchSummary:
    summary = simulate(config).token_batches
    assert summary is not None
    return summary


# -- the default report is untouched -------------------------------------------------------


def test_without_a_token_budget_nothing_new_is_printed_or_written(tmp_path: Path) -> None:
    report, results = run(*SMALL, tmp_path=tmp_path)
    assert results is not None
    assert "token" not in report
    for result in results.values():
        assert "token_batches" not in result
        for key in ("token_budget", "batch_by", "prompt_tokens", "max_response_tokens", "tokens_per_second"):
            assert key not in result["config"]


def test_counting_tokens_leaves_a_count_batch_run_as_it_was(tmp_path: Path) -> None:
    """Token counts come from a stream of their own: with --batch-by groups every row of the
    report without them is the same, and the JSON only gains the token settings and summary."""
    plain, plain_json = run(*SMALL, tmp_path=tmp_path)
    (tmp_path / "counted").mkdir()
    counted, counted_json = run(
        *SMALL, "--token-budget", BUDGET, "--batch-by", "groups", tmp_path=tmp_path / "counted"
    )
    assert plain_json is not None
    assert counted_json is not None
    table = plain.split("\n\n")[1]
    assert table in counted  # the same rows, then the token rows after them
    assert plain.split("\n\n")[2] == counted.split("\n\n")[2]  # the verdict
    for label, result in plain_json.items():
        other = dict(counted_json[label])
        assert other.pop("token_batches")["trained_tokens"] > 0
        other["config"] = {k: v for k, v in other["config"].items() if k in result["config"]}
        assert other == result


# -- token batches ------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_token_batches_are_sized_in_tokens(strategy: str) -> None:
    config = SimulationConfig(strategy=strategy, token_budget=K, **SETTINGS)
    summary = work(config)
    # K is above the largest group (M = 16,896 tokens), so no batch is over it...
    assert config.max_tokens_per_group < K
    assert summary.batches_over_budget == 0
    assert all(0 < tokens <= K for tokens in summary.step_tokens)
    # ...and each is short of it by less than one group.
    assert all(tokens > K - config.max_tokens_per_group for tokens in summary.step_tokens)
    assert summary.fill_min > 0.5
    assert summary.fill_mean > 0.9
    assert summary.groups_per_step_cv > 0  # the number of groups follows their lengths
    assert summary.trained_tokens == sum(summary.step_tokens)


def test_a_budget_under_the_longest_group_returns_it_alone() -> None:
    """Without admission K may be below M: a group alone over K is a batch of its own."""
    summary = work(SimulationConfig(strategy="wait", token_budget=5000, **SETTINGS))
    assert summary.batches_over_budget > 0
    assert max(summary.step_tokens) > 5000
    assert summary.fill_mean > 0.5


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_token_batches_vary_far_less_than_count_batches_on_a_heavy_tail(strategy: str) -> None:
    """The lognormal latency (sigma 1) makes group lengths heavy-tailed: a batch of 8 groups
    varies by a quarter to a half of its mean, a batch of K tokens by a few percent."""
    counts = work(SimulationConfig(strategy=strategy, token_budget=K, batch_by="groups", **SETTINGS))
    tokens = work(SimulationConfig(strategy=strategy, token_budget=K, **SETTINGS))
    assert counts.groups_per_step_cv == 0.0  # always 8 groups
    assert counts.tokens_per_step_cv > 0.15
    assert tokens.tokens_per_step_cv < counts.tokens_per_step_cv / 2
    assert tokens.tokens_per_step_cv < 0.15


def test_token_admission_keeps_the_hard_bound_and_the_residency_cap() -> None:
    config = SimulationConfig(strategy="wait", admission=True, token_budget=K, **SETTINGS)
    result = simulate(config)
    summary = result.token_batches
    assert summary is not None
    assert config.capacity_tokens is not None
    assert result.staleness.max <= config.threshold
    assert result.dropped_groups == 0
    assert 0 < summary.max_resident_tokens <= config.capacity_tokens
    assert config.sampler_config().admission_token_budget == K
    assert config.sampler_config().max_tokens_per_group == config.max_tokens_per_group
    assert config.sampler_config().admission_batch_size is None


def test_every_strategy_admission_and_unit_runs(tmp_path: Path) -> None:
    report, results = run(*SMALL, "--token-budget", BUDGET, "--batch-by", "both", tmp_path=tmp_path)
    assert results is not None
    labels = [
        f"{strategy}{admission}{unit}"
        for strategy in ("drop", "wait")
        for admission in ("", "+admission")
        for unit in ("", "+tokens")
    ]
    assert list(results) == labels
    for label, result in results.items():
        assert result["config"]["batch_by"] == ("tokens" if label.endswith("+tokens") else "groups")
        assert result["token_batches"]["trained_tokens"] > 0
        assert len(result["token_batches"]["step_tokens"]) == 20
    for row in TOKEN_ROWS:
        assert f"\n{row} " in report
    assert "(lognormal is unbounded)" in report
    assert "token batches without admission: prompts of 36,000 tokens kept dispatched" in report
    assert "token batches with admission: at most K tokens per dispatch step" in report


@pytest.mark.parametrize(
    "extra",
    [
        ["--filter-pass-rate", "0.5"],
        ["--failure-rate", "0.5", "--failure-strategy", "sample"],
        ["--failure-rate", "0.5", "--failure-strategy", "evict"],
        ["--latency", "lognormal:3.4,2.5"],  # a tail far past max-response-tokens
        ["--latency", "fixed:30", "--parameter-sync-step", "2"],
    ],
)
def test_token_runs_with_filters_failures_and_tails(extra: list[str], tmp_path: Path) -> None:
    """Every strategy, with and without admission, runs to its last step (no hang, no put past
    M: the buffer would raise)."""
    report, results = run(*SMALL, "--token-budget", BUDGET, *extra, tmp_path=tmp_path)
    assert results is not None
    assert len(results) == 4
    for result in results.values():
        assert len(result["token_batches"]["step_tokens"]) == 20
        assert result["token_batches"]["max_resident_tokens"] > 0
    assert "coefficient of variation" in report


def test_failed_groups_put_their_shortest_trajectories() -> None:
    """A group that fails part-way puts those finished first: the shortest, so a trained failed
    group under failure_strategy="sample" holds fewer tokens than it was drawn with."""
    config = SimulationConfig(
        token_budget=K, failure_rate=0.9, failure_strategy="sample", **{**SETTINGS, "group_size": 4}
    )
    result = simulate(config)
    assert result.failed_groups > 0
    summary = result.token_batches
    assert summary is not None
    # Failed groups lack their longest trajectories: the same steps with no failure hold more.
    whole = work(SimulationConfig(token_budget=K, failure_rate=0.0, **{**SETTINGS, "group_size": 4}))
    per_group = summary.tokens_per_step_mean / summary.groups_per_step_mean
    assert per_group < 0.8 * whole.tokens_per_step_mean / whole.groups_per_step_mean


# -- the token counts ---------------------------------------------------------------------


def test_lengths_are_cut_at_the_cap_and_the_others_are_a_share_of_the_longest() -> None:
    lengths = TrajectoryLengths(group_size=5, tokens_per_second=50.0, cap=1000, seed=0)
    assert lengths.draw(10.0)[0] == 500
    assert all(SHORTEST * 500 - 1 <= n <= 500 for n in lengths.draw(10.0))
    assert lengths.draw(100.0)[0] == 1000  # 5,000 cut at 1,000
    assert lengths.uncut(20.0)
    assert not lengths.uncut(20.1)
    first, second = (TrajectoryLengths(group_size=5, tokens_per_second=50.0, cap=1000, seed=7) for _ in "ab")
    assert [first.draw(12.5) for _ in range(3)] == [second.draw(12.5) for _ in range(3)]


def test_token_work_draws_prompt_plus_response_shortest_first() -> None:
    config = SimulationConfig(token_budget=K, group_size=3, prompt_tokens=100, max_response_tokens=400)
    tokens = TokenWork(config)
    lengths = tokens.draw(4.0)  # 200 tokens for the longest response at 50/s
    assert lengths == tuple(sorted(lengths))
    assert lengths[-1] == 300
    assert all(100 + SHORTEST * 200 - 1 <= n <= 300 for n in lengths)
    assert tokens.draw(60.0)[-1] == 500  # 3,000 cut at 400
    assert (tokens.drawn_groups, tokens.cut_groups) == (2, 1)
    assert sum(tokens.draw(1000.0)) <= config.max_tokens_per_group == 3 * 500
    with pytest.raises(ValueError, match="token_budget"):
        TokenWork(SimulationConfig())


def test_the_cut_share_follows_max_response_tokens() -> None:
    fixed = {**SETTINGS, "steps": 5, "latency": Latency.parse("fixed:10")}  # 500 response tokens
    assert work(SimulationConfig(token_budget=K, max_response_tokens=499, **fixed)).cut_groups_fraction == 1.0
    assert work(SimulationConfig(token_budget=K, max_response_tokens=500, **fixed)).cut_groups_fraction == 0.0


def test_same_seed_same_json(tmp_path: Path) -> None:
    args = [*SMALL, "--token-budget", BUDGET, "--batch-by", "both", "--strategy", "wait"]
    for name in "abc":
        (tmp_path / name).mkdir()
    first = run(*args, "--seed", "3", tmp_path=tmp_path / "a")
    second = run(*args, "--seed", "3", tmp_path=tmp_path / "b")
    other = run(*args, "--seed", "4", tmp_path=tmp_path / "c")
    assert first == second
    assert first[1] != other[1]


def test_the_report_parts_refuse_nothing_to_report() -> None:
    with pytest.raises(ValueError, match="at least one result"):
        token_rows([])
    with pytest.raises(ValueError, match="at least one result"):
        token_header([])
    result = simulate(SimulationConfig(steps=2, batch_size=2, group_size=2, workers=4))
    assert token_rows([result]) == []
    assert token_header([result]) == []


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--token-budget", "0"], "argument --token-budget: token_budget must be None or an int from 1"),
        (["--token-budget", "-5"], "argument --token-budget: token_budget must be None or an int from 1"),
        (["--token-budget", "1e5"], "argument --token-budget: invalid int value"),
        (["--token-budget", "many"], "argument --token-budget: invalid int value"),
        (["--token-budget", str(2**49)], "argument --token-budget: token_budget must be None or an int"),
        (["--token-budget", "10000000000"], "argument --token-budget: token_budget 10000000000 holds about"),
        (
            ["--token-budget", "1000", "--admission", "on"],
            "token_budget 1000 is below max_tokens_per_group = group_size * (prompt_tokens + "
            "max_response_tokens) = 16896",
        ),
        (
            ["--token-budget", BUDGET, "--tasks", "a:1;b:1"],
            "argument --token-budget: not with --tasks (the buffer",
        ),
        (
            ["--token-budget", BUDGET, "--in-flight-updates"],
            "argument --token-budget: not with --in-flight-updates",
        ),
        (["--prompt-tokens", "10"], "argument --prompt-tokens: only with --token-budget"),
        (["--max-response-tokens", "10"], "argument --max-response-tokens: only with --token-budget"),
        (["--batch-by", "tokens"], "argument --batch-by: only with --token-budget"),
        (["--batch-by", "groups"], "argument --batch-by: only with --token-budget"),
        (["--tokens-per-second", "10"], "argument --tokens-per-second: only with --in-flight-updates or"),
        (["--token-budget", BUDGET, "--batch-by", "bytes"], "argument --batch-by: invalid choice"),
        (
            ["--token-budget", BUDGET, "--prompt-tokens", "-1"],
            "argument --prompt-tokens: prompt_tokens must be",
        ),
        (["--token-budget", BUDGET, "--prompt-tokens", "x"], "argument --prompt-tokens: invalid int value"),
        (
            ["--token-budget", BUDGET, "--max-response-tokens", "0"],
            "argument --max-response-tokens: max_response_tokens must be",
        ),
        (
            ["--token-budget", BUDGET, "--max-response-tokens", str(2**33)],
            "argument --max-response-tokens: max_response_tokens must be",
        ),
        (
            ["--token-budget", BUDGET, "--tokens-per-second", "0"],
            "argument --tokens-per-second: tokens_per_second must be",
        ),
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
    ("kwargs", "field"),
    [
        ({"token_budget": 0}, "token_budget"),
        ({"token_budget": True}, "token_budget"),
        ({"token_budget": 5000.0}, "token_budget"),
        ({"token_budget": "5000"}, "token_budget"),
        ({"batch_by": "tokens"}, "batch_by"),  # without a token budget
        ({"batch_by": "bytes", "token_budget": K}, "batch_by"),
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"prompt_tokens": 1.5}, "prompt_tokens"),
        ({"max_response_tokens": 0}, "max_response_tokens"),
        ({"token_budget": 100, "admission": True}, "token_budget"),
        ({"token_budget": K, "tasks": TaskMix.parse("a:1;b:1")}, "token_budget"),
        ({"token_budget": K, "in_flight_updates": True}, "token_budget"),
        ({"token_budget": 10**12}, "token_budget"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field} "):  # the message names the field
        SimulationConfig(**kwargs)


def test_the_defaults_and_derived_values() -> None:
    assert SimulationConfig().batch_by == "groups"
    config = SimulationConfig(token_budget=K)
    assert config.batch_by == "tokens"
    assert config.token_batches
    assert config.label == "drop+tokens"
    assert SimulationConfig(token_budget=K, batch_by="groups").label == "drop"
    assert config.max_tokens_per_group == 8 * (256 + 8192)
    assert config.token_dispatch_budget == 2 * K
    assert config.capacity is None
    assert config.capacity_tokens is None
    admitted = SimulationConfig(token_budget=10**6, admission=True)
    assert admitted.capacity is None
    assert admitted.capacity_tokens == 4 * 10**6
    assert SimulationConfig(token_budget=10**6, admission=True, batch_by="groups").capacity == 128


def test_the_help_lists_the_new_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--token-budget K" in text
    assert "--batch-by {groups,tokens,both}" in text
    assert "--prompt-tokens N" in text
    assert "(default: 256)" in text
    assert "--max-response-tokens N" in text
    assert "(default: 8192)" in text
    assert "token budgets (--token-budget K):" in text
