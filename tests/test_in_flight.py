"""In-flight eviction (issue 11): with ``evict_stale_in_flight=True`` under "drop", ``sample(g)``
also evicts PENDING/RUNNING groups whose staleness at ``g`` exceeds T; a producer's later call
on one raises GroupEvictedError, and ``add_prompt`` with its uid starts a new group.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from _helpers import (
    EVICTED_UIDS_REMEMBERED,
    LIMIT,
    add_group,
    assert_conserved,
    full_snapshot,
    make,
    resident_groups,
)
from stalebuf import (
    BatchNotReadyError,
    ConfigError,
    EvictionEvent,
    GroupEvictedError,
    ReplayBuffer,
    SamplerConfig,
    Status,
    UnknownGroupError,
)

pytestmark = pytest.mark.anyio


def test_config_rejects_in_flight_eviction_under_wait() -> None:
    with pytest.raises(ConfigError, match=r"evict_stale_in_flight.*drop"):
        SamplerConfig(max_off_policy_strategy="wait", evict_stale_in_flight=True)
    with pytest.raises(ConfigError, match="evict_stale_in_flight"):
        SamplerConfig.from_mapping({"max_off_policy_strategy": "wait", "evict_stale_in_flight": True})
    assert SamplerConfig(max_off_policy_strategy="wait", evict_stale_in_flight=False)


def populate(buf: ReplayBuffer) -> None:
    """Groups at steps 0, 1 and 3 in every status, and an exempt one at step 0."""
    add_group(buf, "f0", 0)  # FINISHED
    add_group(buf, "p0", 0, n=1, status=Status.PENDING)
    add_group(buf, "r0", 0, n=2, status=Status.RUNNING)
    add_group(buf, "e1", 1, n=0, status=Status.RUNNING)  # nothing put yet
    add_group(buf, "r3", 3, status=Status.RUNNING)
    add_group(buf, "f3", 3)
    add_group(buf, "v0", 0, status=Status.RUNNING, partition="val")


@pytest.mark.parametrize("how", ["sample_nowait", "sample", "sample with timeout"])
async def test_sample_evicts_the_in_flight_groups_no_later_sample_could_return(how: str) -> None:
    events: list[EvictionEvent] = []
    buf = make(max_off_policy_threshold=2, evict_stale_in_flight=True, on_evict=events.append)
    populate(buf)
    with anyio.fail_after(LIMIT):
        if how == "sample_nowait":
            batch, metrics = buf.sample_nowait(3, 1)
        elif how == "sample":
            batch, metrics = await buf.sample(3, 1)
        else:  # evicts, then finds too few groups and times out: the eviction stands
            with pytest.raises(TimeoutError):
                await buf.sample(3, 2, timeout=0.01)
    # s at g=3: step 0 -> 4, step 1 -> 3 (both > T=2), step 3 -> 1.
    [event] = events
    assert (event.reason, event.partition, event.global_steps) == ("stale", "train", 3)
    got = {group.uid: group for group in event.groups}
    assert set(got) == {"f0", "p0", "r0", "e1"}
    steps = [group.dispatch_step for group in event.groups]
    assert steps == sorted(steps), "not oldest first"
    assert {uid: group.status for uid, group in got.items()} == {
        "f0": Status.FINISHED,
        "p0": Status.PENDING,
        "r0": Status.RUNNING,
        "e1": Status.RUNNING,
    }
    assert {uid: [t.key for t in group.trajectories] for uid, group in got.items()} == {
        "f0": ["f0_0_0", "f0_1_0"],
        "p0": ["p0_0_0"],
        "r0": ["r0_0_0", "r0_1_0"],
        "e1": [],
    }
    assert all(group.finish_step == 3 for uid, group in got.items() if uid != "f0")  # the clock
    assert all(group.generation_seconds >= 0 for group in got.values())
    stats = buf.stats()
    train = stats.partitions["train"]
    assert (train.evicted_stale_groups, train.evicted_in_flight_groups) == (4, 3)
    assert train.evicted_stale_trajectories == 5
    assert (train.pending, train.running) == (0, 1)  # r3 stays: s = 1
    assert "r3" in buf
    assert "v0" in buf
    assert stats.partitions["val"].evicted_in_flight_groups == 0
    assert_conserved(buf)
    if how != "sample with timeout":
        assert batch.uids == ["f3"]
        assert metrics["training/off_policy/evicted_in_flight_groups"] == 3
        assert metrics["training/off_policy/dropped_groups"] == 4
        assert metrics["training/off_policy/dropped_generation_seconds/mean"] >= 0


async def test_plain_drop_keeps_stale_in_flight_groups() -> None:
    buf = make(max_off_policy_threshold=2)
    populate(buf)
    batch, metrics = buf.sample_nowait(3, 1)
    assert batch.uids == ["f3"]
    assert {"p0", "r0", "e1"} <= set(resident_groups(buf))
    assert buf.stats().total.evicted_in_flight_groups == 0
    assert "training/off_policy/evicted_in_flight_groups" not in metrics
    with pytest.raises(UnknownGroupError) as info:
        buf.put_nowait("f0", 1, session_id=7)  # evicted terminal, not in flight
    assert type(info.value) is UnknownGroupError


def evicted_in_flight(**config: Any) -> ReplayBuffer:
    """A buffer where "r" (RUNNING) and "p" (PENDING) were evicted in flight at step 3."""
    buf = make(max_off_policy_threshold=1, evict_stale_in_flight=True, **config)
    add_group(buf, "r", 0, n=1, status=Status.RUNNING)
    add_group(buf, "p", 0, n=0, status=Status.PENDING)
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(3, 1)
    assert "r" not in buf
    assert "p" not in buf
    return buf


WRITES: list[tuple[str, Callable[[ReplayBuffer, str], Any]]] = [
    ("put_nowait", lambda b, uid: b.put_nowait(uid, 1, session_id=5)),
    ("put", lambda b, uid: b.put(uid, 1, session_id=5)),
    ("mark_running_nowait", lambda b, uid: b.mark_running_nowait(uid)),
    ("mark_running", lambda b, uid: b.mark_running(uid)),
    ("mark_finished_nowait", lambda b, uid: b.mark_finished_nowait(uid)),
    ("mark_finished", lambda b, uid: b.mark_finished(uid)),
    ("mark_failed_nowait", lambda b, uid: b.mark_failed_nowait(uid)),
    ("mark_failed", lambda b, uid: b.mark_failed(uid)),
]


async def invoke(call: Callable[[ReplayBuffer, str], Any], buf: ReplayBuffer, uid: str) -> None:
    """Call a producer method, awaiting it if it is a coroutine."""
    result = call(buf, uid)
    if inspect.isawaitable(result):
        await result


@pytest.mark.parametrize("uid", ["r", "p"])
@pytest.mark.parametrize(("name", "call"), WRITES, ids=[name for name, _ in WRITES])
async def test_a_later_producer_call_on_a_group_evicted_in_flight_raises_group_evicted_error(
    name: str, call: Callable[[ReplayBuffer, str], Any], uid: str
) -> None:
    buf = evicted_in_flight()
    before = full_snapshot(buf)
    with anyio.fail_after(LIMIT), pytest.raises(GroupEvictedError, match="evicted as stale while in flight"):
        await invoke(call, buf, uid)
    assert full_snapshot(buf) == before
    assert issubclass(GroupEvictedError, UnknownGroupError)  # old handlers keep working


@pytest.mark.parametrize("admission_batch_size", [4, None])
@pytest.mark.parametrize("form", ["put_group_nowait", "put_group"])
async def test_put_group_on_a_group_evicted_in_flight_raises_group_evicted_error(
    form: str, admission_batch_size: int | None
) -> None:
    """put_group is a producer write too: a remote producer that adds its prompt first and
    writes the whole group at the end must learn that the group was evicted, not have it
    silently re-admitted at a later step (only add_prompt starts a new group). With and without
    admission control: put_group's fast path for a new group must not take such a uid for new."""
    buf = evicted_in_flight(admission_batch_size=admission_batch_size)
    before = full_snapshot(buf)
    with anyio.fail_after(LIMIT), pytest.raises(GroupEvictedError, match="evicted as stale while in flight"):
        await invoke(lambda b, uid: getattr(b, form)(uid, ["late"]), buf, "r")
    assert full_snapshot(buf) == before


