"""``checkpoint()`` and ``restore()`` in memory: the three ``in_flight`` modes, conservation,
FIFO ties, clocks, admission state, evicted-in-flight memory, and custom samplers (issue 12).

Every test starts from ``_ckpt_helpers.rich``, a buffer that has been through every kind of event (see its
docstring), so a field the checkpoint forgets shows up as a difference. The file format has its
own module (``test_checkpoint_file.py``), the acceptance test too (``test_checkpoint_exactness.py``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from _ckpt_helpers import (
    IN_FLIGHT,
    PARTITIONS,
    admission,
    checkpoint_content,
    in_flight,
    in_flight_trajectories,
    rich,
    stats_of,
)
from _helpers import (
    EVICTED_UIDS_REMEMBERED,
    LIMIT,
    assert_conserved,
    make,
    ready_order,
    resident_groups,
    sample_now,
    snapshot,
)
from stalebuf import (
    BatchNotReadyError,
    EvictionEvent,
    GroupEvictedError,
    ReplayBuffer,
    SamplerConfig,
    StalenessPolicy,
    Status,
    UnknownGroupError,
    WrongThreadError,
)
from stalebuf.checkpoint import RestoreResult
from stalebuf.errors import CheckpointError, ConfigError


def continue_identically(*buffers: ReplayBuffer) -> list[Any]:
    """Run the same calls on each buffer; return what each observed (must be equal)."""
    seen = []
    for buf in buffers:
        log: list[Any] = []
        for uid in in_flight(buf):
            group = resident_groups(buf)[uid]
            if group.status is Status.PENDING:
                buf.mark_running_nowait(uid)
            buf.put_nowait(uid, f"late {uid}", session_id=7)
            buf.mark_finished_nowait(uid)
        for step, size, partition in ((3, 2, "train"), (3, 1, "train"), (3, 1, "train"), (5, 3, "val")):
            batch, metrics = sample_now(buf, step, size, partition)
            log.append((batch.uids, batch.keys, batch.payloads, batch.staleness.tolist()))
            log.append({k: v for k, v in metrics.items() if "_seconds" not in k})
        buf.add_prompt_nowait("z0")
        log.append((admission(buf), stats_of(buf), ready_order(buf)))
        assert_conserved(buf)
        seen.append(log)
    return seen


# -- the three modes -------------------------------------------------------------------------------


def test_the_rich_buffer_is_what_the_tests_assume() -> None:
    buf = rich()
    assert set(in_flight(buf)) == IN_FLIGHT
    assert ready_order(buf)["train"] == ["d1", "c0", "c1"]  # step 2 first; FIFO by admission at 3
    train = buf.stats().partitions["train"]
    assert (train.sampled_groups, train.evicted_failure_groups, train.evicted_stale_groups) == (1, 1, 4)
    assert train.evicted_in_flight_groups == 2
    assert admission(buf)["ghost"][0] == 5
    assert admission(buf)["train"][:2] == (3, 0)
    with pytest.raises(GroupEvictedError):
        buf.put_nowait("b0", 1, session_id=5)
    assert_conserved(buf)


def test_keep_restores_everything_exactly() -> None:
    original = rich()
    ckpt = original.checkpoint()
    result = ReplayBuffer.restore(ckpt, in_flight="keep", status_log_interval=None)
    assert isinstance(result, RestoreResult)
    restored = result.buffer
    assert result.reissue == ()
    assert type(restored) is ReplayBuffer
    assert snapshot(restored) == snapshot(original)  # stats, every group's contents, ready order
    assert in_flight(restored) == in_flight(original)
    assert [v.status for v in resident_groups(restored).values()] == [
        v.status for v in resident_groups(original).values()
    ]
    assert admission(restored) == admission(original)
    assert checkpoint_content(restored.checkpoint()) == checkpoint_content(ckpt)
    for buf in (original, restored):
        with pytest.raises(GroupEvictedError):  # the evicted-in-flight uids are remembered
            buf.put_nowait("b1", 1, session_id=5)
        assert_conserved(buf)
    first, second = continue_identically(original, restored)
    assert first == second


def test_reissue_keeps_in_flight_groups_pending_in_place_without_their_trajectories() -> None:
    original = rich()
    ckpt = original.checkpoint()
    lost = {name: in_flight_trajectories(original, name) for name in (*PARTITIONS[:3], "total")}
    result = ReplayBuffer.restore(ckpt, status_log_interval=None)  # "reissue" is the default
    restored = result.buffer
    views = resident_groups(original)
    assert [group.uid for group in result.reissue] == in_flight(original)  # in admission order
    for group in result.reissue:
        view = views[group.uid]
        assert (group.partition, group.dispatch_step, dict(group.tags)) == (
            view.partition,
            view.dispatch_step,
            dict(view.tags),
        )
        assert (group.status, group.trajectories) == (Status.PENDING, ())
    # In the buffer: PENDING, empty, at their place in the admission order.
    assert list(resident_groups(restored)) == list(views)
    for uid, view in resident_groups(restored).items():
        if uid in IN_FLIGHT:
            assert (view.status, view.trajectories, view.in_flight) == (Status.PENDING, (), True)
    before, after = stats_of(original), stats_of(restored)
    for name, want in before.items():
        assert after[name] == {
            **want,
            "pending": want["pending"] + want["running"],
            "running": 0,
            "trajectories": want["trajectories"] - lost[name],
            "reissued_groups": want["pending"] + want["running"],
            "reissued_trajectories": lost[name],
        }, name
    assert admission(restored) == admission(original)
    assert ready_order(restored) == ready_order(original)
    assert_conserved(restored)
    # Regenerated under the same uids, the groups are what they were; the rest follows suit.
    regenerate_like(restored, original)
    assert snapshot(restored)[1:] == snapshot(original)[1:]
    first, second = continue_identically(original, restored)
    *batches, (slots, stats, order) = first
    *batches_again, (slots_again, stats_again, order_again) = second
    assert (batches_again, slots_again, order_again) == (batches, slots, order)
    for name, want in stats.items():
        reissued = stats_again[name]["reissued_trajectories"]
        assert reissued == lost[name]
        assert stats_again[name] == {
            **want,
            "admitted_trajectories": want["admitted_trajectories"] + reissued,
            "reissued_groups": before[name]["pending"] + before[name]["running"],
            "reissued_trajectories": reissued,
        }


def regenerate_like(restored: ReplayBuffer, original: ReplayBuffer) -> None:
    """Generate every reissued group again as far as the original had got."""
    for uid in in_flight(original):
        view = resident_groups(original)[uid]
        if view.status is Status.RUNNING:
            restored.mark_running_nowait(uid)
        for t in view.trajectories:
            restored.put_nowait(uid, t.payload, session_id=t.session_id, index=t.index, tags=t.tags)


def test_evict_reports_one_restart_event_per_partition_at_its_clock() -> None:
    original = rich()
    views = resident_groups(original)
    events: list[EvictionEvent] = []
    result = ReplayBuffer.restore(
        original.checkpoint(), in_flight="evict", on_evict=events.append, status_log_interval=None
    )
    restored = result.buffer
    assert result.reissue == ()
    assert sorted(event.partition for event in events) == ["other", "train", "val"]  # exempt val too
    for event in events:
        assert event.reason == "restart"
        assert event.global_steps == original.dispatch_step(event.partition)
        expected = [uid for uid in in_flight(original) if views[uid].partition == event.partition]
        assert [group.uid for group in event.groups] == expected
        for group in event.groups:  # the partial work is reported with the group
            view = views[group.uid]
            assert group.status is view.status
            assert [t.key for t in group.trajectories] == [t.key for t in view.trajectories]
            assert [t.payload for t in group.trajectories] == [t.payload for t in view.trajectories]
    assert in_flight(restored) == []
    for uid in IN_FLIGHT:
        assert uid not in restored
        with pytest.raises(UnknownGroupError):
            restored.put_nowait(uid, 1, session_id=9)
    before, after = stats_of(original), stats_of(restored)
    for name, want in before.items():
        lost = in_flight_trajectories(original, name)
        groups = want["pending"] + want["running"]
        assert after[name] == {
            **want,
            "pending": 0,
            "running": 0,
            "trajectories": want["trajectories"] - lost,
            "evicted_restart_groups": groups,
            "evicted_restart_trajectories": lost,
        }, name
    assert_conserved(restored)
    # The slots of the evicted groups are free again; the clocks are untouched.
    assert restored.free_slots("train") == original.free_slots("train") + 1  # c2 was at the clock's step
    assert [restored.dispatch_step(p) for p in PARTITIONS] == [original.dispatch_step(p) for p in PARTITIONS]


def test_evict_with_nothing_in_flight_reports_nothing() -> None:
    buf = ReplayBuffer(SamplerConfig(), status_log_interval=None)
    buf.put_group_nowait("g", [1, 2])
    events: list[EvictionEvent] = []
    restored = ReplayBuffer.restore(buf.checkpoint(), in_flight="evict", on_evict=events.append).buffer
    assert events == []
    assert snapshot(restored) == snapshot(buf)


def test_an_on_evict_that_raises_inside_restore_propagates() -> None:
    def boom(event: EvictionEvent) -> None:
        raise RuntimeError(f"boom {event.partition}")

    with pytest.raises(RuntimeError, match="boom"):
        ReplayBuffer.restore(rich().checkpoint(), in_flight="evict", on_evict=boom)


@pytest.mark.parametrize("mode", ["reissue", "keep", "evict"])
def test_conservation_and_counters_survive_a_restore_of_a_restore(mode: str) -> None:
    """Restoring twice neither loses nor double-counts: the counters are the saved ones."""
    first = ReplayBuffer.restore(rich().checkpoint(), in_flight=mode).buffer  # type: ignore[arg-type]
    second = ReplayBuffer.restore(first.checkpoint(), in_flight=mode).buffer  # type: ignore[arg-type]
    assert_conserved(second)
    want = stats_of(first)
    if mode == "reissue":  # the groups are reissued again (with nothing left to discard)
        for stats in want.values():
            stats["reissued_groups"] += stats["pending"]
    assert stats_of(second) == want
    assert checkpoint_content(second.checkpoint())[3] == checkpoint_content(first.checkpoint())[3]


# -- what a checkpoint is ----------------------------------------------------------------------


def test_a_checkpoint_is_a_snapshot_later_calls_do_not_change() -> None:
    buf = rich()
    ckpt = buf.checkpoint()
    content = checkpoint_content(ckpt)
    before = snapshot(buf)
    buf.put_nowait("c2", "more", session_id=5)
    buf.mark_finished_nowait("c2")
    sample_now(buf, 4, 2)
    buf.add_prompt_nowait("new", global_steps=4)
    assert checkpoint_content(ckpt) == content
    restored = ReplayBuffer.restore(ckpt, in_flight="keep").buffer
    assert snapshot(restored) == before


def test_fifo_ties_come_out_identical_after_restore() -> None:
    """Groups of one step finishing out of admission order, then one by one."""
    buf = ReplayBuffer(SamplerConfig(max_off_policy_strategy="wait"), status_log_interval=None)
    for uid in ("t0", "t1", "t2", "t3", "t4", "t5"):
        buf.add_prompt_nowait(uid, global_steps=1)
    for uid in ("t4", "t1", "t5"):
        buf.mark_finished_nowait(uid)
    ckpt = buf.checkpoint()
    copies = [ReplayBuffer.restore(ckpt, in_flight=mode).buffer for mode in ("keep", "reissue")]  # type: ignore[arg-type]
    orders = []
    for each in (buf, *copies):
        for uid in ("t3", "t0", "t2"):
            each.mark_finished_nowait(uid)
        orders.append([sample_now(each, 1, 1)[0].uids[0] for _ in range(6)])
    assert orders == [["t0", "t1", "t2", "t3", "t4", "t5"]] * 3


def test_restore_needs_no_event_loop_and_the_buffer_then_waits_on_either_backend() -> None:
    restored = ReplayBuffer.restore(rich().checkpoint(), in_flight="keep").buffer  # no loop runs here

    for backend in ("asyncio", "trio"):
        buf = ReplayBuffer.restore(restored.checkpoint(), in_flight="keep").buffer

        async def run(buf: ReplayBuffer = buf) -> list[str]:
            with anyio.fail_after(LIMIT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(buf.mark_finished, "c2")
                    batch, _ = await buf.sample(3, 4)  # waits for c2
                return batch.uids

        assert anyio.run(run, backend=backend) == ["d1", "c0", "c1", "c2"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_checkpoint_from_another_thread_is_refused(backend: str) -> None:
    buf = rich()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            buf.checkpoint()
        except BaseException as exc:
            errors.append(exc)

    async def run() -> None:
        buf.threadsafe()  # binds the buffer to this loop's thread
        thread = threading.Thread(target=call)
        thread.start()
        thread.join(LIMIT)
        buf.checkpoint()  # the loop's own thread may

    anyio.run(run, backend=backend)
    assert [type(e) for e in errors] == [WrongThreadError]


# -- custom samplers and policies ----------------------------------------------------------------


class Cautious(StalenessPolicy):
    """A policy given as ``policy=``: drops everything older than ``limit`` steps."""

    def __init__(self, config: SamplerConfig, *, limit: int = 1) -> None:
        super().__init__(config)
        self.limit = limit

    def is_stale(self, global_steps: int, dispatch_step: int, partition: str) -> bool:
        return global_steps - dispatch_step > self.limit


def test_a_custom_sampler_named_by_the_config_is_rebuilt() -> None:
    original = rich(custom_sampler="samplers:NewestFirst")
    restored = ReplayBuffer.restore(original.checkpoint(), in_flight="keep").buffer
    assert type(restored).__name__ == "NewestFirst"
    assert type(restored) is type(original)
    first, second = continue_identically(original, restored)
    assert first == second
    assert first[0][0] == ["c2", "c1"]  # the custom selection ran (oldest first: d0, d1)


def test_a_policy_given_to_the_constructor_is_rebuilt_by_name() -> None:
    policy_config = SamplerConfig(sampler_kwargs={"limit": 0})
    buf = ReplayBuffer(policy_config, policy=Cautious(policy_config, limit=0), status_log_interval=None)
    buf.put_group_nowait("g0", [1], global_steps=0)
    buf.put_group_nowait("g1", [1], global_steps=1)
    ckpt = buf.checkpoint()
    assert str(ckpt.policy).endswith(":Cautious")
    restored = ReplayBuffer.restore(ckpt).buffer
    assert type(restored.policy) is Cautious
    assert restored.policy.limit == 0
    assert sample_now(restored, 1, 1)[0].uids == ["g1"]  # g0 is stale under the custom rule


# A policy given as ``policy=`` is saved by name and rebuilt as ``Cls(config, **sampler_kwargs)``
# (issue 21, item 3): checkpoint() refuses one that would not come back with the same rules.


def policy_buffer(policy: StalenessPolicy) -> ReplayBuffer:
    buf = ReplayBuffer(policy.config, policy=policy, status_log_interval=None)
    buf.put_group_nowait("g0", [1], global_steps=0)
    return buf


def test_a_policy_whose_constructor_state_the_rebuild_would_lose_is_refused_by_checkpoint(
    tmp_path: Path,
) -> None:
    """Defect (issue 21, item 3): a ``policy=`` instance was saved by class name only, and rebuilt
    as ``Cls(config, **sampler_kwargs)``: ``Cautious(config, limit=0)`` came back with limit 1,
    so the restored buffer silently followed other rules. checkpoint() now refuses it, saying
    how to build it so that it can be saved; nothing changes."""
    buf = policy_buffer(Cautious(SamplerConfig(), limit=0))
    with pytest.raises(
        CheckpointError, match=r"Cautious\(config, \*\*config.sampler_kwargs\), whose attribute 'limit'"
    ):
        buf.checkpoint()
    with pytest.raises(CheckpointError, match="sampler_kwargs"):
        anyio.run(buf.save, tmp_path / "buffer.ckpt")
    assert buf.stats().total.groups == 1
    assert list(tmp_path.iterdir()) == []
    config = SamplerConfig(sampler_kwargs={"limit": 0})  # the way that saves: rebuilt the same
    assert (
        ReplayBuffer.restore(policy_buffer(Cautious(config, limit=0)).checkpoint()).buffer.policy.limit == 0
    )


def test_a_policy_class_defined_inside_a_function_is_refused_by_checkpoint() -> None:
    """Defect (issue 21, item 3): a policy whose class is defined inside a function was saved by a
    name no import can resolve: checkpoint() succeeded, and the checkpoint could never be
    restored. checkpoint() now refuses it and says to define the class at module level."""

    class Local(StalenessPolicy):
        pass

    with pytest.raises(CheckpointError, match="inside a function: define Local at module level"):
        policy_buffer(Local(SamplerConfig())).checkpoint()


def test_a_policy_whose_name_now_imports_another_class_is_refused_by_checkpoint() -> None:
    """The name of a class defined again since (a notebook cell run twice) imports the newer class:
    restore would build that one, so checkpoint() refuses the older one's instance."""
    older = Cautious(SamplerConfig())
    globals()["Cautious"] = type("Cautious", (StalenessPolicy,), {"__module__": __name__})
    try:
        with pytest.raises(CheckpointError, match="names another class"):
            policy_buffer(older).checkpoint()
    finally:
        globals()["Cautious"] = type(older)


