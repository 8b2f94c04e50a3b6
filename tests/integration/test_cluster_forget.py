"""`dynamod cluster forget` against a real etcd: a lost node forgotten leaves no lost
record, lease record or ledger ack behind, its Dynamo lease is revoked (its keys go), and
the daemons stop pinging it, waiting for it and showing it lost; a node that is up, this
node and a name the cluster does not have are refused with nothing changed; a marking that
waited does not bring a forgotten node back as lost; a new run's first publish under a
lost or forgotten name clears its records. The whole path through a cut network namespace
and the CLI is tests/integration/test_cluster.py's forget round."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from dynamod.cluster import registry
from dynamod.cluster.forget import ForgetRefused
from dynamod.cluster.heartbeat import Responder
from dynamod.cluster.membership import Membership
from dynamod.cluster.registry import LostRecord, NodeEntry
from dynamod.cluster.shutdown import ClusterShutdown
from dynamod.core.phase import Phase
from dynamod.core.placement import ClusterSpec
from dynamod.rollout.etcd import EtcdClient
from dynamod.rollout.ledger import lease_key

LEASE_S = 30  # far longer than the test: only a revocation ends one in time
NODES = {"head": "127.0.0.1", "n1": "127.0.0.1", "n2": "127.0.0.1"}


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, unit: str | None = None, **fields: Any) -> None:
        self.emitted.append((kind, fields))


def _member(etcd: EtcdClient, stack: str, node: str) -> Membership:
    """`node`'s membership (no loops), its etcd the real one."""
    spec = ClusterSpec(nodes=NODES, head="head", node=node, registry=["http://127.0.0.1:1"],
                       heartbeat_timeout=0.6)  # fmt: skip
    member = Membership(spec, registrations=Any, policy=None)  # type: ignore[arg-type]
    member.host = SimpleNamespace(  # type: ignore[assignment]
        phase=Phase.UP, stack=SimpleNamespace(name=stack), events=Events()
    )
    member.etcd = etcd
    return member


