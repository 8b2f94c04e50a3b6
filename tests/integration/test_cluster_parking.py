"""cluster/parking.py against a real etcd: a lost node's instance keys are withdrawn (and
only those: its other keys, and other workers' instances, stay), put back on the same
lease while that lease lives, and reported gone, with nothing written, once it expired.
Withdrawal and the node's return race: nothing is withdrawn once the node's registry entry
is back, and the node clears only the lost record it read."""

from __future__ import annotations

import asyncio
import json

import pytest

from dynamod.cluster import parking
from dynamod.rollout.etcd import EtcdClient


async def _worker(etcd: EtcdClient, namespace: str) -> tuple[int, list[str]]:
    """A worker's registration as Dynamo 1.6.1 writes it: every key on one lease."""
    lease = await etcd.lease_grant(30)
    address = f"10.0.0.2:4000/{lease:x}/{namespace}/backend/generate"
    value = json.dumps(
        {"namespace": namespace, "instance_id": lease, "transport": {"tcp": address}},
    )
    keys = [f"v1/instances/{namespace}/backend/generate/{lease:x}",
            f"v1/instances/{namespace}/backend/clear_kv_blocks/{lease:x}",
            f"v1/mdc/{namespace}/backend/generate/{lease:x}"]  # fmt: skip
    for key in keys:
        await etcd.put(key, value, lease)
    return lease, keys


ENTRY = "dynamod/test-parking/nodes/n2"  # the lost node's registry entry
RECORD = "dynamod/test-parking/lost/n2"


def _record(parked: list[parking.ParkedKey]) -> str:
    return json.dumps([key.as_dict() for key in parked])


async def _withdraw(
    etcd: EtcdClient, ids: list[int], earlier: list[parking.ParkedKey] | None = None
) -> list[parking.ParkedKey] | None:
    return await parking.withdraw(etcd, ids, absent=ENTRY, record_key=RECORD, record=_record,
                                  earlier=earlier or [])  # fmt: skip


def _recorded(raw: bytes | None) -> list[str]:
    assert raw is not None, "no lost record was written"
    return sorted(parking.ParkedKey.from_dict(k).key for k in json.loads(raw))


async def test_withdrawn_keys_come_back_on_their_lease(etcd: EtcdClient) -> None:
    lost, lost_keys = await _worker(etcd, "parkns1")
    other, other_keys = await _worker(etcd, "parkns1")
    parked = await _withdraw(etcd, [lost])
    assert parked is not None
    assert sorted(k.key for k in parked) == sorted(lost_keys[:2])  # its instance keys only
    record = await etcd.get_kv(RECORD)
    assert record is not None and _recorded(record.value) == sorted(lost_keys[:2])
    assert {k.lease for k in parked} == {lost}
    assert [await etcd.get(k) is None for k in lost_keys] == [True, True, False]
    assert all([await etcd.get(k) is not None for k in other_keys]), "the other worker stays"
    restored, gone = await parking.put_back(etcd, parked)
    assert (sorted(k.key for k in restored), gone) == (sorted(lost_keys[:2]), [])
    for key in lost_keys:
        kv = await etcd.get_kv(key)
        assert kv is not None and kv.lease == lost, key
    again = parking.ParkedKey.from_dict(json.loads(json.dumps(parked[0].as_dict())))
    assert again == parked[0]  # as the lost record stores it
    assert await parking.clear_record(etcd, record) and await etcd.get(RECORD) is None
    await etcd.lease_revoke(lost)
    await etcd.lease_revoke(other)


async def test_nothing_is_withdrawn_once_the_node_is_back_in_the_registry(
    etcd: EtcdClient,
) -> None:
    lost, keys = await _worker(etcd, "parkns3")
    entry_lease = await etcd.lease_grant(30)
    await etcd.put(ENTRY, "{}", entry_lease)  # the node published again before the marking
    try:
        assert await _withdraw(etcd, [lost]) is None
        assert all([await etcd.get(k) is not None for k in keys]), "its keys must stay"
        assert await etcd.get(RECORD) is None, "and no lost record be written"
    finally:
        await etcd.lease_revoke(entry_lease)
        await etcd.lease_revoke(lost)


