"""The fleet benchmark's second push: the trainer's call answered early.

`dynamod policy push --serving 1`: the head's daemon answers once one of its shards
serves the step and the ledger is at it; the rest of its shards, and every other node's
(which replay the step from the ledger meanwhile), update after the answer. Measured beside
the full push in the same fleet: the trainer's stall, and until every shard of the fleet
holds the step (the head's `policy.push_finished` event, once its own shards are done and
the registry shows every other node's at the step). Under load from inside the head (the
fleet's, half of it trainer-style), which asks for the new step from the answer on: the
requests for it until the push finished, how many failed, and their latency beside the
load's before the push (what the early answer trades: the step's capacity grows from one
shard). With `--early-pushes N` it is pushed N times, each after the whole fleet is routed
again, and each push says how many of etcd's fsyncs and backend commits were slow around it,
which member led raft, and (etcd's members then run with `--metrics extensive`) the bound
etcd served every transaction within meanwhile."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from prometheus_client.samples import Sample

from bench import fleet_cpu, host
from bench.fleet_cut import member_metrics
from bench.fleet_growth import prometheus
from bench.fleet_stack import members
from bench.report import Table
from dynamod.chaos.cluster import ClusterError, ClusterRig
from dynamod.chaos.history import Request
from dynamod.chaos.model import Load
from dynamod.chaos.node_loss import make_checkpoint
from dynamod.client import Client
from dynamod.core import events
from dynamod.rollout.dynamo import metric_samples

SERVING = 1  # the head's shards serving the step before the trainer goes on
TAIL = 200  # the head's last events looked at for push_finished (each look reads the end)
# Load after every shard holds the step: at the fleet's 6 req/s, ~12 requests, of which the
# load's seeded draws make at least one trainer-style (no 8 plain ones in a row)
AFTER_S = 2.0
# etcd's disk: each write is the leader's WAL fsync (and each follower's) before it is
# committed, and a batch into its backend; a commit that waited is looked for in these
DISK = {"wal_fsync": "etcd_disk_wal_fsync_duration_seconds",
        "backend_commit": "etcd_disk_backend_commit_duration_seconds"}  # fmt: skip
ERROR_CHARS = 160  # of a failed request's error, kept to tell its kind
SLOW_LE = "0.032"  # a histogram bound of both (1 ms x 2^n): "slow" is above it
# etcd's own time for each transaction it served (`--metrics extensive`: gRPC's handling
# histogram, from the call's arrival at the member to its answer, raft's round included): the
# commit is one Txn, so a commit that is slow while every Txn was quick waited outside etcd's
# handler (in the daemon, or for a core)
TXN = "grpc_server_handling_seconds_bucket"
TXN_LABELS = {"grpc_method": "Txn", "grpc_service": "etcdserverpb.KV", "grpc_type": "unary"}
TXN_LE = ("0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1")  # its bounds, s


def push_early(rig: ClusterRig, step: int, shards: int, load: Load, steady_s: float,
               trace: bool = False) -> dict[str, Any]:  # fmt: skip
    """Push `step` with `serving = 1` under `load` (`steady_s` of it before): the trainer's
    stall, the shards the answer left updating on the head, until every shard of the fleet
    held the step, and the step's requests meanwhile. `trace`: also the scheduler's events
    over the stall, to say behind whom its threads waited for a core (fleet_sched)."""
    checkpoint = make_checkpoint(rig, rig.work_dir / f"step-{step}", 1.0 + 0.01 * step)
    asked = [step - 1]  # the step trainer-style requests require: the new one from the answer
    parts = fleet_cpu.fleet_parts(rig)  # pid -> the fleet's part, for the stall's CPU
    split = fleet_cpu.Split(parts, trace=trace)
    gen = rig.load(load, "tiny-cpu", lambda: asked[0])
    gen.start()
    try:
        time.sleep(steady_s)
        disk_before = etcd_disk(rig)
        split.start()
        host_before = host.counters()
        started = time.monotonic()
        answer = Client(rig.state_dir(rig.names[0]), timeout=900).policy_push(
            step, checkpoint, serving=SERVING
        )
        answered = time.monotonic()
        asked[0] = step  # before the reads below: the load asks for the step from the answer
        machine = host.window(host_before)  # the two cores' busy time in the stall (10 ms ticks)
        split.stop()  # its reads: 14-39 ms at 8 x 32, 1-3 at 1 x 1 (docs/benchmarks.md 16)
        disk = disk_since(disk_before, etcd_disk(rig))  # read after: not in the stall
        bad = {k: v.get("error") for k, v in answer["acks"].items() if not v.get("ok")}
        if bad:
            raise ClusterError(f"push of step {step} (serving {SERVING}) failed on {bad}")
        finished: list[dict[str, Any]] = []

        def done() -> bool:  # the head's event for this step (the events file's last ones)
            finished[:] = [e for e in events.tail(rig.state_dir(rig.names[0]), TAIL)
                           if e["kind"] == "policy.push_finished" and e.get("version") == step]
            return bool(finished) or not answer.get("updating")

        rig.wait(f"every shard at step {step} after the early answer", done,
                 max(300, 2 * shards), 0.2)  # fmt: skip
        whole = time.monotonic()
        time.sleep(AFTER_S)  # the step's traffic on the whole fleet
    finally:
        gen.stop()
        split.close()
    event = finished[0] if finished else {"seconds": answer["seconds"], "behind": [], "stale": []}
    rows = list(gen.requests)
    wrong = sum(r.ok and r.version != step for r in rows if r.required == step)
    first_shard, first = min(((k, a) for k, a in answer["acks"].items() if a["ok"]),
                             key=lambda acked: float(acked[1]["total_ms"]))  # fmt: skip
    at = {name: t - gen.origin for name, t in
          (("push", started), ("answer", answered), ("whole", whole))}  # fmt: skip
    return {
        "step": step,
        "serving": SERVING,
        "stall_s": answered - started,
        "daemon_s": float(answer["seconds"]),  # the rest of the stall: the CLI's call
        "commit_ms": answer.get("commit_ms"),
        "commit_cpu_ms": answer.get("commit_cpu_ms"),  # the head's daemon's CPU in it
        "commit_waited_ms": answer.get("commit_waited_ms"),  # its loop's wait for a core
        "first_shard": first_shard,
        "first_ack_ms": float(first["total_ms"]),
        "first_ack_steps_ms": first["ms"],  # by step
        # where the machine's cores went in the stall, by the fleet's part (fleet_cpu)
        "cpu_split": split.result(first_shard),
        "acked_at_answer": len(answer["acks"]),
        "updating_at_answer": len(answer.get("updating", [])),
        "etcd_disk": disk,  # from before the push to just after its answer, by member
        "host": machine,
        "every_shard_s": float(event["seconds"]),
        "head_shards_s": float(event.get("here_s", event["seconds"])),
        "behind": event.get("behind", []),
        "stale": event.get("stale", []),
        "load": {
            "before": latencies([r for r in rows if r.sent < at["push"]]),
            "in_push": latencies([r for r in rows if at["push"] <= r.sent < at["answer"]]),
            "step_until_whole": latencies(
                [r for r in rows if r.required == step and r.sent < at["whole"]]
            ),
            "step_all": latencies([r for r in rows if r.required == step]),
            "step_wrong_version": wrong,  # served, at another version: never expected
        },
    }


def disk_counts(text: str) -> dict[str, float]:
    """A /metrics text's fsyncs and backend commits so far, their seconds, how many took
    longer than SLOW_LE s, and whether its member leads etcd's raft (1) or not (0)."""
    found = metric_samples(text)
    names = {f"{k}_{part}": f"{m}_{part}" for k, m in DISK.items() for part in ("count", "sum")}
    counts = prometheus(found, {**names, "is_leader": "etcd_server_is_leader"})
    for key, metric in DISK.items():
        within = next((s.value for s in found if s.name == f"{metric}_bucket"
                       and s.labels.get("le") == SLOW_LE), math.nan)  # fmt: skip
        counts[f"{key}_slow"] = counts[f"{key}_count"] - within
    return counts | txn_counts(found)


