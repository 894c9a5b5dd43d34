"""The distribution of a group's generation time: :class:`Latency`, and the spec forms it parses.

A spec is one of:

- ``lognormal:MU,SIGMA``, ``exponential:MEAN``, ``fixed:SECONDS``: a parametric distribution;
- ``lognormal-fit:MEDIAN,P95``: the lognormal with that median and 95th percentile, for users who
  know only those two numbers;
- ``empirical:PATH`` or ``empirical:PATH#COLUMN``: generation times in seconds read from a file
  (one number per line, a JSON array, or a column of a CSV, JSON or JSON Lines file), resampled
  uniformly with the run's seed; :mod:`._empirical` reads the file.

Every error is a :class:`~stalebuf.errors.ConfigError` whose message is one line, so that the
command line can print it as is.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from statistics import NormalDist
from typing import Any, Literal, get_args

import attrs
import numpy as np

from .._validation import describe, finite_in, is_finite_number, one_of
from ..errors import ConfigError
from ._bounds import MAX_SECONDS
from ._empirical import read_times, split_column

__all__ = ["LATENCY_KINDS", "MAX_SECONDS", "Latency", "LatencyKind"]

LatencyKind = Literal["lognormal", "exponential", "fixed", "empirical"]

#: Accepted latency distribution kinds (see :meth:`Latency.parse` for the spec forms).
LATENCY_KINDS: tuple[str, ...] = get_args(LatencyKind)

_FORMS = (
    "lognormal:MU,SIGMA, lognormal-fit:MEDIAN,P95, exponential:MEAN, fixed:SECONDS, "
    "empirical:PATH or empirical:PATH#COLUMN"
)

# Each parametric kind's parameters, by the names its spec uses, and their checks in the same order.
_PARAM_NAMES: dict[str, tuple[str, ...]] = {
    "lognormal": ("MU", "SIGMA"),
    "exponential": ("MEAN",),
    "fixed": ("SECONDS",),
}
_PARAM_CHECKS: dict[str, tuple[Any, ...]] = {
    "lognormal": (
        finite_in("lognormal latency MU (log of seconds)", -30.0, 30.0),
        finite_in("lognormal latency SIGMA", 0.0, 5.0),
    ),
    "exponential": (finite_in("exponential latency MEAN (seconds)", 0.0, MAX_SECONDS, open_low=True),),
    "fixed": (finite_in("fixed latency SECONDS", 0.0, MAX_SECONDS, open_low=True),),
}
# The standard normal's 95th percentile: a lognormal's p95 is exp(MU + _Z95 * SIGMA).
_Z95 = NormalDist().inv_cdf(0.95)


def _short(value: float) -> str:
    """Format ``value`` as ``%g`` when that is exact, else as its full repr."""
    text = f"{value:g}"
    return text if float(text) == value else repr(value)


def _to_params(value: object) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"latency params must be a sequence of numbers, got {describe(value)}")
    params = tuple(value)
    if not all(is_finite_number(p) for p in params):
        raise ConfigError(f"latency params must be finite numbers, got {describe(params)}")
    return tuple(float(p) for p in params)


def _params_repr(params: tuple[float, ...]) -> str:
    # An empirical latency may hold a million values: its repr says how many instead.
    return repr(params) if len(params) <= 8 else f"<{len(params)} values>"


@attrs.frozen
class Latency:
    """A distribution of per-group generation times, in seconds.

    Attributes:
        kind: "lognormal" (params ``(mu, sigma)`` of the natural log of the seconds, with
            ``|mu| <= 30`` and ``0 <= sigma <= 5``; long-tailed), "exponential" (params
            ``(mean,)``, > 0), "fixed" (params ``(seconds,)``, > 0) or "empirical" (params: the
            observed generation times, at least one, each > 0; a draw picks one uniformly).
        params: the distribution's parameters, as floats.
        spec: the spec it was parsed from when that is not its canonical form
            (``lognormal-fit:...`` or ``empirical:...``), else None; :meth:`parse` reads it back.

    Raises:
        ConfigError: on construction, for an unknown kind or invalid parameters.
    """

    kind: LatencyKind = attrs.field(validator=one_of("latency kind", LATENCY_KINDS))
    params: tuple[float, ...] = attrs.field(converter=_to_params, repr=_params_repr)
    spec: str | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.spec is not None and (type(self.spec) is not str or "\n" in self.spec):
            raise ConfigError(f"latency spec must be None or a one-line str, got {describe(self.spec)}")
        if self.kind == "empirical":
            if not self.params:
                raise ConfigError("empirical latency needs at least one generation time")
            if min(self.params) <= 0.0 or max(self.params) > MAX_SECONDS:
                bad = min(self.params) if min(self.params) <= 0.0 else max(self.params)
                raise ConfigError(
                    f"empirical latency: generation times must be > 0 and <= {MAX_SECONDS:g} seconds, "
                    f"got {bad!r}"
                )
            return
        names = _PARAM_NAMES[self.kind]
        if len(self.params) != len(names):
            raise ConfigError(
                f"{self.kind} latency needs {','.join(names)}, got {len(self.params)} number(s)"
            )
        for check, value in zip(_PARAM_CHECKS[self.kind], self.params, strict=True):
            check(self, None, value)

    @classmethod
    def parse(cls, spec: str) -> Latency:
        """Parse a spec: ``lognormal:MU,SIGMA``, ``lognormal-fit:MEDIAN,P95``, ``exponential:MEAN``,
        ``fixed:SECONDS``, ``empirical:PATH`` or ``empirical:PATH#COLUMN``.

        ``lognormal-fit`` is the lognormal with that median and 95th percentile (``0 < MEDIAN <=
        P95``). ``empirical`` reads generation times in seconds from ``PATH`` (relative to the
        current directory): without a column, one number per line (blank lines skipped), or a JSON
        array of numbers if it ends in ``.json``; with ``#COLUMN``, that field of a ``.json`` file
        (an array of objects, or an object of arrays), of a ``.jsonl``/``.ndjson`` file (one object
        per line), or else that column of a CSV file with a header row. If ``PATH#COLUMN`` names an
        existing file, it is read whole, as a path. The file must be a regular file of at most
        32 MiB (``_bounds.MAX_FILE_BYTES``).

        Raises:
            ConfigError: if ``spec`` is not of one of those forms, a parameter is invalid, or the
                file cannot be read, is not a regular file, is larger than 32 MiB, is JSON nested
                too deeply to parse or holds anything but numbers > 0 and at most ``MAX_SECONDS``
                (the message is one line).
        """
        kind, sep, rest = str(spec).partition(":")
        kind = kind.strip().lower()
        if kind == "empirical" and sep:
            path, column = split_column(rest)
            return cls("empirical", read_times(path, column), spec=f"empirical:{rest}")
        if not sep or kind not in (*_PARAM_NAMES, "lognormal-fit"):
            raise ConfigError(f"latency must look like {_FORMS}; got {spec!r}")
        try:
            params = tuple(float(part) for part in rest.split(","))
        except ValueError:
            raise ConfigError(f"latency parameters must be numbers, got {spec!r}") from None
        if kind == "lognormal-fit":
            return _fit_lognormal(params)
        return cls(kind, params)  # type: ignore[arg-type]

    def sample(self, rng: random.Random) -> float:
        """Draw one generation time in seconds from ``rng`` (deterministic given its state)."""
        if self.kind == "lognormal":
            mu, sigma = self.params
            return math.exp(mu + sigma * rng.gauss(0.0, 1.0))
        if self.kind == "empirical":
            return rng.choice(self.params)
        u = rng.random()
        if self.kind == "exponential":
            return -self.params[0] * math.log(1.0 - u)
        return self.params[0]

    def quantile(self, q: float) -> float:
        """Return the ``q``-quantile (0 < q < 1) of the distribution, in seconds (for "empirical",
        of the observed times, interpolating linearly between them)."""
        if self.kind == "lognormal":
            mu, sigma = self.params
            return math.exp(mu + sigma * NormalDist().inv_cdf(q))
        if self.kind == "exponential":
            return -self.params[0] * math.log(1.0 - q)
        if self.kind == "empirical":
            return float(np.quantile(np.asarray(self.params, dtype=np.float64), q))
        return self.params[0]

    @property
    def mean(self) -> float:
        """The mean generation time in seconds."""
        if self.kind == "lognormal":
            mu, sigma = self.params
            return math.exp(mu + sigma * sigma / 2)
        if self.kind == "empirical":
            return math.fsum(self.params) / len(self.params)
        return self.params[0]

    def __str__(self) -> str:
        """Return the spec form, e.g. ``lognormal:3.4,1``, which :meth:`parse` reads back exactly
        (an "empirical" latency built from numbers, without a spec, shows only how many it has)."""
        if self.spec is not None:
            return self.spec
        if self.kind == "empirical":
            return f"empirical:<{len(self.params)} values>"
        return f"{self.kind}:{','.join(_short(p) for p in self.params)}"


def _fit_lognormal(params: tuple[float, ...]) -> Latency:
    """The lognormal whose median and 95th percentile are ``params``."""
    if len(params) != 2:
        raise ConfigError(f"lognormal-fit latency needs MEDIAN,P95, got {len(params)} number(s)")
    median, p95 = params
    if not (math.isfinite(p95) and 0.0 < median <= p95):
        raise ConfigError(
            f"lognormal-fit latency needs 0 < MEDIAN <= P95 (seconds), got {_short(median)},{_short(p95)}"
        )
    mu = math.log(median)
    sigma = (math.log(p95) - mu) / _Z95
    spec = f"lognormal-fit:{_short(median)},{_short(p95)}"
    try:
        return Latency("lognormal", (mu, sigma), spec=spec)
    except ConfigError as exc:
        raise ConfigError(f"{spec} fits MU={mu:.4f}, SIGMA={sigma:.4f}, out of range: {exc}") from None