@pytest.mark.parametrize("form", ["add_prompt_nowait", "add_prompt", "rollout"])
async def test_add_prompt_with_an_evicted_uid_starts_a_new_group_and_forgets_the_eviction(form: str) -> None:
    buf = evicted_in_flight()
    with anyio.fail_after(LIMIT):
        if form == "add_prompt_nowait":
            buf.add_prompt_nowait("r")
            buf.mark_running_nowait("r")
            buf.put_nowait("r", "new")
            buf.mark_finished_nowait("r")
        elif form == "add_prompt":
            await buf.add_prompt("r")
            await buf.put_group("r", ["new"])
        else:
            async with buf.rollout("r") as group:
                await group.put("new")
            assert not group.evicted
    view = resident_groups(buf)["r"]
    assert (view.dispatch_step, view.status, [t.payload for t in view.trajectories]) == (
        3,
        Status.FINISHED,
        ["new"],
    )
    batch, _ = buf.sample_nowait(3, 1)
    assert batch.uids == ["r"]
    with pytest.raises(UnknownGroupError) as info:
        buf.put_nowait("r", 1)
    assert type(info.value) is UnknownGroupError, "the old eviction was not forgotten"
    with pytest.raises(GroupEvictedError):
        buf.put_nowait("p", 1)  # the other eviction is still remembered
    assert_conserved(buf)


def test_evicted_uids_are_remembered_in_bounded_memory_most_recent_first() -> None:
    n = EVICTED_UIDS_REMEMBERED
    buf = make(max_off_policy_threshold=1, evict_stale_in_flight=True)
    for i in range(n + 1):
        buf.add_prompt_nowait(f"g{i}", global_steps=0)
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(2, 1)
    assert buf.stats().total.evicted_in_flight_groups == n + 1
    with pytest.raises(UnknownGroupError) as info:
        buf.put_nowait("g0", 1)  # the oldest was forgotten
    assert type(info.value) is UnknownGroupError
    for uid in ("g1", f"g{n // 2}", f"g{n}"):
        with pytest.raises(GroupEvictedError):
            buf.put_nowait(uid, 1)


async def test_in_flight_eviction_frees_admission_slots() -> None:
    buf = make(max_off_policy_threshold=1, evict_stale_in_flight=True, admission_batch_size=2)
    buf.add_prompt_nowait("a")
    buf.add_prompt_nowait("b")
    with pytest.raises(BatchNotReadyError):
        buf.sample_nowait(1, 1)  # s = 2 > 1 at step 1
    assert buf.stats().total.groups == 0
    assert buf.free_slots() == 2
    for uid in ("c", "d"):
        buf.add_prompt_nowait(uid, global_steps=0)  # step 0's slots are free again
    assert buf.free_slots() == 2  # at the clock's step 1 nothing is resident
