"""Benchmark 2 - worker recovery: `kill -9` of a shard until it is admitted again at the
current policy (and so serving), broken into its stages.

    python -m bench.recovery [--quick] [--json]

The serve-only local stack (2 CPU workers) runs under dynamod with a pushed policy
(step 1, a real checkpoint), so a rejoin replays real weights. Each kill is a first
failure (the worker has been up longer than its restart.reset_after, so the backoff is
the initial one), alternating between the two workers. From daemon.log (microsecond
timestamps, the same clock as the kill):

  detect    kill -> unit.state ready->backoff (the Dynamo lease revoke runs before it)
  restart   backoff -> starting (the backoff delay, then spawn)
  boot      starting -> the worker's /health answers ready (seen by a 10 ms poller)
  probe + ids  -> held: the readiness probe's 0.1 s interval, instance ids from etcd
  replay    pause + update_weights_from_disk            (admission detail, per-step ms)
  kv reset  flush_cache
  admit     get_weight_version (verify) + taint + resume
  other     held -> ready minus those steps (ledger read, ack written to etcd)

Against: the worker's cold start (the same command started alone against the same etcd
and NATS, spawn -> /health ready polled every 10 ms; in its own namespace, and again in the
stack's namespace, where the frontend takes in the new instance as it does for a restarted
shard), and restarting the whole stack (`dynamod down` then `dynamod up`, same state dir).
The target is judged against the cold start in its own namespace.

Side by side, in the same run: the same kill with one hot spare (bench.spare_kills): a
current spare, a spare being replayed (the kill lands as a push returns), a sleeping
spare, requests failed under trainer-like load during each, and the time a push takes
with the spare kept current (for the trainer and in total) against pushes with no spare.
--quick leaves that half out: bench.spare_kills --quick runs the same scenarios in CI.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.procs import (
    bench_mark,
    kill_group,
    state_dir,
    sweep,
    wait_until,
)
from bench.report import (
    Report,
    Table,
    emit,
    entry,
    options,
    ratio,
    summary,
)
from bench.runners import (
    Dynamod,
)
from bench.spare_kills import push_without_spares, run_spares, spare_tables
from bench.stack import (
    MODEL,
    NAMESPACE,
    load_local_stack,
    prebuilt_model,
    serve_stack,
    unit_env,
)

STEP_MS = re.compile(r"(\w+) (\d+(?:\.\d+)?)")
STAGES = ["detect", "restart", "boot", "probe + ids", "replay", "kv reset", "admit", "other"]


class HealthWatch(threading.Thread):
    """After a kill: when the worker's /health (same port after a restart) goes down, and
    when it first answers ready again (10 ms polls)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.down_at: float | None = None
        self.ready_at: float | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ok = worker_health(self.port, timeout=0.2)
            if self.down_at is None and not ok:
                self.down_at = time.time()
            elif self.down_at is not None and ok:
                self.ready_at = time.time()
                return
            time.sleep(0.01)


def admission_ms(detail: str) -> dict[str, float]:
    """'at policy version 1 (last update 47 ms: pause 1, load 1, ...)' -> {'pause': 1, ...}"""
    inner = detail.split(":", 1)[1] if "ms:" in detail else ""
    return {k: float(v) for k, v in STEP_MS.findall(inner)}


def make_checkpoint(root: Path) -> Path:
    path = root / "ckpt" / "step-1"
    path.mkdir(parents=True)
    shutil.copy(prebuilt_model() / "model.safetensors", path / "model.safetensors")
    return path


def stages_of(
    events: list[dict[str, Any]], unit: str, t_kill: float, health_at: float | None
) -> dict[str, Any]:
    after = [e for e in events if e.get("unit") == unit and e["t"] >= t_kill - 0.001]

    def first(pred: Any) -> dict[str, Any]:
        return next(e for e in after if pred(e))

    backoff = first(lambda e: e.get("new") == "backoff")
    starting = first(lambda e: e.get("new") == "starting" and e["t"] >= backoff["t"])
    held = first(lambda e: e.get("new") == "held" and e["t"] >= starting["t"])
    ready = first(
        lambda e: e.get("new") == "ready" and e.get("old") == "held" and e["t"] >= held["t"]
    )
    revoked = next(
        (e for e in after if e.get("event") == "dynamo.revoked" and e["t"] <= backoff["t"]), None
    )
    steps = admission_ms(ready.get("detail", ""))
    admit_s = ready["t"] - held["t"]
    replay = (steps.get("pause", 0) + steps.get("load", 0)) / 1000
    kv = steps.get("kv_reset", 0) / 1000
    admit = (steps.get("verify", 0) + steps.get("taint", 0) + steps.get("resume", 0)) / 1000
    return {
        "unit": unit,
        "total": ready["t"] - t_kill,
        "detect": backoff["t"] - t_kill,
        "restart": starting["t"] - backoff["t"],
        "boot": (health_at if health_at else held["t"]) - starting["t"],
        "probe + ids": held["t"] - health_at if health_at else float("nan"),
        "replay": replay,
        "kv reset": kv,
        "admit": admit,
        "other": admit_s - replay - kv - admit,
        "held_to_ready": admit_s,
        "revoke_ms": revoked.get("ms") if revoked else None,
        "steps_ms": steps,
        "detail": ready.get("detail"),
    }


