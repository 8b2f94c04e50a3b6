"""`dynamod stop UNIT` / `start UNIT` against real processes: one replica held stopped past
its backoff while the others keep their pids, then started back to ready."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Dynamod, pid_alive, unit_by_name

pytestmark = pytest.mark.slow

SERVE = '"{python}", "@PROC@", "serve", "{ports.http}"'
READY = ('ready = { kind = "http", url = "http://127.0.0.1:{ports.http}/health", '
         'interval = 0.05, deadline = 20 }')


def test_stop_holds_one_replica_and_start_brings_it_back(
    dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    stack = stack_file(f"""
        [units.base]
        command = [{SERVE}]
        ports = {{ http = 0 }}
        {READY}
        [units.worker]
        replicas = 2
        command = [{SERVE}]
        ports = {{ http = 0 }}
        depends_on = {{ base = "ready" }}
        {READY}
        [units.worker.restart]
        backoff_initial = 0.1
        jitter = 0
    """)
    dm.run("up", str(stack), "--detach", check=True)
    before = {u["name"]: u["pid"] for u in dm.status()["units"]}
    out = dm.run("stop", "worker@1", check=True).stdout
    assert "worker@1 stopped" in out
    assert not pid_alive(before["worker@1"])
    time.sleep(1.0)  # ten times its backoff: it is not started again
    status = dm.status()
    held = unit_by_name(status, "worker@1")
    assert held["state"] == "stopped" and held["pid"] is None
    assert held["operator_stop"] is not None
    assert held["detail"].startswith("stopped by `dynamod stop` ")
    assert {u["name"]: u["pid"] for u in status["units"] if u["name"] != "worker@1"} == {
        n: p for n, p in before.items() if n != "worker@1"}
    assert "stopped by `dynamod stop`" in dm.run("status").stdout
    again = dm.run("stop", "worker@1")
    assert again.returncode == 0 and "already stopped" in again.stdout
    unknown = dm.run("stop", "wroker")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().count("\n") == 0 and "did you mean worker" in unknown.stderr
    assert "worker@1 started" in dm.run("start", "worker@1", check=True).stdout
    back = dm.wait_for(lambda s: (u := unit_by_name(s, "worker@1"))["state"] == "ready" and u,
                       what="worker@1 ready again")
    assert back["operator_stop"] is None and back["pid"] != before["worker@1"]
    running = dm.run("start", "worker@1")
    assert running.returncode == 0 and "already running" in running.stdout
    dm.run("down", check=True)
