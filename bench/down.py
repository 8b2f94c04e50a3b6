"""Benchmark 5 - `down`: time until no process of the stack is left, and survivors.

    python -m bench.down [--quick] [--json]

Scenarios (each run repeatedly, dynamod and supervisord alternating):
- clean: 3 HTTP servers + 2 `sleep` units, all honour SIGTERM.
- stray: the same plus a unit that double-forks a setsid'ed grandchild ignoring SIGTERM
  (tests/fixtures/proc.py double-fork).
- local (full run only): the real local stack (etcd, NATS, 2 CPU workers, frontend).

dynamod: `dynamod down` (the CLI, as an operator runs it). supervisord: the stack exported
with `dynamod export supervisord` (stopasgroup/killasgroup), stopped with SIGTERM to
supervisord as its docs say. Every process of the stack (found by this benchmark's env
marker, which every descendant inherits) is watched every 5 ms from the moment the stop
is asked for; "no process left" is when the last of them is gone, survivors are those
still alive 3 s after the supervisor itself exited (then killed by pid).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

from bench.procs import (
    BIN,
    PROC,
    alive,
    bench_mark,
    marked,
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
    ratio,
    summary,
)
from bench.runners import (
    Dynamod,
    Supervisord,
)
from bench.stack import (
    prebuilt_model,
    serve_stack,
    wait_routable,
)

STOP_TIMEOUT = 2
GRACE = 3.0  # after the supervisor exits, how long a process may linger before it survived

UNITS = textwrap.dedent(
    """\
    [stack]
    name = "bench-down"

    [units.web]
    replicas = 3
    command = ["{{python}}", "{proc}", "serve", "{{ports.http}}"]
    ports = {{ http = 0 }}
    ready = {{ kind = "http", url = "http://127.0.0.1:{{ports.http}}/", interval = 0.02 }}
    restart = {{ reset_after = 1 }}
    stop = {{ timeout = {stop} }}

    [units.sleeper]
    replicas = 2
    command = ["sleep", "infinity"]
    restart = {{ reset_after = 1 }}
    stop = {{ timeout = {stop} }}
    """
)

STRAY = textwrap.dedent(
    """\

    [units.stray]
    command = ["{{python}}", "{proc}", "double-fork", "{{state_dir}}/stray.pid"]
    ready = {{ kind = "log", pattern = "forked a stray grandchild", interval = 0.02 }}
    restart = {{ reset_after = 1 }}
    stop = {{ timeout = {stop} }}
    """
)


def write_stack(state: Path, stray: bool) -> Path:
    text = UNITS.format(proc=PROC, stop=STOP_TIMEOUT)
    if stray:
        text += STRAY.format(proc=PROC, stop=STOP_TIMEOUT)
    path = state / "bench-down.toml"
    path.write_text(text)
    return path


def watch(
    pids: list[int],
    stopper: subprocess.Popen[Any] | None,
    started: float,
    supervisor_pid: int | None = None,
) -> dict[str, Any]:
    """Poll until every pid is gone, or the supervisor exited GRACE s ago."""
    gone: dict[int, float] = {}
    returned = None
    while True:
        now = time.monotonic()
        for pid in pids:
            if pid not in gone and not alive(pid):
                gone[pid] = now - started
        if returned is None:
            if stopper is not None and stopper.poll() is not None:
                returned = now - started
            elif supervisor_pid is not None and supervisor_pid in gone:
                returned = gone[supervisor_pid]
        if len(gone) == len(pids) and returned is not None:
            break
        if returned is not None and now - started > returned + GRACE:
            break
        if now - started > 120:
            break
        time.sleep(0.005)
    survivors = [p for p in pids if p not in gone]
    return {
        "returned_s": returned,
        "empty_s": max(gone.values()) if not survivors else math.nan,
        "survivors": len(survivors),
        "survivor_cmds": [_cmdline(p) for p in survivors],
        "processes": len(pids),
        "_survivor_pids": survivors,
    }


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stack_for(scenario: str, state: Path) -> tuple[str | Path, tuple[str, ...]]:
    if scenario == "local":
        prebuilt_model()
        return serve_stack(state), ()
    return write_stack(state, scenario == "stray"), ()


def dynamod_down(scenario: str) -> dict[str, Any]:
    with state_dir("dn") as state:
        dm = Dynamod(state)
        try:
            stack, variables = stack_for(scenario, state)
            dm.up(stack, *variables, timeout=180)
            time.sleep(0.3)  # let strays settle
            pids = marked()
            started = time.monotonic()
            stopper = subprocess.Popen(
                [str(BIN / "dynamod"), "--state-dir", str(state), "down"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            result = watch(pids, stopper, started)
            stopper.wait(60)
            _kill(result.pop("_survivor_pids"))
        finally:
            dm.close()
            sweep()
    return result


def supervisord_down(scenario: str) -> dict[str, Any]:
    with state_dir("sdn") as state:
        stack, variables = stack_for(scenario, state)
        sd = Supervisord(state, stack, *variables)
        try:
            sd.start()
            sd.wait_rpc()
            if scenario == "local":  # workers stay STARTING for startsecs=30: ask the frontend
                port = re.search(r"--http-port (\d+)", sd.config_text())
                assert port is not None
                wait_routable(f"http://127.0.0.1:{port.group(1)}", 2, timeout=180)
            else:
                wait_until(
                    lambda: all(i["statename"] == "RUNNING" for i in sd.info()),
                    120,
                    0.05,
                    "every program RUNNING",
                )
            time.sleep(0.3)
            assert sd.proc is not None
            pids = marked()
            started = time.monotonic()
            sd.proc.send_signal(signal.SIGTERM)
            result = watch(pids, None, started, supervisor_pid=sd.proc.pid)
            sd.proc.wait(60)
            _kill(result.pop("_survivor_pids"))
        finally:
            sd.close()
            sweep()
    return result


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    reps = {"clean": 1, "stray": 1} if args.quick else {"clean": 10, "stray": 10, "local": 3}
    report = Report("down", "5. `down`: time until no process is left, survivors", args.quick)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        for scenario, n in reps.items():
            runs[scenario] = {"dynamod": [], "supervisord": []}
            for _ in range(n):
                runs[scenario]["dynamod"].append(dynamod_down(scenario))
                runs[scenario]["supervisord"].append(supervisord_down(scenario))
    finally:
        sweep()
    table = Table(
        "Stop the whole stack, seconds (median / p95 over runs)",
        [
            "scenario",
            "supervisor",
            "runs",
            "processes",
            "supervisor returned",
            "no process left",
            "p95 no process left",
            "runs with survivors",
            "survivors (total)",
            "no process left vs dynamod",
        ],
        digits=3,
    )
    judged: dict[str, dict[str, Any]] = {}
    for scenario, by in runs.items():
        base = math.nan
        for name in ("dynamod", "supervisord"):
            results = by[name]
            returned = summary(r["returned_s"] for r in results)
            empty = summary(r["empty_s"] for r in results)
            with_survivors = sum(1 for r in results if r["survivors"])
            survivors = sum(r["survivors"] for r in results)
            if name == "dynamod":
                base = empty["median"]
            judged[f"{scenario}/{name}"] = {
                "returned": returned,
                "empty": empty,
                "survivors": survivors,
            }
            table.rows.append(
                [
                    scenario,
                    name,
                    len(results),
                    results[0]["processes"] if results else 0,
                    returned["median"],
                    empty["median"] if empty["n"] == len(results) else "never (survivors)",
                    empty["p95"] if empty["n"] == len(results) else "-",
                    with_survivors,
                    survivors,
                    ratio(empty["median"], base) if empty["n"] == len(results) else "-",
                ]
            )
    report.tables.append(table)
    clean_d, clean_s = judged["clean/dynamod"]["empty"], judged["clean/supervisord"]["empty"]
    report.target(
        "clean stack: dynamod / supervisord, time to no process left",
        ratio(clean_d["median"], clean_s["median"]),
        1.0,
        "x",
    )
    report.target(
        "dynamod survivors (all scenarios)",
        sum(v["survivors"] for k, v in judged.items() if k.endswith("/dynamod")),
        0,
        "processes",
    )
    report.data = {"runs": runs, "stop_timeout_s": STOP_TIMEOUT}
    report.notes += [
        f"every unit has stop timeout {STOP_TIMEOUT} s (supervisord: stopwaitsecs={STOP_TIMEOUT});"
        " the stray grandchild ignores SIGTERM, so dynamod must wait that long before SIGKILL.",
        "dynamod's 'supervisor returned' is the `dynamod down` CLI exiting (it waits for the "
        "daemon's pid to go); supervisord's is the supervisord process exiting.",
        f"a process still alive {GRACE:g} s after its supervisor exited counts as a survivor.",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
