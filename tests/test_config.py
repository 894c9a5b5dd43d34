from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any

import pytest

from stalebuf import SamplerConfig
from stalebuf.config import IGNORED_VERL_KEYS, METRIC_NAMINGS
from stalebuf.errors import ConfigError, StalebufError


def test_defaults() -> None:
    config = SamplerConfig()
    assert config.max_off_policy_threshold == 8
    assert config.max_off_policy_strategy == "drop"
    assert config.parameter_sync_step == 1
    assert config.failure_strategy == "sample"
    assert config.exempt_partitions == frozenset({"val"})
    assert config.custom_sampler is None
    assert dict(config.sampler_kwargs) == {}


def test_is_frozen_and_keyword_only() -> None:
    config = SamplerConfig()
    with pytest.raises(AttributeError):
        config.max_off_policy_threshold = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplerConfig(3)  # type: ignore[misc]


@pytest.mark.parametrize("value", [0, -1, True, False, 1.0, "2", 2**63])
def test_threshold_rejected(value: object) -> None:
    with pytest.raises(ConfigError, match="max off policy threshold"):
        SamplerConfig(max_off_policy_threshold=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -3, True, 2.0, None])
def test_sync_step_rejected(value: object) -> None:
    with pytest.raises(ConfigError, match="parameter_sync_step"):
        SamplerConfig(parameter_sync_step=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["Drop", "", None, "dropless"])
def test_strategy_rejected_and_choices_listed(value: object) -> None:
    with pytest.raises(ConfigError, match="max off policy strategy") as info:
        SamplerConfig(max_off_policy_strategy=value)  # type: ignore[arg-type]
    assert "'drop'" in str(info.value)
    assert "'wait'" in str(info.value)


def test_failure_strategy_rejected() -> None:
    with pytest.raises(ConfigError, match="failure_strategy"):
        SamplerConfig(failure_strategy="retry")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["val", 3, [""], [1]])
def test_exempt_partitions_rejected(value: object) -> None:
    with pytest.raises(ConfigError, match="exempt_partitions"):
        SamplerConfig(exempt_partitions=value)  # type: ignore[arg-type]


def test_exempt_partitions_accepts_any_collection() -> None:
    assert SamplerConfig(exempt_partitions=["val", "eval"]).exempt_partitions == {"val", "eval"}
    assert SamplerConfig(exempt_partitions=()).exempt_partitions == frozenset()


@pytest.mark.parametrize("value", ["noclass", ":Cls", "mod:", "mod:not-ident", 5, "pkg://:X"])
def test_custom_sampler_string_rejected(value: object) -> None:
    with pytest.raises(ConfigError, match="custom_sampler"):
        SamplerConfig(custom_sampler=value)  # type: ignore[arg-type]


def test_sampler_kwargs_rejected() -> None:
    with pytest.raises(ConfigError, match="sampler_kwargs"):
        SamplerConfig(sampler_kwargs=[("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="sampler_kwargs"):
        SamplerConfig(sampler_kwargs={1: 2})  # type: ignore[dict-item]


def test_sampler_kwargs_are_copied_and_read_only() -> None:
    source = {"alpha": 1}
    config = SamplerConfig(sampler_kwargs=source)
    source["alpha"] = 2
    assert config.sampler_kwargs["alpha"] == 1
    with pytest.raises(TypeError):
        config.sampler_kwargs["alpha"] = 3  # type: ignore[index]


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, StalebufError)


def test_from_mapping_verl_block() -> None:
    block = {
        "max_off_policy_threshold": 4,
        "max_off_policy_strategy": "wait",
        "custom_sampler": {"path": None, "name": None},
        "sampler_kwargs": {},
    }
    config = SamplerConfig.from_mapping(block)
    assert config == SamplerConfig(max_off_policy_threshold=4, max_off_policy_strategy="wait")


def test_from_mapping_missing_keys_take_defaults() -> None:
    assert SamplerConfig.from_mapping({}) == SamplerConfig()
    assert SamplerConfig.from_mapping(MappingProxyType({"parameter_sync_step": 2})).parameter_sync_step == 2


def test_from_mapping_own_fields() -> None:
    config = SamplerConfig.from_mapping(
        {"failure_strategy": "evict", "exempt_partitions": ["val", "test"], "parameter_sync_step": 3}
    )
    assert config.failure_strategy == "evict"
    assert config.exempt_partitions == {"val", "test"}
    assert config.parameter_sync_step == 3


def test_from_mapping_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match="max_off_policy_thresold"):
        SamplerConfig.from_mapping({"max_off_policy_thresold": 3})


def test_from_mapping_invalid_value_is_config_error() -> None:
    with pytest.raises(ConfigError, match="max off policy threshold"):
        SamplerConfig.from_mapping({"max_off_policy_threshold": 0})


def test_from_mapping_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError):
        SamplerConfig.from_mapping([("a", 1)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ({"path": "pkg://my.samplers", "name": "Mine"}, "pkg://my.samplers:Mine"),
        ({"path": "file:///tmp/s.py", "name": "Mine"}, "file:///tmp/s.py:Mine"),
        ({"path": "/tmp/s.py", "name": "Mine"}, "file:///tmp/s.py:Mine"),
        ({"path": "samplers/s.py", "name": "Mine"}, "file://samplers/s.py:Mine"),
        ({"path": None, "name": None}, None),
        ("my.samplers:Mine", "my.samplers:Mine"),
        (None, None),
    ],
)
def test_from_mapping_custom_sampler_forms(block: object, expected: str | None) -> None:
    assert SamplerConfig.from_mapping({"custom_sampler": block}).custom_sampler == expected


