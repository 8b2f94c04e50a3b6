"""Three network namespaces as nodes, each with its own dynamod (its own state dir): the head
runs etcd, NATS, the frontend and one CPU shard; n1 and n2 one shard each. One shared
cluster for the checks, in order: bring-up and the status tree seen from a non-head node; a
second stack on the cluster's etcd and NATS kept apart from it (stack identity), and copies
claiming the cluster's identity refused; a worker node cut under load (detection,
re-routing, serving continues, a push commits meanwhile, only that node is marked lost); the
link healed (its shard gets its registration back and replays the pushed version, no
restart); the same node cut again and forgotten (`cluster forget`: not waited for by a push;
healed, it rejoins with its shard started again); one node's dynamod SIGKILLed and started
again without disturbing the others, its dead worker's lease revoked; one SIGKILLed while
its shard replays another node's push (not waited for; back at the pushed step); a node
started again by `up --join ADDR` alone; `down --cluster` leaves no process, cgroup or
namespace. Skipped, with the reason, only where network namespaces cannot be made."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dynamod.chaos.cluster import ClusterRig, running_cluster
from dynamod.chaos.model import Load
from dynamod.chaos.netns import can_create_namespaces
from dynamod.chaos.node_loss import NodeLossRound, make_checkpoint, run_round
from dynamod.cluster import registry
from dynamod.rollout.etcd import EtcdClient
from dynamod.rollout.etcd.records import KeyValue
from tests.conftest import Dynamod, unit_by_name, wait_dead
from tests.integration.policystack import frontend, model_dir, push, served_by
from tests.integration.rawstack import free_port

REASON = can_create_namespaces()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
    pytest.mark.xdist_group("netns"),  # one simulated cluster at a time (make test runs -n 2)
]

CGROUP_ROOT = Path("/sys/fs/cgroup/unified")


@pytest.fixture(scope="module")
def rig() -> Iterator[ClusterRig]:
    with running_cluster(3, variables={"workers": "1", "trainer_steps": "0"},
                         timeout=240) as cluster:  # fmt: skip
        yield cluster


@pytest.fixture(scope="module")
def loss_round(rig: ClusterRig, tmp_path_factory: pytest.TempPathFactory) -> NodeLossRound:
    ckpt = make_checkpoint(rig, tmp_path_factory.mktemp("ckpt") / "step-1", 1.01)
    load = Load(clients=3, rate=6, trainer_fraction=0.5, max_tokens=4, request_timeout=10)
    return run_round(rig, "n2", step=1, checkpoint=ckpt, load=load)


def _cluster(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in status["cluster"]["nodes"]}


def test_status_on_a_worker_node_shows_the_whole_cluster_tree(rig: ClusterRig) -> None:
    status = rig.status("n1")
    nodes = rig.wait("every node up in n1's view",
                     lambda: (c := _cluster(rig.status("n1")))
                     and all(n["state"] == "up" for n in c.values()) and c, 30)
    assert list(nodes) == ["head", "n1", "n2"]
    assert status["cluster"]["this_node"] == "n1" and status["cluster"]["head"] == "head"
    head_units = {u["name"] for u in nodes["head"]["units"]}
    assert {"etcd", "nats", "frontend", "worker@0"} <= head_units
    for name in ("n1", "n2"):
        assert [u["name"] for u in nodes[name]["units"] if u["shard"]] == ["worker@0"]
    # n1's own units: its worker, and the head's etcd as a stand-in probed over the link
    own = {u["name"]: u for u in status["units"]}
    assert own["etcd"]["state"] == "ready" and "on node head" in own["etcd"]["detail"]
    assert own["worker@0"]["pid"] is not None
    text = rig.run("n1", "status").stdout
    assert "cluster: this node n1, head head" in text
    assert "├─ head (head)" in text and "└─ n2" in text


def _shards(rig: ClusterRig) -> dict[str, tuple[int, int, int]]:
    """node -> its worker@0's (pid, restarts, policy version)."""
    out = {}
    for node in rig.names:
        shard = next(u for u in rig.status(node)["units"] if u["name"] == "worker@0")
        out[node] = (shard["pid"], shard["restarts"], shard["policy_version"])
    return out


