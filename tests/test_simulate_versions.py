"""``stalebuf simulate --in-flight-updates``: weight pushes mid-generation, chunked decoding,
versioned trajectories, and the token report of drop, wait and mask.

Runs use small settings (a second or less each); the test of the docs runs the default
command once (several seconds).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stalebuf.simulate
from stalebuf.cli import main
from stalebuf.errors import ConfigError
from stalebuf.records import Batch
from stalebuf.simulate import Latency, SimulationConfig, _model, simulate
from stalebuf.simulate._decoding import Decoder
from stalebuf.simulate._weights import WeightPushes

SMALL = ["--steps", "30", "--batch-size", "4", "--group-size", "3", "--workers", "8", "--no-progress"]
# Tight enough that drop evicts, wait waits and mask masks.
TIGHT = [*SMALL, "--threshold", "1", "--latency", "lognormal:2.3,1.0", "--train-step-seconds", "5"]
LABELS = ["drop+admission", "wait+admission", "mask+admission"]
ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "simulate_versions.md"
SETTINGS: dict[str, Any] = {
    "in_flight_updates": True,
    "threshold": 1,
    "steps": 40,
    "batch_size": 4,
    "group_size": 3,
    "workers": 8,
    "latency": Latency.parse("lognormal:2.3,1.0"),
    "train_step_seconds": 5.0,
    "tokens_per_second": 40.0,
    "chunk_tokens": 32,
}


def run_json(tmp_path: Path, *args: str) -> tuple[str, dict[str, Any]]:
    """Run ``stalebuf simulate`` in-process; return its report and its JSON results."""
    path = tmp_path / "out.json"
    out = tmp_path / "out.txt"
    with out.open("w", encoding="utf-8") as stream, pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdout", stream)
        assert main(["simulate", *args, "--json", str(path)]) == 0
    results: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))["results"]
    report = out.read_text(encoding="utf-8").split(f"\nwrote {path}\n", 1)[0]
    return report, results


def header_labels(report: str) -> list[str]:
    """The run labels of the report's column header."""
    known = {f"{s}{a}" for s in ("drop", "wait", "mask") for a in ("", "+admission")}
    (line,) = [line for line in report.splitlines() if line.split() and set(line.split()) <= known]
    return line.split()


_RUN = _model._Run  # the real one: a test may replace it with a spy


class Recorded:
    """A simulation run with its buffer and every batch the trainer received."""

    def __init__(self, config: SimulationConfig, monkeypatch: pytest.MonkeyPatch) -> None:
        runs: list[Any] = []
        batches: list[Batch] = []

        class Spy(_RUN):
            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                runs.append(self)
                sample = self.buffer.sample

                async def recording(*args: Any, **kwargs: Any) -> Any:
                    batch, metrics = await sample(*args, **kwargs)
                    batches.append(batch)
                    return batch, metrics

                self.buffer.sample = recording  # type: ignore[method-assign]

        monkeypatch.setattr(_model, "_Run", Spy)
        self.result = simulate(config)
        (self.run,) = runs
        self.batches = batches
        self.stats = self.run.buffer.stats().partitions["train"]
        assert self.result.tokens is not None
        self.tokens = self.result.tokens


# -- the mode runs: its columns and rows ------------------------------------------------------


def test_the_mode_runs_drop_wait_and_mask_with_admission(tmp_path: Path) -> None:
    report, results = run_json(tmp_path, *TIGHT, "--in-flight-updates")
    assert header_labels(report) == LABELS
    assert list(results) == LABELS
    for label in (
        "in-flight weight updates: new weights after every train step",
        "trained tokens per simulated hour",
        "share of generated tokens: trained (in the loss)",
        "masked (out of the loss)",
        "thrown away (evicted)",
        "thrown away while fresh",
        "trainer idle fraction",
        "staleness of trained tokens: mean",
        "p95",
        "max",
        "long prompts (>= ",
        "vs dispatched (1.00x = no bias)",
        "trained groups stale by p, fresh by head",
    ):
        assert label in report, label
    p_row = next(line for line in report.splitlines() if line.startswith("trained groups stale by p"))
    *shares, mask_cell = p_row.split()[-3:]
    assert mask_cell == "-"  # mask judges by the newest token: the row does not apply
    assert all(re.fullmatch(r"\d+\.\d%", share) for share in shares)  # drop and wait have a share
    for label, result in results.items():
        config, tokens = result["config"], result["tokens"]
        assert config["in_flight_updates"] is True
        assert config["admission"] is True
        assert config["strategy"] == label.split("+")[0]
        assert tokens["generated"] == tokens["trained"] + tokens["masked"] + tokens["thrown_away"]
        assert sum(item["tokens"] for item in tokens["staleness"]["histogram"]) == tokens["trained"]
    verdict = report.split("\n\n")[-1].splitlines()
    assert "as many tokens per hour as" in verdict[0]
    assert [line.split()[0] for line in verdict[1:]] == LABELS