@pytest.mark.parametrize(
    "block",
    [
        {"path": "x.py", "name": None},
        {"path": None, "name": "X"},
        {"path": "x.py", "name": "X", "extra": 1},
        3,
    ],
)
def test_from_mapping_custom_sampler_invalid(block: object) -> None:
    with pytest.raises(ConfigError, match="custom_sampler"):
        SamplerConfig.from_mapping({"custom_sampler": block})


def test_from_mapping_omegaconf() -> None:
    omegaconf = pytest.importorskip("omegaconf")
    yaml = """
    max_off_policy_threshold: 2
    max_off_policy_strategy: drop
    custom_sampler:
      path: pkg://tests.samplers
      name: Mine
    sampler_kwargs:
      weights: [1, 2]
      nested: {a: 1}
    exempt_partitions: [val, test]
    """
    block = omegaconf.OmegaConf.create(yaml)
    config = SamplerConfig.from_mapping(block)
    assert config.max_off_policy_threshold == 2
    assert config.custom_sampler == "pkg://tests.samplers:Mine"
    assert dict(config.sampler_kwargs) == {"weights": [1, 2], "nested": {"a": 1}}
    assert type(config.sampler_kwargs["weights"]) is list
    assert config.exempt_partitions == {"val", "test"}


# -- no threshold (verl 0.9.1's max_off_policy_threshold: null) --------------------------------


def test_threshold_none_turns_staleness_control_off() -> None:
    """None was refused before verl 0.9.1 made null mean "no version control"; now it is valid."""
    config = SamplerConfig(max_off_policy_threshold=None, max_off_policy_strategy="wait")
    assert config.max_off_policy_threshold is None
    assert SamplerConfig(max_off_policy_threshold=None).admission_batch_size is None


def test_admission_needs_a_threshold() -> None:
    with pytest.raises(ConfigError, match="admission_batch_size needs a max_off_policy_threshold"):
        SamplerConfig(max_off_policy_threshold=None, admission_batch_size=4)
    with pytest.raises(ConfigError, match="admission_batch_size needs a max_off_policy_threshold"):
        SamplerConfig.from_mapping({"max_off_policy_threshold": None, "admission_batch_size": 4})


# -- SamplerConfig.bounded: the safe bounded configuration in one call ---------------------------


def test_bounded_sets_admission_to_the_batch_size() -> None:
    config = SamplerConfig.bounded(threshold=2, batch_size=32)
    assert config == SamplerConfig(
        max_off_policy_threshold=2, max_off_policy_strategy="wait", admission_batch_size=32
    )


def test_bounded_drop_evicts_stale_groups_in_flight_unless_told_otherwise() -> None:
    """Under drop, a straggler that can no longer be trained would hold its slot until it ends."""
    config = SamplerConfig.bounded(threshold=3, batch_size=8, strategy="drop", parameter_sync_step=2)
    assert (config.max_off_policy_strategy, config.parameter_sync_step) == ("drop", 2)
    assert (config.admission_batch_size, config.evict_stale_in_flight) == (8, True)
    config = SamplerConfig.bounded(threshold=3, batch_size=8, strategy="drop", evict_stale_in_flight=False)
    assert config.evict_stale_in_flight is False


