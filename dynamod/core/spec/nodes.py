"""Which node runs which unit of a `[cluster]` stack, seen from one node: the units it
runs, the units of other nodes it only depends on (checked remotely), and the registry
endpoints and cross-node stop tiers every node must agree on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamod.core import graph, placement
from dynamod.core.errors import SpecError
from dynamod.core.placement import ClusterSpec
from dynamod.core.spec.files import RawStack, RawUnit
from dynamod.core.spec.links import dependencies
from dynamod.core.spec.models import http_url
from dynamod.core.spec.render import Renderer


@dataclass(frozen=True)
class Where:
    """Which units this node runs (`local`) and which it only depends on (`remote`:
    unit -> the node whose copy is checked)."""

    local: frozenset[str]
    remote: dict[str, str]
    placed: dict[str, list[str]]


def cluster_of(raw: RawStack, node: str | None) -> ClusterSpec | None:
    if raw.cluster is None:
        if node is not None:
            raise SpecError(
                f"--node {node!r} needs a stack with a [cluster] table; this one has none",
                file=raw.path,
                field="--node",
            )
        for unit in raw.units.values():
            if "nodes" in unit.table:
                raise SpecError(
                    "only a stack with a [cluster] table places units on nodes",
                    file=unit.source,
                    unit=unit.name,
                    field="nodes",
                )
        return None
    fields = placement.parse(raw.cluster, path=raw.path, node=node)
    return ClusterSpec(**fields)


def placements(raw: RawStack, cluster: ClusterSpec | None) -> Where:
    if cluster is None:
        return Where(frozenset(raw.units), {}, {})
    names = list(cluster.nodes)
    placed = {
        unit.name: placement.unit_nodes(
            unit.table.get("nodes"), names, cluster.head, source=unit.source, unit=unit.name
        )
        for unit in raw.units.values()
    }
    local = frozenset(name for name, on in placed.items() if cluster.node in on)
    remote: dict[str, str] = {}
    for name in sorted(local):
        for dep in dependencies(raw.units[name]):
            base = dep if dep in raw.units else dep.partition("@")[0]
            if base in raw.units and base not in local:
                remote[base] = placement.runner_of(placed[base], cluster.head)
    return Where(local, remote, placed)


def with_registry(
    cluster: ClusterSpec,
    raw: RawStack,
    context: Mapping[str, Any],
    renderer: Renderer,
    where: Where,
) -> ClusterSpec:
    """Render the registry endpoints and add what the whole cluster needs to know: each
    unit's nodes and the cross-node stop tiers."""
    holder = RawUnit(name="[cluster]", source=raw.path, table={})
    registry = [
        _http_url_or_error(renderer.field(url, context, holder, "cluster.registry"), raw.path)
        for url in cluster.registry
    ]
    edges: dict[str, list[str]] = {}
    for unit in raw.units.values():
        deps = dependencies(unit)
        edges[unit.name] = sorted(
            {d if d in raw.units else d.partition("@")[0] for d in deps} & set(raw.units)
        )
    try:
        tiers = placement.stop_tiers(edges)
    except graph.Cycle:
        tiers = [list(raw.units)]  # the cycle is reported with its units further on
    return cluster.model_copy(
        update={"registry": registry, "placement": where.placed, "stop_tiers": tiers}
    )


def _http_url_or_error(value: Any, path: Path) -> str:
    try:
        return http_url(str(value))
    except ValueError as exc:
        raise SpecError(str(exc), file=path, field="cluster.registry") from None


