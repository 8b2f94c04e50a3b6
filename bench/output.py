"""Benchmark 8 - output: the daemon's CPU per MB of a unit's output, for short lines and
for one huge line without a newline, side by side in one run.

    python -m bench.output [--quick] [--json]

One stack, two units that each wait for a trigger file, then write N MB to stdout (1 MB
writes) and a `done K` line: `lines` writes 100-byte lines, `huge` one N-MB line. For each
round the daemon's utime+stime is read before the trigger and once `done K` has reached
the unit's log file; its VmRSS is read before the first round and after the last. Output
handling is linear when a huge line costs about what short lines cost per MB, and memory
is bounded when the daemon's RSS does not grow with the line.
"""

from __future__ import annotations

import statistics
import textwrap
import time
from pathlib import Path

from bench.procs import cpu_seconds, rss_mb, state_dir, wait_until
from bench.report import Report, Table, emit, entry, options, ratio
from bench.runners import Dynamod

WRITER = textwrap.dedent(
    """\
    import os, sys, time
    kind, mb, state = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    line = b"y" * 99 + b"\\n"
    piece = line * ((1 << 20) // len(line)) if kind == "lines" else b"x" * (1 << 20)
    print("waiting", flush=True)
    k = 0
    while True:
        k += 1
        trigger = os.path.join(state, f"go-{kind}-{k}")
        while not os.path.exists(trigger):
            time.sleep(0.01)
        written = 0
        while written < mb << 20:
            sys.stdout.buffer.write(piece)
            written += len(piece)
        sys.stdout.buffer.write(f"\\ndone {k}\\n".encode())
        sys.stdout.flush()
    """
)

STACK = """\
[stack]
name = "bench-output"
[units.lines]
command = ["{{python}}", "{writer}", "lines", "{mb}", "{state}"]
ready = {{ kind = "log", pattern = "^waiting$" }}
[units.huge]
command = ["{{python}}", "{writer}", "huge", "{mb}", "{state}"]
ready = {{ kind = "log", pattern = "^waiting$" }}
"""


def _log_ends_with(path: Path, text: bytes) -> bool:
    try:
        with path.open("rb") as fh:
            fh.seek(max(path.stat().st_size - 64, 0))
            return fh.read().endswith(text)
    except OSError:
        return False


def one_round(dm: Dynamod, state: Path, pid: int, kind: str, k: int) -> float:
    before = cpu_seconds(pid)
    (state / f"go-{kind}-{k}").touch()
    wait_until(
        lambda: _log_ends_with(state / "logs" / f"{kind}.log", f"done {k}\n".encode()),
        timeout=600,
        interval=0.01,
        what=f"{kind} round {k} in the log",
    )
    return cpu_seconds(pid) - before


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    mb = 10 if args.quick else 50
    rounds = 1 if args.quick else 3
    report = Report("output", "Daemon CPU per MB of unit output", args.quick)
    with state_dir("output") as state:
        writer = state / "writer.py"
        writer.write_text(WRITER)
        stack = state / "bench-output.toml"
        stack.write_text(STACK.format(writer=writer, mb=mb, state=state))
        dm = Dynamod(state)
        try:
            dm.up(stack)
            pid = dm.daemon_pid()
            assert pid is not None
            time.sleep(1.0)
            rss: dict[str, tuple[float, float]] = {}
            cpu: dict[str, list[float]] = {}
            for kind in ("lines", "huge"):
                start_rss = rss_mb(pid)
                cpu[kind] = [one_round(dm, state, pid, kind, k) for k in range(1, rounds + 1)]
                rss[kind] = (start_rss, rss_mb(pid))
        finally:
            dm.close()
    table = Table(
        f"{mb} MB of output per round, {rounds} round(s) each; daemon utime+stime",
        ["output", "MB", "CPU s (median)", "CPU s per MB", "RSS before MB", "RSS after MB"],
        digits=3,
    )
    per_mb = {}
    for kind, label in (("lines", "100-byte lines"), ("huge", "one line, no newline")):
        median = statistics.median(cpu[kind])
        per_mb[kind] = median / mb
        table.rows.append([label, mb, median, per_mb[kind], *rss[kind]])
    report.tables.append(table)
    huge_vs_lines = ratio(per_mb["huge"], per_mb["lines"])
    report.tables.append(
        Table("Side by side", ["one huge line / short lines, CPU per MB"], [[huge_vs_lines]], 2)
    )
    report.target("one huge line costs at most 2x short lines per MB", huge_vs_lines, 2.0, "x")
    growth = rss["huge"][1] - rss["huge"][0]
    report.target(f"daemon RSS growth over a {mb} MB line", growth, 20.0, "MB")
    report.data = {"mb": mb, "rounds": rounds, "cpu_s": cpu, "rss_mb": rss}
    report.notes.append(
        "The log file is written as it comes (rotated at 20 MB); the in-memory tail holds "
        "lines cut at 16 KiB, each piece marked."
    )
    emit(report, args.json)


if __name__ == "__main__":
    main()
