"""The import-graph check (``.ci/import_graph.py``), on small packages written to a temporary
directory, and on ``stalebuf.ray``, whose graph is clean already."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "import_graph.py"
SRC_PACKAGE = Path(__file__).resolve().parent.parent / "src" / "stalebuf"
#: Two layers for the synthetic packages: ``pkg.app`` (and what is under it) above the rest.
LAYERS = (("core", ()), ("app", ("app",)))


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


import_graph = load_script()


def package(root: Path, files: dict[str, str]) -> Path:
    """Write the package ``pkg`` under ``root`` (file name -> source; ``__init__.py`` if not given)."""
    top = root / "pkg"
    for name, source in {"__init__.py": "", **files}.items():
        path = top / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return top


def check(top: Path) -> Any:
    return import_graph.check(top, LAYERS)


def summaries(report: Any) -> list[str]:
    return [problem.summary for problem in report.problems]


def test_a_cycle_only_the_type_checker_sees_is_a_cycle(tmp_path: Path) -> None:
    top = package(
        tmp_path,
        {
            "a.py": """
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from .b import B

                class A: ...
            """,
            "b.py": "from .a import A\n\nclass B(A): ...\n",
        },
    )
    report = check(top)
    assert report.cycles == (("pkg.a", "pkg.b", "pkg.a"),)
    assert summaries(report) == ["cycle: pkg.a -> pkg.b -> pkg.a"]
    (problem,) = report.problems
    assert any("pkg.a imports pkg.b (under TYPE_CHECKING)" in line for line in problem.details)
    assert any("pkg.b imports pkg.a (module level)" in line for line in problem.details)


def test_a_cycle_through_a_function_local_import_is_a_cycle(tmp_path: Path) -> None:
    top = package(
        tmp_path,
        {
            "a.py": """
                def late():
                    from . import b
                    return b
            """,
            "b.py": "import pkg.c\n",
            "c.py": "from pkg.a import late\n",
        },
    )
    report = check(top)
    assert report.cycles == (("pkg.a", "pkg.b", "pkg.c", "pkg.a"),)
    (problem,) = report.problems
    assert any("pkg.a imports pkg.b (in a function)" in line for line in problem.details)


def test_every_cycle_is_listed(tmp_path: Path) -> None:
    """Two cycles through one module are two chains, each printed once."""
    top = package(
        tmp_path,
        {"a.py": "from . import b, c\n", "b.py": "from .a import x\n", "c.py": "from .a import y\n"},
    )
    assert check(top).cycles == (("pkg.a", "pkg.b", "pkg.a"), ("pkg.a", "pkg.c", "pkg.a"))


def test_a_clean_package_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = package(
        tmp_path,
        {
            "__init__.py": "from .app.cli import main\nfrom .core import Thing\n",
            "core.py": "import os\n\nfrom .util import helper\n\nclass Thing: ...\n",
            "util.py": "def helper() -> None: ...\n",
            "sub/__init__.py": "from .inner import value\n",
            "sub/inner.py": "from .. import util\nfrom ..core import Thing\nvalue = 1\n",
            "app/__init__.py": "",
            "app/cli.py": """
                from typing import TYPE_CHECKING

                import pkg.sub.inner
                from pkg.sub import value

                if TYPE_CHECKING:
                    from ..core import Thing

                def main() -> None:
                    from . import helpers
            """,
            "app/helpers.py": "from ..util import helper\n",
        },
    )
    report = check(top)
    assert report.problems == ()
    assert report.modules == 8
    args = ["--root", str(top), "--layer", "core=", "--layer", "app=app"]
    assert import_graph.main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"import graph of pkg: 8 modules, {report.imports} imports, no cycle, no upward import "
        "(layers: core < app)"
    ]
    assert import_graph.main([*args, "--quiet"]) == 0
    assert capsys.readouterr().out == ""


def test_how_imports_resolve(tmp_path: Path) -> None:
    """``from .pkg import name`` imports pkg (and pkg.name when that is a module); ``from . import
    sub`` imports the submodule only; packages on the way to a module run first."""
    top = package(
        tmp_path,
        {
            "a.py": "from .sub import mod, name\nfrom . import b\n",
            "b.py": "import pkg.sub.mod\n",
            "sub/__init__.py": "name = 1\n",
            "sub/mod.py": "from . import other\n",
            "sub/other.py": "",
        },
    )
    modules = import_graph.find_modules(top)
    imports, problems = import_graph.collect_imports(modules)
    assert problems == []
    edges = {(edge.importer, edge.target) for edge in imports}
    assert edges == {
        ("pkg.a", "pkg.sub"),
        ("pkg.a", "pkg.sub.mod"),
        ("pkg.a", "pkg.b"),
        ("pkg.b", "pkg.sub"),
        ("pkg.b", "pkg.sub.mod"),
        ("pkg.sub.mod", "pkg.sub.other"),
    }


def test_an_import_up_the_layers_is_flagged(tmp_path: Path) -> None:
    top = package(
        tmp_path,
        {
            "core.py": "def late():\n    from .app.cli import main\n",
            "app/__init__.py": "",
            "app/cli.py": "def main() -> None: ...\n",
            "base.py": "from .app import cli\n",
        },
    )
    assert summaries(check(top)) == [
        f"upward import: {top / 'base.py'}:1 pkg.base (core) imports pkg.app (app) (module level)",
        f"upward import: {top / 'base.py'}:1 pkg.base (core) imports pkg.app.cli (app) (module level)",
        f"upward import: {top / 'core.py'}:2 pkg.core (core) imports pkg.app (app) (in a function)",
        f"upward import: {top / 'core.py'}:2 pkg.core (core) imports pkg.app.cli (app) (in a function)",
    ]


def test_importing_the_package_itself_is_flagged(tmp_path: Path) -> None:
    """The facade may import anything, but nothing may import the facade (a submodule by name is
    not the facade)."""
    top = package(
        tmp_path,
        {
            "__init__.py": "from .core import VERSION\n",
            "core.py": "VERSION = '1'\n",
            "app/__init__.py": "",
            "app/cli.py": "from .. import core\nfrom .. import VERSION\n",
        },
    )
    assert summaries(check(top)) == [
        f"facade import: {top / 'app' / 'cli.py'}:2 pkg.app.cli imports the package pkg itself "
        "(module level); import the module that defines the name"
    ]


def test_an_import_that_resolves_to_nothing_is_flagged(tmp_path: Path) -> None:
    top = package(tmp_path, {"a.py": "from .missing import x\nfrom ... import y\n"})
    assert summaries(check(top)) == [
        f"unresolved import: {top / 'a.py'}:1 pkg.a imports pkg.missing",
        f"unresolved import: {top / 'a.py'}:2 pkg.a imports ... (beyond the top-level package)",
    ]


def test_the_command_line_exits_1_and_prints_each_problem(tmp_path: Path) -> None:
    top = package(
        tmp_path,
        {"a.py": "from . import b\n", "b.py": "from . import a\nfrom .app import x\n", "app/__init__.py": ""},
    )
    command = [sys.executable, str(SCRIPT), "--root", str(top), "--layer", "core=", "--layer", "app=app"]
    quiet = subprocess.run([*command, "--quiet"], capture_output=True, text=True, check=False, cwd=tmp_path)
    assert quiet.returncode == 1
    assert quiet.stdout.splitlines() == [
        "cycle: pkg.a -> pkg.b -> pkg.a",
        "upward import: pkg/b.py:2 pkg.b (core) imports pkg.app (app) (module level)",
    ]
    loud = subprocess.run(command, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert loud.returncode == 1
    assert loud.stdout.splitlines() == [
        "cycle: pkg.a -> pkg.b -> pkg.a",
        "    pkg/a.py:1 pkg.a imports pkg.b (module level)",
        "    pkg/b.py:1 pkg.b imports pkg.a (module level)",
        "upward import: pkg/b.py:2 pkg.b (core) imports pkg.app (app) (module level)",
        "import graph of pkg: 2 problem(s), 1 cycle(s) (layers: core < app)",
    ]


def test_the_declared_layers_place_stalebuf_modules() -> None:
    layer = import_graph.layer_of
    names = [name for name, _ in import_graph.LAYERS]
    assert names == ["core", "prometheus", "ray", "simulate", "cli"]
    expected = {
        "stalebuf.buffer": "core",
        "stalebuf._partition": "core",
        "stalebuf.prometheus": "prometheus",
        "stalebuf._prometheus_samples": "prometheus",
        "stalebuf.ray": "ray",
        "stalebuf.ray._actor": "ray",
        "stalebuf.simulate._model": "simulate",
        "stalebuf.cli": "cli",
        "stalebuf.__main__": "cli",
    }
    assert {module: names[layer(module, import_graph.LAYERS)] for module in expected} == expected


def test_stalebuf_ray_has_no_cycle_and_no_upward_import() -> None:
    """Until the whole package is clean (and the check runs in CI), at least ``stalebuf.ray`` is."""
    report = import_graph.check(SRC_PACKAGE)
    in_ray = [
        problem.summary
        for problem in report.problems
        if any(module == "stalebuf.ray" or module.startswith("stalebuf.ray.") for module in problem.modules)
    ]
    assert in_ray == []
