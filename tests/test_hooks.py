"""Policy hooks that raise: the buffer stays exactly as it was and the error reaches the caller.

A hook is a ``ReplayBuffer`` subclass's ``_is_stale`` / ``_must_wait_for`` / ``_select`` or a
:class:`~stalebuf.StalenessPolicy`'s ``is_stale`` / ``must_wait_for`` / ``select`` (and
``is_exempt`` / ``evicts_failures``). The rule (issue 10, item 2): the buffer asks before it
changes anything, so a hook that raises leaves it as it was (``full_snapshot``) and the error
propagates out of the call that ran it. A hook run on a producer's path (the wake-up check
after a group completes) must not turn the completed producer call into an error: it is
logged, and the waiting ``sample`` re-evaluates and raises it instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

import stalebuf
from _helpers import (
    LIMIT,
    RaisingAdmits,
    add_group,
    assert_conserved,
    full_snapshot,
    resident_count,
    resident_groups,
    settle,
)
from _helpers import train_stats as train
from stalebuf import EvictionEvent, ReplayBuffer, SamplerConfig, Status

pytestmark = pytest.mark.anyio

KINDS = ["subclass", "policy"]


class Boom(Exception):
    pass


class Trap:
    """Makes the hook named ``hook`` raise Boom while armed, for the calls ``when`` accepts."""

    def __init__(self, hook: str, when: Callable[..., bool] = lambda *args: True) -> None:
        self.hook, self.when = hook, when
        self.armed = True
        self.raised = 0

    def check(self, hook: str, *args: Any) -> None:
        if self.armed and hook == self.hook and self.when(*args):
            self.raised += 1
            raise Boom(hook)


def hooked(kind: str, trap: Trap, **config: Any) -> ReplayBuffer:
    """A buffer whose rules consult ``trap`` first: through a subclass's protected hooks
    (verl-style) or through a StalenessPolicy subclass given as ``policy=``."""
    sampler_config = SamplerConfig(**config)
    if kind == "subclass":

        class TrappedBuffer(ReplayBuffer):
            def _is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
                trap.check("is_stale", global_steps, dispatch_step)
                return super()._is_stale(global_steps, dispatch_step, partition)

            def _must_wait_for(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
                trap.check("must_wait_for", global_steps, dispatch_step)
                return super()._must_wait_for(global_steps, dispatch_step, partition)

            def _select(self, candidates: Any, batch_size: int, global_steps: int, partition: str) -> Any:
                trap.check("select", global_steps)
                return super()._select(candidates, batch_size, global_steps, partition)

        return TrappedBuffer(sampler_config, status_log_interval=None)

    class TrappedPolicy(stalebuf.StalenessPolicy):
        def is_exempt(self, partition: str) -> bool:
            trap.check("is_exempt", partition)
            return super().is_exempt(partition)

        def evicts_failures(self, partition: str) -> bool:
            trap.check("evicts_failures", partition)
            return super().evicts_failures(partition)

        def is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
            trap.check("is_stale", global_steps, dispatch_step)
            return super().is_stale(global_steps, dispatch_step, partition)

        def must_wait_for(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
            trap.check("must_wait_for", global_steps, dispatch_step)
            return super().must_wait_for(global_steps, dispatch_step, partition)

        def select(self, candidates: Any, batch_size: int, global_steps: int, partition: str) -> Any:
            trap.check("select", global_steps)
            return super().select(candidates, batch_size, global_steps, partition)

    return ReplayBuffer(sampler_config, policy=TrappedPolicy(sampler_config), status_log_interval=None)


# The calls that evaluate a partition, each as ``call(buf, global_steps, batch_size)``.
CALLS: dict[str, Callable[[ReplayBuffer, int, int], Awaitable[object] | object]] = {
    "sample": lambda buf, g, b: buf.sample(g, b),
    "sample-timeout-0": lambda buf, g, b: buf.sample(g, b, timeout=0),
    "sample_nowait": lambda buf, g, b: buf.sample_nowait(g, b),
}


# is_stale is also asked by the one call that only counts.
ASKING_IS_STALE = {**CALLS, "sampleable_count": lambda buf, g, b: buf.sampleable_count(g)}


async def awaited(result: object) -> object:
    return await result if isinstance(result, Awaitable) else result


async def call(name: str, buf: ReplayBuffer, g: int, b: int) -> object:
    return await awaited(ASKING_IS_STALE[name](buf, g, b))


# -- a hook raising inside a consumer's call ------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(ASKING_IS_STALE))
async def test_is_stale_raising_after_the_first_answer_changes_nothing(kind: str, name: str) -> None:
    """Regression: the first stale bucket was popped before the hook raised for the next one;
    its groups were gone from the index but still counted, and later samples raised IndexError."""
    with anyio.fail_after(LIMIT):
        trap = Trap("is_stale", lambda g, step: step >= 1)  # step 0 is stale, step 1 raises
        buf = hooked(kind, trap, max_off_policy_threshold=1)
        for uid, step in [("s0", 0), ("s1", 1), ("s2", 2), ("fresh", 9)]:
            add_group(buf, uid, step)
        before = full_snapshot(buf)
        with pytest.raises(Boom):
            await call(name, buf, 9, 1)
        assert trap.raised
        assert full_snapshot(buf) == before, "a raising is_stale left the buffer changed"
        trap.armed = False
        batch, _ = await buf.sample(9, 1, timeout=0)
        assert batch.uids == ["fresh"]
        assert buf.stats().total.evicted_stale_groups == 3
        assert_conserved(buf)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(CALLS))
async def test_must_wait_for_raising_changes_nothing(kind: str, name: str) -> None:
    with anyio.fail_after(LIMIT):
        trap = Trap("must_wait_for")
        buf = hooked(kind, trap, max_off_policy_threshold=1, max_off_policy_strategy="wait")
        add_group(buf, "gate", 0, status=Status.RUNNING)
        add_group(buf, "ready", 5)
        before = full_snapshot(buf)
        with pytest.raises(Boom):
            await call(name, buf, 5, 1)
        assert full_snapshot(buf) == before
        trap.armed = False
        buf.mark_finished_nowait("gate")
        assert (await buf.sample(5, 2, timeout=0))[0].uids == ["gate", "ready"]
        assert_conserved(buf)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(CALLS))
async def test_select_raising_changes_nothing(kind: str, name: str) -> None:
    with anyio.fail_after(LIMIT):
        trap = Trap("select")
        buf = hooked(kind, trap)
        add_group(buf, "a", 0)
        add_group(buf, "b", 1)
        before = full_snapshot(buf)
        with pytest.raises(Boom):
            await call(name, buf, 1, 2)
        assert full_snapshot(buf) == before
        trap.armed = False
        assert (await buf.sample(1, 2, timeout=0))[0].uids == ["a", "b"]
        assert_conserved(buf)


@pytest.mark.parametrize("kind", KINDS)
async def test_select_raising_after_an_eviction_keeps_the_eviction_and_the_groups(kind: str) -> None:
    """The eviction round completed (and was reported) before selection ran: it stands, and
    the raising selection takes nothing."""
    with anyio.fail_after(LIMIT):
        trap = Trap("select")
        buf = hooked(kind, trap, max_off_policy_threshold=1)
        add_group(buf, "old", 0)
        add_group(buf, "a", 5)
        with pytest.raises(Boom):
            await buf.sample(5, 1)
        assert set(resident_groups(buf)) == {"a"}
        assert buf.stats().total.evicted_stale_groups == 1
        assert_conserved(buf)


FIRST_USES: dict[str, Callable[[ReplayBuffer], object]] = {
    "add_prompt_nowait": lambda buf: buf.add_prompt_nowait("a", global_steps=0, partition="new"),
    "put_group_nowait": lambda buf: buf.put_group_nowait("a", ["x"], global_steps=0, partition="new"),
    "sample": lambda buf: buf.sample(0, 1, partition="new", timeout=LIMIT),
}


@pytest.mark.parametrize("hook", ["is_exempt", "evicts_failures"])
@pytest.mark.parametrize("first_use", list(FIRST_USES))
async def test_a_partition_rule_raising_on_first_use_creates_nothing(hook: str, first_use: str) -> None:
    with anyio.fail_after(LIMIT):
        trap = Trap(hook)
        buf = hooked("policy", trap)
        before = full_snapshot(buf)
        with pytest.raises(Boom):
            await awaited(FIRST_USES[first_use](buf))
        assert full_snapshot(buf) == before
        trap.armed = False
        buf.put_group_nowait("a", ["x"], global_steps=0, partition="new")
        assert (await buf.sample(0, 1, partition="new", timeout=0))[0].uids == ["a"]


# -- a hook raising on a producer's wake-up check ---------------------------------------------------


def gated_setup(buf: ReplayBuffer, hook: str) -> None:
    """Groups under which ``sample(5, 2)`` parks without asking ``hook``, and which the
    producer's completing call (of group "b") turns into a wake-up check that asks it."""
    if hook == "must_wait_for":
        add_group(buf, "gate", 0, status=Status.RUNNING)  # the gate asks about it
        add_group(buf, "a", 5)


