"""What the rollout backend needs to know about the running stack, read from dynamod.

Everything comes from the daemon's `status --json` object (`Client.status()`): the
frontend's address and router mode (its unit's port and command line), the served model,
each rollout shard's system URL, state and applied policy version, whether the shard is
admitted (not held), the ledger's current version and the Ray head's GCS port; on a cluster
node, every node's shards and state dir (status's `cluster` rows) and the head's frontend
as this node reaches it (`layout.py` places verl's replicas on them). `attach`
refuses a stack that is not up, or that has fewer admitted shards than verl's rollout
layout needs, with a diagnosis naming what is missing. Parsing is pure; only `read_stack`
talks to the daemon.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamod.core.argv import flag_value
from dynamod.integrations.verl.config import PREFIX, RolloutSettings
from dynamod.integrations.verl.errors import RolloutConfigError, StackNotReadyError

SERVING_STATES = ("ready", "degraded")
FRONTEND_UNIT = "frontend"
RAY_HEAD_UNIT = "ray-head"
THUNDERAGENT_MODULE = "dynamo.thunderagent_router"


@dataclass(frozen=True)
class Shard:
    name: str
    state: str
    system_url: str | None
    policy_version: int | None
    admitted: bool
    instance_ids: tuple[int, ...]


@dataclass(frozen=True)
class Node:
    """A node of a cluster stack, from status's `cluster` rows. Another node's shards have
    no system URL here (their system ports are on that node's loopback) and count as
    admitted when serving at the ledger's version (that node's daemon holds the others)."""

    name: str
    address: str
    head: bool
    state: str  # up, lost, unknown, forgotten
    phase: str | None  # its daemon's (up once its stack is up)
    state_dir: str | None  # its daemon's, on that node
    shards: tuple[Shard, ...]

    @property
    def admitted(self) -> list[Shard]:
        return [s for s in self.shards if s.admitted]


@dataclass(frozen=True)
class StackView:
    state_dir: Path
    stack: str
    phase: str
    frontend_url: str | None
    frontend_state: str | None
    router_mode: str | None
    model: str | None
    model_path: str | None  # the shards' weights: what verl's actor must load too
    namespace: str | None
    thunderagent: bool
    shards: tuple[Shard, ...]
    current_version: int
    ray_address: str | None
    ray_cpus: float | None = None  # what the `ray-head` unit offers (--num-cpus/--num-gpus)
    ray_gpus: float | None = None
    node: str | None = None  # this node's name in a cluster stack (None: a single node)
    nodes: tuple[Node, ...] = ()  # a cluster's nodes in its order, this one included
    frontend_port: int | None = None

    @property
    def admitted(self) -> list[Shard]:
        return [s for s in self.shards if s.admitted]

    def ledger_name(self, shard: str) -> str:
        """The shard's name in the policy ledger, as dynamod's publish takes it:
        `<node>/<unit>` in a cluster stack (every node has a `worker@0`), else the unit's."""
        return f"{self.node}/{shard}" if self.node is not None else shard

    def shard_named(self, name: str) -> Shard:
        for shard in self.shards:
            if shard.name == name:
                return shard
        raise StackNotReadyError(f"stack {self.stack!r} has no rollout shard {name!r}")

    def shards_of_replica(self, replica_rank: int, replicas: int) -> list[Shard]:
        """Replica r owns shards r, r + replicas, ... (by name order) for its lifecycle calls;
        generation is routed by the frontend across every admitted shard."""
        ordered = sorted(self.shards, key=lambda s: s.name)
        return [s for i, s in enumerate(ordered) if i % replicas == replica_rank]