def _local_on_the_cluster(rig: ClusterRig, stack_id: str, *extra: str) -> list[str]:
    """`up` of the stock single-node stack on the head's etcd and NATS."""
    head = rig.address("head")
    return ["up", "local", "--detach", "--var", f"etcd={head}:2379", "--var", f"nats={head}:4222",
            "--var", f"stack_id={stack_id}", "--var", "workers=1", "--var", "trainer_steps=0",
            *extra]  # fmt: skip


def test_a_registry_key_lost_some_other_way_is_put_back(rig: ClusterRig) -> None:
    """n1's entry is a header and one key per unit, kept by its lease and rewritten only
    when it changes; a key deleted or overwritten by something else (not its lease's
    expiry) is found by n1's next read and put back as it was, on n1's lease."""
    key = registry.unit_key("cluster", "n1", "worker@0")

    async def tamper() -> tuple[int, float, float]:
        async with EtcdClient(["http://127.0.0.1:2379"]) as etcd:
            kv = await etcd.get_kv(key)
            assert kv is not None and json.loads(kv.value)["name"] == "worker@0"
            await etcd.delete(key)
            gone_back = await _back(etcd, kv)
            await etcd.put(key, b'{"name": "worker@0", "forged": true}')  # no lease
            return kv.lease, gone_back, await _back(etcd, kv)

    lease, after_delete, after_put = rig.in_node("head", lambda: asyncio.run(tamper()))
    assert lease != 0 and after_delete < 5 and after_put < 5, (after_delete, after_put)
    n1 = _cluster(rig.status("head"))["n1"]
    assert n1["state"] == "up" and n1["lost"] is None, n1  # a unit key is not the node


async def _back(etcd: EtcdClient, kv: KeyValue) -> float:
    """Seconds until `kv` is in etcd again as it was, value and lease (at most 10)."""
    began = time.monotonic()
    while time.monotonic() - began < 10:
        now = await etcd.get_kv(kv.key)
        if now is not None and (now.value, now.lease) == (kv.value, kv.lease):
            return time.monotonic() - began
        await asyncio.sleep(0.05)
    return math.inf


def test_a_second_stack_on_the_cluster_s_etcd_stays_apart(rig: ClusterRig, tmp_path: Path) -> None:
    """Stack `beta` (the stock `local`, one worker) inside n1 on the head's etcd and NATS:
    each frontend is served by its own stack's workers, a push to beta leaves the
    cluster's ledger, beta's start-up sweep revokes none of the cluster's registrations,
    and copies that claim the cluster's identity (or namespace) are refused."""
    # every node's shard registered in the head's view: a node can be "up" there before its
    # shard's instance id is (one run took this snapshot with only the head's, and failed)
    def registered() -> set[int]:
        ids = [rig.instance_ids(n) for n in rig.names]
        return set().union(*ids) if all(ids) else set()

    cluster_ids: set[int] = rig.wait("every node's shard in the head's view", registered, 30)
    before, current = _shards(rig), rig.status("head")["policy"]["current"]
    beta = Dynamod(rig.work_dir / "beta")
    try:
        started = rig.run_inside("n1", beta.state_dir, *_local_on_the_cluster(rig, "beta"))
        assert started.returncode == 0, started.stdout + started.stderr[-3000:]
        status = beta.status()
        mine = {i for u in status["units"] if u.get("dynamo") for i in u["dynamo"]["instance_ids"]}
        assert len(mine) == 1 and not mine & cluster_ids
        assert unit_by_name(status, "worker@0")["dynamo"]["namespace"] == "beta"
        assert status["identity"]["held"] and status["identity"]["key"] == "dynamod/beta/daemon"
        for node in rig.names:  # the cluster's keys, beside beta's: held, nothing shared
            held = rig.status(node)["identity"]
            assert held["key"] == f"dynamod/cluster/daemon/{node}" and held["held"], held
            assert held["shared_namespaces"] == {}
        # beta's start-up sweep ran while the cluster served: every shard still routed
        assert cluster_ids <= rig.routed() and not mine & rig.routed()
        url, beta_url = rig.frontend_url(), frontend(status)
        served = rig.in_node("head", lambda: asyncio.run(served_by(url, 6)))
        assert set(served) <= cluster_ids, f"the cluster's frontend answered from {served}"
        served = rig.in_node("n1", lambda: asyncio.run(served_by(beta_url, 3)))
        assert set(served) <= mine, f"beta's frontend answered from {served}"
        step = tmp_path / "beta-1"  # the tiny model's own weights, as beta's version 1
        shutil.copytree(model_dir(status), step)
        pushed = push(beta, 1, step)
        assert pushed["ok"] and set(pushed["acks"]) == {"worker@0"}, pushed
        assert beta.status()["policy"]["current"] == 1
        ledger = json.loads(rig.run("head", "policy", "status", "--json").stdout)
        assert ledger["current"] == current != 1, ledger
        assert {s["policy_version"] for s in ledger["shards"]} == {current}, ledger
        _copies_are_refused(rig)
    finally:
        if (beta.state_dir / "dynamod.sock").exists():
            beta.run("down", timeout=120)
    assert _shards(rig) == before, "no cluster shard restarted, none moved version"
    assert cluster_ids <= rig.routed()


