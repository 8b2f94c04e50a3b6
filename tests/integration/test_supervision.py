"""The supervision core against real processes: gating, restarts, limits, liveness,
ordered stop, no leftovers, and a SIGKILLed daemon taking its units with it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Dynamod, pid_alive, unit_by_name, wait_dead

pytestmark = pytest.mark.slow

SERVE = '"{python}", "@PROC@", "serve", "{ports.http}"'


def _http_ready(interval: float = 0.05) -> str:
    return (f'ready = {{ kind = "http", url = "http://127.0.0.1:{{ports.http}}/health", '
            f'interval = {interval}, deadline = 20 }}')


def records(path: Path) -> list[tuple[str, str, float]]:
    rows = []
    for line in path.read_text().splitlines():
        what, name, at = line.split()
        rows.append((what, name, float(at)))
    return rows


def test_start_is_gated_on_readiness_in_dependency_order(
    dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    rec = tmp_path / "events"
    stack = stack_file(f"""
        [units.db]
        command = [{SERVE}, "--delay", "0.8", "--record", "{rec}", "--name", "db"]
        ports = {{ http = 0 }}
        {_http_ready()}
        [units.app]
        command = [{SERVE}, "--record", "{rec}", "--name", "app"]
        ports = {{ http = 0 }}
        depends_on = {{ db = "ready" }}
        {_http_ready()}
        [units.side]
        command = [{SERVE}, "--record", "{rec}", "--name", "side"]
        ports = {{ http = 0 }}
        depends_on = {{ db = "started" }}
    """)
    result = dm.run("up", str(stack), "--detach", check=True)
    assert "ready in" in result.stdout
    events = {(what, name): at for what, name, at in records(rec)}
    # app starts only after db answered its probe; side only needed db spawned
    assert events[("start", "app")] > events[("ready", "db")]
    assert events[("start", "side")] < events[("ready", "db")]
    status = dm.status()
    assert status["phase"] == "up"
    assert {u["name"]: u["state"] for u in status["units"]} == {
        "db": "ready", "app": "ready", "side": "ready"}
    assert unit_by_name(status, "app")["depends_on"] == {"db": "ready"}


def _most_starting_at_once(rows: list[tuple[str, str, float]]) -> int:
    """From start/ready records: the most units between their start and ready at once."""
    edges = sorted((at, 1 if what == "start" else -1) for what, _, at in rows
                   if what in {"start", "ready"})  # fmt: skip
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_max_starting_starts_that_many_at_once(
    dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    """Four units that take 1 s to get ready, `[stack] max_starting = 2`: never more than
    two between spawn and ready, and status says who waits. The same stack without the
    limit starts all four at once (the control: the count can see it)."""
    rec = tmp_path / "events"
    units = f"""
        [units.svc]
        replicas = 4
        command = [{SERVE}, "--delay", "1", "--record", "{rec}", "--name", "svc-{{index}}"]
        ports = {{ http = 0 }}
        {_http_ready()}
    """
    stack = stack_file("[stack]\nmax_starting = 2\n" + units)
    up = subprocess.Popen([sys.executable, "-m", "dynamod", "--state-dir", str(dm.state_dir),
                           "up", str(stack), "--detach"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        seen = dm.wait_for(lambda s: (s.get("start_slots") or {}).get("waiting") and s,
                           timeout=60, what="units waiting for a start slot")
        slots = seen["start_slots"]
        # in line in order; svc@2 may have had its turn by the time status was asked
        assert slots["max_starting"] == 2 and len(slots["starting"]) == 2
        assert slots["waiting"] in (["svc@2", "svc@3"], ["svc@3"])
        waiting = unit_by_name(seen, "svc@3")
        assert waiting["state"] == "inactive" and waiting["pid"] is None
        assert waiting["detail"].startswith("waiting for a start slot (2 of max_starting 2")
    finally:
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0, out
    assert dm.status()["start_slots"] == {"max_starting": 2, "starting": [], "waiting": []}
    rows = records(rec)
    assert sorted(name for what, name, _ in rows if what == "ready") == [
        f"svc-{i}" for i in range(4)]
    assert _most_starting_at_once(rows) == 2
    assert dm.daemon_log().count("unit.start_slot_wait") == 2  # svc@2 and svc@3 waited
    dm.run("down", check=True)

    rec.unlink()
    dm.run("up", str(stack_file(units)), "--detach", check=True)
    assert _most_starting_at_once(records(rec)) == 4


def test_sigkill_restarts_with_backoff(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file(f"""
        [units.svc]
        command = [{SERVE}]
        ports = {{ http = 0 }}
        {_http_ready()}
        restart = {{ first_delay = 0.4, backoff_initial = 0.8, jitter = 0 }}
    """)
    dm.run("up", str(stack), "--detach", check=True)
    first = dm.unit("svc")
    os.kill(first["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    second = dm.wait_ready_again("svc", first["pid"], what="first restart")
    first_delay = time.monotonic() - killed_at
    assert second["restarts"] == 1 and second["last_exit"] == "killed by SIGKILL"
    os.kill(second["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    third = dm.wait_ready_again("svc", first["pid"], second["pid"], what="second restart")
    second_delay = time.monotonic() - killed_at
    assert third["restarts"] == 2
    assert first_delay >= 0.4 and second_delay >= 0.8  # first_delay, then backoff_initial
    log = dm.daemon_log()
    assert "restarting in 0.40s" in log and "restarting in 0.80s" in log


def test_restart_limit_fails_the_unit_and_up(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file("""
        [units.crashy]
        command = ["{python}", "@PROC@", "exit", "3"]
        ready = { kind = "tcp", port = 1, deadline = 5 }
        restart = { backoff_initial = 0.05, limit_burst = 3, limit_interval = 60 }
    """)
    result = dm.run("up", str(stack), "--detach")
    assert result.returncode != 0
    assert "crashy" in result.stderr
    assert "restart limit reached: 3 restarts within 60s" in result.stderr
    assert "exited with status 3" in result.stderr
    assert "exiting with 3" in result.stderr  # the unit's own last lines are shown
    assert not (dm.state_dir / "dynamod.sock").exists()
    down = json.loads((dm.state_dir / "last-down.json").read_text())
    (crashy,) = down["units"]
    assert crashy["restarts"] == 3 and crashy["starts"] == 4


def test_service_exiting_0_at_once_is_a_failed_start(dm: Dynamod, stack_file: Any) -> None:
    """Like the mocker without --model-path: exit 0 before ready is not success."""
    stack = stack_file("""
        [units.quitter]
        command = ["{python}", "@PROC@", "exit", "0"]
        ready = { kind = "tcp", port = 1, deadline = 5 }
        restart = { backoff_initial = 0.05, limit_burst = 2 }
    """)
    result = dm.run("up", str(stack), "--detach")
    assert result.returncode == 1
    assert "exited with status 0 (exited before it was ready" in result.stderr
    assert "restart limit reached" in result.stderr and "log: " in result.stderr
    assert "nothing was left running" in result.stderr


def test_restart_limit_after_the_stack_is_up(dm: Dynamod, stack_file: Any, tmp_path: Path) -> None:
    stack = stack_file(f"""
        [units.svc]
        command = [{SERVE}]
        ports = {{ http = 0 }}
        {_http_ready()}
        restart = {{ backoff_initial = 0.05, limit_burst = 2, limit_interval = 60 }}
    """)
    dm.run("up", str(stack), "--detach", check=True)
    for _ in range(3):
        unit = dm.wait_for(lambda s: (u := unit_by_name(s, "svc"))["pid"] and
                           u["state"] == "ready" and u, what="svc ready")
        os.kill(unit["pid"], signal.SIGKILL)
        dm.wait_for(lambda s, pid=unit["pid"]: unit_by_name(s, "svc")["pid"] != pid,
                    what="svc noticed the kill")
    failed = dm.wait_for(lambda s: (u := unit_by_name(s, "svc"))["state"] == "failed" and u,
                         what="svc failed")
    assert "restart limit reached" in failed["detail"]
    # The daemon keeps running and says the stack is degraded, naming the failed unit.
    status = dm.status()
    assert status["phase"] == "degraded" and "svc" in status["degraded"]
    assert "failed" in dm.run("status").stdout


def test_liveness_failure_restarts_a_hung_process(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file(f"""
        [units.svc]
        command = [{SERVE}]
        ports = {{ http = 0 }}
        {_http_ready()}
        restart = {{ backoff_initial = 0.05 }}
        [units.svc.live]
        kind = "http"
        url = "http://127.0.0.1:{{ports.http}}/health"
        interval = 0.2
        timeout = 0.3
        failure_threshold = 2
    """)
    dm.run("up", str(stack), "--detach", check=True)
    hung = dm.unit("svc")
    os.kill(hung["pid"], signal.SIGSTOP)
    restarted = dm.wait_ready_again("svc", hung["pid"], timeout=15, what="hung unit restarted")
    assert restarted["restarts"] == 1
    assert restarted["last_exit"] == "killed by SIGKILL"
    assert not pid_alive(hung["pid"])
    assert "liveness failed 2 times in a row" in dm.daemon_log()


def test_down_stops_in_reverse_dependency_order(
    dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    rec = tmp_path / "events"
    units = []
    for name, dep in (("base", None), ("mid", "base"), ("top", "mid"), ("other", "base")):
        deps = f'depends_on = ["{dep}"]' if dep else ""
        units.append(f"""
        [units.{name}]
        command = [{SERVE}, "--record", "{rec}", "--name", "{name}", "--stop-delay", "0.2"]
        ports = {{ http = 0 }}
        {deps}
        {_http_ready()}
        """)
    stack = stack_file("\n".join(units))
    dm.run("up", str(stack), "--detach", check=True)
    result = dm.run("down", check=True)
    assert "nothing left running" in result.stdout
    stops = {name: at for what, name, at in records(rec) if what == "stop"}
    assert stops["top"] < stops["mid"] < stops["base"]
    assert stops["other"] < stops["base"]
    # independent units stop in parallel: 'other' does not wait for the top/mid chain
    assert stops["other"] < stops["mid"]


def test_down_leaves_nothing_even_double_forked_term_ignoring(
    dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    pidfile = tmp_path / "stray.pid"
    stack = stack_file(f"""
        [units.forker]
        command = ["{{python}}", "@PROC@", "double-fork", "{pidfile}"]
        ready = {{ kind = "log", pattern = "forked a stray", deadline = 10 }}
        stop = {{ timeout = 1 }}
        [units.stubborn]
        command = [{SERVE}, "--ignore-term"]
        ports = {{ http = 0 }}
        {_http_ready()}
        stop = {{ timeout = 0.5 }}
    """)
    dm.run("up", str(stack), "--detach", check=True)
    status = dm.status()
    stray = int(pidfile.read_text())
    pids = [u["pid"] for u in status["units"]] + [stray, status["daemon_pid"]]
    assert os.getsid(stray) != os.getsid(unit_by_name(status, "forker")["pid"])
    port = unit_by_name(status, "stubborn")["ports"]["http"]
    result = dm.run("down", "--json", check=True)
    down = json.loads(result.stdout)
    assert down["ok"] and down["survivors"] == []
    assert wait_dead(pids, timeout=5) == []
    from dynamod.core.ports import listening

    assert not listening(port)
    stubborn = next(u for u in down["units"] if u["name"] == "stubborn")
    assert "escalated to SIGKILL" in stubborn["detail"]


def test_control_socket_is_private(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file('[units.s]\ncommand = ["sleep", "60"]\n')
    dm.run("up", str(stack), "--detach", check=True)
    assert (dm.state_dir / "dynamod.sock").stat().st_mode & 0o777 == 0o600
    assert dm.state_dir.stat().st_mode & 0o777 == 0o700


def test_sigkilled_daemon_takes_its_units_with_it(
    dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    pidfile = tmp_path / "stray.pid"
    stack = stack_file(f"""
        [units.forker]
        command = ["{{python}}", "@PROC@", "double-fork", "{pidfile}"]
        ready = {{ kind = "log", pattern = "forked a stray", deadline = 10 }}
        [units.svc]
        command = [{SERVE}]
        ports = {{ http = 0 }}
        {_http_ready()}
    """)
    dm.run("up", str(stack), "--detach", check=True)
    status = dm.status()
    stray = int(pidfile.read_text())
    pids = [u["pid"] for u in status["units"]] + [stray]
    assert all(pid_alive(p) for p in pids)
    os.kill(status["daemon_pid"], signal.SIGKILL)
    assert wait_dead(pids, timeout=10) == []


def test_restart_command_and_logs(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file(f"""
        [units.svc]
        command = [{SERVE}]
        ports = {{ http = 0 }}
        {_http_ready()}
    """)
    dm.run("up", str(stack), "--detach", check=True)
    before = dm.unit("svc")
    dm.run("restart", "svc", check=True)
    after = dm.wait_ready_again("svc", before["pid"], what="manual restart")
    assert after["starts"] == 2
    logs = dm.run("logs", "svc", check=True).stdout
    assert logs.count("listening on") == 2 and "start #2" in logs
    missing = dm.run("restart", "nope")
    assert missing.returncode != 0 and "no unit 'nope'" in missing.stderr


def test_status_tree_and_json_fields(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file(f"""
        [units.base]
        command = [{SERVE}]
        ports = {{ http = 0 }}
        {_http_ready()}
        [units.w]
        replicas = 2
        command = [{SERVE}]
        ports = {{ http = 0 }}
        depends_on = ["base"]
        {_http_ready()}
    """)
    dm.run("up", str(stack), "--detach", check=True)
    status = dm.status()
    for unit in status["units"]:
        assert {"name", "state", "pid", "restarts", "ports", "depends_on"} <= set(unit)
    assert unit_by_name(status, "w@1")["depends_on"] == {"base": "ready"}
    printed = json.loads(dm.run("status", "--json", check=True).stdout)  # the CLI's own --json
    assert [(u["name"], u["pid"]) for u in printed["units"]] == [
        (u["name"], u["pid"]) for u in status["units"]]
    text = dm.run("status").stdout
    assert re.search(r"^w@0\s+ready", text, re.M)
    assert re.search(r"^└─ base\s+ready", text, re.M)
