"""What the checkpoint tests share: :func:`rich`, a buffer that went through every kind of event,
and ways to compare buffers and checkpoints by content (public API only, plus ``_helpers``)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from _helpers import resident_groups, sample_now
from stalebuf import Group, ReplayBuffer, SamplerConfig
from stalebuf.checkpoint import BufferCheckpoint

__all__ = [
    "IN_FLIGHT",
    "PARTITIONS",
    "admission",
    "assert_tokens_conserved",
    "checkpoint_content",
    "group_content",
    "in_flight",
    "in_flight_trajectories",
    "rich",
    "stats_of",
]

PARTITIONS = ("train", "val", "other", "ghost")  # "ghost" has a clock and nothing else
IN_FLIGHT = {"c2", "d0", "e0", "v1", "v2", "o1"}


def rich(**options: Any) -> ReplayBuffer:
    """A buffer that went through everything a checkpoint must carry.

    train (T=2, admission b=3, failures evicted, stale in-flight groups evicted):
    a0 sampled, a2 evicted as failed, a1 and b2 evicted as stale, b0 and b1 evicted in flight
    (remembered), d1 c1 c0 FINISHED out of admission order (FIFO ties at steps 2 and 3), c2
    RUNNING with 2 trajectories, d0 PENDING with 1, e0 RUNNING dispatched explicitly at step 2
    with none (admission refuses a step ahead of the clock, 3; step 3 is full); clock 3, last sampled
    step 1. val (exempt): v0 FINISHED, v1 PENDING with 1, v2 RUNNING with 2. other: o0
    (dispatched at 1, once a sample moved its clock there) sampled at 2, o1 RUNNING with 1.
    ghost: only a clock, at 5.
    """
    config = SamplerConfig(
        max_off_policy_threshold=2,
        failure_strategy="evict",
        admission_batch_size=3,
        evict_stale_in_flight=True,
        exempt_partitions={"val"},
        sampler_kwargs=options.pop("sampler_kwargs", {}),
        custom_sampler=options.pop("custom_sampler", None),
    )
    if config.custom_sampler is not None:
        buf = ReplayBuffer.from_config(config, status_log_interval=None)
    else:
        buf = ReplayBuffer(config, status_log_interval=None, **options)

    def group(uid: str, step: int | None, puts: int, end: str | None, partition: str = "train") -> None:
        add(buf, uid, step, puts, end, partition)

    group("a0", None, 2, "finish")
    buf.add_prompt_nowait("a1", tags={"first": True})
    buf.put_nowait("a1", "x")
    buf.mark_finished_nowait("a1")
    group("a2", None, 1, "fail")
    sample_now(buf, 1, 1)  # a0 (a1 under a newest-first sampler)
    group("b0", None, 2, None)
    group("b1", None, 1, "pending")
    group("b2", None, 1, "finish")
    with pytest.raises(TimeoutError):
        sample_now(buf, 3, 5)  # evicts a1 and b2 (stale) and b0, b1 (in flight)
    group("c0", None, 1, None)
    group("c1", None, 2, "finish")
    group("c2", None, 2, None)
    group("d0", 2, 1, "pending")
    group("d1", 2, 3, "finish")
    buf.mark_finished_nowait("c0")
    group("e0", 2, 0, None)
    group("v0", None, 1, "finish", "val")
    group("v1", None, 1, "pending", "val")
    group("v2", None, 2, None, "val")
    with pytest.raises(TimeoutError):
        sample_now(buf, 1, 1, "other")  # the clock of "other" to 1: its admission takes step 1
    group("o0", 1, 1, "finish", "other")
    sample_now(buf, 2, 1, "other")
    group("o1", None, 1, None, "other")
    with pytest.raises(TimeoutError):
        sample_now(buf, 5, 1, "ghost")
    return buf


def add(buf: ReplayBuffer, uid: str, step: int | None, puts: int, end: str | None, partition: str) -> None:
    """Add group ``uid`` with ``puts`` tagged trajectories; leave it PENDING (``end="pending"``),
    RUNNING (None), or end it ("finish", "fail")."""
    buf.add_prompt_nowait(uid, global_steps=step, partition=partition, tags={"uid": uid, "n": [puts]})
    if end != "pending":
        buf.mark_running_nowait(uid)
    for session in range(puts):
        buf.put_nowait(uid, {"uid": uid, "s": session}, session_id=session, tags={"s": session})
    if end == "finish":
        buf.mark_finished_nowait(uid)
    elif end == "fail":
        buf.mark_failed_nowait(uid)


def in_flight(buf: ReplayBuffer) -> list[str]:
    return [uid for uid, view in resident_groups(buf).items() if view.in_flight]


def group_content(group: Group) -> tuple[Any, ...]:
    """A group by content (terminal groups keep their wall-clock field exactly)."""
    seconds = group.generation_seconds if group.status.is_terminal else None
    trajectories = [(t.key, t.session_id, t.index, dict(t.tags), t.payload) for t in group.trajectories]
    return (group.uid, group.partition, group.dispatch_step, group.status, dict(group.tags), trajectories,
            group.finish_step, seconds)  # fmt: skip


def checkpoint_content(ckpt: BufferCheckpoint) -> tuple[Any, ...]:
    """A checkpoint field by field, groups by content."""
    return (
        ckpt.format_version,
        ckpt.config,
        ckpt.policy,
        [group_content(group) for group in ckpt.groups],
        [(part.name, part.last_sampled, dict(part.counters)) for part in ckpt.partitions],
        dict(ckpt.clocks),
        tuple(ckpt.evicted_in_flight),
    )


def admission(buf: ReplayBuffer) -> dict[str, tuple[Any, ...]]:
    return {p: (buf.dispatch_step(p), buf.free_slots(p), buf.full(p), buf.capacity(p)) for p in PARTITIONS}


def stats_of(buf: ReplayBuffer) -> dict[str, dict[str, Any]]:
    stats = buf.stats()
    return {**{n: attrs.asdict(s) for n, s in stats.partitions.items()}, "total": attrs.asdict(stats.total)}


def in_flight_trajectories(buf: ReplayBuffer, partition: str) -> int:
    views = resident_groups(buf).values()
    return sum(len(v.trajectories) for v in views if v.in_flight and (partition in ("total", v.partition)))


def assert_tokens_conserved(buf: ReplayBuffer) -> None:
    """``admitted_tokens == tokens + sampled_tokens + evicted_tokens + reissued_tokens``, masked
    tokens among the sampled ones, per partition and in total."""
    stats = buf.stats()
    for item in (*stats.partitions.values(), stats.total):
        gone = item.sampled_tokens + item.evicted_tokens + item.reissued_tokens
        assert item.admitted_tokens == item.tokens + gone, item
        assert item.masked_tokens <= item.sampled_tokens, item
