"""Where a long run's CPU goes, by kind of process (docs/testing.md, "What it costs").

    python3 scripts/cpu_by_process.py OUT.json -- COMMAND [ARG ...]

Runs COMMAND and, until it exits, reads every process's user + system time from /proc
every 0.5 s; writes the CPU seconds and process count per kind (dynamod daemons, CPU
workers, Ray, etcd, ...) to OUT.json and prints them, then the CPU of the processes no
kind names by their command. A process that lives less than one
interval is missed; what processes used before the first read is not counted. Exits with
COMMAND's status. Linux only; reads /proc, changes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

INTERVAL_S = 0.5
TICK = os.sysconf("SC_CLK_TCK")
# First match wins: (a substring of the command line, the kind it counts as).
KINDS = [
    ("dynamo.vllm", "the real engine's main processes"),
    ("dynamo.frontend", "the Dynamo frontend"),
    ("dynamod.workers.cpu", "our CPU workers"),
    ("dynamo.mocker", "Dynamo's mocker"),
    ("raylet", "Ray"), ("gcs_server", "Ray"), ("ray::", "Ray"), ("ray/", "Ray"),
    ("verl", "verl"), ("aiperf", "AIPerf"),
    ("etcd", "etcd"), ("nats-server", "NATS"),
    ("pytest", "pytest"), ("exec(eval(sys.stdin", "pytest"),  # xdist's workers
    ("mypy", "mypy"), ("ruff", "ruff"),
    ("uv ", "the install"), ("compileall", "the install"),
    ("dynamod.trainer", "our CPU trainer"),
    ("bench.", "benchmarks"), ("dynamod.chaos", "chaos"),
]  # fmt: skip


def kind_of(cmdline: str) -> str:
    if "-m dynamod " in cmdline or "/bin/dynamod " in cmdline:
        return "dynamod daemons and `up`" if " up " in cmdline else "the dynamod CLI"
    for key, kind in KINDS:
        if key in cmdline:
            return kind
    if "python" in cmdline:
        return "other Python"
    return "other"


def short(cmdline: str) -> str:
    """A command line cut to what tells processes apart: file names without their
    directories, the first four words."""
    return " ".join(word.rsplit("/", 1)[-1] for word in cmdline.split()[:4])


def read_all() -> dict[int, tuple[str, int]]:
    """pid -> (start time, utime + stime in ticks) for every process readable now."""
    seen = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        seen[int(name)] = (fields[19], int(fields[11]) + int(fields[12]))
    return seen


def cmdline_of(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or "[kernel]"


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python3 scripts/cpu_by_process.py OUT.json -- COMMAND [ARG ...]",
              file=sys.stderr)
        return 2
    out = Path(argv[0])
    before = read_all()  # counted from here on only
    last = {pid: (start, ticks, cmdline_of(pid)) for pid, (start, ticks) in before.items()}
    kinds = {cmdline: kind_of(cmdline) for _, _, cmdline in last.values()}  # each one once
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    unsorted: dict[str, float] = defaultdict(float)  # the "other" kinds, by command
    child = subprocess.Popen(argv[2:])
    while True:
        done = child.poll() is not None
        for pid, (start, ticks) in read_all().items():
            if pid == os.getpid():
                continue
            known = last.get(pid)
            if known is None or known[0] != start:  # new since the last read
                cmdline = cmdline_of(pid)
                if cmdline not in kinds:  # setdefault would classify it on every new pid
                    kinds[cmdline] = kind_of(cmdline)
                kind = kinds[cmdline]
                count[kind] += 1
                used = ticks / TICK
            else:
                cmdline = known[2]
                kind = kinds[cmdline]
                used = (ticks - known[1]) / TICK
            seconds[kind] += used
            if kind.startswith("other"):
                unsorted[short(cmdline)] += used
            last[pid] = (start, ticks, cmdline)
        if done:
            break
        time.sleep(INTERVAL_S)
    rows = sorted(seconds.items(), key=lambda kv: -kv[1])
    others = sorted(unsorted.items(), key=lambda kv: -kv[1])[:20]
    out.write_text(json.dumps({"cpu_s": dict(rows), "processes": dict(count),
                               "other_by_command": dict(others)}, indent=1))
    for kind, cpu in rows:
        print(f"{cpu:9.1f} s {count[kind]:6d}  {kind}", file=sys.stderr)
    print("the \"other\" kinds, by command:", file=sys.stderr)
    for command, cpu in others:
        print(f"{cpu:9.1f} s  {command}", file=sys.stderr)
    return int(child.returncode)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
