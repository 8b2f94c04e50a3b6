"""Benchmark 1 - failure detection: SIGKILL a unit, how long until the supervisor notices;
and how long stopping one unit takes.

    python -m bench.detect [--quick] [--json]

- dynamod: a stack of `sleep infinity` units (restart always), once with cgroup v2
  containment and once with the fallback (DYNAMOD_CONTAINMENT=pgroup), each with the stack
  alone and with CROWD extra idle processes on the host (started and ended by this
  benchmark, by pid / own process group). For each kill, time.time() just before os.kill
  is compared with the timestamp of the daemon's own `unit.state` ready -> backoff line in
  daemon.log (structlog, microseconds, same clock); 20-80 ms without a request to the
  supervisor before and after each kill (`quiet`). Extra kills with a tight status loop
  over the control socket measure when `status` shows the exit. One unit's stop: `restart
  UNIT` over the socket, timed from the unit's ready -> stopping to stopping -> stopped.
- supervisord: the same stack exported with `dynamod export supervisord`, alone and with
  the crowd; its log line "exited: NAME (terminated by SIGKILL ...)" carries a millisecond
  timestamp; one program's stop is the `stopProcess` XML-RPC round trip.
- floor: bench/floor_watch.py, no supervisor: a process blocked on its child's pidfd,
  alone and with the crowd; what the machine allows anyone in the same run.
- split: every kill above is also watched by bench/exit_watch.py, a SCHED_FIFO pidfd
  waiter of its own, which times when the kernel completed the victim's exit; each kill
  -> noticed splits into kill -> exit complete (the kernel's) and exit complete ->
  noticed (the supervisor's).
- 5 s poller: bench/poll_watch.py, today's watchdog (waitpid every 5 s), kills spread
  uniformly over its polling window.

--quick (the suite's smoke run): 5 kills per row, the stack alone only (no crowd).
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.exit_watch import ExitClock
from bench.procs import (
    ROOT,
    bench_mark,
    state_dir,
    sweep,
    wait_until,
)
from bench.report import (
    Report,
    Table,
    damon,
    emit,
    entry,
    options,
    ratio,
    summary,
)
from bench.runners import (
    Dynamod,
    Supervisord,
)
from dynamod.ops.supervisord import program_name, supervisorctl_name

UNITS = 4
CROWD = 1000  # extra idle processes on the host: detection must not scale with the process table
CONTAINMENT_ENV = "DYNAMOD_CONTAINMENT"

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


def quiet() -> None:
    """A random 20-80 ms with no request to the supervisor, before each kill and after it.
    Without the gap after it, the harness asked for the next unit's state at once: its
    request reached the supervisor ~0.4 ms after the SIGKILL, and answering it came before
    the exit (both supervisors; dynamod's status answer took 0.4-0.8 ms of the 1.4 ms
    median). Kills with requests in flight are the `polled` ones, measured apart."""
    time.sleep(random.uniform(0.02, 0.08))


def split(
    t_kills: list[float], exits: list[float], seen: list[float], policy: str
) -> dict[str, Any]:
    """Each kill's kill -> noticed (`log_ms`), and the same split at the reference clock's
    exit complete: the kernel's share (kill -> exit complete) and the supervisor's (exit
    complete -> noticed)."""
    return {
        "log_ms": [(s - t) * 1000 for t, s in zip(t_kills, seen, strict=True)],
        "exit_ms": [(e - t) * 1000 for t, e in zip(t_kills, exits, strict=True)],
        "share_ms": [(s - e) * 1000 for e, s in zip(exits, seen, strict=True)],
        "reference": policy,
    }


def write_stack(state: Path, n: int) -> Path:
    path = state / "bench-detect.toml"
    path.write_text(STACK.format(n=n))
    return path


@contextmanager
def crowd(n: int) -> Iterator[list[int]]:
    """n idle `sleep infinity` processes in one process group of our own; ended by that
    group and waited for by pid."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    ["sleep", "infinity"],
                    stdin=subprocess.DEVNULL,
                    process_group=procs[0].pid if procs else 0,
                )
            )
        yield [p.pid for p in procs]
    finally:
        if procs:
            os.killpg(procs[0].pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()


def host_processes() -> int:
    return sum(1 for e in os.scandir("/proc") if e.name.isdigit())


def _ready_pid(dm: Dynamod, name: str, old: int | None) -> int | None:
    unit = dm.unit(name)
    if unit["state"] == "ready" and unit["pid"] and unit["pid"] != old:
        return int(unit["pid"])
    return None


def run_dynamod(kills: int, polled: int, stops: int, mode: str) -> dict[str, Any]:
    with state_dir("det") as state:
        dm = Dynamod(state, env={CONTAINMENT_ENV: mode})
        clock = ExitClock()
        try:
            dm.up(write_stack(state, UNITS), timeout=120)
            in_force = dm.status()["containment"]["summary"]
            processes = host_processes()
            last: dict[str, int | None] = {f"victim@{i}": None for i in range(UNITS)}
            plan: list[tuple[str, float, bool]] = []  # unit, t_kill, status-polled
            exits: list[float] = []  # the reference clock's exit complete, per kill
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
                clock.watch(pid)
                quiet()  # no phase lock with anything
                poll = k >= kills
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
                plan.append((name, t_kill, poll))
                if not poll:
                    quiet()  # the next unit's readiness is asked after the exit is noticed
                    exits.append(clock.exited(pid))
                else:
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
                    clock.exited(pid)
            wait_until(lambda: all(_ready_pid(dm, n, None) for n in last), 10, 0.02)
            stop_rtt_ms: list[float] = []
            for k in range(stops):
                name = f"victim@{k % UNITS}"
                old = wait_until(lambda name=name: _ready_pid(dm, name, None), 10, 0.01)
                started = time.monotonic()
                dm.client.restart(name)
                stop_rtt_ms.append((time.monotonic() - started) * 1000)
                wait_until(lambda name=name, old=old: _ready_pid(dm, name, old), 10, 0.01)
            transitions = dm.transitions()
        finally:
            clock.close()
            dm.close()
    seen_at: list[float] = []
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
        at = seen if seen is not None else float("nan")
        if poll:
            polled_log_ms.append((at - t_kill) * 1000)
        else:
            seen_at.append(at)
    stop_ms: list[float] = []
    began: dict[str, float] = {}
    for e in transitions:
        if e["new"] == "stopping":
            began[e["unit"]] = e["t"]
        elif e["new"] == "stopped" and e["unit"] in began:
            stop_ms.append((e["t"] - began.pop(e["unit"])) * 1000)
    t_kills = [t for _, t, poll in plan if not poll]
    return {
        **split(t_kills, exits, seen_at, clock.policy),
        "polled_log_ms": polled_log_ms,
        "status_exit_ms": status_exit_ms,
        "status_state_ms": status_state_ms,
        "stop_ms": stop_ms[:stops],  # the restarts' stops, not the final down's
        "stop_rtt_ms": stop_rtt_ms,
        "host_processes": processes,
        "containment": in_force,
    }


EXITED = re.compile(r"exited: (\S+) \(terminated by SIGKILL")


def run_supervisord(kills: int, stops: int = 0) -> dict[str, Any]:
    with state_dir("sdet") as state:
        sd = Supervisord(state, write_stack(state, UNITS))
        clock = ExitClock()
        exits: list[float] = []
        try:
            sd.start()
            sd.wait_rpc()
            victims = [f"victim@{i}" for i in range(UNITS)]
            last: dict[str, int | None] = dict.fromkeys(victims)

            def running(victim: str) -> int | None:
                info = sd.process_info(victim)
                pid = int(info["pid"])
                return pid if info["statename"] == "RUNNING" and pid != last[victim] else None

            plan: list[tuple[str, float]] = []
            for k in range(kills):
                victim = victims[k % UNITS]
                pid = wait_until(lambda v=victim: running(v), 15, 0.01, f"{victim} RUNNING")
                last[victim] = pid
                clock.watch(pid)
                quiet()
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
                plan.append((program_name(victim), t_kill))  # as supervisord.log names it
                quiet()
                exits.append(clock.exited(pid))
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
            processes = host_processes()
            stop_rtt_ms: list[float] = []
            for k in range(stops):
                victim = victims[k % UNITS]
                wait_until(lambda v=victim: running(v), 15, 0.01, f"{victim} RUNNING")
                started = time.monotonic()
                sd.rpc.supervisor.stopProcess(supervisorctl_name(victim))
                stop_rtt_ms.append((time.monotonic() - started) * 1000)
                sd.rpc.supervisor.startProcess(supervisorctl_name(victim), False)
        finally:
            clock.close()
            sd.close()
    seen_at: list[float] = []
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
        seen_at.append(seen + 0.0005 if seen is not None else float("nan"))
    return {
        **split([t for _, t in plan], exits, seen_at, clock.policy),
        "stop_rtt_ms": stop_rtt_ms,
        "host_processes": processes,
    }


def run_floor(kills: int) -> dict[str, Any]:
    """The machine's floor, killed the same way: bench.floor_watch's children."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.floor_watch", "--count", str(kills)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=ROOT,
    )
    clock = ExitClock()
    t_kills: list[float] = []
    exits: list[float] = []
    woke: list[float] = []
    try:
        assert proc.stdout is not None
        for _ in range(kills):
            pid = int(proc.stdout.readline().split()[1])
            clock.watch(pid)
            quiet()
            t_kills.append(time.time())
            os.kill(pid, signal.SIGKILL)
            woke.append(float(proc.stdout.readline().split()[1]))
            exits.append(clock.exited(pid))
        proc.wait(30)
    finally:
        clock.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return split(t_kills, exits, woke, clock.policy)


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


def _kind(run: dict[str, Any]) -> str:
    """The containment in force, without the run's cgroup path (it differs every run)."""
    text: str = run["containment"]
    return "cgroup v2" if text.startswith("cgroup v2") else text


def _row(label: str, values: list[float], base: float) -> list[Any]:
    x = summary(values)
    return [label, x["n"], x["median"], x["p95"], x["p99"], x["max"], ratio(x["median"], base)]


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    # 200 kills a run: with 60, the p99 is an interpolation between the two slowest kills.
    kills, polled, stops = (5, 2, 2) if args.quick else (200, 30, 30)
    window = 5.0 if args.quick else 25.0
    # quick (the suite's smoke run): the stack alone; the crowd repeats the same code paths
    loads = ("alone",) if args.quick else ("alone", "crowd")
    crowd_size = CROWD if "crowd" in loads else 0
    report = Report("detect", "1. Failure detection (SIGKILL -> noticed)", args.quick)
    poll: dict[str, Any] = {}
    runs: dict[str, dict[str, Any]] = {}
    # The poller sleeps 5 s at a time: it runs beside the others without disturbing them.
    poller = threading.Thread(target=lambda: poll.update(run_poller(kills, window)))
    try:
        poller.start()
        for load in loads:
            with crowd(crowd_size if load == "crowd" else 0):
                for mode in ("cgroup", "pgroup"):
                    runs[f"{mode}/{load}"] = run_dynamod(kills, polled, stops, mode)
                runs[f"supervisord/{load}"] = run_supervisord(kills, stops)
                runs[f"floor/{load}"] = run_floor(kills)
        poller.join()
    finally:
        sweep()
    if not poll:
        raise RuntimeError("the 5 s poller run failed")
    d = summary(runs["cgroup/alone"]["log_ms"])
    s, p = summary(runs["supervisord/alone"]["log_ms"]), summary(poll["log_ms"])
    headers = [
        "supervisor (how measured)",
        "kills",
        "median",
        "p95",
        "p99",
        "max",
        "median vs dynamod",
    ]
    table = Table("Kill -> noticed, ms", headers, digits=2)
    base = d["median"]
    for load in loads:
        for mode in ("cgroup", "pgroup"):
            run = runs[f"{mode}/{load}"]
            where = f"{run['host_processes']} processes on the host"
            table.rows.append(
                _row(
                    f"dynamod, {_kind(run)} ({where}; daemon.log ready->backoff)",
                    run["log_ms"],
                    base,
                )
            )
            if load == "alone" and mode == "cgroup":
                for label, key in (
                    ("status over socket: pid gone", "status_exit_ms"),
                    ("status over socket: state left ready", "status_state_ms"),
                    ("daemon.log, kills with status loop running", "polled_log_ms"),
                ):
                    table.rows.append(_row(f"dynamod, cgroup v2 ({label})", run[key], base))
        sup = runs[f"supervisord/{load}"]
        table.rows.append(
            _row(
                f"supervisord ({sup['host_processes']} processes on the host; "
                "supervisord.log 'exited:', ms stamps)",
                sup["log_ms"],
                base,
            )
        )
        table.rows.append(
            _row(
                f"floor: no supervisor, a bare pidfd waiter ({load}; its wake)",
                runs[f"floor/{load}"]["log_ms"],
                base,
            )
        )
    table.rows.append(_row("5 s polling loop (waitpid every 5 s)", poll["log_ms"], base))
    report.tables.append(table)

    split_table = Table(
        "The same kills, split where the kernel completed the exit, ms (reference: "
        f"bench.exit_watch, a {runs['floor/alone']['reference']} pidfd waiter)",
        [
            "supervisor",
            "kills",
            "kill->exit median",
            "kill->exit p99",
            "kill->exit max",
            "exit->noticed median",
            "exit->noticed p99",
            "exit->noticed max",
        ],
        digits=2,
    )
    for load in loads:
        for key, label in (
            ("cgroup", "dynamod, cgroup v2"),
            ("pgroup", "dynamod, fallback"),
            ("supervisord", "supervisord (+0.5 ms stamps)"),
            ("floor", "floor (bare pidfd waiter)"),
        ):
            run = runs[f"{key}/{load}"]
            k, n = summary(run["exit_ms"]), summary(run["share_ms"])
            kernel = [k["median"], k["p99"], k["max"]]
            share = [n["median"], n["p99"], n["max"]]
            split_table.rows.append([f"{label}, {load}", k["n"], *kernel, *share])
    report.tables.append(split_table)

    stop_table = Table(
        "One unit's stop (SIGTERM, sleep exits at once), ms",
        ["supervisor (how measured)", "stops", "median", "p95", "p99", "max", "median vs dynamod"],
        digits=2,
    )
    stop_base = summary(runs["cgroup/alone"]["stop_ms"])["median"]
    for load in loads:
        for mode in ("cgroup", "pgroup"):
            run = runs[f"{mode}/{load}"]
            where = f"{run['host_processes']} processes on the host"
            stop_table.rows.append(
                _row(
                    f"dynamod, {mode} ({where}; daemon.log stopping->stopped)",
                    run["stop_ms"],
                    stop_base,
                )
            )
            stop_table.rows.append(
                _row(
                    f"dynamod, {mode} ({where}; `restart` round trip over the socket)",
                    run["stop_rtt_ms"],
                    stop_base,
                )
            )
        sup = runs[f"supervisord/{load}"]
        stop_table.rows.append(
            _row(
                f"supervisord ({sup['host_processes']} processes on the host; stopProcess "
                "XML-RPC round trip)",
                sup["stop_rtt_ms"],
                stop_base,
            )
        )
    report.tables.append(stop_table)

    for load in loads:
        x = summary(runs[f"cgroup/{load}"]["log_ms"])
        what = "the stack alone" if load == "alone" else f"+{crowd_size} idle processes"
        report.target(f"dynamod (cgroup v2) detection median, {what}", x["median"], 1.0, "ms")
        report.target(f"dynamod (cgroup v2) detection p99, {what}", x["p99"], 5.0, "ms")
    for load in loads:
        x = summary(runs[f"pgroup/{load}"]["log_ms"])
        what = "the stack alone" if load == "alone" else f"+{crowd_size} idle processes"
        report.target(f"dynamod (fallback) detection median, {what}", x["median"], 1.0, "ms")
        report.target(f"dynamod (fallback) detection p99, {what}", x["p99"], 5.0, "ms")
    report.data = {
        "dynamod": runs["cgroup/alone"],
        "runs": runs,
        "poller": poll,
        "summary": {"dynamod": d, "supervisord": s, "poller": p},
        "units": UNITS,
        "crowd": crowd_size,
    }
    report.notes += [
        f"{UNITS} `sleep infinity` units, restart always (backoff 0.05 s); kills rotate over "
        "them, each after the unit is running again plus a random 20-80 ms.",
        f"'crowd': {crowd_size} extra idle `sleep infinity` processes on the host, started by "
        "the benchmark in one process group of its own and ended by it (quick: no crowd run).",
        "supervisord's log stamps are truncated to the millisecond; 0.5 ms (the expected "
        "truncation) is added to each of its values.",
        f"the poller's kills are spread uniformly over {window:g} s; its detection is "
        "uniform in [0, 5 s] by construction.",
        "one unit's stop: `restart UNIT` (dynamod) / `stopProcess` (supervisord) on a "
        "`sleep infinity` unit, which exits at once on SIGTERM.",
        "floor: bench.floor_watch, a process blocked in select on its one child's pidfd, "
        "killed the same way; what this machine gives any supervisor in the same minutes "
        "(its p99 is the machine's wake-up tail, not a supervisor's).",
        "split: bench.exit_watch opens a pidfd on each victim before its kill and times its "
        "wake (SCHED_FIFO where allowed): kill -> exit complete is the kernel's share, "
        "exit complete -> noticed the supervisor's; the two add up to kill -> noticed.",
    ]
    for monitor in damon():
        report.notes.append(
            f"this host runs DAMON ({monitor}): kdamond's reverse-map walks over pages the "
            "crowd's processes share can hold a dying victim up (kill -> exit complete)."
        )
    for load in loads:
        for mode in ("cgroup", "pgroup"):
            run = runs[f"{mode}/{load}"]
            k, n = summary(run["exit_ms"])["p99"], summary(run["share_ms"])["p99"]
            report.notes.append(
                f"{mode}/{load}: p99 of kill -> exit complete (the kernel) {k:.2f} ms, of "
                f"exit complete -> noticed (dynamod) {n:.2f} ms."
            )
    emit(report, args.json)


if __name__ == "__main__":
    main()
