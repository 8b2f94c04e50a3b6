"""Where units run in a multi-node stack: the `[cluster]` table (node name -> address, the
head, the registry lease, the secrets dir, the store its registry lives in), each unit's
`nodes` (`"all"`, `"others"` (every node but the head) or a list of node names; without
it the head only), the template context and environment every unit of a cluster stack
gets, and the cluster-wide stop tiers (dependents first, across nodes). Pure logic: it
knows that units run on nodes, nothing of what the nodes run or how they coordinate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dynamod.core import graph, limits
from dynamod.core.errors import SpecError

_CLUSTER_KEYS = {"nodes", "head", "lease_ttl", "heartbeat_timeout", "secrets", "registry"}
# s: the leader marks lost a node its heartbeats have not heard from this long (0: off)
DEFAULT_HEARTBEAT_TIMEOUT = 1.2
MIN_HEARTBEAT_TIMEOUT = 0.6  # three of the leader's pings (cluster/heartbeat.py PING_S)
DEFAULT_REGISTRY = "http://{cluster.head_address}:{vars.etcd_client_port}"
MAX_NODES = 64


class ClusterSpec(BaseModel):
    """A validated `[cluster]` table, seen from one node (`node`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: dict[str, str] = Field(description="node name -> address, in order")
    head: str
    node: str = Field(description="the node this daemon runs")
    lease_ttl: float = Field(3.0, gt=0, le=60, allow_inf_nan=False)
    heartbeat_timeout: float = Field(DEFAULT_HEARTBEAT_TIMEOUT, ge=0, le=60, allow_inf_nan=False)
    secrets: str | None = None
    registry: list[str] = Field(min_length=1, description="store endpoints of the registry")
    placement: dict[str, list[str]] = Field(
        default_factory=dict, description="unit (base name) -> the nodes it runs on"
    )
    stop_tiers: list[list[str]] = Field(
        default_factory=list, description="unit base names, stopped tier by tier, across nodes"
    )

    @property
    def head_address(self) -> str:
        return self.nodes[self.head]

    @property
    def address(self) -> str:
        return self.nodes[self.node]

    @property
    def is_head(self) -> bool:
        return self.node == self.head

    def nodes_spec(self) -> str:
        return ",".join(f"{name}={address}" for name, address in self.nodes.items())

    def context(self, node: str) -> dict[str, Any]:
        """The `{node.*}` and `{cluster.*}` template context of a unit rendered for `node`."""
        return {
            "node": {"name": node, "address": self.nodes[node]},
            "cluster": {
                "head": self.head,
                "head_address": self.head_address,
                "nodes": dict(self.nodes),
                "nodes_spec": self.nodes_spec(),
                "secrets": self.secrets or "",
            },
        }

    def environment(self) -> dict[str, str]:
        """What every unit of this node gets in its environment."""
        return {
            "DYNAMOD_NODE": self.node,
            "DYNAMOD_CLUSTER_NODES": self.nodes_spec(),
            "DYNAMOD_CLUSTER_HEAD": self.head,
        }


def parse(table: Mapping[str, Any], *, path: Path, node: str | None) -> dict[str, Any]:
    """Check the raw `[cluster]` table; returns the fields of ClusterSpec that need no
    rendering (nodes, head, node, lease_ttl, heartbeat_timeout, secrets) plus the raw
    `registry`."""
    for key in table:
        if key not in _CLUSTER_KEYS:
            known = ", ".join(sorted(_CLUSTER_KEYS))
            raise SpecError(f"unknown key (expected: {known})", file=path, field=f"cluster.{key}")
    nodes = _nodes(table.get("nodes"), path)
    head = table.get("head", next(iter(nodes)))
    if head not in nodes:
        raise SpecError(
            f"{head!r} is not one of the nodes ({', '.join(nodes)})",
            file=path,
            field="cluster.head",
        )
    if node is not None and node not in nodes:
        raise SpecError(
            f"node {node!r} is not in the stack's [cluster] nodes ({', '.join(nodes)})",
            file=path,
            field="--node",
        )
    return {
        "nodes": nodes,
        "head": head,
        "node": node or head,
        "secrets": _secrets(table.get("secrets"), path),
        "lease_ttl": _lease_ttl(table.get("lease_ttl", 3.0), path),
        "heartbeat_timeout": _heartbeat_timeout(
            table.get("heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT), path
        ),
        "registry": _registry(table.get("registry", DEFAULT_REGISTRY), path),
    }


def _nodes(nodes: Any, path: Path) -> dict[str, str]:
    """`cluster.nodes`: name = address, in order."""
    if not isinstance(nodes, dict) or not nodes:
        raise SpecError(
            'must be a table of node name = address, e.g. { head = "10.77.0.1" }',
            file=path,
            field="cluster.nodes",
        )
    if len(nodes) > MAX_NODES:
        raise SpecError(
            f"at most {MAX_NODES} nodes, got {len(nodes)}", file=path, field="cluster.nodes"
        )
    for name, address in nodes.items():
        if (
            not name
            or len(name) > limits.MAX_NAME_LENGTH
            or not set(name) <= limits.UNIT_NAME_CHARS
        ):
            raise SpecError(
                "node names may use letters, digits, '_' and '-' only",
                file=path,
                field=f"cluster.nodes.{name}",
            )
        if not isinstance(address, str) or not address or any(c in address for c in " /@"):
            raise SpecError(
                f"must be a host address, got {address!r}", file=path, field=f"cluster.nodes.{name}"
            )
    return {str(k): str(v) for k, v in nodes.items()}


def _secrets(secrets: Any, path: Path) -> str | None:
    """`cluster.secrets`: a directory, relative to the stack file."""
    if secrets is None:
        return None
    if not isinstance(secrets, str) or not secrets:
        raise SpecError("must be a directory path", file=path, field="cluster.secrets")
    return str((path.parent / secrets).absolute())


def _lease_ttl(lease_ttl: Any, path: Path) -> float:
    """`cluster.lease_ttl`: seconds, above 0 and at most 60."""
    if (
        isinstance(lease_ttl, bool)
        or not isinstance(lease_ttl, int | float)
        or not 0 < lease_ttl <= 60
    ):
        raise SpecError(
            f"must be seconds above 0 and at most 60, got {lease_ttl!r}",
            file=path,
            field="cluster.lease_ttl",
        )
    return float(lease_ttl)


def _heartbeat_timeout(timeout: Any, path: Path) -> float:
    """`cluster.heartbeat_timeout`: 0 (off), or seconds from MIN_HEARTBEAT_TIMEOUT to 60."""
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not (timeout == 0 or MIN_HEARTBEAT_TIMEOUT <= timeout <= 60)
    ):
        raise SpecError(
            f"must be 0 (off) or seconds from {MIN_HEARTBEAT_TIMEOUT:g} to 60, got {timeout!r}",
            file=path,
            field="cluster.heartbeat_timeout",
        )
    return float(timeout)


def _registry(registry: Any, path: Path) -> list[str]:
    """`cluster.registry`: a URL or a list of them (rendered later)."""
    if isinstance(registry, str):
        registry = [registry]
    if (
        not isinstance(registry, list)
        or not registry
        or not all(isinstance(r, str) for r in registry)
    ):
        raise SpecError("must be a URL or a list of URLs", file=path, field="cluster.registry")
    return registry


def unit_nodes(
    value: Any, nodes: Sequence[str], head: str, *, source: Path, unit: str
) -> list[str]:
    """A unit's `nodes` value -> the node names it runs on, in the cluster's order."""
    if value is None:
        return [head]
    if value == "all":
        return list(nodes)
    if value == "others" and len(nodes) > 1:
        return [n for n in nodes if n != head]
    if value == "others":
        raise SpecError(
            f'"others" leaves no node: the cluster has only its head {head!r}',
            file=source, unit=unit, field="nodes",
        )  # fmt: skip
    if not isinstance(value, list) or not value or not all(isinstance(n, str) for n in value):
        raise SpecError(
            f'must be "all", "others" or a non-empty list of node names, got {value!r}',
            file=source,
            unit=unit,
            field="nodes",
        )
    unknown = [n for n in value if n not in nodes]
    if unknown:
        raise SpecError(
            f"unknown node {unknown[0]!r} (nodes: {', '.join(nodes)})",
            file=source,
            unit=unit,
            field="nodes",
        )
    return [n for n in nodes if n in value]


def runner_of(placed_on: Sequence[str], head: str) -> str:
    """The node whose copy of a unit another node's dependency is checked against."""
    return head if head in placed_on else placed_on[0]


def stop_tiers(edges: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Unit base names in tiers: every unit's tier comes before the tiers of what it
    depends on, so stopping tier by tier on every node is reverse dependency order."""
    depth: dict[str, int] = {}
    dependents = graph.dependents(edges)
    for name in graph.stop_order(edges):
        depth[name] = 1 + max((depth[d] for d in dependents.get(name, ())), default=-1)
    tiers: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for name in edges:
        tiers[depth[name]].append(name)
    return tiers
