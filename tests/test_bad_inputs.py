"""The bad-input table: every documented error, raised before anything changes.

Each row is one bad call: it must raise exactly the documented error class, with a message
that names the offending argument or value (never its ``repr`` when that may raise or be
huge: every message stays under ``MAX_MESSAGE`` characters), and a full snapshot of the
buffer (stats plus every group's contents and the per-partition indexes) must be identical
before and after.

``ACCEPTED`` is the twin table: odd but valid calls (``[] in buffer``, ``status="failure"``)
that must succeed with exactly the documented effect.

The table is plain data (``CASES``); add a row to cover a new error. Every row runs against
the same populated buffer (see :func:`populated`), so rows can name its groups:

========  =========  ==========================================================
uid       partition  state
========  =========  ==========================================================
old       train      evicted as stale (dispatched at 0, sampled at 5, T=1)
oldfail   train      evicted as failed (failure_strategy="evict")
took      train      sampled
fin       train      FINISHED, sessions 0 and 1, tagged
failr     train      FAILURE (awaiting eviction)
pend      train      PENDING, session 0 (3 tokens, no versions)
run       train      RUNNING at 6, sessions 0 and 1 (1 with versions ((4, 2), (6, 1)): head 4)
vfin      val        FINISHED (exempt partition)
vfail     val        FAILURE (exempt partition: sampleable)
========  =========  ==========================================================

Rows marked ``flow=True`` run against a second buffer with admission control (T=2, b=2,
drop with ``evict_stale_in_flight``; see :func:`populated_flow`), whose dispatch clock and
last returned sample are at step 3, so step 3 is full and steps 1 and below are closed:

========  =========  ==========================================================
uid       partition  state
========  =========  ==========================================================
gone      train      evicted as stale while RUNNING (dispatched at 0, sampled at 3)
took      train      sampled at step 3
fa        train      RUNNING at step 3, session 0
fb        train      FINISHED at step 3 (put_group)
vfin      val        FINISHED (exempt partition: never gated)
========  =========  ==========================================================

Rows marked ``mixed=True`` run against a third buffer under a task mixture (``{"math": 2,
"code": 1}``, T=2, b=3, drop; see :func:`populated_mixed`): quotas of a batch of 3 are math 2,
code 1, and a batch of 1 would give code none:

========  =========  ==========================================================
uid       partition  state
========  =========  ==========================================================
m0, m1    train      FINISHED, task "math"
c0        train      RUNNING, task "code"
v0        val        FINISHED, no task (exempt partition: no quotas)
========  =========  ==========================================================

Rows marked ``tokens=True`` run against a fourth buffer under token admission (T=2, drop,
``admission_token_budget=100``, ``max_tokens_per_group=60``, ``max_resident_tokens=150``; see
:func:`populated_tokens`): step 0 counts 90 tokens (10 left), 90 are resident in all:

========  =========  ==========================================================
uid       partition  state
========  =========  ==========================================================
ta        train      RUNNING at step 0, 10 tokens put (reserves 60)
tb        train      FINISHED at step 0 (put_group, 30 tokens)
vfin      val        FINISHED (exempt partition: never gated)
========  =========  ==========================================================
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from _helpers import (
    LIMIT,
    LyingLen,
    assert_conserved,
    full_snapshot,
    in_flight_heads,
    make,
    resident_groups,
    resident_uids,
    version_state,
)
from samplers import NewestFirst
from stalebuf import Batch, Group, ReplayBuffer, SamplerConfig, StalenessPolicy, Status, Trajectory
from stalebuf.errors import (
    BufferClosedError,
    BufferFullError,
    CheckpointError,
    ConfigError,
    DuplicateGroupError,
    DuplicateTrajectoryError,
    FutureTagError,
    GroupEvictedError,
    InvalidTransitionError,
    TagClosedError,
    UnknownGroupError,
)
from stalebuf.filters import min_trajectories, zero_variance
from stalebuf.records import EMPTY_TAGS

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class Ctx:
    """What a row's call may use."""

    buf: ReplayBuffer
    tmp_path: Path


@dataclass(frozen=True)
class Case:
    """One bad call: ``call`` must raise exactly ``error`` with a message matching ``match``."""

    id: str
    call: Callable[[Ctx], object]  # may return an awaitable, which is awaited
    error: type[Exception]
    match: str
    closed: bool = False  # close the buffer before the call (and before the snapshot)
    flow: bool = False  # run against populated_flow() instead of populated()
    mixed: bool = False  # run against populated_mixed() instead of populated()
    tokens: bool = False  # run against populated_tokens() instead of populated()


def write(ctx: Ctx, name: str, source: str) -> str:
    path = ctx.tmp_path / name
    path.write_text(source)
    return str(path)


def from_file(ctx: Ctx, name: str, source: str, cls: str) -> ReplayBuffer:
    spec = f"{write(ctx, name, source)}:{cls}"
    return ReplayBuffer.from_config(SamplerConfig(custom_sampler=spec))


# -- hostile arguments (issue 10, items 14 and 15) -------------------------------------------
MAX_MESSAGE = 1000  # characters: an error message must not grow with the value it rejects
HUGE = 10**5000  # str() of it raises ValueError (Python's 4300-digit limit)
HUGE_STR = "x" * 1_000_000
SURROGATE = "\udcff"  # what json.loads('"\\udcff"') or os.fsdecode(b"\xff") gives: not UTF-8
UTF8 = "encodable as UTF-8"


class EvilRepr:
    """A value whose ``repr`` raises: messages must name its type instead."""

    def __repr__(self) -> str:
        raise RuntimeError("evil repr")


class EvilEq(EvilRepr):
    """Also refuses to be compared (``status=`` must be checked by type first)."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("evil eq")


class EvilCollection(EvilRepr):
    """A collection whose ``len()`` or iteration raises."""

    def __init__(self, *, bad_len: bool = False, bad_iter: bool = False) -> None:
        self.bad_len, self.bad_iter = bad_len, bad_iter

    def __len__(self) -> int:
        if self.bad_len:
            raise RuntimeError("evil len")
        return 2

    def __iter__(self) -> Iterator[int]:
        yield 0
        if self.bad_iter:
            raise RuntimeError("evil iter")
        yield 1

    def __contains__(self, item: object) -> bool:
        return item in (0, 1)


class EvilMapping(Mapping[str, Any], EvilRepr):
    """A mapping whose ``len()`` and iteration raise."""

    def __getitem__(self, key: str) -> Any:
        raise KeyError(key)

    def __len__(self) -> int:
        raise RuntimeError("evil len")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("evil iter")


def group(c: Ctx, uid: str = "new", payloads: Any = ("x", "y"), **kwargs: Any) -> list[str]:
    """``put_group_nowait`` with a valid default for everything the row does not name."""
    kwargs.setdefault("global_steps", 5)
    return c.buf.put_group_nowait(uid, payloads, **kwargs)


def restore(ctx: Ctx, **options: object) -> object:
    """Restore the table's buffer from a checkpoint, with ``options``."""
    return ReplayBuffer.restore(ctx.buf.checkpoint(), **options)  # type: ignore[arg-type]


async def restore_codec_file(ctx: Ctx) -> object:
    """Save the buffer with a payload codec, then restore the file without one."""
    path = ctx.tmp_path / "codec.ckpt"
    await ctx.buf.save(path, payload_codec=(lambda p: repr(p).encode(), bytes.decode))
    return ReplayBuffer.restore(path)


async def enter(block: Any) -> None:
    """Enter and leave an ``async with`` block (a rollout whose entry must fail)."""
    async with block:
        pytest.fail("entered a rollout that must fail")


async def _async_filter(group: Group) -> bool:
    return True


def _keep(group: Group) -> bool:
    return True


def mix(**config: Any) -> SamplerConfig:
    """A config with a two-task mixture and ``config``."""
    config.setdefault("mixture", {"math": 2, "code": 1})
    return SamplerConfig(**config)


def tok(**config: Any) -> SamplerConfig:
    """A token-admission config (T=2, K=100, M=60) with ``config``."""
    fields: dict[str, Any] = {"max_off_policy_threshold": 2, "admission_token_budget": 100}
    fields["max_tokens_per_group"] = 60
    return SamplerConfig(**{**fields, **config})


class CountingAdmits(StalenessPolicy):
    """A policy whose ``admits`` counts groups: refused under token admission."""

    def admits(self, tag: int, resident_at_tag: int, last_sampled: int, cap: int, partition: str) -> bool:
        return True


