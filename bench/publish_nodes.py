"""Benchmark 19 - the colocated update across nodes: verl's ranks feed each node's shards,
rank 0 publishes, and the other nodes' dynamods follow the step without a load.

    python -m bench.publish_nodes [--quick] [--json] [--nodes 1,2,4] [--shards-per-node 4]
                                  [--updates 6]

Benchmark 18 times the colocated update on one node. On a cluster each node's dynamod
lists only its own shards, so each node's trainer ranks feed that node's shards, and the
publish on rank 0's node is followed by every other node's daemon: a shard that reports
the step's version and agreed digest is flushed, verified, tainted and resumed with no
load (docs/verl-backend.md, "On a cluster"). Here, for each node count, the cluster stack
(units/stacks/cluster.toml: etcd, NATS and the frontend on the head) runs on that many
network namespaces as nodes, each with `--shards-per-node` CPU workers hosting dynamod's
worker extension (started 2 at a time a node); one trainer rank a node
(bench/publish_rank.py, inside the node's namespace) sends the tiny model's tensors into
its node's shards, rank 0 gathers the others' acknowledgements beside the shared
checkpoint and publishes. One untimed update (the ranks' processes start with it, and
their connections open), then `--updates` timed ones; then as many
`policy push`es of the last checkpoint from the head (every shard of every node loads it).

Reported per node count: rank 0's stall (its update's wall time: its send, the wait for
the other ranks' acknowledgements, the publish, which answers once the other nodes hold
the step), the publish as the head's daemon timed it, the machine's cores busy through the
timed updates, the push, each against one node's;
the last update's slowest shard on the head (verify to route) and on the other nodes
(their follow: check to resume), and how many of the other nodes' shards loaded the
checkpoint in it (0 when each shard's own rank fed it). Target: the stall at the largest
node count within 2x one node's (the issue's target for a push to every shard). Needs
root (network namespaces).
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from bench.fleet_stack import with_max_starting
from bench.procs import bench_mark, state_dir, sweep
from bench.publish_scale import EXTENSION, median
from bench.report import Report, Table, emit, entry, options, ratio, rising_counts
from dynamod.chaos.cluster import NODE_NAMES, ClusterRig, running_cluster
from dynamod.chaos.netns import can_create_namespaces
from dynamod.client import Client
from dynamod.core import paths

MAX_STARTING = 2  # a node's shards starting at once (torch in each; the nodes share 2 cores)
STACK = paths.units_dir() / "stacks" / "cluster.toml"


def stack_file(folder: Path) -> Path:
    """cluster.toml with its shards started MAX_STARTING at a time, includes absolute."""
    text = STACK.read_text().replace('"../', f'"{paths.units_dir()}/')
    path = folder / "cluster.toml"
    path.write_text(with_max_starting(text, MAX_STARTING))
    return path


def run_ranks(rig: ClusterRig, shared: Path, first: int, last: int
              ) -> tuple[list[dict[str, Any]], float]:
    """One rank a node, all at once, through steps first..last: rank 0's records, and the
    machine's cores busy % after the first step (as rank 0 read it)."""
    assert rig.sandbox is not None
    world = len(rig.names)
    procs = [
        rig.sandbox.run(
            rank,
            [sys.executable, "-m", "bench.publish_rank", str(rig.state_dir(node)), str(shared),
             str(rank), str(world), str(first), str(last)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        for rank, node in enumerate(rig.names)
    ]  # fmt: skip
    outs = []
    for rank, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"rank {rank} on {rig.names[rank]} exited {proc.returncode}: "
                               f"{stderr.decode(errors='replace').strip().splitlines()[-1:]}")
        outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    busy = outs[0][-1].get("busy_pct_after_first", float("nan"))
    return [one_update(r) for r in outs[0]], busy


def one_update(record: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's record of a step, checked: every node's every shard at the step, none
    stale or behind."""
    step, published = record["step"], record["publish"]
    at = {s: v for vs in published.get("nodes", {}).values() for s, v in vs.items()}
    if (record["errors"] or record["stale"] or not published.get("ok")
            or published.get("behind") or any(v != step for v in at.values())):
        raise RuntimeError(f"step {step} did not reach every shard: errors {record['errors']}, "
                           f"stale {record['stale']}, behind {published.get('behind')}, {at}")
    slowest = max(published["acks"].values(), key=lambda a: a["total_ms"])
    return {"step": step, "stall_s": record["wall_s"], "send_s": record["send_s"],
            "acks_wait_s": record["acks_wait_s"],
            "publish_s": published["seconds"], "acked": len(record["acks"]),
            "other_nodes_shards": len(at), "head_slowest_ms": slowest["total_ms"],
            "checkpoint": record["checkpoint"]}  # fmt: skip


def followed(rig: ClusterRig) -> dict[str, Any]:
    """The other nodes' shards' last update (the follow of the last step): the slowest's
    milliseconds and how many loaded the checkpoint."""
    totals, loads = [], 0
    for node in rig.names[1:]:
        for unit in rig.status(node)["units"]:
            ms = (unit.get("policy") or {}).get("last_ack_ms") or {}
            if unit["name"].startswith("worker@") and ms:
                totals.append(sum(ms.values()))
                loads += "load" in ms
    return {"slowest_ms": max(totals, default=float("nan")), "loads": loads,
            "shards": len(totals)}  # fmt: skip


def push(rig: ClusterRig, step: int, path: str) -> float:
    answer = Client(rig.state_dir(rig.names[0])).policy_push(step, path, timeout=600)
    bad = {k: v.get("error") for k, v in answer["acks"].items() if not v.get("ok")}
    if bad or answer.get("stale") or answer.get("behind"):
        raise RuntimeError(f"push of step {step} failed: {bad or answer.get('stale')}, "
                           f"behind {answer.get('behind')}")
    return float(answer["seconds"])


def one_cluster(n: int, per_node: int, updates: int) -> dict[str, Any]:
    variables = {"workers": str(per_node), "trainer_steps": "0",
                 "worker_extension_cls": EXTENSION, "weight_ipc_dir": "{state_dir}/weight-ipc"}
    print(f"# publish across {n} node(s) x {per_node} shards", file=sys.stderr, flush=True)
    with state_dir("pn") as folder:
        shared = folder / "shared"
        shared.mkdir()
        started = time.monotonic()
        with running_cluster(n, stack=stack_file(folder), variables=variables,
                             timeout=600) as rig:  # fmt: skip
            up_s = time.monotonic() - started
            # step 1 warms each rank's connections up (the ranks' processes start with it)
            records, busy_pct = run_ranks(rig, shared, 1, updates + 1)
            timed = records[1:]
            follow = followed(rig)
            last = timed[-1]["checkpoint"]
            pushes = [push(rig, step, last) for step in range(updates + 2, 2 * updates + 2)]
    shards = n * per_node
    if any(u["acked"] != shards or u["other_nodes_shards"] != shards - per_node
           for u in timed):  # fmt: skip
        raise RuntimeError(f"{n} nodes: an update acknowledged by fewer than {shards} shards")
    return {"nodes": n, "shards": shards, "up_s": up_s, "updates": timed, "follow": follow,
            "pushes_s": pushes, "busy_pct": busy_pct}


def stall_table(clusters: list[dict[str, Any]]) -> Table:
    table = Table(
        "The colocated update across nodes: rank 0's stall and its parts, s (median over "
        "the timed updates)",
        ["nodes", "shards", "updates", "stall", "slowest", "x 1 node", "send",
         "the other ranks' acks", "publish (head's daemon)", "cores busy %",
         "push (head's daemon)", "push x 1 node"],
        digits=3,
    )
    ref = clusters[0]
    for c in clusters:
        ups = c["updates"]
        table.rows.append([
            c["nodes"], c["shards"], len(ups), median(ups, "stall_s"),
            max(u["stall_s"] for u in ups),
            ratio(median(ups, "stall_s"), median(ref["updates"], "stall_s")),
            median(ups, "send_s"), median(ups, "acks_wait_s"), median(ups, "publish_s"),
            c["busy_pct"],
            statistics.median(c["pushes_s"]),
            ratio(statistics.median(c["pushes_s"]), statistics.median(ref["pushes_s"])),
        ])
    return table


def follow_table(clusters: list[dict[str, Any]]) -> Table:
    table = Table(
        "The last update's shards: the head's slowest (verify to route) and the other "
        "nodes' slowest follow (check to resume), ms; the other nodes' loads",
        ["nodes", "head's slowest", "other nodes' slowest", "other nodes' shards",
         "of them loaded the checkpoint"],
        digits=1,
    )
    for c in clusters:
        f = c["follow"]
        table.rows.append([c["nodes"], c["updates"][-1]["head_slowest_ms"],
                           f["slowest_ms"] if f["shards"] else "-", f["shards"],
                           f["loads"]])  # fmt: skip
    return table


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0])
    parser.add_argument("--nodes", default=None,
                        help="node counts, rising from 1 (default 1,2,4; quick 1,2)")
    parser.add_argument("--shards-per-node", type=int, default=None,
                        help="CPU shards a node (default 4; quick 1)")
    parser.add_argument("--updates", type=int, default=None,
                        help="timed updates (and pushes) per count (default 6; quick 2)")
    args = parser.parse_args()
    try:
        nodes = rising_counts(args.nodes or ("1,2" if args.quick else "1,2,4"), "--nodes",
                              "1,2,4")
    except ValueError as exc:
        parser.error(str(exc))
    if nodes[-1] > len(NODE_NAMES):
        parser.error(f"--nodes {nodes[-1]}: at most {len(NODE_NAMES)} nodes")
    for flag, value in (("--shards-per-node", args.shards_per_node),
                        ("--updates", args.updates)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: at least 1")
    per_node = args.shards_per_node or (1 if args.quick else 4)
    updates = args.updates or (2 if args.quick else 6)
    reason = can_create_namespaces()
    if reason is not None:
        parser.error(f"network namespaces are needed (run as root): {reason}")
    bench_mark()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    report = Report("publish_nodes", "19. The colocated update across nodes", args.quick)
    clusters: list[dict[str, Any]] = []
    try:
        for n in nodes:
            clusters.append(one_cluster(n, per_node, updates))
    finally:
        sweep()
    report.tables += [stall_table(clusters), follow_table(clusters)]
    largest, ref = clusters[-1], clusters[0]
    report.target(
        f"rank 0's stall at {largest['nodes']} nodes against 1 node's "
        f"({per_node} shards a node)",
        ratio(median(largest["updates"], "stall_s"), median(ref["updates"], "stall_s")),
        2.0, "x",
    )
    report.data = {"clusters": clusters, "shards_per_node": per_node}
    report.notes += [
        "stall = `ColocatedSync.update`'s wall time on rank 0: pause -> IPC send into its "
        "node's shards -> flush -> version -> checkpoint submitted -> the other ranks' "
        "acknowledgements -> `policy publish`, which answers once every other node holds "
        "the step",
        "the other nodes follow the published step: each shard that reports the step's "
        "version and digest is flushed, verified, tainted and resumed with no load",
        "push = `policy push` of the last checkpoint from the head: every shard of every "
        "node loads it from disk (the replay path)",
        "every node is a network namespace on this one machine: all nodes' shards, "
        "daemons and ranks share its cores",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