async def complete_b(buf: ReplayBuffer, producer: str, hook: str) -> None:
    step = 0 if hook == "is_stale" else 5  # is_stale is asked about the oldest ready group
    if producer == "put_group_nowait":
        buf.put_group_nowait("b", ["x"], global_steps=step)
    elif producer == "mark_finished_nowait":
        add_group(buf, "b", step, status=Status.RUNNING)
        buf.mark_finished_nowait("b")
    else:
        add_group(buf, "b", step, status=Status.RUNNING)
        await buf.mark_failed("b")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hook", ["is_stale", "must_wait_for"])
@pytest.mark.parametrize("producer", ["put_group_nowait", "mark_finished_nowait", "mark_failed"])
async def test_a_hook_raising_on_a_producers_wake_up_check_raises_in_the_waiting_sample(
    kind: str, hook: str, producer: str, caplog: pytest.LogCaptureFixture
) -> None:
    with anyio.fail_after(LIMIT):
        strategy = "drop" if hook == "is_stale" else "wait"
        trap = Trap(hook)
        buf = hooked(kind, trap, max_off_policy_threshold=1, max_off_policy_strategy=strategy)
        gated_setup(buf, hook)
        outcome: list[BaseException] = []

        async def waiting_sample() -> None:
            try:
                await buf.sample(5, 2)
            except Boom as exc:
                outcome.append(exc)

        caplog.set_level(logging.ERROR, logger="stalebuf")
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting_sample)
            await settle()
            assert buf.stats().total.waiting_samplers == 1
            assert not trap.raised, "the setup asked the hook before the producer's call"
            await complete_b(buf, producer, hook)  # must not raise: its change is done
            assert "b" in buf
        assert trap.raised >= 2  # the producer's wake-up check, then the woken sample
        assert len(outcome) == 1, "the waiting sample did not raise the hook's error"
        assert any(
            record.exc_info is not None and isinstance(record.exc_info[1], Boom) for record in caplog.records
        ), "the hook's error on the producer's path was not logged"
        assert resident_groups(buf)["b"].status is (
            Status.FAILURE if producer == "mark_failed" else Status.FINISHED
        )
        assert buf.stats().total.waiting_samplers == 0
        assert_conserved(buf)


