"""`dynamod events` on a real small stack: a kill -9's transitions and restart, in order,
with their reasons; still there after `down`; `--follow` shows a kill within 2 s."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.conftest import Dynamod

pytestmark = pytest.mark.slow

STACK = """
    [units.db]
    command = ["sleep", "600"]

    [units.worker]
    command = ["{python}", "@PROC@", "serve", "{ports.http}"]
    depends_on = ["db"]
    ports = { http = 0 }
    ready = { kind = "http", url = "http://127.0.0.1:{ports.http}/health", interval = 0.05, deadline = 20 }
    restart = { first_delay = 0.3, jitter = 0 }
"""


def _events(dm: Dynamod, *args: str) -> list[dict[str, Any]]:
    out = dm.run("events", "--json", "-n", "1000", *args, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def _after(events: list[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    """The worker's events from the one that says it was spawned as `pid` on."""
    mine = [e for e in events if e["unit"] == "worker"]
    start = next(i for i, e in enumerate(mine) if e.get("reason") == f"spawned pid {pid}")
    return mine[start:]


def test_a_kill_shows_as_events_in_order_and_after_down(dm: Dynamod, stack_file: Any) -> None:
    dm.run("up", str(stack_file(STACK)), "--detach", check=True)
    first = dm.unit("worker")
    os.kill(first["pid"], signal.SIGKILL)
    second = dm.wait_ready_again("worker", first["pid"], what="restart after kill")

    seen = _after(_events(dm), first["pid"])
    steps = [(e["kind"], e.get("from"), e.get("to")) for e in seen]
    assert steps[:6] == [
        ("state", "inactive", "starting"),
        ("state", "starting", "ready"),
        ("state", "ready", "backoff"),
        ("restart", None, None),
        ("state", "backoff", "starting"),
        ("state", "starting", "ready"),
    ], steps
    kill, restart = seen[2], seen[3]
    assert "killed by SIGKILL" in kill["reason"] and "restarting in 0.30s" in kill["reason"]
    assert restart["exit"] == "killed by SIGKILL" and restart["delay_s"] == 0.3
    assert restart["restarts"] == 1
    assert seen[4]["reason"] == f"spawned pid {second['pid']}"
    monos = [e["mono"] for e in seen[:6]]
    assert monos == sorted(monos) and seen[4]["mono"] - seen[2]["mono"] >= 0.3  # the delay

    people = dm.run("events", "-u", "worker", check=True).stdout
    assert "ready -> backoff" in people and "killed by SIGKILL" in people

    dm.run("down", check=True)
    after = _events(dm)
    assert _after(after, first["pid"])[:6] == seen[:6]  # the daemon has gone; the file stays
    assert [e.get("phase") for e in after if e["kind"] == "phase"][-1] == "stopped"

    bad = dm.run("events", "--since", "yesterdayish")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--since 'yesterdayish'" in bad.stderr


def test_follow_shows_a_kill_within_two_seconds(dm: Dynamod, stack_file: Any) -> None:
    dm.run("up", str(stack_file(STACK)), "--detach", check=True)
    worker = dm.unit("worker")
    cmd = [sys.executable, "-m", "dynamod", "--state-dir", str(dm.state_dir),
           "events", "--follow", "--json", "-n", "1"]  # fmt: skip
    follow = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert follow.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(follow.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=30), "events --follow printed no history"
        follow.stdout.readline()  # the last event so far: it is reading
        os.kill(worker["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        lines: list[dict[str, Any]] = []
        while time.monotonic() - killed_at < 2.0:
            if sel.select(timeout=2.0 - (time.monotonic() - killed_at)):
                lines.append(json.loads(follow.stdout.readline()))
                if any(e.get("to") == "backoff" and e["unit"] == "worker" for e in lines):
                    break
        assert any(e.get("to") == "backoff" and "SIGKILL" in e["reason"] for e in lines), lines
    finally:
        follow.terminate()
        follow.wait(timeout=10)