class Counting(StalenessPolicy):
    """A policy with state of its own that changes as the buffer runs."""

    def __init__(self, config: SamplerConfig) -> None:
        super().__init__(config)
        self.selections = 0

    def select(self, candidates: Any, batch_size: int, global_steps: int, partition: str) -> Any:
        self.selections += 1
        return super().select(candidates, batch_size, global_steps, partition)


def test_a_policy_whose_state_changed_while_it_ran_is_refused_by_checkpoint() -> None:
    """Defect (issue 21, item 3): the rebuild loses what a policy changed in itself while the
    buffer ran. A checkpoint is taken while its state is still what the rebuild makes, and
    refused once it differs (it would silently restore other state)."""
    buf = policy_buffer(Counting(SamplerConfig()))
    assert ReplayBuffer.restore(buf.checkpoint()).buffer.policy.selections == 0
    sample_now(buf, 0, 1)
    with pytest.raises(CheckpointError, match="attribute 'selections'"):
        buf.checkpoint()


class Slotted(StalenessPolicy):
    """A policy that keeps its setting in a slot (not in its ``__dict__``)."""

    __slots__ = ("__limit",)

    def __init__(self, config: SamplerConfig, limit: int = 1) -> None:
        super().__init__(config)
        self.__limit = limit


def test_a_policy_whose_state_is_in_slots_is_compared_too() -> None:
    """The comparison reads the slots a policy's classes declare, name-mangled ones included."""
    with pytest.raises(CheckpointError, match="attribute '_Slotted__limit'"):
        policy_buffer(Slotted(SamplerConfig(), limit=2)).checkpoint()
    assert policy_buffer(Slotted(SamplerConfig())).checkpoint().policy == f"{__name__}:Slotted"


