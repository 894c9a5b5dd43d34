"""Loading the class named by ``SamplerConfig.custom_sampler``.

Accepted forms (``ClassName`` is looked up as an attribute of the loaded module):

- ``"package.module:ClassName"`` or ``"pkg://package.module:ClassName"``: imported by name;
- ``"path/to/file.py:ClassName"`` or ``"file://path/to/file.py:ClassName"``: executed from
  the file (a bare target is read as a file when it ends in ``.py`` or contains a path
  separator).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ._validation import describe, describe_error
from .config import SamplerConfig
from .errors import ConfigError
from .policy import StalenessPolicy


def build_from_config(
    cls: type[Any],
    base: type[Any],
    config: SamplerConfig | Mapping[str, Any],
    options: Mapping[str, Any],
) -> Any:
    """Build what ``ReplayBuffer.from_config`` promises (see its docs): an instance of ``cls``
    or of the ``base`` (``ReplayBuffer``) subclass the config names. (Typed loosely: this module
    sits below the buffer and must not import it.)

    Raises:
        ConfigError: for an invalid config, a custom sampler that cannot be loaded or is
            neither kind of subclass, or sampler_kwargs its constructor rejects.
    """
    if isinstance(config, Mapping):
        config = SamplerConfig.from_mapping(config)
    elif not isinstance(config, SamplerConfig):
        raise ConfigError(f"config must be a SamplerConfig or a mapping, got {type(config).__name__}")
    target: Any = cls
    if config.custom_sampler is not None:
        target = load_custom_sampler(config.custom_sampler)
        if not (isinstance(target, type) and issubclass(target, (base, StalenessPolicy))):
            raise ConfigError(
                f"custom_sampler {describe(config.custom_sampler)} must name a subclass of "
                f"stalebuf.ReplayBuffer or stalebuf.StalenessPolicy, got {type(target).__name__}"
            )
    kwargs = dict(config.sampler_kwargs)
    try:
        if issubclass(target, StalenessPolicy):
            return cls(config, policy=target(config, **kwargs), **options)
        built = target(config, **kwargs, **options)
    except TypeError as exc:
        raise ConfigError(
            f"{target.__qualname__} rejected sampler_kwargs {describe(kwargs)}: {describe_error(exc)}"
        ) from exc
    return built


__all__ = ["build_from_config", "load_custom_sampler", "refuse_custom_sampler"]


def refuse_custom_sampler(config: object) -> None:
    """Refuse a config naming a custom sampler given to plain ``ReplayBuffer(config)``.

    Raises:
        ConfigError: it names one (``from_config`` loads it).
    """
    if isinstance(config, SamplerConfig) and config.custom_sampler is not None:
        raise ConfigError(
            f"config names custom_sampler {describe(config.custom_sampler)}: build the buffer with "
            "ReplayBuffer.from_config(config), which loads it"
        )


def load_custom_sampler(spec: str) -> object:
    """Import and return the object named by ``spec``.

    Raises:
        ConfigError: if the module or file cannot be loaded or has no such attribute.
    """
    target, _, name = spec.rpartition(":")
    if target.startswith("pkg://"):
        module = _import_module(target.removeprefix("pkg://"), spec)
    elif target.startswith("file://"):
        module = _import_file(target.removeprefix("file://"), spec)
    elif target.endswith(".py") or "/" in target or os.sep in target:
        module = _import_file(target, spec)
    else:
        module = _import_module(target, spec)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(
            f"custom_sampler {describe(spec)}: {describe(module.__name__)} has no attribute {describe(name)}"
        ) from None


def _import_module(dotted: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(dotted)
    except Exception as exc:
        raise ConfigError(
            f"custom_sampler {describe(spec)}: cannot import module {describe(dotted)}: {describe_error(exc)}"
        ) from exc


def _import_file(path: str, spec: str) -> ModuleType:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ConfigError(f"custom_sampler {describe(spec)}: no such file {describe(path)}")
    # A stable, path-derived module name: loading the same file twice yields one module,
    # and two files with the same basename do not shadow each other.
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    module_name = f"_stalebuf_custom_sampler_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ConfigError(f"custom_sampler {describe(spec)}: {describe(path)} is not a loadable Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclass/attrs machinery looks modules up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ConfigError(
            f"custom_sampler {describe(spec)}: executing {describe(path)} failed: {describe_error(exc)}"
        ) from exc
    return module
