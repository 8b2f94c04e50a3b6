"""The benchmarks' entry points (bench/): every benchmark is listed in bench.run_all, and a
failed run, a bad argument or an interrupt ends in one line on stderr and a non-zero exit
status, never a traceback. In-process: the failure is forced by replacing the module's
`options` (what every benchmark's `main` calls first) with one that raises."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest

from bench.report import one_line
from bench.run_all import BENCHMARKS
from tests.conftest import ROOT

ENTRIES = ["run_all", *BENCHMARKS]


def test_every_benchmark_is_in_run_all() -> None:
    """A bench/ module that builds a Report is a benchmark; run_all (and so CI's smoke
    run, which takes run_all's list) must know it."""
    found = {
        path.stem
        for path in (ROOT / "bench").glob("*.py")
        if path.name != "report.py" and "Report(" in path.read_text()
    }
    assert found, "the benchmarks build a bench.report.Report"
    assert sorted(found - set(BENCHMARKS)) == [], "add them to bench/run_all.py BENCHMARKS"
    assert sorted(set(BENCHMARKS) - found) == []
    assert len(BENCHMARKS) == len(set(BENCHMARKS))


def run_main(monkeypatch: pytest.MonkeyPatch, name: str, *argv: str) -> int:
    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / f"{name}.py"), *argv])
    with pytest.raises(SystemExit) as exited:
        module.main()
    code = exited.value.code
    assert isinstance(code, int)
    return code


def stderr_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("name", ENTRIES)
def test_failure_is_one_line(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("forced failure\n  with a second line")

    monkeypatch.setattr(importlib.import_module(f"bench.{name}"), "options", broken)
    assert run_main(monkeypatch, name) == 1
    assert stderr_line(capsys) == (
        f"python -m bench.{name}: failed: RuntimeError: forced failure with a second line"
    )


@pytest.mark.parametrize("name", ENTRIES)
def test_bad_argument_is_one_line(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(monkeypatch, name, "--no-such-flag") == 2
    assert stderr_line(capsys) == (
        f"python -m bench.{name}: unrecognized arguments: --no-such-flag "
        f"(see python -m bench.{name} --help)"
    )


def test_interrupt_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("bench.detect"), "options", interrupted)
    assert run_main(monkeypatch, "detect") == 130
    assert stderr_line(capsys) == "python -m bench.detect: interrupted"


def test_run_all_refuses_an_unknown_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(monkeypatch, "run_all", "--only", "detect,nope") == 2
    line = stderr_line(capsys)
    assert line.startswith("python -m bench.run_all: unknown benchmark(s) ['nope']"), line


def test_one_line_folds_and_caps() -> None:
    assert one_line(ValueError("a\n  b\tc")) == "ValueError: a b c"
    assert one_line(TimeoutError()) == "TimeoutError: TimeoutError()"
    long = one_line(RuntimeError("x" * 5000))
    assert len(long) == 600 and long.endswith("...")
