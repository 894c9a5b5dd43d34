#!/usr/bin/env python3
"""The import graph of ``src/stalebuf``: fail on an import cycle or an import up the layers.

Every import statement counts: at module level, inside a function, and under
``if TYPE_CHECKING:`` (a cycle that only the type checker sees is still a cycle). Each is resolved
to modules of the package:

- ``import pkg.mod`` imports ``pkg.mod``;
- ``from pkg import name`` imports ``pkg.name`` when that is a module, else ``pkg`` (where the name
  is defined); relative imports (``from . import x``, ``from ..pkg import y``) likewise;
- importing a module also runs the ``__init__`` of each package on the way to it that is not
  already a package of the importing module, so ``from .pkg.mod import x`` imports ``pkg`` too
  (while ``from . import sub`` does not import the importer's own package).

Then it reports every cycle, as a chain ``a -> b -> a``, and every import that runs up the declared
:data:`LAYERS`, and exits 1; with no problem it prints a one-line summary and exits 0. Standard
library only: CI runs it before anything is installed.

Usage: ``python .ci/import_graph.py [--root DIR] [--layer NAME=PATTERN[,PATTERN...]]... [--quiet]``
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

#: The layers of the package, lowest first: a module may import modules of its own layer and of
#: lower ones, never of a higher one. A module belongs to the highest layer with a pattern that
#: matches its name inside the package or the name of one of its packages (shell wildcards
#: allowed: ``_prometheus_*``); a module that no pattern matches belongs to the lowest layer. The
#: package's own ``__init__`` (its facade) stands above every layer and may import anything, but
#: no module of the package may import it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ()),  # every module not listed below
    ("prometheus", ("prometheus", "_prometheus_*")),
    ("ray", ("ray",)),
    ("simulate", ("simulate",)),
    ("cli", ("cli", "__main__")),
)

#: The default package: ``src/stalebuf`` of the repository this script is in.
DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "src" / "stalebuf"

#: At most this many cycles are listed per strongly connected set of modules.
MAX_CYCLES_PER_SET = 200

Layers = Sequence[tuple[str, Sequence[str]]]


class Import(NamedTuple):
    """One import of ``target`` by ``importer``, at ``path:line`` (``where``: how it is reached)."""

    importer: str
    target: str
    path: Path
    line: int
    where: str  # "module level", "in a function" or "under TYPE_CHECKING"


class Problem(NamedTuple):
    """A problem to report: its one-line summary, the lines that locate it, the modules involved."""

    summary: str
    details: tuple[str, ...]
    modules: tuple[str, ...]


class Report(NamedTuple):
    """What :func:`check` found."""

    modules: int
    imports: int
    cycles: tuple[tuple[str, ...], ...]  # each a chain that ends where it starts
    problems: tuple[Problem, ...]  # cycles, upward imports, facade imports, unresolved imports


def find_modules(root: Path) -> dict[str, Path]:
    """Return the modules of the package at ``root`` by dotted name (a package by its ``__init__``)."""
    package = root.name
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Statement(NamedTuple):
    level: int  # 0 for an absolute import
    module: str | None  # ``x.y`` of ``import x.y`` or ``from x.y import ...``
    names: tuple[str, ...] | None  # the names of ``from ... import``, None for ``import``
    line: int
    where: str


class _Collector(ast.NodeVisitor):
    """Every import statement of a module, with where it is reached from."""

    def __init__(self) -> None:
        self.found: list[_Statement] = []
        self._where = ["module level"]

    def _inside(self, where: str, nodes: Iterable[ast.AST]) -> None:
        """Visit ``nodes`` as reached ``where`` (unless already inside a function or such a block)."""
        self._where.append(where if self._where[-1] == "module level" else self._where[-1])
        for node in nodes:
            self.visit(node)
        self._where.pop()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append(_Statement(0, alias.name, None, node.lineno, self._where[-1]))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        names = tuple(alias.name for alias in node.names)
        self.found.append(_Statement(node.level, node.module, names, node.lineno, self._where[-1]))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._inside("in a function", ast.iter_child_nodes(node))

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._inside("in a function", ast.iter_child_nodes(node))

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._inside("in a function", ast.iter_child_nodes(node))

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._inside("under TYPE_CHECKING", node.body)
        for child in node.orelse:
            self.visit(child)


def _chain(name: str) -> list[str]:
    """``a.b.c`` -> ``[a, a.b, a.b.c]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _targets(
    statement: _Statement, importer: str, is_package: bool, modules: dict[str, Path]
) -> tuple[list[str], list[str]]:
    """Return (the package modules ``statement`` imports, the names it could not resolve)."""
    package = importer.split(".")[0]
    if statement.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        up = statement.level - 1
        if up >= len(base):
            return [], [f"{'.' * statement.level}{statement.module or ''} (beyond the top-level package)"]
        base = base[: len(base) - up]
        if statement.module:
            base += statement.module.split(".")
        origin = ".".join(base)
    else:
        origin = statement.module or ""
        if origin.split(".")[0] != package:
            return [], []  # not this package
    named: list[str] = []
    if statement.names is None:
        named.append(origin)
    else:
        for name in statement.names:
            named.append(f"{origin}.{name}" if f"{origin}.{name}" in modules else origin)
    missing = sorted({name for name in named if name not in modules})
    own = set(_chain(importer))  # the importer and its packages run before it: never new
    targets: dict[str, None] = {}
    for name in named:
        if name in modules:
            for step in _chain(name)[:-1]:  # the packages on the way, which run first
                if step not in own and step in modules:
                    targets[step] = None
            targets[name] = None
    targets.pop(importer, None)  # a module importing itself adds no edge
    return list(targets), missing