def parse_status(status: Mapping[str, Any]) -> StackView:
    """The stack as the daemon reports it (the `status --json` object)."""
    units: list[Mapping[str, Any]] = list(status.get("units") or [])
    policy: Mapping[str, Any] = status.get("policy") or {}
    held = set(policy.get("held") or [])
    by_name = {str(u["name"]): u for u in units}
    cluster: Mapping[str, Any] = status.get("cluster") or {}
    this_node = cluster.get("this_node")
    frontend, frontend_host = _frontend(by_name, cluster)
    router = next(
        (u for u in units if THUNDERAGENT_MODULE in (u.get("command") or [])), None
    )
    shards: list[Shard] = []
    for unit in units:
        if "policy_version" not in unit or not unit.get("dynamo"):
            continue
        dynamo: Mapping[str, Any] = unit["dynamo"]
        state = str(unit.get("state"))
        shards.append(
            Shard(
                name=str(unit["name"]),
                state=state,
                system_url=dynamo.get("system_url"),
                policy_version=unit.get("policy_version"),
                admitted=state in SERVING_STATES and unit["name"] not in held,
                instance_ids=tuple(int(i) for i in dynamo.get("instance_ids") or []),
            )
        )
    model, model_path = _model(units, {s.name for s in shards}, router)
    namespace = next(
        (u["dynamo"].get("namespace") for u in units if u.get("dynamo")), None
    )
    http = (frontend or {}).get("ports", {}).get("http")
    shards.sort(key=lambda s: s.name)
    nodes = tuple(_node(row, this_node, shards) for row in cluster.get("nodes") or [])
    ray_head = by_name.get(RAY_HEAD_UNIT) or {}
    gcs = ray_head.get("ports", {}).get("gcs")
    ray_command = ray_head.get("command") or []
    return StackView(
        state_dir=Path(str(status.get("state_dir", "."))),
        stack=str(status.get("stack", "?")),
        phase=str(status.get("phase", "?")),
        frontend_url=f"http://{frontend_host}:{http}" if http else None,
        frontend_state=str(frontend["state"]) if frontend else None,
        router_mode=flag_value((frontend or {}).get("command") or [], "--router-mode"),
        model=model,
        model_path=model_path,
        namespace=namespace,
        thunderagent=router is not None,
        shards=tuple(shards),
        current_version=int(policy.get("current") or 0),
        # a cluster's Ray head listens on its node's address (--node-ip-address)
        ray_address=(f"{flag_value(ray_command, '--node-ip-address') or '127.0.0.1'}:{gcs}"
                     if gcs else None),
        ray_cpus=_number(flag_value(ray_command, "--num-cpus")),
        ray_gpus=_number(flag_value(ray_command, "--num-gpus")),
        node=this_node,
        nodes=nodes,
        frontend_port=int(http) if http else None,
    )


def _frontend(
    by_name: Mapping[str, Mapping[str, Any]], cluster: Mapping[str, Any]
) -> tuple[Mapping[str, Any] | None, str]:
    """The frontend unit's row and the host this node reaches it at: its own on loopback,
    else the one on another node's registry entry (the head's) at that node's address."""
    if FRONTEND_UNIT in by_name:
        return by_name[FRONTEND_UNIT], "127.0.0.1"
    for row in cluster.get("nodes") or []:
        found = next((u for u in row.get("units") or [] if u["name"] == FRONTEND_UNIT), None)
        if found is not None:
            return found, str(row["address"])
    return None, "127.0.0.1"


def _node(row: Mapping[str, Any], this_node: str | None, local: list[Shard]) -> Node:
    """A `cluster` row; this node's shards are the daemon's own (held ones known)."""
    name = str(row["name"])
    behind = set(row.get("behind") or [])
    shards = tuple(local) if name == this_node else tuple(
        Shard(
            name=str(u["name"]), state=str(u["state"]), system_url=None,
            policy_version=u.get("policy_version"),
            admitted=str(u["state"]) in SERVING_STATES and f"{name}/{u['name']}" not in behind,
            instance_ids=tuple(int(i) for i in u.get("instance_ids") or []),
        )
        for u in sorted(row.get("units") or [], key=lambda u: str(u["name"]))
        if u.get("shard")
    )  # fmt: skip
    return Node(name=name, address=str(row["address"]), head=bool(row.get("head")),
                state=str(row.get("state")), phase=row.get("phase"),
                state_dir=row.get("state_dir"), shards=shards)


