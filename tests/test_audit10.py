"""Regression tests from an independent audit of issue 10 (reliability, round 2).

Each test names the issue item it holds the code to. Waits are bounded by ``anyio.fail_after``
or thread joins with a limit; nothing asserts on timing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anyio
import pytest

from _helpers import LIMIT, LyingLen, RaisingAdmits, settle
from stalebuf import ReplayBuffer, SamplerConfig, StalebufError, Status
from stalebuf.errors import ConfigError, DuplicateTrajectoryError, WrongThreadError


def outcome_in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a fresh thread; return what it returned or the exception it raised."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(LIMIT)
    assert not thread.is_alive(), "the thread hung"
    return outcome[0]


async def outcome_from_worker(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a worker thread while the loop keeps running; return its outcome."""

    def run() -> Any:
        try:
            return fn()
        except BaseException as exc:
            return exc

    with anyio.fail_after(LIMIT):
        return await anyio.to_thread.run_sync(run)


def resident(buf: ReplayBuffer) -> int:
    total = buf.stats().total
    return total.pending + total.running + total.finished + total.failure


# -- item 10: the threadsafe handle mirrors the *_nowait producers -------------------------


@pytest.mark.anyio
async def test_threadsafe_add_prompt_and_put_group_default_global_steps_like_their_nowait_twins() -> None:
    """Item 10: the handle's methods run the ``*_nowait`` operation, so they take what it takes:
    ``add_prompt_nowait(uid)`` and ``put_group_nowait(uid, payloads)`` default ``global_steps``
    to the dispatch clock; the handle must not make it a required argument."""
    buf = ReplayBuffer()
    producer = buf.threadsafe()

    def produce() -> list[str]:
        producer.add_prompt("a")
        producer.mark_finished("a")
        return producer.put_group("b", [1, 2])

    outcome = await outcome_from_worker(produce)
    assert outcome == ["b_0_0", "b_1_0"], outcome
    with anyio.fail_after(LIMIT):
        batch, _ = await buf.sample(0, 2)
    assert list(batch.uids) == ["a", "b"]


@pytest.mark.anyio
@pytest.mark.parametrize("query", ["capacity", "free_slots", "full"])
async def test_flow_control_queries_from_another_thread_raise_wrong_thread_error(query: str) -> None:
    """Item 10: "once the buffer is bound to an event loop, any call from a thread other than
    the loop's raises WrongThreadError". ``free_slots``/``full`` even drop abandoned producer
    waiters, i.e. change the loop's queues from the foreign thread. (``dispatch_step`` reads
    one int and stays callable from any thread: the example server relies on it.)"""
    buf = ReplayBuffer(SamplerConfig(admission_batch_size=2))
    buf.threadsafe()  # binds the buffer to this loop
    outcome = await outcome_from_worker(lambda: getattr(buf, query)("train"))
    assert isinstance(outcome, WrongThreadError), outcome


# -- item 2/3: nothing that can fail runs after sample removed the batch ---------------------


class _StaleTrapAfterSample(ReplayBuffer):
    """Its ``_is_stale`` raises for the step after a sample (asked by admission's rule)."""

    armed = False

    def _is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        if self.armed and global_steps == 1:
            raise RuntimeError("hook")
        return super()._is_stale(global_steps, dispatch_step, partition)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["subclass _is_stale", "policy admits"])
@pytest.mark.parametrize("call", ["sample", "sample_nowait", "sample parked"])
async def test_a_hook_raising_while_sample_builds_admission_metrics_loses_no_batch(
    kind: str, call: str
) -> None:
    """Items 2 and 3: "a user hook that raises leaves the buffer exactly as it was ... compute
    everything that can fail before removing anything". Under admission control ``sample``
    asked the policy's ``admits`` (and through it ``_is_stale``) for its free-slots metric after
    it had removed the batch: a raising hook lost the batch (counted sampled, never returned)."""
    config = SamplerConfig(admission_batch_size=2)
    buf: ReplayBuffer
    if kind == "subclass _is_stale":
        buf = _StaleTrapAfterSample(config)
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
    assert delivered + resident(buf) == 1