def _copies_are_refused(rig: ClusterRig) -> None:
    """`up` inside n2 of: the cluster's identity as a single-node stack; a second n2 of the
    cluster stack; another identity on the cluster's Dynamo namespace. Each: exit 2, one
    line naming the daemon that holds it, nothing started."""
    head, n2 = str(rig.state_dir("head")), str(rig.state_dir("n2"))  # the first key: head's
    cases = {  # what the line says, and whose state dir it names
        ("stack identity 'cluster' is held by a live daemon", head): _local_on_the_cluster(
            rig, "cluster"),
        ("stack identity 'cluster' is held by a live daemon: stack 'cluster' (identity "
         "'cluster' node n2)", n2): [
            "up", str(rig.stack_file), "--node", "n2", "--detach",
            *(a for k, v in rig.variables.items() for a in ("--var", f"{k}={v}"))],
        ("Dynamo namespace 'dynamod' is used by the workers of stack 'cluster'", head):
            _local_on_the_cluster(rig, "gamma", "--var", "namespace=dynamod"),
    }  # fmt: skip
    copies = {case: rig.work_dir / f"copy{i}" for i, case in enumerate(cases)}
    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            runs = {c: pool.submit(rig.run_inside, "n2", copies[c], *argv, timeout=120)
                    for c, argv in cases.items()}  # fmt: skip
        got = {case: _refused(run.result(), copies[case], *case) for case, run in runs.items()}
        wrong = [f"{expect!r} ({holder}): {why}" for (expect, holder), why in got.items() if why]
        assert not wrong, "\n".join(wrong)  # every case, not the first
    finally:
        for copy in copies.values():  # one that started after all is stopped here
            if (copy / "dynamod.sock").exists():
                Dynamod(copy).run("down", timeout=120)


def _refused(result: subprocess.CompletedProcess[str], copy: Path, expect: str, holder: str
             ) -> str | None:  # fmt: skip
    """None for a refusal as it should be, else what happened instead."""
    lines = result.stderr.strip().splitlines()
    started = [f.name for f in (copy / "dynamod.sock", copy / "daemon.log") if f.exists()]
    if (result.returncode, len(lines), started) != (2, 1, []) or not (
        expect in lines[0] and f"state dir {holder}" in lines[0] and "nothing was started"
        in lines[0]
    ):  # fmt: skip
        said = (result.stdout[-800:] + result.stderr[-800:]).strip()
        return f"exit {result.returncode}, started {started}: {said}"
    return None


