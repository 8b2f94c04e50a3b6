"""Raw stack -> resolved Stack, as a pipeline of small steps, all before anything starts:

  expand instances (replicas -> `NAME@i`) -> assign ports (fixed, base + i, or allocated)
  -> render every string (`{ports.x}`, `{units.other.ports.y}`, `{vars.v}`, `{index}`, ...)
  and validate it (unknown keys are errors) -> link dependencies to instances -> order.

Each step collects every problem it finds (up to a bound) before the pipeline stops, so
one run names all that is wrong; each problem names the file, the unit and the field.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from dynamod.core import graph, limits, paths
from dynamod.core.errors import CycleError, SpecError, SpecErrors
from dynamod.core.placement import ClusterSpec
from dynamod.core.spec import links, nodes, tables, varformats
from dynamod.core.spec.files import STACK_ID_VAR, RawStack, RawUnit, check_id, load_stack
from dynamod.core.spec.models import Condition, LimitsSpec, SpecModel, UnitSpec
from dynamod.core.spec.render import Renderer, as_int, check_error_count, pydantic_errors
from dynamod.core.spec.stack import PortAllocator, Stack, StackSource
from dynamod.core.spec.vars import check_overrides

# keys of a unit table the resolver consumes itself; the rest is rendered and validated
_RESOLVER_KEYS = frozenset({"replicas", "ports", "depends_on", "nodes", "outside"})
T = TypeVar("T")


@dataclass(frozen=True)
class Instance:
    """One instance of a raw unit: `NAME` (index None) or replica `NAME@i`. `remote` names
    the node that runs it when this node only depends on it; `outside` the HOST:PORT of a
    unit that runs outside the stack (`outside = "{vars.etcd}"` rendered non-empty)."""

    name: str
    raw: RawUnit
    index: int | None = None
    remote: str | None = None
    outside: tuple[str, int] | None = None


@dataclass
class Expanded:
    """The instances of every unit this node runs or depends on, in the stack's order."""

    units: dict[str, tuple[RawUnit, list[Instance]]] = field(default_factory=dict)
    instances: dict[str, Instance] = field(default_factory=dict)
    replicated: dict[str, list[str]] = field(default_factory=dict)  # unit -> its replicas

    def add(self, raw: RawUnit, members: list[Instance], *, replicated: bool) -> None:
        self.units[raw.name] = (raw, members)
        self.instances.update((i.name, i) for i in members)
        if replicated:
            self.replicated[raw.name] = [i.name for i in members]


def resolve_stack(
    raw: RawStack,
    *,
    state_dir: Path,
    allocate_port: PortAllocator,
    python: str | None = None,
    pinned: Mapping[str, Mapping[str, int]] | None = None,
    node: str | None = None,
) -> Stack:
    """Expand, allocate, render and validate. Raises SpecErrors listing every problem.
    `pinned` (instance -> port name -> port) keeps ports allocated earlier: an allocated
    (port = 0) port named there is not allocated again. For a stack with a [cluster] table,
    `node` (default: the head) picks the node whose share of the stack is resolved; units of
    other nodes that its units depend on become stand-ins (`remote`), rendered for the node
    that runs them."""
    renderer = Renderer()
    python = python or sys.executable
    cluster, where = _first(lambda: _nodes(raw, node))
    context = _first(lambda: base_context(raw, state_dir, python, cluster, renderer))
    stack_id = _first(lambda: check_id(context["vars"].get(STACK_ID_VAR), raw.path, "--var"))
    extra = _first(lambda: tables.extra_replicas(raw, context, renderer))
    if cluster is not None:
        placed = cluster
        cluster = _first(lambda: nodes.with_registry(placed, raw, context, renderer, where))
    errors: list[SpecError] = []
    expanded = expand_instances(raw, where, context, renderer, extra, errors)
    ports = assign_ports(expanded, context, renderer, PortSource(allocate_port, pinned), errors)
    _raise_any(errors)
    units = units_context(expanded, ports)
    unit_context = {**context, "units": units}
    specs = build_specs(expanded, ports, unit_context, cluster, renderer, sorted(raw.units), errors)
    _raise_any(errors)
    order = start_order(specs)
    errors.extend(links.check_completed(specs))
    found = tables.stack_tables(raw, unit_context, specs, renderer, errors)
    _raise_any(errors)
    source = StackSource(raw, state_dir, python, node)
    return Stack(
        raw.name, raw.path, specs, order, source=source, cluster=cluster, tables=found,
        id=stack_id, max_starting=raw.max_starting,
    )  # fmt: skip


