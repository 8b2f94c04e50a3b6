"""Benchmark 2b - hot spares (also the hot-spare half of bench.recovery): `kill -9` of a
serving shard with one spare, until the stack has its N admitted shards at the current
policy version again (the `spares.promoted` event in daemon.log, same clock as the kill:
the spare is tainted and a canary through the frontend has reached it), under
trainer-like load (every request requires the current version's taint; a non-200 answer
is a failure, and each failure is listed by phase, status and body).

    python -m bench.spare_kills [--quick] [--json]

Alone it also kills serving shards of the same stack with no spare (`--var spares=0`:
kill -> the victim admitted again, its cold start included) for the side-by-side ratio,
and splits each current-spare kill into its steps from daemon.log: kill -> the shard seen
dying (its threads ending), -> the promotion started, -> promoted (taint, canary), and
kill -> the exit reaped (the kernel's teardown). It prints the load average: under load
the numbers are provisional.

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
import re
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.procs import bench_mark, iso_epoch, state_dir, sweep, wait_until
from bench.report import Report, Table, emit, entry, options, ratio, summary
from bench.runners import Dynamod
from bench.stack import MODEL, prebuilt_model, serve_stack


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


def promoted_after(dm: Dynamod, t_kill: float, timeout: float = 30) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        return next(
            (e for e in dm.events() if e.get("event") == "spares.promoted" and e["t"] >= t_kill),
            None,
        )

    found: dict[str, Any] = wait_until(find, timeout, 0.01, "spares.promoted")
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
        events = dm.events()
        for name, runs_of in runs.items():
            for run in runs_of:
                run["promote_s"] = run["event"]["t"] - run["t_kill"]
                run["steps_s"] = steps_of(events, run)
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
                "phase": next(
                    (n for n, (a, b) in out["spans"].items() if a <= sent <= b), "between"
                ),
                "status": status,
                "body": body,
            }
            for sent, status, body in load.errors
        ]
        # What the frontend logged about models and workers after each of the first kills
        # (evidence for or against it dropping the model, as in the 503s once seen here).
        out["frontend_after_kill"] = [
            frontend_lines(state, r["t_kill"] - 0.2, r["t_kill"] + 6, limit=20)
            for r in runs["current"][:3]
        ]
        if load.errors:  # what the frontend said while it failed them
            first, last = min(e[0] for e in load.errors), max(e[0] for e in load.errors)
            out["frontend_log"] = frontend_lines(state, first - 2, last + 2)
    finally:
        dm.close()
    return out


WORDS = re.compile(r"model|worker|instance|remov|added|lease|WARN|ERROR", re.IGNORECASE)
# The frontend logs every request at INFO; those lines say nothing about its model list.
REQUEST = re.compile(r"http-request:|Selected worker")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z)")


def frontend_lines(state: Path, start: float, end: float, limit: int = 60) -> list[str]:
    """The frontend's log lines about models, workers and errors between start and end
    (epoch seconds, by the line's own timestamp)."""
    path = state / "logs" / "frontend.log"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    found = []
    for line in lines:
        stamp = STAMP.search(line)
        if (
            stamp
            and WORDS.search(line)
            and not REQUEST.search(line)
            and start <= iso_epoch(stamp.group(1)) <= end
        ):
            found.append(ANSI.sub("", line)[:300])
    return found[:limit]


def steps_of(events: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, float | None]:
    """Seconds from the kill to each step of one promotion, from daemon.log (None: not seen)."""
    victim, t_kill = run["victim"], run["t_kill"]

    def first(match: Any) -> float | None:
        found = [e["t"] for e in events if e["t"] >= t_kill and match(e)]
        return min(found) - t_kill if found else None

    spare, promoted = run["event"]["unit"], run["event"]["t"]
    missed = sum(  # canaries that did not reach the spare yet (each retried)
        1
        for e in events
        if e.get("event") == "unit.state"
        and e.get("unit") == spare
        and t_kill <= e["t"] <= promoted
        and "last canary:" in str(e.get("detail"))
    )
    return {
        "canaries_missed": float(missed),
        "dying": first(lambda e: e.get("event") == "spares.shard_dying" and e["unit"] == victim),
        "promoting": first(
            lambda e: e.get("event") == "spares.promoting" and e["replaced"] == victim
        ),
        "exit": first(
            lambda e: (
                e.get("event") == "unit.state"
                and e.get("unit") == victim
                and e.get("new") in {"backoff", "failed", "waiting"}
            )
        ),
    }


def no_spare_kills(state: Path, stack_file: Path, kills: int) -> tuple[list[float], list[float]]:
    """kill -9 of a serving shard on the same stack with no spare: seconds until the victim
    is admitted again (held -> ready), its restart and cold start included. One kill per
    shard, so each is a first failure (an immediate restart). Then 3 pushes on it."""
    dm = Dynamod(state)
    times: list[float] = []
    pushes: list[float] = []
    try:
        dm.up(stack_file, "spares=0", timeout=180)
        push(dm, state, 1)
        for k in range(kills):
            name = f"worker@{k % 2}"

            def admitted(name: str = name) -> dict[str, Any] | None:
                u = dm.unit(name)
                return u if u["state"] == "ready" and u.get("policy_version") == 1 else None

            unit = wait_until(admitted, 120, 0.05, f"{name} admitted")
            time.sleep(0.5)
            t_kill = time.time()
            os.kill(unit["pid"], signal.SIGKILL)

            def back(name: str = name, t_kill: float = t_kill) -> float | None:
                for e in dm.events():
                    if (
                        e.get("event") == "unit.state"
                        and e.get("unit") == name
                        and e.get("old") == "held"
                        and e.get("new") == "ready"
                        and e["t"] >= t_kill
                    ):
                        return float(e["t"])
                return None

            times.append(wait_until(back, 180, 0.05, f"{name} admitted again") - t_kill)
        for name in ("worker@0", "worker@1"):
            wait_until(lambda name=name: admitted(name), 120, 0.05, f"{name} admitted")
        pushes = push_without_spares(dm, state, 3, first_step=2)
    finally:
        dm.close()
    return times, pushes


def push_without_spares(dm: Dynamod, state: Path, reps: int, first_step: int) -> list[float]:
    """The same pushes on the stack with no spare: the trainer's wait is the total."""
    return [push(dm, state, first_step + i) for i in range(reps)]


def spare_tables(
    report: Report,
    spares: dict[str, Any],
    plain: dict[str, float],
    pushes_plain: list[float],
    plain_label: str = "no spare (the recovery above)",
) -> None:
    """kill -> N admitted again with one spare, against the recovery without one."""
    runs = spares["runs"]
    table = Table(
        "kill -9 of a serving shard -> N admitted shards at the current version again, seconds",
        [
            "with",
            "kills",
            "median",
            "p95",
            "against no spare",
            "of which after dynamod's first notice (median)",
            "failed requests",
            "spare was",
        ],
        digits=3,
    )
    table.rows.append(
        [
            plain_label,
            plain["n"],
            plain["median"],
            plain["p95"],
            1.0,
            "-",
            "-",
            "-",
        ]
    )
    labels = {
        "current": "a current, awake spare",
        "behind": "a spare being replayed (kill as the push returns)",
        "asleep": "a sleeping spare (wake included)",
    }
    medians = {}
    for name, label in labels.items():
        x = summary(r["promote_s"] for r in runs[name])
        medians[name] = x["median"]
        behind = sum(1 for r in runs[name] if r["event"]["was_version"] != r["event"]["version"])
        asleep = sum(1 for r in runs[name] if r["event"]["was_asleep"])
        was = f"{behind} behind, {asleep} asleep"
        table.rows.append(
            [
                label,
                x["n"],
                x["median"],
                x["p95"],
                ratio(x["median"], plain["median"]),
                summary(r["event"]["total_ms"] / 1000 for r in runs[name])["median"],
                spares["failed"][name],
                was,
            ]
        )
    report.tables.append(table)
    steps = Table(
        "Promotion steps (ms, median; 'waited' includes a background replay in progress)",
        ["with", "waited", "wake", "replay (load)", "taint", "canary"],
    )
    for name, label in labels.items():
        row: list[Any] = [label]
        row.append(summary(r["event"]["waited_ms"] for r in runs[name])["median"])
        for step in ("wake", "load", "taint", "route"):
            row.append(
                summary(r["event"]["steps_ms"].get(step, float("nan")) for r in runs[name])[
                    "median"
                ]
            )
        steps.rows.append(row)
    report.tables.append(steps)
    push = Table(
        "Push of one step (the tiny model), seconds",
        ["stack", "pushes", "trainer waits (median)", "total, spare current too (median)"],
        digits=3,
    )
    plain_push = summary(pushes_plain)["median"]
    push.rows.append(["2 shards, no spare", len(pushes_plain), plain_push, plain_push])
    push.rows.append(
        [
            "2 shards + 1 spare",
            len(spares["push_s"]),
            summary(spares["push_s"])["median"],
            summary(spares["push_total_s"])["median"],
        ]
    )
    report.tables.append(push)
    report.target(
        "kill -> N admitted again with a current spare (median)", medians["current"], 0.05, "s"
    )
    report.target(
        "requests failed during the spare kills",
        sum(spares["failed"].values()),
        0,
        "requests",
    )
    steps_table(report, runs)
    failures_table(report, spares)
    report.notes.append(
        f"spare runs: {spares['requests']} trainer-like requests (4 clients, each requiring "
        "the current version's taint), "
        f"{spares['failed_total']} failed over the whole run"
        + (f" (first: {spares['errors'][:3]})" if spares["errors"] else "")
        + ". 'replay' is the load step of "
        "the promotion's own replay; a kill that lands after the background replay finished "
        "shows as not behind."
    )


def steps_table(report: Report, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Where the time from the kill goes, from daemon.log (same clock as the kill)."""
    table = Table(
        "kill -9 -> ... (s, median over the kills; the exit is reaped after the kernel has "
        "torn the worker down, which the promotion no longer waits for)",
        [
            "with",
            "seen dying",
            "promotion started",
            "promoted",
            "exit reaped",
            "taint ms",
            "canary ms",
            "canaries missed (all kills)",
        ],
        digits=3,
    )
    labels = {
        "current": "a current, awake spare",
        "behind": "a spare being replayed",
        "asleep": "a sleeping spare",
    }
    for name, label in labels.items():
        rows = runs[name]

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return summary(r["steps_s"][key] for r in rows if r["steps_s"][key] is not None)[
                "median"
            ]

        table.rows.append(
            [
                label,
                med("dying"),
                med("promoting"),
                summary(r["promote_s"] for r in rows)["median"],
                med("exit"),
                summary(r["event"]["steps_ms"].get("taint", float("nan")) for r in rows)["median"],
                summary(r["event"]["steps_ms"].get("route", float("nan")) for r in rows)["median"],
                int(sum(r["steps_s"]["canaries_missed"] or 0 for r in rows)),
            ]
        )
    report.tables.append(table)


def failures_table(report: Report, spares: dict[str, Any]) -> None:
    """Every failed request, grouped by phase, status and body, with when it came."""
    groups: dict[tuple[str, int, str], list[float]] = {}
    for e in spares["errors"]:
        groups.setdefault((e["phase"], e["status"], e["body"][:100]), []).append(e["after_kill_s"])
    table = Table(
        f"Failed requests ({spares['failed_total']} of {spares['requests']})",
        ["phase", "status", "count", "s after the last kill (first - last)", "body"],
        digits=3,
    )
    for (phase, status, body), after in sorted(groups.items()):
        table.rows.append([phase, status, len(after), f"{min(after):.3f} - {max(after):.3f}", body])
    if not groups:
        table.rows.append(["-", "-", 0, "-", "none failed"])
    report.tables.append(table)
    if spares.get("frontend_log"):
        report.notes.append(
            "the frontend's log while requests failed (models, workers, errors): "
            + " | ".join(spares["frontend_log"][:20])
        )


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    kills = 1 if args.quick else 8
    report = Report("spare_kills", "2b. Hot spares: kill -9 of a serving shard", args.quick)
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        prebuilt_model()
        with state_dir("spk-plain") as state:
            plain, pushes = no_spare_kills(state, serve_stack(state), 2)
        with state_dir("spk-spare") as state:
            spares = run_spares(state, serve_stack(state), kills)
    finally:
        sweep()
    spare_tables(report, spares, summary(plain), pushes, "no spare (same stack, spares=0)")
    load_end = [round(x, 2) for x in os.getloadavg()]
    busy = max(load_start + load_end) > 1
    report.notes.insert(
        0,
        f"load average (1, 5, 15 min) at start {load_start}, at end {load_end} on "
        f"{os.cpu_count()} cores" + (": PROVISIONAL, a busy machine" if busy else ": quiet"),
    )
    report.notes.append(
        "no spare: the same stack with --var spares=0, kill -> the victim admitted again "
        f"(held -> ready), {len(plain)} kills (one per shard: first failures)."
    )
    report.data = {
        "spares": spares,
        "no_spare_s": plain,
        "push_without_spares_s": pushes,
        "loadavg": [load_start, load_end],
    }
    emit(report, args.json)


if __name__ == "__main__":
    main()