def test_a_run_without_the_flag_writes_what_it_wrote_before(tmp_path: Path) -> None:
    """No token counts and no in-flight settings in the JSON of a plain run."""
    report, results = run_json(tmp_path, *SMALL)
    assert "in-flight" not in report
    for result in results.values():
        assert "tokens" not in result
        assert not {"in_flight_updates", "tokens_per_second", "chunk_tokens"} & set(result["config"])


# -- the figures are consistent -----------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["drop", "wait", "mask"])
@pytest.mark.parametrize(
    "extra",
    [
        {"admission": True},
        {"admission": False},
        {"admission": True, "failure_rate": 0.3, "failure_strategy": "sample"},
        {"admission": False, "failure_rate": 0.3, "workers": 3, "dispatch_ahead": 2.0},
        {"admission": True, "threshold": 2, "parameter_sync_step": 2},
    ],
)
def test_the_tokens_add_up_against_the_buffers_counters(
    strategy: str, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = SimulationConfig(**{**SETTINGS, "strategy": strategy, **extra})
    recorded = Recorded(config, monkeypatch)
    tokens, stats = recorded.tokens, recorded.stats
    # Trained, masked and thrown away, against the buffer's own counters.
    assert tokens.trained + tokens.masked == stats.sampled_tokens
    assert tokens.masked == stats.masked_tokens
    assert tokens.thrown_away - tokens.lost_in_flight == stats.evicted_tokens
    assert tokens.generated == tokens.trained + tokens.masked + tokens.thrown_away
    assert stats.admitted_tokens == stats.sampled_tokens + stats.evicted_tokens + stats.tokens
    assert stats.admitted_tokens > 0
    assert sum(n for _, n in tokens.staleness.histogram) == tokens.trained
    assert tokens.trained_per_hour == pytest.approx(tokens.trained * 3600 / recorded.result.simulated_seconds)
    # What each strategy promises.
    span = config.threshold
    if strategy != "mask":
        assert tokens.masked == tokens.loss_excluded_trajectories == 0
    if strategy != "wait":
        assert tokens.trained_stale == 0
        assert tokens.staleness.max <= span
    if strategy == "mask":
        assert tokens.thrown_away_fresh == 0  # its guarantee: no fresh token is thrown away
        assert tokens.p_would_drop_groups is None
    else:
        assert tokens.p_would_drop_groups is not None
    assert tokens.trained_trajectories == sum(len(batch.trajectories) for batch in recorded.batches)


@pytest.mark.parametrize("strategy", ["drop", "wait", "mask"])
def test_the_ledger_agrees_with_the_batches_arrays(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The token counts equal what the batches hand the trainer: the freshness mask, the
    loss-excluded trajectories and the per-token versions."""
    # Without admission for mask: with it, at T=1, no group is trained with a stale token.
    config = SimulationConfig(**{**SETTINGS, "strategy": strategy, "admission": strategy == "drop"})
    recorded = Recorded(config, monkeypatch)
    span = config.threshold * config.parameter_sync_step
    trained = masked = excluded = p_drops = 0
    lags: Counter[int] = Counter()
    for batch in recorded.batches:
        fresh, offsets = batch.freshness_mask()
        versions, same_offsets = batch.token_versions()
        assert np.array_equal(offsets, same_offsets)
        lag = batch.global_steps - versions + 1
        in_loss = fresh if strategy == "mask" else np.ones_like(fresh)
        trained += int(in_loss.sum())
        masked += int((~in_loss).sum())
        excluded += int(batch.loss_excluded.sum())
        lags.update(dict(zip(*np.unique(lag[in_loss], return_counts=True), strict=True)))
        heads = batch.head_staleness * config.parameter_sync_step
        start = 0
        for group in batch:
            n = len(group.trajectories)
            head = heads[start : start + n].max(initial=batch.global_steps - group.start_version + 1)
            start += n
            p_drops += batch.global_steps - group.dispatch_step + 1 > span >= head
    tokens = recorded.tokens
    assert (tokens.trained, tokens.masked, tokens.loss_excluded_trajectories) == (trained, masked, excluded)
    assert dict(tokens.staleness.histogram) == {float(lag): n for lag, n in lags.items()}
    assert tokens.p_would_drop_groups == (None if strategy == "mask" else p_drops)
    if strategy == "mask":
        assert masked > 0
        assert excluded > 0


def test_every_trajectory_carries_the_versions_of_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Versions never decrease, start no earlier than the group, change only at chunk
    boundaries, and add up to the trajectory's tokens; a group's start version is the version
    served when its worker started (here without admission: mark_running(version=))."""
    config = SimulationConfig(**{**SETTINGS, "strategy": "mask", "admission": False, "workers": 3})
    recorded = Recorded(config, monkeypatch)
    pushes = recorded.run.decoder.pushes
    prompts = {prompt.uid: prompt for prompt in recorded.run.dispatched}
    spanning = 0
    for batch in recorded.batches:
        for group in batch:
            prompt = prompts[group.uid]
            assert group.start_version == pushes.version_at(prompt.started) >= group.dispatch_step
            for trajectory in group.trajectories:
                versions = [v for v, _ in trajectory.versions]
                assert versions == sorted(set(versions))
                assert versions[0] >= group.start_version
                assert sum(n for _, n in trajectory.versions) == trajectory.tokens
                assert trajectory.tokens == prompt.lengths[trajectory.session_id]
                assert all(n % config.chunk_tokens == 0 for _, n in trajectory.versions[:-1])
                spanning += len(versions) > 1
    assert spanning > 0  # long generations do span several versions


def test_admission_at_s1_starts_groups_at_their_dispatch_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollout() group is admitted at the clock, which is the version served then: its head
    is its dispatch step, so measuring from p drops nothing more than measuring from the head."""
    for strategy in ("drop", "wait"):
        recorded = Recorded(
            SimulationConfig(**{**SETTINGS, "strategy": strategy, "admission": True}), monkeypatch
        )
        for batch in recorded.batches:
            for group in batch:
                assert group.start_version == group.dispatch_step
                assert all(t.versions[0][0] >= group.dispatch_step for t in group.trajectories)
        assert recorded.tokens.p_would_drop_groups == 0


def test_queued_prompts_start_after_their_dispatch_step() -> None:
    """Without admission, prompts dispatched beyond the workers queue, start on newer weights
    than their dispatch step, and some are stale by p while fresh by their head."""
    config = SimulationConfig(
        **{
            **SETTINGS,
            "strategy": "drop",
            "admission": False,
            "threshold": 2,
            "workers": 2,
            "dispatch_ahead": 3.0,
        }
    )
    tokens = simulate(config).tokens
    assert tokens is not None
    assert tokens.p_would_drop_groups is not None
    assert tokens.p_would_drop_groups > 0
    assert tokens.p_would_drop_fraction == pytest.approx(tokens.p_would_drop_groups / (40 * 4))


def test_parameter_sync_step_pushes_at_sync_points(monkeypatch: pytest.MonkeyPatch) -> None:
    config = SimulationConfig(**{**SETTINGS, "strategy": "drop", "threshold": 2, "parameter_sync_step": 2})
    recorded = Recorded(config, monkeypatch)
    versions = {v for batch in recorded.batches for t in batch.trajectories for v, _ in t.versions}
    assert len(versions) > 3
    assert all(v % 2 == 0 for v in versions)
    assert recorded.tokens.staleness.max <= config.threshold


def test_mask_keeps_every_fresh_token_drop_throws_some_away() -> None:
    """mask's guarantee, in a run: the groups it evicts hold no fresh token, and it trains the
    fresh tails drop throws away with their groups. (Whether it trains *more* fresh tokens per
    hour depends on the run: its batches spend group slots on partly stale groups.)"""
    settings = {**SETTINGS, "admission": False, "steps": 60}
    drop = simulate(SimulationConfig(strategy="drop", **settings)).tokens
    mask = simulate(SimulationConfig(strategy="mask", **settings)).tokens
    assert drop is not None
    assert mask is not None
    assert drop.thrown_away_fresh > 0
    assert mask.thrown_away_fresh == 0
    assert mask.masked > 0
    assert mask.share(mask.thrown_away) < drop.share(drop.thrown_away)


def test_the_default_scenario_trains_more_fresh_tokens_per_hour_with_mask() -> None:
    """At the documented settings (docs/simulate_versions.md), seeds 0 and 1, mask trains more
    fresh tokens per simulated hour than drop; per step it trains a few percent fewer."""
    settings = {"in_flight_updates": True, "admission": True, "steps": 60}
    for seed in (0, 1):
        drop = simulate(SimulationConfig(strategy="drop", seed=seed, **settings)).tokens
        mask = simulate(SimulationConfig(strategy="mask", seed=seed, **settings)).tokens
        assert drop is not None
        assert mask is not None
        assert mask.trained_per_hour > drop.trained_per_hour  # every trained token is fresh in both
        assert drop.trained_stale == mask.trained_stale == 0


# -- reproducibility ----------------------------------------------------------------------------


def test_a_seed_reproduces_a_run(tmp_path: Path) -> None:
    _, first = run_json(tmp_path, *TIGHT, "--in-flight-updates", "--seed", "3")
    _, second = run_json(tmp_path, *TIGHT, "--in-flight-updates", "--seed", "3")
    _, other = run_json(tmp_path, *TIGHT, "--in-flight-updates", "--seed", "4")
    assert first == second
    assert first != other


@pytest.mark.parametrize("admission", [False, True])
def test_simultaneous_pushes_and_chunks_do_not_break_reproducibility(admission: bool) -> None:
    """Fixed latencies and a chunk time that divides the train step put chunk starts, ends of
    generation and weight pushes at the same instants; reseed trio's scheduler RNG (a private
    detail, used only if present) to run them in different orders: the result must not move."""
    trio_run = pytest.importorskip("trio._core._run")
    rng = getattr(trio_run, "_r", None)
    config = SimulationConfig(
        strategy="mask",
        admission=admission,
        in_flight_updates=True,
        threshold=1,
        steps=25,
        batch_size=4,
        group_size=2,
        workers=12 if admission else 3,
        latency=Latency.parse("fixed:20"),
        train_step_seconds=10.0,
        tokens_per_second=10.0,
        chunk_tokens=50,
        failure_rate=0.3,
    )
    outcomes = []
    for seed in range(3):
        if rng is not None:
            rng.seed(seed)
        outcomes.append(simulate(config).to_dict())
    assert outcomes[0] == outcomes[1] == outcomes[2]


def test_turning_the_flag_on_keeps_every_prompt() -> None:
    """Trajectory lengths come from an RNG of their own: the prompts, their lengths and fates,
    and so the "long prompts" cutoff, are those of the run without in-flight updates."""
    plain = {
        key: value for key, value in SETTINGS.items() if key not in ("tokens_per_second", "chunk_tokens")
    }
    plain["in_flight_updates"] = False
    without = simulate(SimulationConfig(strategy="wait", **plain))
    with_updates = simulate(SimulationConfig(strategy="wait", **SETTINGS))
    for name in ("long_seconds", "long_share_dispatched", "mean_seconds_dispatched"):
        assert getattr(without.length_bias, name) == getattr(with_updates.length_bias, name)
    assert without.failed_groups == with_updates.failed_groups


# -- chunked decoding, against a worker that wakes at every chunk -----------------------------------


def brute_force_versions(
    pushes: WeightPushes, start: float, seconds: float, lengths: tuple[int, ...], decoded: int, chunk: int
) -> list[tuple[tuple[int, int], ...]]:
    """Each trajectory's versions, built chunk by chunk as a worker waking at every chunk would."""
    longest = lengths[0]
    out = []
    for tokens in lengths:
        pairs: list[list[int]] = []
        for first in range(0, min(tokens, decoded), chunk):
            version = pushes.version_at(start + seconds * (first // chunk * chunk / longest))
            n = min(first + chunk, tokens, decoded) - first
            if pairs and pairs[-1][0] == version:
                pairs[-1][1] += n
            else:
                pairs.append([version, n])
        out.append(tuple((v, n) for v, n in pairs))
    return out


def test_decoding_in_chunks_matches_a_worker_that_wakes_at_every_chunk() -> None:
    rng = random.Random(7)
    for _ in range(400):
        config = SimulationConfig(
            in_flight_updates=True, chunk_tokens=rng.choice([1, 7, 64, 256]), group_size=rng.randint(1, 4)
        )
        decoder = Decoder(config)
        instant = 0.0
        for version in range(1, rng.randint(1, 12)):
            instant += rng.choice([0.5, 3.0, 10.0, 30.0])
            decoder.pushes.push(instant, version)
        start = rng.choice([0.0, 3.0, 10.0, rng.uniform(0, 60)])
        seconds = rng.choice([5.0, 30.0, rng.uniform(0.1, 90)])
        longest = rng.randint(1, 3000)
        lengths = (longest, *(rng.randint(1, longest) for _ in range(config.group_size - 1)))
        decoded = rng.choice([longest, rng.randint(0, longest)])
        expected = brute_force_versions(decoder.pushes, start, seconds, lengths, decoded, config.chunk_tokens)
        assert decoder.segments(start, seconds, lengths, decoded) == expected


def test_a_worked_example_of_chunk_versions() -> None:
    decoder = Decoder(SimulationConfig(in_flight_updates=True, chunk_tokens=50, group_size=2))
    decoder.pushes.push(10.0, 1)  # chunks of 5 s from t=5: they start at 5, 10, 15, 20, 25, 30
    decoder.pushes.push(20.0, 2)
    full, short = decoder.segments(5.0, 30.0, (300, 120), 300)
    assert full == ((0, 50), (1, 100), (2, 150))  # a push at a chunk's very start serves it
    assert short == ((0, 50), (1, 70))
    assert decoder.segments(5.0, 30.0, (300, 120), 60) == [((0, 50), (1, 10)), ((0, 50), (1, 10))]
    assert decoder.segments(5.0, 30.0, (300, 120), 0) == [(), ()]
    with pytest.raises(ValueError, match="does not follow"):
        decoder.pushes.push(15.0, 3)


# -- composing with the other options, or refusing them ---------------------------------------------


@pytest.mark.parametrize(
    ("argv", "labels"),
    [
        (["--admission", "both"], [f"{s}{a}" for s in ("drop", "wait", "mask") for a in ("", "+admission")]),
        (["--admission", "off"], ["drop", "wait", "mask"]),
        (["--strategy", "both"], ["drop+admission", "wait+admission"]),
        (["--strategy", "mask", "--admission", "off"], ["mask"]),
        (["--strategy", "all"], LABELS),
    ],
)
def test_strategy_and_admission_choose_the_columns(
    tmp_path: Path, argv: list[str], labels: list[str]
) -> None:
    report, results = run_json(tmp_path, *SMALL, "--steps", "5", "--in-flight-updates", *argv)
    assert header_labels(report) == labels
    assert list(results) == labels


def test_the_other_options_reach_the_run(tmp_path: Path) -> None:
    argv = [
        *SMALL,
        "--in-flight-updates",
        "--strategy",
        "mask",
        "--threshold",
        "2",
        "--parameter-sync-step",
        "2",
        "--tokens-per-second",
        "80",
        "--chunk-tokens",
        "64",
        "--latency",
        "fixed:12",
        "--failure-strategy",
        "sample",
        "--failure-rate",
        "0.2",
        "--seed",
        "5",
    ]
    report, results = run_json(tmp_path, *argv)
    config = results["mask+admission"]["config"]
    assert (config["tokens_per_second"], config["chunk_tokens"], config["parameter_sync_step"]) == (
        80.0,
        64,
        2,
    )
    assert "new weights after every 2 train steps" in report
    assert "decoding in chunks of 64 tokens at 80 tokens/s per trajectory" in report
    # fixed:12 at 80 tokens/s: the longest trajectory has 960 tokens, the others at least 240.
    tokens = results["mask+admission"]["tokens"]
    returned, trajectories = tokens["trained"] + tokens["masked"], tokens["trained_trajectories"]
    assert 240 * trajectories <= returned <= 960 * trajectories


def test_the_plot_shows_token_staleness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    figures: list[Any] = []
    savefig = Figure.savefig

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        figures.append(self)
        savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    path = tmp_path / "versions.png"
    _report, _ = run_json(tmp_path, *TIGHT, "--in-flight-updates", "--admission", "both", "--plot", str(path))
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    (figure,) = figures
    histograms = figure.axes[:6]
    assert histograms[0].get_ylabel() == "trained tokens"
    assert all(ax.get_xlabel() == "token staleness (g - v + 1) / S" for ax in histograms)
    okabe_ito = {"#e69f00", "#56b4e9", "#009e73", "#f0e442", "#0072b2", "#d55e00", "#cc79a7", "#000000"}
    fills = {
        to_hex(color)
        for ax in figure.axes
        for artist in [*ax.patches, *ax.collections]
        for color in np.atleast_2d(artist.get_facecolor())
    }
    assert len(fills) == 6 + 2  # a colour per run, then busy and idle
    assert fills <= okabe_ito


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--strategy", "mask"],
            "stalebuf simulate: error: argument --strategy: mask needs --in-flight-updates",
        ),
        (
            ["--chunk-tokens", "64"],
            "stalebuf simulate: error: argument --chunk-tokens: only with --in-flight-updates",
        ),
        (
            ["--tokens-per-second", "80"],
            "stalebuf simulate: error: argument --tokens-per-second: only with --in-flight-updates",
        ),
        (
            ["--in-flight-updates", "--tokens-per-second", "0"],
            "stalebuf simulate: error: argument --tokens-per-second: tokens_per_second must be",
        ),
        (
            ["--in-flight-updates", "--chunk-tokens", "0"],
            "stalebuf simulate: error: argument --chunk-tokens: chunk_tokens must be an int from 1",
        ),
        (["--in-flight-updates", "--chunk-tokens", "1.5"], "argument --chunk-tokens: invalid int value"),
        (["--in-flight-updates", "--strategy", "sometimes"], "argument --strategy: invalid choice"),
    ],
)
def test_what_cannot_compose_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *SMALL, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert message in captured.err


