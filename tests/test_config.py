from __future__ import annotations

from types import MappingProxyType

import pytest

from stalebuf import SamplerConfig
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


@pytest.mark.parametrize("value", [0, -1, True, False, 1.0, "2", None])
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