def test_bounded_passes_other_fields_on() -> None:
    config = SamplerConfig.bounded(
        threshold=1, batch_size=4, group_deadline_factor=3.0, metric_names="verl-0.9"
    )
    assert (config.group_deadline_factor, config.metric_names) == (3.0, "verl-0.9")
    assert config.admission_batch_size == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": None, "batch_size": 4}, "admission_batch_size needs a max_off_policy_threshold"),
        ({"threshold": 0, "batch_size": 4}, "max off policy threshold"),
        ({"threshold": 2, "batch_size": 0}, "admission_batch_size"),
        ({"threshold": 2, "batch_size": True}, "admission_batch_size"),
        ({"threshold": 2, "batch_size": 4, "strategy": "dropless"}, "max off policy strategy"),
        ({"threshold": 2, "batch_size": 4, "parameter_sync_step": 0}, "parameter_sync_step"),
        ({"threshold": 2, "batch_size": 4, "admission_batch_size": 8}, "pass batch_size= instead"),
        ({"threshold": 2, "batch_size": 4, "max_off_policy_threshold": 3}, "pass threshold= instead"),
        ({"threshold": 2, "batch_size": 4, "max_off_policy_strategy": "drop"}, "pass strategy= instead"),
        ({"threshold": 2, "batch_size": 4, "admision_batch_size": 8}, "unknown SamplerConfig field"),
    ],
)
def test_bounded_rejects_bad_input_with_config_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SamplerConfig.bounded(**kwargs)


# -- metric names --------------------------------------------------------------------------------


def test_metric_names() -> None:
    assert METRIC_NAMINGS == ("default", "verl-0.9")
    assert SamplerConfig().metric_names == "default"
    assert SamplerConfig(metric_names="verl-0.9").metric_names == "verl-0.9"
    assert SamplerConfig.from_mapping({"metric_names": "verl-0.9"}).metric_names == "verl-0.9"
    for bad in ("verl", "", None, 0.9):
        with pytest.raises(ConfigError, match="metric_names"):
            SamplerConfig(metric_names=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="metric_names"):
            SamplerConfig.from_mapping({"metric_names": bad})


# -- verl's trainer.v1.sampler blocks, verbatim ----------------------------------------------------
# Each block is copied as verl ships it, comments included, under the keys verl reads it from
# (``config.trainer.v1.sampler``); the other keys of ``trainer.v1`` are left out.

#: verl main (1dda039, after #7082 and #7373): verl/trainer/config/ppo_trainer.yaml.
VERL_MAIN_PPO_TRAINER = """
trainer:
  v1:
    # Replay buffer sampling strategy
    sampler:

      # Maximum number of model versions that trajectory can span
      max_off_policy_threshold: 8

      # How to handle trajectory that exceeds the maximum number of model versions
      # drop: drop the trajectory
      # wait: dropless, wait all trajectories that reach threshold to finish
      max_off_policy_strategy: drop

      # Whether sync trainers replace failed groups that have no trajectories
      sync_refill_failed_groups: False

      # Custom sampler config
      custom_sampler:

        # Path to the custom sampler class
        path: null

        # Name of the custom sampler class
        name: null

      # Additional kwargs for the custom sampler
      sampler_kwargs: {}
"""

#: verl main and the verl 0.9.1 wheel: verl/trainer/config/_generated_ppo_trainer.yaml (the same
#: block in both).
VERL_GENERATED_PPO_TRAINER = """
trainer:
  v1:
    sampler:
      max_off_policy_threshold: 8
      max_off_policy_strategy: drop
      sync_refill_failed_groups: false
      custom_sampler:
        path: null
        name: null
      sampler_kwargs: {}
"""