def test_a_plain_staleness_policy_changed_after_it_was_built_is_refused_by_checkpoint() -> None:
    """Defect (issue 21, item 3): a StalenessPolicy is saved as nothing (restore builds
    ``StalenessPolicy(config)``), so one whose threshold was changed after it was built came
    back with the config's threshold."""
    policy = StalenessPolicy(SamplerConfig(max_off_policy_threshold=4))
    policy.threshold = 1
    with pytest.raises(CheckpointError, match=r"StalenessPolicy\(config\), whose attribute 'threshold'"):
        policy_buffer(policy).checkpoint()


class Needy(StalenessPolicy):
    """A policy whose constructor needs an argument."""

    def __init__(self, config: SamplerConfig, *, window: int) -> None:
        super().__init__(config)
        self.window = window


def test_a_policy_the_rebuild_cannot_build_is_refused_by_checkpoint() -> None:
    """Restore builds ``Needy(config, **sampler_kwargs)``, which raises without ``window`` in
    them: checkpoint() refuses, naming what restore would call and what to pass."""
    with pytest.raises(CheckpointError, match=r"window.*sampler_kwargs"):
        policy_buffer(Needy(SamplerConfig(), window=3)).checkpoint()
    config = SamplerConfig(sampler_kwargs={"window": 3})
    assert ReplayBuffer.restore(policy_buffer(Needy(config, window=3)).checkpoint()).buffer.policy.window == 3


