"""verl's rollout replicas laid out over a cluster's nodes (`layout.place`), from status
objects as a cluster node's daemon answers them (`cluster` rows, pure)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from dynamod.integrations.verl import attach
from dynamod.integrations.verl.config import RolloutSettings
from dynamod.integrations.verl.errors import StackNotReadyError
from dynamod.integrations.verl.layout import place
from dynamod.integrations.verl.server import DynamodRolloutServer
from dynamod.integrations.verl.stack import diagnose, parse_status

ADDRESSES = {"head": "10.77.0.1", "n1": "10.77.0.2", "n2": "10.77.0.3"}


def shard(name: str, state: str = "ready", port: int = 21000) -> dict[str, Any]:
    return {"name": name, "state": state, "ports": {"system": port}, "policy_version": 3,
            "command": ["python", "-m", "dynamod.workers.cpu", "--model-name", "tiny-cpu"],
            "dynamo": {"namespace": "dynamod", "system_url": f"http://127.0.0.1:{port}",
                       "instance_ids": [port], "routed": True}}  # fmt: skip


def row(name: str, shards: int, state: str = "up", behind: tuple[str, ...] = (),
        frontend: bool = False, phase: str = "up") -> dict[str, Any]:
    units = [{"name": f"worker@{i}", "unit": "worker", "state": "ready", "pid": 1,
              "ports": {"system": 21000 + i}, "detail": "", "policy_version": 3,
              "instance_ids": [i], "shard": True} for i in range(shards)]  # fmt: skip
    if frontend:
        units.append({"name": "frontend", "unit": "frontend", "state": "ready", "pid": 2,
                      "ports": {"http": 24000}, "detail": "", "shard": False})  # fmt: skip
    return {"name": name, "address": ADDRESSES[name], "head": name == "head", "state": state,
            "state_dir": f"/srv/{name}", "units": units if state == "up" else [], "phase": phase,
            "behind": list(behind)}  # fmt: skip


def cluster_status(this: str, rows: list[dict[str, Any]], held: list[str] | None = None,
                   local: int = 2) -> dict[str, Any]:
    units = [shard(f"worker@{i}", port=21000 + i) for i in range(local)]
    if this == "head":
        units.append({"name": "frontend", "state": "ready", "ports": {"http": 24000},
                      "command": ["python", "-m", "dynamo.frontend", "--router-mode", "kv"]})
    return {"stack": "cluster", "state_dir": f"/srv/{this}", "phase": "up",
            "policy": {"current": 3, "held": held or []}, "units": units,
            "cluster": {"this_node": this, "head": "head", "nodes": rows}}  # fmt: skip


def test_another_node_reaches_the_head_s_frontend_at_the_head_s_address() -> None:
    rows = [row("head", 2, frontend=True), row("n1", 2)]
    assert parse_status(cluster_status("head", rows)).frontend_url == "http://127.0.0.1:24000"
    view = parse_status(cluster_status("n1", rows))
    assert view.frontend_url == "http://10.77.0.1:24000" and view.frontend_state == "ready"
    assert [n.name for n in view.nodes] == ["head", "n1"]
    assert [s.system_url for s in view.nodes[0].shards] == [None, None]  # not reached here
    assert view.nodes[1].shards == view.shards  # this node's own, with their URLs


def test_each_node_takes_its_share_of_the_replicas() -> None:
    rows = [row("head", 2, frontend=True), row("n1", 2)]
    view = parse_status(cluster_status("head", rows))
    diagnose(view, needed_shards=4)
    places = [place(view, r, 4) for r in range(4)]
    assert [(p.node, p.replica, p.replicas) for p in places] == [
        ("head", 0, 2), ("head", 1, 2), ("n1", 0, 2), ("n1", 1, 2)]
    assert [str(p.state_dir) for p in places] == ["/srv/head"] * 2 + ["/srv/n1"] * 2
    assert [p.frontend_url for p in places] == (
        ["http://127.0.0.1:24000"] * 2 + ["http://10.77.0.1:24000"] * 2)
    assert places[2].address == "10.77.0.2"
    # one replica a node: it owns all of its node's shards, as on one node
    assert [(p.node, p.replicas) for p in (place(view, r, 2) for r in range(2))] == [
        ("head", 1), ("n1", 1)]
    single = parse_status({**cluster_status("head", []), "cluster": None})
    assert place(single, 1, 2).node is None and place(single, 1, 2).replica == 1


def test_the_count_is_across_the_cluster_and_names_other_nodes_shards() -> None:
    rows = [row("head", 2, frontend=True), row("n1", 2, behind=("n1/worker@1",))]
    view = parse_status(cluster_status("head", rows, held=["worker@0"]))
    with pytest.raises(StackNotReadyError, match=r"2 admitted rollout shard\(s\) "
                       r"\(head/worker@1, n1/worker@0\).*needs 4.*"
                       r"head/worker@0 ready held, n1/worker@1 ready held"):
        diagnose(view, needed_shards=4)


@pytest.mark.parametrize(("rows", "replicas", "why"), [
    ([row("head", 2, frontend=True), row("n1", 2), row("n2", 2)], 4,
     r"shards on 3 node\(s\) \(head, n1, n2\), and verl's 4 replica\(s\) do not divide"),
    ([row("head", 2, frontend=True), row("n1", 0, state="lost")], 2,
     r"node\(s\) n1 \(lost\) not up"),
    ([row("head", 2, frontend=True), row("n1", 1, behind=("n1/worker@0",))], 2,
     r"node n1 has 0 admitted rollout shard\(s\) for its 1 replica\(s\) \(replicas 1-1\)"),
    ([row("head", 2, frontend=True), row("n1", 2, phase="starting")], 2,
     r"node\(s\) n1 \(starting\) not up"),
])  # fmt: skip
def test_a_layout_the_nodes_cannot_take_is_refused(rows: list[dict[str, Any]], replicas: int,
                                                   why: str) -> None:
    view = parse_status(cluster_status("head", rows, local=2))
    with pytest.raises(StackNotReadyError, match=why):
        for r in range(replicas):
            place(view, r, replicas)


def test_no_shards_on_any_node_s_entry_is_refused() -> None:
    view = parse_status(cluster_status("head", [row("head", 0, frontend=True), row("n1", 0)],
                                       local=0))  # fmt: skip
    with pytest.raises(StackNotReadyError, match=r"no node's registry entry lists rollout "):
        place(view, 0, 2)


def test_a_forgotten_node_takes_no_replica() -> None:
    rows = [row("head", 2, frontend=True), row("n1", 0, state="forgotten"), row("n2", 2)]
    view = parse_status(cluster_status("head", rows))
    assert [place(view, r, 2).node for r in range(2)] == ["head", "n2"]


def test_a_server_whose_frontend_does_not_answer_says_to_listen_beyond_loopback() -> None:
    with socket.socket() as taken:  # a port nothing listens on: bound, never listening
        taken.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{taken.getsockname()[1]}"
        server = DynamodRolloutServer("/nonexistent", RolloutSettings(), 0, 1, "m", url, 8, 8,
                                      node="n1")  # fmt: skip

        async def reach() -> None:
            try:
                await server.reach()
            finally:
                await server._http().close()

        with pytest.raises(StackNotReadyError, match=r"rollout replica 0 of node n1: the "
                           r"frontend at http://127\.0\.0\.1:\d+/live does not answer .*"
                           r"--var frontend_host=0\.0\.0\.0"):
            asyncio.run(reach())


def test_a_rank_finds_its_own_node_s_daemon_by_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl gives every rank the head's state dir; a rank on n1 must call n1's daemon."""
    rows = [row("head", 2, frontend=True), row("n1", 2)]
    monkeypatch.setattr(attach, "read_stack", lambda d: parse_status(cluster_status("head", rows)))
    assert attach.node_state_dir(Path("/srv/head"), "10.77.0.2") == Path("/srv/n1")
    assert attach.node_state_dir(Path("/srv/head"), "10.77.0.1") == Path("/srv/head")
    assert attach.node_state_dir(Path("/srv/head"), "10.9.9.9") == Path("/srv/head")
    single = {**cluster_status("head", []), "cluster": None}
    monkeypatch.setattr(attach, "read_stack", lambda d: parse_status(single))
    assert attach.node_state_dir(Path("/srv/x"), "10.77.0.2") == Path("/srv/x")


def test_a_cluster_s_ray_head_is_reached_at_its_node_s_address() -> None:
    status = cluster_status("head", [row("head", 2, frontend=True), row("n1", 2)])
    status["units"].append({"name": "ray-head", "state": "ready", "ports": {"gcs": 6379},
                            "command": ["ray", "start", "--head", "--node-ip-address",
                                        "10.77.0.1", "--num-gpus", "1"]})  # fmt: skip
    view = parse_status(status)
    assert view.ray_address == "10.77.0.1:6379" and view.ray_gpus == 1.0
    assert attach.ray_env(view.ray_address) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    assert attach.ray_env("127.0.0.1:25000") == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    assert attach.ray_env(None) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
