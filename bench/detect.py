"""Benchmark 1 - failure detection: SIGKILL a unit, how long until the supervisor notices.

    python -m bench.detect [--quick] [--json]

- dynamod: a stack of `sleep infinity` units (restart always). For each kill, time.time()
  just before os.kill is compared with the timestamp of the daemon's own `unit.state`
  ready -> backoff line in daemon.log (structlog, microseconds, same clock). Extra kills
  with a tight status loop over the control socket measure when `status` shows the exit.
- supervisord: the same stack exported with `dynamod export supervisord`; its log line
  "exited: NAME (terminated by SIGKILL ...)" carries a millisecond timestamp.
- 5 s poller: bench/poll_watch.py, today's watchdog (waitpid every 5 s), kills spread
  uniformly over its polling window.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from bench.procs import (
    bench_mark,
    state_dir,
    sweep,
    wait_until,
)
from bench.report import (
    Report,
    Table,
    emit,
    options,
    ratio,
    summary,
)
from bench.runners import (
    Dynamod,
    Supervisord,
)

UNITS = 4
CROWD = 252  # idle units added in the full run: how detection scales with the process table

STACK = textwrap.dedent(
    """\
    # Benchmark stack: cheap units that restart at once, for repeated SIGKILLs.
    [stack]
    name = "bench-detect"

    [vars]
    n = {n}

    [units.victim]
    replicas = "{{vars.n}}"
    command = ["sleep", "infinity"]

    [units.victim.restart]
    policy = "always"
    backoff_initial = 0.05
    backoff_max = 0.05
    jitter = 0
    limit_burst = 10000
    limit_interval = 60
    reset_after = 1

    [units.victim.stop]
    timeout = 2
    """
)


IDLE = textwrap.dedent(
    """
    [units.idle]
    replicas = {idle}
    command = ["sleep", "infinity"]
    """
)


def write_stack(state: Path, n: int, idle: int = 0) -> Path:
    path = state / "bench-detect.toml"
    path.write_text(STACK.format(n=n) + (IDLE.format(idle=idle) if idle else ""))
    return path


def host_processes() -> int:
    return sum(1 for e in os.scandir("/proc") if e.name.isdigit())


def _ready_pid(dm: Dynamod, name: str, old: int | None) -> int | None:
    unit = dm.unit(name)
    if unit["state"] == "ready" and unit["pid"] and unit["pid"] != old:
        return int(unit["pid"])
    return None


def run_dynamod(kills: int, polled: int, idle: int = 0) -> dict[str, Any]:
    with state_dir("det") as state:
        dm = Dynamod(state)
        try:
            dm.up(write_stack(state, UNITS, idle), timeout=120)
            processes = host_processes()
            last: dict[str, int | None] = {f"victim@{i}": None for i in range(UNITS)}
            plan: list[tuple[str, float, bool]] = []  # unit, t_kill, status-polled
            status_exit_ms: list[float] = []
            status_state_ms: list[float] = []
            for k in range(kills + polled):
                name = f"victim@{k % UNITS}"
                pid = wait_until(
                    lambda name=name: _ready_pid(dm, name, last[name]),
                    10,
                    0.01,
                    f"{name} ready again",
                )
                last[name] = pid
                time.sleep(random.uniform(0.02, 0.08))  # no phase lock with anything
                poll = k >= kills
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
                plan.append((name, t_kill, poll))
                if poll:
                    exit_seen = state_seen = None
                    deadline = time.monotonic() + 5
                    while (exit_seen is None or state_seen is None) and time.monotonic() < deadline:
                        unit = dm.unit(name)
                        now = time.time()
                        if exit_seen is None and unit["pid"] != pid:
                            exit_seen = now
                        if state_seen is None and unit["state"] != "ready":
                            state_seen = now
                    status_exit_ms.append(((exit_seen or float("nan")) - t_kill) * 1000)
                    status_state_ms.append(((state_seen or float("nan")) - t_kill) * 1000)
            wait_until(lambda: all(_ready_pid(dm, n, None) for n in last), 10, 0.02)
            transitions = dm.transitions()
        finally:
            dm.close()
    log_ms: list[float] = []
    polled_log_ms: list[float] = []
    for name, t_kill, poll in plan:
        seen = next(
            (
                e["t"]
                for e in transitions
                if e["unit"] == name
                and e["t"] >= t_kill - 0.001
                and e["old"] == "ready"
                and e["new"] in {"backoff", "failed"}
            ),
            None,
        )
        value = ((seen if seen is not None else float("nan")) - t_kill) * 1000
        (polled_log_ms if poll else log_ms).append(value)
    return {
        "log_ms": log_ms,
        "polled_log_ms": polled_log_ms,
        "status_exit_ms": status_exit_ms,
        "status_state_ms": status_state_ms,
        "host_processes": processes,
        "idle_units": idle,
    }


EXITED = re.compile(r"exited: (\S+) \(terminated by SIGKILL")


def run_supervisord(kills: int) -> dict[str, Any]:
    with state_dir("sdet") as state:
        sd = Supervisord(state, write_stack(state, UNITS))
        try:
            sd.start()
            sd.wait_rpc()
            programs = [f"victim-{i}" for i in range(UNITS)]
            last: dict[str, int | None] = dict.fromkeys(programs)

            def running(program: str) -> int | None:
                info = sd.rpc.supervisor.getProcessInfo(program)
                pid = int(info["pid"])
                return pid if info["statename"] == "RUNNING" and pid != last[program] else None

            plan: list[tuple[str, float]] = []
            for k in range(kills):
                program = programs[k % UNITS]
                pid = wait_until(lambda p=program: running(p), 15, 0.01, f"{program} RUNNING")
                last[program] = pid
                time.sleep(random.uniform(0.02, 0.08))
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
                plan.append((program, t_kill))
            events = wait_until(
                lambda: (
                    (ev := sd.log_events())
                    and sum(1 for _, m in ev if EXITED.search(m)) >= kills
                    and ev
                ),
                5,
                0.05,
                "every kill in supervisord.log",
            )
        finally:
            sd.close()
    ms = []
    for program, t_kill in plan:
        seen = next(
            (
                t
                for t, msg in events
                if t >= t_kill - 0.005 and (m := EXITED.search(msg)) and m.group(1) == program
            ),
            None,
        )
        # The stamp is truncated to the millisecond: +0.5 ms is its expected value.
        ms.append(((seen + 0.0005 if seen is not None else float("nan")) - t_kill) * 1000)
    return {"log_ms": ms}


def run_poller(kills: int, window: float, interval: float = 5.0) -> dict[str, Any]:
    with state_dir("poll") as state:
        pids_file, seen_file = state / "pids", state / "seen"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.poll_watch",
                "--interval",
                str(interval),
                "--count",
                str(kills),
                "--pids",
                str(pids_file),
                "--seen",
                str(seen_file),
                "--for",
                str(window + 2 * interval),
                "--",
                "sleep",
                "infinity",
            ],
            start_new_session=True,
        )
        try:
            pids = wait_until(
                lambda: (
                    (lines := pids_file.read_text().splitlines() if pids_file.exists() else [])
                    and len(lines) == kills
                    and [json.loads(x)["pid"] for x in lines]
                ),
                10,
                0.01,
                "the poller's children",
            )
            start = time.time()
            schedule = sorted((random.uniform(0, window), pid) for pid in pids)
            killed: dict[int, float] = {}
            for offset, pid in schedule:
                time.sleep(max(0.0, start + offset - time.time()))
                killed[pid] = time.time()
                os.kill(pid, signal.SIGKILL)
            proc.wait(window + 3 * interval + 10)
            seen = {d["pid"]: d["t"] for d in map(json.loads, seen_file.read_text().splitlines())}
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"log_ms": [(seen.get(pid, float("nan")) - t) * 1000 for pid, t in killed.items()]}


def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    kills, polled = (12, 6) if args.quick else (60, 30)
    window = 5.0 if args.quick else 25.0
    report = Report("detect", "1. Failure detection (SIGKILL -> noticed)", args.quick)
    poll: dict[str, Any] = {}
    # The poller sleeps 5 s at a time: it runs beside the others without disturbing them.
    poller = threading.Thread(target=lambda: poll.update(run_poller(kills, window)))
    try:
        poller.start()
        dyn = run_dynamod(kills, polled)
        crowded = None if args.quick else run_dynamod(kills // 2, 0, idle=CROWD)
        sup = run_supervisord(kills)
        poller.join()
    finally:
        sweep()
    if not poll:
        raise RuntimeError("the 5 s poller run failed")
    d, s, p = summary(dyn["log_ms"]), summary(sup["log_ms"]), summary(poll["log_ms"])
    table = Table(
        "Kill -> noticed, ms",
        ["supervisor (how measured)", "kills", "median", "p95", "p99", "max", "median vs dynamod"],
        digits=2,
    )
    table.rows.append(
        [
            f"dynamod (daemon.log unit.state ready->backoff; "
            f"{dyn['host_processes']} processes on the host)",
            d["n"],
            d["median"],
            d["p95"],
            d["p99"],
            d["max"],
            1.0,
        ]
    )
    for label, values in (
        ("dynamod (status over socket: pid gone)", dyn["status_exit_ms"]),
        ("dynamod (status over socket: state left ready)", dyn["status_state_ms"]),
        ("dynamod (daemon.log, kills with status loop running)", dyn["polled_log_ms"]),
    ):
        x = summary(values)
        table.rows.append(
            [
                label,
                x["n"],
                x["median"],
                x["p95"],
                x["p99"],
                x["max"],
                ratio(x["median"], d["median"]),
            ]
        )
    if crowded is not None:
        x = summary(crowded["log_ms"])
        table.rows.append(
            [
                f"dynamod, {UNITS + CROWD}-unit stack ({crowded['host_processes']} "
                "processes on the host; daemon.log)",
                x["n"],
                x["median"],
                x["p95"],
                x["p99"],
                x["max"],
                ratio(x["median"], d["median"]),
            ]
        )
    table.rows.append(
        [
            "supervisord (supervisord.log 'exited:', ms stamps)",
            s["n"],
            s["median"],
            s["p95"],
            s["p99"],
            s["max"],
            ratio(s["median"], d["median"]),
        ]
    )
    table.rows.append(
        [
            "5 s polling loop (waitpid every 5 s)",
            p["n"],
            p["median"],
            p["p95"],
            p["p99"],
            p["max"],
            ratio(p["median"], d["median"]),
        ]
    )
    report.tables.append(table)
    report.target("dynamod detection median", d["median"], 5.0, "ms")
    report.target("dynamod detection p99", d["p99"], 20.0, "ms")
    report.data = {
        "dynamod": dyn,
        "dynamod_crowded": crowded,
        "supervisord": sup,
        "poller": poll,
        "summary": {"dynamod": d, "supervisord": s, "poller": p},
        "units": UNITS,
    }
    report.notes += [
        f"{UNITS} `sleep infinity` units, restart always (backoff 0.05 s); kills rotate over "
        "them, each after the unit is running again plus a random 20-80 ms.",
        "supervisord's log stamps are truncated to the millisecond; 0.5 ms (the expected "
        "truncation) is added to each of its values.",
        f"the poller's kills are spread uniformly over {window:g} s; its detection is "
        "uniform in [0, 5 s] by construction.",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
