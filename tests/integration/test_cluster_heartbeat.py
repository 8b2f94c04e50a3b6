"""The leader's heartbeats against a real etcd, over real UDP on loopback: a node that fell
silent has its registry lease revoked (its entry deleted, as at an expiry) well before
that lease would run out, with why; a node that answers keeps it; when most of the
cluster falls silent at once, the leases decide. The whole path through a cut network
namespace is tests/integration/test_cluster.py's loss round and bench/fleet.py's cut."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from dynamod.cluster import heartbeat, membership, registry
from dynamod.cluster.heartbeat import Responder
from dynamod.cluster.membership import Membership
from dynamod.cluster.registry import NodeEntry
from dynamod.core.phase import Phase
from dynamod.core.placement import ClusterSpec
from dynamod.rollout.etcd import EtcdClient

LEASE_S = 30  # far longer than the test: only a revocation can delete an entry in time
TIMEOUT_S = 0.6


@dataclass
class Node:
    name: str
    lease: int
    responder: Responder | None


def _entry(name: str, port: int | None) -> NodeEntry:
    return NodeEntry(node=name, address="127.0.0.1", daemon_pid=1, run_id="r", phase="up",
                     head=False, units=[], heartbeat_port=port)  # fmt: skip


def _member(etcd: EtcdClient, stack: str, node: str, leader: str) -> Membership:
    """`node`'s membership (no loops but the heartbeat's) with `leader` the leader, its
    etcd the real one."""
    nodes = {"head": "127.0.0.1", "n1": "127.0.0.1", "n2": "127.0.0.1", "n3": "127.0.0.1"}
    spec = ClusterSpec(nodes=nodes, head="head", node=node, registry=["http://127.0.0.1:1"],
                       heartbeat_timeout=TIMEOUT_S)  # fmt: skip
    member = Membership(spec, registrations=Any, policy=None)  # type: ignore[arg-type]
    member.host = SimpleNamespace(phase=Phase.UP, stack=SimpleNamespace(name=stack))  # type: ignore[assignment]
    member.etcd, member.leader = etcd, leader
    return member


@pytest.fixture
async def leader(etcd: EtcdClient, request: pytest.FixtureRequest) -> AsyncIterator[Membership]:
    """The leader's membership."""
    member = _member(etcd, f"hb{abs(hash(request.node.name)) % 10**8}", "head", "head")
    yield member
    member._stopping = True
    member._hearing.close()


async def _nodes(member: Membership, etcd: EtcdClient, names: list[str]) -> list[Node]:
    """Each a registry entry on a lease of its own, and an echo on loopback."""
    nodes = []
    for name in names:
        echo = Responder("127.0.0.1")
        lease = await etcd.lease_grant(LEASE_S)
        await etcd.put(registry.node_key(member.stack, name), "{}", lease)
        member.entries[name] = _entry(name, echo.port)
        nodes.append(Node(name, lease, echo))
    return nodes


async def _judging(member: Membership, seconds: float) -> None:
    task = asyncio.create_task(member._heartbeat_loop())
    try:
        await asyncio.sleep(seconds)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _hang_up(*nodes: Node) -> None:
    """Close the echoes still open (a test's end)."""
    for node in nodes:
        if node.responder is not None:
            _silence(node)


def _silence(node: Node) -> None:
    assert node.responder is not None
    node.responder.close()
    node.responder = None


async def test_a_silent_node_loses_its_lease_and_one_that_answers_keeps_it(
    leader: Membership, etcd: EtcdClient
) -> None:
    quiet, talking = await _nodes(leader, etcd, ["n1", "n2"])
    try:
        await _judging(leader, 0.5)  # both answer: armed
        assert leader._hearing.pinger is not None
        assert set(leader._hearing.pinger.heard().answered) == {"n1", "n2"}
        _silence(quiet)
        silenced = time.monotonic()
        task = asyncio.create_task(_judging(leader, 3.0))
        while await etcd.get_kv(registry.node_key(leader.stack, "n1")) is not None:
            assert time.monotonic() - silenced < 3.0, "n1's entry outlived its silence"
            await asyncio.sleep(0.05)
        gone_s = time.monotonic() - silenced
        await task
        # not before the timeout (its last answer came up to one ping before the silence)
        assert TIMEOUT_S - heartbeat.PING_S - 0.05 <= gone_s < LEASE_S / 2, gone_s
        assert (await etcd.lease_time_to_live(quiet.lease)) is None, "its lease was revoked"
        assert "heartbeat" in leader._hearing.why_lost["n1"], leader._hearing.why_lost
        assert await etcd.get_kv(registry.node_key(leader.stack, "n2")) is not None
        assert "n1" in leader._hearing.silenced  # not judged again before it answers again
    finally:
        _hang_up(quiet, talking)


