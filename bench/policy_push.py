"""Benchmark 7 - policy push: one update to 2, 4 and 8 shards (in parallel), and the replay
into one rejoining shard, against the size of the weights.

    python -m bench.policy_push [--quick] [--json]

Checkpoints: the tiny model's own model.safetensors, and copies grown to 10 MB and 100 MB
by an extra float32 tensor (the CPU worker loads and digests every tensor in the file, see
dynamod/workers/weights.py). They are written once to /tmp and read from the page cache.
For each shard count the serve-only local stack runs with `--var workers=N`; each push is
`dynamod policy push --step K --path DIR --json` (a new step each time). Reported: the CLI's
wall time, the daemon's own `seconds`, and the slowest shard's per-step ms (pause, load =
update_weights_from_disk incl. digest and KV reset, kv_reset = flush_cache, verify, taint,
resume). Replay: on the 2-shard stack, after a push of each size, worker@k is SIGKILLed and
its held -> ready admission (the same steps, from daemon.log) is timed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from bench.procs import (
    bench_mark,
    state_dir,
    sweep,
    wait_until,
)
from bench.recovery import admission_ms
from bench.report import (
    Report,
    Table,
    emit,
    options,
    summary,
)
from bench.runners import (
    Dynamod,
)
from bench.stack import (
    prebuilt_model,
    serve_stack,
)

CKPT_ROOT = Path("/tmp/dmbench-cache/checkpoints")
STEPS = ("pause", "load", "kv_reset", "verify", "taint", "resume")


def checkpoint(megabytes: int | None) -> tuple[Path, float]:
    """A checkpoint directory of about `megabytes` (None: the tiny model as is)."""
    import torch
    from safetensors.torch import load_file, save_file

    source = prebuilt_model() / "model.safetensors"
    name = "tiny" if megabytes is None else f"{megabytes}MB"
    path = CKPT_ROOT / name
    file = path / "model.safetensors"
    if not file.exists():
        path.mkdir(parents=True, exist_ok=True)
        tensors = load_file(str(source))
        if megabytes is not None:
            have = sum(t.numel() * t.element_size() for t in tensors.values())
            extra = max(0, megabytes * 1024 * 1024 - have) // 4
            generator = torch.Generator().manual_seed(megabytes)
            tensors["bench.padding"] = torch.randn(extra, generator=generator)
        tmp = path / ".model.safetensors.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, file)
    file.read_bytes()  # into the page cache
    return path, file.stat().st_size / 1024 / 1024


def push(dm: Dynamod, step: int, path: Path) -> dict[str, Any]:
    started = time.monotonic()
    out = dm.cli("policy", "push", "--step", str(step), "--path", str(path), "--json", timeout=600)
    wall = time.monotonic() - started
    result: dict[str, Any] = json.loads(out.stdout)
    acks = result["acks"]
    bad = {k: v for k, v in acks.items() if not v.get("ok")}
    if bad:
        raise RuntimeError(f"push of step {step} failed on {bad}")
    slowest = max(acks.values(), key=lambda a: a["total_ms"])
    return {
        "wall_s": wall,
        "daemon_s": result["seconds"],
        "slowest_ms": slowest["ms"],
        "slowest_total_ms": slowest["total_ms"],
        "shard_total_ms": {k: v["total_ms"] for k, v in acks.items()},
    }


def replay(dm: Dynamod, unit: str) -> dict[str, Any]:
    before = dm.unit(unit)
    t_kill = time.time()
    os.kill(before["pid"], signal.SIGKILL)

    def back() -> dict[str, Any] | None:
        u = dm.unit(unit)
        if u["state"] == "failed":
            raise RuntimeError(f"{unit} failed after the kill: {u['detail']}")
        return u if u["pid"] not in (None, before["pid"]) and u["state"] == "ready" else None

    wait_until(back, 120, 0.05, f"{unit} admitted again")
    events = [e for e in dm.transitions(unit) if e["t"] >= t_kill]
    held = next(e for e in events if e["new"] == "held")
    ready = next(e for e in events if e["new"] == "ready" and e["old"] == "held")
    steps = admission_ms(ready["detail"])
    return {
        "held_to_ready_s": ready["t"] - held["t"],
        "steps_ms": steps,
        "steps_total_ms": sum(steps.values()),
    }


def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    if args.quick:
        counts, sizes, reps, replays = [2], [None, 10], 2, 1
    else:
        counts, sizes, reps, replays = [2, 4, 8], [None, 10, 100], 5, 2
    report = Report("policy_push", "7. Policy push and replay against weight size", args.quick)
    ckpts = {size: checkpoint(size) for size in sizes}
    pushes: list[dict[str, Any]] = []
    replays_out: list[dict[str, Any]] = []
    try:
        for n in counts:
            with state_dir("pp") as state:
                prebuilt_model()
                dm = Dynamod(state)
                try:
                    dm.up(serve_stack(state), f"workers={n}", timeout=300)
                    step = 0
                    for size in sizes:
                        path, mb = ckpts[size]
                        for _ in range(reps):
                            step += 1
                            pushes.append({"shards": n, "mb": mb, **push(dm, step, path)})
                        if n == counts[0]:
                            for _ in range(replays):  # alternate: stay within the
                                unit = f"worker@{len(replays_out) % 2}"  # restart limit
                                replays_out.append({"mb": mb, "unit": unit, **replay(dm, unit)})
                finally:
                    dm.close()
    finally:
        sweep()
    table = Table(
        f"Push one update to every shard in parallel ({reps} pushes each), seconds",
        [
            "shards",
            "weights MB",
            "CLI wall median",
            "p95",
            "daemon median",
            "p95",
            *[f"slowest shard {s} ms" for s in STEPS],
        ],
        digits=3,
    )
    for n in counts:
        for size in sizes:
            mb = ckpts[size][1]
            rows = [p for p in pushes if p["shards"] == n and p["mb"] == mb]
            wall, daemon = summary(p["wall_s"] for p in rows), summary(p["daemon_s"] for p in rows)
            table.rows.append(
                [
                    n,
                    mb,
                    wall["median"],
                    wall["p95"],
                    daemon["median"],
                    daemon["p95"],
                    *[summary(p["slowest_ms"].get(s, 0) for p in rows)["median"] for s in STEPS],
                ]
            )
    report.tables.append(table)
    rt = Table(
        f"Replay into one rejoining shard ({counts[0]}-shard stack): held -> ready",
        ["weights MB", "replays", "held -> ready s (median)", *[f"{s} ms" for s in STEPS]],
        digits=3,
    )
    for size in sizes:
        mb = ckpts[size][1]
        rows = [r for r in replays_out if r["mb"] == mb]
        rt.rows.append(
            [
                mb,
                len(rows),
                summary(r["held_to_ready_s"] for r in rows)["median"],
                *[summary(r["steps_ms"].get(s, 0) for r in rows)["median"] for s in STEPS],
            ]
        )
    report.tables.append(rt)
    report.data = {
        "pushes": pushes,
        "replays": replays_out,
        "checkpoints": {str(k): {"path": str(v[0]), "mb": v[1]} for k, v in ckpts.items()},
    }
    report.notes += [
        "`load` is the worker's update_weights_from_disk: read every tensor, sha256 digest, "
        "and the KV reset it does itself after new weights; `kv_reset` is the separate "
        "flush_cache the rejoin protocol then asks for.",
        "the CLI wall time adds the `dynamod policy push` process (interpreter start, imports).",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