def txn_counts(found: list[Sample]) -> dict[str, float]:
    """A /metrics text's Txns served so far (its `metric_samples`), in all and within each of
    TXN_LE's bounds (`txn_le_0.005`: within 5 ms); none for a member without `--metrics
    extensive`."""
    counts: dict[str, float] = {}
    for s in found:
        if s.name == TXN and all(s.labels.get(k) == v for k, v in TXN_LABELS.items()):
            bound = s.labels.get("le", "")
            key = "txn_count" if bound == "+Inf" else f"txn_le_{bound}"
            counts[key] = counts.get(key, 0.0) + s.value
    return counts


def etcd_disk(rig: ClusterRig) -> dict[str, dict[str, float]]:
    """Every etcd member's `disk_counts`, by the node it runs on."""
    return {node: disk_counts(member_metrics(rig, node)) for node in members(rig.names)}


def disk_since(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """What each member's disk did between two `etcd_disk` readings (and whether it led
    etcd's raft at the second: a write through a follower is forwarded to the leader)."""
    return {node: {k: after[node][k] - (0 if k == "is_leader" else v) for k, v in counts.items()}
            for node, counts in before.items() if node in after}  # fmt: skip


def slow_disk(pushed: dict[str, Any]) -> str:
    """An early push's slow fsyncs and backend commits over its members ("-" before
    they were read)."""
    disk = pushed.get("etcd_disk")
    if not disk:
        return "-"
    fsyncs = sum(m["wal_fsync_slow"] for m in disk.values())
    commits = sum(m["backend_commit_slow"] for m in disk.values())
    return f"{fsyncs:.0f} / {commits:.0f}"


def commit_split(pushed: dict[str, Any]) -> str:
    """An early push's commit: the head's daemon's CPU in it / how long its event loop's
    thread waited for a core in it, ms ("-" where the daemon did not say)."""
    cpu, waited = pushed.get("commit_cpu_ms"), pushed.get("commit_waited_ms")
    return " / ".join("-" if v is None else f"{v:.1f}" for v in (cpu, waited))


def slowest_txn(pushed: dict[str, Any]) -> str:
    """The bound etcd served every Txn within, over its members, from before an early
    push to just after its answer ("<= 5 ms"; "-" without `--metrics extensive`)."""
    disk = [m for m in (pushed.get("etcd_disk") or {}).values() if "txn_count" in m]
    if not disk:
        return "-"
    for bound in TXN_LE:
        if all(m.get(f"txn_le_{bound}", math.nan) >= m["txn_count"] for m in disk):
            return f"<= {float(bound) * 1000:g} ms"
    return f"> {float(TXN_LE[-1]) * 1000:g} ms"


def raft_leader(pushed: dict[str, Any]) -> str:
    """The member that led etcd's raft just after an early push's answer ("-": unknown)."""
    disk = pushed.get("etcd_disk") or {}
    return next((node for node, m in disk.items() if m.get("is_leader") == 1), "-")


def push_early_again(
    rig: ClusterRig,
    after: int,
    times: int,
    shards: int,
    load: Load,
    steady_s: float,
    whole: Callable[[], dict[str, Any]],
    trace: bool = False,
) -> list[dict[str, Any]]:
    """The early push `times` more, at the steps after `after`, each once every shard is
    routed again after the one before (`whole`, timed with it): one push's stall and
    commit on a busy machine say little of the next's."""
    pushes = []
    for step in range(after + 1, after + 1 + times):
        pushed = push_early(rig, step, shards, load, steady_s, trace)
        pushes.append({**pushed, "whole": whole()})
    return pushes


def pushes_of(fleet: dict[str, Any]) -> list[dict[str, Any]]:
    """Every early push in a fleet's result: the first, then its repeats."""
    return [fleet["early"], *fleet.get("early_again", [])] if "early" in fleet else []


def early_stalls(fleet: dict[str, Any]) -> list[float]:
    """Every early push's stall in a fleet's result."""
    return [float(p["stall_s"]) for p in pushes_of(fleet)]


def early_repeat_table(fleets: list[dict[str, Any]], ref_s: float) -> Table:
    """Per fleet that pushed early more than once: the spread over its pushes."""
    table = Table(
        "The push answered at one shard serving, repeated (`--early-pushes`): median / "
        f"slowest over the fleet's pushes; one shard's push {ref_s:.3f} s",
        ["nodes", "shards", "pushes", "trainer's stall s", "its stall / one shard's",
         "met 2x", "first shard's update ms", "commit ms", "every shard at the step s",
         "each push: commit ms (the daemon's CPU / its loop's wait for a core in it; "
         f"etcd's fsyncs / backend commits over {float(SLOW_LE) * 1000:g} ms; etcd's "
         "slowest Txn)",
         "etcd's raft leader"],
    )  # fmt: skip
    for f in fleets:
        pushes = pushes_of(f)
        if len(pushes) < 2:
            continue
        stalls = early_stalls(f)

        def spread(
            key: str, digits: int, scale: float = 1.0, pushes: list[dict[str, Any]] = pushes
        ) -> str:
            values = [float(p[key]) * scale for p in pushes if p.get(key) is not None]
            if not values:
                return "-"
            return f"{statistics.median(values):.{digits}f} / {max(values):.{digits}f}"

        table.rows.append(
            [f["nodes"], f["shards"], len(pushes),
             f"{statistics.median(stalls):.3f} / {max(stalls):.3f}",
             spread("stall_s", 2, 1 / ref_s),
             f"{sum(s / ref_s <= 2.0 for s in stalls)} of {len(stalls)}",
             spread("first_ack_ms", 0), spread("commit_ms", 1), spread("every_shard_s", 1),
             ", ".join(f"{p.get('commit_ms') or math.nan:.1f} ({commit_split(p)}; "
                       f"{slow_disk(p)}; {slowest_txn(p)})" for p in pushes),
             ", ".join(sorted({raft_leader(p) for p in pushes}))]
        )  # fmt: skip
    return table


def latencies(rows: list[Request]) -> dict[str, Any]:
    """Requests, failed, the answered ones' latency p50 / p99 in ms, and the failures by
    what they got (HTTP status, the error's start)."""
    ms = sorted(r.latency * 1000 for r in rows if r.ok)
    failures = Counter(f"{r.status}: {(r.error or '')[:ERROR_CHARS]}" for r in rows if not r.ok)
    return {
        "requests": len(rows),
        "failed": sum(not r.ok for r in rows),
        "p50_ms": statistics.median(ms) if ms else float("nan"),
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else float("nan"),
        "failures": dict(failures.most_common(5)),
    }


def early_table(fleets: list[dict[str, Any]]) -> Table:
    """Per fleet: the push answered at one shard serving, and the load around it."""
    table = Table(
        f"The second push answered once {SERVING} of the head's shards serve it (`policy push "
        f"--serving {SERVING}`), under load asking for the new step from the answer on",
        ["nodes", "shards", "trainer's stall s", "of it: first shard's update / commit ms",
         "updating after the answer (head)",
         "the head's shards at the step s", "every shard at the step s",
         "before: p50 / p99 ms", "in the stall: requests, failed",
         "the step's requests until every shard: n", "failed", "p50 ms", "p99 ms",
         "served at another version"],
        digits=2,
    )  # fmt: skip
    for f in fleets:
        e = f.get("early")
        if e is None:
            continue
        load = e["load"]
        before, stall, step = load["before"], load["in_push"], load["step_until_whole"]
        table.rows.append(
            [f["nodes"], f["shards"], e["stall_s"],
             f"{e.get('first_ack_ms', math.nan):.0f} / {e.get('commit_ms') or math.nan:.0f}",
             e["updating_at_answer"], e["head_shards_s"],
             e["every_shard_s"],
             f"{before['p50_ms']:.0f} / {before['p99_ms']:.0f}",
             f"{stall['requests']}, {stall['failed']}", step["requests"], step["failed"],
             step["p50_ms"], step["p99_ms"], load["step_wrong_version"]]
        )  # fmt: skip
    return table
