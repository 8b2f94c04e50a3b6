"""Watches the daemon during a chaos run: polls `status` at ~10 Hz and records every unit
state change, each shard's applied policy version, the ledger's current version, and every
pid it saw (for the leftover check); once a second it reads the kv router's prefix-cache
hit rate from the frontend's metrics. It survives the daemon's absence (a daemon fault)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from dynamod.chaos.history import CacheSample, StateChange, VersionSample
from dynamod.client import Client
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
        self.cache: list[CacheSample] = []
        self.metrics_url: str | None = None  # the frontend's /metrics, set once it is up
        self._hits: tuple[float, float] | None = None  # last (sum, count) of the histogram
        self._next_cache = 0.0
        self._state: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current_version(self) -> int | None:
        last = self.last
        return (last.get("policy") or {}).get("current") if last else None

    def frontend_url(self, fallback: str) -> str:
        """The frontend's URL in the latest status (its port changes when the daemon is
        started again), else `fallback`."""
        for unit in (self.last or {}).get("units", []):
            if unit["name"] == "frontend" and (unit.get("ports") or {}).get("http"):
                return f"http://127.0.0.1:{unit['ports']['http']}"
        return fallback

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

    def sample_cache(self) -> None:
        """One interval's mean kv hit rate: the delta of the router's histogram sum/count."""
        import urllib.request

        if self.metrics_url is None:
            return
        try:
            url = f"{self.frontend_url(self.metrics_url.removesuffix('/metrics'))}/metrics"
            with urllib.request.urlopen(url, timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            self._hits = None  # a restarted frontend starts its counters over
            return
        totals = parse_hit_rate(text)
        if totals is None:
            return
        last, self._hits = self._hits, totals
        if last is not None and totals[1] > last[1]:
            rate = (totals[0] - last[0]) / (totals[1] - last[1])
            self.cache.append(CacheSample(time.monotonic() - self.origin, "frontend", rate))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            if time.monotonic() >= self._next_cache:
                self._next_cache = time.monotonic() + 1.0
                self.sample_cache()
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


_HIT_RATE = "dynamo_component_router_kv_hit_rate"


def parse_hit_rate(metrics: str) -> tuple[float, float] | None:
    """(sum, count) of the kv router's per-request prefix hit-rate histogram."""
    found: dict[str, float] = {}
    for line in metrics.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"{_HIT_RATE}_{part}"):
                found[part] = found.get(part, 0.0) + float(line.rsplit(" ", 1)[1])
    return (found["sum"], found["count"]) if len(found) == 2 else None
