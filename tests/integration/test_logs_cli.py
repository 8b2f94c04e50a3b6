"""`dynamod logs` on a real infra stack, and the daemon's own log as JSON lines."""

from __future__ import annotations

import json

import pytest

from tests.conftest import Dynamod, unit_by_name

pytestmark = pytest.mark.slow


def test_logs_of_a_running_and_a_stopped_stack(dm: Dynamod) -> None:
    dm.run("up", "infra", "--detach", check=True)
    etcd = unit_by_name(dm.status(), "etcd")

    lines = dm.run("logs", "etcd", check=True).stdout.splitlines()
    assert lines[0].startswith(f"--- dynamod: start #1 pid {etcd['pid']}: ")
    assert lines[0].endswith("--log-level warn")
    assert any('"level":"warn"' in line for line in lines[1:])  # etcd's own output

    two = dm.run("logs", "nats", "-n", "2", check=True).stdout.splitlines()
    assert len(two) == 3 and two[0].startswith("--- dynamod: start #1 pid ")  # + its header

    missing = dm.run("logs", "frontend")
    assert missing.returncode == 1
    assert "no log for unit 'frontend'" in missing.stderr and "etcd, nats" in missing.stderr

    dm.run("down", check=True)
    after = dm.run("logs", "etcd", "-n", "1000", check=True).stdout.splitlines()
    assert after[: len(lines)] == lines  # still readable once the daemon has gone

    # not a terminal: the daemon's structured log is one JSON object per line
    records = [json.loads(line) for line in dm.daemon_log().splitlines() if line.strip()]
    events = [r["event"] for r in records]
    assert "stack.ready" in events and "stack.down" in events
    assert all({"event", "level", "timestamp"} <= r.keys() for r in records)
