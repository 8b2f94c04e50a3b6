"""The replicated, authenticated stock cluster stack (units/stacks/cluster-ha.toml) on three
simulated nodes (network namespaces), each with its own dynamod: a 3-member etcd (TLS with
client certificates, auth with a role limited to the stack's prefixes), NATS servers joined
by authenticated routes, and Dynamo units that get their credentials in their environment
only and reach etcd through their node's relay. Under load from inside the head, the head's
etcd member is stopped and held down (killed, its client port taken by a socket that resets
every connection, so dynamod's restarts fail until it is released): serving goes on, no
frontend is restarted, and a policy push commits through the other two members and reaches
every node's shard; released, the member comes back and serves the version written while
it was away. Everything is removed at the end, namespaces included. Skipped, with the
reason, only where network namespaces cannot be made."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamod.chaos.cluster import ClusterError, ClusterRig, running_cluster
from dynamod.chaos.model import Load
from dynamod.chaos.netns import can_create_namespaces
from dynamod.chaos.node_loss import make_checkpoint
from dynamod.cluster.secrets import load_etcd_auth
from dynamod.core import paths
from tests.conftest import wait_dead

REASON = can_create_namespaces()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
    pytest.mark.xdist_group("netns"),  # one simulated cluster at a time (make test runs -n 2)
]

STACK = paths.units_dir() / "stacks" / "cluster-ha.toml"
RELAY = "https://127.0.0.1:23790"  # each node's etcd relay, where its Dynamo units connect
SECRET_FIELDS = ("etcd_root_password", "etcd_password", "nats_password", "nats_route_password")


@pytest.fixture(scope="module")
def rig() -> Iterator[ClusterRig]:
    with running_cluster(3, stack=STACK, variables={"workers": "1", "trainer_steps": "0"},
                         timeout=180) as cluster:  # fmt: skip
        yield cluster


def _nodes(rig: ClusterRig) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in rig.status("head")["cluster"]["nodes"]}


def _shard_versions(rig: ClusterRig) -> dict[str, list[int | None]]:
    return {
        name: [u["policy_version"] for u in entry["units"] if u["shard"]]
        for name, entry in _nodes(rig).items()
    }


def _wait_serving(rig: ClusterRig) -> None:
    seen: list[Any] = []

    def serving() -> bool:
        states = {name: entry["state"] for name, entry in _nodes(rig).items()}
        seen[:] = [states]
        routed = rig.routed()
        seen.append(len(routed))
        return all(s == "up" for s in states.values()) and len(routed) >= 3

    try:
        rig.wait("3 nodes up, 3 shards routed", serving, 60)
    except ClusterError as exc:
        raise AssertionError(f"{exc}; seen: {seen}; logs under {rig.work_dir}") from None


def _frontend_restarts(rig: ClusterRig) -> dict[str, int]:
    """How often each node's frontend has been restarted (nodes that run one)."""
    return {
        f"{node}/{u['name']}": u["restarts"]
        for node in rig.names
        for u in rig.status(node)["units"]
        if u["name"] == "frontend"
    }


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def test_every_node_runs_a_member_and_dynamo_gets_credentials_in_its_environment_only(
    rig: ClusterRig,
) -> None:
    _wait_serving(rig)
    # each node holds its identity although its user may read only its stack's own keys
    # (a look at every stack's was refused whole, and no node held it)
    rig.wait("every node holds its identity",
             lambda: all(rig.status(n)["identity"]["held"] for n in rig.names), 15)  # fmt: skip
    assert not any(rig.status(n)["identity"]["others_visible"] for n in rig.names)
    human = rig.run("n1", "status").stdout  # and the human status says what that hides
    assert "daemons are hidden from this stack's etcd user" in human, human
    # and each node's start-up sweep ran before its worker started (it never found a window:
    # the units' readiness came before auth was on, the workers after a oneshot)
    swept = rig.logged("dynamo.swept", "dynamo.stale_revoked")
    assert not rig.logged("dynamo.sweep_given_up") and len(swept) >= 3, swept
    assert all(not r.get("leases") for r in swept), swept  # a fresh cluster: nothing stale
    creds = json.loads((rig.work_dir / "cluster-ha.secrets" / "credentials.json").read_text())
    secrets = [creds[f] for f in SECRET_FIELDS]
    for node in rig.names:
        units = {u["name"]: u for u in rig.status(node)["units"]}
        assert units["etcd"]["pid"] is not None and units["nats"]["pid"] is not None, node
        assert units["etcd-login"]["state"] == "completed", units["etcd-login"]
        worker = units["worker@0"]
        env = _environ(worker["pid"])
        assert env["ETCD_AUTH_CLIENT_CERT"].startswith("-----BEGIN CERTIFICATE-----"), node
        assert env["NATS_AUTH_PASSWORD"] == creds["nats_password"], node
        # Dynamo reaches etcd through the node's relay, to whichever member is there
        assert env["ETCD_ENDPOINTS"] == RELAY, env["ETCD_ENDPOINTS"]
        assert units["etcd-relay"]["state"] == "ready", units["etcd-relay"]
        cmdline = Path(f"/proc/{worker['pid']}/cmdline").read_bytes().decode(errors="replace")
        shown = rig.run(node, "status", "--json").stdout
        assert shown and not [s for s in secrets if s in shown or s in cmdline], node


