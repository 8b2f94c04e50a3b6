"""Taking a lost node's shards out of the router in a way the node can undo: the leader
deletes the shards' `v1/instances/...` keys (what Dynamo's frontend routes by) and records
them, and leaves the workers' own leases, model cards and event channels alone. A node back
in contact within Dynamo's lease (30 s) puts the keys back on the same leases (its shards
paused first, so none serves before its replay), and its shards rejoin by replay instead of
a cold restart (~8 s of a CPU worker's start on the loaded test machine). A lease that
expired meanwhile took the worker's other keys with it: that shard is restarted instead."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dynamod.rollout import dynamo
from dynamod.rollout.etcd import EtcdClient, EtcdError


@dataclass(frozen=True)
class ParkedKey:
    """One instance key the leader took away: put it back as it was, on its lease."""

    key: str
    value: str
    lease: int
    instance_id: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParkedKey:
        return cls(str(data["key"]), str(data["value"]), int(data["lease"]),
                   int(data["instance_id"]))  # fmt: skip


async def withdraw(etcd: EtcdClient, instance_ids: Iterable[int]) -> list[ParkedKey]:
    """Delete the instance keys of `instance_ids`; returns what was deleted."""
    wanted = set(instance_ids)
    if not wanted:
        return []
    parked: list[ParkedKey] = []
    for kv in await etcd.get_prefix(f"{dynamo.INSTANCES_ROOT}/"):
        instance = dynamo.parse_instance(kv.key, kv.value, kv.lease)
        if instance is None or instance.instance_id not in wanted:
            continue
        if await etcd.delete(kv.key):
            parked.append(ParkedKey(kv.key, kv.value.decode(), kv.lease, instance.instance_id))
    return parked


async def put_back(
    etcd: EtcdClient, parked: Sequence[ParkedKey]
) -> tuple[list[ParkedKey], list[ParkedKey]]:
    """Put parked keys back on their leases: (restored, gone: their lease had expired)."""
    restored: list[ParkedKey] = []
    gone: list[ParkedKey] = []
    for key in parked:
        if not key.lease or await etcd.lease_time_to_live(key.lease) is None:
            gone.append(key)
            continue
        try:
            await etcd.put(key.key, key.value, key.lease)
        except EtcdError as exc:
            if "lease not found" not in str(exc):  # expired between the check and the put
                raise
            gone.append(key)
            continue
        restored.append(key)
    return restored, gone