def _model(
    units: list[Mapping[str, Any]], shards: set[str], router: Mapping[str, Any] | None
) -> tuple[str | None, str | None]:
    """The served model's name (the router's, else the first shard's) and its path."""
    model = model_path = None
    for unit in units:
        if unit["name"] in shards:
            command = unit.get("command") or []
            model_path = flag_value(command, "--model-path") or flag_value(command, "--model")
            break
    if router is not None:
        model = flag_value(router.get("command") or [], "--model-name")
    for unit in units if model is None else []:
        if unit["name"] in shards:
            command = unit.get("command") or []
            served = flag_value(command, "--served-model-name")
            model = served or flag_value(command, "--model-name")
            break
    return model, model_path


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def diagnose(view: StackView, needed_shards: int) -> None:
    """StackNotReadyError unless the stack can serve a layout of `needed_shards` shards
    (on a cluster, counted across its nodes; `layout.place` then judges each node)."""
    where = f"dynamod stack {view.stack!r} (state dir {view.state_dir})"
    if view.phase != "up":
        raise StackNotReadyError(
            f"{where} is {view.phase!r}, not up; wait for `dynamod up` to finish "
            "(`dynamod status` shows which unit it waits for)"
        )
    if view.frontend_url is None:
        raise StackNotReadyError(f"{where} has no `frontend` unit with an http port")
    if view.frontend_state not in SERVING_STATES:
        raise StackNotReadyError(
            f"{where}: the frontend is {view.frontend_state}, not ready "
            "(`dynamod logs frontend`)"
        )
    every: list[tuple[str | None, Shard]] = [
        (n.name, s) for n in view.nodes for s in n.shards] or [
        (None, s) for s in view.shards]  # fmt: skip
    if not every:
        raise StackNotReadyError(
            f"{where} has no rollout shards under its [policy] table; use a stack for verl "
            "(units/stacks/verl-cpu.toml, verl-native.toml, verl-thunderagent.toml)"
        )

    def named(node: str | None, shard: Shard) -> str:
        return f"{node}/{shard.name}" if node is not None else shard.name

    admitted = [named(n, s) for n, s in every if s.admitted]
    if len(admitted) < needed_shards:
        others = ", ".join(
            f"{named(n, s)} {s.state}{' held' if s.state in SERVING_STATES else ''}"
            for n, s in every
            if not s.admitted
        )
        raise StackNotReadyError(
            f"{where} has {len(admitted)} admitted rollout shard(s) "
            f"({', '.join(admitted) or 'none'}) but verl's rollout layout "
            f"needs {needed_shards} (one per replica: n_gpus_per_node x nnodes / "
            f"(tensor x data x pipeline parallel)); "
            + (f"not admitted: {others}; " if others else "")
            + "start the stack with --var workers=N (or shards=N), or lower the layout"
        )


def check_settings(view: StackView, settings: RolloutSettings, section: str = "dynamod") -> None:
    """RolloutConfigError for a setting that disagrees with the running stack."""
    where = f"{PREFIX}.{section}"
    checks = [
        ("router_mode", settings.router_mode, view.router_mode),
        ("namespace", settings.namespace, view.namespace),
        ("served_model_name", settings.served_model_name, view.model),
    ]
    for key, wanted, actual in checks:
        if wanted is not None and actual is not None and wanted != actual:
            raise RolloutConfigError(
                f"{where}.{key}",
                f"{wanted!r} conflicts with the running stack {view.stack!r}, whose "
                f"{key} is {actual!r}; change the stack (dynamod up --var ...) or drop the key",
            )
    if settings.thunderagent is not None and settings.thunderagent != view.thunderagent:
        stack_has = "runs" if view.thunderagent else "does not run"
        raise RolloutConfigError(
            f"{where}.thunderagent.enabled",
            f"{settings.thunderagent} conflicts with the running stack {view.stack!r}, which "
            f"{stack_has} the ThunderAgent router (units/stacks/verl-thunderagent.toml)",
        )


def read_stack(state_dir: Path) -> StackView:
    """Ask the daemon; StackNotReadyError when none answers."""
    from dynamod.client import Client
    from dynamod.core.errors import DaemonError

    try:
        status = Client(state_dir, timeout=10).status()
    except DaemonError as exc:
        raise StackNotReadyError(f"verl rollout backend 'dynamod': {exc}") from None
    return parse_status(status)