def _first(step: Callable[[], T]) -> T:
    """A step that stops at its first problem."""
    try:
        return step()
    except SpecError as exc:
        raise SpecErrors([exc]) from None


def _raise_any(errors: list[SpecError]) -> None:
    if errors:
        raise SpecErrors(errors)


def _nodes(raw: RawStack, node: str | None) -> tuple[ClusterSpec | None, nodes.Where]:
    cluster = nodes.cluster_of(raw, node)
    return cluster, nodes.placements(raw, cluster)


def base_context(
    raw: RawStack, state_dir: Path, python: str, cluster: ClusterSpec | None, renderer: Renderer
) -> dict[str, Any]:
    """What every template sees. Vars may be templates themselves
    (model_dir = "{cache_dir}/models/{vars.model_name}"), rendered here once."""
    context: dict[str, Any] = {
        "vars": raw.vars,
        "state_dir": str(state_dir),
        "cache_dir": str(paths.cache_dir()),
        "python": python,
        "stack_dir": str(raw.path.parent),
        **(cluster.context(cluster.node) if cluster else {}),
    }
    holder = RawUnit(name="[vars]", source=raw.path, table={})
    context["vars"] = {
        key: renderer.field(value, context, holder, f"vars.{key}")
        for key, value in raw.vars.items()
    }
    varformats.check_values(context["vars"], raw.formats, raw.overrides(), raw.path)
    return context


# --------------------------------------------------------------------------- 1. expand


def expand_instances(
    raw: RawStack,
    where: nodes.Where,
    context: Mapping[str, Any],
    renderer: Renderer,
    extra: Mapping[str, int],
    errors: list[SpecError],
) -> Expanded:
    """Every unit this node runs or depends on -> its instances: `replicas = N` (plus the
    unit's `extra` instances) makes `NAME@0` .. `NAME@N-1`, none makes `NAME`."""
    expanded = Expanded()
    for unit in raw.units.values():
        if unit.name not in where.local and unit.name not in where.remote:
            continue
        remote = where.remote.get(unit.name)
        try:
            value = renderer.field(unit.table.get("replicas"), context, unit, "replicas")
            room = limits.MAX_INSTANCES - len(expanded.instances)
            outside = outside_address(unit, context, renderer)
            if outside is not None:
                if value is not None:
                    raise SpecError("a unit outside the stack has no replicas here",
                                    file=unit.source, unit=unit.name, field="outside")  # fmt: skip
                instance = replace(_single(unit, None, room), outside=outside)
                expanded.add(unit, [instance], replicated=False)
                continue
            if value is None:
                expanded.add(unit, [_single(unit, remote, room)], replicated=False)
                continue
            count = as_int(value, unit, "replicas", 0, limits.MAX_INSTANCES)
            count += extra.get(unit.name, 0)
            if count > room:
                raise SpecError(
                    f"{count} replicas would make the stack more than "
                    f"{limits.MAX_INSTANCES} unit instances",
                    file=unit.source,
                    unit=unit.name,
                    field="replicas",
                )
            members = [Instance(f"{unit.name}@{i}", unit, i, remote) for i in range(count)]
            expanded.add(unit, members, replicated=True)
        except SpecError as exc:
            errors.append(exc)
            check_error_count(errors)
    return expanded


