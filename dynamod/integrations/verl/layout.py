"""Where verl's rollout replica r runs its server actor, and which shards it puts to sleep.

On one node every replica's actor reads that node's daemon: replica r of R owns shards r,
r + R, ... of it (`StackView.shards_of_replica`) and sends its requests to the frontend on
loopback. On a cluster each node's shards sit behind that node's loopback (their system
ports, where sleep, wake-up and the cache flush go) and its own daemon, so a replica's
actor must run on the node of its shards: the cluster's nodes with shards, in its order,
take R / N replicas each (replica r on node r // (R / N), as verl numbers its replicas
node after node), and on its node the replica owns its share as on one node. Its requests
go to the head's frontend at the head's address (`frontend_host` beyond loopback).
A node not up (lost, or its stack still starting), a layout that does not divide among
the nodes, or a node with fewer admitted shards than its replicas is refused with what to
change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dynamod.integrations.verl.errors import StackNotReadyError
from dynamod.integrations.verl.stack import StackView


@dataclass(frozen=True)
class Placement:
    """Replica r's server: the node it runs on (None: a single-node stack, anywhere the
    stack's Ray puts it) and that node's address, the daemon it reads there, its share
    among that node's replicas, and the frontend's URL as that node reaches it."""

    node: str | None
    address: str | None
    state_dir: Path
    replica: int
    replicas: int
    frontend_url: str


def place(view: StackView, replica_rank: int, replicas: int) -> Placement:
    """Replica `replica_rank` of `replicas` on `view`'s stack (diagnosed before)."""
    assert view.frontend_url is not None  # stack.diagnose() guarantees it
    if not view.nodes:
        return Placement(None, None, view.state_dir, replica_rank, replicas, view.frontend_url)
    where = f"dynamod cluster stack {view.stack!r}"
    # a node counts once it is up with its stack up; a forgotten one takes no replica
    absent = [f"{n.name} ({n.phase if n.state == 'up' else n.state})" for n in view.nodes
              if n.state != "forgotten" and (n.state, n.phase) != ("up", "up")]
    if absent:
        raise StackNotReadyError(
            f"{where}: node(s) {', '.join(absent)} not up; verl's replicas are laid out over "
            "the cluster's nodes: bring them up, or `dynamod cluster forget` one gone for good"
        )
    hosts = [n for n in view.nodes if n.state == "up" and n.shards]
    if not hosts:
        raise StackNotReadyError(
            f"{where}: no node's registry entry lists rollout shards yet; wait for the "
            "nodes' `dynamod up` to finish (`dynamod status --cluster`)"
        )
    if replicas % len(hosts):
        raise StackNotReadyError(
            f"{where} has rollout shards on {len(hosts)} node(s) "
            f"({', '.join(n.name for n in hosts)}), and verl's {replicas} replica(s) do not "
            "divide among them: a replica's sleep and wake-up reach only its own node's "
            "shards; set rollout.nnodes (and n_gpus_per_node) so that they do"
        )
    per_node = replicas // len(hosts)
    node = hosts[replica_rank // per_node]
    if len(node.admitted) < per_node:
        raise StackNotReadyError(
            f"{where}: node {node.name} has {len(node.admitted)} admitted rollout shard(s) "
            f"for its {per_node} replica(s) (replicas {replica_rank - replica_rank % per_node}"
            f"-{replica_rank - replica_rank % per_node + per_node - 1}); start it with more "
            "workers or wait for its held shards (`dynamod status --cluster`)"
        )
    if node.state_dir is None:
        raise StackNotReadyError(
            f"{where}: node {node.name}'s registry entry names no state dir (its dynamod is "
            "older than this one); upgrade it"
        )
    head = next(n for n in view.nodes if n.head)
    host = "127.0.0.1" if node.head else head.address
    return Placement(
        node.name, node.address, Path(node.state_dir), replica_rank % per_node, per_node,
        f"http://{host}:{view.frontend_port}",
    )  # fmt: skip
