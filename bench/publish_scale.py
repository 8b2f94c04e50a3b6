"""Benchmark 18 - the colocated update against the shard count on one node: the trainer's
IPC send and dynamod's `policy publish`, beside a `policy push` of the same weights.

    python -m bench.publish_scale [--quick] [--json] [--shards 1,8,32] [--updates 10]

verl's colocated path (`weight_sync: ipc`) is what its users run on GPUs: the trainer
sends its tensors to every shard itself and dynamod only records, verifies, taints and
resumes them (`policy publish`). The fleet benchmark (16) measures the push, since its
light shards have no weight receiver. Here, for each shard count, the serve-only local
stack runs that many CPU workers (the numpy engine and the tiny model) hosting dynamod's
worker extension (`--worker-extension-cls`, a weight receiver in each shard), started at
most 4 at a time; the bench process is the trainer: `ColocatedSync.update` as verl's rank
0 runs it (pause, IPC send of the tiny model's tensors scaled anew each step, flush, set
the version, background checkpoint, `policy publish` with each shard's digest). One
untimed update warms the sockets; then `--updates` timed ones, and as many `policy push`es
of the last update's checkpoint (a new step each) through the daemon's socket.

Reported per shard count: the trainer's stall (the update call's wall time) and its parts
(the send into every receiver; the publish as the daemon timed it; the rest: the pause,
flush and version calls to each shard and the publish's round trip), the slowest shard's
publish steps, the push's daemon seconds, each against the one-shard stack's, one shard's
PSS with the extension (torch in every shard), and where the machine's CPU went in the
timed updates: the trainer (this process), the shards, dynamod's daemon, the frontend,
etcd and NATS. Target: the stall at the largest count within 2x one shard's (the issue's
target for a push to every shard).
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from typing import Any

import structlog

from bench import host
from bench.fleet_stack import with_max_starting
from bench.procs import bench_mark, cpu_of, cpu_since, pss_mb, state_dir, sweep
from bench.report import Report, Table, emit, entry, options, ratio, rising_counts
from bench.runners import Dynamod
from bench.stack import prebuilt_model, serve_stack

EXTENSION = "dynamod.integrations.verl.worker_extension.DynamodWorkerExtension"
MAX_STARTING = 4  # torch in every shard: ~2 s of CPU each to start on this machine's 2 cores
PUBLISH_STEPS = ("verify", "taint", "resume", "route")
PARTS = ("trainer", "shards", "daemon", "frontend", "etcd, NATS")


def stack_pids(dm: Dynamod) -> dict[str, list[int]]:
    """The processes whose CPU an update is put to: this process (the trainer), the
    shards, dynamod's daemon, the frontend, etcd and NATS."""
    units = [u for u in dm.status()["units"] if u.get("pid")]
    daemon = dm.daemon_pid()

    def named(*prefixes: str) -> list[int]:
        return [u["pid"] for u in units if u["name"].split("@")[0] in prefixes]

    return {"trainer": [os.getpid()], "shards": named("worker"),
            "daemon": [daemon] if daemon else [], "frontend": named("frontend"),
            "etcd, NATS": named("etcd", "nats")}  # fmt: skip


def shard_counts(text: str) -> list[int]:
    """`--shards` ("1,8,32"): rising counts from 1 (the reference every ratio is to)."""
    return rising_counts(text, "--shards", "1,8,32")


def tiny_weights() -> dict[str, Any]:
    from safetensors.torch import load_file

    return dict(load_file(str(prebuilt_model() / "model.safetensors")))


def update(sync: Any, boot: dict[str, Any], step: int) -> dict[str, Any]:
    """One colocated update of `step` (the boot weights scaled by the step), its record;
    refused unless every shard took it."""
    scale = 1.0 + step / 100
    started = time.monotonic()
    record: dict[str, Any] = asyncio.run(
        sync.update(((k, v * scale) for k, v in boot.items()), step)
    )
    wall = time.monotonic() - started
    published = record["publish"]
    if record["errors"] or record["stale"] or not published.get("ok"):
        raise RuntimeError(
            f"update {step} did not reach every shard: errors {record['errors']}, "
            f"stale {record['stale']}"
        )
    acks = published["acks"]
    slowest = max(acks.values(), key=lambda a: a["total_ms"])
    return {
        "step": step,
        "stall_s": wall,
        "send_s": record["send_s"],
        "host_copy_s": record["host_copy_s"],
        "write_stall_s": record["write_stall_s"],
        "publish_s": published["seconds"],
        "rest_s": wall - record["send_s"] - record["write_stall_s"] - published["seconds"],
        "acked": len(acks),
        "slowest_ms": slowest["ms"],
        "slowest_total_ms": slowest["total_ms"],
        "checkpoint": record["checkpoint"],
    }


