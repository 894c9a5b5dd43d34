"""Building a buffer's rule book from its constructor's arguments, refusing what cannot work.

:func:`build_rules` checks the ``config``, ``policy`` and ``filters`` a ``ReplayBuffer`` is
given and returns its :class:`~stalebuf._rules.Rules`; a task mixture refuses the policies it
cannot honour (:func:`check_mixture_policy`).
"""

from __future__ import annotations

from ._rules import Rules
from .config import SamplerConfig
from .errors import ConfigError
from .filters import check_filters
from .policy import RuleHooks, StalenessPolicy, SubclassHooks, asks_defaults, select_label

__all__ = ["build_rules", "check_mixture_policy", "check_token_policy"]


def check_mixture_policy(policy: StalenessPolicy, config: SamplerConfig) -> None:
    """Refuse the policies a task mixture cannot honour.

    Raises:
        ConfigError: a ``select`` override (a mixture selects by quotas), or per-task thresholds
            with an overridden ``is_stale``, ``must_wait_for`` or ``admits`` (asked with a
            partition name only, they cannot apply a task's threshold).
    """
    if not asks_defaults(policy, ("select",)):
        raise ConfigError(
            f"{select_label(policy)} cannot be used with a task mixture: a mixture selects each "
            "task's quota itself"
        )
    if config.task_thresholds and not asks_defaults(policy, ("is_stale", "must_wait_for", "admits")):
        raise ConfigError(
            "task_thresholds cannot be used with a policy that overrides is_stale, must_wait_for or "
            "admits (they are asked with a partition name, not a task, so a task's threshold could "
            "not apply); override task_threshold instead, or drop task_thresholds"
        )


def check_token_policy(policy: StalenessPolicy, config: SamplerConfig) -> None:
    """Refuse the policies token admission cannot honour.

    Raises:
        ConfigError: under ``admission_token_budget``, an ``admits`` or ``admission_batch_size``
            override (both count groups per dispatch step; token admission counts tokens).
    """
    if config.admission_token_budget is not None and not asks_defaults(
        policy, ("admits", "admission_batch_size")
    ):
        raise ConfigError(
            f"{type(policy).__name__} overrides admits or admission_batch_size, which count groups per "
            "dispatch step: it cannot be used with admission_token_budget (admission counts tokens)"
        )


def build_rules(config: object, policy: object, hooks: RuleHooks | None, filters: object = ()) -> Rules:
    """Check a buffer's ``config``, ``policy`` and ``filters`` arguments and return its rule
    book (``hooks``: a subclass that overrides the verl-style hooks, else None).

    Raises:
        ConfigError: ``policy`` is not a StalenessPolicy or None, ``config`` not a SamplerConfig
            or None, or ``filters`` not a sequence of plain callables.
    """
    checked = check_filters(filters)
    # Types first: a policy of the wrong type must not be asked for its config.
    if policy is not None and not isinstance(policy, StalenessPolicy):
        raise ConfigError(f"policy must be a StalenessPolicy or None, got {type(policy).__name__}")
    if config is None:
        config = SamplerConfig() if policy is None else policy.config
    elif not isinstance(config, SamplerConfig):
        raise ConfigError(f"config must be a SamplerConfig or None, got {type(config).__name__}")
    base = StalenessPolicy(config) if policy is None else policy
    if config.mixture is not None:
        check_mixture_policy(base if hooks is None else SubclassHooks(base, hooks), config)
    check_token_policy(base, config)
    return Rules(base, hooks, config, checked)