def _single(unit: RawUnit, remote: str | None, room: int) -> Instance:
    if room <= 0:
        raise SpecError(
            f"more than {limits.MAX_INSTANCES} unit instances in the stack",
            file=unit.source,
            unit=unit.name,
        )
    return Instance(unit.name, unit, None, remote)


def outside_address(
    unit: RawUnit, context: Mapping[str, Any], renderer: Renderer
) -> tuple[str, int] | None:
    """`outside = "HOST:PORT"`: the unit runs outside the stack there (this stack only
    waits for it to answer); empty or absent: the stack runs it."""
    value = renderer.field(unit.table.get("outside", ""), context, unit, "outside")
    if value in ("", None):
        return None
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= limits.MAX_PORT:
        raise SpecError(
            f"expects HOST:PORT (or empty: the stack runs it), got {value!r}",
            file=unit.source,
            unit=unit.name,
            field="outside",
        )
    return host.strip("[]"), int(port)


# --------------------------------------------------------------------------- 2. ports


@dataclass
class PortSource:
    """Where a `port = 0` gets its number: kept from an earlier resolution (`pinned`:
    instance -> port name -> port), else the allocator, at most MAX_ALLOCATED_PORTS."""

    allocate: PortAllocator
    pinned: Mapping[str, Mapping[str, int]] | None = None
    allocated: int = 0

    def take(self, instance: Instance, name: str) -> int:
        self.allocated += 1
        kept = (self.pinned or {}).get(instance.name, {}).get(name)
        return kept or self._allocate(instance, f"ports.{name}")

    def _allocate(self, instance: Instance, where: str) -> int:
        source = instance.raw.source
        if self.allocated > limits.MAX_ALLOCATED_PORTS:
            raise SpecError(
                f"more than {limits.MAX_ALLOCATED_PORTS} ports to allocate (port = 0) in "
                "the stack",
                file=source,
                unit=instance.name,
                field=where,
            )
        try:
            return self.allocate()
        except OSError as exc:
            raise SpecError(
                f"cannot allocate a free port: {exc}", file=source, unit=instance.name, field=where
            ) from None


def assign_ports(
    expanded: Expanded,
    context: Mapping[str, Any],
    renderer: Renderer,
    source: PortSource,
    errors: list[SpecError],
) -> dict[str, dict[str, int]]:
    """Every instance's ports, which other units' templates may reference: a fixed port
    (a replica of a fixed base port listens on base + index) or 0, allocated."""
    ports: dict[str, dict[str, int]] = {}
    for raw, members in expanded.units.values():
        try:
            table = _port_table(raw)
            for instance in members:
                ports[instance.name] = {}  # filled in place: a partial entry on an error
                _instance_ports(instance, table, context, renderer, source, ports[instance.name])
        except SpecError as exc:
            errors.append(exc)
            check_error_count(errors)
    return ports


def _port_table(raw: RawUnit) -> dict[str, Any]:
    table = raw.table.get("ports", {})
    if not isinstance(table, dict):
        raise SpecError(
            "must be a table of name = port", file=raw.source, unit=raw.name, field="ports"
        )
    if len(table) > limits.MAX_PORTS_PER_UNIT:
        raise SpecError(
            f"{len(table)} ports; a unit may have at most {limits.MAX_PORTS_PER_UNIT}",
            file=raw.source,
            unit=raw.name,
            field="ports",
        )
    return table


def _instance_ports(
    instance: Instance,
    table: Mapping[str, Any],
    context: Mapping[str, Any],
    renderer: Renderer,
    source: PortSource,
    out: dict[str, int],
) -> None:
    raw, index = instance.raw, instance.index
    context = {**context, "index": index if index is not None else 0}
    if instance.outside is not None:  # it listens where `outside` says: nothing to allocate
        out.update((name, instance.outside[1]) for name in table)
        return
    for name, value in table.items():
        where = f"ports.{name}"
        number = as_int(renderer.field(value, context, raw, where), raw, where, 0, limits.MAX_PORT)
        if number == 0 and instance.remote:
            raise SpecError(
                f"runs on node {instance.remote} and a unit of node "
                f"{_here(context)} depends on it: it needs a fixed port (each node has its "
                "own), not 0",
                file=raw.source,
                unit=instance.name,
                field=where,
            )
        if number == 0:
            number = source.take(instance, name)
        elif index is not None and isinstance(value, int):
            number += index  # a fixed base port: instance i listens on base + i
            if number > limits.MAX_PORT:
                raise SpecError(
                    f"base port {value} + replica index {index} = {number} "
                    f"is above {limits.MAX_PORT}",
                    file=raw.source,
                    unit=instance.name,
                    field=where,
                )
        out[name] = number