def test_the_heads_etcd_member_down_under_load_serving_goes_on_and_a_push_commits(
    rig: ClusterRig, tmp_path: Path
) -> None:
    _wait_serving(rig)
    ckpt = make_checkpoint(rig, tmp_path / "step-1", 1.01)
    current: list[int | None] = [rig.status("head").get("policy", {}).get("current")]
    restarts_before = _frontend_restarts(rig)
    assert "head/frontend" in restarts_before, restarts_before
    load = Load(clients=3, rate=6, trainer_fraction=0.5, max_tokens=4, request_timeout=10)
    gen = rig.load(load, "tiny-cpu", lambda: current[0])
    gen.start()
    pushed: dict[str, Any] = {}
    try:
        time.sleep(2.0)  # steady state first
        down_at = time.monotonic() - gen.origin
        # The client port: a half-open member (it accepts, then resets every connection).
        # Dynamo reaches etcd through the node's relay, which passes over such a member;
        # given the members' list itself, Dynamo 1.6.1's frontend kept reconnecting, and a
        # watch it resynced just before a reconnect went silent: it never saw the new
        # taints and the push failed, truthfully, on its route check (CI's failure, and 4 of
        # 32 runs here; also with the member's peer port held, so that clients were refused).
        hold = rig.hold_down("head", "etcd", "client")
        try:
            time.sleep(1.5)  # past the 3-member cluster's election (~1.2 s after its leader)
            push_started = time.monotonic() - gen.origin
            done = rig.run("head", "policy", "push", "--step", "1", "--path", str(ckpt),
                           "--json", timeout=120)  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
            pushed = json.loads(done.stdout)
            current[0] = 1
            push_done = time.monotonic() - gen.origin
            time.sleep(2.0)  # serving at the new version, the member still down
            member = next(u for u in rig.status("head")["units"] if u["name"] == "etcd")
        finally:
            hold.release()
        back_at = time.monotonic() - gen.origin
        rig.wait("every node's shard at version 1",
                 lambda: _shard_versions(rig) == {"head": [1], "n1": [1], "n2": [1]}, 30)
        rig.wait("the head's member back and serving the version written while it was away",
                 lambda: (units := {u["name"]: u for u in rig.status("head")["units"]})
                 and units["etcd"]["state"] == "ready"
                 and json.loads(rig.run("head", "policy", "status", "--json").stdout)["current"]
                 == 1, 30)  # fmt: skip
        time.sleep(1.0)  # serving with the member back: the load's last measured phase
    finally:
        gen.stop()
    requests = list(gen.requests)
    during = [q for q in requests if down_at <= q.sent < back_at]

    def refused_by_design(q: Any) -> bool:  # required the outgoing version during the push
        return (q.required is not None and q.required < 1
                and q.sent <= push_done and q.done >= push_started)  # fmt: skip

    # The bound: no worker was lost, so nothing had to be re-routed: 0 failed requests that
    # require the current version from the stop to the end, apart from those the router
    # refuses by design at the version a push is replacing while that push is under way.
    failed = [q for q in requests if q.sent >= down_at and not q.ok and not refused_by_design(q)]
    refused = sum(map(refused_by_design, requests))
    served = sum(q.ok for q in during)
    print(f"head's etcd member down {back_at - down_at:.1f}s ({member['state']}: "
          f"{member['detail']}; {hold.resets} connections reset); push "
          f"{push_started:.2f}-{push_done:.2f}s; {len(during)} requests meanwhile, "
          f"{served} ok, {len(failed)} failed; {refused} refused by design")  # fmt: skip
    shown = [(round(q.sent, 2), round(q.done, 2), q.required, q.status, q.error)
             for q in during if not q.ok]  # fmt: skip
    assert member["state"] != "ready", f"the head's etcd member must stay down: {member}"
    assert pushed["ok"] and pushed["version"] == 1, pushed
    assert pushed["nodes"] == {"n1": {"n1/worker@0": 1}, "n2": {"n2/worker@0": 1}}, "\n".join(
        [json.dumps({k: v for k, v in pushed.items() if k != "acks"})]
        + [json.dumps(r) for r in _etcd_trouble(rig)])  # a str, not cut; the rig's digest below
    assert pushed["behind"] == [], pushed
    assert served >= 10, f"serving must go on while the member is down: {shown}"
    assert not failed, [(q.sent, q.status, q.error) for q in failed[:5]]
    # A frontend still serving must not be killed for its etcd watch failing over (its
    # liveness probe is /live, which does not ask etcd).
    assert _frontend_restarts(rig) == restarts_before, rig.logged("unit.state")[-20:]
    lost = rig.logged("cluster.node_lost")
    assert not lost, "\n".join(  # the nodes' own warnings and loop stalls: the rig's digest
        ["no node may be marked lost while only an etcd member is down:"]
        + [json.dumps(r) for r in _etcd_trouble(rig)])