def test_the_help_tells_the_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--help"]) == 0
    # argparse wraps the help at spaces and after hyphens.
    text = re.sub(r"-\s+", "-", " ".join(capsys.readouterr().out.split()))
    for needle in (
        "--in-flight-updates",
        "--tokens-per-second TPS",
        "--chunk-tokens N",
        "(default: both; on with --in-flight-updates)",
        "in-flight weight updates (--in-flight-updates):",
        "lag <= T*S",
    ):
        assert needle in text, needle


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"strategy": "mask"}, "strategy 'mask' needs in_flight_updates"),
        ({"in_flight_updates": 1}, "in_flight_updates must be a bool"),
        ({"in_flight_updates": True, "tokens_per_second": 0}, "tokens_per_second "),
        ({"in_flight_updates": True, "tokens_per_second": float("inf")}, "tokens_per_second "),
        ({"in_flight_updates": True, "tokens_per_second": 2e6}, "tokens_per_second "),
        ({"in_flight_updates": True, "chunk_tokens": 0}, "chunk_tokens "),
        ({"in_flight_updates": True, "chunk_tokens": 2**32 + 1}, "chunk_tokens "),
        ({"in_flight_updates": True, "chunk_tokens": True}, "chunk_tokens "),
    ],
)
def test_the_config_refuses_bad_values(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(field)}"):
        SimulationConfig(**kwargs)