@pytest.mark.parametrize("kind", KINDS)
async def test_after_a_raising_head_the_next_waiter_is_served(kind: str) -> None:
    """The head raises the hook's error; once the hook recovers, the waiter behind it gets a batch."""
    with anyio.fail_after(LIMIT):
        trap = Trap("select")
        buf = hooked(kind, trap)
        outcomes: list[object] = []

        async def run(batch_size: int) -> None:
            try:
                outcomes.append((await buf.sample(0, batch_size))[0].uids)
            except Boom:
                outcomes.append("boom")
                trap.armed = False

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 1)
            await settle()
            tg.start_soon(run, 1)
            await settle()
            buf.put_group_nowait("a", ["x"], global_steps=0)
        assert outcomes == ["boom", ["a"]]
        assert_conserved(buf)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("hook", "strategy", "g"),
    [("is_stale", "drop", 20), ("must_wait_for", "wait", 20), ("select", "drop", 0)],
)
def test_hooked_buffers_ask_the_trap(kind: str, hook: str, strategy: str, g: int) -> None:
    """The fixture itself: each kind routes the rule through the trap (else tests pass vacuously)."""
    trap = Trap(hook)
    buf = hooked(kind, trap, max_off_policy_strategy=strategy)
    add_group(buf, "a", 0)
    add_group(buf, "b", 0, status=Status.RUNNING)
    with pytest.raises(Boom):
        buf.sample_nowait(g, 1)
    assert trap.raised == 1


