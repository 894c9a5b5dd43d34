"""What ``stalebuf simulate`` writes: into a closed pipe, in the singular, the "long prompts"
cutoff shared by every column, the plot's formats and colours, and the docs' picture of the
default run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stalebuf.cli import main

SMALL = ["--steps", "20", "--batch-size", "4", "--group-size", "2", "--workers", "8"]
# Tight enough that drop evicts something and wait has to wait.
TIGHT = [*SMALL, "--threshold", "1", "--latency", "lognormal:2.3,1.0", "--train-step-seconds", "5"]
LABELS = ["drop", "drop+admission", "wait", "wait+admission"]
ROOT = Path(__file__).resolve().parent.parent
SIMULATE = [sys.executable, "-m", "stalebuf", "simulate"]


# -- a reader that stops reading early ------------------------------------------------------


def test_a_reader_gone_before_the_report_is_not_an_error(tmp_path: Path) -> None:
    """The reader closes the pipe before anything is written, so every write to stdout fails
    (deterministically); the run still finishes, writes its --json file and exits 0, silently."""
    read_end, write_end = os.pipe()
    reader = subprocess.run(  # a reader that closes its end at once, as `head -c 0` would
        [sys.executable, "-c", "pass"], stdin=read_end, timeout=60, check=True
    )
    assert reader.returncode == 0
    os.close(read_end)  # now the pipe has no reader left
    path = tmp_path / "out.json"
    try:
        proc = subprocess.run(
            [*SIMULATE, *SMALL, "--json", str(path)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert proc.stderr == ""  # no traceback, no "Broken pipe" line, no exit-time flush error
    assert proc.returncode == 0
    assert list(json.loads(path.read_text(encoding="utf-8"))["results"])  # the run was not cut short


def test_piping_into_a_reader_of_one_line(tmp_path: Path) -> None:
    """`stalebuf simulate | head -1`, with a Python reader that exits after one line. Whether
    the reader is gone before the simulator's last write is up to the scheduler (the test above
    forces it); either way the simulator must stay quiet and exit 0."""
    simulator = subprocess.Popen(
        [*SIMULATE, *SMALL, "--json", str(tmp_path / "out.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert simulator.stdout is not None
    reader = subprocess.run(
        [sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.readline())"],
        stdin=simulator.stdout,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    simulator.stdout.close()  # the reader had the only other read end
    _, err = simulator.communicate(timeout=120)
    assert reader.stdout.startswith("stalebuf simulate: 20 trainer steps")
    assert err == b""
    assert simulator.returncode == 0


# -- grammar ------------------------------------------------------------------------------------


def test_one_of_each_is_singular(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--steps", "1", "--batch-size", "1", "--group-size", "1", "--workers", "1"]
    assert main(["simulate", *argv, "--dispatch-ahead", "0", "--threshold", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    header = out.split("\n\n")[0].splitlines()
    assert header[0] == "stalebuf simulate: 1 trainer step x 1 group x 1 trajectory, 1 rollout worker"
    assert header[3] == "  without admission: 1 prompt kept dispatched (dispatch-ahead 0)"
    assert header[4] == (
        "  with admission: each worker loops rollout(); at most 1 group per dispatch step, 1 resident (T*S*B)"
    )
    plural = re.compile(r"\b1 (trainer steps|groups|trajectories|rollout workers|prompts)\b")
    assert not plural.search(out)


def test_two_of_each_is_plural(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--steps", "2", "--batch-size", "2", "--group-size", "2", "--workers", "2"]
    assert main(["simulate", *argv, "--dispatch-ahead", "0", "--no-progress"]) == 0
    header = capsys.readouterr().out.splitlines()
    assert header[0] == "stalebuf simulate: 2 trainer steps x 2 groups x 2 trajectories, 2 rollout workers"
    assert header[3] == "  without admission: 2 prompts kept dispatched (dispatch-ahead 0)"


# -- the "long prompts" cutoff ------------------------------------------------------------------


def long_prompts(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """Run with ``argv``; return each column's length bias and the cutoff the report prints."""
    path = tmp_path / "out.json"
    assert main(["simulate", *TIGHT, *argv, "--no-progress", "--json", str(path)]) == 0
    printed = re.search(r"^long prompts \(>= (.*?)\) in trained", capsys.readouterr().out, re.M)
    assert printed is not None
    results = json.loads(path.read_text(encoding="utf-8"))["results"]
    return {"printed": printed[1], **{label: r["length_bias"] for label, r in results.items()}}


