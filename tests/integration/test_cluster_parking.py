"""cluster/parking.py against a real etcd: a lost node's instance keys are withdrawn (and
only those: its other keys, and other workers' instances, stay), put back on the same
lease while that lease lives, and reported gone, with nothing written, once it expired."""

from __future__ import annotations

import json

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


async def test_withdrawn_keys_come_back_on_their_lease(etcd: EtcdClient) -> None:
    lost, lost_keys = await _worker(etcd, "parkns1")
    other, other_keys = await _worker(etcd, "parkns1")
    parked = await parking.withdraw(etcd, [lost])
    assert sorted(k.key for k in parked) == sorted(lost_keys[:2])  # its instance keys only
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
    await etcd.lease_revoke(lost)
    await etcd.lease_revoke(other)


async def test_keys_whose_lease_expired_are_reported_gone_and_not_written(
    etcd: EtcdClient,
) -> None:
    lost, keys = await _worker(etcd, "parkns2")
    parked = await parking.withdraw(etcd, [lost])
    await etcd.lease_revoke(lost)  # as when the cut outlasted Dynamo's 30 s lease
    restored, gone = await parking.put_back(etcd, parked)
    assert restored == [] and sorted(k.key for k in gone) == sorted(keys[:2])
    assert await etcd.get_prefix("v1/instances/parkns2/") == []
