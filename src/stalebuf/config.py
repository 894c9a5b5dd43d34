"""Sampler configuration: validated on construction, loadable from a verl-style mapping."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import attrs

from ._mixture_config import MIXTURE_POLICIES, check_mixture, to_mixture, to_task_thresholds
from ._token_config import check_token_admission, drop_unset_token_fields, optional_tokens
from ._validation import describe, finite_in, int_at_least, one_of
from .errors import ConfigError

__all__ = ["FAILURE_STRATEGIES", "IGNORED_VERL_KEYS", "METRIC_NAMINGS", "STRATEGIES", "SamplerConfig"]

#: Accepted values of ``max_off_policy_strategy``.
STRATEGIES: tuple[str, ...] = ("drop", "wait", "mask")
#: Accepted values of ``failure_strategy``.
FAILURE_STRATEGIES: tuple[str, ...] = ("sample", "evict")
#: Accepted values of ``metric_names``: stalebuf's keys, or verl main's eviction keys (verl #7082).
METRIC_NAMINGS: tuple[str, ...] = ("default", "verl-0.9")
#: Keys of verl's ``trainer.v1.sampler`` block that ``from_mapping`` accepts and ignores, each with
#: why: verl's sync trainer refills failed groups that hold no trajectory through its ``refill_fn``;
#: here that is ``failure_strategy="evict"`` plus an ``on_evict`` callback that refills.
IGNORED_VERL_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "sync_refill_failed_groups": (
            "refilling failed groups is failure_strategy='evict' plus an on_evict callback that "
            "dispatches new prompts"
        ),
    }
)

Strategy = Literal["drop", "wait", "mask"]
FailureStrategy = Literal["sample", "evict"]
MixturePolicy = Literal["wait", "borrow"]
MetricNaming = Literal["default", "verl-0.9"]

logger = logging.getLogger("stalebuf")


def _to_partitions(value: object) -> frozenset[str]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ConfigError(f"exempt_partitions must be a collection of partition names, got {describe(value)}")
    try:
        names = frozenset(value)
    except Exception as exc:  # an iteration, or an element's __hash__/__eq__, raised
        raise ConfigError(
            f"exempt_partitions could not be read as a set of names: {type(exc).__name__}"
        ) from exc
    for name in names:
        if type(name) is not str or not name:
            raise ConfigError(f"exempt_partitions must hold non-empty strings, got {describe(name)}")
    return names


def _to_kwargs(value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"sampler_kwargs must be a mapping, got {describe(value)}")
    try:
        copied = dict(value)
    except Exception as exc:  # a user mapping whose iteration or lookup raises
        raise ConfigError(f"sampler_kwargs could not be copied: {type(exc).__name__}") from exc
    for key in copied:
        if type(key) is not str or not key.isidentifier():
            raise ConfigError(f"sampler_kwargs keys must be identifiers, got {describe(key)}")
    return MappingProxyType(copied)


def _check_custom_sampler(_instance: object, _attribute: attrs.Attribute[str | None], value: object) -> None:
    if value is None:
        return
    if type(value) is not str:
        raise ConfigError(
            "custom_sampler must be None or 'module:ClassName' or 'path/to/file.py:ClassName', "
            f"got {describe(value)}"
        )
    target, sep, name = value.rpartition(":")
    location = target.removeprefix("pkg://").removeprefix("file://")
    if not sep or not location or not name.isidentifier():
        raise ConfigError(
            "custom_sampler must look like 'package.module:ClassName' or "
            f"'path/to/file.py:ClassName', got {describe(value)}"
        )


def _check_threshold(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # None is verl 0.9.1's "max_off_policy_threshold: null": no staleness control at all.
    if value is not None:
        int_at_least("max off policy threshold", 1)(_instance, attribute, value)


def _check_admission_batch_size(
    instance: SamplerConfig, attribute: attrs.Attribute[int | None], value: object
) -> None:
    if value is None:
        return
    int_at_least("admission_batch_size", 1)(instance, attribute, value)
    if instance.max_off_policy_threshold is None:
        # Admission's bound is T*S*b and its tags close by the drop rule: both need a threshold.
        raise ConfigError(
            "admission_batch_size needs a max_off_policy_threshold (admission bounds residency by "
            "T*S*b); max_off_policy_threshold=None turns staleness control off"
        )


def _check_evict_stale_in_flight(instance: SamplerConfig, _attribute: object, value: object) -> None:
    if type(value) is not bool:
        raise ConfigError(f"evict_stale_in_flight must be a bool, got {describe(value)}")
    if value and instance.max_off_policy_strategy == "mask":
        raise ConfigError(
            "evict_stale_in_flight=True cannot be used with max_off_policy_strategy='mask': an "
            "in-flight group can always still gain fresh tokens, so no in-flight group is provably "
            "useless (mask evicts only terminal groups without one fresh token)"
        )
    if value and instance.max_off_policy_strategy != "drop":
        raise ConfigError(
            "evict_stale_in_flight=True needs max_off_policy_strategy='drop' (under 'wait' every "
            "in-flight group is waited for, never evicted)"
        )


def _check_filter_metric(_instance: object, _attribute: attrs.Attribute[str | None], value: object) -> None:
    if value is not None and (type(value) is not str or not value):
        raise ConfigError(
            f"filter_groups_metric must be None or a non-empty str (a tag name), got {describe(value)}"
        )


def _check_deadline_seconds(
    _instance: object, _attribute: attrs.Attribute[float | None], value: object
) -> None:
    if value is not None:
        finite_in("group_deadline_seconds", 0.0, open_low=True)(_instance, _attribute, value)


def _check_deadline_factor(
    instance: SamplerConfig, _attribute: attrs.Attribute[float | None], value: object
) -> None:
    if value is None:
        return
    finite_in("group_deadline_factor", 1.0, open_low=True)(instance, _attribute, value)
    if instance.group_deadline_seconds is not None:
        raise ConfigError(
            "group_deadline_seconds and group_deadline_factor are exclusive: give a fixed deadline "
            "or a multiple of the median generation time, not both"
        )


def _check_quorum(_instance: object, attribute: attrs.Attribute[int | None], value: object) -> None:
    if value is not None:
        int_at_least("group_quorum", 1)(_instance, attribute, value)


@attrs.frozen(kw_only=True)
class SamplerConfig:
    """How ``sample`` treats stale and failed groups.

    Attributes:
        max_off_policy_threshold: the staleness threshold ``T`` (int >= 1), or None for no
            staleness control: no group is ever stale (nothing is dropped or masked) and the wait
            gate never closes (verl's ``max_off_policy_threshold: null``). None refuses admission.
        max_off_policy_strategy: "drop" evicts terminal groups whose head (oldest token; the
            dispatch step without versions) has ``s > T`` before selecting; "wait" never drops
            and waits while an in-flight group's head has ``s >= T``; "mask" evicts only
            terminal groups whose tail (newest token) has ``s > T`` and returns the rest with
            their stale tokens masked (``Batch.freshness_mask``, ``Batch.loss_excluded``).
        parameter_sync_step: ``S``, the trainer steps between weight syncs (int >= 1);
            staleness is ``(g - p + 1) / S``.
        failure_strategy: "sample" treats failed groups as sampleable; "evict" evicts them
            (reason "failure") when a ``sample`` call evaluates their partition.
        exempt_partitions: partitions where nothing is evicted and no wait gate applies.
        custom_sampler: None, or the ``ReplayBuffer`` subclass that ``ReplayBuffer.from_config``
            builds: ``"package.module:ClassName"``, ``"path/to/file.py:ClassName"``,
            ``"pkg://package.module:ClassName"`` or ``"file://path/to/file.py:ClassName"``.
        sampler_kwargs: extra keyword arguments for the custom sampler's constructor.
        admission_batch_size: None (no admission control) or ``b`` (int >= 1), the number of
            groups the trainer takes per ``sample``: each non-exempt partition then admits at most
            ``b`` resident groups per dispatch step (see the docs' "Flow control"). Needs a
            ``max_off_policy_threshold``; :meth:`bounded` sets both.
        evict_stale_in_flight: with "drop" only: ``sample`` also evicts PENDING/RUNNING groups
            that no later sample could return (their staleness already exceeds ``T``).
        group_deadline_seconds: None, or a finite number > 0: a PENDING/RUNNING group older than
            this (from its admission) is cut when a ``sample`` evaluates its partition (see the
            docs' "Deadlines"). Exclusive with ``group_deadline_factor``.
        group_deadline_factor: None, or a finite number > 1: the deadline is this multiple of
            the rolling median generation time of the partition's last 256 groups that the
            buffer saw in flight and that finished uncut; no deadline before 16 have counted.
        group_quorum: None, or an int >= 1: a cut group holding at least this many trajectories
            is finished with what it has; one with fewer is failed (None: every cut group fails).
        metric_names: "default" (stalebuf's metric keys) or "verl-0.9": the eviction counts
            ``sample`` reports take verl main's names (``off_policy/evicted_samples``,
            ``rollout_failure/evicted_samples``, ``filter_groups/evicted_samples``, all counting
            groups) and the dropped staleness is over groups, as verl reports it.
        mixture: None, or a mapping task name -> weight (a number > 0; normalised): every
            ``sample`` on a non-exempt partition returns each task's quota of the batch (the
            largest-remainder method on the weights), see the docs' "Mixing tasks". A group's
            task is its tag ``mixture_tag``; a group without one, or naming another task, is
            refused at admission with ValueError.
        mixture_tag: the group tag that names a group's task (default "task").
        mixture_policy: "wait" (a sample waits until every task can fill its quota) or
            "borrow" (a task's shortfall is filled from the others and paid back later).
        task_thresholds: task -> its own ``max_off_policy_threshold`` (int >= 1), overriding T
            for that task's groups in every rule; tasks of the mixture only.
        filter_groups_metric: None, or a trajectory tag name: the buffer filters groups with
            ``stalebuf.filters.zero_variance(filter_groups_metric)`` (verl's
            ``algorithm.filter_groups`` with ``enable: true`` and that ``metric``), before any
            filter given to the buffer.
        admission_token_budget: None, or an int >= 1: the tokens the trainer takes per step.
            Admission then counts tokens per dispatch step instead of groups: each non-exempt
            partition admits groups at a step while their tokens there stay within it (an
            in-flight group counts ``max_tokens_per_group`` until it ends, then its own
            tokens; see the docs' "Token admission"). Exclusive with ``admission_batch_size``;
            needs ``max_tokens_per_group`` (at most this) and a ``max_off_policy_threshold``.
        max_tokens_per_group: None, or an int >= 1: the most tokens a group may hold (e.g.
            ``n * max_response_length``; a ``put`` past it raises ValueError) and what an
            in-flight group reserves under token admission or ``max_resident_tokens``.
        max_resident_tokens: None, or an int >= 1 (at least ``max_tokens_per_group``, which it
            needs): a cap on the tokens of each non-exempt partition's resident groups,
            reservations included; producers wait for room as for admission. Works with or
            without the two admission fields. Neither token cap works with a ``mixture``.

    Raises:
        ConfigError: on construction, for any invalid value (the message names the field).
    """

    max_off_policy_threshold: int | None = attrs.field(default=8, validator=_check_threshold)
    max_off_policy_strategy: Strategy = attrs.field(
        default="drop", validator=one_of("max off policy strategy", STRATEGIES)
    )
    parameter_sync_step: int = attrs.field(default=1, validator=int_at_least("parameter_sync_step", 1))
    failure_strategy: FailureStrategy = attrs.field(
        default="sample", validator=one_of("failure_strategy", FAILURE_STRATEGIES)
    )
    exempt_partitions: frozenset[str] = attrs.field(default=frozenset({"val"}), converter=_to_partitions)
    custom_sampler: str | None = attrs.field(default=None, validator=_check_custom_sampler)
    sampler_kwargs: Mapping[str, Any] = attrs.field(
        factory=lambda: MappingProxyType({}), converter=_to_kwargs
    )
    admission_batch_size: int | None = attrs.field(default=None, validator=_check_admission_batch_size)
    evict_stale_in_flight: bool = attrs.field(default=False, validator=_check_evict_stale_in_flight)
    group_deadline_seconds: float | None = attrs.field(default=None, validator=_check_deadline_seconds)
    group_deadline_factor: float | None = attrs.field(default=None, validator=_check_deadline_factor)
    group_quorum: int | None = attrs.field(default=None, validator=_check_quorum)
    metric_names: MetricNaming = attrs.field(
        default="default", validator=one_of("metric_names", METRIC_NAMINGS)
    )
    filter_groups_metric: str | None = attrs.field(default=None, validator=_check_filter_metric)
    mixture: Mapping[str, float] | None = attrs.field(default=None, converter=to_mixture)
    mixture_tag: str = "task"
    mixture_policy: MixturePolicy = attrs.field(
        default="wait", validator=one_of("mixture_policy", MIXTURE_POLICIES)
    )
    task_thresholds: Mapping[str, int] = attrs.field(
        factory=lambda: MappingProxyType({}), converter=to_task_thresholds
    )
    admission_token_budget: int | None = attrs.field(
        default=None, validator=optional_tokens("admission_token_budget")
    )
    max_tokens_per_group: int | None = attrs.field(
        default=None, validator=optional_tokens("max_tokens_per_group")
    )
    max_resident_tokens: int | None = attrs.field(
        default=None, validator=optional_tokens("max_resident_tokens")
    )

    def __attrs_post_init__(self) -> None:
        """Check the rules across fields (the mixture's, the token caps')."""
        check_mixture(self.mixture, self.mixture_tag, self.task_thresholds, self.admission_batch_size)
        check_token_admission(
            self.admission_token_budget,
            self.max_tokens_per_group,
            self.max_resident_tokens,
            batch_size=self.admission_batch_size,
            threshold=self.max_off_policy_threshold,
            mixture=self.mixture,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: rebuilt through the constructor (and so validated again)."""
        fields = drop_unset_token_fields(attrs.asdict(self, recurse=False))
        fields["sampler_kwargs"] = dict(self.sampler_kwargs)
        fields["task_thresholds"] = dict(self.task_thresholds)
        if self.mixture is not None:
            fields["mixture"] = dict(self.mixture)
        return (_config_from_fields, (fields,))

    @classmethod
    def bounded(
        cls,
        *,
        threshold: int,
        batch_size: int,
        strategy: Strategy = "wait",
        parameter_sync_step: int = 1,
        **other_fields: Any,
    ) -> SamplerConfig:
        """The safe bounded configuration: admission control sized to the trainer's batch.

        Returns a config with ``max_off_policy_threshold=threshold``,
        ``max_off_policy_strategy=strategy``, ``parameter_sync_step`` and
        ``admission_batch_size=batch_size`` (plus ``evict_stale_in_flight=True`` under "drop",
        unless given: a straggler that can no longer be trained then frees its slot at once).
        At most ``T*S*batch_size`` groups are then resident and, under "wait", no trained group
        is staler than ``T`` — provided the trainer calls ``sample(g, batch_size)`` once per
        step and the producers dispatch at the clock (``global_steps=None``), best with
        ``async with buffer.rollout(uid)``. ``other_fields`` are any other fields.

        Raises:
            ConfigError: an invalid value, an unknown field, or a field that the named
                arguments set (``max_off_policy_threshold``, ``max_off_policy_strategy``,
                ``admission_batch_size``).
        """
        known = {field.name for field in attrs.fields(cls)}
        for name in other_fields:
            if name not in known:
                raise ConfigError(f"unknown SamplerConfig field {describe(name)}")
            if name in _BOUNDED_ARGUMENTS:
                argument = _BOUNDED_ARGUMENTS[name]
                raise ConfigError(f"bounded() sets {name} from {argument}=; pass {argument}= instead")
        if strategy == "drop":
            other_fields.setdefault("evict_stale_in_flight", True)
        return cls(
            max_off_policy_threshold=threshold,
            max_off_policy_strategy=strategy,
            parameter_sync_step=parameter_sync_step,
            admission_batch_size=batch_size,
            **other_fields,
        )

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> SamplerConfig:
        """Build a config from a dict or any Mapping shaped like verl's ``trainer.v1.sampler``.

        ``custom_sampler`` may be a string (see the class docs) or verl's ``{path, name}``
        mapping, where ``path`` is a file path, ``file://...`` or ``pkg://dotted.module``,
        and both null means no custom sampler. ``max_off_policy_threshold: null`` turns
        staleness control off. ``sync_refill_failed_groups`` (verl main and 0.9.1) is accepted
        and ignored (a bool or null; true is logged as a warning): refilling failed groups is
        ``failure_strategy="evict"`` plus an ``on_evict`` callback. Missing keys take their
        defaults; nested omegaconf containers are converted to plain ones.

        Raises:
            ConfigError: if ``mapping`` is not a mapping, has an unknown key, or holds an
                invalid value.
        """
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"sampler config must be a mapping, got {type(mapping).__name__}")
        known = {field.name for field in attrs.fields(cls)}
        values: dict[str, Any] = {}
        try:
            items = list(mapping.items())
        except Exception as exc:  # a user mapping whose iteration or lookup raises
            raise ConfigError(f"sampler config could not be read: {type(exc).__name__}") from exc
        for key, value in items:
            if type(key) is str and key in IGNORED_VERL_KEYS:
                _ignore_verl_key(key, value)
                continue
            if type(key) is not str or key not in known:
                raise ConfigError(
                    f"unknown sampler config key {describe(key)}; known keys: {', '.join(sorted(known))}"
                )
            values[key] = _plain(value)
        if "custom_sampler" in values:
            values["custom_sampler"] = _custom_sampler_spec(values["custom_sampler"])
        for key in ("sampler_kwargs", "exempt_partitions"):
            if key in values and values[key] is None:
                del values[key]
        return cls(**values)


#: The fields :meth:`SamplerConfig.bounded` sets, by the argument that sets each.
_BOUNDED_ARGUMENTS: Mapping[str, str] = MappingProxyType(
    {
        "max_off_policy_threshold": "threshold",
        "max_off_policy_strategy": "strategy",
        "admission_batch_size": "batch_size",
    }
)


def _ignore_verl_key(key: str, value: object) -> None:
    """Check a verl key that has no field here (a bool or null) and say when ignoring it matters.

    Raises:
        ConfigError: the value is not a bool or None.
    """
    if value is not None and type(value) is not bool:
        raise ConfigError(f"{key} must be a bool or null, got {describe(value)}")
    if value:
        # Not an error: verl's own default block must load as it is, and True is a valid verl run.
        logger.warning("sampler config key %s=true is ignored: %s", key, IGNORED_VERL_KEYS[key])


def _custom_sampler_spec(value: object) -> str | None:
    """Turn verl's ``{path, name}`` block (or a string) into this library's string form."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"custom_sampler must be a mapping with 'path' and 'name', got {describe(value)}")
    unknown = set(value) - {"path", "name"}
    if unknown:
        raise ConfigError(
            f"unknown custom_sampler key(s) {describe(sorted(unknown))}; expected 'path' and 'name'"
        )
    path, name = value.get("path"), value.get("name")
    if path is None and name is None:
        return None
    if not isinstance(path, str) or not path or not isinstance(name, str) or not name:
        raise ConfigError(
            "custom_sampler needs both 'path' and 'name' as non-empty strings, "
            f"got path={describe(path)}, name={describe(name)}"
        )
    if path.startswith(("pkg://", "file://")):
        return f"{path}:{name}"
    return f"file://{path}:{name}"  # verl reads a bare path as a file path


def _plain(value: Any) -> Any:
    """Copy nested mappings and sequences (omegaconf containers included) into dicts and lists."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        return [_plain(item) for item in value]
    return value


def _config_from_fields(fields: dict[str, Any]) -> SamplerConfig:
    return SamplerConfig(**fields)
