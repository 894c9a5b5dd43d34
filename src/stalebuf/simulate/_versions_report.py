"""The text report of runs with in-flight weight updates (``stalebuf simulate --in-flight-updates``).

It reads each run's :class:`~._result.TokenSummary`: where the generated tokens went (trained,
masked, thrown away), how stale the trained ones were, and the groups measuring from the
dispatch step would have dropped. :func:`~._report.format_report` hands such runs here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._mix_report import mix_rows
from ._result import SimulationResult, TokenSummary
from ._text import Row, duration, header, percent, seconds, table, tokens

__all__ = ["format_versions_report"]


def _summary(result: SimulationResult) -> TokenSummary:
    if result.tokens is None:
        raise ValueError(f"the run {result.config.label} has no token counts (no in-flight updates)")
    return result.tokens


def _share(part: str) -> Callable[[SimulationResult], str]:
    """A cell: the share of the generated tokens that the summary's count ``part`` holds."""
    return lambda r: percent(_summary(r).share(getattr(_summary(r), part)))


def _p_would_drop(result: SimulationResult) -> str:
    fraction = _summary(result).p_would_drop_fraction
    return "-" if fraction is None else percent(fraction)


def _pushes(results: Sequence[SimulationResult]) -> list[str]:
    """The header lines that describe the weight pushes and the decoding."""
    c = results[0].config
    when = "every train step" if c.parameter_sync_step == 1 else f"every {c.parameter_sync_step} train steps"
    return [
        f"  in-flight weight updates: new weights after {when}, taken mid-generation by workers",
        f"    decoding in chunks of {c.chunk_tokens} tokens at {c.tokens_per_second:g} tokens/s "
        "per trajectory",
    ]


def format_versions_report(results: Sequence[SimulationResult]) -> str:
    """Return the side-by-side text report of runs with in-flight weight updates that share
    their settings but the strategy and admission.

    Raises:
        ValueError: ``results`` is empty, or a run has no token counts.
    """
    if not results:
        raise ValueError("format_versions_report needs at least one result")
    long_seconds = seconds(results[0].length_bias.long_seconds)
    rows: list[Row] = [
        ("trained tokens per simulated hour", lambda r: tokens(_summary(r).trained_per_hour)),
        ("trained groups per simulated hour", lambda r: f"{r.trained_groups_per_hour:.0f}"),
        ("simulated time", lambda r: duration(r.simulated_seconds)),
        ("share of generated tokens: trained (in the loss)", _share("trained")),
        ("                           masked (out of the loss)", _share("masked")),
        ("                           thrown away (evicted)", _share("thrown_away")),
        ("                           thrown away while fresh", _share("thrown_away_fresh")),
        ("trained tokens that are stale (lag > T*S)", lambda r: percent(_stale_share(_summary(r)))),
        ("loss-excluded trajectories (all stale)", lambda r: f"{_summary(r).loss_excluded_trajectories}"),
        ("trainer idle fraction", lambda r: percent(r.trainer_idle_fraction)),
        ("staleness of trained tokens: mean", lambda r: f"{_summary(r).staleness.mean:.2f}"),
        ("                             p95", lambda r: f"{_summary(r).staleness.p95:.2f}"),
        ("                             max", lambda r: f"{_summary(r).staleness.max:.2f}"),
        (f"long prompts (>= {long_seconds}) in trained", lambda r: percent(r.length_bias.long_share_trained)),
        ("  vs dispatched (1.00x = no bias)", lambda r: f"{r.length_bias.ratio:.2f}x"),
        ("trained groups stale by p, fresh by head", _p_would_drop),
        *mix_rows(results),
    ]
    lines = [*header(results, *_pushes(results)), *table(results, rows)]
    if len(results) >= 2:
        lines += ["", *_verdict(results)]
    return "\n".join(lines)


def _stale_share(summary: TokenSummary) -> float:
    return summary.trained_stale / summary.trained if summary.trained else 0.0


def _verdict(results: Sequence[SimulationResult]) -> list[str]:
    """One line on token throughput (the fastest run against the slowest), then one per run."""
    rate = {id(r): _summary(r).trained_per_hour for r in results}
    fast = max(results, key=lambda r: rate[id(r)])
    slow = min(results, key=lambda r: rate[id(r)])
    ratio = rate[id(fast)] / rate[id(slow)] if rate[id(slow)] else 1.0
    if f"{ratio:.2f}" == "1.00":
        throughput = "every run trains about as many tokens per hour as the others."
    else:
        throughput = (
            f"{fast.config.label} trains {ratio:.2f}x as many tokens per hour as {slow.config.label}."
        )
    costs = [_cost(r) for r in results]
    return [throughput, *(f"{cost};" for cost in costs[:-1]), f"{costs[-1]}."]


def _cost(result: SimulationResult) -> str:
    summary, label = _summary(result), result.config.label
    thrown = percent(summary.share(summary.thrown_away))
    if result.config.strategy == "mask":
        masked = percent(summary.share(summary.masked))
        return f"{label} masks {masked} of generated tokens and throws away {thrown}, {_fresh(summary)}"
    if result.config.strategy == "drop":
        return f"{label} throws away {thrown} of generated tokens, {_fresh(summary)}"
    return (
        f"{label} idles the trainer {percent(result.trainer_idle_fraction)} of the time "
        f"and throws away {thrown} of generated tokens"
    )


def _fresh(summary: TokenSummary) -> str:
    if not summary.thrown_away_fresh:
        return "none of them fresh"
    return f"{percent(summary.share(summary.thrown_away_fresh))} while still fresh"
