"""Taking a lost node's shards out of the router in a way the node can undo: the leader
deletes the shards' `v1/instances/...` keys (what Dynamo's frontend routes by) and records
them, and leaves the workers' own leases, model cards and event channels alone. A node back
in contact within Dynamo's lease (30 s) puts the keys back on the same leases (its shards
paused first, so none serves before its replay), and its shards rejoin by replay instead of
a cold restart (~8 s of a CPU worker's start on the loaded test machine). A lease that
expired meanwhile took the worker's other keys with it: that shard is restarted instead.

The leader's withdrawal and the node's return race (on a loaded machine a withdrawal of 32
shards took 1 s): a node that put back what its lost record listed, and cleared the record,
before the leader's deletes and record landed, had its shards unrouted for good (the fleet
benchmark at 4 x 32). So both sides are etcd transactions: the leader's record and deletes
hold only while the node's registry entry is absent (a node back in contact publishes its
entry first), and the node clears only the record it read."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dynamod.rollout import dynamo
from dynamod.rollout.etcd import (
    TXN_OPS,
    Compare,
    EtcdClient,
    EtcdError,
    KeyValue,
    TxnDelete,
    TxnPut,
)


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


async def withdraw(
    etcd: EtcdClient,
    instance_ids: Iterable[int],
    *,
    absent: str,
    record_key: str,
    record: Callable[[list[ParkedKey]], str],
    earlier: Sequence[ParkedKey] = (),
) -> list[ParkedKey] | None:
    """Delete the instance keys of `instance_ids` and write `record(parked)` at `record_key`,
    only while the key `absent` (the node's registry entry) does not exist: None, and
    nothing changed, once it does (the node is back). The record goes first, listing every
    key about to go, so a node that returns between two of the delete transactions still
    finds all of them to put back (putting back a key that was not deleted is harmless).
    `earlier`: what a record of the same loss already lists (a marking tried again after a
    failed delete), kept in the new one."""
    wanted = set(instance_ids)
    found = {key.key: key for key in earlier}
    for kv in await etcd.get_prefix(f"{dynamo.INSTANCES_ROOT}/"):
        instance = dynamo.parse_instance(kv.key, kv.value, kv.lease)
        if instance is not None and instance.instance_id in wanted:
            found[kv.key] = ParkedKey(kv.key, kv.value.decode(), kv.lease, instance.instance_id)
    parked = list(found.values())
    guard = [Compare(absent, "version", "==", 0)]
    if not await etcd.txn(guard, [TxnPut(record_key, record(parked))]):
        return None
    for start in range(0, len(parked), TXN_OPS):  # each chunk under the same guard
        chunk = parked[start : start + TXN_OPS]
        if not await etcd.txn(guard, [TxnDelete(key.key) for key in chunk]):
            return None  # back meanwhile: it puts back all the record lists
    return parked


async def clear_record(etcd: EtcdClient, record: KeyValue) -> bool:
    """Delete the lost record the node read and put back, unless a newer one replaced it
    (the node was lost again meanwhile: that one is for the next return)."""
    return await etcd.txn(
        [Compare(record.key, "mod", "==", record.mod_revision)], [TxnDelete(record.key)]
    )


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