#: The verl 0.9.1 wheel: verl/trainer/config/ppo_trainer.yaml, which documents null.
VERL_091_PPO_TRAINER = """
trainer:
  v1:
    # Replay buffer sampling strategy
    sampler:

      # Maximum number of model versions that trajectory can span.
      # null disables off-policy version control entirely: no samples are
      # dropped or awaited for staleness (off-policy degree is then only
      # bounded by rollout concurrency and feed/consume balance).
      max_off_policy_threshold: 8

      # How to handle trajectory that exceeds the maximum number of model versions
      # drop: drop the trajectory
      # wait: dropless, wait all trajectories that reach threshold to finish
      max_off_policy_strategy: drop

      # Whether sync trainers replace failed groups that have no trajectories
      sync_refill_failed_groups: False

      # Custom sampler config
      custom_sampler:

        # Path to the custom sampler class
        path: null

        # Name of the custom sampler class
        name: null

      # Additional kwargs for the custom sampler
      sampler_kwargs: {}
"""


def _sampler_block(yaml: str, *overrides: str) -> Any:
    """The ``trainer.v1.sampler`` node of ``yaml`` with verl-style command-line ``overrides``."""
    omegaconf = pytest.importorskip("omegaconf")
    config = omegaconf.OmegaConf.merge(
        omegaconf.OmegaConf.create(yaml), omegaconf.OmegaConf.from_dotlist(list(overrides))
    )
    return config.trainer.v1.sampler


@pytest.mark.parametrize("yaml", [VERL_MAIN_PPO_TRAINER, VERL_GENERATED_PPO_TRAINER, VERL_091_PPO_TRAINER])
def test_from_mapping_reads_verl_blocks_verbatim(yaml: str) -> None:
    config = SamplerConfig.from_mapping(_sampler_block(yaml))
    assert config == SamplerConfig(max_off_policy_threshold=8, max_off_policy_strategy="drop")


@pytest.mark.parametrize("yaml", [VERL_MAIN_PPO_TRAINER, VERL_091_PPO_TRAINER])
def test_from_mapping_reads_verl_null_threshold(yaml: str) -> None:
    """``trainer.v1.sampler.max_off_policy_threshold=null`` as verl 0.9.1 documents it."""
    block = _sampler_block(yaml, "trainer.v1.sampler.max_off_policy_threshold=null")
    assert block.max_off_policy_threshold is None
    config = SamplerConfig.from_mapping(block)
    assert config == SamplerConfig(max_off_policy_threshold=None, max_off_policy_strategy="drop")


def test_from_mapping_reads_verl_custom_sampler_override() -> None:
    """The override verl's ReplayBuffer.sample docstring gives, as a {path, name} mapping."""
    block = _sampler_block(
        VERL_MAIN_PPO_TRAINER,
        'trainer.v1.sampler.custom_sampler.path="path/to/your/sampler.py"',
        'trainer.v1.sampler.custom_sampler.name="UserCustomReplayBuffer"',
    )
    config = SamplerConfig.from_mapping(block)
    assert config.custom_sampler == "file://path/to/your/sampler.py:UserCustomReplayBuffer"


def test_sync_refill_failed_groups_is_accepted_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    """verl's sync trainer refills failed groups through refill_fn; here that is
    failure_strategy="evict" plus on_evict, so the key changes nothing (true says so in a warning)."""
    assert set(IGNORED_VERL_KEYS) == {"sync_refill_failed_groups"}
    for value in (False, None):
        with caplog.at_level(logging.WARNING, logger="stalebuf"):
            assert SamplerConfig.from_mapping({"sync_refill_failed_groups": value}) == SamplerConfig()
        assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="stalebuf"):
        config = SamplerConfig.from_mapping(
            _sampler_block(VERL_MAIN_PPO_TRAINER, "trainer.v1.sampler.sync_refill_failed_groups=true")
        )
    assert config == SamplerConfig()
    assert "sync_refill_failed_groups=true is ignored" in caplog.text
    assert "on_evict" in caplog.text


@pytest.mark.parametrize("value", ["yes", 1, [True]])
def test_sync_refill_failed_groups_must_be_a_bool(value: object) -> None:
    with pytest.raises(ConfigError, match="sync_refill_failed_groups must be a bool or null"):
        SamplerConfig.from_mapping({"sync_refill_failed_groups": value})


def test_sync_refill_failed_groups_is_not_a_field() -> None:
    """Accepted only where verl's block is read: SamplerConfig itself has no such field."""
    with pytest.raises(TypeError):
        SamplerConfig(sync_refill_failed_groups=False)  # type: ignore[call-arg]