def test_the_long_prompt_cutoff_is_the_same_whatever_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    every = long_prompts(tmp_path, capsys)
    printed = every.pop("printed")
    assert list(every) == LABELS
    cutoffs = {(bias["long_seconds"], bias["long_share_dispatched"]) for bias in every.values()}
    assert len(cutoffs) == 1  # one cutoff for every column of the report
    ((cutoff, share),) = cutoffs
    assert 0.0 < share <= 0.5
    # Drop, which drops long prompts, and wait, which does not, train different groups...
    assert every["drop"]["long_share_trained"] != every["wait"]["long_share_trained"]
    for argv in (
        ["--strategy", "drop", "--admission", "off"],
        ["--strategy", "wait", "--admission", "off"],
        ["--strategy", "wait", "--admission", "on"],
        ["--strategy", "drop", "--workers", "3", "--failure-rate", "0.2"],
    ):
        alone = long_prompts(tmp_path, capsys, *argv)
        assert alone.pop("printed") == printed, argv  # ...but "long" means the same whichever run
        for label, bias in alone.items():
            assert (bias["long_seconds"], bias["long_share_dispatched"]) == (cutoff, share), argv
            if label in every and "--workers" not in argv:
                assert bias == every[label]  # and each column is the one of the full report
    other_seed = long_prompts(tmp_path, capsys, "--seed", "1")
    assert other_seed["drop"]["long_seconds"] != cutoff  # it comes from the prompts, not a constant


# -- the plot ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "magic"),
    [
        ("sim.png", b"\x89PNG\r\n\x1a\n"),
        ("sim.PNG", b"\x89PNG\r\n\x1a\n"),
        ("sim.jpg", b"\xff\xd8\xff"),
        ("sim.jpeg", b"\xff\xd8\xff"),
    ],
)
def test_plot_writes_the_format_its_suffix_names(
    tmp_path: Path, name: str, magic: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / name
    assert main(["simulate", *SMALL, "--steps", "10", "--plot", str(path)]) == 0
    assert path.read_bytes().startswith(magic)
    assert f"wrote {path}" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["sim.gif", "sim.svg", "sim", "sim.png.txt"])
def test_plot_refuses_other_suffixes_before_simulating(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *SMALL, "--plot", str(tmp_path / name)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("stalebuf simulate: error: argument --plot: cannot write a plot to ")
    assert ".png, .jpg, .jpeg" in captured.err
    assert not list(tmp_path.iterdir())


def test_plot_colours_are_okabe_ito(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every colour the plot fills with is one of Okabe & Ito's colour-blind-safe palette."""
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    okabe_ito = {"#e69f00", "#56b4e9", "#009e73", "#f0e442", "#0072b2", "#d55e00", "#cc79a7", "#000000"}
    figures: list[Any] = []
    savefig = Figure.savefig

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        figures.append(self)
        savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    assert main(["simulate", *TIGHT, "--plot", str(tmp_path / "sim.png")]) == 0
    (figure,) = figures
    fills = {
        to_hex(color)
        for ax in figure.axes
        for artist in [*ax.patches, *ax.collections]
        for color in np.atleast_2d(artist.get_facecolor())
    }
    assert len(fills) == len(LABELS) + 2  # a colour per run, then busy and idle
    assert fills <= okabe_ito


# -- the docs' picture -------------------------------------------------------------------------


def test_the_docs_embed_the_default_plot_and_say_how_to_remake_it() -> None:
    page = (ROOT / "docs" / "simulate.md").read_text(encoding="utf-8")
    section = page.split("## The plot", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"!\[[^\]]+\]\(simulate\.png\)", section)
    command = "stalebuf simulate --no-progress --plot docs/simulate.png"
    assert f"```bash\n{command}\n```" in section
    assert command in (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    png = (ROOT / "docs" / "simulate.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    # Four runs at the size write_plot draws them (12.8 x 6.5 inches at 100 dpi).
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1280, 650)


# -- a closed stdout ------------------------------------------------------------------------------

TINY = ["--steps", "3", "--batch-size", "2", "--group-size", "1", "--workers", "2", "--no-progress"]


def test_a_closed_stdout_is_no_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: started with stdout closed (``stalebuf simulate >&-``), Python sets ``sys.stdout``
    to None: ``print`` drops the report, but the final flush raised AttributeError with a
    traceback."""
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["simulate", *TINY]) == 0