def _here(context: Mapping[str, Any]) -> str:
    """The name of the node being resolved (`{node.name}`), for messages."""
    node = context.get("node")
    return str(node.get("name", "?")) if isinstance(node, Mapping) else "?"


def units_context(expanded: Expanded, ports: Mapping[str, dict[str, int]]) -> dict[str, Any]:
    """`{units.NAME.ports.x}` and `{units.NAME.host}` (where to reach it: the HOST of a unit
    outside the stack, else 127.0.0.1) for every instance, `{units.NAME.instances}` for a
    replicated unit."""
    context: dict[str, Any] = {
        name: {"ports": p, "host": _host(expanded.instances[name])} for name, p in ports.items()
    }
    for base, members in expanded.replicated.items():
        context.setdefault(base, {"instances": members})
    return context


def _address(outside: tuple[str, int] | None) -> str | None:
    return f"{outside[0]}:{outside[1]}" if outside is not None else None


def _host(instance: Instance) -> str:
    return instance.outside[0] if instance.outside is not None else "127.0.0.1"


# --------------------------------------------------------------------------- 3. render + 4. link


def build_specs(
    expanded: Expanded,
    ports: Mapping[str, dict[str, int]],
    context: Mapping[str, Any],
    cluster: ClusterSpec | None,
    renderer: Renderer,
    unit_names: list[str],
    errors: list[SpecError],
) -> dict[str, UnitSpec]:
    """Render, link and validate every instance; `context` has the base and `units`."""
    specs: dict[str, UnitSpec] = {}
    for instance in expanded.instances.values():
        check_error_count(errors)
        try:
            rendered, deps = render_unit(instance, ports[instance.name], context, cluster, renderer)
        except SpecError as exc:
            errors.append(exc)
            continue
        linked, problems = links.link(
            instance.name, instance.raw, deps, expanded.instances, expanded.replicated, unit_names
        )
        errors.extend(problems)
        try:
            specs[instance.name] = validate_unit(instance, rendered, ports[instance.name], linked)
        except SpecErrors as exc:
            errors.extend(exc.errors)
    return specs


def render_unit(
    instance: Instance,
    ports: dict[str, int],
    context: Mapping[str, Any],
    cluster: ClusterSpec | None,
    renderer: Renderer,
) -> tuple[dict[str, Any], dict[str, Condition]]:
    """One instance's fields rendered, and its dependencies as written (a stand-in for
    another node's unit has none here: that node starts it)."""
    raw, remote = instance.raw, instance.remote
    context = {
        **context,
        **(cluster.context(remote) if cluster and remote else {}),
        "name": instance.name,
        "unit": raw.name,
        "index": instance.index if instance.index is not None else 0,
        "unit_dir": str(raw.source.parent),
        "ports": ports,
    }
    if "remote" in raw.table:
        raise SpecError(
            "unknown key (dynamod sets it for units of other nodes)",
            file=raw.source,
            unit=raw.name,
            field="remote",
        )
    if "tables" in raw.table:  # UnitSpec.tables is the resolver's, never a file's
        raise SpecError("unknown key", file=raw.source, unit=raw.name, field="tables")
    deps = {} if remote or instance.outside else links.dependencies(raw)
    table = {k: v for k, v in raw.table.items() if k not in _RESOLVER_KEYS}
    rendered: dict[str, Any] = renderer.field(table, context, raw, "")
    if instance.outside is not None:
        rendered["ready"] = _outside_probe(instance.outside, rendered.get("ready"))
    if remote and rendered.get("ready") is None:
        raise SpecError(
            f"runs on node {remote} and a unit of node {cluster.node if cluster else '?'} "
            "depends on it: it needs a ready probe to check it by from there",
            file=raw.source,
            unit=raw.name,
            field="ready",
        )
    if cluster is not None and not remote:
        env = rendered.get("env", {})
        if isinstance(env, dict):
            rendered["env"] = {**cluster.environment(), **env}
    return rendered, deps


