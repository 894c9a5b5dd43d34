"""Loading custom samplers and the protected hooks they override."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import samplers
from _helpers import add_group, resident_uids, sample_now, snapshot
from stalebuf import EvictionEvent, ReplayBuffer, SamplerConfig, StalenessPolicy
from stalebuf.errors import CheckpointError, ConfigError, StalebufError


def test_from_config_without_custom_sampler_builds_the_class_itself() -> None:
    buf = ReplayBuffer.from_config({"max_off_policy_threshold": 3})
    assert type(buf) is ReplayBuffer
    assert buf.config.max_off_policy_threshold == 3
    assert type(samplers.NewestFirst.from_config(SamplerConfig())) is samplers.NewestFirst


def test_from_config_rejects_other_types() -> None:
    with pytest.raises(ConfigError):
        ReplayBuffer.from_config(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["samplers:NewestFirst", "pkg://samplers:NewestFirst"])
def test_load_by_module(spec: str) -> None:
    buf = ReplayBuffer.from_config(SamplerConfig(custom_sampler=spec))
    assert type(buf) is samplers.NewestFirst
    for i in range(4):
        add_group(buf, f"g{i}", i)
    assert sample_now(buf, 3, 2)[0].uids == ["g3", "g2"]
    assert sorted(resident_uids(buf)) == ["g0", "g1"]
    assert buf.stats().total.sampled_groups == 2


def test_load_from_verl_block_with_kwargs_and_hook() -> None:
    buf = ReplayBuffer.from_config(
        {
            "max_off_policy_threshold": 100,
            "custom_sampler": {"path": "pkg://samplers", "name": "AgeCapped"},
            "sampler_kwargs": {"max_age": 2},
        },
        status_log_interval=None,
    )
    assert isinstance(buf, samplers.AgeCapped)
    assert buf.max_age == 2
    add_group(buf, "old", 0)
    add_group(buf, "ok", 1)
    assert buf.sampleable_count(3) == 1
    assert sample_now(buf, 3, 1)[0].uids == ["ok"]
    assert buf.stats().total.evicted_stale_groups == 1


SAMPLER_FILE = """
from stalebuf import ReplayBuffer

class FromFile(ReplayBuffer):
    def __init__(self, *args, label="none", **kwargs):
        super().__init__(*args, **kwargs)
        self.label = label