@attrs.define(eq=True, init=False)
class Guarded(StalenessPolicy):
    """A policy holding a lock (a new one in every instance): it says itself, by its ``__eq__``,
    that a rebuilt one is the same."""

    limit: int
    lock: Any = attrs.field(eq=False)

    def __init__(self, config: SamplerConfig, limit: int = 1) -> None:
        super().__init__(config)
        self.limit, self.lock = limit, threading.Lock()


class Locked(StalenessPolicy):
    """The same policy without ``__eq__``: its lock can never be shown the same."""

    def __init__(self, config: SamplerConfig) -> None:
        super().__init__(config)
        self.lock = threading.Lock()


def test_a_policy_that_defines_eq_says_whether_a_rebuilt_one_is_the_same() -> None:
    """A policy holding what compares by identity (a lock) is refused by the attribute comparison;
    one that defines ``__eq__`` decides for itself, and is refused only when it says they differ."""
    with pytest.raises(CheckpointError, match=r"attribute 'lock'.*define Locked\.__eq__"):
        policy_buffer(Locked(SamplerConfig())).checkpoint()
    config = SamplerConfig(sampler_kwargs={"limit": 2})
    assert ReplayBuffer.restore(policy_buffer(Guarded(config, limit=2)).checkpoint()).buffer.policy.limit == 2
    with pytest.raises(CheckpointError, match=r"value \(by its __eq__\)"):
        policy_buffer(Guarded(SamplerConfig(), limit=2)).checkpoint()


