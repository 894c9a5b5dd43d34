"""Custom samplers used by the tests (importable as the module ``samplers``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from stalebuf import EvictionEvent, Group, ReplayBuffer, SamplerConfig


class NewestFirst(ReplayBuffer):
    """Selects the newest groups first (consumes every candidate: O(N))."""

    def _select(
        self, candidates: Iterator[Group], batch_size: int, global_steps: int, partition: str
    ) -> Sequence[Group]:
        return list(candidates)[::-1][:batch_size]


class AgeCapped(ReplayBuffer):
    """Drops groups older than ``max_age`` steps, whatever the threshold says."""

    def __init__(self, *args: Any, max_age: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_age = max_age

    def _is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        return global_steps - dispatch_step > self.max_age


class ShortSelect(ReplayBuffer):
    """A broken hook: returns one group too few."""

    def _select(
        self, candidates: Iterator[Group], batch_size: int, global_steps: int, partition: str
    ) -> Sequence[Group]:
        return list(candidates)[: batch_size - 1]


class VerlStyle(ReplayBuffer):
    """A plugin written the way verl's are: its constructor has no ``status_log_interval``."""

    def __init__(
        self,
        config: SamplerConfig | None = None,
        *,
        on_evict: Callable[[EvictionEvent], object] | None = None,
        label: str = "x",
    ) -> None:
        super().__init__(config, on_evict=on_evict)
        self.label = label


NOT_A_SAMPLER = object


class Unrelated:
    """Not a ReplayBuffer subclass."""