def free_port() -> int:
    """A free loopback port <= 32767 (Dynamo reads DYN_SYSTEM_PORT as a signed 16-bit int)."""
    for _ in range(200):
        port = random.randint(20000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def worker_health(port: int, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as resp:
            return bool(resp.status == 200 and json.loads(resp.read()).get("status") == "ready")
    except (OSError, ValueError):
        return False


def cold_start(
    state: Path, etcd: int, nats: int, reps: int, namespace: str = "bench-cold"
) -> tuple[list[float], list[float]]:
    """The worker command alone, against the running stack's etcd/NATS.

    In its own namespace (default), returns spawn -> /health ready and SIGKILL -> exit seen
    on a pidfd (the kernel's share of any supervisor's detection for this process). In the
    stack's namespace the frontend also takes in the new instance (model card, tokenizer)
    on the same cores, as it does for a restarted shard; that worker is stopped with
    SIGTERM, so its registration goes with it, and gives no exit sample."""
    spec = load_local_stack(state).units["worker@0"]
    own = namespace == "bench-cold"
    out, exits = [], []
    for _ in range(reps):
        port = free_port()
        env = unit_env(spec)
        env.update(
            ETCD_ENDPOINTS=f"http://127.0.0.1:{etcd}",
            NATS_SERVER=f"nats://127.0.0.1:{nats}",
            DYN_NAMESPACE=namespace,
            DYN_SYSTEM_PORT=str(port),
        )
        started = time.monotonic()
        with (state / "cold-worker.log").open("ab") as log:
            proc = subprocess.Popen(
                list(spec.command),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_until(
                lambda port=port: worker_health(port),
                90,
                0.01,
                f"cold worker /health (log: {state / 'cold-worker.log'})",
            )
            out.append(time.monotonic() - started)
            time.sleep(0.5)
            if not own:
                kill_group(proc.pid, signal.SIGTERM)
                proc.wait(30)
                continue
            fd = os.pidfd_open(proc.pid)
            try:
                killed = time.monotonic()
                os.kill(proc.pid, signal.SIGKILL)
                select.select([fd], [], [], 10)
                exits.append(time.monotonic() - killed)
            finally:
                os.close(fd)
        finally:
            kill_group(proc.pid)
            proc.wait(10)
        time.sleep(0.5)
    return out, exits


def stack_ports(dm: Dynamod) -> tuple[int, int]:
    units = {u["name"]: u for u in dm.status()["units"]}
    return units["etcd"]["ports"]["client"], units["nats"]["ports"]["client"]


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    kills, cold_reps, full_reps = (1, 1, 1) if args.quick else (8, 8, 3)
    report = Report("recovery", "2. Worker recovery after kill -9 (2 shards)", args.quick)
    records: list[dict[str, Any]] = []
    cold: list[float] = []
    cold_ns: list[float] = []
    kernel_exit: list[float] = []
    whole: list[float] = []
    pushes_plain: list[float] = []
    spares: dict[str, Any] = {}
    try:
        with state_dir("rec") as state:
            prebuilt_model()
            dm = Dynamod(state)
            try:
                stack_file = serve_stack(state)
                dm.up(stack_file, timeout=180)
                ckpt = make_checkpoint(state)
                dm.cli("policy", "push", "--step", "1", "--path", str(ckpt), timeout=120)
                spawned: dict[str, float] = {}
                plan: list[tuple[str, float, HealthWatch]] = []
                reset_after = 30.0
                for k in range(kills):
                    name = f"worker@{k % 2}"

                    def admitted(name: str = name) -> dict[str, Any] | None:
                        u = dm.unit(name)
                        ok = u["state"] == "ready" and u.get("policy_version") == 1
                        return u if ok else None

                    unit = wait_until(admitted, 120, 0.05, f"{name} admitted")
                    if name in spawned:  # a first failure: up longer than reset_after
                        wait = spawned[name] + reset_after + 1 - time.monotonic()
                        time.sleep(max(0.0, wait))
                    time.sleep(random.uniform(0.2, 0.6))
                    watch = HealthWatch(unit["ports"]["system"])
                    t_kill = time.time()
                    os.kill(unit["pid"], signal.SIGKILL)
                    watch.start()
                    plan.append((name, t_kill, watch))
                    wait_until(
                        lambda name=name, old=unit["pid"]: (
                            (u := dm.unit(name))["pid"] not in (None, old) and u
                        ),
                        60,
                        0.02,
                        f"{name} respawned",
                    )
                    spawned[name] = time.monotonic()
                    wait_until(admitted, 120, 0.05, f"{name} admitted")
                    # Cold starts interleaved with the kills: same conditions, and they use
                    # the wait for the next kill's reset_after anyway.
                    if k < cold_reps:
                        got, exits = cold_start(state, *stack_ports(dm), 1)
                        cold += got
                        kernel_exit += exits
                        cold_ns += cold_start(state, *stack_ports(dm), 1, NAMESPACE)[0]
                events = dm.events()
                for _, _, watch in plan:
                    watch.join(10)
                records = [stages_of(events, name, t, watch.ready_at) for name, t, watch in plan]
                pushes_plain = push_without_spares(dm, state, kills, first_step=2)
                for _ in range(full_reps):
                    started = time.monotonic()
                    dm.down()
                    dm.up(stack_file, timeout=180)
                    whole.append(time.monotonic() - started)
            finally:
                dm.close()
        if not args.quick:  # quick: bench.spare_kills --quick runs the same half in CI
            with state_dir("rec-spare") as state:
                spares = run_spares(state, serve_stack(state), 8)
    finally:
        sweep()
    total = summary(r["total"] for r in records)
    cold_s, cold_ns_s, whole_s = summary(cold), summary(cold_ns), summary(whole)
    stages = Table(
        f"kill -9 -> admitted at the current policy, {len(records)} kills, seconds",
        ["stage", "median", "p95", "share of median total"],
        digits=3,
    )
    for stage in STAGES:
        x = summary(r[stage] for r in records)
        stages.rows.append([stage, x["median"], x["p95"], ratio(x["median"], total["median"])])
    stages.rows.append(["total (kill -> admitted)", total["median"], total["p95"], 1.0])
    report.tables.append(stages)
    own = total["median"] - cold_s["median"]
    direct = summary(r["total"] - r["boot"] for r in records)
    compare = Table(
        "Recovery against the alternatives, seconds",
        ["what", "runs", "median", "p95", "recovery / this"],
        digits=3,
    )
    compare.rows += [
        ["dynamod recovery (kill -> admitted)", total["n"], total["median"], total["p95"], 1.0],
        [
            "worker cold start alone (spawn -> /health ready)",
            cold_s["n"],
            cold_s["median"],
            cold_s["p95"],
            ratio(total["median"], cold_s["median"]),
        ],
        [
            "  the same, registering in the stack's namespace",
            cold_ns_s["n"],
            cold_ns_s["median"],
            cold_ns_s["p95"],
            ratio(total["median"], cold_ns_s["median"]),
        ],
        [
            "whole stack restart (`down` + `up`)",
            whole_s["n"],
            whole_s["median"],
            whole_s["p95"],
            ratio(total["median"], whole_s["median"]),
        ],
        ["dynamod's own share (recovery - cold start alone)", "-", own, "-", "-"],
        [
            "  the same against the cold start in the stack's namespace",
            "-",
            total["median"] - cold_ns_s["median"],
            "-",
            "-",
        ],
        [
            "  direct: each recovery minus its own boot stage (all stages but boot)",
            direct["n"],
            direct["median"],
            direct["p95"],
            "-",
        ],
    ]
    report.tables.append(compare)
    steps = Table("Admission steps (ms, median)", ["step", "median ms", "p95 ms"], digits=1)
    for step in ("pause", "load", "kv_reset", "verify", "taint", "resume"):
        x = summary(r["steps_ms"].get(step, float("nan")) for r in records)
        steps.rows.append([step, x["median"], x["p95"]])
    x = summary(r["revoke_ms"] for r in records if r["revoke_ms"] is not None)
    steps.rows.append(["(lease revoke, before backoff)", x["median"], x["p95"]])
    x = summary(v * 1000 for v in kernel_exit)
    steps.rows.append(
        ["(kernel: SIGKILL -> worker exit on a pidfd, no supervisor)", x["median"], x["p95"]]
    )
    report.tables.append(steps)
    report.target(
        "dynamod's own share of a recovery (median recovery - median cold start)", own, 0.3, "s"
    )
    if spares:
        spare_tables(report, spares, total, pushes_plain)
    else:
        report.notes.append(
            "quick profile: the hot-spare half is not run here; `python -m bench.spare_kills "
            "--quick` runs the same scenarios (run_spares) on its own stack."
        )
    report.data = {
        "kills": records,
        "cold_start_s": cold,
        "cold_start_in_namespace_s": cold_ns,
        "whole_restart_s": whole,
        "kernel_exit_s": kernel_exit,
        "model": MODEL,
        "spares": spares,
        "push_without_spares_s": pushes_plain,
    }
    report.notes += [
        "the pushed policy is a copy of the tiny model's weights (0.5 MB); see "
        "bench.policy_push for replay time against checkpoint size.",
        "`boot` is the worker's own start inside the recovery (spawn -> its /health answers "
        "ready, seen by a 10 ms poller); the cold start alone is the same process without "
        "dynamod. Both vary by +/-0.3 s run to run on this shared 2-core machine, so the "
        "difference of medians is noisy; the direct row attributes every other stage.",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