def test_a_checkpoint_whose_policy_is_not_a_policy_class_is_refused_without_calling_it() -> None:
    """BUG (reported): restore imports the ``module:QualName`` a checkpoint names and calls it
    with the config, whatever it is; a non-policy callable is called and silently ignored.
    Suggested fix: in ``checkpoint.policy_from_name``, check ``isinstance(target, type) and
    issubclass(target, StalenessPolicy)`` before calling it (CheckpointError otherwise)."""
    called: list[Any] = []
    forged = attrs.evolve(rich().checkpoint(), policy=f"{__name__}:record_call")
    globals()["record_call"] = lambda *args, **kwargs: called.append(args)
    try:
        with pytest.raises(CheckpointError, match="record_call"):
            ReplayBuffer.restore(forged)
    finally:
        del globals()["record_call"]
    assert called == []


def test_an_inconsistent_or_newer_checkpoint_is_refused() -> None:
    ckpt = rich().checkpoint()
    for forged, match in (
        (attrs.evolve(ckpt, groups=(*ckpt.groups, ckpt.groups[0])), "inconsistent"),
        (attrs.evolve(ckpt, groups=(ckpt.groups[0].replace(partition="nowhere"),)), "inconsistent"),
        (attrs.evolve(ckpt, format_version=ckpt.format_version + 1), "newer"),
    ):
        with pytest.raises(CheckpointError, match=match):
            ReplayBuffer.restore(forged)


