"""Outages with real processes: a service that exits after it was ready, a dependency that
goes away, a crash loop without a readiness probe, and the degraded phase."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Dynamod, unit_by_name
from tests.integration.test_metrics import free_port, scrape
from tests.integration.test_sdnotify import NotifySocket

pytestmark = pytest.mark.slow

SERVE = '"{python}", "@PROC@", "serve", "{ports.http}"'
READY = ('ready = { kind = "http", url = "http://127.0.0.1:{ports.http}/health", '
         'interval = 0.05, deadline = 20 }')


def _states_for(
    dm: Dynamod,
    name: str,
    seconds: float,
    until: Callable[[list[dict[str, Any]]], bool] = lambda seen: False,
) -> list[dict[str, Any]]:
    """The unit's status, sampled for `seconds`, or until `until(samples)` holds once at
    least one second has been sampled (a loaded machine may need the whole window)."""
    seen = []
    started = time.monotonic()
    while time.monotonic() < started + seconds:
        seen.append(dm.unit(name))
        if time.monotonic() > started + 1.0 and until(seen):
            break
        time.sleep(0.05)
    return seen


def test_a_service_that_exits_0_after_it_was_ready_has_failed(
    dm: Dynamod, stack_file: Any
) -> None:
    stack = stack_file("""
        [units.quits]
        command = ["{python}", "@PROC@", "exit", "0", "--after", "1.0"]
        restart = { min_uptime = 0.3, backoff_initial = 0.05, limit_burst = 100 }
        [units.done]
        command = ["{python}", "@PROC@", "exit", "0", "--after", "1.0"]
        restart = { min_uptime = 0.3, clean_exit_final = true }
    """)
    dm.run("up", str(stack), "--detach", check=True)
    restarted = dm.wait_for(lambda s: unit_by_name(s, "quits")["restarts"] >= 1 and
                            unit_by_name(s, "done")["state"] == "completed",
                            timeout=10, what="quits restarted, done completed")
    assert restarted
    quits = dm.unit("quits")
    assert quits["state"] != "completed"
    assert quits["last_exit"] == "exited with status 0"
    assert dm.unit("done")["restarts"] == 0


def test_a_unit_whose_dependency_is_away_waits_naming_it_and_the_stack_says_degraded(
    dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    stack = stack_file(f"""
        [units.db]
        command = [{SERVE}]
        ports = {{ http = 0 }}
        {READY}
        restart = {{ first_delay = 3, jitter = 0 }}
        [units.app]
        command = [{SERVE}]
        ports = {{ http = 0 }}
        depends_on = {{ db = "ready" }}
        {READY}
        restart = {{ limit_burst = 1 }}
    """)
    notify = NotifySocket(tmp_path / "notify")
    metrics_port = free_port()
    dm.run("up", str(stack), "--detach", "--metrics-addr", f"127.0.0.1:{metrics_port}",
           check=True, env={"NOTIFY_SOCKET": str(notify.path)})
    db, app = dm.unit("db"), dm.unit("app")
    assert dm.status()["phase"] == "up" and dm.status()["degraded"] == {}
    notify.drain(0.3)
    os.kill(db["pid"], signal.SIGKILL)
    dm.wait_for(lambda s: unit_by_name(s, "db")["state"] == "backoff", timeout=5,
                what="db in backoff")
    os.kill(app["pid"], signal.SIGKILL)
    status = dm.wait_for(
        lambda s: unit_by_name(s, "app")["state"] == "waiting" and s, timeout=5,
        what="app waiting for db")
    waiting = unit_by_name(status, "app")
    assert "waiting for db (ready)" in waiting["detail"], waiting["detail"]
    assert waiting["restarts"] == 0  # the dependency's outage is not the unit's failure
    # degraded, naming the units and why: in status, sd_notify STATUS= and the metrics
    assert status["phase"] == "degraded"
    assert status["degraded"]["app"].startswith("waiting: ")
    assert "waiting for db (ready)" in status["degraded"]["app"]
    assert status["degraded"]["db"].startswith("backoff: ")
    assert "degraded: " in dm.run("status", check=True).stdout
    lines = [m.get("STATUS", "") for m in notify.collect(0.5)]
    assert any("stack" in line and "degraded" in line and "app waiting (" in line
               for line in lines), lines
    samples, _ = scrape(metrics_port)
    degraded = {dict(labels)["unit"]: dict(labels) for (name, labels), value in samples.items()
                if name == "dynamod_stack_degraded_unit" and value == 1}
    assert degraded["app"]["state"] == "waiting", degraded
    assert samples[("dynamod_stack_phase",
                    frozenset({("stack", "stack"), ("phase", "degraded")}))] == 1
    back = dm.wait_ready_again("app", app["pid"], timeout=15)
    assert back["restarts"] == 0
    assert dm.wait_for(lambda s: s["phase"] == "up" and s["degraded"] == {}, timeout=5,
                       what="up again")
    samples, _ = scrape(metrics_port)
    assert not [k for k, v in samples.items() if k[0] == "dynamod_stack_degraded_unit" and v]
    # the same kill with db ready counts against app's limit (limit_burst = 1): restarted
    os.kill(back["pid"], signal.SIGKILL)
    again = dm.wait_ready_again("app", back["pid"], timeout=10)
    assert again["restarts"] == 1


def test_a_crash_looping_unit_without_a_probe_never_shows_ready(
    dm: Dynamod, stack_file: Any
) -> None:
    stack = stack_file("""
        [units.steady]
        command = ["{python}", "@PROC@", "sleep"]
        restart = { min_uptime = 1.0 }
        [units.looper]
        command = ["{python}", "@PROC@", "exit", "1", "--after", "0.4"]
        # (up 0.4 s after its interpreter started: min_uptime 3 s leaves a loaded machine
        # 2.6 s to start Python before a run of it would count as up)
        [units.looper.restart]
        min_uptime = 3.0
        backoff_initial = 0.05
        backoff_max = 0.1
        limit_burst = 1000
    """)
    up = subprocess.Popen(
        [sys.executable, "-m", "dynamod", "--state-dir", str(dm.state_dir), "up", str(stack),
         "--detach", "--timeout", "9"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def looped(seen: list[dict[str, Any]]) -> bool:  # three starts, and an exit's reason seen
        return max(u["starts"] for u in seen) >= 3 and any(
            "exited within min_uptime 3s" in u["detail"] for u in seen)

    try:
        dm.wait_for(lambda s: unit_by_name(s, "looper")["starts"] >= 1, timeout=10,
                    what="looper started")
        looper = _states_for(dm, "looper", 6.0, until=looped)
        steady = dm.unit("steady")
    finally:
        _out, err = up.communicate(timeout=60)
    assert {u["state"] for u in looper} <= {"starting", "backoff", "inactive"}, looper
    assert max(u["starts"] for u in looper) >= 3  # it did loop
    assert steady["state"] == "ready" and steady["uptime_s"] >= 1.0
    assert up.returncode == 1
    assert "looper" in err, err
    assert any("exited within min_uptime 3s" in u["detail"] for u in looper), looper