# -- item 4: a payloads collection whose len() disagrees with what it yields -----------------


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("argument", ["payloads", "session_ids", "indices", "trajectory_tags"])
def test_put_group_collection_whose_len_disagrees_with_its_items_is_a_value_error(
    argument: str, length: int
) -> None:
    """Item 4: "a payloads collection ... whose len() disagrees with what it yields ... a
    length mismatch is a typed ValueError with nothing changed" (every per-trajectory
    argument is materialised the same way)."""
    buf = ReplayBuffer()
    values: dict[str, list[Any]] = {
        "payloads": ["x", "y"],
        "session_ids": [0, 1],
        "indices": [0, 0],
        "trajectory_tags": [None, None],
    }
    kwargs: dict[str, Any] = {"global_steps": 0}
    if argument != "payloads":
        kwargs[argument] = LyingLen(length, values[argument])
        payloads: Any = values["payloads"]
    else:
        payloads = LyingLen(length, values["payloads"])
    with pytest.raises(ValueError, match=argument):
        buf.put_group_nowait("g", payloads, **kwargs)
    assert "g" not in buf
    assert buf.stats().total.admitted_groups == 0


# -- item 14: messages never repr unbounded user values --------------------------------------


def test_duplicate_trajectory_message_of_put_group_is_bounded_for_a_huge_uid() -> None:
    """Item 14: "error messages must never repr unbounded user values: truncate"."""
    buf = ReplayBuffer()
    uid = "u" * 100_000
    with pytest.raises(DuplicateTrajectoryError) as info:
        buf.put_group_nowait(uid, [1, 2], global_steps=0, session_ids=[0, 0])
    assert len(str(info.value)) < 1000


# -- item 15: raising __iter__/__hash__/__eq__ in config arguments ---------------------------


class _Evil:
    def __repr__(self) -> str:
        raise RuntimeError("evil repr")

    def __hash__(self) -> int:
        raise RuntimeError("evil hash")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("evil eq")

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("evil iter")

    def __len__(self) -> int:
        raise RuntimeError("evil len")


class _EvilMapping(Mapping[str, Any]):
    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("evil getitem")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("evil iter")

    def __len__(self) -> int:
        raise RuntimeError("evil len")


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: SamplerConfig(exempt_partitions=_Evil()), id="exempt_partitions-iter"),
        pytest.param(lambda: SamplerConfig(exempt_partitions=[_Evil()]), id="exempt_partitions-hash"),
        pytest.param(lambda: SamplerConfig(sampler_kwargs=_EvilMapping()), id="sampler_kwargs-iter"),
        pytest.param(lambda: SamplerConfig.from_mapping(_EvilMapping()), id="from_mapping-iter"),
        pytest.param(lambda: ReplayBuffer.from_config(_EvilMapping()), id="from_config-iter"),
        pytest.param(lambda: ReplayBuffer(policy=_Evil()), id="policy-no-config"),  # type: ignore[arg-type]
    ],
)
def test_config_arguments_whose_dunders_raise_get_a_config_error(call: Callable[[], object]) -> None:
    """Item 15: "arguments whose __repr__/__len__/__eq__ raise pass that exception through ...
    type checks come first and messages name the type, not the repr"."""
    with pytest.raises(ConfigError):
        call()


# -- item 12: the minimal custom sampler constructor, through restore -------------------------


class VerlStyleSampler(ReplayBuffer):
    """A custom sampler shaped like verl's plugins: no ``status_log_interval`` parameter."""

    def __init__(
        self, config: SamplerConfig | None = None, *, on_evict: Any = None, label: str = "x"
    ) -> None:
        super().__init__(config, on_evict=on_evict)
        self.label = label