def timed_updates(sync: Any, boot: dict[str, Any], steps: range,
                  parts: dict[str, list[int]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The updates of `steps` back to back, and the CPU they used, an update's mean: the
    machine's (busy ms, and its cores' busy %) and each of `parts`' (ms). Taken over all
    of them, not per update: the kernel counts CPU time in 10 ms ticks."""
    owner = {pid: part for part, pids in parts.items() for pid in pids}
    cpu_before, host_before, started = cpu_of(list(owner)), host.counters(), time.monotonic()
    timed = [update(sync, boot, step) for step in steps]
    wall, busy_s = time.monotonic() - started, host.window(host_before)["busy_s"]
    used = dict.fromkeys(parts, 0.0)
    for pid, seconds in cpu_since(cpu_before).items():
        used[owner[pid]] += seconds * 1000 / len(timed)
    return timed, {"busy_ms": busy_s * 1000 / len(timed),
                   "busy_pct": 100 * busy_s / (wall * (os.cpu_count() or 1)),
                   "parts_ms": used}  # fmt: skip


def push(dm: Dynamod, step: int, path: str) -> dict[str, Any]:
    started = time.monotonic()
    answer = dm.client.policy_push(step, path, timeout=600)
    wall = time.monotonic() - started
    bad = {k: v.get("error") for k, v in answer["acks"].items() if not v.get("ok")}
    if bad or answer.get("stale"):
        raise RuntimeError(f"push of step {step} failed on {bad or answer['stale']}")
    slowest = max(answer["acks"].values(), key=lambda a: a["total_ms"])
    return {"step": step, "wall_s": wall, "daemon_s": answer["seconds"],
            "acked": len(answer["acks"]), "slowest_total_ms": slowest["total_ms"]}


def one_stack(n: int, updates: int, boot: dict[str, Any]) -> dict[str, Any]:
    """An `n`-shard stack: one warm-up update, `updates` timed ones, as many pushes."""
    from dynamod.integrations.verl.colocated import ColocatedSync

    with state_dir("ps") as state:
        dm = Dynamod(state)
        sync = None
        try:
            stack = serve_stack(state)
            stack.write_text(with_max_starting(stack.read_text(), MAX_STARTING))
            up_s = dm.up(stack, f"workers={n}", f"worker_extension_cls={EXTENSION}",
                         f"weight_ipc_dir={state}/weight-ipc", timeout=600)
            shards = [u for u in dm.status()["units"] if u["name"].startswith("worker@")]
            pss = [pss_mb(u["pid"]) for u in shards if u.get("pid")]
            sync = ColocatedSync(state, state / "verl" / "checkpoints", state / "weight-ipc",
                                 timeout_s=300)
            update(sync, boot, 1)  # the warm-up: the bench's first connections
            timed, cpu = timed_updates(sync, boot, range(2, updates + 2), stack_pids(dm))
            sync.writer.wait()  # the last checkpoint is on disk before a push loads it
            last = timed[-1]["checkpoint"]
            pushes = [push(dm, step, last)
                      for step in range(updates + 2, 2 * updates + 2)]  # fmt: skip
        finally:
            if sync is not None:
                sync.close()
            dm.close()
    if any(u["acked"] != n for u in timed) or any(p["acked"] != n for p in pushes):
        raise RuntimeError(f"{n} shards: an update or a push acknowledged by fewer")
    return {"shards": n, "up_s": up_s, "shard_pss_mb": pss, "updates": timed, "cpu": cpu,
            "pushes": pushes}


def median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def stall_table(stacks: list[dict[str, Any]]) -> Table:
    table = Table(
        "The colocated update: the trainer's stall and its parts, s (median over the "
        "timed updates)",
        ["shards", "updates", "stall", "slowest", "x 1 shard", "send", "pause, flush, "
         "version, round trip", "publish (daemon)", "cores busy %", "push (daemon)",
         "push x 1 shard", "shard PSS MB"],
        digits=3,
    )
    ref = stacks[0]
    for s in stacks:
        ups, pushes = s["updates"], s["pushes"]
        table.rows.append([
            s["shards"], len(ups), median(ups, "stall_s"), max(u["stall_s"] for u in ups),
            ratio(median(ups, "stall_s"), median(ref["updates"], "stall_s")),
            median(ups, "send_s"), median(ups, "rest_s"), median(ups, "publish_s"),
            s["cpu"]["busy_pct"], median(pushes, "daemon_s"),
            ratio(median(pushes, "daemon_s"), median(ref["pushes"], "daemon_s")),
            statistics.median(s["shard_pss_mb"]) if s["shard_pss_mb"] else float("nan"),
        ])
    return table


def publish_steps_table(stacks: list[dict[str, Any]]) -> Table:
    table = Table(
        "The publish's slowest shard, ms (median over the timed updates)",
        ["shards", *PUBLISH_STEPS, "total"],
        digits=1,
    )
    for s in stacks:
        ups = s["updates"]
        steps = [statistics.median(u["slowest_ms"].get(k, 0.0) for u in ups)
                 for k in PUBLISH_STEPS]  # fmt: skip
        table.rows.append([s["shards"], *steps, median(ups, "slowest_total_ms")])
    return table


def cpu_table(stacks: list[dict[str, Any]]) -> Table:
    table = Table(
        "Where the machine's CPU went in one update, ms (the timed updates' mean)",
        ["shards", "machine busy", *PARTS, "a shard", "the daemon a shard", "rest"],
        digits=1,
    )
    for s in stacks:
        n, used, busy = s["shards"], s["cpu"]["parts_ms"], s["cpu"]["busy_ms"]
        table.rows.append([n, busy, *(used[p] for p in PARTS), used["shards"] / n,
                           used["daemon"] / n,
                           round(busy - sum(used.values()), 1)])  # fmt: skip
    return table


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0])
    parser.add_argument("--shards", default=None,
                        help="shard counts, rising from 1 (default 1,8,32; quick 1,2)")
    parser.add_argument("--updates", type=int, default=None,
                        help="timed updates (and pushes) per count (default 10; quick 2)")
    args = parser.parse_args()
    try:
        counts = shard_counts(args.shards or ("1,2" if args.quick else "1,8,32"))
    except ValueError as exc:
        parser.error(str(exc))
    if args.updates is not None and args.updates < 1:
        parser.error(f"--updates {args.updates}: at least 1")
    updates = args.updates or (2 if args.quick else 10)
    bench_mark()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    report = Report("publish_scale", "18. The colocated update against the shard count",
                    args.quick)
    boot = tiny_weights()
    stacks: list[dict[str, Any]] = []
    try:
        for n in counts:
            stacks.append(one_stack(n, updates, boot))
    finally:
        sweep()
    report.tables += [stall_table(stacks), publish_steps_table(stacks), cpu_table(stacks)]
    largest, ref = stacks[-1], stacks[0]
    report.target(
        f"the trainer's stall at {largest['shards']} shards against 1 shard's",
        ratio(median(largest["updates"], "stall_s"), median(ref["updates"], "stall_s")),
        2.0, "x",
    )
    report.data = {"stacks": stacks,
                   "weights_mb": round(sum(t.numel() * t.element_size()
                                           for t in boot.values()) / 1e6, 2)}  # fmt: skip
    report.notes += [
        "stall = `ColocatedSync.update`'s wall time on the trainer (verl's rank 0): pause "
        "-> IPC send -> flush -> version -> checkpoint submitted -> `policy publish`",
        "send = the tensors into every shard's receiver (each shard copies and digests "
        "them and installs them in its engine); publish = the daemon's own seconds "
        "(verify, taint, resume and the router's canary per shard, all shards at once)",
        "push = `policy push` of the last update's checkpoint: each shard loads it from "
        "disk itself (the path a shard that missed an update is replayed on)",
        f"shards start {MAX_STARTING} at a time; one warm-up update before the timed ones",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
