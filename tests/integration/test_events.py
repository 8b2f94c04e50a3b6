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
    ready = { kind = "http", url = "http://127.0.0.1:{ports.http}/health", interval = 0.05 }
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


def _follow(dm: Dynamod) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "dynamod", "--state-dir", str(dm.state_dir),
           "events", "--follow", "--json", "-n", "1"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def _followed_kill(follow: subprocess.Popen[str], pid: int) -> list[dict[str, Any]]:
    """Kill `pid` once `follow` is reading; what it printed within 10 s of the kill (it
    stops at the backoff line: live, not at the next start)."""
    assert follow.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(follow.stdout, selectors.EVENT_READ)
    assert sel.select(timeout=30), "events --follow printed no history"
    follow.stdout.readline()  # the last event so far: it is reading
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    lines: list[dict[str, Any]] = []
    while (left := 10.0 - (time.monotonic() - killed_at)) > 0 and sel.select(timeout=left):
        lines.append(json.loads(follow.stdout.readline()))
        if any(e.get("to") == "backoff" for e in lines):
            break
    return lines


def test_a_kill_shows_as_events_in_order_live_and_after_down(
    dm: Dynamod, stack_file: Any
) -> None:
    dm.run("up", str(stack_file(STACK)), "--detach", check=True)
    first = dm.unit("worker")
    follow = _follow(dm)
    try:
        live = _followed_kill(follow, first["pid"])
    finally:
        follow.terminate()
        follow.wait(timeout=10)
    assert any(e["unit"] == "worker" and e.get("to") == "backoff" and "SIGKILL" in e["reason"]
               for e in live), live  # fmt: skip
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

    dm.run("down", check=True)
    after = _events(dm)
    assert _after(after, first["pid"])[:6] == seen[:6]  # the daemon has gone; the file stays
    assert [e.get("phase") for e in after if e["kind"] == "phase"][-1] == "stopped"
    people = dm.run("events", "-u", "worker", check=True).stdout
    assert "ready -> backoff" in people and "killed by SIGKILL" in people

    bad = dm.run("events", "--since", "yesterdayish")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--since 'yesterdayish'" in bad.stderr
