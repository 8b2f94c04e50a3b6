"""One node-loss round on a simulated cluster, timed: under load from inside the head, cut
a worker node's link; measure when the registry marks it lost and when the head's router
stops listing its shards; push a new policy version during the cut; heal the link and
measure when its shards are admitted again at that version. Shared by the 3-node test
(which asserts) and bench/cluster.py (which reports)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamod.chaos.cluster import ClusterError, ClusterRig
from dynamod.chaos.history import Request
from dynamod.chaos.model import Load


@dataclass
class NodeLossRound:
    node: str
    lost_s: float | None = None  # cut -> the head's registry view says lost
    rerouted_s: float | None = None  # cut -> the router lists none of the node's shards
    push: dict[str, Any] = field(default_factory=dict)
    push_s: float | None = None
    admitted_s: float | None = None  # heal -> every shard of the node at the pushed version
    rejoined_version: int | None = None
    requests: list[Request] = field(default_factory=list)
    cut_at: float = 0.0  # on the load's clock
    rerouted_at: float | None = None
    push_started_at: float | None = None
    push_done_at: float | None = None
    step: int | None = None
    marked_lost: list[str] = field(default_factory=list)  # nodes the leader marked lost meanwhile
    # the cut node heard the cluster again while its etcd calls failed: its etcd connections
    # opened afresh (cluster.link_back) in the round
    link_back: bool = False
    lost_why: str = ""  # why the head's view gave for the cut node's loss

    def _at_outgoing_version(self, r: Request) -> bool:
        """Required the version a push was replacing while that push was under way: the
        router refuses those by design (no stale shard may serve)."""
        if self.push_started_at is None or self.push_done_at is None or self.step is None:
            return False
        overlaps = r.sent <= self.push_done_at and r.done >= self.push_started_at
        return overlaps and r.required is not None and r.required < self.step

    def failed_after_reroute(self) -> list[Request]:
        """Failed requests that required the current version, sent once the router had
        dropped the node (what the target of 0 is about)."""
        if self.rerouted_at is None:
            return []
        return [
            r
            for r in self.requests
            if r.sent >= self.rerouted_at
            and r.required is not None
            and not r.ok
            and not self._at_outgoing_version(r)
        ]

    def refused_at_outgoing_version(self) -> list[Request]:
        """After re-routing, refused by design at the version being replaced (apart from
        those counted by failed_during_cut)."""
        if self.rerouted_at is None:
            return []
        return [
            r
            for r in self.requests
            if r.sent >= self.rerouted_at and not r.ok and self._at_outgoing_version(r)
        ]

    def falsely_lost(self) -> list[str]:
        """Nodes marked lost during the round that were not cut (a lease missed under load),
        and the cut node marked lost more than once."""
        others = [n for n in self.marked_lost if n != self.node]
        return others + [self.node] * max(0, self.marked_lost.count(self.node) - 1)

    def failed_during_cut(self) -> list[Request]:
        end = self.rerouted_at if self.rerouted_at is not None else float("inf")
        return [r for r in self.requests if self.cut_at <= r.sent < end and not r.ok]


def make_checkpoint(rig: ClusterRig, out: Path, scale: float) -> Path:
    """A new policy: the boot weights of the head's shard (float32, the tiny model),
    scaled. numpy, not torch: importing torch took 8.5 s on a loaded 2-core machine."""
    from safetensors.numpy import load_file, save_file

    worker = next(u for u in rig.status(rig.names[0])["units"] if u["name"] == "worker@0")
    base = Path(worker["command"][worker["command"].index("--model-path") + 1])
    tensors = load_file(str(base / "model.safetensors"))
    tensors = {k: (v * scale).astype(v.dtype) for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def node_state(rig: ClusterRig, viewer: str, node: str) -> dict[str, Any]:
    view = rig.status(viewer)["cluster"]
    entry: dict[str, Any] = next(n for n in view["nodes"] if n["name"] == node)
    return entry


def run_round(
    rig: ClusterRig,
    node: str,
    *,
    step: int,
    checkpoint: Path,
    load: Load,
    model: str = "tiny-cpu",
    detect_timeout: float = 30,
    rejoin_timeout: float = 60,
    hold_s: float = 2.0,
) -> NodeLossRound:
    head = rig.names[0]
    result = NodeLossRound(node=node, step=step)
    current: list[int | None] = [_ledger(rig)]
    gen = rig.load(load, model, lambda: current[0])
    # A node is "up" in the head's view before its shard's instance id is: `up` returned
    # 2.3 s into a quick cluster, and one CI run found no id for n2 yet.
    ids: set[int] = rig.wait(
        f"{node}'s shards in the head's registry view (to cut off)",
        lambda: rig.instance_ids(node), detect_timeout, 0.1,
    )  # fmt: skip
    lost_before = len(rig.logged("cluster.node_lost"))
    back_before = len(_link_back(rig, node))
    gen.start()
    try:
        time.sleep(2.0)  # the load's steady state first: the round measures against it
        cut = time.monotonic()
        result.cut_at = cut - gen.origin
        rig.cut(node)
        lost, rerouted, result.lost_why = lost_and_rerouted(rig, node, ids, cut, detect_timeout)
        result.lost_s, result.rerouted_s = lost - cut, rerouted - cut
        result.rerouted_at = rerouted - gen.origin
        time.sleep(1.0)  # load on the head's shards alone before the push
        started = time.monotonic()
        result.push_started_at = started - gen.origin
        result.push = _push(rig, step, checkpoint)
        result.push_s = time.monotonic() - started
        current[0] = step
        result.push_done_at = time.monotonic() - gen.origin
        time.sleep(hold_s)  # load at the new version while the node is still cut off
        healed = time.monotonic()
        rig.heal(node)
        rig.wait(f"{node}'s shards admitted at version {step}",
                 lambda: _admitted(rig, head, node, step), rejoin_timeout, 0.1)
        result.admitted_s = time.monotonic() - healed
        result.rejoined_version = step
        time.sleep(2.0)  # serving with the node back: the round's last measured phase
    finally:
        gen.stop()
        result.requests = list(gen.requests)
        result.marked_lost = [
            str(e.get("node")) for e in rig.logged("cluster.node_lost")[lost_before:]
        ]
        result.link_back = len(_link_back(rig, node)) > back_before
    return result


def _link_back(rig: ClusterRig, node: str) -> list[dict[str, Any]]:
    return [e for e in rig.logged("cluster.link_back") if e.get("logged_by") == node]


def lost_and_rerouted(
    rig: ClusterRig, node: str, ids: set[int], cut: float, timeout: float
) -> tuple[float, float, str]:
    """When the head's registry marked the cut node lost, and when its router stopped
    listing the node's shards (monotonic times, each when the answer that showed it came);
    and why it was lost (its lease's expiry, or the leader's heartbeats:
    cluster/heartbeat.py). The two are asked from two threads: the frontend's answer can
    take seconds when its etcd connection went to a member on the cut node, and the
    registry's view must not wait on it. The router's view counts only when it lists some
    shard: Dynamo's frontend answers an empty list when its own etcd read failed
    (health.rs), which is no sign that it stopped routing to the node (the other nodes'
    shards are routed)."""
    deadline = cut + timeout
    rerouted: list[float] = []

    def watch_router() -> None:
        while not rerouted and time.monotonic() < deadline:
            with contextlib.suppress(ClusterError):
                view = rig.routed()
                if view and not view & ids:
                    rerouted.append(time.monotonic())
                    return
            time.sleep(0.05)

    router = threading.Thread(target=watch_router, name="rerouted", daemon=True)
    router.start()
    lost = None
    why = ""
    # a node is `lost` in the view as its entry goes; its lost record (with why) follows
    while (lost is None or not why) and time.monotonic() < deadline:
        with contextlib.suppress(ClusterError):
            state = node_state(rig, rig.names[0], node)
            if state["state"] == "lost":
                lost = time.monotonic() if lost is None else lost
                why = str((state.get("lost") or {}).get("why", ""))
        time.sleep(0.05)
    router.join(max(0.0, deadline - time.monotonic()) + 3)
    if lost is None or not rerouted:
        raise ClusterError(
            f"{node} cut {timeout:g}s ago: lost={lost is not None}, "
            f"rerouted={bool(rerouted)}"
        )
    return lost, rerouted[0], why


def lost_by(why: str) -> str:
    """What marked a node lost, from its lost record's why: "heartbeat" (the leader's or
    the deputy's revocation, cluster/heartbeat.py), "lease" (its expiry), "-" (unknown)."""
    if not why:
        return "-"
    return "heartbeat" if "heartbeat" in why else "lease"


def _push(rig: ClusterRig, step: int, checkpoint: Path) -> dict[str, Any]:
    pushed = rig.run(
        rig.names[0], "policy", "push", "--step", str(step), "--path", str(checkpoint),
        "--json", timeout=300,
    )
    if pushed.returncode != 0:
        raise ClusterError(f"push of step {step} failed: {pushed.stderr[-2000:]}")
    answer: dict[str, Any] = json.loads(pushed.stdout)
    return answer


def _admitted(rig: ClusterRig, head: str, node: str, step: int) -> bool:
    """Every shard of the node ready at `step` and routed again, the node up."""
    entry = node_state(rig, head, node)
    shards = [u for u in entry["units"] if u["shard"]]
    return (
        entry["state"] == "up"
        and bool(shards)
        and all(u["state"] == "ready" and u["policy_version"] == step for u in shards)
        and bool(rig.routed() & rig.instance_ids(node))
    )


def _ledger(rig: ClusterRig) -> int | None:
    policy = rig.status(rig.names[0]).get("policy") or {}
    version = policy.get("current")
    return int(version) if version is not None else None
