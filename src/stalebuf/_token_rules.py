"""The token rules a ``sample`` call must follow, as a pure function of the config.

Under ``admission_token_budget`` a count batch breaks the flow-control bound (admission and
the batches disagree on the unit) and a token budget below the admission budget can leave a
sample waiting forever; under ``admission_batch_size`` a token batch disagrees the other way.
:func:`check_sample_budget` refuses both before a ``sample`` changes anything.
"""

from __future__ import annotations

from .config import SamplerConfig

__all__ = ["check_sample_budget"]


def check_sample_budget(
    config: SamplerConfig, batch_size: int | None, token_budget: int | None, *, exempt: bool = False
) -> None:
    """Refuse a ``sample`` of ``batch_size`` groups or of ``token_budget`` tokens (one of them
    given, already checked) that the partition's admission cannot serve (``exempt``: the
    partition is exempt, where no admission applies and any batch goes).

    Raises:
        ValueError: under ``admission_token_budget``, a count batch or a token budget below it;
            under ``admission_batch_size``, a token budget.
    """
    if exempt:
        return
    admission = config.admission_token_budget
    if admission is not None:
        if token_budget is None:
            raise ValueError(
                f"sample(batch_size={batch_size}) cannot be used under admission_token_budget="
                f"{admission}: admission counts tokens, so the batch must too; call "
                f"sample(global_steps, token_budget=K) with K >= {admission}"
            )
        if token_budget < admission:
            raise ValueError(
                f"token_budget={token_budget} is below admission_token_budget={admission}: admission "
                "would admit more tokens per step than the trainer takes (the staleness bound breaks) "
                "and a sample could wait forever; use a token budget >= the admission budget"
            )
    elif token_budget is not None and config.admission_batch_size is not None:
        raise ValueError(
            f"sample(token_budget={token_budget}) cannot be used under admission_batch_size="
            f"{config.admission_batch_size}: admission counts groups, so the batch must too; call "
            "sample(global_steps, batch_size) or configure admission_token_budget"
        )
