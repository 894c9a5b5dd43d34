"""The result table of ``compare.py``: rows, verdicts, number formatting and the scaling plot.

Every target module adds its rows to one :class:`Report`; ``compare.py`` prints it as a
markdown table, then a summary of the verdicts, and draws :meth:`Report.scaling` (cost
vs N) and :meth:`Report.scaling_k` (cost vs k) into ``scaling.png``.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

__all__ = [
    "HERE",
    "Report",
    "Row",
    "fmt_n",
    "machine_info",
    "ms",
    "one_poll",
    "p50_p99",
    "percentile",
    "plot",
    "ratio",
    "status",
    "us",
    "vs_ref",
]

#: The benchmarks folder (default place of ``scaling.png``).
HERE = Path(__file__).resolve().parent

_HEAD = "| target | measurement | stalebuf | baseline | ratio | goal | verdict |"
_RULE = "|---|---|---:|---:|---:|---|---|"


@dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the result table; every cell but the first three may stay empty."""

    target: str
    what: str
    stalebuf: str
    baseline: str = ""
    ratio: str = ""
    goal: str = ""
    verdict: str = ""


@dataclass
class Report:
    """Rows plus the verdicts per target and the series the scaling plot is drawn from."""

    rows: list[Row] = field(default_factory=list)
    verdicts: dict[str, list[bool]] = field(default_factory=dict)
    scaling: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # ns vs N
    scaling_k: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # ns vs k

    def add(self, row: Row) -> None:
        """Append ``row`` to the table."""
        self.rows.append(row)

    def info(self, target: str, what: str, stalebuf: str, *, baseline: str = "", ratio: str = "") -> None:
        """Append a row that reports a figure without judging it (verdict "info")."""
        self.add(
            Row(target=target, what=what, stalebuf=stalebuf, baseline=baseline, ratio=ratio, verdict="info")
        )

    def stress_row(
        self,
        target: str,
        what: str,
        t_n: float,
        t_ref: float,
        ref_n: int,
        *,
        unit: Callable[[float], str],
        judged: bool,
    ) -> Row:
        """A stress-layout row: the cost at N next to the reference N's, and their ratio; with
        ``judged`` also the verdict (for "<target> (stress layouts)") that it is at most 3."""
        return Row(
            target=target,
            what=what,
            stalebuf=unit(t_n),
            baseline=f"{unit(t_ref)} (N={fmt_n(ref_n)})",
            ratio=f"{t_n / t_ref:.2f}x",
            goal="<= 3" if judged else "",
            verdict=self.check(f"{target} (stress layouts)", t_n <= 3 * t_ref) if judged else "",
        )

    def check(self, target: str, ok: bool) -> str:
        """Record one verdict for ``target`` and return its table cell."""
        self.verdicts.setdefault(target, []).append(ok)
        return "PASS" if ok else "**FAIL**"

    def failed(self) -> bool:
        """Whether any recorded verdict failed."""
        return any(not all(results) for results in self.verdicts.values())

    def summary(self) -> str:
        """One line: PASS or FAIL per target, in name order."""
        parts = [f"{t} {'PASS' if all(results) else 'FAIL'}" for t, results in sorted(self.verdicts.items())]
        return "Summary: " + ", ".join(parts)

    def markdown(self) -> str:
        """The rows as a markdown table."""
        lines = [_HEAD, _RULE]
        for r in self.rows:
            cells = (r.target, r.what, r.stalebuf, r.baseline, r.ratio, r.goal, r.verdict)
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


# -- formatting --------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Return the ``q``-quantile (0..1) of ``values`` by linear interpolation."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def us(ns: float) -> str:
    """Format nanoseconds as microseconds."""
    if ns != ns:  # NaN
        return "n/a"
    value = ns / 1e3
    if value >= 100:
        return f"{value:,.0f} µs"
    if value >= 10:
        return f"{value:.1f} µs"
    return f"{value:.2f} µs"


def p50_p99(values: Sequence[float]) -> str:
    """Format the median and the 99th percentile of nanosecond ``values`` as "p50 / p99" in µs."""
    return f"{us(percentile(values, 0.5))} / {us(percentile(values, 0.99))}"


def ms(ns: float) -> str:
    """Format nanoseconds as milliseconds (seconds from 1 s on)."""
    return f"{ns / 1e6:,.2f} ms" if ns < 1e9 else f"{ns / 1e9:,.2f} s"


def ratio(a: float, b: float) -> str:
    """Format ``a / b`` as "1.23x" ("n/a" when ``b`` is 0)."""
    return f"{a / b:.2f}x" if b else "n/a"


def fmt_n(n: int) -> str:
    """Format a size: powers of ten as "1e5", anything else with thousands separators."""
    exp = len(str(n)) - 1
    return f"1e{exp}" if n == 10**exp else f"{n:,}"


def one_poll(ns: float | None) -> str:
    """The polling baseline's cell: one poll's cost, or "not run" at this size."""
    return "not run" if ns is None else f"{us(ns)} (one poll)"


def vs_ref(growth: float, ref_n: int) -> str:
    """The ratio cell of a cost measured against the reference size ``ref_n``."""
    return f"{growth:.2f}x vs N={fmt_n(ref_n)}"


def status(message: str) -> None:
    """Print a progress line to stderr (the table goes to stdout)."""
    print(f"# {message}", file=sys.stderr, flush=True)


# -- the header lines and the plot -------------------------------------------------------


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(HERE), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=False,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(argv: Sequence[str]) -> list[str]:
    """The header lines of a run: command, machine, Python, package versions, commit."""
    versions = ", ".join(
        f"{name} {_version(name)}" for name in ("stalebuf", "anyio", "trio", "uvloop", "numpy", "attrs")
    )
    return [
        f"- command: `python benchmarks/compare.py{' ' if argv else ''}{' '.join(argv)}`",
        f"- machine: {os.cpu_count()} cores ({_cpu_name()}), {platform.system()} {platform.release()}",
        f"- Python: {platform.python_implementation()} {platform.python_version()}",
        f"- versions: {versions}",
        f"- commit: {_commit() or 'unknown'}",
    ]


def plot(report: Report, path: Path) -> str:
    """Draw the scaling series of ``report`` into ``path``; return a line saying what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written"
    fig, (by_n, by_k) = plt.subplots(1, 2, figsize=(10, 5.6), gridspec_kw={"width_ratios": [3, 2]})
    for ax, series in ((by_n, report.scaling), (by_k, report.scaling_k)):
        for label, points in series.items():
            if points:
                xs, ys = zip(*points, strict=True)
                style = "--" if "polling" in label else (":" if "stress" in label else "-")
                ax.plot(xs, [y / 1e3 for y in ys], style, marker="o", label=label)
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.16), frameon=False)
    by_n.set_yscale("log")
    by_k.set_ylim(bottom=0)
    by_n.set_xlabel("N: resident groups (P3, P4), in-flight groups (P5)")
    by_n.set_ylabel("µs per call (P4: per evicted group)")
    by_n.set_title("cost vs N (dashed: polling baseline; dotted: stress layouts)", fontsize=10)
    by_k.set_xlabel("k: stale groups evicted by one sample")
    by_k.set_ylabel("µs per evicted group")
    by_k.set_title("eviction cost per group vs k", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return f"plot written to {path}"
