"""``--latency empirical:PATH[#COLUMN]`` and ``--latency lognormal-fit:MEDIAN,P95``.

Files are written to ``tmp_path``; runs are small, so the module takes a few seconds.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import NormalDist
from typing import Any

import pytest

from stalebuf.cli import main
from stalebuf.errors import ConfigError
from stalebuf.simulate import Latency, SimulationConfig, _empirical, simulate
from stalebuf.simulate._bounds import MAX_FILE_BYTES

SMALL = ["--steps", "10", "--batch-size", "4", "--group-size", "2", "--workers", "8"]
TIMES = (12.5, 30.0, 45.25, 200.0, 8.0)


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def simulate_json(tmp_path: Path, *args: str) -> dict[str, Any]:
    """Run ``stalebuf simulate`` in-process and return its JSON results, by column."""
    out = tmp_path / "out.json"
    assert main(["simulate", *SMALL, *args, "--no-progress", "--json", str(out)]) == 0
    results: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))["results"]
    return results


# -- empirical: the file formats ------------------------------------------------------------


RECORDS = [{"uid": f"u{i}", "seconds": t, "tokens": 100 * i} for i, t in enumerate(TIMES)]
FORMATS: dict[str, tuple[str, str]] = {
    # id: (file name + "#column" if any, contents)
    "lines": ("times.txt", "12.5\n30\n\n45.25\n  200  \n8\n"),
    "lines, CRLF and no final newline": ("times.log", "12.5\r\n30\r\n45.25\r\n200\r\n8"),
    "json array": ("times.json", json.dumps(list(TIMES))),
    "json records#column": ("times.json#seconds", json.dumps(RECORDS)),
    "json columns#column": ("times.json#seconds", json.dumps({"seconds": TIMES, "uid": ["a"] * 5})),
    "jsonl#column": ("times.jsonl#seconds", "\n".join(map(json.dumps, RECORDS)) + "\n\n"),
    "ndjson#column": ("times.ndjson#seconds", "\n".join(map(json.dumps, RECORDS))),
    "csv#column": (
        "times.csv#seconds",
        "uid,seconds,tokens\n" + "".join(f'u{i},"{t}",{i}\n' for i, t in enumerate(TIMES)),
    ),
    "csv with a byte-order mark and blank lines": (
        "times.csv#seconds",
        "\ufeffseconds,uid\n12.5,a\n\n30,b\n45.25,c\n200,d\n8,e\n",
    ),
    "csv#column, any suffix": ("rollouts.log#seconds", "seconds\n12.5\n30\n45.25\n200\n8\n"),
}


@pytest.mark.parametrize(("target", "text"), list(FORMATS.values()), ids=list(FORMATS))
def test_empirical_reads_every_format(tmp_path: Path, target: str, text: str) -> None:
    name, _, column = target.partition("#")
    path = write(tmp_path, name, text)
    spec = f"empirical:{path}" + (f"#{column}" if column else "")
    latency = Latency.parse(spec)
    assert latency.kind == "empirical"
    assert latency.params == TIMES
    assert str(latency) == spec  # what the JSON output records, and parse reads back
    assert Latency.parse(str(latency)) == latency


def test_a_path_with_a_hash_that_exists_is_read_whole(tmp_path: Path) -> None:
    path = write(tmp_path, "run#3.txt", "5\n6\n")
    assert Latency.parse(f"empirical:{path}").params == (5.0, 6.0)


def test_the_column_chooses_which_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, "log.csv", "seconds,tokens\n1.5,300\n2.5,400\n")
    assert Latency.parse(f"empirical:{path}#seconds").params == (1.5, 2.5)
    assert Latency.parse(f"empirical:{path}#tokens").params == (300.0, 400.0)


def test_empirical_resamples_the_values_with_the_seed() -> None:
    latency = Latency("empirical", TIMES)
    draws = [latency.sample(random.Random(7)) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]  # deterministic given the seed
    rng = random.Random(0)
    many = [latency.sample(rng) for _ in range(2000)]
    assert set(many) == set(TIMES)  # only the file's values, every one of them
    assert max(many.count(t) for t in TIMES) < 2 * min(many.count(t) for t in TIMES)  # uniformly
    assert latency.mean == pytest.approx(sum(TIMES) / len(TIMES))
    assert latency.quantile(0.5) == 30.0
    assert latency.quantile(0.75) == 45.25


def test_an_empirical_run_is_reproducible_and_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "t.csv", "s\n" + "".join(f"{t}\n" for t in TIMES))
    spec = f"empirical:{path}#s"
    first = simulate_json(tmp_path, "--latency", spec, "--seed", "3")
    out = capsys.readouterr().out
    assert f"generation time per group: {spec}, 5 values resampled (median 30.0 s," in out
    again = simulate_json(tmp_path, "--latency", spec, "--seed", "3")
    other = simulate_json(tmp_path, "--latency", spec, "--seed", "4")
    assert first == again
    assert first != other
    assert {result["config"]["latency"] for result in first.values()} == {spec}
    config = SimulationConfig(steps=5, batch_size=2, workers=2, latency=Latency.parse(spec))
    lengths = simulate(config).length_bias
    assert min(TIMES) <= lengths.mean_seconds_dispatched <= max(TIMES)


# -- empirical: bad files -------------------------------------------------------------------

BAD_FILES: dict[str, tuple[str | None, str, str]] = {
    # id: (file name, or None for no file; contents; text the error line must hold)
    "missing file": (None, "", "cannot read"),
    "not a number": ("t.txt", "12\nabc\n", "line 2: expected a number of seconds > 0, got 'abc'"),
    "negative": ("t.txt", "12\n-3\n", "line 2: expected a number of seconds > 0, got '-3'"),
    "zero": ("t.txt", "0\n", "line 1: expected a number of seconds > 0"),
    "nan": ("t.txt", "nan\n", "line 1: expected a number of seconds > 0"),
    "empty": ("t.txt", "\n\n", "holds no generation times"),
    "binary": ("t.txt", "", "is not a UTF-8 text file"),
    "csv without a column": ("t.csv", "uid,seconds\na,1\n", "choose a column with empirical:"),
    "csv, no such column": ("t.csv#secs", "uid,seconds\na,1\n", "has no column 'secs'"),
    "csv, empty cell": ("t.csv#seconds", "uid,seconds\na,1\nb,\n", "line 3, column 'seconds'"),
    "csv, short row": ("t.csv#seconds", "uid,seconds\na,1\nb\n", "line 3, column 'seconds'"),
    "csv, header only": ("t.csv#seconds", "uid,seconds\n", "holds no generation times"),
    "json, invalid": ("t.json", "[1, 2", "is not valid JSON"),
    "json, records without a column": ("t.json", '[{"s": 1}]', "holds objects: choose a column"),
    "json, a string": ("t.json", '[1, "2", 3]', "item 1: expected a number of seconds > 0, got '2'"),
    "json, bool": ("t.json", "[1, true]", "item 1: expected a number of seconds > 0, got True"),
    "json, no such field": ("t.json#x", '[{"s": 1}]', "item 0 has no field 'x'"),
    "json, not an object": ("t.json#s", '[{"s": 1}, 2]', "item 1: expected an object"),
    "json, no such array": ("t.json#x", '{"s": [1]}', "has no array 'x'"),
    "json, a scalar": ("t.json", "3", "must hold a JSON array of numbers"),
    "jsonl, invalid line": ("t.jsonl#s", '{"s": 1}\n{"s": \n', "line 2 is not valid JSON"),
    "jsonl, missing field": ("t.jsonl#s", '{"s": 1}\n{"t": 2}\n', "line 2 has no field 's'"),
    "jsonl without a column": ("t.jsonl", '{"s": 1}\n', "holds objects: choose a column"),
    # Issue 21 item 10: a directory is refused by its kind, before it is opened.
    "a directory": ("", "", "cannot read {target!r}: it is a directory, not a regular file"),
}


@pytest.mark.parametrize(("name", "text", "needle"), list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_a_bad_file_is_one_line_and_exit_2(
    tmp_path: Path, name: str | None, text: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if name is None:
        target = str(tmp_path / "missing.txt")
    elif name == "":
        target = str(tmp_path)
    else:
        file_name, _, column = name.partition("#")
        path = tmp_path / file_name
        if needle.endswith("UTF-8 text file"):
            path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
        else:
            path.write_text(text, encoding="utf-8")
        target = str(path) + (f"#{column}" if column else "")
    assert_refused(target, needle.format(target=target), capsys)


def assert_refused(target: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--latency empirical:TARGET`` is one error line holding ``needle``, with exit status 2;
    ``Latency.parse`` raises the same as a ConfigError."""
    assert main(["simulate", *SMALL, "--latency", f"empirical:{target}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # it fails before simulating
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("stalebuf simulate: error: argument --latency: empirical latency")
    assert needle in captured.err
    assert "Traceback" not in captured.err
    with pytest.raises(ConfigError, match=r"^empirical latency"):
        Latency.parse(f"empirical:{target}")


DEEP = "[" * 100_000 + "]" * 100_000
NESTED_TOO_DEEPLY: dict[str, tuple[str, str, str]] = {
    # id: (file name + "#column" if any; contents; text the error line must hold)
    "json": ("t.json", DEEP, "t.json' nests arrays or objects too deeply to read"),
    "json#column": ("t.json#s", f'{{"s": {DEEP}}}', "t.json' nests arrays or objects too deeply"),
    "jsonl": ("t.jsonl", f"1\n{DEEP}\n", "t.jsonl' line 2 nests arrays or objects too deeply"),
    "jsonl#column": ("t.jsonl#s", f'{{"s": 1}}\n{{"s": {DEEP}}}\n', "t.jsonl' line 2 nests arrays"),
}


@pytest.mark.parametrize(
    ("name", "text", "needle"), list(NESTED_TOO_DEEPLY.values()), ids=list(NESTED_TOO_DEEPLY)
)
def test_json_nested_too_deeply_is_one_line_and_exit_2(
    tmp_path: Path, name: str, text: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 21 item 7: a deeply nested .json or .jsonl ("[[[[...") made the JSON parser raise
    RecursionError, which escaped as a traceback with exit status 1."""
    file_name, _, column = name.partition("#")
    path = write(tmp_path, file_name, text)
    assert_refused(path + (f"#{column}" if column else ""), needle, capsys)


def test_json_nested_within_reason_is_read(tmp_path: Path) -> None:
    """The fix of issue 21 item 7 refuses only what the parser cannot read: records with nested
    fields a few levels deep are read as before."""
    meta = "[" * 50 + "]" * 50
    path = write(tmp_path, "t.jsonl", "".join(f'{{"s": {t}, "meta": {meta}}}\n' for t in TIMES))
    assert Latency.parse(f"empirical:{path}#s").params == TIMES


HUGE = "9" * 5000  # more digits than int() converts (4,300 by default)
AT_MOST = "expected at most 1e+12 seconds, got"
HUGE_NUMBERS: dict[str, tuple[str, str, str]] = {
    # id: (file name + "#column" if any; contents; text the error line must hold)
    "json array": ("t.json", f"[1, {HUGE}]", f"item 1: {AT_MOST} a number of 5,000 digits"),
    "json array, negative": (
        "t.json",
        f"[1, -{HUGE}]",
        "item 1: expected a number of seconds > 0, got a number of 5,000 digits",
    ),
    "json records#column": ("t.json#s", f'[{{"s": {HUGE}}}]', f"item 0, field 's': {AT_MOST} a number of"),
    "json columns#column": ("t.json#s", f'{{"s": [2, {HUGE}]}}', f"s[1]: {AT_MOST} a number of 5,000"),
    "jsonl#column": ("t.jsonl#s", f'{{"s": 1}}\n{{"s": {HUGE}}}\n', f"line 2, field 's': {AT_MOST} a number"),
    "jsonl": ("t.jsonl", f"1\n{HUGE}\n", f"line 2: {AT_MOST} a number of 5,000 digits"),
    # Fewer digits than that: an int, but too large for a float. It was called "not > 0".
    "json, an int of 400 digits": ("t.json", f"[{'9' * 400}]", f"item 0: {AT_MOST} an int of 1329 bits"),
    # As text, float() reads any length, as inf. It was called "not > 0" too.
    "lines": ("t.txt", f"1\n{HUGE}\n", f"line 2: {AT_MOST} '99999"),
    "csv#column": ("t.csv#s", f"s\n{HUGE}\n", f"line 2, column 's': {AT_MOST} '99999"),
}


@pytest.mark.parametrize(("name", "text", "needle"), list(HUGE_NUMBERS.values()), ids=list(HUGE_NUMBERS))
def test_a_number_of_thousands_of_digits_is_one_line_and_exit_2(
    tmp_path: Path, name: str, text: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 21 item 7: a JSON number of more than 4,300 digits made int() raise inside the
    parser, and the line said only "invalid _latency_option value"; now it says where the
    number is and that it is too large (a huge number was also called "not > 0")."""
    file_name, _, column = name.partition("#")
    path = write(tmp_path, file_name, text)
    assert_refused(path + (f"#{column}" if column else ""), needle, capsys)


def test_a_huge_number_in_another_field_is_ignored(tmp_path: Path) -> None:
    """Issue 21 item 7: a number of thousands of digits in a field that is not the column (an id)
    is none of the times: the file is read (it made the whole file unreadable)."""
    records = "".join(f'{{"id": {HUGE}, "s": {t}}}\n' for t in TIMES)
    jsonl = write(tmp_path, "t.jsonl", records)
    array = write(tmp_path, "t.json", "[" + records.strip().replace("\n", ",") + "]")
    assert Latency.parse(f"empirical:{jsonl}#s").params == TIMES
    assert Latency.parse(f"empirical:{array}#s").params == TIMES


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m stalebuf`` in a subprocess that cannot outlive 60 s: a read that blocks
    fails the test instead of hanging the suite."""
    return subprocess.run(
        [sys.executable, "-m", "stalebuf", *argv], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    """Issue 21 item 10: a FIFO was opened and read like a file, which waits for a writer:
    forever, for one nobody writes to. It is refused from its kind, one line, exit 2."""
    fifo = tmp_path / "times.txt"
    os.mkfifo(fifo)
    proc = run_cli("simulate", *SMALL, "--latency", f"empirical:{fifo}")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (
        f"stalebuf simulate: error: argument --latency: empirical latency: cannot read {str(fifo)!r}: "
        "it is a FIFO (named pipe), not a regular file\n"
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_that_replaced_the_file_after_its_check_does_not_block(tmp_path: Path) -> None:
    """Issue 21 item 10: the kind is checked again on what was opened, and the open does not
    wait for a writer: a FIFO swapped in between the check and the open is refused at once."""
    fifo, regular = tmp_path / "times.txt", write(tmp_path, "regular.txt", "1\n")
    os.mkfifo(fifo)
    # The path's check sees a regular file (as if the FIFO came just after it); the open gets the FIFO.
    code = (
        "import os, sys\n"
        "from stalebuf.cli import main\n"
        "real_stat = os.stat\n"
        "os.stat = lambda path, *args, **kwargs: real_stat(sys.argv[2], *args, **kwargs)\n"
        "sys.exit(main(['simulate', '--latency', 'empirical:' + sys.argv[1]]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(fifo), regular],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(": it is a FIFO (named pipe), not a regular file\n")
    assert proc.stderr.count("\n") == 1


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_a_device_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 21 item 10: a device was read like a file (/dev/null as an empty one, /dev/zero
    without end); it is refused from its kind, one line, exit 2."""
    assert main(["simulate", *SMALL, "--latency", "empirical:/dev/null"]) == 2
    assert capsys.readouterr().err == (
        "stalebuf simulate: error: argument --latency: empirical latency: cannot read '/dev/null': "
        "it is a character device, not a regular file\n"
    )


def test_a_huge_file_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 21 item 10: the whole file was read before it was checked, so a 3 GB file given
    by mistake raised MemoryError (or took minutes). It is refused from its size, unread."""
    path = tmp_path / "model.json"
    with open(path, "wb") as file:
        file.truncate(3 * 2**30)  # sparse: it takes no disk
    reads: list[int] = []
    real_read = os.read

    def counted_read(fd: int, size: int) -> bytes:
        reads.append(size)
        return real_read(fd, size)

    monkeypatch.setattr(os, "read", counted_read)
    start = time.monotonic()
    assert main(["simulate", *SMALL, "--latency", f"empirical:{path}"]) == 2
    assert time.monotonic() - start < 10  # reading 3 GB would take longer; refusing takes no time
    assert reads == []
    assert capsys.readouterr().err == (
        f"stalebuf simulate: error: argument --latency: empirical latency: {str(path)!r} is "
        "3,221,225,472 bytes, more than the 32 MiB a latency file may hold; keep only the generation "
        "times (one number per line is the smallest form)\n"
    )
    largest = tmp_path / "times.txt"  # the largest file read: one time, then blanks
    largest.write_bytes(b"1.5\n".ljust(MAX_FILE_BYTES, b" "))
    assert Latency.parse(f"empirical:{largest}").params == (1.5,)
    assert reads
    assert max(reads) <= 2**20  # read in chunks


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_a_file_longer_than_its_size_is_read_only_up_to_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 21 item 10: a file's size is not always its length (a /proc file says 0 bytes, a log
    grows while it is read), so the bound is also kept while reading: it stops past it."""
    monkeypatch.setattr(_empirical, "MAX_FILE_BYTES", 100)
    with pytest.raises(ConfigError, match=r"^empirical latency: '/proc/self/status' holds more than "):
        Latency.parse("empirical:/proc/self/status")


def test_a_path_with_a_nul_is_a_config_error() -> None:
    """A NUL in the path made Latency.parse raise the bare ValueError of open (not OSError);
    checked before it is opened now, it is a ConfigError like every other unreadable path."""
    with pytest.raises(ConfigError, match=r"^empirical latency: cannot read 'a\\x00b': embedded null byte$"):
        Latency.parse("empirical:a\0b")


@pytest.mark.parametrize("spec", ["empirical:", "empirical:#seconds", "empirical:t.csv#"])
def test_an_incomplete_empirical_spec_is_rejected(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"^empirical latency needs"):
        Latency.parse(spec)


@pytest.mark.parametrize(
    ("params", "needle"),
    [((), "at least one"), ((1.0, 0.0), "must be > 0"), ((1.0, -2.0), "must be > 0")],
)
def test_empirical_values_must_be_positive(params: tuple[float, ...], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Latency("empirical", params)


# -- lognormal-fit ----------------------------------------------------------------------------


def test_lognormal_fit_has_the_median_and_p95_asked_for() -> None:
    latency = Latency.parse("lognormal-fit:30,155")
    mu, sigma = latency.params
    assert latency.kind == "lognormal"
    assert mu == pytest.approx(math.log(30))
    assert sigma == pytest.approx((math.log(155) - math.log(30)) / NormalDist().inv_cdf(0.95))
    assert (round(mu, 4), round(sigma, 4)) == (3.4012, 0.9984)
    assert latency.quantile(0.5) == pytest.approx(30.0)
    assert latency.quantile(0.95) == pytest.approx(155.0)
    assert str(latency) == "lognormal-fit:30,155"
    assert Latency.parse(str(latency)) == latency
    # The fitted distribution draws exactly like the lognormal it fitted.
    plain = Latency("lognormal", latency.params)
    assert latency.sample(random.Random(1)) == plain.sample(random.Random(1))
    narrow = Latency.parse("lognormal-fit:10,10")  # median = p95: no spread at all
    assert narrow.params == (pytest.approx(math.log(10)), 0.0)


def test_the_header_prints_the_fitted_mu_and_sigma(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", *SMALL, "--latency", "lognormal-fit:30,155", "--strategy", "drop"]
    assert main([*argv, "--admission", "off", "--no-progress"]) == 0
    header = capsys.readouterr().out.splitlines()[2]
    assert header == (
        "  generation time per group: lognormal-fit:30,155, fitted MU,SIGMA = 3.4012,0.9984 "
        "(median 30.0 s, mean 49.4 s, p95 155 s)"
    )


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("lognormal-fit:30", "needs MEDIAN,P95, got 1 number(s)"),
        ("lognormal-fit:30,155,2", "needs MEDIAN,P95, got 3 number(s)"),
        ("lognormal-fit:155,30", "needs 0 < MEDIAN <= P95"),
        ("lognormal-fit:0,30", "needs 0 < MEDIAN <= P95"),
        ("lognormal-fit:-1,30", "needs 0 < MEDIAN <= P95"),
        ("lognormal-fit:30,inf", "needs 0 < MEDIAN <= P95"),
        ("lognormal-fit:a,b", "must be numbers"),
        ("lognormal-fit:1,1e9", "fits MU=0.0000, SIGMA=12.5989, out of range"),
    ],
)
def test_a_bad_fit_is_one_line_and_exit_2(spec: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL, "--latency", spec]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("stalebuf simulate: error: argument --latency: ")
    assert needle in captured.err


# -- latency files and values the command line turned into a traceback or a hang -------------------

TINY = ["--steps", "3", "--batch-size", "2", "--group-size", "1", "--workers", "2", "--no-progress"]


def test_a_csv_with_bare_carriage_return_line_endings_is_read(tmp_path: Path) -> None:
    """Defect: old spreadsheet exports end rows with a lone CR; csv raised "new-line character
    seen in unquoted field" through the CLI as a traceback."""
    path = write(tmp_path, "times.csv", "uid,seconds\ra,12.5\rb,30\r")
    assert Latency.parse(f"empirical:{path}#seconds").params == (12.5, 30.0)


def test_a_csv_field_over_the_csv_size_limit_is_one_error_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect: a field over the csv module's size limit ended ``stalebuf simulate`` in a
    traceback instead of one error line and exit status 2."""
    path = write(tmp_path, "big.csv", "seconds\n" + "1" * 200_000 + "\n")
    assert main(["simulate", *TINY, "--latency", f"empirical:{path}#seconds"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("stalebuf simulate: error: argument --latency: empirical latency")


@pytest.mark.parametrize("spec", ["fixed:1e308", "exponential:1e300"])
def test_a_huge_parametric_latency_is_refused_with_exit_2(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect: fixed:1e308 ended in an OverflowError traceback, and 1e300 in a report of
    300-digit numbers (the virtual clock had lost the train step to rounding)."""
    assert main(["simulate", *TINY, "--latency", spec]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "argument --latency" in err


def test_a_huge_empirical_time_is_refused(tmp_path: Path) -> None:
    """Defect: an empirical file of 1e308 made ``stalebuf simulate`` run forever."""
    path = write(tmp_path, "times.txt", "30\n1e308\n")
    with pytest.raises(ConfigError, match=r"line 2"):
        Latency.parse(f"empirical:{path}")
    with pytest.raises(ConfigError):
        Latency("empirical", (30.0, 1e308))
