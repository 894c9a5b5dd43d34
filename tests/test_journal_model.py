"""Recovery at a trainer step against a brute-force reference (issue 25).

The rule: recovering at ``g`` undoes what samples did after the last ``sample(g)`` and keeps what
producers did. The reference does exactly that the slow way: it restores the checkpoint taken
right after that sample and replays, one by one, every producer call made after it (each call
that succeeded then must succeed again; one that raised is skipped). The recovered buffer must
equal it: stats (every counter), clocks, and every group's content. Uids are never reused here
(the conflict of a reused uid is specified in ``test_journal_recovery.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _helpers import assert_conserved
from stalebuf import BatchNotReadyError, ReplayBuffer, SamplerConfig, StalebufError
from stalebuf.checkpoint import BufferCheckpoint

Op = tuple[Any, ...]

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("put_group"),
            st.integers(1, 3),
            st.sampled_from(["finished", "failed"]),
            st.integers(0, 9),
        ),
        st.tuples(st.just("add_prompt")),
        st.tuples(st.just("start"), st.integers(0, 30), st.integers(0, 6)),
        st.tuples(st.just("put"), st.integers(0, 30), st.integers(0, 5)),
        st.tuples(st.just("finish"), st.integers(0, 30)),
        st.tuples(st.just("fail"), st.integers(0, 30)),
        st.tuples(st.just("sample"), st.integers(0, 2), st.integers(1, 3)),
    ),
    min_size=5,
    max_size=40,
)
configs = st.builds(
    SamplerConfig,
    max_off_policy_threshold=st.integers(1, 3),
    max_off_policy_strategy=st.sampled_from(["drop", "wait"]),
    failure_strategy=st.sampled_from(["evict", "sample"]),
)


def producer_call(buffer: ReplayBuffer, op: Op, uids: list[str], step: int) -> Any:
    """Run one producer ``op`` on ``buffer`` (explicit steps: the reference's clock differs)."""
    kind = op[0]
    if kind == "put_group":
        uid = f"g{len(uids)}"
        uids.append(uid)
        return buffer.put_group_nowait(
            uid, [bytes([op[3]])] * op[1], global_steps=step, status=op[2], tokens=[op[3]] * op[1]
        )
    if kind == "add_prompt":
        uid = f"g{len(uids)}"
        uids.append(uid)
        return buffer.add_prompt_nowait(uid, global_steps=step)
    uid = uids[op[1] % len(uids)] if uids else "none"
    if kind == "start":
        return buffer.mark_running_nowait(uid, version=step + op[2] % 2)
    if kind == "put":
        return buffer.put_nowait(uid, bytes([op[2]]), index=op[2], tokens=op[2] + 1)
    if kind == "finish":
        return buffer.mark_finished_nowait(uid)
    return buffer.mark_failed_nowait(uid)


def content(buffer: ReplayBuffer) -> tuple[Any, ...]:
    checkpoint = buffer.checkpoint()
    groups = [
        (g.uid, g.dispatch_step, g.status, g.start_version,
         [(t.key, t.payload, t.versions, t.tokens) for t in g.trajectories])
        for g in checkpoint.groups
    ]  # fmt: skip
    return buffer.stats(), dict(checkpoint.clocks), groups, checkpoint.evicted_in_flight


def run(
    path: Path, config: SamplerConfig, script: list[Op]
) -> tuple[list[tuple[Op, int, bool]], dict[int, tuple[BufferCheckpoint, int]]]:
    """Run ``script`` on a journaled buffer; return each call with the step it used and whether it
    succeeded, and for each step sampled, the checkpoint right after its last sample and where."""
    buffer = ReplayBuffer(config, journal=path, journal_interval=3600.0)
    uids: list[str] = []
    calls: list[tuple[Op, int, bool]] = []
    points: dict[int, tuple[BufferCheckpoint, int]] = {}
    clock = 0
    for op in script:
        if op[0] == "sample":
            try:
                buffer.sample_nowait(clock + op[1], op[2])
            except BatchNotReadyError:
                pass
            else:
                points[clock + op[1]] = (buffer.checkpoint(), len(calls))
            clock += op[1]
            continue
        step = buffer.dispatch_step()
        try:
            producer_call(buffer, op, uids, step)
            calls.append((op, step, True))
        except (StalebufError, ValueError, TypeError):
            calls.append((op, step, False))
    buffer.close()  # the final commit
    return calls, points


def reference(checkpoint: BufferCheckpoint, calls: list[tuple[Op, int, bool]], position: int) -> ReplayBuffer:
    """The state the rule defines: the checkpoint at the point, then the later producer calls."""
    buffer = ReplayBuffer.restore(checkpoint, in_flight="keep").buffer
    uids = [
        f"g{i}"
        for i in range(sum(1 for op, _, _ in calls[:position] if op[0] in ("put_group", "add_prompt")))
    ]
    for op, step, succeeded in calls[position:]:
        if succeeded:
            producer_call(buffer, op, uids, step)
        elif op[0] in ("put_group", "add_prompt"):
            uids.append(f"g{len(uids)}")
    return buffer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=configs, script=ops)