def test_a_report_does_not_mix_the_modes() -> None:
    small = {"steps": 2, "batch_size": 2, "group_size": 1, "workers": 2}
    plain = simulate(SimulationConfig(**small))
    versions = simulate(SimulationConfig(in_flight_updates=True, **small))
    assert "TokenSummary" in stalebuf.simulate.__all__
    with pytest.raises(ValueError, match="with and without in-flight updates"):
        stalebuf.simulate.format_report([plain, versions])
    assert "in-flight weight updates" in stalebuf.simulate.format_report([versions])


def test_the_longest_trajectory_is_capped() -> None:
    """A generation of MAX_SECONDS at the fastest decoding stays within the token bound."""
    from stalebuf.simulate._bounds import MAX_SECONDS, MAX_TOKENS_PER_SECOND, MAX_TRAJECTORY_TOKENS

    config = SimulationConfig(
        in_flight_updates=True,
        steps=2,
        batch_size=2,
        group_size=2,
        workers=2,
        latency=Latency("fixed", (MAX_SECONDS,)),
        train_step_seconds=MAX_SECONDS,
        tokens_per_second=MAX_TOKENS_PER_SECOND,
    )
    result = simulate(config)
    assert result.tokens is not None
    assert 0 < result.tokens.trained <= 2 * 2 * 2 * MAX_TRAJECTORY_TOKENS


# -- the docs -------------------------------------------------------------------------------------


def test_the_docs_show_the_default_run_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/simulate_versions.md pastes the report of its command verbatim (a run of several
    seconds)."""
    text = DOC.read_text(encoding="utf-8")
    command = "stalebuf simulate --in-flight-updates --no-progress"
    block = text.split(f"```bash\n{command}\n```", 1)[1]
    pasted = block.split("```text\n", 1)[1].split("```", 1)[0]
    assert main(["simulate", "--in-flight-updates", "--no-progress"]) == 0
    assert capsys.readouterr().out == pasted
