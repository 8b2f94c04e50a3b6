"""Watches the daemon during a chaos run: polls `status` at ~10 Hz and records every unit
state change, each shard's applied policy version, the ledger's current version, and every
pid it saw (for the leftover check). It survives the daemon's absence (a daemon fault)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from dynamod.chaos.history import StateChange, VersionSample
from dynamod.control.client import Client
from dynamod.core.errors import DaemonError


class Observer:
    def __init__(self, state_dir: Path, origin: float, interval: float = 0.1) -> None:
        self.client = Client(state_dir, timeout=5)
        self.origin = origin
        self.interval = interval
        self.states: list[StateChange] = []
        self.versions: list[VersionSample] = []
        self.pids: set[int] = set()
        self.last: dict[str, Any] | None = None
        self.daemon_seen_gone = False
        self._state: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current_version(self) -> int | None:
        last = self.last
        return (last.get("policy") or {}).get("current") if last else None

    def sample(self) -> dict[str, Any] | None:
        try:
            status = self.client.status()
        except DaemonError:
            self.daemon_seen_gone = True
            return None
        self.record(status, time.monotonic() - self.origin)
        return status

    def record(self, status: dict[str, Any], at: float) -> None:
        self.last = status
        if status.get("daemon_pid"):
            self.pids.add(int(status["daemon_pid"]))
        shards: dict[str, int | None] = {}
        admitted: dict[str, bool] = {}
        for unit in status.get("units", []):
            name, state = unit["name"], unit["state"]
            if unit.get("pid"):
                self.pids.add(int(unit["pid"]))
            old = self._state.get(name)
            if old != state:
                self.states.append(StateChange(at, name, old or "none", state, unit.get("pid")))
                self._state[name] = state
            if "policy_version" in unit:
                shards[name] = unit.get("policy_version")
                admitted[name] = bool((unit.get("policy") or {}).get("admitted"))
        current = (status.get("policy") or {}).get("current")
        self.versions.append(VersionSample(at, current, shards, admitted))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="chaos-observer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def states_from_log(path: Path, wall_origin: float) -> list[StateChange]:
    """Every `unit.state` transition in the daemon's JSON log (exact, unlike a 10 Hz poll
    that can miss a short `held`), as seconds since the run's origin."""
    from datetime import datetime

    changes: list[StateChange] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return changes
    for line in lines:
        if '"unit.state"' not in line:
            continue
        try:
            event = json.loads(line)
            wall = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError):
            continue
        changes.append(StateChange(round(wall - wall_origin, 4), event["unit"], event["old"],
                                   event["new"]))
    return changes