def test_recovery_at_a_step_equals_the_checkpoint_then_the_later_producer_calls(
    tmp_path_factory: pytest.TempPathFactory, config: SamplerConfig, script: list[Op]
) -> None:
    directory = tmp_path_factory.mktemp("journal")
    path = directory / "journal.db"
    calls, points = run(path, config, script)
    for step, (checkpoint, position) in points.items():
        copy = directory / f"at-{step}.db"
        shutil.copyfile(path, copy)  # each recovery voids the history after its point
        recovered = ReplayBuffer.recover(copy, global_steps=step, in_flight="keep").buffer
        expected = reference(checkpoint, calls, position)
        assert content(recovered) == content(expected)
        assert_conserved(recovered)
        recovered.close()


def score(trajectory: Any) -> Any:
    return trajectory.payload[0] % 2 if trajectory.payload else 0


rich_configs = st.one_of(
    configs,
    st.builds(
        SamplerConfig,
        max_off_policy_threshold=st.integers(1, 3),
        mixture=st.just({"math": 1.0, "code": 1.0}),
        mixture_policy=st.sampled_from(["wait", "borrow"]),
    ),
    st.builds(
        SamplerConfig,
        max_off_policy_threshold=st.integers(1, 3),
        admission_token_budget=st.just(24),
        max_tokens_per_group=st.just(12),
    ),
)


def rich_call(buffer: ReplayBuffer, op: Op, uids: list[str], step: int, mixed: bool) -> Any:
    """``producer_call`` with a task tag under a mixture (every group names one)."""
    if mixed and op[0] in ("put_group", "add_prompt"):
        uid = f"g{len(uids)}"
        uids.append(uid)
        tags = {"task": "math" if len(uids) % 2 else "code"}
        if op[0] == "add_prompt":
            return buffer.add_prompt_nowait(uid, tags=tags)
        return buffer.put_group_nowait(uid, [bytes([op[3]])] * op[1], status=op[2], tags=tags)
    if op[0] == "put_group":
        uid = f"g{len(uids)}"
        uids.append(uid)
        return buffer.put_group_nowait(uid, [bytes([op[3]])] * op[1], status=op[2], tokens=[op[3]] * op[1])
    if op[0] == "add_prompt":
        uid = f"g{len(uids)}"
        uids.append(uid)
        return buffer.add_prompt_nowait(uid)
    return producer_call(buffer, op, uids, step)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=rich_configs, script=ops, filtered=st.booleans())
def test_recovery_at_the_last_commit_equals_the_live_buffer(
    tmp_path_factory: pytest.TempPathFactory, config: SamplerConfig, script: list[Op], filtered: bool
) -> None:
    """Everything the other issues add is journaled: versions, tokens, filter evictions and
    verdicts, task cells and balances, token reservations."""
    from stalebuf.filters import zero_variance

    path = tmp_path_factory.mktemp("journal") / "journal.db"
    filters = [zero_variance(score)] if filtered else []
    buffer = ReplayBuffer(config, journal=path, journal_interval=3600.0, filters=filters)
    uids: list[str] = []
    clock = 0
    for op in script:
        try:
            if op[0] == "sample":
                clock += op[1]
                buffer.sample_nowait(clock, op[2])
            else:
                rich_call(buffer, op, uids, buffer.dispatch_step(), config.mixture is not None)
        except (StalebufError, ValueError, TypeError):
            pass
    expected = content(buffer)
    mixing = {name: item.tasks for name, item in buffer.stats().partitions.items()}
    buffer.close()
    recovered = ReplayBuffer.recover(path, in_flight="keep", filters=filters).buffer
    assert content(recovered) == expected
    assert {name: item.tasks for name, item in recovered.stats().partitions.items()} == mixing
    assert_conserved(recovered)
    recovered.close()
