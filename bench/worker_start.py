"""Benchmark 14 - CPU worker start: spawn -> /health ready, transformers' Llama vs our own.

    python -m bench.worker_start [--quick] [--json]

etcd, NATS and the tiny model of the serve-only local stack (`workers=1`) are started
once by a plain script; then one torch-engine worker at a time is spawned with worker@0's
command and environment and timed from the spawn to its first `GET /health` answering
200 `{"status": "ready"}` (polled every 20 ms), then stopped (SIGTERM to its group).
Rounds alternate the two workers, so both see the same machine load:

* `transformers` - the worker as it was (`bench.hf_worker`: the engine builds
  `transformers.LlamaForCausalLM`);
* `own Llama` - the stock worker (`python -m dynamod.workers.cpu`, `dynamod.workers.cpu.llama`).

A second table times, in fresh interpreters, what differs between them: building the
model from the model directory (imports included) after `import torch`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.procs import ROOT, bench_mark, kill_group, state_dir, sweep, wait_dead, wait_until
from bench.report import Report, Table, emit, options, ratio, summary
from bench.stack import PlainStack, load_local_stack, prebuilt_model, unit_env

VARIANTS = {"transformers": "bench.hf_worker", "own Llama": "dynamod.workers.cpu"}

BUILD_PROBE = """
import json, sys, time
from pathlib import Path
import torch
model_dir = Path(sys.argv[2])
t = time.monotonic()
if sys.argv[1] == "transformers":
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig.from_json_file(str(model_dir / "config.json")))
    model.load_state_dict(load_file(str(model_dir / "model.safetensors")), strict=True)
else:
    from dynamod.workers.cpu.llama import Llama
    from dynamod.workers.weights import load_checkpoint
    model = Llama.from_dir(model_dir, load_checkpoint(model_dir).tensors)
print(json.dumps({"build_s": time.monotonic() - t}))
"""


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200 and json.loads(resp.read()).get("status") == "ready")
    except (OSError, ValueError):
        return False


def start_once(stack: Any, module: str, log: Path) -> float:
    """Seconds from spawning a worker (running `module`) to its /health ready."""
    spec = stack.units["worker@0"]
    command = list(spec.command)
    at = command.index("-m")
    command[at + 1] = module
    env = unit_env(spec)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with log.open("ab") as out:
        started = time.monotonic()
        proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
    try:
        wait_until(
            lambda: ready(spec.ready.url) or proc.poll() is not None, 120, 0.02, f"{module} ready"
        )
        took = time.monotonic() - started
        if proc.poll() is not None:
            raise RuntimeError(f"{module} exited {proc.returncode} before ready; see {log}")
        return took
    finally:
        kill_group(proc.pid, signal.SIGTERM)
        if wait_dead([proc.pid], 15):
            kill_group(proc.pid)
        proc.wait(10)


def build_once(variant: str, model_dir: Path) -> float:
    done = subprocess.run(
        [sys.executable, "-c", BUILD_PROBE, variant, str(model_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=120,
    )
    return float(json.loads(done.stdout.strip().splitlines()[-1])["build_s"])


def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    report = Report("worker_start", "14. CPU worker start: transformers vs own Llama", args.quick)
    rounds = 1 if args.quick else 5
    starts: dict[str, list[float]] = {v: [] for v in VARIANTS}
    builds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    model_dir = prebuilt_model()
    try:
        with state_dir("wst") as state:
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
                    for variant, module in VARIANTS.items():
                        starts[variant].append(start_once(stack, module, state / "worker.log"))
            finally:
                plain.close()
        for _ in range(rounds):
            for variant in VARIANTS:
                builds[variant].append(build_once(variant, model_dir))
    finally:
        sweep()
    old, new = (summary(starts[v]) for v in VARIANTS)
    table = Table(
        f"Torch worker spawn -> /health ready, s ({rounds} rounds, alternating)",
        ["worker", "median", "p95", "min", "max"],
        digits=2,
    )
    for variant, s in zip(VARIANTS, (old, new), strict=True):
        table.rows.append([variant, s["median"], s["p95"], s["min"], s["max"]])
    table.rows.append(
        ["own / transformers", *(ratio(new[k], old[k]) for k in ("median", "p95", "min", "max"))]
    )
    report.tables.append(table)
    b_old, b_new = (summary(builds[v]) for v in VARIANTS)
    build_table = Table(
        "Model build from the model directory after `import torch`, fresh interpreter, s",
        ["model", "median", "min", "max"],
        digits=2,
    )
    for variant, s in zip(VARIANTS, (b_old, b_new), strict=True):
        build_table.rows.append([variant, s["median"], s["min"], s["max"]])
    build_table.rows.append(["own / transformers", ratio(b_new["median"], b_old["median"]), "", ""])
    report.tables.append(build_table)
    report.target(
        "worker start, own Llama / transformers (median)",
        ratio(new["median"], old["median"]),
        0.5,
        "x",
    )
    report.notes.append(
        "The worker's other start costs (import torch, Dynamo's runtime and registration "
        "in etcd) are the same on both sides; the build table isolates the part that differs."
    )
    report.data = {"starts_s": starts, "builds_s": builds}
    emit(report, args.json)


def ready_any(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


if __name__ == "__main__":
    main()
