"""What every benchmark prints: flags, statistics, tables, JSON, the machine."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

# --------------------------------------------------------------------------- flags


def program() -> str:
    """How this benchmark was started: `python -m bench.NAME`."""
    return f"python -m bench.{Path(sys.argv[0]).stem}"


class _Parser(argparse.ArgumentParser):
    """argparse with its usage + error lines turned into one line, exit status 2, as the
    `dynamod` CLI answers bad input."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def options(description: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=program(), description=description)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: fewer repetitions, seconds not minutes"
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    return parser


def redraw_args(usage: str, benchmark: str, key: str) -> tuple[list[Any], Path]:
    """A picture tool's two arguments (`python -m bench.X_plot RESULTS.json OUT`): the
    `data[key]` list of a `python -m bench.BENCHMARK --json` output, and OUT. Anything else
    ends in one line on stderr and exit status 2."""
    prog = program()
    if len(sys.argv) != 3:
        print(f"usage: {prog} {usage}", file=sys.stderr)
        sys.exit(2)
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        found = json.loads(source.read_text())["data"][key]
        if not isinstance(found, list):
            raise TypeError(f"data.{key} is not a list")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"{prog}: {source}: not a bench.{benchmark} --json output ({exc})", file=sys.stderr)
        sys.exit(2)
    return found, out


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and message, whitespace folded, at most 600
    characters (a failed subprocess's output can be long)."""
    text = " ".join(str(exc).split()) or repr(exc)
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 600 else text[:597] + "..."


def entry(main: Callable[[], None]) -> Callable[[], None]:
    """A benchmark's `main`: a failure ends in one line on stderr (`python -m bench.NAME:
    failed: ...`) and exit status 1, an interrupt in exit status 130, never in a
    traceback. The sweep of what it started still runs (bench.procs registers it atexit)."""

    @functools.wraps(main)
    def run() -> None:
        try:
            main()
        except KeyboardInterrupt:
            print(f"{program()}: interrupted", file=sys.stderr, flush=True)
            sys.exit(130)
        except Exception as exc:
            print(f"{program()}: failed: {one_line(exc)}", file=sys.stderr, flush=True)
            sys.exit(1)

    return run


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(values: Iterable[float]) -> dict[str, float]:
    data = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not data:
        return {
            "n": 0,
            "median": math.nan,
            "p95": math.nan,
            "p99": math.nan,
            "min": math.nan,
            "max": math.nan,
        }
    return {
        "n": len(data),
        "median": statistics.median(data),
        "p95": percentile(data, 95),
        "p99": percentile(data, 99),
        "min": min(data),
        "max": max(data),
    }


def rising_counts(text: str, flag: str, example: str) -> list[int]:
    """A comma-separated flag of rising counts from 1 ("1,8,32"), the first the reference
    every ratio is to; ValueError naming the flag otherwise."""
    wrong = ValueError(f"{flag} {text!r}: rising counts starting at 1, e.g. {example}")
    try:
        counts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise wrong from None
    if not counts or counts[0] != 1 or counts != sorted(set(counts)):
        raise wrong
    return counts


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and abs(value) < 10**-digits:
            return f"{value:.2g}"
        return f"{value:.{digits}f}"
    return str(value)


# --------------------------------------------------------------------------- reporting


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    digits: int = 1

    def render(self) -> str:
        cells = [[fmt(c, self.digits) for c in row] for row in self.rows]
        widths = [len(h) for h in self.headers]
        for row in cells:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        line = "| " + " | ".join(h.ljust(w) for h, w in zip(self.headers, widths, strict=True))
        out = [
            f"### {self.title}",
            "",
            line + " |",
            "|" + "|".join("-" * (w + 2) for w in widths) + "|",
        ]
        for row in cells:
            out.append(
                "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
            )
        return "\n".join(out)


@dataclass
class Report:
    """One benchmark's results: tables for people, `data` for machines, targets judged."""

    name: str
    title: str
    quick: bool
    tables: list[Table] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    load_at_start: list[float] = field(
        default_factory=lambda: [round(x, 2) for x in os.getloadavg()]
    )

    def target(
        self, name: str, measured: float, limit: float, unit: str, *, lower_is_better: bool = True
    ) -> None:
        met = measured <= limit if lower_is_better else measured >= limit
        if math.isnan(measured):
            met = False
        self.targets.append(
            {"target": name, "measured": measured, "limit": limit, "unit": unit, "met": met}
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            "title": self.title,
            "quick": self.quick,
            "seconds": round(time.time() - self.started, 1),
            "machine": machine(),
            "loadavg_at_start": self.load_at_start,
            "command": " ".join(
                [Path(sys.executable).name, "-m", f"bench.{self.name}", *sys.argv[1:]]
            ),
            "tables": [
                {"title": t.title, "headers": t.headers, "rows": t.rows, "digits": t.digits}
                for t in self.tables
            ],
            "targets": self.targets,
            "notes": self.notes,
            "data": self.data,
        }

    def render(self) -> str:
        out = [f"## {self.title}" + (" (quick)" if self.quick else ""), ""]
        for table in self.tables:
            out += [table.render(), ""]
        if self.targets:
            judged = Table("Targets", ["target", "measured", "limit", "met"], digits=3)
            for t in self.targets:
                judged.rows.append(
                    [
                        t["target"],
                        f"{fmt(t['measured'], 3)} {t['unit']}",
                        f"{fmt(t['limit'], 3)} {t['unit']}",
                        t["met"],
                    ]
                )
            out += [judged.render(), ""]
        out += [f"- {note}" for note in self.notes]
        out.append(f"\n(took {time.time() - self.started:.0f} s)")
        return "\n".join(out)


def render_json(result: dict[str, Any]) -> str:
    """A benchmark's --json output rendered as its table report again."""
    report = Report(
        result["benchmark"],
        result["title"],
        result["quick"],
        notes=list(result["notes"]),
        targets=list(result["targets"]),
    )
    report.tables = [
        Table(t["title"], t["headers"], t["rows"], digits=t.get("digits", 2))
        for t in result["tables"]
    ]
    text = report.render()
    return text.rsplit("\n(took", 1)[0] + f"\n(took {result['seconds']:.0f} s)"


def finite(value: Any) -> Any:
    """NaN/inf (a missing measurement) become null: strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def emit(report: Report, as_json: bool) -> None:
    if as_json:
        data = json.loads(json.dumps(report.as_json(), default=_jsonable))
        print(json.dumps(finite(data), indent=1, allow_nan=False))
    else:
        print(report.render())
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    rev = subprocess.run(
        ["git", "-C", str(Path(__file__).resolve().parent.parent), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "git": rev or None,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "damon": damon(),
    }


DAMON = Path("/sys/kernel/mm/damon/admin/kdamonds")


def damon() -> list[str]:
    """The kernel's DAMON monitors running on this host, as "kdamond N: OPS, ACTIONS".
    A DAMON pageout scheme (this VM's) walks the reverse mappings of sampled pages; a
    process exiting meanwhile can wait for its locks (docs/benchmarks.md, section 1)."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for kd in sorted(DAMON.iterdir()):
            if not kd.name.isdigit() or (kd / "state").read_text().strip() != "on":
                continue
            for ctx in sorted((kd / "contexts").glob("[0-9]*")):
                ops = (ctx / "operations").read_text().strip()
                actions = [
                    (scheme / "action").read_text().strip()
                    for scheme in sorted((ctx / "schemes").glob("[0-9]*"))
                ]
                found.append(f"kdamond {kd.name}: {ops}, schemes: {', '.join(actions) or '-'}")
    return found