def test_the_head_s_dynamod_killed_and_started_again_revokes_its_earlier_worker_s_lease(
    rig: ClusterRig,
) -> None:
    """The head's dynamod SIGKILLed: its etcd member, the frontend and its worker die with
    it. Another node leads (the deputy takes over where the head led; under etcd's auth the
    first leader is whichever node reached etcd first once the head turned auth on, so it is
    not always the head), marks it lost and takes its shard out of routing, leaving the
    worker's lease (Dynamo's, 300 s here). Started again (its auth oneshot runs again
    against the auth it turned on), before its new worker starts, its sweep, which under
    etcd's auth sees its own stack's lease records only, revokes the lease the earlier
    worker held, so that worker's keys (its model card) do not stay for the rest of the
    lease; the other nodes' shards are left alone."""
    _wait_serving(rig)
    status = rig.status("head")
    led = status["cluster"]["leader"]
    old = rig.instance_ids("head")
    others = rig.instance_ids("n1") | rig.instance_ids("n2")
    assert old and old & _leases_under_v1(rig, "n1"), (old, "the head's worker holds keys")
    pids = [u["pid"] for u in status["units"] if u["pid"]]
    log_from = len(rig.records("head"))
    os.kill(status["daemon_pid"], signal.SIGKILL)
    assert wait_dead([status["daemon_pid"], *pids], timeout=15) == []

    def lost_to_n1() -> str | None:
        view = rig.status("n1")["cluster"]
        states = {n["name"]: n["state"] for n in view["nodes"]}
        leader: str | None = view["leader"]
        return leader if leader in ("n1", "n2") and states["head"] == "lost" else None

    rig.wait(f"another node leading (the head's view: {led} led), the head lost in n1's view",
             lost_to_n1, 30)  # fmt: skip
    assert old <= _leases_under_v1(rig, "n1"), "the routes are withdrawn, not the lease"
    rig.up(["head"], timeout=180)
    _wait_serving(rig)
    events = [r for r in rig.records("head")[log_from:]
              if r.get("event") in ("dynamo.swept", "dynamo.stale_revoked",
                                    "dynamo.sweep_given_up", "unit.state")]  # fmt: skip
    swept = [r for r in events if r["event"] in ("dynamo.swept", "dynamo.stale_revoked")]
    assert len(swept) == 1 and swept[0]["event"] == "dynamo.stale_revoked", events
    assert {int(x, 16) for x in swept[0]["leases"]} == old, swept
    started = next(i for i, r in enumerate(events)
                   if r["event"] == "unit.state" and r["unit"] == "worker@0")  # fmt: skip
    assert events.index(swept[0]) < started, "swept before the new worker started"
    new = rig.instance_ids("head")
    leases = _leases_under_v1(rig, "head")
    assert new and new <= rig.routed() and new <= leases, (new, leases)
    assert not old & leases, f"the earlier worker's keys stayed: {old & leases}"
    assert others <= leases and others <= rig.routed(), "other nodes' shards left alone"


def _leases_under_v1(rig: ClusterRig, node: str) -> set[int]:
    """The leases that hold Dynamo's keys, read as the stack's user through the node's
    relay, as Dynamo reads them."""
    return rig.dynamo_leases(node, RELAY, load_etcd_auth(rig.work_dir / "cluster-ha.secrets", node))


# etcd's own account of a stall (the members log at warn): slow applies, ReadIndex retries,
# an overloaded leader, lost peers
_ETCD_NOISE = ("request stats", "rejected connection", "simple token is not cryptographically")


def _etcd_trouble(rig: ClusterRig) -> list[dict[str, Any]]:
    """The etcd members' warnings (from each node's etcd unit log), for a failure's message:
    what the surviving members went through meanwhile."""
    records = []
    for node in rig.names:
        for r in rig.records(node, "logs/etcd.log"):
            msg = str(r.get("msg", ""))
            if msg.startswith(_ETCD_NOISE):
                continue
            if r.get("level") in ("warn", "error"):
                keep = ("logged_by", "ts", "level", "msg", "took", "expected-duration", "error")
                records.append({k: r[k] for k in keep if k in r}
                               | {"request": str(r.get("request", ""))[:120]})  # fmt: skip
    return sorted(records, key=lambda r: str(r.get("ts")))[-40:]
