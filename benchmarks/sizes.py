"""How much work each ``compare.py`` measurement does: the full run and the ``--quick`` smoke run."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FULL", "QUICK", "Sizes"]


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does."""

    quick: bool
    p1_reps: dict[str, int]
    p1_batch: int
    p1_small_batch: int
    p1_big_batch: int
    p1_big_reps: int
    p1_polls: tuple[tuple[float, int], ...]  # (interval, measured reps)
    p1_polls_computed: tuple[float, ...]  # intervals reported from theory only
    p2_groups: int
    p2_rounds: int
    p2_poll_intervals: tuple[float, ...]
    p3_sizes: tuple[int, ...]
    p3_reps: int
    p3_poll_sizes: tuple[int, ...]
    p3_poll_reps: int
    p3_layouts: tuple[tuple[int | None, tuple[int, ...]], ...]  # (groups per step, sizes)
    p3_layout_reps: int
    p4_fixed_n: int
    p4_ks: tuple[int, ...]
    p4_k_at_n: int
    p4_reps: int
    p5_sizes: tuple[int, ...]
    p5_reps: int
    p5_poll_sizes: tuple[int, ...]
    p6_calls: int
    p6_idle: float
    p7_groups: int
    p7_polling_groups: int
    scale_groups: int  # groups of 8 through put_group + sample(256), end to end
    scale_reps: int
    order_groups: int  # groups in one dispatch step, finished in or out of admission order
    order_chunk: int  # mark_finished calls per timed chunk
    count_layouts: tuple[tuple[int, tuple[int, ...]], ...]  # (groups per step, sizes), all stale
    count_reps: int
    gc_groups: int  # resident groups built with the cyclic GC on, and off
    gc_reps: int

    def __post_init__(self) -> None:
        if self.p4_fixed_n not in self.p3_sizes:
            raise ValueError("p4_fixed_n must be one of p3_sizes (P4 reuses the P3 buffers)")


FULL = Sizes(
    quick=False,
    p1_reps={"asyncio": 2000, "trio": 1000, "uvloop": 1000},
    p1_batch=8,
    p1_small_batch=1,
    p1_big_batch=64,
    p1_big_reps=500,
    p1_polls=((0.05, 40), (2.0, 5)),
    p1_polls_computed=(),
    p2_groups=2048,
    p2_rounds=11,
    p2_poll_intervals=(0.05, 2.0),
    p3_sizes=(1_000, 10_000, 100_000, 1_000_000),
    p3_reps=101,
    p3_poll_sizes=(1_000, 10_000, 100_000),
    p3_poll_reps=5,
    p3_layouts=((None, (1_000, 100_000, 1_000_000)), (1, (1_000, 10_000, 100_000))),
    p3_layout_reps=21,
    p4_fixed_n=100_000,
    p4_ks=(10, 100, 1_000, 10_000),
    p4_k_at_n=1_000,
    p4_reps=7,
    p5_sizes=(1_000, 10_000, 100_000, 1_000_000),
    p5_reps=301,
    p5_poll_sizes=(1_000, 10_000, 100_000, 1_000_000),
    p6_calls=1_000,
    p6_idle=0.25,
    p7_groups=100_000,
    p7_polling_groups=20_000,
    scale_groups=1_000_000,
    scale_reps=3,
    order_groups=300_000,
    order_chunk=1_000,
    count_layouts=((256, (1_000, 1_000_000)), (1, (1_000, 100_000))),
    count_reps=21,
    gc_groups=1_000_000,
    gc_reps=2,
)

QUICK = Sizes(
    quick=True,
    p1_reps={"asyncio": 100, "trio": 50, "uvloop": 50},
    p1_batch=8,
    p1_small_batch=1,
    p1_big_batch=64,
    p1_big_reps=20,
    p1_polls=((0.02, 3),),
    p1_polls_computed=(0.05, 2.0),
    p2_groups=256,
    p2_rounds=2,
    p2_poll_intervals=(0.02,),
    p3_sizes=(500, 2_000),
    p3_reps=5,
    p3_poll_sizes=(500, 2_000),
    p3_poll_reps=2,
    p3_layouts=((None, (500, 2_000)), (1, (500, 2_000))),
    p3_layout_reps=3,
    p4_fixed_n=2_000,
    p4_ks=(10, 100),
    p4_k_at_n=50,
    p4_reps=2,
    p5_sizes=(500, 2_000),
    p5_reps=11,
    p5_poll_sizes=(500, 2_000),
    p6_calls=50,
    p6_idle=0.1,
    p7_groups=1_000,
    p7_polling_groups=1_000,
    scale_groups=2_048,
    scale_reps=1,
    order_groups=2_000,
    order_chunk=100,
    count_layouts=((256, (500, 2_000)), (1, (500, 2_000))),
    count_reps=3,
    gc_groups=2_000,
    gc_reps=1,
)