def test_a_cut_node_is_marked_lost_and_routed_around_and_serving_continues(
    loss_round: NodeLossRound, rig: ClusterRig
) -> None:
    r = loss_round
    print(f"n2 cut: lost after {r.lost_s:.2f}s ({r.lost_why}), router dropped it after "
          f"{r.rerouted_s:.2f}s; "
          f"push {r.push_s:.2f}s; healed: admitted at v1 after {r.admitted_s:.2f}s; "
          f"{len(r.requests)} requests, {len(r.failed_during_cut())} failed before re-routing, "
          f"{len(r.refused_at_outgoing_version())} refused at the outgoing version")
    assert r.rerouted_s is not None and r.rerouted_s < 10  # the target (3 s) is bench/cluster.py's
    assert r.marked_lost == ["n2"], f"only the cut node is marked lost, once: {r.marked_lost}"
    assert r.lost_s is not None and r.lost_s < 10
    # the leader's heartbeats, or its lease's expiry where that came first
    assert "heartbeat" in r.lost_why or "lease expired" in r.lost_why, r.lost_why
    after = [q for q in r.requests if r.rerouted_at is not None and q.sent >= r.rerouted_at]
    assert len(after) >= 10 and sum(q.ok for q in after) >= 10, "serving must go on"
    failed = r.failed_after_reroute()
    assert not failed, [(q.sent, q.status, q.error) for q in failed[:5]]
    # the push during the cut committed, n1 acked it, n2 was not waited for
    assert r.push["ok"] and r.push["version"] == 1
    assert r.push["nodes"]["n1"] == {"n1/worker@0": 1}
    assert "n2" not in r.push["nodes"] and r.push["behind"] == []


def test_the_healed_node_rejoins_at_the_pushed_version(
    loss_round: NodeLossRound, rig: ClusterRig
) -> None:
    assert loss_round.rejoined_version == 1
    # its Dynamo lease lived through the cut: the shard's registration was put back and
    # the same worker replayed the push, no cold restart
    back = rig.logged("cluster.registration_put_back")
    assert [(e["logged_by"], e["unit"], e["lease_gone"]) for e in back] == [("n2", "worker@0", [])]
    assert not rig.logged("cluster.shard_restart")
    n2 = _cluster(rig.status("head"))["n2"]
    assert n2["state"] == "up" and n2["lost"] is None
    assert [u["policy_version"] for u in n2["units"] if u["shard"]] == [1]
    policy = json.loads(rig.run("n2", "policy", "status", "--json").stdout)
    assert policy["current"] == 1
    assert [s["policy_version"] for s in policy["shards"]] == [1]


def test_a_lost_node_forgotten_is_not_waited_for_and_rejoins_if_it_comes_back(
    rig: ClusterRig, loss_round: NodeLossRound, tmp_path: Path
) -> None:
    """`dynamod cluster forget`: a name the cluster lacks is bad input, a node that is up is
    refused; n2 cut, lost, then forgotten from n1: every node shows it forgotten, and a push
    neither names it lost nor waits for it. Healed after all, n2 is up again: its forgotten
    record gone, its shard (whose Dynamo lease the forget revoked) started again, routed and
    at the version pushed meanwhile."""
    unknown = rig.run("n1", "cluster", "forget", "n9")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1, unknown.stderr
    assert "no node 'n9' in the cluster (head, n1, n2)" in unknown.stderr
    up = rig.run("head", "cluster", "forget", "n1")
    assert up.returncode == 1 and "node n1 is up" in up.stderr, up.stderr
    old = rig.instance_ids("n2")
    ckpt = make_checkpoint(rig, tmp_path / "step-2", 1.02)
    rig.cut("n2")
    try:
        rig.wait("n2 lost in n1's view",
                 lambda: _cluster(rig.status("n1"))["n2"]["state"] == "lost", 30)  # fmt: skip
        done = rig.run("n1", "cluster", "forget", "n2", "--json")
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(done.stdout)
        assert result["was_lost"] and result["shards"] == ["n2/worker@0"], result
        assert result["state"] == "forgotten" and result["lease_records"] == ["worker@0"]
        assert result["ledger_records"] == ["worker@0"] and result["revoked"], result
        rig.wait("n2 forgotten in the head's view",
                 lambda: _cluster(rig.status("head"))["n2"]["state"] == "forgotten",
                 10)  # fmt: skip
        assert "gone for good, said on n1" in rig.run("head", "status").stdout
        started = time.monotonic()
        pushed = push_from(rig, 2, ckpt)
        took = time.monotonic() - started
        assert pushed["ok"] and pushed["lost_nodes"] == [] and pushed["unseen_nodes"] == []
        assert "n2" not in pushed["nodes"], pushed["nodes"]
        assert took < 60, f"the push waited {took:.1f}s: it must not wait for a forgotten node"
    finally:
        rig.heal("n2")
    rig.wait("n2 back: up, at v2, its shard started again and routed",
             lambda: _cluster(rig.status("head"))["n2"]["state"] == "up"
             and [u["policy_version"] for u in _cluster(rig.status("head"))["n2"]["units"]
                  if u["shard"]] == [2]
             and bool((new := rig.instance_ids("n2")) and not new & old and new & rig.routed()),
             120)  # fmt: skip
    assert [e["logged_by"] for e in rig.logged("cluster.back_after_forgotten")] == ["n2"]
    assert _cluster(rig.status("n1"))["n2"]["forgotten"] is None