def _outside_probe(address: tuple[str, int], ready: Any) -> dict[str, Any]:
    """A unit outside the stack is ready while its address takes a TCP connection (its own
    probe may name ports it has not there), at the pace its probe asked for."""
    pace = {k: ready[k] for k in ("interval", "timeout") if k in ready} if isinstance(
        ready, Mapping) else {}  # fmt: skip
    return {"kind": "tcp", "host": address[0], "port": address[1], **pace}


def validate_unit(
    instance: Instance,
    rendered: Mapping[str, Any],
    ports: dict[str, int],
    depends_on: dict[str, Condition],
) -> UnitSpec:
    """The rendered fields and what the resolver decided -> a UnitSpec, or SpecErrors
    naming every field that is wrong (in the unit's registered tables too)."""
    fields = dict(rendered)
    found, errors = tables.unit_tables(fields, instance.raw, instance.name)
    try:
        spec = _unit_spec(instance, fields, ports, depends_on, found)
    except ValidationError as exc:
        errors.extend(pydantic_errors(exc, instance.raw, instance.name))
    if errors:
        raise SpecErrors(errors)
    return spec


def _unit_spec(
    instance: Instance,
    rendered: Mapping[str, Any],
    ports: dict[str, int],
    depends_on: dict[str, Condition],
    found: dict[str, SpecModel],
) -> UnitSpec:
    spec = UnitSpec.model_validate(
        {
            **rendered,
            "tables": found,
            "name": instance.name,
            "unit": instance.raw.name,
            "index": instance.index,
            "source": str(instance.raw.source),
            "ports": ports,
            "depends_on": depends_on,
            "remote": instance.remote or _address(instance.outside),
            "outside": _address(instance.outside),
        }
    )
    return placed(spec)


def placed(spec: UnitSpec) -> UnitSpec:
    """The replica's CPUs (its `placement`) as its cpuset, unless `limits` names one, and
    in the environment variable `placement.cpus_env` names."""
    cpus = spec.placement.cpus(spec.index) if spec.placement is not None else None
    if cpus is None or spec.placement is None:
        return spec
    limits = spec.limits or LimitsSpec()
    if limits.cpuset is None:
        limits = limits.model_copy(update={"cpuset": cpus})
    env = dict(spec.env)
    if spec.placement.cpus_env is not None:
        env[spec.placement.cpus_env] = limits.cpuset or cpus
    return spec.model_copy(update={"limits": limits, "env": env})


# --------------------------------------------------------------------------- 5. order


def start_order(specs: Mapping[str, UnitSpec]) -> list[str]:
    """Dependencies first; a cycle is one error naming its units."""
    edges = {name: list(spec.depends_on) for name, spec in specs.items()}
    try:
        return graph.start_order(edges)
    except graph.Cycle as exc:
        first = specs[exc.cycle[0]]
        raise SpecErrors([CycleError(exc.cycle, file=first.source)]) from None


def load(
    path: Path,
    *,
    state_dir: Path,
    allocate_port: PortAllocator,
    var_overrides: Mapping[str, Any] | None = None,
    node: str | None = None,
) -> Stack:
    """load_stack + resolve_stack: the one call the CLI and the daemon use. A `--var`
    that names no variable of the stack is refused before anything is rendered."""
    raw = load_stack(path, var_overrides)
    check_overrides(raw, var_overrides or {})
    return resolve_stack(raw, state_dir=state_dir, allocate_port=allocate_port, node=node)
