"""Where the tokens of a run with in-flight weight updates went: :class:`TokenLedger`.

The trainer hands it each batch (:meth:`TokenLedger.sampled`): the tokens of the returned
trajectories, by lag, in the loss or masked, and the groups measuring from the dispatch step
would have dropped. At the end it walks the prompts in dispatch order (:meth:`TokenLedger.summary`)
for what was decoded and thrown away, reading the versions of what was decoded from the
:class:`~._decoding.Decoder`. Which tokens enter the loss follows the buffer's contract: every
returned token under "drop" and "wait", the fresh ones (lag ``<= T*S``) under "mask"; the
tests check these counts against the buffer's own ``sampled_tokens`` and ``masked_tokens``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from ..records import Batch
from ._config import SimulationConfig
from ._decoding import Decoder, Segments
from ._result import StalenessSummary, TokenSummary

__all__ = ["DecodedPrompt", "TokenLedger"]


class DecodedPrompt(Protocol):
    """What the ledger reads of a dispatched prompt (:class:`~._prompt.Prompt`)."""

    @property
    def fate(self) -> str | None: ...
    @property
    def lengths(self) -> tuple[int, ...]: ...
    @property
    def started(self) -> float | None: ...
    @property
    def seconds(self) -> float: ...
    @property
    def decoded(self) -> int: ...
    @property
    def put_tokens(self) -> int: ...
    @property
    def evicted_step(self) -> int: ...


class TokenLedger:
    """The token counts of one run with in-flight weight updates."""

    __slots__ = (
        "decoder",
        "excluded",
        "lags",
        "masked",
        "masks",
        "p_drops",
        "returned_groups",
        "span",
        "sync_step",
        "trained",
        "trained_stale",
        "trajectories",
    )

    def __init__(self, config: SimulationConfig, decoder: Decoder) -> None:
        self.decoder = decoder
        self.sync_step = config.parameter_sync_step
        self.span = config.threshold * config.parameter_sync_step  # T*S: the largest fresh lag
        self.masks = config.strategy == "mask"
        self.lags: Counter[int] = Counter()  # trained tokens by lag
        self.trained = self.trained_stale = self.masked = 0
        self.trajectories = self.excluded = 0
        self.returned_groups = self.p_drops = 0

    def sampled(self, batch: Batch) -> None:
        """Count the tokens of a batch the trainer received."""
        g, span, lags, masks = batch.global_steps, self.span, self.lags, self.masks
        fresh = stale = excluded = p_drops = trajectories = 0
        for group in batch:
            head = group.start_version
            trajectories += len(group.trajectories)
            for trajectory in group.trajectories:
                segments: Segments = trajectory.versions
                if not segments and trajectory.tokens:  # its tokens count at the start version
                    segments = ((group.start_version, trajectory.tokens),)
                fresh_here = 0
                for version, tokens in segments:
                    if version < head:
                        head = version
                    lag = g - version + 1
                    if lag <= span:
                        fresh_here += tokens
                        lags[lag] += tokens
                    else:
                        stale += tokens
                        if not masks:
                            lags[lag] += tokens
                excluded += not fresh_here and segments != ()
                fresh += fresh_here
            p_drops += g - group.dispatch_step + 1 > span >= g - head + 1
        self.trajectories += trajectories
        self.returned_groups += len(batch)
        self.p_drops += p_drops
        if masks:
            self.trained += fresh
            self.masked += stale
            self.excluded += excluded
        else:
            self.trained += fresh + stale
            self.trained_stale += stale

    def summary(self, prompts: Iterable[DecodedPrompt], end: float, simulated_seconds: float) -> TokenSummary:
        """Summarise the run, its prompts in dispatch order, which ended at instant ``end`` after
        ``simulated_seconds``."""
        generated = thrown_away = fresh_thrown = lost = 0
        for prompt in prompts:
            started = prompt.started
            if prompt.fate is None or started is None:
                continue  # unresolved, or evicted before a worker took it: nothing decoded
            decoded = prompt.decoded
            if decoded < 0:  # still generating when the run ended
                decoded = self.decoder.position(prompt.lengths[0], end - started, prompt.seconds)
            tokens = sum(min(n, decoded) for n in prompt.lengths)
            generated += tokens
            lost += tokens - prompt.put_tokens
            if prompt.fate == "trained":
                thrown_away += tokens - prompt.put_tokens
                continue
            thrown_away += tokens
            if prompt.fate == "stale":
                fresh_thrown += self._fresh(prompt, decoded)
        excluded = self.excluded if self.masks else 0
        return TokenSummary(
            generated=generated,
            trained=self.trained,
            trained_stale=self.trained_stale,
            masked=self.masked,
            thrown_away=thrown_away,
            thrown_away_fresh=fresh_thrown,
            lost_in_flight=lost,
            trained_trajectories=self.trajectories,
            loss_excluded_trajectories=excluded,
            trained_per_hour=self.trained * 3600.0 / simulated_seconds,
            staleness=StalenessSummary.from_lags(self.lags, self.sync_step),
            p_would_drop_groups=None if self.masks else self.p_drops,
            p_would_drop_fraction=None if self.masks else self.p_drops / max(1, self.returned_groups),
        )

    def _fresh(self, prompt: DecodedPrompt, decoded: int) -> int:
        """The tokens of an evicted prompt that were fresh at the step that evicted it."""
        started = prompt.started
        assert started is not None
        oldest = prompt.evicted_step + 1 - self.span  # the oldest fresh version
        return sum(
            tokens
            for segments in self.decoder.segments(started, prompt.seconds, prompt.lengths, decoded)
            for version, tokens in segments
            if version >= oldest
        )