def push_from(rig: ClusterRig, step: int, checkpoint: Path) -> dict[str, Any]:
    pushed = rig.run("head", "policy", "push", "--step", str(step), "--path", str(checkpoint),
                     "--json", timeout=300)  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    answer: dict[str, Any] = json.loads(pushed.stdout)
    return answer


def test_restarting_one_node_s_dynamod_does_not_disturb_the_others(
    rig: ClusterRig, loss_round: NodeLossRound
) -> None:
    """n1's dynamod SIGKILLed (its units die with it) and started again: the other nodes'
    shards keep their processes and routes, and n1's start-up sweep revokes the lease its
    dead worker held (the leader withdrew its route only: the lease, 300 s here, would keep
    its model card), and no other node's. A clean `down` and `up` is the next test's."""

    def shards(node: str) -> dict[str, Any]:
        return {u["name"]: u for u in rig.status(node)["units"] if u["name"] == "worker@0"}

    before = {n: shards(n)["worker@0"] for n in ("head", "n2")}
    others = rig.instance_ids("head") | rig.instance_ids("n2")
    old = rig.instance_ids("n1")
    assert old and old <= rig.dynamo_leases("head"), old
    status = rig.status("n1")
    log_from = len(rig.records("n1"))
    os.kill(status["daemon_pid"], signal.SIGKILL)
    pids = [u["pid"] for u in status["units"] if u["pid"]]
    assert wait_dead([status["daemon_pid"], *pids], timeout=15) == []
    rig.wait("n1 lost in the head's view",
             lambda: _cluster(rig.status("head"))["n1"]["state"] == "lost", 30)  # fmt: skip
    assert old <= rig.dynamo_leases("head"), "the leader withdraws the route, not the lease"
    rig.up(["n1"], timeout=180)
    rig.wait("n1 back up in the head's view", lambda: _cluster(rig.status("head"))["n1"]["state"]
             == "up" and rig.instance_ids("n1") & rig.routed(), 60)  # fmt: skip
    for node, was in before.items():
        now = shards(node)["worker@0"]
        assert (now["pid"], now["restarts"]) == (was["pid"], was["restarts"]), node
    assert others <= rig.routed(), "n1's start-up sweep must leave the other nodes' shards alone"
    swept = [r for r in rig.records("n1")[log_from:]
             if r.get("event") in ("dynamo.swept", "dynamo.stale_revoked")]  # fmt: skip
    assert [r["event"] for r in swept] == ["dynamo.stale_revoked"], swept
    assert {int(x, 16) for x in swept[0]["leases"]} == old, swept
    leases = rig.dynamo_leases("head")
    assert not old & leases, f"the dead worker's keys stayed: {old & leases}"
    assert others <= leases