@pytest.fixture
async def stack(etcd: EtcdClient, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    name = f"fg{abs(hash(request.node.name)) % 10**8}"
    await etcd.put(registry.leader_key(name), "head")
    yield name
    await etcd.delete_prefix(f"dynamod/{name}/")


async def _up(etcd: EtcdClient, stack: str, name: str, port: int | None = None) -> int:
    """`name`'s registry entry on a lease of its own; the lease."""
    lease = await etcd.lease_grant(LEASE_S)
    entry = NodeEntry(node=name, address="127.0.0.1", daemon_pid=1, run_id="r", phase="up",
                      head=False, units=[], heartbeat_port=port)  # fmt: skip
    for key, value in entry.records(stack).items():
        await etcd.put(key, value, lease)
    return lease


async def _worker_records(etcd: EtcdClient, stack: str, node: str) -> tuple[int, str]:
    """A worker of `node` as dynamod keeps it: a Dynamo lease holding a key, its lease
    record and its ledger ack. The lease and the key on it."""
    lease = await etcd.lease_grant(LEASE_S)
    key = f"v1/mdc/fg/{node}-{lease:x}"
    await etcd.put(key, "{}", lease)
    record = {"namespace": "fg", "instance_ids": [lease], "recorded_at": 1.0}
    await etcd.put(lease_key(stack, node, "worker@0"), json.dumps(record))
    await etcd.put(f"dynamod/{stack}/shards/{node}/worker@0", json.dumps({"applied_version": 1}))
    return lease, key


async def test_a_lost_node_forgotten_leaves_nothing_and_is_no_longer_pinged_nor_waited_for(
    etcd: EtcdClient, stack: str
) -> None:
    leader, other = _member(etcd, stack, "head"), _member(etcd, stack, "n1")
    echo = Responder("127.0.0.1")
    try:
        n2_lease = await _up(etcd, stack, "n2", echo.port)
        await _up(etcd, stack, "n1")
        _, n2_key = await _worker_records(etcd, stack, "n2")
        n1_lease, n1_key = await _worker_records(etcd, stack, "n1")
        await leader.read()
        await other.read()
        assert {"n1", "n2"} <= leader.seen and "n2" in other.seen
        await etcd.lease_revoke(n2_lease)  # its lease expired: the leader marks it lost
        await leader.read()
        await other.read()
        assert set(leader.lost) == {"n2"} and leader.lost["n2"].heard_at == ("127.0.0.1", echo.port)
        assert "n2" in leader._heard_by_me()
        assert leader._state_of("n2") == "lost" and other._state_of("n2") == "lost"

        done = await other.forget("n2")

        assert done["state"] == "forgotten" and done["was_lost"] and done["node"] == "n2"
        assert done["lease_records"] == ["worker@0"] and done["ledger_records"] == ["worker@0"]
        assert list(done["revoked"].values()) == [1] and done["revoke_error"] is None
        assert await etcd.get(n2_key) is None, "its worker's Dynamo lease was revoked"
        assert await etcd.get_kv(registry.lost_key(stack, "n2")) is None
        kv = await etcd.get_kv(registry.forgotten_key(stack, "n2"))
        assert kv is not None and registry.ForgottenRecord.decode(kv.value).by == "n1"
        assert await etcd.get_prefix(lease_key(stack, "n2", "")) == []
        assert await etcd.get_prefix(f"dynamod/{stack}/shards/n2/") == []
        # another node's records and leases are untouched
        assert await etcd.get(n1_key) is not None
        assert await etcd.get(lease_key(stack, "n1", "worker@0")) is not None
        assert await etcd.get(f"dynamod/{stack}/shards/n1/worker@0") is not None
        assert (await etcd.lease_time_to_live(n1_lease)) is not None
        host_events = other.host.events.emitted  # type: ignore[union-attr]
        assert [kind for kind, _ in host_events] == ["cluster.node_forgotten"]
        # the leader, at its next read: not pinged, not lost, not waited for
        await leader.read()
        assert leader.lost == {} and "n2" not in leader.seen and leader.unseen() == []
        assert "n2" not in leader._heard_by_me()
        rows = {n["name"]: n for n in leader.view()["nodes"]}
        assert rows["n2"]["state"] == "forgotten" and rows["n2"]["forgotten"]["by"] == "n1"
        # `down --cluster` names it as forgotten where it says why a node was not asked
        assert ClusterShutdown(leader, wait_s=1)._state("n2") == "forgotten"
        # forgotten twice: nothing left to remove, and said so
        again = await leader.forget("n2")
        assert not again["was_lost"] and again["lease_records"] == [] and again["revoked"] == {}
    finally:
        echo.close()


async def test_a_node_that_is_up_this_node_and_an_unknown_name_are_refused(
    etcd: EtcdClient, stack: str
) -> None:
    leader = _member(etcd, stack, "head")
    await _up(etcd, stack, "n1")
    await _worker_records(etcd, stack, "n1")
    before = await etcd.get_prefix(f"dynamod/{stack}/")
    with pytest.raises(ForgetRefused, match="node n1 is up"):
        await leader.forget("n1")
    with pytest.raises(ForgetRefused, match="is this node"):
        await leader.forget("head")
    with pytest.raises(ForgetRefused, match="no node 'n9' in stack"):
        await leader.forget("n9")
    after = await etcd.get_prefix(f"dynamod/{stack}/")
    assert [(kv.key, kv.value) for kv in after] == [(kv.key, kv.value) for kv in before]


async def test_a_marking_that_waited_does_not_bring_a_forgotten_node_back_as_lost(
    etcd: EtcdClient, stack: str
) -> None:
    """The leader deferred n2's marking (its own calls had failed); an operator forgot n2
    meanwhile: the marking, when the leader may judge again, leaves it forgotten."""
    leader = _member(etcd, stack, "head")
    n2_lease = await _up(etcd, stack, "n2")
    await leader.read()
    await etcd.lease_revoke(n2_lease)
    leader.trouble_at = 1e18  # its own last call failed just now: it may not judge yet
    await leader.read()
    assert "n2" in leader._unmarked and leader.lost == {}
    await leader.forget("n2")
    leader.trouble_at = None
    await leader.read()
    assert leader._unmarked == {} and leader.lost == {}
    assert await etcd.get_kv(registry.lost_key(stack, "n2")) is None
    assert leader._state_of("n2") == "forgotten"


def _new_run(etcd: EtcdClient, stack: str, node: str) -> Membership:
    """`node`'s daemon as `dynamod up` on a new machine under its name starts it: no unit
    yet, never published."""
    member = _member(etcd, stack, node)
    member.host = SimpleNamespace(  # type: ignore[assignment]
        phase=Phase.UP, stack=SimpleNamespace(name=stack, tables={}), events=Events(),
        engine=SimpleNamespace(units={}), run_id="new-machine", state_dir=f"/srv/{node}",
    )  # fmt: skip
    return member


@pytest.mark.parametrize("forgotten", [True, False], ids=["forgotten", "only-lost"])
async def test_a_new_run_s_first_publish_clears_the_lost_and_forgotten_records(
    etcd: EtcdClient, stack: str, forgotten: bool
) -> None:
    """A machine replaced under a lost name (forgotten by an operator, or not): its
    daemon's first publish, one transaction, deletes the earlier run's lost record and the
    forgotten one; the node is up to every daemon, and only a forgotten node's return is
    logged as such."""
    leader = _member(etcd, stack, "head")
    await etcd.put(registry.lost_key(stack, "n2"), LostRecord("n2", 1.0, "head", [], []).encode())
    await leader.read()
    if forgotten:
        await leader.forget("n2")
        assert leader._state_of("n2") == "forgotten"
    else:
        assert leader._state_of("n2") == "lost"
    n2 = _new_run(etcd, stack, "n2")
    try:
        with capture_logs() as logs:
            await n2._publish()
        await leader.read()
        assert await etcd.get_kv(registry.lost_key(stack, "n2")) is None
        assert await etcd.get_kv(registry.forgotten_key(stack, "n2")) is None
        assert leader._state_of("n2") == "up" and "n2" in leader.seen
        back = [e for e in logs if e["event"] == "cluster.back_after_forgotten"]
        assert len(back) == forgotten
        header = await etcd.get_kv(registry.node_key(stack, "n2"))
        assert header is not None and header.lease == n2.lease
    finally:
        if n2.lease is not None:
            await etcd.lease_revoke(n2.lease)