"""


@pytest.mark.parametrize("form", ["plain", "file-url", "verl-plain", "verl-file-url"])
def test_load_from_file(tmp_path: Path, form: str) -> None:
    path = tmp_path / "my_sampler.py"
    path.write_text(textwrap.dedent(SAMPLER_FILE))
    config: SamplerConfig | dict[str, object]
    if form == "plain":
        config = SamplerConfig(custom_sampler=f"{path}:FromFile", sampler_kwargs={"label": "x"})
    elif form == "file-url":
        config = SamplerConfig(custom_sampler=f"file://{path}:FromFile", sampler_kwargs={"label": "x"})
    elif form == "verl-plain":
        config = {"custom_sampler": {"path": str(path), "name": "FromFile"}, "sampler_kwargs": {"label": "x"}}
    else:
        config = {
            "custom_sampler": {"path": f"file://{path}", "name": "FromFile"},
            "sampler_kwargs": {"label": "x"},
        }
    buf = ReplayBuffer.from_config(config)
    assert type(buf).__name__ == "FromFile"
    assert isinstance(buf, ReplayBuffer)
    assert buf.label == "x"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("samplers:Unrelated", "subclass of stalebuf.ReplayBuffer"),
        ("samplers:NOT_A_SAMPLER", "subclass"),
        ("samplers:Missing", "has no attribute 'Missing'"),
        ("no_such_module_xyz:Cls", "cannot import module"),
        ("/no/such/file.py:Cls", "no such file"),
    ],
)
def test_bad_custom_sampler(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReplayBuffer.from_config(SamplerConfig(custom_sampler=spec))


def test_broken_sampler_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("this is not python\n")
    with pytest.raises(ConfigError, match="failed"):
        ReplayBuffer.from_config(SamplerConfig(custom_sampler=f"{path}:X"))


def test_sampler_kwargs_rejected_by_constructor() -> None:
    with pytest.raises(ConfigError, match="rejected sampler_kwargs"):
        ReplayBuffer.from_config(SamplerConfig(sampler_kwargs={"nope": 1}))


def test_a_select_hook_returning_the_wrong_groups_changes_nothing() -> None:
    buf = ReplayBuffer.from_config(SamplerConfig(custom_sampler="samplers:ShortSelect"))
    add_group(buf, "a", 0)
    add_group(buf, "b", 0)
    before = snapshot(buf)
    with pytest.raises(StalebufError, match="_select must return 2"):
        sample_now(buf, 0, 2)
    assert snapshot(buf) == before


# -- issue 10, items 11 and 12 -----------------------------------------------------------------


def test_replay_buffer_refuses_a_config_naming_a_custom_sampler() -> None:
    """ReplayBuffer(config) would silently ignore the custom sampler: only from_config loads it."""
    config = SamplerConfig(custom_sampler="samplers:NewestFirst")
    with pytest.raises(ConfigError, match=r"ReplayBuffer\.from_config"):
        ReplayBuffer(config)
    assert type(ReplayBuffer.from_config(config)) is samplers.NewestFirst
    # the class the config names may be built directly (that is what from_config does)
    assert type(samplers.NewestFirst(config)) is samplers.NewestFirst


@pytest.mark.parametrize("form", ["config", "verl-mapping"])
def test_from_config_builds_a_sampler_whose_init_takes_no_status_log_interval(form: str) -> None:
    config: SamplerConfig | dict[str, object]
    if form == "config":
        config = SamplerConfig(
            custom_sampler="samplers:VerlStyle", sampler_kwargs={"label": "y"}, max_off_policy_threshold=1
        )
    else:
        config = {
            "custom_sampler": {"path": "pkg://samplers", "name": "VerlStyle"},
            "sampler_kwargs": {"label": "y"},
            "max_off_policy_threshold": 1,
        }
    events: list[EvictionEvent] = []
    buf = ReplayBuffer.from_config(config, on_evict=events.append)
    assert type(buf) is samplers.VerlStyle
    assert buf.label == "y"
    add_group(buf, "old", 0)
    add_group(buf, "new", 5)
    assert sample_now(buf, 5, 1)[0].uids == ["new"]
    assert [g.uid for event in events for g in event.groups] == ["old"], "on_evict was not passed on"


def test_from_config_passes_status_log_interval_only_when_given() -> None:
    config = SamplerConfig(custom_sampler="samplers:VerlStyle")
    assert type(ReplayBuffer.from_config(config)) is samplers.VerlStyle
    with pytest.raises(ConfigError, match=r"VerlStyle rejected.*status_log_interval"):
        ReplayBuffer.from_config(config, status_log_interval=5.0)


def test_restore_builds_a_custom_sampler_whose_init_does_not_take_status_log_interval() -> None:
    """Defect (issue 10, item 12: "Pass status_log_interval only when the caller gave one"):
    ``restore`` builds "what from_config builds from the saved config", but always passed the
    interval, so a checkpoint of a verl-style custom sampler could not be restored."""
    config = SamplerConfig(custom_sampler="samplers:VerlStyle", sampler_kwargs={"label": "y"})
    buf = ReplayBuffer.from_config(config)
    assert isinstance(buf, samplers.VerlStyle)
    buf.put_group_nowait("a", [1], global_steps=0)
    restored = ReplayBuffer.restore(buf.checkpoint()).buffer
    assert isinstance(restored, samplers.VerlStyle)
    assert restored.label == "y"
    assert "a" in restored


class Named(StalenessPolicy):
    """A policy a config names as its custom sampler."""

    def __init__(self, config: SamplerConfig, *, limit: int = 1) -> None:
        super().__init__(config)
        self.limit = limit


class Other(StalenessPolicy):
    """Another policy."""


def test_a_policy_the_config_names_checkpoints_as_before() -> None:
    """A policy named by ``custom_sampler`` is rebuilt from the config, as it always was (by name,
    with ``sampler_kwargs``): ``from_config`` built it exactly so."""
    config = SamplerConfig(custom_sampler=f"{__name__}:Named", sampler_kwargs={"limit": 3})
    buf = ReplayBuffer.from_config(config, status_log_interval=None)
    buf.put_group_nowait("a", [1], global_steps=0)
    checkpoint = buf.checkpoint()
    assert checkpoint.policy is None
    restored = ReplayBuffer.restore(checkpoint).buffer
    assert type(restored.policy) is Named
    assert restored.policy.limit == 3


def test_a_policy_of_another_class_than_the_config_names_is_refused_by_checkpoint() -> None:
    """Defect (issue 21, item 3): a buffer built as ``ReplayBuffer(config, policy=Other(config))``
    from a config naming the policy class ``Named`` saved no policy at all, and restore built
    ``Named`` from the config: the restored buffer silently followed other rules. checkpoint()
    now refuses it."""
    config = SamplerConfig(custom_sampler=f"{__name__}:Named")
    buf = ReplayBuffer(config, policy=Other(config), status_log_interval=None)
    with pytest.raises(
        CheckpointError, match=r"a Other, cannot be checkpointed: its config names custom_sampler '.*:Named'"
    ):
        buf.checkpoint()