def test_a_node_killed_while_it_replays_a_push_is_not_waited_for_and_comes_back_at_it(
    rig: ClusterRig, loss_round: NodeLossRound, tmp_path: Path
) -> None:
    """The head pushes step 3 while n1's worker is frozen (SIGSTOP: a replay that takes a
    while, as a real engine's load does), so n1's shard is held replaying it after the
    head's commit, and n1's dynamod is SIGKILLed then: the push answers ok without n1,
    naming it lost and no shard behind, n2 holds step 3. Started again, n1's new worker is
    held until it replays step 3, then routed: n1's ledger, its shard and the head's view
    all say 3."""
    ckpt = make_checkpoint(rig, tmp_path / "step-3", 1.03)
    status = rig.status("n1")
    pids = [u["pid"] for u in status["units"] if u["pid"]]
    log_from = len(rig.records("n1"))
    os.kill(unit_by_name(status, "worker@0")["pid"], signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        pushing = pool.submit(push_from, rig, 3, ckpt)

        def replaying() -> bool:
            worker = unit_by_name(rig.status("n1"), "worker@0")
            return worker["state"] == "held" and "behind the ledger, which is at version 3" in (
                worker["detail"] or "")  # fmt: skip

        rig.wait("n1's shard held, replaying step 3", replaying, 60)
        os.kill(status["daemon_pid"], signal.SIGKILL)
        assert wait_dead([status["daemon_pid"], *pids], timeout=15) == []
        pushed = pushing.result(timeout=300)
    admitted = [r for r in rig.records("n1")[log_from:]
                if r.get("event") == "unit.state" and r.get("unit") == "worker@0"
                and r.get("new") == "ready"]  # fmt: skip
    assert not admitted, f"n1's shard was admitted before the kill: {admitted}"
    assert pushed["ok"] and pushed["version"] == 3, pushed
    assert "n1" not in pushed["nodes"] and pushed["behind"] == [], pushed
    assert pushed["lost_nodes"] == ["n1"], pushed
    assert pushed["nodes"]["n2"] == {"n2/worker@0": 3}, pushed
    rig.up(["n1"], timeout=180)
    rig.wait("n1 up, its shard at step 3 and routed",
             lambda: _cluster(rig.status("head"))["n1"]["state"] == "up"
             and [u["policy_version"] for u in _cluster(rig.status("head"))["n1"]["units"]
                  if u["shard"]] == [3]
             and rig.instance_ids("n1") & rig.routed(), 120)  # fmt: skip
    policy = json.loads(rig.run("n1", "policy", "status", "--json").stdout)
    assert policy["current"] == 3 and [s["policy_version"] for s in policy["shards"]] == [3]


def test_a_node_joins_by_the_head_s_etcd_address_alone(
    rig: ClusterRig, loss_round: NodeLossRound
) -> None:
    """`up --join ADDR`: no stack file, no --node, no --var on n2: it reads the stack the
    head published and finds its own node by the address it holds."""
    stopped = rig.run("n2", "down", timeout=120)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    nowhere = rig.run("n2", "up", "--join", f"127.0.0.1:{free_port()}", timeout=60)
    assert nowhere.returncode == 2 and nowhere.stderr.count("\n") == 1, nowhere.stderr
    assert "--join 127.0.0.1:" in nowhere.stderr and "cannot reach etcd" in nowhere.stderr
    rig.up(["n2"], timeout=180, join=f"{rig.address('head')}:2379")
    rig.wait("n2 joined: up in the head's view and its shard routed",
             lambda: _cluster(rig.status("head"))["n2"]["state"] == "up"
             and rig.instance_ids("n2") & rig.routed(), 60)  # fmt: skip
    status = rig.status("n2")
    assert status["cluster"]["this_node"] == "n2" and status["stack"] == "cluster"
    assert (rig.state_dir("n2") / "joined" / "cluster.toml").is_file()
    workers = [u for u in status["units"] if u["name"].startswith("worker@")]
    assert [u["name"] for u in workers] == ["worker@0"], "the head's --var workers=1 came along"


def test_down_cluster_stops_every_node_and_leaves_nothing(
    rig: ClusterRig, loss_round: NodeLossRound
) -> None:
    run_ids = [rig.status(n)["run_id"] for n in rig.names]
    done = rig.run("n1", "down", "--cluster", "--json", timeout=300)
    report = json.loads(done.stdout) if done.stdout.startswith("{") else {}
    own = report.get("this_node_down", {})
    assert done.returncode == 0, (report.get("nodes"), own.get("survivors"), done.stderr[-2000:])
    assert report["tiers"][:3] == [["trainer"], ["frontend"], ["worker"]]
    assert all(report["nodes"][n]["answered"] for n in rig.names)
    assert "worker@0" in report["nodes"]["n2"]["stopped"]
    assert report["this_node_down"]["ok"]
    for node in rig.names:
        rig.wait(f"{node}'s daemon gone",
                 lambda node=node: not (rig.state_dir(node) / "dynamod.pid").exists(), 30)
    sandbox = rig.sandbox
    assert sandbox is not None
    rig.wait("no process left in the sandbox", lambda: not sandbox.pids(), 10)
    assert not [p for p in CGROUP_ROOT.glob("dynamod-*") if any(r in p.name for r in run_ids)]
