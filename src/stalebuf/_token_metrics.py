"""The per-token metrics of a returned batch (``{prefix}/off_policy/token_staleness/...``).

Computed from the batch's version runs, never per token: O(runs + trajectories).
"""

from __future__ import annotations

import numpy as np

from . import _token_arrays as arrays
from ._batch import batch_runs, excluded_trajectories, fresh_runs
from .records import Batch

__all__ = ["token_metrics"]


def token_metrics(batch: Batch, prefix: str) -> tuple[dict[str, float], int]:
    """Return the token metrics of ``batch`` under ``prefix`` ("training", ...) and how many of
    its tokens the ``mask`` strategy kept out of the loss; no metric when it holds no token."""
    versions, lengths, offsets, starts = batch_runs(batch.groups)
    if not lengths.size:
        return {}, 0
    # Sums as floats (metrics) and Python ints (counters): a batch may hold more than 2**63 - 1
    # tokens in all, where an int64 sum would wrap.
    weights = lengths.astype(np.float64)
    total = float(weights.sum())
    g, sync_step = batch.global_steps, batch.parameter_sync_step
    # Versions newer than the step (a journal recovered at an earlier one) count as fresh: 1 / S.
    lag = np.maximum(arrays.staleness(versions, g, sync_step), 1.0 / sync_step)  # per run, in S units
    masked = excluded = 0
    if batch.masks:
        fresh = fresh_runs(batch, versions, offsets)
        masked = sum(lengths[~fresh].tolist())
        excluded = int(excluded_trajectories(fresh, lengths, offsets).sum())
    head, tail = (
        np.maximum(lag, 1.0 / sync_step)
        for lag in arrays.head_tail_staleness(versions, offsets, starts, g, sync_step)
    )
    off = f"{prefix}/off_policy"
    metrics = {
        f"{off}/token_staleness/mean": float(np.dot(lag, weights) / total),
        f"{off}/token_staleness/max": float(lag.max()),
        f"{off}/masked_tokens": float(masked),
        f"{off}/loss_excluded_trajectories": float(excluded),
        f"{off}/head_staleness/mean": float(head.mean()),
        f"{off}/tail_staleness/mean": float(tail.mean()),
    }
    return metrics, masked