async def test_most_of_the_cluster_silent_at_once_keeps_its_leases(
    leader: Membership, etcd: EtcdClient
) -> None:
    nodes = await _nodes(leader, etcd, ["n1", "n2", "n3"])
    try:
        await _judging(leader, 0.5)
        for node in nodes[:2]:  # two of three, at once: more likely the leader's own link
            assert node.responder is not None
            node.responder._stop.set()  # no answer from either after this
        _silence(nodes[0])
        _silence(nodes[1])
        await _judging(leader, 1.5)
        for node in nodes:
            key = registry.node_key(leader.stack, node.name)
            assert await etcd.get_kv(key) is not None, node.name
        assert not leader._hearing.why_lost
        assert leader._hearing.withheld == {"n1", "n2"}  # logged, with why, once each
    finally:
        _hang_up(*nodes)


async def test_nodes_falling_silent_in_a_cluster_down_are_not_lost(
    leader: Membership, etcd: EtcdClient
) -> None:
    (node,) = await _nodes(leader, etcd, ["n1"])
    try:
        await _judging(leader, 0.5)
        leader.down_request = {"id": "down-1", "step": "0", "nodes": ["n1"]}  # newer than it
        _silence(node)  # n1 stopping in its tier
        await _judging(leader, 1.5)
        assert await etcd.get_kv(registry.node_key(leader.stack, "n1")) is not None
        assert not leader._hearing.why_lost
    finally:
        _hang_up(node)