def collect_imports(modules: dict[str, Path]) -> tuple[list[Import], list[Problem]]:
    """Return every import of a package module by a package module, and the unresolved ones."""
    imports: list[Import] = []
    problems: list[Problem] = []
    for importer, path in modules.items():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as exc:
            problems.append(
                Problem(f"cannot parse {_show(path)}: {exc.msg} (line {exc.lineno})", (), (importer,))
            )
            continue
        collector = _Collector()
        collector.visit(tree)
        is_package = path.name == "__init__.py"
        for statement in collector.found:
            targets, missing = _targets(statement, importer, is_package, modules)
            for target in targets:
                imports.append(Import(importer, target, path, statement.line, statement.where))
            for name in missing:
                where = f"{_show(path)}:{statement.line}"
                problems.append(
                    Problem(f"unresolved import: {where} {importer} imports {name}", (), (importer,))
                )
    return imports, problems


def layer_of(module: str, layers: Layers) -> int:
    """Return the index in ``layers`` of the layer ``module`` belongs to (see :data:`LAYERS`)."""
    inner = module.split(".")[1:]  # the name inside the package
    steps = [".".join(inner[:i]) for i in range(1, len(inner) + 1)]
    for index in range(len(layers) - 1, 0, -1):
        if any(fnmatch.fnmatchcase(step, pattern) for pattern in layers[index][1] for step in steps):
            return index
    return 0


def _layer_problems(imports: Iterable[Import], package: str, layers: Layers) -> list[Problem]:
    problems: list[Problem] = []
    for edge in imports:
        if edge.importer == package:
            continue  # the facade may import anything
        where = f"{_show(edge.path)}:{edge.line} {edge.importer}"
        if edge.target == package:
            summary = (
                f"facade import: {where} imports the package {package} itself ({edge.where}); "
                "import the module that defines the name"
            )
        else:
            low, high = layer_of(edge.importer, layers), layer_of(edge.target, layers)
            if low >= high:
                continue
            summary = (
                f"upward import: {where} ({layers[low][0]}) imports {edge.target} ({layers[high][0]}) "
                f"({edge.where})"
            )
        problems.append(Problem(summary, (), (edge.importer, edge.target)))
    return problems


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, without recursion: the sets of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return sorted(found)


