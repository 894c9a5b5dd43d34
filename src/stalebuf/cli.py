"""The ``stalebuf`` command line: ``stalebuf simulate`` compares drop and wait, with and
without admission control, and with ``--in-flight-updates`` drop, wait and mask under in-flight
weight updates.

This module only parses. The options of ``simulate`` are derived from the fields of
:class:`~stalebuf.simulate.SimulationConfig` (name, default and type), and every value is
checked by building that config: the CLI knows no range of its own.

Every error is reported as one line on stderr with a non-zero exit status: 2 for bad
options (including any value the config rejects, and a ``--latency empirical:`` file that
cannot be read), 1 for anything that goes wrong while running (a missing optional dependency,
an unwritable output path), 130 when interrupted. A reader that stops reading early
(``stalebuf simulate | head -1``) is not an error: the run finishes quietly with status 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import IO, Any, Literal, NoReturn, cast, get_args, get_origin, get_type_hints

import attrs

from ._version import __version__
from .errors import ConfigError, StalebufError
from .simulate import (
    Latency,
    MissingDependencyError,
    SimulationConfig,
    SimulationResult,
    format_report,
    simulate,
    write_plot,
)
from .simulate._config import PLAIN_STRATEGIES, BatchBy, Strategy
from .simulate._help import DESCRIPTION, FIELD_OPTIONS, MODEL_HELP
from .simulate._model import ProgressCallback
from .simulate._report import PLOT_FORMATS, plot_format, require_matplotlib
from .simulate._tasks import TaskMix

__all__ = ["main"]

_DEFAULTS = SimulationConfig()
#: ``--admission`` choices and the ``SimulationConfig.admission`` value each stands for.
_ADMISSION: dict[str, bool] = {"off": False, "on": True}
#: ``--strategy`` choices beyond the strategies themselves: "both" is drop and wait, "all" every
#: strategy the mode runs (mask too with ``--in-flight-updates``).
_STRATEGY_SETS = ("both", "all")
#: The options that mean something only with one of some others (``--in-flight-updates``,
#: ``--tasks``, ``--token-budget``): given without them, they are refused rather than ignored.
_ONLY_WITH: dict[str, tuple[str, ...]] = {
    "tokens_per_second": ("in_flight_updates", "token_budget"),
    "chunk_tokens": ("in_flight_updates",),
    "mixture_policy": ("tasks",),
    "prompt_tokens": ("token_budget",),
    "max_response_tokens": ("token_budget",),
    "batch_by": ("token_budget",),
}
#: The options that cannot be used together, and why.
_NOT_WITH = {
    (
        "token_budget",
        "tasks",
    ): "the buffer refuses token budgets under a task mixture, whose quotas count groups",
    ("token_budget", "in_flight_updates"): "token counts with in-flight updates are not supported yet",
}
#: The options absent from the namespace unless given: those above, ``--tasks`` and ``--token-budget``.
_GIVEN_ONLY = (*_ONLY_WITH, "tasks", "token_budget")


class _UsageError(Exception):
    """A bad command line; the message is the whole line to print."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, raised instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: error: {message}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_as(kind: object) -> dict[str, Any]:
    """Return how argparse reads a value of the field type ``kind``; the range is the config's."""
    if get_origin(kind) is Literal:
        return {"choices": get_args(kind)}
    if kind is Latency:
        return {"type": _latency_option}
    if TaskMix in get_args(kind):  # TaskMix | None
        return {"type": _tasks_option}
    if int in get_args(kind):  # int | None
        return {"type": int}
    if kind in (int, float):
        return {"type": kind}
    raise TypeError(f"no command-line form for a SimulationConfig field of type {kind!r}")


