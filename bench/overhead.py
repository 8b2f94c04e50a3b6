"""Benchmark 6 - overhead: the supervisor's own memory and idle CPU with 8, 64 and 256
cheap units, and how long `status` takes.

    python -m bench.overhead [--quick] [--json]

Units are `sleep infinity` (no probes). After `up` returns and 2 s of settling:
- RSS: VmRSS of the dynamod daemon (and of its guardian, reported apart);
- idle CPU: the daemon's utime+stime over a window, as % of one core;
- `status`: wall time of the `dynamod status --json` CLI (what an operator runs) and of
  one request on the control socket (what the CLI and tests use underneath).
The same units under supervisord (exported config) give the reference numbers:
supervisord's RSS and idle CPU, `supervisorctl status`, and SIGTERM to exit.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from bench.procs import (
    BIN,
    bench_mark,
    cpu_seconds,
    rss_mb,
    state_dir,
    sweep,
    wait_until,
)
from bench.report import (
    Report,
    Table,
    emit,
    entry,
    options,
    summary,
)
from bench.runners import (
    Dynamod,
    Supervisord,
)
from dynamod.core import runrecord

STACK = textwrap.dedent(
    """\
    [stack]
    name = "bench-overhead"

    [units.idle]
    replicas = {n}
    command = ["sleep", "infinity"]
    restart = {{ reset_after = 1 }}
    """
)


SETTLE = 2.0
# supervisord's SIGTERM-to-exit is measured up to this; past it the group is killed and the
# time shows as at least this.
STOP_TIMEOUT = 120.0

# What `dynamod status --json` needs at the least: the stdlib control-socket client. The
# gap between this and the CLI is import work the status command does not use.
LEAN_STATUS = (
    "import json, sys; from pathlib import Path; from dynamod.client import Client; "
    "print(json.dumps(Client(Path(sys.argv[1])).status(), indent=2))"
)


def write_stack(state: Path, n: int) -> Path:
    path = state / "bench-overhead.toml"
    path.write_text(STACK.format(n=n))
    return path


def timed(cmd: list[str], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True, timeout=60)
        out.append((time.perf_counter() - started) * 1000)
    return out


def idle_cpu(pid: int, window: float) -> float:
    before, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    return (cpu_seconds(pid) - before) / (time.monotonic() - t0) * 100


def measure_dynamod(n: int, window: float, reps: int) -> dict[str, Any]:
    with state_dir("ov") as state:
        dm = Dynamod(state)
        try:
            up_s = dm.up(write_stack(state, n), timeout=300)
            status = dm.status()
            pid = status["daemon_pid"]
            run = runrecord.read(state)
            if run is None or run.guardian_pid is None:
                raise RuntimeError(f"no guardian pid in {state}/run.json")
            guardian = run.guardian_pid
            time.sleep(SETTLE)
            cpu = idle_cpu(pid, window)
            rss, guardian_rss = rss_mb(pid), rss_mb(guardian)
            cli = timed([str(BIN / "dynamod"), "--state-dir", str(state), "status", "--json"], reps)
            table_cli = timed(
                [str(BIN / "dynamod"), "--state-dir", str(state), "status"], max(3, reps // 2)
            )
            lean = timed([sys.executable, "-c", LEAN_STATUS, str(state)], reps)
            socket = []
            for _ in range(reps * 5):
                started = time.perf_counter()
                dm.status()
                socket.append((time.perf_counter() - started) * 1000)
            started = time.monotonic()
            dm.down()
            down_s = time.monotonic() - started
        finally:
            dm.close()
    return {
        "units": n,
        "up_s": up_s,
        "rss_mb": rss,
        "guardian_rss_mb": guardian_rss,
        "idle_cpu_pct": cpu,
        "status_cli_ms": cli,
        "status_table_cli_ms": table_cli,
        "status_lean_ms": lean,
        "status_socket_ms": socket,
        "down_s": down_s,
    }


def measure_supervisord(n: int, window: float, reps: int) -> dict[str, Any]:
    with state_dir("sov") as state:
        sd = Supervisord(state, write_stack(state, n))
        try:
            started = sd.start()
            sd.wait_rpc()
            wait_until(
                lambda: all(i["statename"] == "RUNNING" for i in sd.info()),
                120,
                0.05,
                "every program RUNNING",
            )
            up_s = time.monotonic() - started
            assert sd.proc is not None
            time.sleep(SETTLE)
            cpu = idle_cpu(sd.proc.pid, window)
            rss = rss_mb(sd.proc.pid)
            ctl = timed([str(BIN / "supervisorctl"), "-c", str(sd.conf), "status"], reps)
            down_s = sd.stop(STOP_TIMEOUT)
        finally:
            sd.close()
    return {"units": n, "up_s": up_s, "rss_mb": rss, "idle_cpu_pct": cpu, "status_cli_ms": ctl,
            "down_s": down_s}


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    sizes = [64] if args.quick else [8, 64, 256]
    window, reps = (2.0, 5) if args.quick else (30.0, 20)
    report = Report("overhead", "6. Overhead: RSS, idle CPU, `status` latency", args.quick)
    dyn: list[dict[str, Any]] = []
    sup: list[dict[str, Any]] = []
    try:
        for n in sizes:
            dyn.append(measure_dynamod(n, window, reps))
            if not args.quick or n == 64:
                sup.append(measure_supervisord(n, window, reps))
    finally:
        sweep()
    table = Table(
        "dynamod daemon",
        [
            "units",
            "RSS MB",
            "guardian RSS MB",
            "idle CPU %",
            "status --json CLI ms (median)",
            "p95",
            "status table CLI ms (median)",
            "lean client process ms (median)",
            "socket request ms (median)",
            "p95",
            "up s",
            "down s",
        ],
        digits=2,
    )
    for r in dyn:
        cli, sock = summary(r["status_cli_ms"]), summary(r["status_socket_ms"])
        table.rows.append(
            [
                r["units"],
                r["rss_mb"],
                r["guardian_rss_mb"],
                r["idle_cpu_pct"],
                cli["median"],
                cli["p95"],
                statistics.median(r["status_table_cli_ms"]),
                statistics.median(r["status_lean_ms"]),
                sock["median"],
                sock["p95"],
                r["up_s"],
                r["down_s"],
            ]
        )
    report.tables.append(table)
    ref = Table(
        "supervisord (same units, exported config)",
        [
            "units",
            "RSS MB",
            "idle CPU %",
            "supervisorctl status ms (median)",
            "p95",
            "all RUNNING s",
            "SIGTERM to exit s",
            "dynamod RSS / supervisord RSS",
        ],
        digits=2,
    )
    for r in sup:
        ctl = summary(r["status_cli_ms"])
        mine = next(d for d in dyn if d["units"] == r["units"])
        ref.rows.append(
            [
                r["units"],
                r["rss_mb"],
                r["idle_cpu_pct"],
                ctl["median"],
                ctl["p95"],
                r["up_s"],
                r["down_s"],
                mine["rss_mb"] / r["rss_mb"],
            ]
        )
    report.tables.append(ref)
    by = {r["units"]: r for r in dyn}
    report.target("RSS at 64 units", by[64]["rss_mb"], 80, "MB")
    report.target("idle CPU (worst size)", max(r["idle_cpu_pct"] for r in dyn), 1.0, "%")
    largest = max(by)
    report.target(
        f"`status --json` CLI at {largest} units (median)",
        summary(by[largest]["status_cli_ms"])["median"],
        200,
        "ms",
    )
    report.data = {"dynamod": dyn, "supervisord": sup, "idle_window_s": window}
    report.notes += [
        f"idle CPU over {window:g} s after {SETTLE:g} s of settling; % of one core.",
        "`status` CLI time is the whole process (interpreter start, imports, request, print).",
        "lean client process: `python -c` importing only dynamod.client (stdlib) and "
        "printing the same JSON - the floor a `status` command could reach.",
        "supervisord's SIGTERM to exit: it stops one program group per pass of its 1 s loop; "
        "the export puts a unit's replicas in one group, so they stop together (as separate "
        "groups, 64 took ~35 s).",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