def elementary_cycles(graph: dict[str, list[str]], members: list[str], limit: int) -> list[tuple[str, ...]]:
    """Return the cycles among ``members`` (one strongly connected set), each starting at its
    smallest module, at most ``limit`` of them."""
    order = {name: i for i, name in enumerate(members)}
    cycles: list[tuple[str, ...]] = []
    for start in members:
        # Paths from ``start`` through larger members only, so each cycle is found once.
        path = [start]
        work = [iter(sorted(graph[start]))]
        while work and len(cycles) < limit:
            child = next(work[-1], None)
            if child is None:
                work.pop()
                path.pop()
            elif child == start:
                cycles.append((*path, start))
            elif child in order and order[child] > order[start] and child not in path:
                path.append(child)
                work.append(iter(sorted(graph[child])))
    return cycles


def check(root: Path, layers: Layers = LAYERS) -> Report:
    """Build the import graph of the package at ``root`` and return what is wrong with it."""
    modules = find_modules(root)
    imports, problems = collect_imports(modules)
    graph: dict[str, list[str]] = {name: [] for name in modules}
    by_edge: dict[tuple[str, str], list[Import]] = {}
    for edge in imports:
        key = (edge.importer, edge.target)
        if key not in by_edge:
            graph[edge.importer].append(edge.target)
        by_edge.setdefault(key, []).append(edge)
    cycles: list[tuple[str, ...]] = []
    for members in strongly_connected(graph):
        found = elementary_cycles(graph, members, MAX_CYCLES_PER_SET)
        cycles.extend(found)
        for cycle in found:
            details = tuple(
                f"{_show(edge.path)}:{edge.line} {a} imports {b} ({edge.where})"
                for a, b in itertools.pairwise(cycle)
                for edge in by_edge[(a, b)]
            )
            problems.append(Problem(f"cycle: {' -> '.join(cycle)}", details, cycle[:-1]))
        if len(found) == MAX_CYCLES_PER_SET:
            summary = f"cycles: more than {MAX_CYCLES_PER_SET} among {', '.join(members)}"
            problems.append(Problem(summary, (), tuple(members)))
    problems.extend(_layer_problems(imports, root.name, layers))
    return Report(len(modules), len(by_edge), tuple(cycles), tuple(problems))


def _show(path: Path) -> str:
    """``path`` relative to the working directory when under it, else as it is."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def parse_layer(text: str) -> tuple[str, tuple[str, ...]]:
    """``NAME=PATTERN,PATTERN`` (patterns may be empty: ``core=``) -> ``(NAME, (PATTERN, ...))``."""
    name, sep, patterns = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a layer is NAME=PATTERN[,PATTERN...], got {text!r}")
    return name, tuple(p for p in patterns.split(",") if p)


def main(argv: Sequence[str] | None = None) -> int:
    """Check the package and print the result; return the exit status (0: clean, 1: problems)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the package directory")
    parser.add_argument(
        "--layer",
        type=parse_layer,
        action="append",
        metavar="NAME=PATTERN[,PATTERN...]",
        help="a layer, lowest first (repeat; replaces the declared layers)",
    )
    parser.add_argument("--quiet", action="store_true", help="print the problems only, one line each")
    args = parser.parse_args(argv)
    if not (args.root / "__init__.py").is_file():
        parser.error(f"{args.root} is not a package (no __init__.py)")
    layers: Layers = args.layer or LAYERS
    report = check(args.root, layers)
    for problem in report.problems:
        print(problem.summary)
        if not args.quiet:
            for detail in problem.details:
                print(f"    {detail}")
    order = " < ".join(name for name, _ in layers)
    if report.problems:
        if not args.quiet:
            print(
                f"import graph of {args.root.name}: {len(report.problems)} problem(s), "
                f"{len(report.cycles)} cycle(s) (layers: {order})"
            )
        return 1
    if not args.quiet:
        print(
            f"import graph of {args.root.name}: {report.modules} modules, {report.imports} imports, "
            f"no cycle, no upward import (layers: {order})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
