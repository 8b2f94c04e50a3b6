"""The hot-spare half of bench.recovery: `kill -9` of a serving shard with one spare, until
the stack has its N admitted shards at the current policy version again (the
`spares.promoted` event in daemon.log, same clock as the kill), under trainer-like load
(every request requires the current version's taint; a non-200 answer is a failure).

Scenarios, each a few kills on one stack (`--var spares=1`, 2 serving shards):
  current   the spare holds the current version and is awake
  behind    the kill lands right after a push returns, while the spare is being replayed
            in the background (each promotion says whether the spare was behind)
  asleep    the spare sleeps (`dynamod policy spares --sleep`); the promotion wakes it
and the time a push takes with and without a spare: for the trainer (the push call) and
in total (until the spare holds the new version too).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.procs import wait_until
from bench.runners import Dynamod
from bench.stack import MODEL, prebuilt_model


class Load(threading.Thread):
    """Sequential trainer-like requests (4 workers) that require the current version."""

    def __init__(self, url: str, version: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.version = url, version
        self.stop = threading.Event()
        self.hold = threading.Event()  # set: send nothing (the trainer does not generate
        self.in_flight = 0  # while it pushes); requests in flight may still finish
        self._lock = threading.Lock()
        self.rows: list[tuple[float, int]] = []  # (sent, status)
        self.errors: list[tuple[float, int, str]] = []  # (sent, status, first bytes)

    def one(self) -> None:
        body = {
            "model": MODEL,
            "prompt": "the policy says",
            "max_tokens": 4,
            "nvext": {
                "routing_constraints": {"required_taints": [f"dynamod.policy/{self.version[0]}"]}
            },
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        sent = time.time()
        with self._lock:
            self.in_flight += 1
        try:
            with urllib.request.urlopen(request, timeout=20) as resp:
                status = resp.status
                resp.read()
        except urllib.error.HTTPError as exc:
            status = exc.code
            self.errors.append((sent, status, exc.read()[:200].decode(errors="replace")))
        except OSError as exc:
            status = -1
            self.errors.append((sent, status, repr(exc)[:200]))
        finally:
            with self._lock:
                self.in_flight -= 1
        self.rows.append((sent, status))

    def run(self) -> None:
        def worker() -> None:
            while not self.stop.is_set():
                if self.hold.is_set():
                    time.sleep(0.005)
                    continue
                self.one()
                time.sleep(0.05)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def pause(self) -> None:
        """Stop sending and wait for what is in flight (a push changes every taint)."""
        self.hold.set()
        wait_until(lambda: self.in_flight == 0, 30, 0.005, "requests in flight to finish")

    def failures(self, start: float, end: float) -> int:
        return sum(1 for sent, status in self.rows if start <= sent <= end and status != 200)


def roles(dm: Dynamod) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"serving": [], "spare": []}
    for unit in dm.status()["units"]:
        role = (unit.get("spare") or {}).get("role")
        if role in out and unit["state"] == "ready":
            out[role].append(unit)
    return out


def settled(dm: Dynamod, version: int, asleep: bool = False) -> dict[str, list[dict[str, Any]]]:
    def check() -> dict[str, list[dict[str, Any]]] | None:
        now = roles(dm)
        ok = (
            len(now["serving"]) == 2
            and len(now["spare"]) == 1
            and all(u.get("policy_version") == version for u in now["serving"])
            and (asleep or now["spare"][0].get("policy_version") == version)
            and bool(now["spare"][0]["spare"].get("sleeping")) == asleep
        )
        return now if ok else None

    result: dict[str, list[dict[str, Any]]] = wait_until(
        check, 120, 0.05, f"2 serving + 1 spare at v{version}"
    )
    return result


def promoted_after(dm: Dynamod, t_kill: float) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        return next(
            (e for e in dm.events() if e.get("event") == "spares.promoted" and e["t"] >= t_kill),
            None,
        )

    found: dict[str, Any] = wait_until(find, 30, 0.01, "spares.promoted")
    return found


def spares_current_after(dm: Dynamod, t0: float, version: int) -> float:
    def find() -> float | None:
        for e in dm.events():
            if e.get("event") == "spares.current" and e["t"] >= t0 and e["version"] == version:
                return float(e["t"])
        return None

    found: float = wait_until(find, 60, 0.01, f"spares current at v{version}")
    return found


def checkpoint(root: Path, step: int) -> Path:
    path = root / "ckpt" / f"step-{step}"
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(prebuilt_model() / "model.safetensors", path / "model.safetensors")
    return path


def push(dm: Dynamod, state: Path, step: int) -> float:
    """Push `step` over the control socket; returns the seconds the trainer waits."""
    started = time.monotonic()
    dm.client.policy_push(step, checkpoint(state, step))
    return time.monotonic() - started


def kill_serving(dm: Dynamod, version: int, victim: dict[str, Any] | None = None) -> dict[str, Any]:
    victim = victim or roles(dm)["serving"][0]
    t_kill = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    event = promoted_after(dm, t_kill)
    return {"victim": victim["name"], "t_kill": t_kill, "event": event, "version": version}


def frontend_url(dm: Dynamod) -> str:
    return f"http://127.0.0.1:{dm.unit('frontend')['ports']['http']}"


def run_spares(state: Path, stack_file: Path, kills: int) -> dict[str, Any]:
    """All three scenarios and the push timings on one stack with one spare."""
    dm = Dynamod(state)
    out: dict[str, Any] = {"push_s": [], "push_total_s": [], "failed": {}, "spans": {}}
    runs: dict[str, list[dict[str, Any]]] = {"current": [], "behind": [], "asleep": []}
    out["runs"] = runs
    try:
        dm.up(stack_file, "spares=1", timeout=180)
        version = [1]
        push(dm, state, 1)
        load = Load(frontend_url(dm), version)
        load.start()
        try:
            step = 1
            started = time.time()
            for _ in range(kills):  # the spare is current and awake
                settled(dm, step)
                time.sleep(0.5)
                runs["current"].append(kill_serving(dm, step))
            settled(dm, step)
            out["spans"]["current"] = (started, time.time())
            started = time.time()
            for _ in range(kills):  # killed while the spare replays the push just returned
                settled(dm, step)
                time.sleep(0.5)
                step += 1
                victim = roles(dm)["serving"][0]  # chosen first: the kill follows the push at once
                load.pause()
                push(dm, state, step)
                version[0] = step
                load.hold.clear()
                runs["behind"].append(kill_serving(dm, step, victim))
            settled(dm, step)
            out["spans"]["behind"] = (started, time.time())
            for _ in range(
                kills
            ):  # pushes alone: the trainer's wait and until the spare is current
                settled(dm, step)
                load.pause()
                step += 1
                t0 = time.time()
                out["push_s"].append(push(dm, state, step))
                version[0] = step
                load.hold.clear()
                out["push_total_s"].append(spares_current_after(dm, t0, step) - t0)
            dm.cli("policy", "spares", "--sleep")
            started = time.time()
            for _ in range(kills):  # asleep at the current version: the wake is on the path
                settled(dm, step, asleep=True)
                time.sleep(0.5)
                runs["asleep"].append(kill_serving(dm, step))
            settled(dm, step, asleep=True)
            out["spans"]["asleep"] = (started, time.time())
        finally:
            load.stop.set()
            load.join(30)
        for name, runs_of in runs.items():
            for run in runs_of:
                run["promote_s"] = run["event"]["t"] - run["t_kill"]
            out["failed"][name] = load.failures(*out["spans"][name])
        out["restarts"] = {u["name"]: u["restarts"] for u in dm.status()["units"]}
        out["frontend_events"] = [
            {k: e.get(k) for k in ("t", "old", "new", "detail")}
            for e in dm.events()
            if e.get("event") == "unit.state" and e.get("unit") == "frontend"
        ]
        out["requests"] = len(load.rows)
        out["failed_total"] = sum(1 for _, status in load.rows if status != 200)
        kill_times = sorted(r["t_kill"] for runs_of in runs.values() for r in runs_of)
        out["errors"] = [
            {
                "after_kill_s": round(sent - max([t for t in kill_times if t <= sent] or [0]), 3),
                "status": status,
                "body": body,
            }
            for sent, status, body in load.errors
        ]
    finally:
        dm.close()
    return out


def push_without_spares(dm: Dynamod, state: Path, reps: int, first_step: int) -> list[float]:
    """The same pushes on the stack with no spare: the trainer's wait is the total."""
    return [push(dm, state, first_step + i) for i in range(reps)]
