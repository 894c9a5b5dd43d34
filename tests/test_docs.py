"""The documentation: every Python block of ``docs/*.md`` and ``README.md`` runs as printed, and
what the pages promise about themselves holds (the README routes, the Guarantees name real tests).

Blocks are found by Sybil, which parses the Markdown (fenced blocks, HTML-comment directives) and
compiles each block at its own line of its ``.md`` file, so a failure points into the page. Each
block runs in a fresh namespace and a temporary working directory. A block that imports an
optional extra is skipped, with the reason, when the extra is missing; a block using Ray runs as a
script in a process of its own (its actors and its ``ray.init`` stay there). A block that cannot
run as printed is preceded by ``<!-- skip: next "illustrative: why" -->``; such blocks are few.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sybil import Example, Sybil
from sybil.evaluators.skip import If
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

import stalebuf

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = (*sorted((ROOT / "docs").glob("*.md")), README)
#: The optional extra that provides each module a block may import (by top-level name).
EXTRAS = {
    "ray": "ray",
    "prometheus_client": "prometheus",
    "matplotlib": "plot",
    "trio": "sim",
    "tqdm": "sim",
    "starlette": "examples",
    "uvicorn": "examples",
    "httpx": "examples",
    "omegaconf": "test",
}
#: At most this many blocks may be illustrative only: the pages are meant to be run.
MAX_ILLUSTRATIVE = 6
#: The README routes to the docs; the manual lives there. (300, not 250: the issues on versions,
#: filters, mixtures and token budgets each ask the README for a worked example.)
MAX_README_LINES = 300

_SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])


@dataclass(frozen=True)
class Block:
    """One Python block: its page, its index among the page's examples, its skip directive."""

    page: Path
    index: int
    line: int
    skip: str | None  # the reason of the ``skip: next`` directive right before it, if any

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _examples(page: Path) -> list[Example]:
    return list(_SYBIL.parse(page))


def _is_skip(example: Example) -> bool:
    return isinstance(example.parsed, tuple)  # SkipParser's (action, reason); a block is a str


def _blocks() -> Iterator[Block]:
    for page in PAGES:
        skip: str | None = None
        for index, example in enumerate(_examples(page)):
            if _is_skip(example):
                action, reason = example.parsed
                assert action == "next", f"{page.name}:{example.line}: only 'skip: next' is used"
                assert reason, f"{page.name}:{example.line}: a skip needs a reason"
                skip = reason
                continue
            yield Block(page, index, example.line, skip)
            skip = None


BLOCKS = tuple(_blocks())


def _skip_reason(directive: str) -> str | None:
    """What ``skip: next <directive>`` says: the reason to skip, or None to run the block."""
    directive = directive.strip()
    if directive.startswith("if"):  # if(condition, reason="...") as Sybil reads it
        reason: str | None = eval("if_" + directive[2:], {"if_": If(directive[2:])})
        return reason
    reason = eval(directive, {})
    assert isinstance(reason, str)
    return reason


def _missing_extra(source: str) -> str | None:
    """The extra a block needs that is not installed, if any."""
    for node in ast.walk(ast.parse(source)):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in EXTRAS and importlib.util.find_spec(top) is None:
                return EXTRAS[top]
    return None


def _imports(source: str, module: str) -> bool:
    return any(
        (isinstance(node, ast.Import) and any(a.name.split(".")[0] == module for a in node.names))
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == module)
        for node in ast.walk(ast.parse(source))
    )


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_the_block_runs_as_printed(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.skip is not None:
        reason = _skip_reason(block.skip)
        if reason:
            pytest.skip(reason)
    example = _examples(block.page)[block.index]
    source = str(example.parsed)
    extra = _missing_extra(source)
    if extra is not None:
        pytest.skip(f"needs the {extra} extra: pip install 'stalebuf[{extra}]'")
    monkeypatch.chdir(tmp_path)
    if _imports(source, "ray") or _imports(source, "stalebuf.ray"):
        _run_as_script(source, tmp_path)
        return
    example.namespace.clear()
    example.namespace["__name__"] = "__docs__"
    example.evaluate()


def _run_as_script(source: str, directory: Path) -> None:
    script = directory / "block.py"
    script.write_text(source, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(stalebuf.__file__).resolve().parent.parent)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_the_pages_have_blocks_and_illustrative_ones_are_few() -> None:
    pages = {block.page for block in BLOCKS}
    assert README in pages
    assert {"index.md", "concepts.md", "producers.md", "trainers.md", "flow-control.md"} <= {
        page.name for page in pages
    }
    illustrative = [block for block in BLOCKS if block.skip and not block.skip.strip().startswith("if")]
    for block in illustrative:
        reason = _skip_reason(block.skip or "")
        assert reason is not None, str(block)
        assert reason.startswith("illustrative: "), f"{block}: {reason!r}"
    assert len(illustrative) <= MAX_ILLUSTRATIVE, [str(block) for block in illustrative]


def test_the_ray_page_shows_the_ray_example_file() -> None:
    """docs/ray.md's first block is examples/ray_quickstart.py (after its docstring and future
    import), so the file a user runs is the one the tests run."""
    example = (ROOT / "examples" / "ray_quickstart.py").read_text(encoding="utf-8")
    body = example.split("from __future__ import annotations\n\n", 1)[1]
    first = next(block for block in BLOCKS if block.page.name == "ray.md")
    assert str(_examples(first.page)[first.index].parsed) == body


# -- the README routes ------------------------------------------------------------------------


def test_the_readme_is_short_and_its_links_into_the_docs_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES
    targets = re.findall(r"\]\(((?:docs/)[^)#\s]+)(?:#[^)\s]*)?\)", text)
    assert {"docs/index.md", "docs/concepts.md", "docs/from-verl.md"} <= set(targets)
    for target in targets:
        assert (ROOT / target).is_file(), target


def test_the_readme_keeps_the_two_set_up_commands_that_ci_runs() -> None:
    text = README.read_text(encoding="utf-8")
    commands = re.findall(r"```bash\n(python3 -m venv .*)\n```", text)
    assert commands == [
        "python3 -m venv .venv && . .venv/bin/activate && pip install '.[sim]' && stalebuf simulate",
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && pytest",
    ]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install --quiet '.[sim]'" in ci
    assert "pip install --quiet -e '.[test]'" in ci


# -- the Guarantees name tests that exist --------------------------------------------------------


def test_every_test_the_guarantees_name_exists() -> None:
    """``tests/file.py::name`` and the ``::name`` that follow it (same file) are defined there."""
    text = (ROOT / "docs" / "guarantees.md").read_text(encoding="utf-8")
    named = 0
    current: Path | None = None
    for match in re.finditer(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", text):
        path, name = match.groups()
        if path:
            current = ROOT / path
            assert current.is_file(), path
        if name:
            assert current is not None, name
            source = current.read_text(encoding="utf-8")
            defined = re.search(rf"^(?:async def|def|class) {name}\b|^{name} = ", source, re.M)
            assert defined, f"{current}::{name}"
            named += 1
    assert named >= 20
