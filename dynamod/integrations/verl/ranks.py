"""Where a trainer rank sits on its node: verl numbers its ranks node after node (as
torchrun does), and each node's dynamod lists only that node's shards, so a rank's share of
shards (the colocated update's, a replica's wake-up) is taken among its own node's."""

from __future__ import annotations

import os


def local_world_size() -> int:
    """Trainer ranks on this node: torchrun's LOCAL_WORLD_SIZE, else the one verl's Ray
    worker groups set (RAY_LOCAL_WORLD_SIZE); 0 when neither says (all ranks local)."""
    for name in ("LOCAL_WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE"):
        text = os.environ.get(name, "")
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 0


def node_replica(rank: int, replica_world: int, world: int, local_world: int) -> tuple[int, int]:
    """(this rank's replica among its own node's, the replicas on its node): each node's
    dynamod lists only that node's shards, so a replica's share is taken among them
    (ranks are numbered node after node; local_world 0: every rank on one node)."""
    local = local_world or world
    return (rank % local) // replica_world, max(1, local // replica_world)