async def test_a_node_clears_only_the_record_it_read(etcd: EtcdClient) -> None:
    lost, _ = await _worker(etcd, "parkns4")
    assert await _withdraw(etcd, [lost]) is not None
    read = await etcd.get_kv(RECORD)
    assert read is not None
    assert await _withdraw(etcd, [lost]) is not None  # lost again while it put back
    assert not await parking.clear_record(etcd, read)
    newer = await etcd.get_kv(RECORD)
    assert newer is not None and newer.mod_revision > read.mod_revision, "the newer one stays"
    assert await parking.clear_record(etcd, newer) and await etcd.get(RECORD) is None
    await etcd.lease_revoke(lost)


async def test_many_keys_go_in_several_transactions_and_a_retry_keeps_the_first_record(
    etcd: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parking, "TXN_OPS", 3)  # etcd's limit is 128 ops; 3 forces chunks
    workers = [await _worker(etcd, "parkns5") for _ in range(4)]  # 8 instance keys
    parked = await _withdraw(etcd, [lease for lease, _ in workers])
    instance_keys = sorted(k for _, keys in workers for k in keys[:2])
    assert parked is not None and sorted(k.key for k in parked) == instance_keys
    assert await etcd.get_prefix("v1/instances/parkns5/") == []
    # tried again (a delete failed): the keys already gone stay in the new record
    again = await _withdraw(etcd, [lease for lease, _ in workers], earlier=parked)
    assert again is not None and _recorded(await etcd.get(RECORD)) == instance_keys
    await etcd.delete(RECORD)
    for lease, _ in workers:
        await etcd.lease_revoke(lease)


async def test_keys_whose_lease_expired_are_reported_gone_and_not_written(
    etcd: EtcdClient,
) -> None:
    lost, keys = await _worker(etcd, "parkns2")
    parked = await _withdraw(etcd, [lost])
    assert parked is not None
    await etcd.lease_revoke(lost)  # as when the cut outlasted Dynamo's 30 s lease
    restored, gone = await parking.put_back(etcd, parked)
    assert restored == [] and sorted(k.key for k in gone) == sorted(keys[:2])
    assert await etcd.get_prefix("v1/instances/parkns2/") == []
    await etcd.delete(RECORD)


async def test_reads_side_by_side_mark_a_lost_node_once_with_all_its_keys(
    etcd: EtcdClient,
) -> None:
    """The leader's read loop and a push's wait (await_other_nodes) both call read(): at 8 x
    32 the two marked the same node, and the second one's `del` failed the push (HTTP 500).
    One marking, its record listing every withdrawn key, and no error."""
    from types import SimpleNamespace

    from dynamod.cluster import registry
    from dynamod.cluster.membership import Membership
    from dynamod.core.phase import Phase
    from dynamod.core.placement import ClusterSpec

    spec = ClusterSpec(nodes={"head": "10.1.0.1", "n2": "10.1.0.2"}, head="head", node="head",
                       registry=["http://10.1.0.1:2379"])  # fmt: skip
    member = Membership(spec, registrations=None, policy=None)  # type: ignore[arg-type]
    member.host = SimpleNamespace(stack=SimpleNamespace(name="parkrace"), phase=Phase.UP)  # type: ignore[assignment]
    member.etcd = etcd
    member.lease = await etcd.lease_grant(30)
    lost, keys = await _worker(etcd, "parkns6")
    entry_lease = await etcd.lease_grant(30)
    unit = registry.UnitEntry(name="worker@0", unit="worker", state="ready", pid=1, ports={},
                              detail="", instance_ids=[lost], shard=True)  # fmt: skip
    entry = registry.NodeEntry(node="n2", address="10.1.0.2", daemon_pid=1, run_id="r",
                               phase="up", head=False, units=[unit])  # fmt: skip
    for key, value in entry.records("parkrace").items():
        await etcd.put(key, value, entry_lease)
    try:
        await member.read()  # sees n2, and takes the leader key
        assert member.leader == "head" and "n2" in member.entries
        await etcd.lease_revoke(entry_lease)  # n2's lease expires
        await asyncio.gather(member.read(), member.read(), member.read())
        record = await etcd.get(registry.lost_key("parkrace", "n2"))
        assert record is not None
        parked = json.loads(record)["parked"]
        assert sorted(p["key"] for p in parked) == sorted(keys[:2])
        assert await etcd.get_prefix("v1/instances/parkns6/") == []
    finally:
        await etcd.delete_prefix("dynamod/parkrace/")
        await etcd.lease_revoke(member.lease)
        await etcd.lease_revoke(lost)
