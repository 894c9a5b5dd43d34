"""The lines the text report adds for a run with a token budget (``stalebuf simulate
--token-budget K``): how tokens are drawn and dispatched in the header, and the trainer's work in
tokens in the table; none for a run without one, so that its report is what it was before.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._result import SimulationResult, TokenBatchSummary
from ._text import Row, percent, tokens

__all__ = ["token_header", "token_rows"]

#: The latency kinds with no longest value: their responses are cut at ``max_response_tokens``.
_UNBOUNDED = ("lognormal", "exponential")


def _summary(result: SimulationResult) -> TokenBatchSummary:
    if result.token_batches is None:
        raise ValueError(f"the run {result.config.label} has no token counts")
    return result.token_batches


def token_header(results: Sequence[SimulationResult]) -> list[str]:
    """The header lines of the runs' token counts (and of their token batches); none without a
    token budget.

    Raises:
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("token_header needs at least one result")
    c = results[0].config
    if c.token_budget is None:
        return []
    unbounded = f" ({c.latency.kind} is unbounded)" if c.latency.kind in _UNBOUNDED else ""
    lines = [
        f"  tokens per trajectory: prompt {c.prompt_tokens} + response: generation time x "
        f"{c.tokens_per_second:g}/s for a group's longest,",
        f"    25-100% of that for the others, cut at {c.max_response_tokens}{unbounded}; "
        f"M = {c.max_tokens_per_group:,} per group",
        f"  token budget K = {c.token_budget:,} (about {c.token_budget / c.mean_group_tokens:.1f} groups "
        f"of the mean latency's {c.mean_group_tokens:,.0f} tokens)",
    ]
    kinds = {(r.config.admission, r.config.token_batches) for r in results}
    if (False, True) in kinds:
        lines.append(
            f"  token batches without admission: prompts of {c.token_dispatch_budget:,} tokens kept "
            "dispatched (K*(1+dispatch-ahead))"
        )
    if (True, True) in kinds:
        resident = c.threshold * c.parameter_sync_step * c.token_budget  # capacity_tokens
        lines.append(
            f"  token batches with admission: at most K tokens per dispatch step (a group in flight "
            f"reserves M), {resident:,} resident (T*S*K)"
        )
    return lines


def token_rows(results: Sequence[SimulationResult]) -> list[Row]:
    """The rows of the trainer's work in tokens; none without a token budget.

    Raises:
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("token_rows needs at least one result")
    if results[0].config.token_budget is None:
        return []
    return [
        ("trained tokens per simulated hour", lambda r: tokens(_summary(r).trained_tokens_per_hour)),
        ("tokens per step: mean", lambda r: tokens(_summary(r).tokens_per_step_mean)),
        ("  coefficient of variation", lambda r: f"{_summary(r).tokens_per_step_cv:.3f}"),
        ("batch fill (tokens / K): mean", lambda r: percent(_summary(r).fill_mean)),
        ("                          min", lambda r: percent(_summary(r).fill_min)),
        ("  batches over K", lambda r: f"{_summary(r).batches_over_budget}"),
        ("groups per step: mean", lambda r: f"{_summary(r).groups_per_step_mean:.1f}"),
        ("max resident tokens", lambda r: tokens(_summary(r).max_resident_tokens)),
        ("groups cut at max-response-tokens", lambda r: percent(_summary(r).cut_groups_fraction)),
    ]