@pytest.mark.parametrize("bad", ["Reissue", "", None, 1, ("keep",)])
def test_in_flight_must_be_one_of_the_modes(bad: Any) -> None:
    with pytest.raises(ConfigError, match="in_flight must be one of 'reissue', 'keep', 'evict', 'resume'"):
        ReplayBuffer.restore(rich().checkpoint(), in_flight=bad)


# -- restore(in_flight="evict"): the remembered evicted uids, and what a write to one says ----------


def test_a_restore_that_evicts_in_flight_groups_keeps_the_remembered_uids_bounded() -> None:
    """Defect (issue 11: "The buffer remembers these uids in bounded memory (document the bound,
    e.g. the most recent 65,536)"): a restore with in_flight="evict" added its evicted uids to
    that memory past the bound."""
    buf = make()
    for i in range(EVICTED_UIDS_REMEMBERED + 3):
        buf.add_prompt_nowait(f"g{i}", global_steps=0)
    restored = ReplayBuffer.restore(buf.checkpoint(), in_flight="evict").buffer
    with pytest.raises(UnknownGroupError) as oldest:
        restored.put_nowait("g0", 1)
    assert type(oldest.value) is UnknownGroupError  # forgotten: the oldest three are past the bound
    with pytest.raises(GroupEvictedError):
        restored.put_nowait(f"g{EVICTED_UIDS_REMEMBERED + 2}", 1)
    with pytest.raises(GroupEvictedError):
        restored.put_nowait("g3", 1)


