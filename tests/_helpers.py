"""Small builders shared by the core tests."""

from __future__ import annotations

from typing import Any

from stalebuf import ReplayBuffer, Status
from stalebuf.partition import OpenGroup


def add_group(
    buf: ReplayBuffer,
    uid: str,
    step: int,
    *,
    n: int = 2,
    status: Status = Status.FINISHED,
    partition: str = "train",
) -> list[str]:
    """Add a group dispatched at ``step`` with ``n`` trajectories and bring it to ``status``."""
    buf.add_prompt_nowait(uid, global_steps=step, partition=partition)
    if status is Status.PENDING:
        keys = [buf.put_nowait(uid, i, session_id=i) for i in range(n)]
        return keys
    buf.mark_running_nowait(uid)
    keys = [buf.put_nowait(uid, i, session_id=i) for i in range(n)]
    if status is Status.FINISHED:
        buf.mark_finished_nowait(uid)
    elif status is Status.FAILURE:
        buf.mark_failed_nowait(uid)
    return keys


def resident_keys(buf: ReplayBuffer) -> list[str]:
    """The keys of every trajectory held by a resident group."""
    keys: list[str] = []
    for group in buf._groups.values():
        if isinstance(group, OpenGroup):
            keys.extend(group.trajectories)
        else:
            keys.extend(t.key for t in group.trajectories)
    return keys


def assert_conserved(buf: ReplayBuffer) -> None:
    """admitted == resident + sampled + evicted by reason, for groups and trajectories alike,
    per partition and in total; and the totals match what the buffer actually holds."""
    stats = buf.stats()
    for item in (*stats.partitions.values(), stats.total):
        assert item.admitted_groups == (
            item.groups + item.sampled_groups + item.evicted_stale_groups + item.evicted_failure_groups
        ), item
        assert item.admitted_trajectories == (
            item.trajectories
            + item.sampled_trajectories
            + item.evicted_stale_trajectories
            + item.evicted_failure_trajectories
        ), item
    assert stats.total.groups == len(buf._groups)
    assert stats.total.trajectories == len(resident_keys(buf))


def snapshot(buf: ReplayBuffer) -> Any:
    """Everything observable about the buffer: stats plus every group's full contents."""
    groups = {}
    for uid, group in buf._groups.items():
        groups[uid] = (
            group.status,
            group.global_steps,
            dict(group.tags),
            [(t.key, t.session_id, t.index, dict(t.tags), t.payload) for t in _trajectories(group)],
        )
    ready = {name: [g.uid for g in part.iter_ready()] for name, part in buf._partitions.items()}
    return buf.stats(), groups, ready


def _trajectories(group: Any) -> list[Any]:
    trajectories = group.trajectories
    return list(trajectories.values()) if isinstance(trajectories, dict) else list(trajectories)
