"""bench.fleet's node cut: which node it cuts (the last; the one holding the cluster's
leader key; the one holding etcd's raft leader) and the cut itself, under load from inside
the head, timed until the head's registry marks the node lost and its router stops listing
the node's shards (bench.cluster's round without its push and rejoin)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.fleet_stack import members
from dynamod.chaos.cluster import ClusterError, ClusterRig
from dynamod.chaos.model import Load
from dynamod.chaos.node_loss import NodeLossRound, lost_and_rerouted

CUTS = ("last", "leader", "etcd-leader")
ETCD_CLIENT_PORT = 2379  # units/stacks/cluster.toml's vars.etcd_client_port
_IS_LEADER = re.compile(r"^etcd_server_is_leader 1(\.0)?$", re.MULTILINE)


def member_metrics(rig: ClusterRig, node: str) -> str:
    """The /metrics text of the etcd member on `node`, read inside its namespace."""

    def read() -> str:
        url = f"http://127.0.0.1:{ETCD_CLIENT_PORT}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            text: str = answer.read().decode()
            return text

    result: str = rig.in_node(node, read)
    return result


def etcd_leader(rig: ClusterRig) -> str | None:
    """The node whose etcd member leads etcd's raft (`etcd_server_is_leader 1` in its
    /metrics); None when no member says so (an election)."""
    for node in members(rig.names):
        if _IS_LEADER.search(member_metrics(rig, node)):
            return node
    return None


def move_etcd_leader(rig: ClusterRig, frm: str, to: str) -> None:
    """`etcdctl move-leader`, sent to the leading member `frm` (the only one that takes
    it), to `to`'s member; waits until `to` leads."""
    etcdctl = str(Path(sys.executable).parent / "etcdctl")
    endpoint = f"http://{rig.address(frm)}:{ETCD_CLIENT_PORT}"

    def ctl(*args: str) -> str:
        assert rig.sandbox is not None
        proc = rig.sandbox.run(0, [etcdctl, "--endpoints", endpoint, *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        out, _ = proc.communicate(timeout=30)
        if proc.returncode != 0:
            raise ClusterError(f"etcdctl {' '.join(args)} at {endpoint}: {out.decode()[-500:]}")
        return out.decode()

    ids = {m["name"]: m["ID"] for m in json.loads(ctl("member", "list", "-w", "json"))["members"]}
    ctl("move-leader", format(int(ids[to]), "x"))
    rig.wait(f"etcd's leader on {to}", lambda: etcd_leader(rig) == to, 30, 0.2)


def cut_target(rig: ClusterRig, which: str) -> str:
    """The node the cut phase cuts. `last`: the last node (no etcd member from 4 nodes on).
    `leader`: the node holding the cluster's leader key (heard by the deputy alone).
    `etcd-leader`: the node whose etcd member leads etcd's raft, moved there from the head
    first if the head leads (etcd elects a new leader, and writes wait on the election).
    Never the head, whose cut would take etcd's first member, NATS, the frontend and the
    load with it: `leader` falls back to the last node, `etcd-leader` needs 3 members."""
    if which == "leader":
        held = rig.status(rig.names[0])["cluster"].get("leader")
        if held in rig.names[1:]:
            return str(held)
    if which == "etcd-leader":
        voters = members(rig.names)
        if len(voters) < 3:
            raise ClusterError("a cut of etcd's leader needs 3 members (3 nodes or more)")
        leading = rig.wait("etcd's leader", lambda: etcd_leader(rig), 30, 0.2)
        if leading == rig.names[0]:
            move_etcd_leader(rig, leading, voters[1])
            leading = voters[1]
        return str(leading)
    return rig.names[-1]


def cut_one(
    rig: ClusterRig, node: str, phase_s: float, load: Load, step: int
) -> dict[str, Any]:
    """Under load from inside the head (its trainer's requests at version `step`, the one
    last pushed), cut the node's link: until the head's registry marks it lost and its
    router lists none of its shards; the requests that failed before and after that."""
    ids = rig.instance_ids(node)
    was_leader = rig.status(rig.names[0])["cluster"].get("leader") == node
    held_etcd_leader = len(members(rig.names)) >= 3 and etcd_leader(rig) == node
    r = NodeLossRound(node=node)
    gen = rig.load(load, "tiny-cpu", lambda: step)
    lost_before = len(rig.logged("cluster.node_lost"))
    gen.start()
    try:
        time.sleep(phase_s)  # steady load first
        cut = time.monotonic()
        r.cut_at = cut - gen.origin
        rig.cut(node)
        lost, rerouted, r.lost_why = lost_and_rerouted(rig, node, ids, cut, 30)
        r.lost_s, r.rerouted_s, r.rerouted_at = lost - cut, rerouted - cut, rerouted - gen.origin
        time.sleep(phase_s)  # load on the other nodes' shards alone
    finally:
        gen.stop()
        rig.heal(node)
    r.requests = list(gen.requests)
    r.marked_lost = [str(e.get("node")) for e in rig.logged("cluster.node_lost")[lost_before:]]
    return {
        "node": node,
        "was_leader": was_leader,
        "held_etcd_leader": held_etcd_leader,
        "shards": len(ids),
        "lost_s": r.lost_s,
        "rerouted_s": r.rerouted_s,
        "why": r.lost_why,  # the lease's expiry, or the leader's heartbeats
        "requests": len(r.requests),
        "failed_before_reroute": len(r.failed_during_cut()),
        "failed_after_reroute": len(r.failed_after_reroute()),
        "falsely_lost": r.falsely_lost(),
        "falsely_lost_n": len(r.falsely_lost()),
    }
