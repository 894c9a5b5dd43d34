"""P7, memory: bytes per group and per trajectory, traced with tracemalloc (payload None).

The uid strings and step numbers are created before tracing starts, so they are not
counted. Bytes per group come from groups without trajectories; bytes per trajectory are
the extra bytes of 8 ``put``s per group. Both are measured while the groups are RUNNING,
then again after all of them are marked FINISHED, next to the polling baseline. Also, for
information, the same for groups stored whole by ``put_group`` (whose trajectory records are
built only when read).
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from typing import Any

from report import Report, Row, fmt_n, ratio, status
from sizes import Sizes
from stalebuf import ReplayBuffer
from workloads import PER_STEP, TRAJECTORIES_PER_GROUP, PollingBuffer, add_group_nowait, add_polling_group

__all__ = ["run", "traced_states"]

#: Bytes traced for groups of 0 and of 8 trajectories: {trajectories: (in flight, terminal)}.
Traced = dict[int, tuple[int, int]]


def traced_states(build: Callable[[], Any], finish: Callable[[Any], object]) -> tuple[int, int]:
    """Bytes that ``build()`` leaves allocated, and the same after ``finish(built)``
    (tracemalloc; objects created before the call are not counted)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        built = build()
        gc.collect()
        in_flight = tracemalloc.get_traced_memory()[0] - before
        finish(built)
        gc.collect()
        terminal = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del built
    gc.collect()
    return in_flight, terminal


def _measure(n: int, pn: int) -> tuple[Traced, Traced]:
    """Trace ``n`` stalebuf groups and ``pn`` polling-baseline groups; returns (stalebuf, polling)."""
    # The caller's own objects (uids, step numbers) are created before tracing starts.
    uids = [f"m{i}" for i in range(n)]
    steps = [i // PER_STEP for i in range(n)]

    def stalebuf_build(trajectories: int) -> Callable[[], Any]:
        def build() -> ReplayBuffer:
            buf = ReplayBuffer()
            for uid, step in zip(uids, steps, strict=True):
                add_group_nowait(buf, uid, step, trajectories=trajectories, finish=False)
            return buf

        return build

    def polling_build(trajectories: int) -> Callable[[], Any]:
        def build() -> PollingBuffer:
            buf = PollingBuffer(2.0)
            for uid, step in zip(uids[:pn], steps[:pn], strict=True):
                add_polling_group(buf, uid, step, trajectories=trajectories, finish=False)
            return buf

        return build

    def finish_all(buf: Any) -> None:
        for uid in uids[: len(buf.meta) if isinstance(buf, PollingBuffer) else n]:
            buf.mark_finished_nowait(uid)

    # Per group: groups without trajectories; per trajectory: the extra bytes of 8 puts.
    mine: Traced = {}
    theirs: Traced = {}
    for t in (0, TRAJECTORIES_PER_GROUP):
        status(f"P7 memory, {n} groups x {t} trajectories")
        mine[t] = traced_states(stalebuf_build(t), finish_all)
        theirs[t] = traced_states(polling_build(t), finish_all)
    return mine, theirs


def _put_group_bytes(n: int) -> tuple[float, float]:
    """(bytes per trajectory, bytes per group) of ``n`` FINISHED groups stored by ``put_group``
    with default keys, their records not yet read."""
    uids = [f"p{i}" for i in range(n)]
    steps = [i // PER_STEP for i in range(n)]
    traced: dict[int, int] = {}
    for t in (0, TRAJECTORIES_PER_GROUP):
        payloads = [None] * t

        def build(payloads: list[None] = payloads) -> ReplayBuffer:
            buf = ReplayBuffer()
            for uid, step in zip(uids, steps, strict=True):
                buf.put_group_nowait(uid, payloads, global_steps=step)
            return buf

        traced[t] = traced_states(build, lambda _buf: None)[1]
    per_group = traced[0] / n
    return (traced[TRAJECTORIES_PER_GROUP] - traced[0]) / (n * TRAJECTORIES_PER_GROUP), per_group


def _split(mem: Traced, state: int, groups: int) -> tuple[float, float]:
    """(bytes per trajectory, bytes per group) in ``state`` (0: in flight, 1: terminal)."""
    per_group = mem[0][state] / groups
    per_traj = (mem[TRAJECTORIES_PER_GROUP][state] - mem[0][state]) / (groups * TRAJECTORIES_PER_GROUP)
    return per_traj, per_group


def run(sizes: Sizes, report: Report) -> None:
    """Measure P7 and add its rows to ``report``."""
    n, pn = sizes.p7_groups, sizes.p7_polling_groups
    mine, theirs = _measure(n, pn)
    for label, state in (("resident terminal (FINISHED)", 1), ("in-flight (RUNNING)", 0)):
        traj, group = _split(mine, state, n)
        ptraj, pgroup = _split(theirs, state, pn)
        for what, mine_b, theirs_b, limit in (
            (f"bytes per trajectory ({fmt_n(n)} groups x 8, payload None)", traj, ptraj, 200),
            ("bytes per group (uids not counted)", group, pgroup, 500),
        ):
            report.add(
                Row(
                    target="P7",
                    what=f"{label}: {what}",
                    stalebuf=f"{mine_b:.0f} B",
                    baseline=f"{theirs_b:.0f} B (polling, {fmt_n(pn)} groups)",
                    ratio=ratio(mine_b, theirs_b),
                    goal=f"<= {limit} B",
                    verdict=report.check("P7", mine_b <= limit),
                )
            )
    status(f"P7 memory, {n} groups stored by put_group")
    traj, group = _put_group_bytes(n)
    report.info(
        "P7",
        f"FINISHED groups stored by put_group_nowait (records built when read): bytes per trajectory "
        f"/ per group ({fmt_n(n)} groups x 8, payload None)",
        f"{traj:.0f} B / {group:.0f} B",
    )