async def test_a_node_without_a_heartbeat_port_is_left_to_its_lease(
    leader: Membership, etcd: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(membership, "HEARTBEAT_LOOK_S", 0.05)
    (node,) = await _nodes(leader, etcd, ["n1"])
    leader.entries["n1"] = _entry("n1", None)  # an older daemon, or one that could not bind
    try:
        await _judging(leader, 1.5)
        assert await etcd.get_kv(registry.node_key(leader.stack, "n1")) is not None
        assert leader._hearing.pinger is None  # no one to ping
    finally:
        _hang_up(node)


async def test_the_deputy_hears_the_leader_and_revokes_its_lease_when_it_falls_silent(
    etcd: EtcdClient,
) -> None:
    """No one else pings the leader: the first other node by name (the deputy) does, and a
    silent leader loses its lease (its entry, and the leader key on the same lease) as a
    node does to the leader; the deputy takes the leader key. The other nodes ping no
    one."""
    stack = f"hbdeputy{time.monotonic_ns() % 10**6}"
    deputy, bystander = _member(etcd, stack, "n1", "head"), _member(etcd, stack, "n2", "head")
    deputy.lease = await etcd.lease_grant(LEASE_S)  # its own registry lease
    echo = Responder("127.0.0.1")
    lease = await etcd.lease_grant(LEASE_S)
    await etcd.put(registry.node_key(stack, "head"), "{}", lease)
    await etcd.put(registry.leader_key(stack), "head", lease)
    for member in (deputy, bystander):
        member.entries = {"head": _entry("head", echo.port), "n1": _entry("n1", 1),
                          "n2": _entry("n2", 2)}  # fmt: skip
    try:
        assert deputy._heard_by_me() == {"head": ("127.0.0.1", echo.port)}
        assert bystander._heard_by_me() == {}
        await asyncio.gather(_judging(deputy, 0.5), _judging(bystander, 0.5))
        assert deputy._hearing.pinger is not None and bystander._hearing.pinger is None
        _, revision = await etcd.get_prefix_at(registry.leader_key(stack))
        echo.close()
        await _judging(deputy, 1.5)
        assert await etcd.get_kv(registry.node_key(stack, "head")) is None
        # the deputy took the leader key, so its own read marks the old leader lost, with why
        taken = await etcd.get_kv(registry.leader_key(stack))
        assert taken is not None and taken.value == b"n1" and taken.lease == deputy.lease
        # taken over before the revocation: never free for another node to take first
        changes = []
        key = registry.leader_key(stack)
        async for event in etcd.watch_prefix(key, start_revision=revision + 1):
            changes.append(event.kind)
            if event.mod_revision >= taken.mod_revision:
                break
        assert changes == ["put"], changes
        assert deputy.leader == "n1"
        assert "heartbeat" in deputy._hearing.why_lost["head"]
    finally:
        echo.close()
        for member in (deputy, bystander):
            member._hearing.close()


async def test_a_leader_whose_last_registry_call_failed_judges_again_at_its_next_renewal(
    leader: Membership, etcd: EtcdClient
) -> None:
    """Withheld while its own last registry call failed (a daemon cut off from etcd may be
    cut off from the nodes too); judged at the first renewal after it, not a whole lease
    later: an etcd electing a leader after a cut of the node that held it fails every
    call for a second or two, and the node's loss then waits for the election alone."""
    leader.cluster = leader.cluster.model_copy(update={"lease_ttl": 30.0})
    quiet, talking = await _nodes(leader, etcd, ["n1", "n2"])
    try:
        await _judging(leader, 0.5)
        leader.trouble_at, leader.renewed_at = time.monotonic(), None  # e.g. an election
        _silence(quiet)
        await _judging(leader, 1.5)
        assert await etcd.get_kv(registry.node_key(leader.stack, "n1")) is not None
        assert leader._hearing.withheld == {"n1"}
        leader.renewed_at = time.monotonic()  # the next keepalive went through
        await _judging(leader, 0.5)
        assert await etcd.get_kv(registry.node_key(leader.stack, "n1")) is None
        assert await etcd.get_kv(registry.node_key(leader.stack, "n2")) is not None
    finally:
        _hang_up(quiet, talking)


async def test_a_revocation_that_failed_is_tried_again_until_etcd_takes_it(
    leader: Membership, etcd: EtcdClient
) -> None:
    """A failed revocation (etcd electing a leader, or out of reach for a moment) leaves
    the silent node judged: tried again at the next look, logged once, and its lost
    record still says why."""
    quiet, talking = await _nodes(leader, etcd, ["n1", "n2"])
    down = EtcdClient("http://127.0.0.1:1", timeout_s=0.2)  # nothing listens there
    try:
        await _judging(leader, 0.5)
        _silence(quiet)
        leader.etcd = down
        await _judging(leader, 1.5)
        assert leader._hearing.waiting == {"n1"} and "n1" not in leader._hearing.silenced
        leader.etcd = etcd
        await _judging(leader, 0.5)
        assert await etcd.get_kv(registry.node_key(leader.stack, "n1")) is None
        assert "heartbeat" in leader._hearing.why_lost["n1"]
        assert "n1" in leader._hearing.silenced and not leader._hearing.waiting
    finally:
        await down.close()
        _hang_up(quiet, talking)


async def test_a_node_the_leader_revoked_is_marked_lost_while_its_calls_failed(
    leader: Membership, etcd: EtcdClient
) -> None:
    """An entry that vanished while the leader's own calls failed waits a whole lease
    (an etcd outage expires every entry at once) unless the leader revoked it itself."""
    leader.trouble_at = time.monotonic()
    leader._hearing.why_lost["n1"] = "silent for 1.3s (heartbeat)"
    leader._unmarked = {"n1": _entry("n1", 1), "n2": _entry("n2", 2)}  # both vanished
    await leader._judge({})
    assert "heartbeat" in leader.lost["n1"].why
    assert "n2" not in leader.lost and leader._deferred == {"n2"}
    assert "n1" not in leader._hearing.why_lost  # said once, in its record


async def test_a_daemon_back_in_contact_reads_and_watches_the_registry_anew(
    leader: Membership,
) -> None:
    """A renewal after a failure re-reads the registry whole (the failure may have moved
    the watch to a member that is cut off); one in contact all along leaves the watch."""
    leader._failed("keepalive", TimeoutError("no answer within 0.5 s"))
    leader._resync.clear()
    leader._reachable("keepalive")
    assert leader._resync.is_set() and leader.error is None
    leader._resync.clear()
    leader._reachable("keepalive")
    assert not leader._resync.is_set()


async def test_a_node_that_hears_the_cluster_again_while_its_calls_fail_reconnects(
    leader: Membership,
) -> None:
    """A ping after a silence while this daemon's registry calls fail: its link is back,
    and every etcd connection of the process is opened afresh, once per return."""
    from dynamod.rollout.etcd import connection

    echo = Responder("127.0.0.1")
    leader._hearing.responder = echo
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sender.settimeout(2)
    try:
        sender.sendto(heartbeat.datagram(leader.stack, "n1", 1), ("127.0.0.1", echo.port))
        sender.recvfrom(heartbeat.MAX_DATAGRAM)  # echoed: heard
        before = connection.generation()
        leader._reconnect_if_back()
        assert connection.generation() == before  # its calls go through: nothing to do
        leader.error = "registry ... keepalive: EtcdError: ... no answer within 0.5 s"
        leader._reconnect_if_back()
        assert connection.generation() == before + 1
        leader._reconnect_if_back()
        assert connection.generation() == before + 1  # once per return
    finally:
        sender.close()


async def test_the_leader_still_pings_a_lost_node_where_it_last_answered(
    leader: Membership,
) -> None:
    """Its pings after a heal are how a cut node learns that its link is back."""
    leader.entries = {"head": _entry("head", 4000), "n1": _entry("n1", 4001),
                      "n2": _entry("n2", 4002)}  # fmt: skip
    assert leader._heard_by_me() == {"n1": ("127.0.0.1", 4001), "n2": ("127.0.0.1", 4002)}
    del leader.entries["n1"]  # its entry went
    assert leader._heard_by_me() == {"n2": ("127.0.0.1", 4002)}  # not lost: stopped
    leader.lost = {"n1": registry.LostRecord(node="n1", since=0.0, by="head", shards=[],
                                             revoked=[], address="127.0.0.1",
                                             heartbeat_port=4001)}  # fmt: skip
    assert leader._heard_by_me() == {"n1": ("127.0.0.1", 4001), "n2": ("127.0.0.1", 4002)}
    leader.leader = "n2"  # no longer the leader: as the deputy, it pings the leader alone
    assert leader._heard_by_me() == {"n2": ("127.0.0.1", 4002)}


async def test_a_leader_that_never_saw_a_lost_nodes_entry_pings_it_where_its_record_says(
    leader: Membership,
) -> None:
    """A leader that restarted or took over after the loss has only the lost record: the
    record keeps where the node's daemon echoed, or its return would wait on TCP again."""
    leader.entries = {"head": _entry("head", 4000), "n2": _entry("n2", 4002)}
    old = registry.LostRecord(node="n1", since=0.0, by="head", shards=[], revoked=[])
    leader.lost = {"n1": old}  # written before records kept the port: nowhere to ping
    assert leader._heard_by_me() == {"n2": ("127.0.0.1", 4002)}
    leader.lost = {"n1": registry.LostRecord(node="n1", since=0.0, by="head", shards=[],
                                             revoked=[], address="127.0.0.9",
                                             heartbeat_port=4001)}  # fmt: skip
    assert leader._heard_by_me() == {"n1": ("127.0.0.9", 4001), "n2": ("127.0.0.1", 4002)}


async def test_the_lost_record_keeps_where_the_node_echoed(
    leader: Membership, etcd: EtcdClient
) -> None:
    """`_mark_lost` writes the node's heartbeat address and port into its lost record, and
    another daemon reading the registry finds them there."""
    (node,) = await _nodes(leader, etcd, ["n1"])
    try:
        entry = leader.entries["n1"]
        await etcd.lease_revoke(node.lease)
        await leader._mark_lost("n1", entry)
        kv = await etcd.get_kv(registry.lost_key(leader.stack, "n1"))
        assert kv is not None
        record = registry.LostRecord.decode(kv.value)
        assert (record.address, record.heartbeat_port) == ("127.0.0.1", entry.heartbeat_port)
    finally:
        _hang_up(node)


async def test_a_lost_node_still_pinged_is_never_judged_nor_counted(
    leader: Membership, etcd: EtcdClient
) -> None:
    """A lost node is pinged only so that it hears its link is back: silent, it neither
    is judged nor counts toward "most of the cluster silent at once" when another node
    falls silent."""
    lost, quiet, talking = await _nodes(leader, etcd, ["n1", "n2", "n3"])
    try:
        await _judging(leader, 0.5)
        del leader.entries["n1"]  # its lease expired: lost, not judged by the heartbeats
        assert lost.responder is not None
        leader.lost = {"n1": registry.LostRecord(node="n1", since=0.0, by="head", shards=[],
                                                 revoked=[], address="127.0.0.1",
                                                 heartbeat_port=lost.responder.port)}  # fmt: skip
        _silence(lost)
        _silence(quiet)
        await _judging(leader, 1.5)
        assert "n1" in leader._heard_by_me()  # still pinged
        assert await etcd.get_kv(registry.node_key(leader.stack, "n2")) is None  # judged
        assert "n1" not in leader._hearing.why_lost and "n1" not in leader._hearing.silenced
        assert await etcd.get_kv(registry.node_key(leader.stack, "n3")) is not None
    finally:
        _hang_up(lost, quiet, talking)


def test_the_ping_period_leaves_three_pings_in_the_shortest_timeout() -> None:
    from dynamod.core.placement import MIN_HEARTBEAT_TIMEOUT

    assert round(MIN_HEARTBEAT_TIMEOUT / heartbeat.PING_S, 6) >= 3