def _latency_option(text: str) -> Latency:
    try:
        return Latency.parse(text)
    except StalebufError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tasks_option(text: str) -> TaskMix:
    try:
        return TaskMix.parse(text)
    except StalebufError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults and keep the epilog's line breaks."""


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="stalebuf",
        description="stalebuf: a staleness-aware replay buffer for asynchronous RL of LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"stalebuf {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim = commands.add_parser(
        "simulate",
        help="compare drop and wait, with and without admission, in a simulated async RL pipeline",
        description=DESCRIPTION,
        epilog=MODEL_HELP,
        formatter_class=_HelpFormatter,
    )
    _add_run_choices(sim)
    types = get_type_hints(SimulationConfig)
    for name, (metavar, help_text) in FIELD_OPTIONS.items():
        default = getattr(_DEFAULTS, name)
        if name in _GIVEN_ONLY:  # absent unless given, so that one given alone is refused
            if default is not None:
                shown = f"{default:g}" if isinstance(default, float) else str(default)
                help_text = f"{help_text} (default: {shown})"
            default = argparse.SUPPRESS
        sim.add_argument(
            _flag(name), default=default, metavar=metavar, help=help_text, **_parse_as(types[name])
        )
    _add_outputs(sim)
    return parser


def _add_run_choices(sim: argparse.ArgumentParser) -> None:
    """The options that choose which runs ``simulate`` compares."""
    sim.add_argument(
        "--strategy",
        choices=(*get_args(Strategy), *_STRATEGY_SETS),
        default="all",
        help="strategies to run (mask only with --in-flight-updates): both is drop and wait, all is "
        "every strategy the mode runs (drop and wait, and mask with --in-flight-updates)",
    )
    sim.add_argument(
        "--admission",
        choices=(*_ADMISSION, "both"),
        default=argparse.SUPPRESS,
        help="run without (off) or with (on) admission control, or both, for each strategy "
        "(default: both; on with --in-flight-updates)",
    )
    sim.add_argument(
        "--batch-by",
        choices=("groups", "tokens", "both"),
        default=argparse.SUPPRESS,
        help="with --token-budget: batches of batch-size groups (tokens only counted), of K tokens, or "
        "both, for each strategy and admission (default: tokens)",
    )
    sim.add_argument(
        "--in-flight-updates",
        action="store_true",
        default=argparse.SUPPRESS,
        help="new weights reach the rollout workers after every sync point, mid-generation: workers "
        "record the version of each chunk they decode, and the report counts tokens (see below)",
    )


def _add_outputs(sim: argparse.ArgumentParser) -> None:
    """The options that choose what ``simulate`` writes besides its report."""
    sim.add_argument(
        "--json", metavar="PATH", default=argparse.SUPPRESS, help="write every number to a JSON file"
    )
    sim.add_argument(
        "--plot",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help=(
            "write staleness histograms and the trainer's busy/idle timeline as a PNG or JPEG, by the "
            f"suffix ({', '.join(PLOT_FORMATS)}); needs matplotlib"
        ),
    )
    sim.add_argument(
        "--no-progress",
        action="store_true",
        default=argparse.SUPPRESS,
        help=(
            "no progress bar on stderr (it is off anyway when stderr is not a TTY, or without tqdm, "
            "which the sim extra installs)"
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``stalebuf`` command line and return its exit status.

    Args:
        argv: the arguments (without the program name); None means ``sys.argv[1:]``.

    Returns:
        0 on success, 2 for bad options, 1 for an error while running, 130 when interrupted.
        Errors are printed as one line on stderr; this function raises nothing but
        unexpected internal errors.
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        print(
            "stalebuf: error: missing command (try 'stalebuf simulate' or 'stalebuf --help')", file=sys.stderr
        )
        return 2
    try:
        status = _simulate_command(args)
        if sys.stdout is not None:  # None when started with stdout closed (`>&-`): print drops it all
            sys.stdout.flush()  # here, so that a reader gone early is caught below, not at exit
        return status
    except BrokenPipeError:
        # The reader stopped reading (`stalebuf simulate | head -1`): not an error, as for
        # other Unix tools. What is left of the report goes nowhere, and no exit-time flush fails.
        _discard_stdout()
        return 0
    except _UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (MissingDependencyError, OSError) as exc:
        print(f"stalebuf simulate: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stalebuf simulate: interrupted", file=sys.stderr)
        return 130


def _discard_stdout() -> None:
    """Point stdout at the null device, so that nothing written to it later can fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _say(line: str) -> None:
    """Print ``line`` to stdout now; if the reader has gone, drop it and what follows quietly
    (the run still writes its ``--json`` and ``--plot`` files)."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        _discard_stdout()


def _check_output_path(option: str, path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise _UsageError(f"stalebuf simulate: error: argument {option}: {path!r} is a directory")
    if not os.path.isdir(parent):
        raise _UsageError(f"stalebuf simulate: error: argument {option}: directory {parent!r} does not exist")


def _strategies(choice: str, in_flight: bool) -> tuple[Strategy, ...]:
    """The strategies ``--strategy choice`` runs; mask is refused without in-flight updates."""
    if choice == "all":
        return get_args(Strategy) if in_flight else PLAIN_STRATEGIES
    if choice == "both":
        return PLAIN_STRATEGIES
    if choice == "mask" and not in_flight:
        raise _UsageError(
            "stalebuf simulate: error: argument --strategy: mask needs --in-flight-updates (without "
            "them every token of a group is at its dispatch step, and mask would be drop without "
            "in-flight eviction)"
        )
    return (cast(Strategy, choice),)


def _configs(args: argparse.Namespace) -> list[SimulationConfig]:
    """Build the config of each run, strategy by strategy, without admission first; a value the
    config rejects is a usage error, and so is an in-flight option without --in-flight-updates."""
    in_flight: bool = getattr(args, "in_flight_updates", False)
    values = {name: getattr(args, name) for name in FIELD_OPTIONS if hasattr(args, name)}
    given = {name for name in (*FIELD_OPTIONS, "in_flight_updates", "batch_by") if hasattr(args, name)}
    for name, needs in _ONLY_WITH.items():
        if name in given and not given.intersection(needs):
            raise _UsageError(
                f"stalebuf simulate: error: argument {_flag(name)}: only with "
                + " or ".join(map(_flag, needs))
            )
    for (name, other), why in _NOT_WITH.items():
        if {name, other} <= given:
            raise _UsageError(
                f"stalebuf simulate: error: argument {_flag(name)}: not with {_flag(other)} ({why})"
            )
    strategies = _strategies(args.strategy, in_flight)
    admission = getattr(args, "admission", "on" if in_flight else "both")
    admissions = tuple(_ADMISSION.values()) if admission == "both" else (_ADMISSION[admission],)
    batch_by = getattr(args, "batch_by", "tokens" if "token_budget" in given else "groups")
    units: tuple[BatchBy, ...] = get_args(BatchBy) if batch_by == "both" else (batch_by,)
    try:
        return [
            SimulationConfig(
                strategy=strategy, admission=choice, in_flight_updates=in_flight, batch_by=unit, **values
            )
            for strategy in strategies
            for choice in admissions
            for unit in units
        ]
    except ConfigError as exc:
        raise _UsageError(f"stalebuf simulate: error: {_option_at_fault(values)}{exc}") from None


def _option_at_fault(values: dict[str, Any]) -> str:
    """Return "argument --FLAG: " for the first value the config rejects on its own, else ""
    (a rule about several fields names them in its message)."""
    for name, value in values.items():
        try:
            if name == "token_budget":  # alone it samples by tokens (evolve keeps the defaults' unit)
                attrs.evolve(_DEFAULTS, token_budget=value, batch_by="tokens")
            else:
                attrs.evolve(_DEFAULTS, **{name: value})
        except ConfigError:
            return f"argument {_flag(name)}: "
    return ""


def _simulate_command(args: argparse.Namespace) -> int:
    # Every option is checked before anything runs: values first, then output paths and plotting.
    configs = _configs(args)
    json_path: str | None = getattr(args, "json", None)
    plot_path: str | None = getattr(args, "plot", None)
    if json_path is not None:
        _check_output_path("--json", json_path)
    if plot_path is not None:
        _check_output_path("--plot", plot_path)
        try:
            plot_format(plot_path)
        except ValueError as exc:
            raise _UsageError(f"stalebuf simulate: error: argument --plot: {exc}") from None
        require_matplotlib()
    progress = None
    if not getattr(args, "no_progress", False) and sys.stderr.isatty():
        progress = _Progress.start(configs, sys.stderr)
    results = []
    try:
        for index, config in enumerate(configs):
            callback = progress.run(index) if progress is not None else None
            results.append(simulate(config, progress=callback))
    finally:
        if progress is not None:
            progress.close()
    _say(format_report(results))
    if json_path is not None:
        _write_json(results, json_path)
        _say(f"wrote {json_path}")
    if plot_path is not None:
        write_plot(results, plot_path)
        _say(f"wrote {plot_path}")
    return 0


def _write_json(results: Sequence[SimulationResult], path: str) -> None:
    document = {
        "stalebuf_version": __version__,
        "results": {result.config.label: result.to_dict() for result in results},
    }
    with open(path, "w", encoding="utf-8") as file:
        json.dump(document, file, indent=2, allow_nan=False)
        file.write("\n")


class _Progress:
    """One tqdm bar on stderr over every run of the command: the run ("2/4 drop+admission"),
    trainer steps done out of all runs' steps, and the time left for the whole command."""

    def __init__(self, configs: Sequence[SimulationConfig], tqdm: Any, stream: IO[str]) -> None:
        self.configs = configs
        self.label_width = max(len(config.label) for config in configs)
        self.bar = tqdm(
            total=sum(config.steps for config in configs),
            desc=self._describe(0),
            file=stream,
            leave=False,  # the report replaces it
            bar_format="{desc} {percentage:3.0f}%|{bar}| step {n_fmt}/{total_fmt}, ETA {remaining}",
        )

    @classmethod
    def start(cls, configs: Sequence[SimulationConfig], stream: IO[str]) -> _Progress | None:
        """Show the bar, or return None if tqdm is not installed (the bar is optional)."""
        try:
            # Imported by name: tqdm is optional and ships no type hints.
            tqdm = importlib.import_module("tqdm").tqdm
        except ImportError:
            return None
        return cls(configs, tqdm, stream)

    def _describe(self, index: int) -> str:
        return f"{index + 1}/{len(self.configs)} {self.configs[index].label:<{self.label_width}}"

    def run(self, index: int) -> ProgressCallback:
        """Name run ``index`` on the bar and return the callback that advances it."""
        self.bar.set_description_str(self._describe(index))
        before = sum(config.steps for config in self.configs[:index])

        def advance(done: int, _steps: int) -> None:
            self.bar.update(before + done - self.bar.n)

        return advance

    def close(self) -> None:
        """Clear the bar from the terminal."""
        self.bar.close()