def test_restore_builds_a_custom_sampler_whose_init_does_not_take_status_log_interval() -> None:
    """Item 12: "Pass status_log_interval only when the caller gave one". ``restore`` builds
    "what from_config builds from the saved config", but always passed the interval, so a
    checkpoint of a verl-style custom sampler could not be restored."""
    config = SamplerConfig(custom_sampler=f"{__name__}:VerlStyleSampler", sampler_kwargs={"label": "y"})
    buf = ReplayBuffer.from_config(config)
    assert isinstance(buf, VerlStyleSampler)
    buf.put_group_nowait("a", [1], global_steps=0)
    restored = ReplayBuffer.restore(buf.checkpoint()).buffer
    assert isinstance(restored, VerlStyleSampler)
    assert restored.label == "y"
    assert "a" in restored


# -- item 7: on_evict that keeps re-admitting stale groups -----------------------------------


@pytest.mark.parametrize("pattern", ["alternating uids", "fresh uids"])
def test_on_evict_re_admitting_stale_groups_under_new_uids_is_bounded(pattern: str) -> None:
    """Item 7: "Bound the eviction rounds of one sample ... raise a clear StalebufError naming
    the cause, with the buffer consistent". The guard turns an endless loop into a test
    failure."""
    rounds = 0

    def on_evict(event: Any) -> None:
        nonlocal rounds
        rounds += 1
        if rounds > 5_000:
            raise AssertionError("sample looped over eviction rounds without bound")
        for group in event.groups:
            uid = ("b" if group.uid == "a" else "a") if pattern == "alternating uids" else f"x{rounds}"
            buf.put_group_nowait(uid, [1], global_steps=0)

    buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=1), on_evict=on_evict)
    buf.put_group_nowait("a", [1], global_steps=0)
    with pytest.raises(StalebufError):
        buf.sample_nowait(5, 1)
    total = buf.stats().total
    assert total.admitted_groups == resident(buf) + total.sampled_groups + total.evicted_stale_groups


def test_on_evict_may_retry_a_stale_group_under_new_uids_a_few_times() -> None:
    """The bound counts rounds in a row: an on_evict that re-admits at the stale step a few
    times and then stops is served, every round reported."""
    retries: list[str] = []

    def on_evict(event: Any) -> None:
        if len(retries) < 3:
            retries.append(f"r{len(retries)}")
            buf.put_group_nowait(retries[-1], [1], global_steps=0)

    buf = ReplayBuffer(SamplerConfig(max_off_policy_threshold=1), on_evict=on_evict)
    buf.put_group_nowait("a", [1], global_steps=0)
    buf.put_group_nowait("fresh", [1], global_steps=5)
    batch, _ = buf.sample_nowait(5, 1)
    assert batch.uids == ["fresh"]
    assert buf.stats().total.evicted_stale_groups == 4  # "a" and its three retries
    assert resident(buf) == 0


def test_put_group_status_accepts_a_str_subclass_by_its_value() -> None:
    """Item 19: "accept Status members and their values" — numpy's ``str_`` (a status read from
    an array) is a str subclass; its plain value counts, not its overrides."""
    import numpy as np

    class Shouting(str):
        def __eq__(self, other: object) -> bool:
            raise RuntimeError("evil eq")

        __hash__ = str.__hash__

    buf = ReplayBuffer(status_log_interval=None)
    buf.put_group_nowait("a", [1], global_steps=0, status=np.str_("failure"))
    buf.put_group_nowait("b", [1], global_steps=0, status=Shouting("finished"))
    statuses = {group.uid: group.status for group in buf.sample_nowait(0, 2)[0]}
    assert statuses == {"a": Status.FAILURE, "b": Status.FINISHED}
    with pytest.raises(ValueError, match="status"):
        buf.put_group_nowait("c", [1], global_steps=0, status=np.str_("running"))
    assert "c" not in buf