C = Case
CASES: tuple[Case, ...] = (
    # -- configuration ---------------------------------------------------------------------
    C("threshold-0", lambda c: SamplerConfig(max_off_policy_threshold=0), ConfigError, "threshold.*0"),
    C(
        "threshold-negative",
        lambda c: SamplerConfig(max_off_policy_threshold=-3),
        ConfigError,
        "threshold.*-3",
    ),
    C(
        "threshold-bool",
        lambda c: SamplerConfig(max_off_policy_threshold=True),
        ConfigError,
        "threshold.*True",
    ),
    C(
        "threshold-float",
        lambda c: SamplerConfig(max_off_policy_threshold=2.0),
        ConfigError,
        "threshold.*2.0",
    ),
    C(
        "threshold-None-with-admission",  # None is no staleness control; admission needs a bound
        lambda c: SamplerConfig(max_off_policy_threshold=None, admission_batch_size=4),
        ConfigError,
        "admission_batch_size needs a max_off_policy_threshold",
    ),
    C(
        "metric-names-unknown",
        lambda c: SamplerConfig(metric_names="verl"),
        ConfigError,
        "metric_names.*verl",
    ),
    C(
        "bounded-sets-admission",
        lambda c: SamplerConfig.bounded(threshold=2, batch_size=4, admission_batch_size=8),
        ConfigError,
        "pass batch_size= instead",
    ),
    C(
        "strategy-unknown",
        lambda c: SamplerConfig(max_off_policy_strategy="dropp"),
        ConfigError,
        "strategy.*dropp",
    ),
    C("sync-step-0", lambda c: SamplerConfig(parameter_sync_step=0), ConfigError, "parameter_sync_step.*0"),
    C(
        "sync-step-bool",
        lambda c: SamplerConfig(parameter_sync_step=False),
        ConfigError,
        "parameter_sync_step",
    ),
    C(
        "sync-step-str",
        lambda c: SamplerConfig(parameter_sync_step="2"),
        ConfigError,
        "parameter_sync_step.*'2'",
    ),
    C(
        "failure-strategy",
        lambda c: SamplerConfig(failure_strategy="retry"),
        ConfigError,
        "failure_strategy.*retry",
    ),
    C(
        "exempt-str",
        lambda c: SamplerConfig(exempt_partitions="val"),
        ConfigError,
        "exempt_partitions.*'val'",
    ),
    C("exempt-empty-name", lambda c: SamplerConfig(exempt_partitions={""}), ConfigError, "exempt_partitions"),
    C("exempt-int-name", lambda c: SamplerConfig(exempt_partitions=[1]), ConfigError, "exempt_partitions.*1"),
    C(
        "exempt-not-iterable",
        lambda c: SamplerConfig(exempt_partitions=5),
        ConfigError,
        "exempt_partitions.*5",
    ),
    C("sampler-kwargs-list", lambda c: SamplerConfig(sampler_kwargs=[1]), ConfigError, "sampler_kwargs"),
    C("sampler-kwargs-key", lambda c: SamplerConfig(sampler_kwargs={"not id": 1}), ConfigError, "'not id'"),
    C("custom-sampler-int", lambda c: SamplerConfig(custom_sampler=42), ConfigError, "custom_sampler.*42"),
    C(
        "custom-sampler-no-colon",
        lambda c: SamplerConfig(custom_sampler="mymod.Sampler"),
        ConfigError,
        "custom_sampler.*mymod.Sampler",
    ),
    C("custom-sampler-no-class", lambda c: SamplerConfig(custom_sampler="mymod:"), ConfigError, "'mymod:'"),
    C("mapping-not-mapping", lambda c: SamplerConfig.from_mapping(["drop"]), ConfigError, "mapping.*list"),
    C(
        "mapping-unknown-key",
        lambda c: SamplerConfig.from_mapping({"max_threshold": 2}),
        ConfigError,
        "unknown.*'max_threshold'",
    ),
    C(
        "mapping-sampler-no-name",
        lambda c: SamplerConfig.from_mapping({"custom_sampler": {"path": "s.py"}}),
        ConfigError,
        "'name'",
    ),
    C(
        "mapping-sampler-extra-key",
        lambda c: SamplerConfig.from_mapping({"custom_sampler": {"path": "s.py", "name": "S", "cls": 1}}),
        ConfigError,
        "'cls'",
    ),
    C(
        "buffer-config-dict",
        lambda c: ReplayBuffer({"max_off_policy_threshold": 2}),
        ConfigError,
        "config must be a SamplerConfig",
    ),
    C("buffer-on-evict-int", lambda c: ReplayBuffer(on_evict=5), ConfigError, "on_evict.*5"),
    C(
        "buffer-log-interval-0",
        lambda c: ReplayBuffer(status_log_interval=0),
        ConfigError,
        "status_log_interval.*0",
    ),
    C(
        "buffer-log-interval-bool",
        lambda c: ReplayBuffer(status_log_interval=True),
        ConfigError,
        "status_log_interval.*True",
    ),
    C(
        "buffer-log-interval-str",
        lambda c: ReplayBuffer(status_log_interval="60"),
        ConfigError,
        "status_log_interval.*'60'",
    ),
    C("from-config-int", lambda c: ReplayBuffer.from_config(8), ConfigError, "config must be.*int"),
    # values that do not fit a 64-bit int would overflow the metrics (issue 10, item 3)
    C(
        "threshold-huge",
        lambda c: SamplerConfig(max_off_policy_threshold=10**400),
        ConfigError,
        "threshold.*2\\*\\*63",
    ),
    C(
        "sync-step-huge",
        lambda c: SamplerConfig(parameter_sync_step=10**400),
        ConfigError,
        "parameter_sync_step",
    ),
    C(
        "sync-step-2**63",
        lambda c: SamplerConfig(parameter_sync_step=2**63),
        ConfigError,
        "parameter_sync_step",
    ),
    # hostile values: a typed error naming the field, never the value's repr (items 14, 15)
    C(
        "threshold-evil-repr",
        lambda c: SamplerConfig(max_off_policy_threshold=EvilRepr()),
        ConfigError,
        "threshold.*EvilRepr",
    ),
    C(
        "strategy-evil-eq",
        lambda c: SamplerConfig(max_off_policy_strategy=EvilEq()),
        ConfigError,
        "strategy.*EvilEq",
    ),
    C(
        "exempt-evil-repr",
        lambda c: SamplerConfig(exempt_partitions=EvilRepr()),
        ConfigError,
        "exempt_partitions",
    ),
    C(
        "exempt-name-evil-repr",
        lambda c: SamplerConfig(exempt_partitions=[EvilRepr()]),
        ConfigError,
        "exempt_partitions",
    ),
    C(
        "exempt-name-huge-int",
        lambda c: SamplerConfig(exempt_partitions=[HUGE]),
        ConfigError,
        "exempt_partitions",
    ),
    C(
        "exempt-huge-str",
        lambda c: SamplerConfig(exempt_partitions=HUGE_STR),
        ConfigError,
        "exempt_partitions",
    ),
    C(
        "sampler-kwargs-evil-repr",
        lambda c: SamplerConfig(sampler_kwargs=EvilRepr()),
        ConfigError,
        "sampler_kwargs",
    ),
    C("sampler-kwargs-huge-int", lambda c: SamplerConfig(sampler_kwargs=HUGE), ConfigError, "sampler_kwargs"),
    C(
        "custom-sampler-evil-repr",
        lambda c: SamplerConfig(custom_sampler=EvilRepr()),
        ConfigError,
        "custom_sampler",
    ),
    C("custom-sampler-huge-int", lambda c: SamplerConfig(custom_sampler=HUGE), ConfigError, "custom_sampler"),
    C(
        "custom-sampler-huge-str",
        lambda c: SamplerConfig(custom_sampler=HUGE_STR),
        ConfigError,
        "custom_sampler",
    ),
    C(
        "mapping-unknown-huge-key",
        lambda c: SamplerConfig.from_mapping({HUGE_STR: 1}),
        ConfigError,
        "unknown sampler config key",
    ),
    C(
        "mapping-sampler-huge-path",
        lambda c: SamplerConfig.from_mapping({"custom_sampler": {"path": HUGE, "name": "S"}}),
        ConfigError,
        "custom_sampler",
    ),
    C(
        "buffer-log-interval-huge",
        lambda c: ReplayBuffer(status_log_interval=10**400),
        ConfigError,
        "status_log_interval",
    ),
    # an interval this short would make the status log the loop's main occupation (item 6)
    C(
        "buffer-log-interval-tiny",
        lambda c: ReplayBuffer(status_log_interval=1e-12),
        ConfigError,
        "status_log_interval.*1e-12",
    ),
    C(
        "buffer-log-interval-below-1ms",
        lambda c: ReplayBuffer(status_log_interval=0.0009),
        ConfigError,
        "status_log_interval.*0.0009",
    ),
    C(
        "from-config-log-interval-tiny",
        lambda c: ReplayBuffer.from_config(SamplerConfig(), status_log_interval=1e-9),
        ConfigError,
        "status_log_interval",
    ),
    C(
        "buffer-log-interval-evil-repr",
        lambda c: ReplayBuffer(status_log_interval=EvilRepr()),
        ConfigError,
        "status_log_interval.*EvilRepr",
    ),
    C(
        "buffer-on-evict-evil-repr",
        lambda c: ReplayBuffer(on_evict=EvilRepr()),
        ConfigError,
        "on_evict.*EvilRepr",
    ),
    # ReplayBuffer(config) would silently ignore the custom sampler (item 11)
    C(
        "buffer-custom-sampler-direct",
        lambda c: ReplayBuffer(SamplerConfig(custom_sampler="samplers:NewestFirst")),
        ConfigError,
        "from_config",
    ),
    # -- custom samplers -------------------------------------------------------------------
    C(
        "sampler-module-missing",
        lambda c: ReplayBuffer.from_config(SamplerConfig(custom_sampler="stalebuf_no_such_module:Sampler")),
        ConfigError,
        "cannot import module 'stalebuf_no_such_module'",
    ),
    C(
        "sampler-class-missing",
        lambda c: ReplayBuffer.from_config(SamplerConfig(custom_sampler="stalebuf.buffer:NoSuchSampler")),
        ConfigError,
        "no attribute 'NoSuchSampler'",
    ),
    C(
        "sampler-not-a-subclass",
        lambda c: ReplayBuffer.from_config(SamplerConfig(custom_sampler="stalebuf.records:Group")),
        ConfigError,
        "subclass of stalebuf.ReplayBuffer",
    ),
    C(
        "sampler-not-a-class",
        lambda c: ReplayBuffer.from_config(SamplerConfig(custom_sampler="stalebuf.staleness:age")),
        ConfigError,
        "subclass of stalebuf.ReplayBuffer",
    ),
    C(
        "sampler-file-missing",
        lambda c: ReplayBuffer.from_config(
            SamplerConfig(custom_sampler=f"file://{c.tmp_path}/nope.py:Sampler")
        ),
        ConfigError,
        "no such file",
    ),
    C(
        "sampler-bare-path-missing",
        lambda c: ReplayBuffer.from_config(SamplerConfig(custom_sampler=f"{c.tmp_path}/nope.py:Sampler")),
        ConfigError,
        "no such file",
    ),
    C(
        "sampler-file-raises",
        lambda c: from_file(c, "broken.py", "raise RuntimeError('boom')\n", "Sampler"),
        ConfigError,
        "executing .*broken.py.* failed: .*boom",
    ),
    C(
        "sampler-file-wrong-class",
        lambda c: from_file(c, "plain.py", "class Sampler:\n    pass\n", "Sampler"),
        ConfigError,
        "subclass of stalebuf.ReplayBuffer",
    ),
    C(
        "sampler-kwargs-rejected",
        lambda c: ReplayBuffer.from_config(SamplerConfig(sampler_kwargs={"bogus": 1})),
        ConfigError,
        "rejected sampler_kwargs.*bogus",
    ),
    C(
        "sampler-mapping-missing-file",
        lambda c: ReplayBuffer.from_config(
            {"custom_sampler": {"path": f"{c.tmp_path}/gone.py", "name": "S"}}
        ),
        ConfigError,
        "no such file",
    ),
    C(
        "sampler-kwargs-rejected-huge",
        lambda c: ReplayBuffer.from_config(SamplerConfig(sampler_kwargs={"bogus": HUGE})),
        ConfigError,
        "rejected sampler_kwargs",
    ),
    C(
        "sampler-module-huge-name",
        lambda c: ReplayBuffer.from_config(SamplerConfig(custom_sampler=f"{'m' * 1_000_000}:Sampler")),
        ConfigError,
        "cannot import module",
    ),
    # -- restore -----------------------------------------------------------------------------
    C("restore-source-int", lambda c: ReplayBuffer.restore(7), TypeError, "source must be.*got int"),
    C("restore-source-bytes", lambda c: ReplayBuffer.restore(b"f.ckpt"), TypeError, "source.*bytes"),
    C("restore-source-None", lambda c: ReplayBuffer.restore(None), TypeError, "source.*NoneType"),
    C("restore-source-buffer", lambda c: ReplayBuffer.restore(c.buf), TypeError, "source.*ReplayBuffer"),
    C(
        "restore-missing-file",
        lambda c: ReplayBuffer.restore(c.tmp_path / "missing.ckpt"),
        FileNotFoundError,
        "missing.ckpt",
    ),
    C("restore-directory", lambda c: ReplayBuffer.restore(c.tmp_path), IsADirectoryError, "directory"),
    C("restore-in-flight-typo", lambda c: restore(c, in_flight="reisue"), ConfigError, "in_flight must be"),
    C("restore-in-flight-None", lambda c: restore(c, in_flight=None), ConfigError, "in_flight.*'evict'"),
    C("restore-in-flight-bool", lambda c: restore(c, in_flight=True), ConfigError, "in_flight"),
    C("restore-on-evict-int", lambda c: restore(c, on_evict=5), ConfigError, "on_evict.*5"),
    C(
        "restore-log-interval",
        lambda c: restore(c, status_log_interval=0),
        ConfigError,
        "status_log_interval",
    ),
    C("restore-codec-callable", lambda c: restore(c, payload_codec=repr), ConfigError, "payload_codec"),
    C("restore-codec-triple", lambda c: restore(c, payload_codec=(repr,) * 3), ConfigError, "payload_codec"),
    C("restore-codec-strings", lambda c: restore(c, payload_codec=("a", "b")), ConfigError, "payload_codec"),
    C("restore-codec-list", lambda c: restore(c, payload_codec=[repr, repr]), ConfigError, "payload_codec"),
    C("restore-codec-missing", restore_codec_file, CheckpointError, "pass payload_codec="),
    # -- add_prompt ------------------------------------------------------------------------
    C("uid-empty", lambda c: c.buf.add_prompt_nowait("", global_steps=0), ValueError, "uid.*''"),
    C("uid-underscore", lambda c: c.buf.add_prompt_nowait("a_b", global_steps=0), ValueError, "'a_b'"),
    C("uid-int", lambda c: c.buf.add_prompt_nowait(7, global_steps=0), TypeError, "uid must be a str.*int"),
    C("uid-None", lambda c: c.buf.add_prompt_nowait(None, global_steps=0), TypeError, "uid.*NoneType"),
    C("uid-bytes", lambda c: c.buf.add_prompt_nowait(b"abc", global_steps=0), TypeError, "uid.*bytes"),
    C(
        "step-negative",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=-1),
        ValueError,
        "global_steps.*-1",
    ),
    C(
        "step-str-None",
        lambda c: c.buf.add_prompt_nowait("new", global_steps="None"),  # type: ignore[arg-type]
        TypeError,
        "global_steps.*'None'",
    ),
    C(
        "step-bool",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=True),
        TypeError,
        "global_steps.*bool",
    ),
    C(
        "step-float",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=1.0),
        TypeError,
        "global_steps.*float",
    ),
    C("step-str", lambda c: c.buf.add_prompt_nowait("new", global_steps="3"), TypeError, "global_steps.*'3'"),
    C(
        "partition-empty",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=0, partition=""),
        ValueError,
        "partition",
    ),
    C(
        "partition-int",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=0, partition=1),
        TypeError,
        "partition must be a str.*int",
    ),
    C(
        "tags-list",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=0, tags=[("a", 1)]),
        TypeError,
        "tags.*list",
    ),
    C(
        "duplicate-pending",
        lambda c: c.buf.add_prompt_nowait("pend", global_steps=0),
        DuplicateGroupError,
        "'pend'",
    ),
    C(
        "duplicate-finished",
        lambda c: c.buf.add_prompt_nowait("fin", global_steps=9),
        DuplicateGroupError,
        "'fin'",
    ),
    C(
        "duplicate-other-partition",
        lambda c: c.buf.add_prompt_nowait("vfin", global_steps=0),
        DuplicateGroupError,
        "'vfin'",
    ),
    C("duplicate-async", lambda c: c.buf.add_prompt("run", global_steps=6), DuplicateGroupError, "'run'"),
    C(
        "step-huge",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=10**400),
        ValueError,
        "global_steps",
    ),
    C("step-2**63", lambda c: c.buf.add_prompt_nowait("new", global_steps=2**63), ValueError, "global_steps"),
    C(
        "step-evil-repr",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=EvilRepr()),
        TypeError,
        "global_steps.*EvilRepr",
    ),
    C(
        "uid-evil-repr",
        lambda c: c.buf.add_prompt_nowait(EvilRepr(), global_steps=0),
        TypeError,
        "uid.*EvilRepr",
    ),
    C("uid-huge", lambda c: c.buf.add_prompt_nowait("a_" * 500_000, global_steps=0), ValueError, "uid"),
    C(
        "partition-evil-repr",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=0, partition=EvilRepr()),
        TypeError,
        "partition.*EvilRepr",
    ),
    C(
        "tags-evil-repr",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=0, tags=EvilRepr()),
        TypeError,
        "tags.*EvilRepr",
    ),
    C(
        "tags-evil-mapping",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=0, tags=EvilMapping()),
        TypeError,
        "tags",
    ),
    # -- mark_running ----------------------------------------------------------------------
    C("running-unknown", lambda c: c.buf.mark_running_nowait("ghost"), UnknownGroupError, "'ghost'"),
    C("running-uid-int", lambda c: c.buf.mark_running_nowait(3), TypeError, "uid must be a str"),
    C("running-empty-uid", lambda c: c.buf.mark_running_nowait(""), UnknownGroupError, "''"),
    C("running-twice", lambda c: c.buf.mark_running_nowait("run"), InvalidTransitionError, "'run'.*running"),
    C(
        "running-finished",
        lambda c: c.buf.mark_running_nowait("fin"),
        InvalidTransitionError,
        "'fin'.*finished",
    ),
    C(
        "running-failed",
        lambda c: c.buf.mark_running_nowait("failr"),
        InvalidTransitionError,
        "'failr'.*failure",
    ),
    C("running-sampled", lambda c: c.buf.mark_running_nowait("took"), UnknownGroupError, "'took'"),
    C("running-evicted-stale", lambda c: c.buf.mark_running_nowait("old"), UnknownGroupError, "'old'"),
    C("running-async-finished", lambda c: c.buf.mark_running("vfin"), InvalidTransitionError, "'vfin'"),
    C("running-uid-evil-repr", lambda c: c.buf.mark_running_nowait(EvilRepr()), TypeError, "uid.*EvilRepr"),
    C(
        "running-huge-unknown-uid",
        lambda c: c.buf.mark_running_nowait("y" * 1_000_000),
        UnknownGroupError,
        "no group",
    ),
    # -- put -------------------------------------------------------------------------------
    C("put-unknown", lambda c: c.buf.put_nowait("ghost", 1), UnknownGroupError, "'ghost'"),
    C("put-uid-bytes", lambda c: c.buf.put_nowait(b"pend", 1), TypeError, "uid must be a str.*bytes"),
    C(
        "put-finished",
        lambda c: c.buf.put_nowait("fin", 1, session_id=5),
        InvalidTransitionError,
        "'fin'.*late write",
    ),
    C(
        "put-failed",
        lambda c: c.buf.put_nowait("failr", 1, session_id=5),
        InvalidTransitionError,
        "'failr'.*late write",
    ),
    C(
        "put-exempt-finished",
        lambda c: c.buf.put_nowait("vfin", 1, session_id=5),
        InvalidTransitionError,
        "'vfin'",
    ),
    C("put-sampled", lambda c: c.buf.put_nowait("took", 1, session_id=5), UnknownGroupError, "'took'"),
    C("put-evicted-stale", lambda c: c.buf.put_nowait("old", 1, session_id=5), UnknownGroupError, "'old'"),
    C(
        "put-evicted-failure",
        lambda c: c.buf.put_nowait("oldfail", 1, session_id=5),
        UnknownGroupError,
        "'oldfail'",
    ),
    C(
        "put-duplicate",
        lambda c: c.buf.put_nowait("pend", 1, session_id=0, index=0),
        DuplicateTrajectoryError,
        "pend_0_0",
    ),
    C(
        "put-duplicate-running",
        lambda c: c.buf.put_nowait("run", 1, session_id=1),
        DuplicateTrajectoryError,
        "run_1_0",
    ),
    C(
        "put-session-negative",
        lambda c: c.buf.put_nowait("pend", 1, session_id=-1),
        ValueError,
        "session_id.*-1",
    ),
    C(
        "put-session-bool",
        lambda c: c.buf.put_nowait("pend", 1, session_id=True),
        TypeError,
        "session_id.*bool",
    ),
    C("put-session-None", lambda c: c.buf.put_nowait("pend", 1, session_id=None), TypeError, "session_id"),
    C("put-index-float", lambda c: c.buf.put_nowait("pend", 1, index=1.5), TypeError, "index.*1.5"),
    C("put-index-negative", lambda c: c.buf.put_nowait("pend", 1, index=-4), ValueError, "index.*-4"),
    C("put-tags-str", lambda c: c.buf.put_nowait("pend", 1, session_id=3, tags="x"), TypeError, "tags.*str"),
    C("put-async-late", lambda c: c.buf.put("fin", 1, session_id=7), InvalidTransitionError, "'fin'"),
    C(
        "put-session-huge",
        lambda c: c.buf.put_nowait("pend", 1, session_id=HUGE),
        ValueError,
        "session_id.*bits",
    ),
    C("put-index-2**63", lambda c: c.buf.put_nowait("pend", 1, index=2**63), ValueError, "index"),
    C(
        "put-index-evil-repr",
        lambda c: c.buf.put_nowait("pend", 1, index=EvilRepr()),
        TypeError,
        "index.*EvilRepr",
    ),
    C(
        "put-tags-evil-mapping",
        lambda c: c.buf.put_nowait("pend", 1, session_id=3, tags=EvilMapping()),
        TypeError,
        "tags",
    ),
    # -- mark_finished / mark_failed -------------------------------------------------------
    C("finish-twice", lambda c: c.buf.mark_finished_nowait("fin"), InvalidTransitionError, "'fin'.*finished"),
    C("finish-failed", lambda c: c.buf.mark_finished_nowait("failr"), InvalidTransitionError, "'failr'"),
    C("fail-finished", lambda c: c.buf.mark_failed_nowait("fin"), InvalidTransitionError, "'fin'.*finished"),
    C("fail-twice", lambda c: c.buf.mark_failed_nowait("vfail"), InvalidTransitionError, "'vfail'.*failure"),
    C("finish-sampled", lambda c: c.buf.mark_finished_nowait("took"), UnknownGroupError, "'took'"),
    C("fail-evicted-stale", lambda c: c.buf.mark_failed_nowait("old"), UnknownGroupError, "'old'"),
    C("fail-evicted-failure", lambda c: c.buf.mark_failed_nowait("oldfail"), UnknownGroupError, "'oldfail'"),
    C("finish-unknown", lambda c: c.buf.mark_finished_nowait("ghost"), UnknownGroupError, "'ghost'"),
    C(
        "finish-uid-list",
        lambda c: c.buf.mark_finished_nowait(["pend"]),
        TypeError,
        "uid must be a str.*list",
    ),
    C("finish-async-twice", lambda c: c.buf.mark_finished("vfin"), InvalidTransitionError, "'vfin'"),
    C("fail-async-sampled", lambda c: c.buf.mark_failed("took"), UnknownGroupError, "'took'"),
    C("finish-uid-evil-repr", lambda c: c.buf.mark_finished_nowait(EvilRepr()), TypeError, "uid.*EvilRepr"),
    C("fail-uid-evil-eq", lambda c: c.buf.mark_failed_nowait(EvilEq()), TypeError, "uid.*EvilEq"),
    # -- put_group -------------------------------------------------------------------------
    C("group-uid-int", lambda c: group(c, 7), TypeError, "uid must be a str.*int"),
    C("group-uid-underscore", lambda c: group(c, "a_b"), ValueError, "'a_b'"),
    C("group-step-negative", lambda c: group(c, global_steps=-1), ValueError, "global_steps.*-1"),
    C("group-step-float", lambda c: group(c, global_steps=5.0), TypeError, "global_steps.*float"),
    C("group-step-huge", lambda c: group(c, global_steps=10**400), ValueError, "global_steps"),
    C("group-partition-int", lambda c: group(c, partition=3), TypeError, "partition must be a str"),
    C("group-partition-empty", lambda c: group(c, partition=""), ValueError, "partition"),
    C("group-tags-list", lambda c: group(c, tags=[("a", 1)]), TypeError, "tags.*list"),
    C("group-tags-evil-mapping", lambda c: group(c, tags=EvilMapping()), TypeError, "tags"),
    C("group-payloads-str", lambda c: group(c, payloads="xy"), TypeError, "payloads.*str"),
    C("group-payloads-dict", lambda c: group(c, payloads={"a": 1}), TypeError, "payloads.*dict"),
    C("group-payloads-int", lambda c: group(c, payloads=2), TypeError, "payloads.*int"),
    C("group-payloads-generator", lambda c: group(c, payloads=(p for p in "xy")), TypeError, "payloads"),
    # a collection whose len() or iteration raises, or whose len() lies (item 4)
    C(
        "group-payloads-iteration-raises",
        lambda c: group(c, payloads=EvilCollection(bad_iter=True)),
        TypeError,
        "payloads",
    ),
    C(
        "group-payloads-len-raises",
        lambda c: group(c, payloads=EvilCollection(bad_len=True)),
        TypeError,
        "payloads",
    ),
    C(
        "group-payloads-len-lies",
        lambda c: group(c, payloads=LyingLen(3, ["x", "y"]), session_ids=[0, 1, 2]),
        ValueError,
        "payloads says len.. is 3 but yielded 2 items",
    ),
    C(
        "group-payloads-len-lies-in-flight",
        lambda c: group(c, "pend", payloads=LyingLen(1, ["x", "y"]), session_ids=[4]),
        ValueError,
        "payloads says len.. is 1 but yielded 2 items",
    ),
    C(
        "group-payloads-len-lies-alone",
        lambda c: group(c, payloads=LyingLen(3, ["x", "y"])),
        ValueError,
        "payloads says len.. is 3 but yielded 2 items",
    ),
    C(
        "group-session-ids-iteration-raises",
        lambda c: group(c, session_ids=EvilCollection(bad_iter=True)),
        TypeError,
        "session_ids",
    ),
    C(
        "group-indices-len-raises",
        lambda c: group(c, indices=EvilCollection(bad_len=True)),
        TypeError,
        "indices",
    ),
    C(
        "group-trajectory-tags-iteration-raises",
        lambda c: group(c, trajectory_tags=EvilCollection(bad_iter=True)),
        TypeError,
        "trajectory_tags",
    ),
    C("group-session-ids-short", lambda c: group(c, session_ids=[0]), ValueError, "session_ids has 1 items"),
    C(
        "group-trajectory-tags-long",
        lambda c: group(c, trajectory_tags=[None, None, None]),
        ValueError,
        "trajectory_tags has 3 items",
    ),
    C("group-session-negative", lambda c: group(c, session_ids=[0, -1]), ValueError, "session_id.*-1"),
    C("group-session-huge", lambda c: group(c, session_ids=[0, HUGE]), ValueError, "session_id"),
    C("group-index-bool", lambda c: group(c, indices=[0, True]), TypeError, "index.*bool"),
    C("group-index-evil-repr", lambda c: group(c, indices=[0, EvilRepr()]), TypeError, "index.*EvilRepr"),
    C("group-trajectory-tags-str", lambda c: group(c, trajectory_tags=["t", None]), TypeError, "tags.*str"),
    C(
        "group-trajectory-tags-evil",
        lambda c: group(c, trajectory_tags=[None, EvilMapping()]),
        TypeError,
        "tags",
    ),
    C("group-duplicate-keys", lambda c: group(c, session_ids=[3, 3]), DuplicateTrajectoryError, "new_3_0"),
    C(
        "group-duplicate-with-group",
        lambda c: group(c, "run", ["x"], global_steps=6, session_ids=[1]),
        DuplicateTrajectoryError,
        "run_1_0",
    ),
    C("group-other-step", lambda c: group(c, "pend", global_steps=6), DuplicateGroupError, "'pend'"),
    C("group-other-partition", lambda c: group(c, "pend", partition="val"), DuplicateGroupError, "'pend'"),
    C("group-late-finished", lambda c: group(c, "fin", session_ids=[7, 8]), InvalidTransitionError, "'fin'"),
    C(
        "group-late-failed",
        lambda c: group(c, "failr", session_ids=[7, 8]),
        InvalidTransitionError,
        "'failr'",
    ),
    C(
        "group-late-exempt",
        lambda c: group(c, "vfin", global_steps=0, partition="val", session_ids=[7, 8]),
        InvalidTransitionError,
        "'vfin'",
    ),
    C("group-status-upper", lambda c: group(c, status="FINISHED"), ValueError, "status.*'FINISHED'"),
    C("group-status-pending", lambda c: group(c, status="pending"), ValueError, "status"),
    C("group-status-running", lambda c: group(c, status=Status.RUNNING), ValueError, "status"),
    C("group-status-None", lambda c: group(c, status=None), ValueError, "status"),
    C("group-status-evil-eq", lambda c: group(c, status=EvilEq()), ValueError, "status.*EvilEq"),
    C("group-status-huge-str", lambda c: group(c, status=HUGE_STR), ValueError, "status"),
    C(
        "group-async-late",
        lambda c: c.buf.put_group("fin", ["x"], global_steps=5, session_ids=[7]),
        InvalidTransitionError,
        "'fin'",
    ),
    # -- sample / sampleable_count ---------------------------------------------------------
    C("batch-0", lambda c: c.buf.sample(6, 0), ValueError, "batch_size.*0"),
    C("batch-negative", lambda c: c.buf.sample(6, -2), ValueError, "batch_size.*-2"),
    C("batch-float", lambda c: c.buf.sample(6, 1.0), ValueError, "batch_size.*1.0"),
    C("batch-bool", lambda c: c.buf.sample(6, True), ValueError, "batch_size.*True"),
    C("batch-None", lambda c: c.buf.sample(6, None), ValueError, "batch_size.*None"),
    C("sample-step-negative", lambda c: c.buf.sample(-1, 1), ValueError, "global_steps.*-1"),
    C("sample-step-None", lambda c: c.buf.sample(None, 1), TypeError, "global_steps.*None"),
    C("sample-step-bool", lambda c: c.buf.sample(False, 1), TypeError, "global_steps.*bool"),
    C("sample-step-float", lambda c: c.buf.sample(6.0, 1), TypeError, "global_steps.*float"),
    C("sample-partition-empty", lambda c: c.buf.sample(6, 1, partition=""), ValueError, "partition"),
    C(
        "sample-partition-None",
        lambda c: c.buf.sample(6, 1, partition=None),
        TypeError,
        "partition.*NoneType",
    ),
    C("timeout-negative", lambda c: c.buf.sample(6, 1, timeout=-1), ValueError, "timeout.*-1"),
    C("timeout-nan", lambda c: c.buf.sample(6, 1, timeout=math.nan), ValueError, "timeout.*nan"),
    C("timeout-bool", lambda c: c.buf.sample(6, 1, timeout=True), ValueError, "timeout.*True"),
    C("timeout-str", lambda c: c.buf.sample(6, 1, timeout="1"), ValueError, "timeout.*'1'"),
    # huge values (items 3, 13, 14) and hostile ones (item 15)
    C("sample-step-huge", lambda c: c.buf.sample(10**400, 1), ValueError, "global_steps"),
    C("sample-step-huge-nowait", lambda c: c.buf.sample(10**400, 1, timeout=0), ValueError, "global_steps"),
    C("sample-step-2**63", lambda c: c.buf.sample(2**63, 1, timeout=0), ValueError, "global_steps"),
    C("batch-huge", lambda c: c.buf.sample(0, HUGE, timeout=0), ValueError, "batch_size.*bits"),
    C("batch-2**63", lambda c: c.buf.sample(6, 2**63), ValueError, "batch_size"),
    C("timeout-huge", lambda c: c.buf.sample(6, 1, timeout=10**400), ValueError, "timeout"),
    C("sample-step-evil-repr", lambda c: c.buf.sample(EvilRepr(), 1), TypeError, "global_steps.*EvilRepr"),
    C("batch-evil-repr", lambda c: c.buf.sample(6, EvilRepr()), ValueError, "batch_size.*EvilRepr"),
    C("timeout-evil-repr", lambda c: c.buf.sample(6, 1, timeout=EvilRepr()), ValueError, "timeout.*EvilRepr"),
    C(
        "sample-partition-evil-repr",
        lambda c: c.buf.sample(6, 1, partition=EvilRepr()),
        TypeError,
        "partition.*EvilRepr",
    ),
    # a failed sample on an unseen partition must not create it (item 17)
    C(
        "sample-unseen-partition-timeout0",
        lambda c: c.buf.sample(0, 1, partition="fresh", timeout=0),  # step 0: the clock stays
        TimeoutError,
        "'fresh'",
    ),
    C(
        "sample-huge-partition-timeout0",
        lambda c: c.buf.sample(0, 1, partition=HUGE_STR, timeout=0),
        TimeoutError,
        "partition",
    ),
    # token budgets (issue 24): exactly one of batch_size and token_budget, an int >= 1
    C("tokens-0", lambda c: c.buf.sample(6, token_budget=0), ValueError, "token_budget.*0"),
    C("tokens-negative", lambda c: c.buf.sample(6, token_budget=-3), ValueError, "token_budget.*-3"),
    C("tokens-float", lambda c: c.buf.sample(6, token_budget=100.0), TypeError, "token_budget.*float"),
    C("tokens-bool", lambda c: c.buf.sample(6, token_budget=True), TypeError, "token_budget.*bool"),
    C("tokens-str", lambda c: c.buf.sample(6, token_budget="100"), TypeError, "token_budget.*str"),
    C(
        "tokens-huge",
        lambda c: c.buf.sample(6, token_budget=HUGE, timeout=0),
        ValueError,
        "token_budget.*bits",
    ),
    C("tokens-2**63", lambda c: c.buf.sample(6, token_budget=2**63), ValueError, "token_budget"),
    C(
        "tokens-evil-repr",
        lambda c: c.buf.sample(6, token_budget=EvilRepr()),
        TypeError,
        "token_budget.*EvilRepr",
    ),
    C("tokens-and-batch", lambda c: c.buf.sample(6, 2, token_budget=100), ValueError, "exactly one"),
    C(
        "tokens-and-batch-nowait",
        lambda c: c.buf.sample_nowait(6, 2, token_budget=100),
        ValueError,
        "exactly one",
    ),
    C("tokens-neither-nowait", lambda c: c.buf.sample_nowait(6), ValueError, "exactly one.*None"),
    C("tokens-nowait-0", lambda c: c.buf.sample_nowait(6, token_budget=0), ValueError, "token_budget.*0"),
    C("tokens-bad-step", lambda c: c.buf.sample(-1, token_budget=100), ValueError, "global_steps.*-1"),
    C(
        "tokens-bad-partition",
        lambda c: c.buf.sample(6, token_budget=100, partition=""),
        ValueError,
        "partition",
    ),
    C("tokens-bad-timeout", lambda c: c.buf.sample(6, token_budget=100, timeout=-1), ValueError, "timeout"),
    C(
        "tokens-closed",
        lambda c: c.buf.sample(6, token_budget=100, timeout=0),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    C(
        "tokens-select-override",
        lambda c: NewestFirst(status_log_interval=None).sample_nowait(0, token_budget=100),
        ConfigError,
        "NewestFirst._select.*token budget",
    ),
    C("count-step-huge", lambda c: c.buf.sampleable_count(10**400), ValueError, "global_steps"),
    C(
        "count-step-evil-repr",
        lambda c: c.buf.sampleable_count(EvilRepr()),
        TypeError,
        "global_steps.*EvilRepr",
    ),
    C("count-step-negative", lambda c: c.buf.sampleable_count(-1), ValueError, "global_steps.*-1"),
    C("count-step-bool", lambda c: c.buf.sampleable_count(True), TypeError, "global_steps.*bool"),
    C("count-partition-int", lambda c: c.buf.sampleable_count(6, 5), TypeError, "partition.*int"),
    C("sample-bad-args-closed", lambda c: c.buf.sample(6, 0), ValueError, "batch_size", closed=True),
    # -- closed buffer ---------------------------------------------------------------------
    C(
        "closed-add",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=0),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    C(
        "closed-add-async",
        lambda c: c.buf.add_prompt("new", global_steps=0),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    C(
        "closed-running",
        lambda c: c.buf.mark_running_nowait("pend"),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    C(
        "closed-put",
        lambda c: c.buf.put_nowait("run", 1, session_id=9),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    C(
        "closed-put-async",
        lambda c: c.buf.put("run", 1, session_id=9),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    C("closed-finish", lambda c: c.buf.mark_finished_nowait("run"), BufferClosedError, "closed", closed=True),
    C("closed-fail", lambda c: c.buf.mark_failed("pend"), BufferClosedError, "closed", closed=True),
    C("closed-sample", lambda c: c.buf.sample(6, 1), BufferClosedError, "closed", closed=True),
    C(
        "closed-sample-nowait",
        lambda c: c.buf.sample(6, 1, timeout=0),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    C(
        "closed-sample-new-partition",
        lambda c: c.buf.sample(6, 1, partition="fresh"),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    C("closed-put-group", lambda c: group(c), BufferClosedError, "closed", closed=True),
    C(
        "closed-put-group-async",
        lambda c: c.buf.put_group("new", ["x"], global_steps=5),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    C(
        "closed-bad-uid",
        lambda c: c.buf.add_prompt_nowait("a_b", global_steps=0),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    # -- flow control: config ----------------------------------------------------------------
    C("admission-0", lambda c: SamplerConfig(admission_batch_size=0), ConfigError, "admission_batch_size.*0"),
    C(
        "admission-negative",
        lambda c: SamplerConfig(admission_batch_size=-4),
        ConfigError,
        "admission_batch_size.*-4",
    ),
    C(
        "admission-bool",
        lambda c: SamplerConfig(admission_batch_size=True),
        ConfigError,
        "admission_batch_size.*True",
    ),
    C(
        "admission-float",
        lambda c: SamplerConfig(admission_batch_size=2.0),
        ConfigError,
        "admission_batch_size.*2.0",
    ),
    C(
        "admission-str",
        lambda c: SamplerConfig(admission_batch_size="8"),
        ConfigError,
        "admission_batch_size.*'8'",
    ),
    C(
        "admission-mapping-0",
        lambda c: SamplerConfig.from_mapping({"admission_batch_size": 0}),
        ConfigError,
        "admission_batch_size",
    ),
    C(
        "evict-in-flight-str",
        lambda c: SamplerConfig(evict_stale_in_flight="yes"),
        ConfigError,
        "evict_stale_in_flight.*'yes'",
    ),
    C(
        "evict-in-flight-int",
        lambda c: SamplerConfig(evict_stale_in_flight=1),
        ConfigError,
        "evict_stale_in_flight.*1",
    ),
    C(
        "evict-in-flight-None",
        lambda c: SamplerConfig(evict_stale_in_flight=None),
        ConfigError,
        "evict_stale_in_flight.*None",
    ),
    C(
        "evict-in-flight-under-wait",
        lambda c: SamplerConfig(max_off_policy_strategy="wait", evict_stale_in_flight=True),
        ConfigError,
        "evict_stale_in_flight.*drop",
    ),
    C(
        "evict-in-flight-mapping-wait",
        lambda c: SamplerConfig.from_mapping(
            {"max_off_policy_strategy": "wait", "evict_stale_in_flight": True}
        ),
        ConfigError,
        "evict_stale_in_flight",
    ),
    # -- flow control: a full partition (BufferFullError changes nothing) --------------------
    C(
        "full-add",
        lambda c: c.buf.add_prompt_nowait("new"),
        BufferFullError,
        "dispatch step 3",
        flow=True,
    ),
    C(
        "full-add-explicit",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=3, tags={"a": 1}),
        BufferFullError,
        "dispatch step 3",
        flow=True,
    ),
    C(
        "full-add-closed-step",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=1),
        TagClosedError,
        "dispatch step 1",
        flow=True,
    ),
    C(  # issue 21 item 11: a tag ahead of the clock let residency exceed capacity()
        "full-add-future-step",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=4),
        FutureTagError,
        "dispatch step 4 of partition 'train' is ahead of its dispatch clock 3",
        flow=True,
    ),
    C(
        "full-add-future-step-async",
        lambda c: c.buf.add_prompt("new", global_steps=10**18),
        FutureTagError,
        "ahead of its dispatch clock 3",
        flow=True,
    ),
    C(
        "full-put-group-future-step",
        lambda c: c.buf.put_group("new", [1], global_steps=4),
        FutureTagError,
        "ahead of its dispatch clock 3",
        flow=True,
    ),
    C(
        "full-put-group",
        lambda c: c.buf.put_group_nowait("new", [1, 2]),
        BufferFullError,
        "step 3",
        flow=True,
    ),
    C(
        "full-put-group-explicit-failed",
        lambda c: c.buf.put_group_nowait("new", [1], global_steps=3, status="failed"),
        BufferFullError,
        "step 3",
        flow=True,
    ),
    C(
        "full-put-group-closed-step",
        lambda c: c.buf.put_group_nowait("new", [1], global_steps=0),
        TagClosedError,
        "dispatch step 0",
        flow=True,
    ),
    C("full-bad-uid-first", lambda c: c.buf.add_prompt_nowait("a_b"), ValueError, "'a_b'", flow=True),
    C(
        "full-duplicate-first",
        lambda c: c.buf.add_prompt_nowait("fa"),
        DuplicateGroupError,
        "'fa'",
        flow=True,
    ),
    C(
        "full-put-group-bad-status-first",
        lambda c: c.buf.put_group_nowait("new", [1], status="running"),
        ValueError,
        "status",
        flow=True,
    ),
    C(
        "full-put-group-bad-payloads-first",
        lambda c: c.buf.put_group_nowait("new", 5),
        TypeError,
        "payloads",
        flow=True,
    ),
    C(
        "full-put-group-other-step",
        lambda c: c.buf.put_group_nowait("fa", [1], global_steps=2),
        DuplicateGroupError,
        "'fa'",
        flow=True,
    ),
    C(
        "full-put-group-existing-duplicate",
        lambda c: c.buf.put_group_nowait("fa", [1]),
        DuplicateTrajectoryError,
        "fa_0_0",
        flow=True,
    ),
    C(
        "full-rollout-duplicate",
        lambda c: enter(c.buf.rollout("fb")),
        DuplicateGroupError,
        "'fb'",
        flow=True,
    ),
    C(
        "full-closed",
        lambda c: c.buf.add_prompt_nowait("new"),
        BufferClosedError,
        "closed",
        closed=True,
        flow=True,
    ),
    C(
        "full-closed-async",
        lambda c: c.buf.put_group("new", [1]),
        BufferClosedError,
        "closed",
        closed=True,
        flow=True,
    ),
    # -- flow control: a group evicted in flight -------------------------------------------
    C(
        "evicted-put",
        lambda c: c.buf.put_nowait("gone", 1, session_id=4),
        GroupEvictedError,
        "'gone'.*evicted as stale while in flight",
        flow=True,
    ),
    C(
        "evicted-put-async",
        lambda c: c.buf.put("gone", 1, session_id=4),
        GroupEvictedError,
        "'gone'",
        flow=True,
    ),
    C("evicted-running", lambda c: c.buf.mark_running_nowait("gone"), GroupEvictedError, "'gone'", flow=True),
    C("evicted-finish", lambda c: c.buf.mark_finished("gone"), GroupEvictedError, "'gone'", flow=True),
    C("evicted-fail", lambda c: c.buf.mark_failed_nowait("gone"), GroupEvictedError, "'gone'", flow=True),
    C(
        "evicted-put-group",
        lambda c: c.buf.put_group_nowait("gone", [1]),
        GroupEvictedError,
        "'gone'.*evicted as stale while in flight",
        flow=True,
    ),
    C("sampled-put-flow", lambda c: c.buf.put_nowait("took", 1), UnknownGroupError, "'took'", flow=True),
    # -- flow control: the new read-only calls and rollout() ---------------------------------
    C("dispatch-step-partition-int", lambda c: c.buf.dispatch_step(3), TypeError, "partition.*int"),
    C("dispatch-step-partition-empty", lambda c: c.buf.dispatch_step(""), ValueError, "partition"),
    C("capacity-partition-None", lambda c: c.buf.capacity(None), TypeError, "partition.*NoneType"),
    C("free-slots-partition-empty", lambda c: c.buf.free_slots(""), ValueError, "partition", flow=True),
    C("full-partition-bytes", lambda c: c.buf.full(b"train"), TypeError, "partition.*bytes", flow=True),
    C("rollout-uid-underscore", lambda c: enter(c.buf.rollout("a_b")), ValueError, "'a_b'"),
    C("rollout-step-negative", lambda c: enter(c.buf.rollout("new", global_steps=-1)), ValueError, "-1"),
    C("rollout-partition-int", lambda c: enter(c.buf.rollout("new", partition=2)), TypeError, "partition"),
    C("rollout-duplicate", lambda c: enter(c.buf.rollout("run")), DuplicateGroupError, "'run'"),
    C("rollout-closed", lambda c: enter(c.buf.rollout("new")), BufferClosedError, "closed", closed=True),
    # -- names UTF-8 cannot encode (issue 21, item 5): a lone surrogate breaks every later JSON,
    # log line or Prometheus scrape that shows the name, so it is refused at the source --------
    C(
        "uid-surrogate",
        lambda c: c.buf.add_prompt_nowait(SURROGATE, global_steps=0),
        ValueError,
        UTF8,
    ),
    C("uid-surrogate-inside", lambda c: c.buf.add_prompt_nowait("a\udcffb"), ValueError, UTF8),
    C(
        "uid-surrogate-async",
        lambda c: c.buf.add_prompt(SURROGATE, global_steps=5),
        ValueError,
        UTF8,
    ),
    C("group-uid-surrogate", lambda c: group(c, SURROGATE), ValueError, UTF8),
    C(
        "group-uid-surrogate-val",
        lambda c: group(c, SURROGATE, partition="val"),
        ValueError,
        UTF8,
    ),
    C("group-uid-surrogate-sessions", lambda c: group(c, SURROGATE, session_ids=[0, 1]), ValueError, UTF8),
    C("group-uid-surrogate-failed", lambda c: group(c, SURROGATE, status="failure"), ValueError, UTF8),
    C(
        "group-uid-surrogate-async",
        lambda c: c.buf.put_group(SURROGATE, ["x"], global_steps=5),
        ValueError,
        UTF8,
    ),
    C("rollout-uid-surrogate", lambda c: enter(c.buf.rollout(SURROGATE)), ValueError, UTF8),
    C(
        "full-surrogate-uid-first",
        lambda c: c.buf.add_prompt_nowait(SURROGATE),
        ValueError,
        UTF8,
        flow=True,
    ),
    C(
        "partition-surrogate",
        lambda c: c.buf.add_prompt_nowait("new", partition=SURROGATE),
        ValueError,
        "partition.*" + UTF8,
    ),
    C(
        "partition-surrogate-huge",
        lambda c: c.buf.add_prompt_nowait("new", partition=HUGE_STR + SURROGATE),
        ValueError,
        "partition.*" + UTF8,
    ),
    C("group-partition-surrogate", lambda c: group(c, partition=SURROGATE), ValueError, "partition.*" + UTF8),
    C(
        "group-partition-surrogate-async",
        lambda c: c.buf.put_group("new", ["x"], partition="\ud800"),
        ValueError,
        "partition.*" + UTF8,
    ),
    C(
        "sample-partition-surrogate",
        lambda c: c.buf.sample(6, 1, partition=SURROGATE),
        ValueError,
        "partition.*" + UTF8,
    ),
    C(
        "sample-nowait-partition-surrogate",
        lambda c: c.buf.sample_nowait(6, 1, partition=SURROGATE),
        ValueError,
        "partition.*" + UTF8,
    ),
    C("count-partition-surrogate", lambda c: c.buf.sampleable_count(6, SURROGATE), ValueError, UTF8),
    C("dispatch-step-partition-surrogate", lambda c: c.buf.dispatch_step(SURROGATE), ValueError, UTF8),
    C("capacity-partition-surrogate", lambda c: c.buf.capacity(SURROGATE), ValueError, UTF8, flow=True),
    C("free-slots-partition-surrogate", lambda c: c.buf.free_slots(SURROGATE), ValueError, UTF8, flow=True),
    C("full-partition-surrogate", lambda c: c.buf.full(SURROGATE), ValueError, UTF8, flow=True),
    C(
        "rollout-partition-surrogate",
        lambda c: enter(c.buf.rollout("new", partition=SURROGATE)),
        ValueError,
        "partition.*" + UTF8,
    ),
    # -- versions and tokens (issue 22): every new parameter, nothing changed ----------------
    *(
        C(f"put-versions-{name}", lambda c, bad=bad: put_versions(c, bad), error, match)
        for name, bad, error, match in (
            ("str", "ab", TypeError, "versions must be a sequence.*str"),
            ("bytes", b"ab", TypeError, "versions must be a sequence.*bytes"),
            ("dict", {1: 2}, TypeError, "versions must be a sequence.*dict"),
            ("set", {(1, 2)}, TypeError, "versions must be a sequence.*set"),
            ("int", 5, TypeError, "versions must be a sequence.*int"),
            ("empty", [], ValueError, "versions must hold at least one"),
            ("empty-tuple", (), ValueError, "versions must hold at least one"),
            ("one-item", [(1,)], ValueError, r"versions\[0\].*pair.*1 items"),
            ("three-items", [(1, 2, 3)], ValueError, r"versions\[0\].*pair.*3 items"),
            ("not-a-pair", [1, 2], TypeError, r"versions\[0\].*pair.*int"),
            ("str-pair", ["ab"], TypeError, r"versions\[0\].*pair.*str"),
            ("None-pair", [None], TypeError, r"versions\[0\]"),
            ("negative-version", [(-1, 3)], ValueError, r"versions\[0\]'s version.*-1"),
            ("zero-tokens", [(1, 0)], ValueError, r"versions\[0\]'s n_tokens.*0"),
            ("negative-tokens", [(1, -2)], ValueError, r"versions\[0\]'s n_tokens.*-2"),
            ("bool-version", [(True, 1)], TypeError, r"versions\[0\]'s version.*bool"),
            ("bool-count", [(1, True)], TypeError, r"versions\[0\]'s n_tokens.*bool"),
            ("float-version", [(1.5, 2)], TypeError, r"versions\[0\]'s version.*float"),
            ("float-count", [(1, 2.0)], TypeError, r"versions\[0\]'s n_tokens.*float"),
            ("str-version", [("1", 2)], TypeError, r"versions\[0\]'s version.*str"),
            ("evil-version", [(EvilRepr(), 2)], TypeError, r"versions\[0\]'s version.*EvilRepr"),
            ("huge-version", [(2**63, 1)], ValueError, r"versions\[0\]'s version"),
            ("huge-count", [(1, 2**63)], ValueError, r"versions\[0\]'s n_tokens"),
            ("enormous-version", [(HUGE, 1)], ValueError, r"versions\[0\]'s version"),
            ("total-overflow", [(0, 2**62), (1, 2**62)], ValueError, r"more than 2\*\*63 - 1 tokens"),
            ("second-pair-bad", [(1, 2), (3, 0)], ValueError, r"versions\[1\]'s n_tokens"),
        )
    ),
    C(
        "put-versions-generator-bad-later",
        lambda c: put_versions(c, ((v, n) for v, n in ((1, 2), (-3, 1)))),
        ValueError,
        r"versions\[1\]'s version.*-3",
    ),
    C("put-versions-iteration-raises", lambda c: put_versions(c, raising_pairs()), RuntimeError, "evil iter"),
    *(
        C(
            f"put-tokens-{name}",
            lambda c, bad=bad: c.buf.put_nowait("run", "x", session_id=5, tokens=bad),
            e,
            m,
        )
        for name, bad, e, m in (
            ("negative", -1, ValueError, "tokens.*-1"),
            ("float", 1.0, TypeError, "tokens.*float"),
            ("bool", True, TypeError, "tokens.*bool"),
            ("str", "3", TypeError, "tokens.*str"),
            ("huge", 2**63, ValueError, "tokens"),
            ("enormous", HUGE, ValueError, "tokens"),
        )
    ),
    C(
        "put-tokens-disagree",
        lambda c: c.buf.put_nowait("run", "x", session_id=5, versions=[(0, 2)], tokens=3),
        ValueError,
        "tokens=3 but versions hold 2 tokens",
    ),
    C(
        "put-tokens-disagree-zero",
        lambda c: c.buf.put_nowait("run", "x", session_id=5, versions=[(0, 2)], tokens=0),
        ValueError,
        "tokens=0 but versions hold 2",
    ),
    C(
        "put-async-versions-bad",
        lambda c: c.buf.put("run", "x", session_id=5, versions=[(0, 0)]),
        ValueError,
        "n_tokens",
    ),
    C(
        "put-versions-bad-to-ghost",  # the arguments are checked first
        lambda c: c.buf.put_nowait("ghost", versions=[(-1, 1)]),
        ValueError,
        "version",
    ),
    C(
        "put-versions-closed",
        lambda c: c.buf.put_nowait("run", "x", session_id=5, versions=[(0, 1)]),
        BufferClosedError,
        "closed",
        closed=True,
    ),
    *(
        C(f"{where}-version-{name}", lambda c, call=call, bad=bad: call(c, bad), error, match)
        for where, call in (
            ("running", lambda c, v: c.buf.mark_running_nowait("pend", version=v)),
            ("running-async", lambda c, v: c.buf.mark_running("pend", version=v)),
            ("running-already", lambda c, v: c.buf.mark_running_nowait("run", version=v)),
            ("group-new", lambda c, v: group(c, version=v)),
            ("group-new-versions", lambda c, v: group(c, version=v, versions=[[(5, 1)], None])),
            ("group-in-flight", lambda c, v: group(c, "pend", ["q"], session_ids=[4], version=v)),
            ("group-async", lambda c, v: c.buf.put_group("new", ["x"], global_steps=5, version=v)),
            ("rollout", lambda c, v: c.buf.rollout("new", version=v)),
        )
        for name, bad, error, match in (
            ("negative", -1, ValueError, "version.*-1"),
            ("str", "3", TypeError, "version must be an int.*str"),
            ("bool", True, TypeError, "version must be an int.*bool"),
            ("float", 3.0, TypeError, "version must be an int.*float"),
            ("huge", 2**63, ValueError, "version"),
        )
    ),
    *(
        C(f"group-{name}", lambda c, kwargs=kwargs: group(c, **kwargs), error, match)
        for name, kwargs, error, match in (
            ("versions-short", {"versions": [[(5, 1)]]}, ValueError, "versions has 1 items for 2 payloads"),
            ("versions-long", {"versions": [None, None, None]}, ValueError, "versions has 3 items for 2"),
            ("tokens-short", {"tokens": [1]}, ValueError, "tokens has 1 items for 2 payloads"),
            ("tokens-long", {"tokens": [1, 2, 3]}, ValueError, "tokens has 3 items"),
            (
                "versions-str",
                {"versions": "ab"},
                TypeError,
                "versions must hold one item per trajectory.*str",
            ),
            ("versions-dict", {"versions": {0: [(1, 1)]}}, TypeError, "versions must hold one item.*dict"),
            ("versions-int", {"versions": 3}, TypeError, "versions must hold one item.*int"),
            ("tokens-int", {"tokens": 3}, TypeError, "tokens must hold one item.*int"),
            ("tokens-bytes", {"tokens": b"ab"}, TypeError, "tokens must hold one item.*bytes"),
            ("versions-entry-empty", {"versions": [[(5, 1)], []]}, ValueError, "trajectory 1's versions"),
            ("versions-entry-bad", {"versions": [[(5, 0)], None]}, ValueError, "trajectory 0's versions"),
            ("versions-entry-str", {"versions": [None, "ab"]}, TypeError, "trajectory 1's versions"),
            ("tokens-entry-negative", {"tokens": [None, -1]}, ValueError, "trajectory 1's tokens.*-1"),
            ("tokens-entry-bool", {"tokens": [True, None]}, TypeError, "trajectory 0's tokens.*bool"),
            ("tokens-entry-float", {"tokens": [1.0, None]}, TypeError, "trajectory 0's tokens.*float"),
            (
                "tokens-disagree",
                {"versions": [[(5, 2)], None], "tokens": [3, None]},
                ValueError,
                "trajectory 0's tokens=3 but trajectory 0's versions hold 2",
            ),
            ("versions-iteration-raises", {"versions": EvilCollection(bad_iter=True)}, RuntimeError, "evil"),
            ("versions-len-lies", {"versions": LyingLen(2, [None])}, ValueError, "versions has 1 items"),
        )
    ),
    C(
        "group-in-flight-versions-bad",
        lambda c: group(c, "run", ["q"], session_ids=[4], versions=[[(1, 0)]]),
        ValueError,
        "trajectory 0's versions",
    ),
    C(
        "group-late-with-versions",
        lambda c: group(c, "fin", ["q"], session_ids=[7], versions=[[(1, 1)]], version=3),
        InvalidTransitionError,
        "'fin'",
    ),
    C(
        "group-full-with-version",
        lambda c: c.buf.put_group_nowait("new", ["x"], version=0),
        BufferFullError,
        "dispatch step 3",
        flow=True,
    ),
    # -- group filters (issue 23) ------------------------------------------------------------
    C("filters-str", lambda c: ReplayBuffer(filters="zero_variance"), ConfigError, "filters.*str"),
    C("filters-one-callable", lambda c: ReplayBuffer(filters=_keep), ConfigError, "filters.*function"),
    C("filters-int-entry", lambda c: ReplayBuffer(filters=[1]), ConfigError, r"filters\[0\].*callable"),
    C(
        "filters-async-entry",
        lambda c: ReplayBuffer(filters=[_async_filter]),
        ConfigError,
        r"filters\[0\].*async",
    ),
    C("filters-None-entry", lambda c: ReplayBuffer(filters=[_keep, None]), ConfigError, r"filters\[1\]"),
    C("filters-None", lambda c: ReplayBuffer(filters=None), ConfigError, "filters"),  # type: ignore[arg-type]
    C(
        "filters-from-config-str",
        lambda c: ReplayBuffer.from_config(SamplerConfig(), filters="x"),
        ConfigError,
        "filters",
    ),
    C("filters-restore-int-entry", lambda c: restore(c, filters=[1]), ConfigError, r"filters\[0\]"),
    C("zero-variance-empty-tag", lambda c: zero_variance(""), ConfigError, "zero_variance"),
    C("zero-variance-int", lambda c: zero_variance(3), ConfigError, "zero_variance"),  # type: ignore[arg-type]
    C("min-trajectories-0", lambda c: min_trajectories(0), ConfigError, "min_trajectories"),
    C("min-trajectories-float", lambda c: min_trajectories(1.5), ConfigError, "min_trajectories"),  # type: ignore[arg-type]
    C(
        "filter-groups-metric-empty",
        lambda c: SamplerConfig(filter_groups_metric=""),
        ConfigError,
        "filter_groups_metric",
    ),
    C(
        "filter-groups-metric-int",
        lambda c: SamplerConfig(filter_groups_metric=3),
        ConfigError,
        "filter_groups_metric.*3",
    ),
    C(
        "filter-groups-metric-mapping",
        lambda c: SamplerConfig.from_mapping({"filter_groups_metric": ""}),
        ConfigError,
        "filter_groups_metric",
    ),
    # -- task mixtures (issue 23) --------------------------------------------------------------
    C("mixture-empty", lambda c: SamplerConfig(mixture={}), ConfigError, "mixture"),
    C("mixture-empty-name", lambda c: SamplerConfig(mixture={"": 1}), ConfigError, "mixture keys.*''"),
    C("mixture-int-name", lambda c: SamplerConfig(mixture={1: 1}), ConfigError, "mixture keys.*1"),
    C("mixture-weight-0", lambda c: SamplerConfig(mixture={"a": 0}), ConfigError, r"mixture\['a'\].*0"),
    C(
        "mixture-weight-negative",
        lambda c: SamplerConfig(mixture={"a": -1}),
        ConfigError,
        r"mixture\['a'\].*-1",
    ),
    C("mixture-weight-nan", lambda c: SamplerConfig(mixture={"a": math.nan}), ConfigError, r"mixture\['a'\]"),
    C("mixture-weight-inf", lambda c: SamplerConfig(mixture={"a": math.inf}), ConfigError, r"mixture\['a'\]"),
    C(
        "mixture-weight-bool",
        lambda c: SamplerConfig(mixture={"a": True}),
        ConfigError,
        r"mixture\['a'\].*True",
    ),
    C("mixture-weight-str", lambda c: SamplerConfig(mixture={"a": "1"}), ConfigError, r"mixture\['a'\].*'1'"),
    C(
        "mixture-weight-huge-int",
        lambda c: SamplerConfig(mixture={"a": HUGE, "b": 1}),
        ConfigError,
        r"mixture\['a'\]",
    ),
    C("mixture-list", lambda c: SamplerConfig(mixture=[("a", 1)]), ConfigError, "mixture must be a mapping"),
    C("mixture-evil-mapping", lambda c: SamplerConfig(mixture=EvilMapping()), ConfigError, "mixture"),
    C(
        "mixture-mapping-weight-0",
        lambda c: SamplerConfig.from_mapping({"mixture": {"a": 0}}),
        ConfigError,
        "mixture",
    ),
    C("mixture-tag-empty", lambda c: mix(mixture_tag=""), ConfigError, "mixture_tag"),
    C("mixture-tag-int", lambda c: mix(mixture_tag=3), ConfigError, "mixture_tag.*3"),
    C("mixture-policy-typo", lambda c: mix(mixture_policy="x"), ConfigError, "mixture_policy.*'x'"),
    C("mixture-policy-None", lambda c: mix(mixture_policy=None), ConfigError, "mixture_policy"),
    C(
        "task-thresholds-0",
        lambda c: mix(task_thresholds={"math": 0}),
        ConfigError,
        r"task_thresholds\['math'\].*0",
    ),
    C(
        "task-thresholds-float",
        lambda c: mix(task_thresholds={"math": 1.5}),
        ConfigError,
        r"task_thresholds\['math'\]",
    ),
    C(
        "task-thresholds-bool",
        lambda c: mix(task_thresholds={"math": True}),
        ConfigError,
        r"task_thresholds\['math'\]",
    ),
    C(
        "task-thresholds-2-63",
        lambda c: mix(task_thresholds={"math": 2**63}),
        ConfigError,
        r"task_thresholds\['math'\]",
    ),
    C(
        "task-thresholds-unknown-task",
        lambda c: mix(task_thresholds={"art": 2}),
        ConfigError,
        "task_thresholds.*'art'",
    ),
    C(
        "task-thresholds-without-mixture",
        lambda c: SamplerConfig(task_thresholds={"a": 2}),
        ConfigError,
        "task_thresholds.*mixture",
    ),
    C(
        "task-thresholds-list",
        lambda c: mix(task_thresholds=[("math", 2)]),
        ConfigError,
        "task_thresholds must be a mapping",
    ),
    C("mixture-huge-name-weight-0", lambda c: SamplerConfig(mixture={HUGE_STR: 0}), ConfigError, "mixture"),
    C(
        "task-thresholds-huge-name",
        lambda c: SamplerConfig(mixture={HUGE_STR: 1}, task_thresholds={HUGE_STR: 0}),
        ConfigError,
        "task_thresholds",
    ),
    C(
        "mixture-huge-name-missing-task",
        lambda c: ReplayBuffer(SamplerConfig(mixture={HUGE_STR: 1})).add_prompt_nowait("x"),
        ValueError,
        "no tag 'task'",
    ),
    C(
        "mixture-huge-tag-missing-task",
        lambda c: ReplayBuffer(SamplerConfig(mixture={"a": 1}, mixture_tag=HUGE_STR)).add_prompt_nowait("x"),
        ValueError,
        "no tag",
    ),
    C(
        "mixture-huge-name-unknown-task-arg",
        lambda c: ReplayBuffer(SamplerConfig(mixture={HUGE_STR: 1})).free_slots(task="a"),
        ValueError,
        "task 'a'",
    ),
    C(
        "mixture-admission-quota-0",
        lambda c: SamplerConfig(mixture={"a": 1, "b": 1, "c": 1}, admission_batch_size=2),
        ConfigError,
        "admission_batch_size.*'c'",
    ),
    C("capacity-task-no-mixture", lambda c: c.buf.capacity(task="math"), ValueError, "task 'math'"),
    C("free-slots-task-no-mixture", lambda c: c.buf.free_slots(task="math"), ValueError, "task 'math'"),
    C("full-task-no-mixture", lambda c: c.buf.full(task="math"), ValueError, "task 'math'"),
    C(
        "sampleable-count-task-no-mixture",
        lambda c: c.buf.sampleable_count(0, task="math"),
        ValueError,
        "task",
    ),
    C("capacity-task-unknown", lambda c: c.buf.capacity(task="art"), ValueError, "task 'art'", mixed=True),
    C("free-slots-task-int", lambda c: c.buf.free_slots(task=3), TypeError, "task.*int", mixed=True),
    C("full-task-bytes", lambda c: c.buf.full(task=b"math"), TypeError, "task.*bytes", mixed=True),
    C(
        "sampleable-count-task-empty",
        lambda c: c.buf.sampleable_count(0, task=""),
        ValueError,
        "task ''",
        mixed=True,
    ),
    C("capacity-task-exempt", lambda c: c.buf.capacity("val", task="math"), ValueError, "'val'", mixed=True),
    C(
        "free-slots-task-exempt",
        lambda c: c.buf.free_slots("val", task="math"),
        ValueError,
        "'val'",
        mixed=True,
    ),
    C("full-task-exempt", lambda c: c.buf.full("val", task="code"), ValueError, "'val'", mixed=True),
    C(
        "sampleable-count-task-exempt",
        lambda c: c.buf.sampleable_count(0, "val", task="math"),
        ValueError,
        "'val'",
        mixed=True,
    ),
    C("mixed-add-prompt-no-task", lambda c: c.buf.add_prompt_nowait("new"), ValueError, "task", mixed=True),
    C(
        "mixed-add-prompt-unknown-task",
        lambda c: c.buf.add_prompt_nowait("new", tags={"task": "art"}),
        ValueError,
        "'art'",
        mixed=True,
    ),
    C(
        "mixed-add-prompt-async-no-task",
        lambda c: c.buf.add_prompt("new", tags={"kind": "math"}),
        ValueError,
        "task",
        mixed=True,
    ),
    C(
        "mixed-add-prompt-new-partition",
        lambda c: c.buf.add_prompt_nowait("new", partition="aux"),
        ValueError,
        "task",
        mixed=True,
    ),
    C(
        "mixed-put-group-int-task",
        lambda c: c.buf.put_group_nowait("new", ["x"], tags={"task": 1}),
        ValueError,
        "task",
        mixed=True,
    ),
    C(
        "mixed-put-group-async-no-task",
        lambda c: c.buf.put_group("new", ["x"], status="failed"),
        ValueError,
        "task",
        mixed=True,
    ),
    C("mixed-rollout-no-task", lambda c: enter(c.buf.rollout("new")), ValueError, "task", mixed=True),
    C(
        "mixed-sample-quota-0",
        lambda c: c.buf.sample(0, 1, timeout=0),
        ValueError,
        "batch_size=1.*'code'",
        mixed=True,
    ),
    C("mixed-sample-nowait-quota-0", lambda c: c.buf.sample_nowait(0, 1), ValueError, "'code'", mixed=True),
    C(
        "mixed-sample-tokens",
        lambda c: c.buf.sample(0, token_budget=100, timeout=0),
        ConfigError,
        "task mixture.*token budget",
        mixed=True,
    ),
    C(
        "mixed-sample-nowait-tokens",
        lambda c: c.buf.sample_nowait(0, token_budget=100),
        ConfigError,
        "task mixture",
        mixed=True,
    ),
    C(
        "mixed-sample-tokens-new-partition",
        lambda c: c.buf.sample(0, token_budget=100, partition="aux", timeout=0),
        ConfigError,
        "'aux' has a task mixture",
        mixed=True,
    ),
    C(
        "mixed-sample-new-partition-quota-0",
        lambda c: c.buf.sample(0, 1, partition="aux", timeout=0),
        ValueError,
        "'code'",
        mixed=True,
    ),
    # -- Batch.split (a batch the trainer holds: nothing in the buffer takes part) -------------
    C("split-n-0", lambda c: split(c, 0), ValueError, "n must be an int >= 1.*got 0"),
    C("split-n-negative", lambda c: split(c, -2), ValueError, "n must.*-2"),
    C("split-n-bool", lambda c: split(c, True), TypeError, "n must be an int.*bool"),
    C("split-n-float", lambda c: split(c, 2.0), TypeError, "n must be an int.*float"),
    C("split-n-None", lambda c: split(c, None), TypeError, "n must be an int.*NoneType"),
    C("split-n-numpy", lambda c: split(c, np.int64(2)), TypeError, "n must be an int.*int64"),
    C("split-n-huge", lambda c: split(c, HUGE), ValueError, "n must.*bits"),
    C("split-n-2**63", lambda c: split(c, 2**63), ValueError, "n must.*2\\*\\*63"),
    C("split-n-evil-repr", lambda c: split(c, EvilRepr()), TypeError, "n must.*EvilRepr"),
    C("split-n-positional-cost", lambda c: split(c, 2, "tokens"), TypeError, "positional"),
    C("split-cost-unknown", lambda c: split(c, 2, cost="cubic"), ValueError, "cost must be one of.*'cubic'"),
    C("split-cost-case", lambda c: split(c, 2, cost="Tokens"), ValueError, "cost.*'Tokens'"),
    C("split-cost-None", lambda c: split(c, 2, cost=None), TypeError, "cost must be one of.*NoneType"),
    C("split-cost-evil-repr", lambda c: split(c, 2, cost=EvilRepr()), TypeError, "cost.*EvilRepr"),
    C("split-cost-huge-str", lambda c: split(c, 2, cost=HUGE_STR), ValueError, "cost.*'xxx"),
    C("split-cost-surrogate", lambda c: split(c, 2, cost=SURROGATE), ValueError, "cost must be one of"),
    C("split-by-unknown", lambda c: split(c, 2, by="token"), ValueError, "by must be one of.*'token'"),
    C("split-by-groups", lambda c: split(c, 2, by="groups"), ValueError, "by.*'group', 'trajectory'"),
    C("split-by-int", lambda c: split(c, 2, by=1), TypeError, "by must be one of.*int"),
    C("split-by-bytes", lambda c: split(c, 2, by=b"group"), TypeError, "by.*bytes"),
    # -- token admission (issue 24): config -----------------------------------------------------
    C("token-budget-0", lambda c: tok(admission_token_budget=0), ConfigError, "admission_token_budget.*0"),
    C(
        "token-budget-bool",
        lambda c: tok(admission_token_budget=True),
        ConfigError,
        "admission_token_budget.*True",
    ),
    C(
        "token-budget-str",
        lambda c: tok(admission_token_budget="100"),
        ConfigError,
        "admission_token_budget.*'100'",
    ),
    C("token-m-0", lambda c: SamplerConfig(max_tokens_per_group=0), ConfigError, "max_tokens_per_group.*0"),
    C(
        "token-m-float",
        lambda c: SamplerConfig(max_tokens_per_group=2.0),
        ConfigError,
        "max_tokens_per_group.*2.0",
    ),
    C(
        "token-resident-negative",
        lambda c: SamplerConfig(max_tokens_per_group=1, max_resident_tokens=-5),
        ConfigError,
        "max_resident_tokens.*-5",
    ),
    C(
        "token-budget-without-m",
        lambda c: SamplerConfig(admission_token_budget=100),
        ConfigError,
        "needs max_tokens_per_group",
    ),
    C(
        "token-m-above-budget",
        lambda c: tok(max_tokens_per_group=101),
        ConfigError,
        "must be <= admission_token_budget",
    ),
    C("token-budget-and-groups", lambda c: tok(admission_batch_size=4), ConfigError, "exclusive"),
    C(
        "token-budget-no-threshold",
        lambda c: tok(max_off_policy_threshold=None),
        ConfigError,
        "admission_token_budget needs a max_off_policy_threshold",
    ),
    C(
        "token-resident-without-m",
        lambda c: SamplerConfig(max_resident_tokens=100),
        ConfigError,
        "max_resident_tokens needs max_tokens_per_group",
    ),
    C(
        "token-resident-below-m",
        lambda c: SamplerConfig(max_tokens_per_group=10, max_resident_tokens=9),
        ConfigError,
        "must be >= max_tokens_per_group",
    ),
    C("token-budget-mixture", lambda c: tok(mixture={"a": 1, "b": 1}), ConfigError, "task mixture"),
    C(
        "token-mapping-0",
        lambda c: SamplerConfig.from_mapping({"max_tokens_per_group": 0}),
        ConfigError,
        "max_tokens_per_group",
    ),
    C(
        "token-policy-admits",
        lambda c: ReplayBuffer(tok(), policy=CountingAdmits(tok())),
        ConfigError,
        "CountingAdmits overrides admits",
    ),
    # -- token admission: calls (against populated_tokens) ------------------------------------
    C(
        "token-put-past-m",
        lambda c: c.buf.put_nowait("ta", "x", session_id=1, tokens=51),
        ValueError,
        "61 tokens.*max_tokens_per_group=60",
        tokens=True,
    ),
    C(
        "token-put-versions-past-m",
        lambda c: c.buf.put_nowait("ta", "x", session_id=1, versions=[(0, 40), (1, 11)]),
        ValueError,
        "max_tokens_per_group=60",
        tokens=True,
    ),
    C(
        "token-put-async-past-m",
        lambda c: c.buf.put("ta", "x", session_id=1, tokens=51),
        ValueError,
        "max_tokens_per_group=60",
        tokens=True,
    ),
    C(
        "token-group-into-past-m",
        lambda c: c.buf.put_group_nowait("ta", ["x"], global_steps=0, session_ids=[1], tokens=[51]),
        ValueError,
        "max_tokens_per_group=60",
        tokens=True,
    ),
    C(
        "token-group-new-past-m",
        lambda c: c.buf.put_group_nowait("new", ["x", "y"], tokens=[40, 21]),
        ValueError,
        "61 tokens, more than max_tokens_per_group=60",
        tokens=True,
    ),
    C(
        "token-group-new-past-m-async",
        lambda c: c.buf.put_group("new", ["x", "y"], tokens=[40, 21]),
        ValueError,
        "max_tokens_per_group=60",
        tokens=True,
    ),
    C(
        "token-full-add-prompt",
        lambda c: c.buf.add_prompt_nowait("new"),
        BufferFullError,
        "room for 10 more tokens at dispatch step 0",
        tokens=True,
    ),
    C(
        "token-full-put-group",
        lambda c: c.buf.put_group_nowait("new", ["x"], tokens=[11]),
        BufferFullError,
        "the group needs 11",
        tokens=True,
    ),
    C(
        "token-future-tag",
        lambda c: c.buf.add_prompt_nowait("new", global_steps=1),
        FutureTagError,
        "ahead of its dispatch clock",
        tokens=True,
    ),
    C(
        "token-count-sample",
        lambda c: c.buf.sample_nowait(0, 1),
        ValueError,
        "admission counts tokens",
        tokens=True,
    ),
    C(
        "token-count-sample-async",
        lambda c: c.buf.sample(0, 1, timeout=0),
        ValueError,
        "admission counts tokens",
        tokens=True,
    ),
    C("token-free-tokens-partition", lambda c: c.buf.free_tokens(""), ValueError, "partition", tokens=True),
    C("token-capacity-tokens-type", lambda c: c.buf.capacity_tokens(7), TypeError, "partition", tokens=True),
)


def split(c: Ctx, *args: Any, **kwargs: Any) -> object:
    """``Batch.split`` of a batch of two groups (3 and 5 tokens) built from records."""
    trajectories = [
        Trajectory(f"s{i}_0_0", 0, 0, EMPTY_TAGS, None, (), tokens) for i, tokens in enumerate((3, 5))
    ]
    groups = tuple(
        Group(f"s{i}", "train", 5, Status.FINISHED, EMPTY_TAGS, (t,)) for i, t in enumerate(trajectories)
    )
    return Batch("train", 5, groups).split(*args, **kwargs)


def raising_pairs() -> Iterator[tuple[int, int]]:
    """Valid ``(version, n_tokens)`` pairs, then an error from the iteration itself."""
    yield (1, 2)
    raise RuntimeError("evil iter")


def put_versions(c: Ctx, versions: Any) -> str:
    """``put_nowait`` into the RUNNING group "run" (whose head is 4: see :func:`populated`)."""
    return c.buf.put_nowait("run", "x", session_id=5, versions=versions)


# -- the populated buffer ---------------------------------------------------------------


async def populated() -> ReplayBuffer:
    """The buffer every row runs against (see the module docstring)."""
    config = SamplerConfig(max_off_policy_threshold=1, failure_strategy="evict")
    buf = ReplayBuffer(config, status_log_interval=None)
    for uid, step, outcome, sessions in (
        ("old", 0, "finish", 2),
        ("oldfail", 5, "fail", 1),
        ("took", 5, "finish", 2),
    ):
        buf.add_prompt_nowait(uid, global_steps=step)
        buf.mark_running_nowait(uid)
        for session in range(sessions):
            buf.put_nowait(uid, {"session": session}, session_id=session)
        (buf.mark_finished_nowait if outcome == "finish" else buf.mark_failed_nowait)(uid)
    batch, _ = await buf.sample(5, 1, timeout=0)
    assert batch.uids == ["took"]
    buf.add_prompt_nowait("fin", global_steps=5, tags={"kind": "math"})
    buf.put_nowait("fin", "a", session_id=0, tags={"reward": 1.0})
    buf.put_nowait("fin", "b", session_id=1)
    buf.mark_finished_nowait("fin")
    buf.add_prompt_nowait("failr", global_steps=5)
    buf.mark_failed_nowait("failr")
    buf.add_prompt_nowait("pend", global_steps=5)
    buf.put_nowait("pend", "p", session_id=0, tokens=3)
    buf.add_prompt_nowait("run", global_steps=6)
    buf.mark_running_nowait("run")
    buf.put_nowait("run", "r0", session_id=0)
    buf.put_nowait("run", "r1", session_id=1, versions=[(4, 2), (6, 1)])  # its head is 4
    for uid, failed in (("vfin", False), ("vfail", True)):
        buf.add_prompt_nowait(uid, global_steps=0, partition="val")
        buf.put_nowait(uid, uid)
        (buf.mark_failed_nowait if failed else buf.mark_finished_nowait)(uid)
    return buf


async def populated_flow() -> ReplayBuffer:
    """The buffer of the ``flow=True`` rows (see the module docstring)."""
    config = SamplerConfig(max_off_policy_threshold=2, admission_batch_size=2, evict_stale_in_flight=True)
    buf = ReplayBuffer(config, status_log_interval=None)
    buf.add_prompt_nowait("gone")  # tagged 0 by the clock
    buf.mark_running_nowait("gone")
    buf.put_nowait("gone", "g0")
    with pytest.raises(TimeoutError):  # moves the clock to 2: evicts "gone" in flight (s = 3 > 2)
        await buf.sample(2, 1, timeout=0)
    buf.put_group_nowait("took", ["t0", "t1"], global_steps=2)  # at the clock, not ahead of it
    batch, _ = await buf.sample(3, 1, timeout=0)
    assert batch.uids == ["took"]
    buf.add_prompt_nowait("fa")  # tagged 3 by the clock
    buf.mark_running_nowait("fa")
    buf.put_nowait("fa", "a0")
    buf.put_group_nowait("fb", ["b0"])
    buf.put_group_nowait("vfin", ["v0"], partition="val")
    return buf


async def populated_tokens() -> ReplayBuffer:
    """The buffer of the ``tokens=True`` rows (see the module docstring)."""
    buf = ReplayBuffer(tok(max_resident_tokens=150), status_log_interval=None)
    buf.add_prompt_nowait("ta")  # reserves 60 at step 0
    buf.mark_running_nowait("ta")
    buf.put_nowait("ta", "a0", tokens=10)
    buf.put_group_nowait("tb", ["b0"], tokens=[30])  # 90 at step 0: 10 left there
    buf.put_group_nowait("vfin", ["v0"], partition="val")
    return buf


async def populated_mixed() -> ReplayBuffer:
    """The buffer of the ``mixed=True`` rows (see the module docstring)."""
    config = SamplerConfig(max_off_policy_threshold=2, admission_batch_size=3, mixture={"math": 2, "code": 1})
    buf = ReplayBuffer(config, status_log_interval=None)
    buf.put_group_nowait("m0", ["a"], tags={"task": "math"})
    buf.put_group_nowait("m1", ["b"], tags={"task": "math"})
    buf.add_prompt_nowait("c0", tags={"task": "code"})
    buf.mark_running_nowait("c0")
    buf.put_nowait("c0", "c")
    buf.put_group_nowait("v0", ["v"], partition="val")
    return buf


# -- the tests -------------------------------------------------------------------------------


async def invoke(case: Case, ctx: Ctx) -> None:
    result = case.call(ctx)
    if inspect.isawaitable(result):
        await result


def rows(cases: tuple[Case, ...]) -> list[Any]:
    """The table as parameters, each with its id."""
    return [pytest.param(case, id=case.id) for case in cases]


@pytest.mark.parametrize("case", rows(CASES))
async def test_bad_input_raises_and_changes_nothing(case: Case, tmp_path: Path) -> None:
    with anyio.fail_after(LIMIT):
        buf = await (
            populated_tokens()
            if case.tokens
            else populated_mixed()
            if case.mixed
            else populated_flow()
            if case.flow
            else populated()
        )
        if case.closed:
            buf.close()
        before = full_snapshot(buf)
        with pytest.raises(case.error, match=case.match) as info:
            await invoke(case, Ctx(buf, tmp_path))
        assert type(info.value) is case.error, (
            f"raised {type(info.value).__name__}, not {case.error.__name__}"
        )
        assert len(str(info.value)) <= MAX_MESSAGE, f"a message of {len(str(info.value))} characters"
        assert full_snapshot(buf) == before, "a failed call changed the buffer"
        # the buffer still works for legal calls afterwards
        if case.tokens and not case.closed:
            buf.mark_finished_nowait("ta")  # settles to 10: 40 at step 0
            assert (buf.free_tokens(), buf.stats().partitions["train"].resident_tokens) == (60, 40)
            buf.add_prompt_nowait("after")
            assert_conserved(buf)
        elif case.mixed and not case.closed:
            buf.mark_finished_nowait("c0")
            batch, _ = await buf.sample(0, 3, timeout=0)
            assert batch.uids == ["m0", "m1", "c0"]  # math 2, code 1
            assert "aux" not in buf.stats().partitions
            assert_conserved(buf)
        elif case.flow and not case.closed:
            buf.mark_finished_nowait("fa")
            batch, _ = await buf.sample(3, 2, timeout=0)
            assert batch.uids == ["fa", "fb"]
            assert buf.free_slots() == 2  # step 3 is open again: s = 2 at the next sample
        elif not case.closed:
            buf.mark_running_nowait("pend")
            buf.mark_finished_nowait("pend")
            batch, _ = await buf.sample(5, 2, timeout=0)
            assert batch.uids == ["fin", "pend"]


# -- odd but valid calls -----------------------------------------------------------------------


@dataclass(frozen=True)
class Accepted:
    """One odd but valid call: it returns ``result``; then ``effect`` holds, or, without one,
    nothing changed."""

    id: str
    call: Callable[[Ctx], object]
    result: object
    effect: Callable[[ReplayBuffer], bool] | None = None


def status_of(uid: str, status: Status) -> Callable[[ReplayBuffer], bool]:
    return lambda buf: resident_groups(buf)[uid].status is status


def holds(uid: str, keys: list[str]) -> Callable[[ReplayBuffer], bool]:
    return lambda buf: [t.key for t in resident_groups(buf)[uid].trajectories] == keys


def stored(uid: str, key: str, versions: Any, tokens: int, *, head: int) -> Callable[[ReplayBuffer], bool]:
    """The trajectory ``key`` of ``uid`` holds exactly ``versions`` (plain ints in tuples) and
    ``tokens``, and the in-flight group is filed under ``head``."""

    def check(buf: ReplayBuffer) -> bool:
        trajectories = {t[0]: t for t in version_state(buf)[uid][1]}
        got = trajectories[key]
        plain = all(type(x) is int for pair in got[1] for x in pair) and type(got[1]) is tuple
        return got == (key, versions, tokens) and plain and in_flight_heads(buf)[uid] == head

    return check


A = Accepted
ACCEPTED: tuple[Accepted, ...] = (
    # membership of anything, hashable or not, is a plain answer (item 16)
    A("contains-list", lambda c: [] in c.buf, False),
    A("contains-dict", lambda c: {} in c.buf, False),
    A("contains-None", lambda c: None in c.buf, False),
    A("contains-bytes", lambda c: b"fin" in c.buf, False),
    A("contains-evil-eq", lambda c: EvilEq() in c.buf, False),
    A("contains-in-flight", lambda c: "pend" in c.buf, True),
    A("contains-terminal", lambda c: "fin" in c.buf, True),
    A("contains-sampled", lambda c: "took" in c.buf, False),
    # put_group's status: a terminal Status or its value, and "failed" (item 19)
    A(
        "group-status-FAILURE",
        lambda c: group(c, status=Status.FAILURE),
        ["new_0_0", "new_1_0"],
        status_of("new", Status.FAILURE),
    ),
    A(
        "group-status-failure",
        lambda c: group(c, status="failure"),
        ["new_0_0", "new_1_0"],
        status_of("new", Status.FAILURE),
    ),
    A(
        "group-status-failed",
        lambda c: group(c, status="failed"),
        ["new_0_0", "new_1_0"],
        status_of("new", Status.FAILURE),
    ),
    A(
        "group-status-FINISHED",
        lambda c: group(c, status=Status.FINISHED),
        ["new_0_0", "new_1_0"],
        status_of("new", Status.FINISHED),
    ),
    A(
        "group-status-FAILURE-in-flight",
        lambda c: group(c, "pend", ["q"], session_ids=[4], status=Status.FAILURE),
        ["pend_4_0"],
        status_of("pend", Status.FAILURE),
    ),
    A("group-payloads-set", lambda c: group(c, payloads={"only"}), ["new_0_0"], holds("new", ["new_0_0"])),
    # versions, tokens and start versions: numpy's integers, any iterable of pairs, the bounds
    A(
        "put-versions-numpy",
        lambda c: put_versions(c, [(np.int64(3), np.uint8(2)), np.array([4, 1])]),
        "run_5_0",
        stored("run", "run_5_0", ((3, 2), (4, 1)), 3, head=3),
    ),
    A(
        "put-versions-generator",
        lambda c: put_versions(c, ((v, 1) for v in (7, 2))),
        "run_5_0",
        stored("run", "run_5_0", ((7, 1), (2, 1)), 2, head=2),
    ),
    A(
        "put-versions-bounds",
        lambda c: put_versions(c, [(2**63 - 1, 2**63 - 2), (0, 1)]),
        "run_5_0",
        stored("run", "run_5_0", ((2**63 - 1, 2**63 - 2), (0, 1)), 2**63 - 1, head=0),
    ),
    A(
        "put-versions-and-tokens-agree",
        lambda c: c.buf.put_nowait("run", session_id=5, versions=[[6, 2]], tokens=np.int32(2)),
        "run_5_0",
        stored("run", "run_5_0", ((6, 2),), 2, head=4),
    ),
    A(
        "put-tokens-zero",
        lambda c: c.buf.put_nowait("run", session_id=5, tokens=0),
        "run_5_0",
        stored("run", "run_5_0", (), 0, head=4),
    ),
    A(
        "running-version-numpy",
        lambda c: c.buf.mark_running_nowait("pend", version=np.int64(9)),
        None,
        lambda buf: version_state(buf)["pend"][0] == 9 and in_flight_heads(buf)["pend"] == 9,
    ),
    A(
        "running-version-max",
        lambda c: c.buf.mark_running_nowait("pend", version=2**63 - 1),
        None,
        lambda buf: in_flight_heads(buf)["pend"] == 2**63 - 1,
    ),
    A(
        "group-version-numpy-fast-path",
        lambda c: group(c, version=np.int16(2)),
        ["new_0_0", "new_1_0"],
        lambda buf: version_state(buf)["new"][0] == 2,
    ),
    A(
        "group-columns-tuples-numpy",
        lambda c: group(c, versions=(((np.int64(1), 2),), None), tokens=(None, np.int64(4))),
        ["new_0_0", "new_1_0"],
        lambda buf: version_state(buf)["new"] == (5, [("new_0_0", ((1, 2),), 2), ("new_1_0", (), 4)]),
    ),
    # Batch.split: more parts than groups, and a cost or by read as a str (numpy's str_ too)
    A("split-more-parts-than-groups", lambda c: split_uids(c, 4), [["s1"], ["s0"], [], []]),
    A("split-cost-numpy-str", lambda c: split_uids(c, 2, cost=np.str_("groups")), [["s0"], ["s1"]]),
    A("split-by-numpy-str", lambda c: split_uids(c, 1, by=np.str_("trajectory")), [["s0_0_0", "s1_0_0"]]),
)


def split_uids(c: Ctx, *args: Any, **kwargs: Any) -> list[list[str]]:
    """What :func:`split` returns, as the uids (or keys) of each part."""
    parts: Any = split(c, *args, **kwargs)
    return [[t.key for t in part] if isinstance(part, list) else part.uids for part in parts]


@pytest.mark.parametrize("case", ACCEPTED, ids=[case.id for case in ACCEPTED])
async def test_odd_but_valid_input_is_accepted(case: Accepted, tmp_path: Path) -> None:
    with anyio.fail_after(LIMIT):
        buf = await populated()
        before = full_snapshot(buf)
        assert case.call(Ctx(buf, tmp_path)) == case.result
        if case.effect is None:
            assert full_snapshot(buf) == before, "the call changed the buffer"
        else:
            assert case.effect(buf)
        assert_conserved(buf)


def test_the_table_is_big_and_distinct() -> None:
    ids = [case.id for case in (*CASES, *ACCEPTED)]
    assert len(ids) == len(set(ids)), "duplicate row ids"
    assert len(CASES) >= 40
    assert sum(case.id.startswith("group-") for case in CASES) >= 30, "put_group needs rows of its own"
    errors = {case.error for case in CASES}
    for required in (
        ConfigError,
        TypeError,
        ValueError,
        UnknownGroupError,
        DuplicateGroupError,
        DuplicateTrajectoryError,
        InvalidTransitionError,
        BufferClosedError,
        BufferFullError,
        TagClosedError,
        FutureTagError,
        GroupEvictedError,
    ):
        assert required in errors, f"no row raises {required.__name__}"


async def test_the_populated_buffer_is_what_the_table_assumes() -> None:
    with anyio.fail_after(LIMIT):
        buf = await populated()
        stats = buf.stats()
        train, val = stats.partitions["train"], stats.partitions["val"]
        assert (train.pending, train.running, train.finished, train.failure) == (1, 1, 1, 1)
        assert (train.sampled_groups, train.evicted_stale_groups, train.evicted_failure_groups) == (1, 1, 1)
        assert (val.finished, val.failure) == (1, 1)
        assert set(resident_uids(buf)) == {"fin", "failr", "pend", "run", "vfin", "vfail"}
        versions = version_state(buf)
        assert versions["pend"] == (5, [("pend_0_0", (), 3)])
        assert versions["run"] == (6, [("run_0_0", (), 0), ("run_1_0", ((4, 2), (6, 1)), 3)])
        assert in_flight_heads(buf) == {"pend": 5, "run": 4}
        assert (train.tokens, train.admitted_tokens) == (6, 6)
        flow = await populated_flow()
        train = flow.stats().partitions["train"]
        assert (train.running, train.finished, train.capacity) == (1, 1, 4)
        assert (train.sampled_groups, train.evicted_in_flight_groups) == (1, 1)
        assert (flow.dispatch_step(), flow.free_slots(), flow.full()) == (3, 0, True)
        assert set(resident_uids(flow)) == {"fa", "fb", "vfin"}
        mixed = await populated_mixed()
        tasks = mixed.stats().partitions["train"].tasks
        assert (tasks["math"].resident, tasks["code"].resident) == (2, 1)
        assert (mixed.capacity(task="math"), mixed.capacity(task="code")) == (4, 2)  # T * q(3)
        assert set(resident_uids(mixed)) == {"m0", "m1", "c0", "v0"}


async def test_a_threadsafe_producer_refuses_a_uid_utf8_cannot_encode() -> None:
    """Issue 21 item 5: a lone-surrogate uid from a worker thread (the example server's ``def``
    handler) was admitted, and every later JSON answer naming it failed."""
    with anyio.fail_after(LIMIT):
        buf = await populated()
        producer = buf.threadsafe()
        before = full_snapshot(buf)
        for call in (
            lambda: producer.put_group(SURROGATE, ["x"]),
            lambda: producer.add_prompt("a" + SURROGATE, partition="val"),
        ):
            with pytest.raises(ValueError, match=UTF8):
                await anyio.to_thread.run_sync(call)
        assert full_snapshot(buf) == before


# -- collections whose len() disagrees with what they yield, raising dunders, odd statuses --------


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("argument", ["payloads", "session_ids", "indices", "trajectory_tags"])
def test_put_group_collection_whose_len_disagrees_with_its_items_is_a_value_error(
    argument: str, length: int
) -> None:
    """Defect (issue 10, item 4: "a payloads collection ... whose len() disagrees with what it
    yields ... a length mismatch is a typed ValueError with nothing changed"): a lying len()
    got past put_group; every per-trajectory argument is now materialised the same way."""
    buf = ReplayBuffer()
    values: dict[str, list[Any]] = {
        "payloads": ["x", "y"],
        "session_ids": [0, 1],
        "indices": [0, 0],
        "trajectory_tags": [None, None],
    }
    kwargs: dict[str, Any] = {"global_steps": 0}
    if argument != "payloads":
        kwargs[argument] = LyingLen(length, values[argument])
        payloads: Any = values["payloads"]
    else:
        payloads = LyingLen(length, values["payloads"])
    with pytest.raises(ValueError, match=argument):
        buf.put_group_nowait("g", payloads, **kwargs)
    assert "g" not in buf
    assert buf.stats().total.admitted_groups == 0


class Draining:
    """A collection that empties as it is iterated (a queue-like view): len() was true when asked."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Any:
        while self.items:
            yield self.items.pop(0)

    def __contains__(self, item: object) -> bool:
        return item in self.items


def test_a_collection_that_empties_as_it_is_read_is_not_called_a_liar() -> None:
    """Defect: put_group read len() after iterating, so a collection that empties as it is read
    said the truth and was still refused as one whose len() lies."""
    buf = make()
    keys = buf.put_group_nowait("g", Draining(["a", "b"]), global_steps=0)
    assert len(keys) == 2
    batch, _ = buf.sample_nowait(0, 1)
    assert [t.payload for t in batch.groups[0].trajectories] == ["a", "b"]


def test_duplicate_trajectory_message_of_put_group_is_bounded_for_a_huge_uid() -> None:
    """Defect (issue 10, item 14: "error messages must never repr unbounded user values:
    truncate"): put_group's duplicate-trajectory message held the whole uid."""
    buf = ReplayBuffer()
    uid = "u" * 100_000
    with pytest.raises(DuplicateTrajectoryError) as info:
        buf.put_group_nowait(uid, [1, 2], global_steps=0, session_ids=[0, 0])
    assert len(str(info.value)) < 1000


class EvilDunders:
    """A value whose repr, hash, equality, iteration and len() all raise."""

    def __repr__(self) -> str:
        raise RuntimeError("evil repr")

    def __hash__(self) -> int:
        raise RuntimeError("evil hash")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("evil eq")

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("evil iter")

    def __len__(self) -> int:
        raise RuntimeError("evil len")


class EvilDundersMapping(Mapping[str, Any]):
    """A mapping whose item access, iteration and len() all raise."""

    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("evil getitem")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("evil iter")

    def __len__(self) -> int:
        raise RuntimeError("evil len")


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: SamplerConfig(exempt_partitions=EvilDunders()), id="exempt_partitions-iter"),
        pytest.param(lambda: SamplerConfig(exempt_partitions=[EvilDunders()]), id="exempt_partitions-hash"),
        pytest.param(lambda: SamplerConfig(sampler_kwargs=EvilDundersMapping()), id="sampler_kwargs-iter"),
        pytest.param(lambda: SamplerConfig.from_mapping(EvilDundersMapping()), id="from_mapping-iter"),
        pytest.param(lambda: ReplayBuffer.from_config(EvilDundersMapping()), id="from_config-iter"),
        pytest.param(lambda: ReplayBuffer(policy=EvilDunders()), id="policy-no-config"),  # type: ignore[arg-type]
    ],
)
def test_config_arguments_whose_dunders_raise_get_a_config_error(call: Callable[[], object]) -> None:
    """Defect (issue 10, item 15: "arguments whose __repr__/__len__/__eq__ raise pass that
    exception through ... type checks come first and messages name the type, not the repr"):
    config arguments whose dunders raise escaped as the dunder's own RuntimeError."""
    with pytest.raises(ConfigError):
        call()


def test_put_group_status_accepts_a_str_subclass_by_its_value() -> None:
    """Defect (issue 10, item 19: "accept Status members and their values"): numpy's ``str_`` (a
    status read from an array) is a str subclass and was refused; its plain value counts, not
    its overrides."""
    import numpy as np

    class Shouting(str):
        def __eq__(self, other: object) -> bool:
            raise RuntimeError("evil eq")

        __hash__ = str.__hash__

    buf = ReplayBuffer(status_log_interval=None)
    buf.put_group_nowait("a", [1], global_steps=0, status=np.str_("failure"))
    buf.put_group_nowait("b", [1], global_steps=0, status=Shouting("finished"))
    statuses = {group.uid: group.status for group in buf.sample_nowait(0, 2)[0]}
    assert statuses == {"a": Status.FAILURE, "b": Status.FINISHED}
    with pytest.raises(ValueError, match="status"):
        buf.put_group_nowait("c", [1], global_steps=0, status=np.str_("running"))
    assert "c" not in buf