def test_restart_evictions_are_remembered_within_the_bound() -> None:
    """Defect: uids evicted by a restart (``restore(in_flight="evict")``) were remembered
    without the bound that applies to stale in-flight evictions."""
    buf = ReplayBuffer(status_log_interval=None)
    count = EVICTED_UIDS_REMEMBERED + 10
    for i in range(count):
        buf.add_prompt_nowait(f"u{i}")
    restored = ReplayBuffer.restore(buf.checkpoint(), in_flight="evict", status_log_interval=None).buffer
    assert restored.stats().total.evicted_restart_groups == count
    with pytest.raises(GroupEvictedError):  # the most recent are remembered, as for stale ones
        restored.put_nowait(f"u{count - 1}", 1)
    with pytest.raises(UnknownGroupError) as caught:  # the oldest were forgotten
        restored.put_nowait("u0", 1)
    assert not isinstance(caught.value, GroupEvictedError)


def test_a_write_to_a_group_a_restore_evicted_says_so() -> None:
    """Defect: a write to a group ``restore(in_flight="evict")`` evicted said it was evicted
    "as stale"; it was evicted by a restart."""
    buf = ReplayBuffer(status_log_interval=None)
    buf.add_prompt_nowait("a", global_steps=0)
    restored = ReplayBuffer.restore(buf.checkpoint(), in_flight="evict", status_log_interval=None).buffer
    with pytest.raises(GroupEvictedError, match="'a' was evicted by a restart while in flight"):
        restored.put_nowait("a", 1)


# -- a policy built from another config than the buffer's; the restore result -----------------------


def test_a_policy_built_from_another_config_than_the_buffers_is_refused_by_checkpoint() -> None:
    """Defect: restore rebuilds the policy from the one config a checkpoint keeps (the
    buffer's), so checkpointing a buffer whose policy was built from another config let the
    restored buffer follow other rules. The checkpoint is refused instead, changing nothing."""
    buf = ReplayBuffer(
        SamplerConfig(max_off_policy_threshold=5),
        policy=StalenessPolicy(SamplerConfig(max_off_policy_threshold=1)),
        status_log_interval=None,
    )
    buf.put_group_nowait("a", [1], global_steps=0)
    with pytest.raises(CheckpointError, match="another config"):
        buf.checkpoint()
    assert buf.stats().total.groups == 1  # nothing changed


def test_a_policy_built_from_an_equal_config_checkpoints_and_keeps_its_rules() -> None:
    """The refusal above compares configs by value: a policy built from an equal (not the same)
    config checkpoints, and the restored buffer follows the same rules."""

    def build() -> ReplayBuffer:
        buf = ReplayBuffer(
            SamplerConfig(max_off_policy_threshold=1),
            policy=StalenessPolicy(SamplerConfig(max_off_policy_threshold=1)),  # equal, not the same
            status_log_interval=None,
        )
        buf.put_group_nowait("a", [1], global_steps=0)
        return buf

    original = build()
    restored = ReplayBuffer.restore(build().checkpoint(), status_log_interval=None).buffer
    assert restored.policy.threshold == original.policy.threshold == 1
    for buf in (original, restored):
        with pytest.raises(BatchNotReadyError):  # "a" is stale at step 3 under threshold 1
            buf.sample_nowait(3, 1)
        assert buf.stats().total.evicted_stale_groups == 1


def test_a_restore_result_unpacks_as_buffer_and_reissue() -> None:
    """Guards against a RestoreResult that does not unpack: ``buffer, reissue = restore(...)``
    gives the same objects as its attributes."""
    buf = ReplayBuffer(status_log_interval=None)
    buf.add_prompt_nowait("a", global_steps=0)
    result = ReplayBuffer.restore(buf.checkpoint(), status_log_interval=None)
    restored, reissue = result
    assert restored is result.buffer
    assert reissue == result.reissue
    assert [group.uid for group in reissue] == ["a"]