class _Clobbering(ReplayBuffer):
    """A verl-style plugin that names its own state and helpers like the old buffer internals."""

    def __init__(self, config: SamplerConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._config = "the plugin's own config"
        self._groups = {"plugin": "state"}
        self._partitions: list[str] = []
        self._closed = "never"
        self._clocks = None

    def _evict(self, *args: Any) -> None:
        raise AssertionError("the buffer called the plugin's _evict")

    def _emit(self, *args: Any) -> None:
        raise AssertionError("the buffer called the plugin's _emit")

    def _result(self, *args: Any) -> None:
        raise AssertionError("the buffer called the plugin's _result")

    def _leave(self, *args: Any) -> None:
        raise AssertionError("the buffer called the plugin's _leave")


async def test_a_subclass_that_names_state_and_helpers_like_the_internals_does_not_replace_them() -> None:
    """Defect (issue 20): a verl-style ReplayBuffer subclass that set ``self._config`` or defined
    ``_evict``, ``_emit``, ``_result``, ``_leave`` or ``_groups`` silently replaced the buffer's
    machinery. The facade's parts are name-mangled: the plugin's names are its own."""
    events: list[EvictionEvent] = []
    config = SamplerConfig(max_off_policy_threshold=1, failure_strategy="evict")
    buf = _Clobbering(config, on_evict=events.append)
    with anyio.fail_after(LIMIT):
        await buf.put_group("old", [1], global_steps=0)
        await buf.put_group("bad", [1], global_steps=1, status="failed")

        async def produce() -> None:
            await anyio.sleep(0.01)
            await buf.put_group("new", [2], global_steps=2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            batch, _ = await buf.sample(2, 1)  # waits, evicts "old" (stale) and "bad" (failed)
    assert batch.uids == ["new"]
    assert sorted(event.reason for event in events) == ["failure", "stale"]
    assert buf.config is config
    assert buf._groups == {"plugin": "state"}
    restored, _ = _Clobbering.restore(buf.checkpoint())
    assert restored.stats() == buf.stats()
    buf.close()
    assert buf.closed


# -- a hook raising while sample builds its admission metrics ------------------------------------


class StaleTrapAfterSample(ReplayBuffer):
    """Its ``_is_stale`` raises for the step after a sample (asked by admission's rule)."""

    armed = False

    def _is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        if self.armed and global_steps == 1:
            raise RuntimeError("hook")
        return super()._is_stale(global_steps, dispatch_step, partition)


@pytest.mark.parametrize("kind", ["subclass _is_stale", "policy admits"])
@pytest.mark.parametrize("call", ["sample", "sample_nowait", "sample parked"])
async def test_a_hook_raising_while_sample_builds_admission_metrics_loses_no_batch(
    kind: str, call: str
) -> None:
    """Defect (issue 10, items 2 and 3: "a user hook that raises leaves the buffer exactly as it
    was ... compute everything that can fail before removing anything"): under admission control
    ``sample`` asked the policy's ``admits`` (and through it ``_is_stale``) for its free-slots
    metric after it had removed the batch, so a raising hook lost the batch (counted sampled,
    never returned)."""
    config = SamplerConfig(admission_batch_size=2)
    buf: ReplayBuffer
    if kind == "subclass _is_stale":
        buf = StaleTrapAfterSample(config)
    else:
        buf = ReplayBuffer(config, policy=RaisingAdmits(config))
    if call != "sample parked":
        buf.put_group_nowait("a", [1, 2], global_steps=0)
    trap: Any = buf if kind == "subclass _is_stale" else buf.policy
    trap.armed = True
    batch = None
    try:
        with anyio.fail_after(LIMIT):
            if call == "sample":
                batch, _ = await buf.sample(0, 1, timeout=0)
            elif call == "sample_nowait":
                batch, _ = buf.sample_nowait(0, 1)
            else:
                async with anyio.create_task_group() as tg:

                    async def sampler() -> None:
                        nonlocal batch
                        with contextlib.suppress(RuntimeError):
                            batch, _ = await buf.sample(0, 1)

                    tg.start_soon(sampler)
                    await settle()
                    assert buf.stats().total.waiting_samplers == 1
                    trap.armed = False  # the put_group's own admission check must pass
                    buf.put_group_nowait("a", [1, 2], global_steps=0)
                    trap.armed = True
    except RuntimeError:
        pass
    total = buf.stats().total
    delivered = 0 if batch is None else len(batch)
    # Either the batch was returned, or it is still in the buffer: never counted and gone.
    assert total.sampled_groups == delivered
    assert delivered + resident_count(buf) == 1


@pytest.mark.parametrize("nowait", [False, True])
async def test_a_raising_admits_hook_never_loses_a_sampled_batch(nowait: bool) -> None:
    """Defect (issue 11): "sample metrics, always present on partitions with admission:
    {prefix}/admission/free_slots (free_slots() after the batch is taken)"; computing it asks the
    policy's ``admits``, and when that raised after the batch was removed, the batch vanished
    with the error."""
    config = SamplerConfig(admission_batch_size=2, max_off_policy_threshold=2)
    policy = RaisingAdmits(config)
    buf = ReplayBuffer(config, policy=policy, status_log_interval=None)
    buf.put_group_nowait("a", [1], global_steps=0)
    buf.put_group_nowait("b", [1], global_steps=0)
    policy.armed = True
    with anyio.fail_after(LIMIT):
        try:
            if nowait:
                batch, _ = buf.sample_nowait(0, 1)
            else:
                batch, _ = await buf.sample(0, 1)
        except RuntimeError:
            # Raising is acceptable only if nothing was taken.
            assert "a" in buf
            assert train(buf).sampled_groups == 0
        else:
            assert [group.uid for group in batch.groups] == ["a"]
    assert_conserved(buf)
