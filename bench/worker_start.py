"""Benchmark 14 - CPU worker start: spawn -> /health ready, the torch worker vs the numpy one.

    python -m bench.worker_start [--quick] [--json] [--before REV]

etcd, NATS and the tiny model of the serve-only local stack (`workers=1`) are started
once by a plain script; then one worker at a time is spawned with worker@0's command and
environment and timed from the spawn to its first `GET /health` answering 200
`{"status": "ready"}` (polled every 20 ms), then stopped (SIGTERM to its group). At that
moment the worker's CPU time so far (user + system, all its threads, from /proc) is read
too: the CPU-seconds one start costs. Rounds alternate the two workers, so both see the
same machine load:

* `torch` - the worker as it was: `dynamod/` exported (`git archive`) at REV (default
  TORCH_WORKER_REV, the last commit whose worker ran the torch engine), run from there;
* `numpy` - the stock worker of this tree (`python -m dynamod.workers.cpu`).

A second table times, in fresh interpreters, what differs between them: loading the
checkpoint and building the model (imports of torch or numpy included).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.procs import ROOT, bench_mark, kill_group, state_dir, sweep, wait_dead, wait_until
from bench.report import Report, Table, emit, entry, options, ratio, summary
from bench.stack import PlainStack, load_local_stack, prebuilt_model, unit_env

TORCH_WORKER_REV = "1306a0b"  # main before the numpy engine: the worker imported torch
VARIANTS = ("torch", "numpy")

BUILD_PROBE = """
import json, resource, sys, time
from pathlib import Path
t = time.monotonic()
model_dir = Path(sys.argv[2])
from dynamod.workers.weights import load_checkpoint
if sys.argv[1] == "torch":
    import torch
    from dynamod.workers.cpu.llama import Llama
    model = Llama.from_dir(model_dir, load_checkpoint(model_dir).tensors)
else:
    from dynamod.workers.cpu.numpy_llama import NumpyLlama
    model = NumpyLlama.from_dir(model_dir, load_checkpoint(model_dir, "numpy").tensors)
took = time.monotonic() - t
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"build_s": took, "process_cpu_s": usage.ru_utime + usage.ru_stime}))
"""


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200 and json.loads(resp.read()).get("status") == "ready")
    except (OSError, ValueError):
        return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far, all its threads (and reaped children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def export_tree(rev: str, into: Path) -> Path:
    """`dynamod/` at git revision `rev`, unpacked under `into` (a PYTHONPATH root)."""
    archive = into / "tree.tar"
    done = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "-o", str(archive), rev, "dynamod"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"bench.worker_start: cannot export {rev}: {done.stderr.strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def start_once(stack: Any, variant: str, pythonpath: Path, log: Path) -> tuple[float, float]:
    """(seconds, CPU-seconds) from spawning a worker from `pythonpath` to its /health ready,
    its `--engine` set to `variant` (the stock unit names this tree's engine)."""
    spec = stack.units["worker@0"]
    command = list(spec.command)
    command[command.index("--engine") + 1] = variant
    env = unit_env(spec)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    with log.open("ab") as out:
        started = time.monotonic()
        proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=pythonpath,
        )
    try:
        wait_until(
            lambda: ready(spec.ready.url) or proc.poll() is not None, 120, 0.02, "worker ready"
        )
        took = time.monotonic() - started
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(
                f"worker from {pythonpath} exited {proc.returncode}: " + "\n".join(tail)
            )
        return took, cpu_seconds(proc.pid)
    finally:
        kill_group(proc.pid, signal.SIGTERM)
        if wait_dead([proc.pid], 15):
            kill_group(proc.pid)
        proc.wait(10)


def build_once(variant: str, model_dir: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", BUILD_PROBE, variant, str(model_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=120,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0])
    parser.add_argument(
        "--before", default=TORCH_WORKER_REV, help="git revision of the torch worker"
    )
    args: argparse.Namespace = parser.parse_args()
    bench_mark()
    load_at_start = os.getloadavg()
    report = Report(
        "worker_start", "14. CPU worker start: torch worker vs numpy worker", args.quick
    )
    rounds = 1 if args.quick else 5
    starts: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpus: dict[str, list[float]] = {v: [] for v in VARIANTS}
    builds: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    model_dir = prebuilt_model()
    try:
        with state_dir("wst") as state:
            roots = {"torch": export_tree(args.before, state), "numpy": ROOT}
            stack = load_local_stack(state, "workers=1")
            plain = PlainStack(stack)
            try:
                for name in ("etcd", "nats", "model"):
                    proc = plain.spawn(name)
                    if stack.units[name].type == "oneshot":
                        proc.wait(120)
                    else:
                        url = stack.units[name].ready.url
                        wait_until(lambda url=url: ready_any(url), 60, 0.05, name)
                for _ in range(rounds):
                    for variant in VARIANTS:
                        took, cpu = start_once(stack, variant, roots[variant], state / "worker.log")
                        starts[variant].append(took)
                        cpus[variant].append(cpu)
            finally:
                plain.close()
        for _ in range(rounds):
            for variant in VARIANTS:
                builds[variant].append(build_once(variant, model_dir))
    finally:
        sweep()
    old, new = (summary(starts[v]) for v in VARIANTS)
    old_cpu, new_cpu = (summary(cpus[v]) for v in VARIANTS)
    table = Table(
        f"Worker spawn -> /health ready ({rounds} rounds, alternating; torch = {args.before})",
        ["worker", "median s", "p95 s", "min s", "max s", "CPU-s median", "CPU-s min"],
        digits=2,
    )
    for variant, s, c in zip(VARIANTS, (old, new), (old_cpu, new_cpu), strict=True):
        table.rows.append(
            [variant, s["median"], s["p95"], s["min"], s["max"], c["median"], c["min"]]
        )
    table.rows.append(
        [
            "numpy / torch",
            *(ratio(new[k], old[k]) for k in ("median", "p95", "min", "max")),
            ratio(new_cpu["median"], old_cpu["median"]),
            ratio(new_cpu["min"], old_cpu["min"]),
        ]
    )
    report.tables.append(table)
    build_table = Table(
        "Checkpoint load + model build, imports included, fresh interpreter",
        ["model", "median s", "min s", "max s", "process CPU-s median"],
        digits=3,
    )
    build_s = {v: summary(b["build_s"] for b in builds[v]) for v in VARIANTS}
    build_cpu = {v: summary(b["process_cpu_s"] for b in builds[v]) for v in VARIANTS}
    for variant in VARIANTS:
        b = build_s[variant]
        build_table.rows.append(
            [variant, b["median"], b["min"], b["max"], build_cpu[variant]["median"]]
        )
    build_table.rows.append(
        [
            "numpy / torch",
            ratio(build_s["numpy"]["median"], build_s["torch"]["median"]),
            "",
            "",
            ratio(build_cpu["numpy"]["median"], build_cpu["torch"]["median"]),
        ]
    )
    report.tables.append(build_table)
    report.notes.append(
        f"load average (1, 5, 15 min) at the start: {', '.join(f'{x:.2f}' for x in load_at_start)}"
        f", at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        "over 1 on this machine's cores the figures are provisional. Dynamo's runtime and "
        "the registration in etcd are the same on both sides."
    )
    report.data = {"starts_s": starts, "cpu_s": cpus, "builds": builds, "before": args.before}
    emit(report, args.json)


def ready_any(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


if __name__ == "__main__":
    main()
