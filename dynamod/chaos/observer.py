"""Watches the daemon during a chaos run: polls `status` at ~10 Hz and records every unit
state change, each shard's applied policy version, the ledger's current version, and every
pid it saw (for the leftover check); once a second it reads the prefix-cache hit rate from
the workers' own metrics (each shard's system port `/metrics`, vLLM's prefix-cache
counters), the tokens the engines really found cached. It survives the daemon's absence."""

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
        self._counts: dict[tuple[str, int], tuple[float, float]] = {}  # (unit, pid) -> last
        self._state: dict[str, str] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

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
        """One interval's hit rate over every running shard: the growth of its hit and
        query counters since the last read, summed (a restarted shard starts over)."""
        hits = queries = 0.0
        counts: dict[tuple[str, int], tuple[float, float]] = {}
        for unit in (self.last or {}).get("units", []):
            url = (unit.get("dynamo") or {}).get("system_url")
            if "policy_version" not in unit or not url or not unit.get("pid"):
                continue
            totals = read_prefix_counters(f"{url}/metrics")
            if totals is None:
                continue
            key = (unit["name"], int(unit["pid"]))
            counts[key] = totals
            last = self._counts.get(key)
            if last is not None and totals[1] >= last[1]:
                hits += totals[0] - last[0]
                queries += totals[1] - last[1]
        self._counts = counts
        if queries > 0:
            self.cache.append(CacheSample(time.monotonic() - self.origin, "workers",
                                          hits / queries))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def _cache_loop(self) -> None:
        # apart from the status poll: a paused shard's /metrics stalls until its timeout
        while not self._stop.wait(1.0):
            self.sample_cache()

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._loop, name="chaos-observer", daemon=True),
                         threading.Thread(target=self._cache_loop, name="chaos-cache",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)


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


# vLLM's prefix-cache counters, in prompt tokens (dynamod/workers/cpu/routes.py serves them
# under the same names as dynamo.vllm's system port)
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"


def parse_prefix_counters(metrics: str) -> tuple[float, float] | None:
    """(hits, queries) summed over every labelled series; None when either is absent."""
    found: dict[str, float] = {}
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (PREFIX_HITS, PREFIX_QUERIES):
            try:
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    if PREFIX_HITS not in found or PREFIX_QUERIES not in found:
        return None
    return found[PREFIX_HITS], found[PREFIX_QUERIES]


def read_prefix_counters(url: str) -> tuple[float, float] | None:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return parse_prefix_counters(resp.read().decode(errors="replace"))
    except (OSError, ValueError):
        return None
