"""Unit and stack files (TOML) -> typed, validated, fully rendered unit specs.

A stack file lists units directly (`[units.NAME]`) and/or includes unit files
(`[stack] include = [...]`, paths relative to the including file). `[vars]` tables give
template defaults; the stack's vars override included ones and `--var` overrides both.

Resolution order, all before anything starts:
  raw tables -> replicas expanded to `NAME@i` -> ports fixed or allocated -> every string
  rendered (`{ports.x}`, `{units.other.ports.y}`, `{vars.v}`, `{index}`, ...) -> pydantic
  validation (unknown keys are errors) -> dependency references checked -> graph checked.
Every error names the file, the unit and the field. Sizes, counts and durations are
bounded (`core/limits.py`): going past a bound is a SpecError, never a memory exhaustion.
"""

from __future__ import annotations

import signal as _signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from dynamod.core import graph, limits, paths, placement, tomlfile
from dynamod.core.errors import CycleError, SpecError, SpecErrors
from dynamod.core.placement import ClusterSpec
from dynamod.core.template import TemplateError, render

# --------------------------------------------------------------------------- models


class Condition(StrEnum):
    """What a dependent waits for: process spawned, probe passed, or exited 0."""

    STARTED = "started"
    READY = "ready"
    COMPLETED = "completed"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _seconds(default: float, *, positive: bool, description: str | None = None) -> Any:
    """A duration: finite, at most a day; zero allowed unless `positive`."""
    return Field(
        default,
        gt=0 if positive else None,
        ge=None if positive else 0,
        le=limits.MAX_SECONDS,
        allow_inf_nan=False,
        description=description,
    )


def _count(
    default: int, *, minimum: int, maximum: int = limits.MAX_COUNT, description: str | None = None
) -> Any:
    return Field(default, ge=minimum, le=maximum, description=description)


def _http_url(value: str) -> str:
    """An http(s) URL with a host (and a valid port, if any): what probes and clients
    will connect to, refused here rather than at the first connection attempt."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise ValueError(f"not a valid URL: {exc}") from None
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {value!r}")
    return value


HttpUrl = Annotated[str, AfterValidator(_http_url)]


def _http_urls(value: str) -> str:
    """One http(s) URL or a comma-separated list of them (as ETCD_ENDPOINTS holds: every
    member of a replicated etcd, so a client fails over between them); each is checked."""
    items = [item.strip() for item in value.split(",")]
    if not all(items):
        raise ValueError(f"expected comma-separated http(s) URLs, got {value!r}")
    for item in items:
        _http_url(item)
    return value


HttpUrls = Annotated[str, AfterValidator(_http_urls)]


class _ProbeBase(_Model):
    interval: float = _seconds(0.2, positive=True, description="seconds between attempts")
    timeout: float = _seconds(2.0, positive=True, description="seconds one attempt may take")
    deadline: float = _seconds(
        120.0,
        positive=True,
        description="readiness: seconds from spawn until the unit must be ready",
    )
    failure_threshold: int = _count(
        3, minimum=1, description="liveness: consecutive failures before the unit is restarted"
    )


class TcpProbe(_ProbeBase):
    kind: Literal["tcp"]
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=limits.MAX_PORT)


class HttpProbe(_ProbeBase):
    kind: Literal["http"]
    url: HttpUrl
    method: Literal["GET", "POST"] = "GET"
    expect_status: int = Field(200, ge=100, le=599)
    expect_json: dict[str, Any] | None = Field(
        None, description="every key given must be present with this value (recursive)"
    )


class ExecProbe(_ProbeBase):
    kind: Literal["exec"]
    command: list[str] = Field(min_length=1)


class LogProbe(_ProbeBase):
    kind: Literal["log"]
    pattern: str

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        import re

        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from exc
        return value


class DynamoFrontendProbe(_ProbeBase):
    """Ready = enough `generate` instances registered and the model listed in /v1/models."""

    kind: Literal["dynamo_frontend"]
    url: HttpUrl
    namespace: str
    model: str
    min_instances: int = Field(1, ge=0, le=limits.MAX_INSTANCES)


Probe = Annotated[
    TcpProbe | HttpProbe | ExecProbe | LogProbe | DynamoFrontendProbe,
    Field(discriminator="kind"),
]


class RestartSpec(_Model):
    policy: Literal["never", "on-failure", "always"] = "on-failure"
    first_delay: float = _seconds(
        0.0, positive=False, description="delay of the first restart after the unit ran well"
    )
    backoff_initial: float = _seconds(
        0.1, positive=False, description="delay of the second restart in a row"
    )
    backoff_max: float = _seconds(30.0, positive=False)
    backoff_factor: float = Field(2.0, ge=1, le=100, allow_inf_nan=False)
    jitter: float = Field(0.2, ge=0, le=1, description="+/- fraction of each delay")
    limit_burst: int = _count(5, minimum=1, description="restarts allowed within limit_interval")
    limit_interval: float = _seconds(60.0, positive=True)
    reset_after: float = _seconds(
        30.0, positive=False, description="seconds of uptime after which backoff starts over"
    )
    clean_exit_final: bool = Field(
        False,
        description="a service that exits 0 after it was ready is done (completed), not failed",
    )
    give_up: bool = Field(
        True,
        description="past the restart limit the unit fails; false: it retries every backoff_max",
    )
    min_uptime: float = Field(
        1.0,
        ge=0,
        description="a unit without a readiness probe counts ready after this long up",
    )


class StopSpec(_Model):
    signal: str = "SIGTERM"
    timeout: float = _seconds(
        10.0, positive=False, description="seconds before SIGKILL to the group"
    )

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        name = value.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        if name not in _signal.Signals.__members__:
            raise ValueError(f"unknown signal {value!r}")
        return name

    @property
    def signum(self) -> _signal.Signals:
        return _signal.Signals[self.signal]


class DynamoWorkerSpec(_Model):
    """Marks a unit as a Dynamo worker: on death its etcd registration is revoked at once."""

    etcd: HttpUrls
    namespace: str
    system_url: HttpUrl


class PolicySpec(_Model):
    """The stack's policy ledger and which units are rollout shards (`[policy]` table)."""

    store: Literal["etcd", "file"] = "etcd"
    etcd: HttpUrls | None = Field(
        None, description="etcd endpoint(s), comma-separated, when store = 'etcd'"
    )
    shards: list[str] = Field(min_length=1, description="unit names that are rollout shards")
    keep: int = _count(
        3, minimum=1, maximum=1000, description="policy versions kept in the ledger's history"
    )
    min_ready_shards: int = Field(1, ge=0, le=limits.MAX_INSTANCES)
    spares: int = Field(
        0,
        ge=0,
        le=limits.MAX_INSTANCES,
        description="extra shard instances kept ready at the current version, unrouted",
    )
    initial_version: int = Field(
        0, ge=0, le=2**63 - 1, description="version of the weights shards boot with"
    )
    taint_prefix: str = "dynamod.policy/"
    replay_backoff_initial: float = _seconds(0.5, positive=True)
    replay_backoff_max: float = _seconds(10.0, positive=True)
    call_timeout: float = _seconds(
        300.0, positive=True, description="seconds one engine admin call may take"
    )
    route_timeout: float = _seconds(
        60.0,
        positive=True,
        description="seconds a shard may wait for the router to route its new version",
    )


class UnitSpec(_Model):
    """One runnable instance, fully rendered. Replicas become `NAME@i` instances."""

    name: str
    unit: str
    index: int | None = None
    source: str
    description: str = ""
    type: Literal["service", "oneshot"] = "service"
    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    ports: dict[str, int] = Field(default_factory=dict)
    depends_on: dict[str, Condition] = Field(default_factory=dict)
    ready: Probe | None = None
    live: Probe | None = None
    restart: RestartSpec = RestartSpec()
    stop: StopSpec = StopSpec()
    install_hint: str | None = None
    dynamo: DynamoWorkerSpec | None = None
    remote: str | None = Field(
        None,
        description="set by the resolver, never in a file: the node that runs this unit; "
        "here it is only a dependency, ready when its probe passes against that node",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not key or "=" in key:
                raise ValueError(f"environment variable name {key!r} is empty or has '='")
        return value


# --------------------------------------------------------------------------- raw files


@dataclass
class RawUnit:
    name: str
    source: Path
    table: dict[str, Any]


@dataclass
class RawStack:
    path: Path
    name: str
    units: dict[str, RawUnit] = field(default_factory=dict)
    vars: dict[str, Any] = field(default_factory=dict)
    policy: dict[str, Any] | None = None
    cluster: dict[str, Any] | None = None
    files_read: int = 0


_STACK_KEYS = {"stack", "vars", "units", "policy", "cluster"}
_STACK_TABLE_KEYS = {"name", "include", "description"}


def load_stack(path: Path, var_overrides: Mapping[str, Any] | None = None) -> RawStack:
    """Read a stack file and everything it includes. No rendering, no validation yet."""
    path = tomlfile.resolve(path)
    stack = RawStack(path=path, name=path.stem)
    included_vars: dict[str, Any] = {}
    _load_file(path, stack, included_vars, chain=[])
    stack.vars = {**included_vars, **stack.vars, **(var_overrides or {})}
    return stack


def _load_file(
    path: Path, stack: RawStack, included_vars: dict[str, Any], chain: list[Path]
) -> None:
    if path in chain:
        cycle = " -> ".join(str(p) for p in [*chain, path])
        raise SpecError(f"include cycle: {cycle}", file=chain[-1], field="stack.include")
    if len(chain) > limits.MAX_INCLUDE_DEPTH:
        raise SpecError(
            f"includes nest more than {limits.MAX_INCLUDE_DEPTH} levels deep",
            file=chain[-1],
            field="stack.include",
        )
    stack.files_read += 1
    if stack.files_read > limits.MAX_FILES:
        raise SpecError(
            f"the stack reads more than {limits.MAX_FILES} files (with its includes)",
            file=chain[-1] if chain else path,
            field="stack.include",
        )
    data = tomlfile.read(path, included_from=chain[-1] if chain else None)
    for key in data:
        if key not in _STACK_KEYS:
            raise SpecError(
                f"unknown top-level table {key!r} "
                "(expected one of: stack, vars, units, policy, cluster)",
                file=path,
                field=key,
            )
    is_root = not chain
    header = data.get("stack", {})
    if not isinstance(header, dict):
        raise SpecError("must be a table", file=path, field="stack")
    for key in header:
        if key not in _STACK_TABLE_KEYS:
            raise SpecError(f"unknown key {key!r}", file=path, field=f"stack.{key}")
    if is_root and "name" in header:
        stack.name = _stack_name(header["name"], path)

    file_vars = data.get("vars", {})
    if not isinstance(file_vars, dict):
        raise SpecError("must be a table", file=path, field="vars")
    if is_root:
        stack.vars = dict(file_vars)
    else:
        for key, value in file_vars.items():
            included_vars.setdefault(key, value)

    if "policy" in data:
        if not is_root:
            raise SpecError(
                "only the stack file itself may have a [policy] table", file=path, field="policy"
            )
        if not isinstance(data["policy"], dict):
            raise SpecError("must be a table", file=path, field="policy")
        stack.policy = data["policy"]

    if "cluster" in data:
        if not is_root:
            raise SpecError(
                "only the stack file itself may have a [cluster] table", file=path, field="cluster"
            )
        if not isinstance(data["cluster"], dict):
            raise SpecError("must be a table", file=path, field="cluster")
        stack.cluster = data["cluster"]

    includes = header.get("include", [])
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise SpecError("must be a list of file paths", file=path, field="stack.include")
    for include in includes:
        target = tomlfile.resolve(
            path.parent / include, referenced_from=path, field="stack.include"
        )
        _load_file(target, stack, included_vars, [*chain, path])

    units = data.get("units", {})
    if not isinstance(units, dict):
        raise SpecError("must be a table of units", file=path, field="units")
    for name, table in units.items():
        if not name or not set(name) <= limits.UNIT_NAME_CHARS:
            raise SpecError(
                "unit names may use letters, digits, '_' and '-' only", file=path, unit=name
            )
        if len(name) > limits.MAX_NAME_LENGTH:
            raise SpecError(
                f"unit names may be at most {limits.MAX_NAME_LENGTH} characters long",
                file=path,
                unit=name,
            )
        if not isinstance(table, dict):
            raise SpecError("must be a table", file=path, unit=name)
        if name in stack.units:
            other = stack.units[name].source
            if other == path:  # one file reached through two includes: one copy of it
                continue
            raise SpecError(f"unit is also defined in {other}", file=path, unit=name)
        stack.units[name] = RawUnit(name=name, source=path, table=table)
        if len(stack.units) > limits.MAX_INSTANCES:
            raise SpecError(
                f"more than {limits.MAX_INSTANCES} units in the stack", file=path, unit=name
            )


def _stack_name(value: Any, path: Path) -> str:
    """It names systemd services and supervisord groups: the unit-name alphabet plus '.'."""
    if (
        not isinstance(value, str)
        or not value
        or len(value) > limits.MAX_NAME_LENGTH
        or not set(value) <= limits.UNIT_NAME_CHARS | {"."}
    ):
        raise SpecError(
            f"must be a name of at most {limits.MAX_NAME_LENGTH} letters, digits, '_', '-' "
            f"or '.', got {value!r}",
            file=path,
            field="stack.name",
        )
    return value


# --------------------------------------------------------------------------- resolution


PortAllocator = Callable[[], int]


@dataclass(frozen=True)
class StackSource:
    """What `resolve_stack` rendered a stack from: the same inputs render it again."""

    raw: RawStack
    state_dir: Path
    python: str
    node: str | None = None


@dataclass(frozen=True)
class Stack:
    """A validated stack: instances in start order, ready for the engine."""

    name: str
    path: Path
    units: dict[str, UnitSpec]
    order: list[str]
    policy: PolicySpec | None = None
    # what it was resolved from, so allocated ports can be moved and the stack re-rendered
    source: StackSource | None = field(default=None, compare=False, repr=False)
    cluster: ClusterSpec | None = None

    def shards(self) -> list[str]:
        """Instance names of this node's rollout shards, in start order."""
        if self.policy is None:
            return []
        return [
            n
            for n in self.order
            if self.units[n].unit in self.policy.shards and self.units[n].remote is None
        ]


class _Renderer:
    """Renders the strings of unit fields within the stack's output budget: every string
    at most MAX_RENDERED_CHARS, everything rendered for the stack (replicas repeat their
    unit) at most MAX_RENDERED_TOTAL, so no stack renders itself into memory exhaustion."""

    _PER_VALUE = 8

    def __init__(self) -> None:
        self.left = limits.MAX_RENDERED_TOTAL

    def field(self, value: Any, context: Mapping[str, Any], raw: RawUnit, where: str) -> Any:
        """Render strings in `value`, turning template errors into SpecErrors at `where`."""
        if isinstance(value, str):
            try:
                out = render(value, context, limits.MAX_RENDERED_CHARS)
            except TemplateError as exc:
                raise SpecError(str(exc), file=raw.source, unit=raw.name, field=where) from None
            self._spend(len(out) + self._PER_VALUE, raw, where)
            return out
        self._spend(self._PER_VALUE, raw, where)
        if isinstance(value, dict):
            return {
                k: self.field(v, context, raw, f"{where}.{k}" if where else k)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self.field(v, context, raw, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    def _spend(self, amount: int, raw: RawUnit, where: str) -> None:
        self.left -= amount
        if self.left < 0:
            raise SpecError(
                f"the stack renders to more than {limits.MAX_RENDERED_TOTAL} characters "
                "(every replica repeats its unit's fields); make it smaller",
                file=raw.source,
                unit=raw.name,
                field=where or None,
            )


def _as_int(value: Any, raw: RawUnit, where: str, minimum: int, maximum: int) -> int:
    """An integer from TOML or a rendered template; floats and booleans are not integers."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    if number is None:
        raise SpecError(
            f"must be an integer, got {_short_repr(value)}",
            file=raw.source,
            unit=raw.name,
            field=where,
        )
    if not minimum <= number <= maximum:
        raise SpecError(
            f"must be between {minimum} and {maximum}, got {number}",
            file=raw.source,
            unit=raw.name,
            field=where,
        )
    return number


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dependencies(raw: RawUnit) -> dict[str, Condition]:
    value = raw.table.get("depends_on", {})
    if isinstance(value, list):
        value = {str(name): Condition.READY.value for name in value}
    if not isinstance(value, dict):
        raise SpecError(
            "must be a list of unit names or a table of name = condition",
            file=raw.source,
            unit=raw.name,
            field="depends_on",
        )
    if len(value) > limits.MAX_INSTANCES:
        raise SpecError(
            f"{len(value)} dependencies; a stack has at most {limits.MAX_INSTANCES} units",
            file=raw.source,
            unit=raw.name,
            field="depends_on",
        )
    deps: dict[str, Condition] = {}
    for name, cond in value.items():
        try:
            deps[name] = Condition(cond)
        except ValueError:
            raise SpecError(
                f"unknown condition {_short_repr(cond)} (expected started, ready or completed)",
                file=raw.source,
                unit=raw.name,
                field=f"depends_on.{name}",
            ) from None
    return deps


def _allocate(
    allocate_port: PortAllocator, allocated: int, raw: RawUnit, instance: str, where: str
) -> int:
    if allocated > limits.MAX_ALLOCATED_PORTS:
        raise SpecError(
            f"more than {limits.MAX_ALLOCATED_PORTS} ports to allocate (port = 0) in the stack",
            file=raw.source,
            unit=instance,
            field=where,
        )
    try:
        return allocate_port()
    except OSError as exc:
        raise SpecError(
            f"cannot allocate a free port: {exc}", file=raw.source, unit=instance, field=where
        ) from None


def _pydantic_errors(exc: ValidationError, raw: RawUnit, instance: str) -> list[SpecError]:
    errors = []
    for err in exc.errors(include_url=False)[: limits.MAX_REPORTED_ERRORS]:
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required but missing"
        elif err["type"] == "value_error":  # our own validators; they quote the value
            message = str(err.get("ctx", {}).get("error", err["msg"]))
        else:
            message = err["msg"]
            if "input" in err and not isinstance(err["input"], dict | list):
                message += f" (got {_short_repr(err['input'])})"
        errors.append(SpecError(message, file=raw.source, unit=instance, field=loc or None))
    return errors


# pydantic puts the probe's `kind` into an error's location; it is not a field the user wrote.
_PROBE_KINDS = frozenset(
    get_args(cls.model_fields["kind"].annotation)[0] for cls in get_args(get_args(Probe)[0])
)


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and part in _PROBE_KINDS


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
    errors: list[SpecError] = []
    renderer = _Renderer()
    python = python or sys.executable
    try:
        cluster = _cluster_of(raw, node)
        where = _placements(raw, cluster)
    except SpecError as exc:
        raise SpecErrors([exc]) from None
    base_context: dict[str, Any] = {
        "vars": raw.vars,
        "state_dir": str(state_dir),
        "cache_dir": str(paths.cache_dir()),
        "python": python,
        "stack_dir": str(raw.path.parent),
        **(cluster.context(cluster.node) if cluster else {}),
    }
    # Vars may be templates themselves (model_dir = "{cache_dir}/models/{vars.model_name}").
    holder = RawUnit(name="[vars]", source=raw.path, table={})
    base_context["vars"] = {
        key: renderer.field(value, base_context, holder, f"vars.{key}")
        for key, value in raw.vars.items()
    }

    # 1. replicas and ports, which other units' templates may reference.
    try:
        spares = _spare_replicas(raw, base_context, renderer)
        if cluster is not None:
            cluster = _with_registry(cluster, raw, base_context, renderer, where)
    except SpecError as exc:
        raise SpecErrors([exc]) from None
    instances: dict[str, tuple[RawUnit, int | None]] = {}
    ports: dict[str, dict[str, int]] = {}
    replicated: dict[str, list[str]] = {}
    runs_on: dict[str, str | None] = {}  # unit base name -> the node it is a stand-in for
    allocated = 0
    for raw_unit in raw.units.values():
        if cluster is not None:
            if raw_unit.name not in where.local and raw_unit.name not in where.remote:
                continue
            runs_on[raw_unit.name] = where.remote.get(raw_unit.name)
        try:
            replicas_value = renderer.field(
                raw_unit.table.get("replicas"), base_context, raw_unit, "replicas"
            )
            names: list[tuple[str, int | None]]
            if replicas_value is None:
                names = [(raw_unit.name, None)]
            else:
                room = limits.MAX_INSTANCES - len(instances)
                count = _as_int(replicas_value, raw_unit, "replicas", 0, limits.MAX_INSTANCES)
                count += spares.get(raw_unit.name, 0)
                if count > room:
                    raise SpecError(
                        f"{count} replicas would make the stack more than "
                        f"{limits.MAX_INSTANCES} unit instances",
                        file=raw_unit.source,
                        unit=raw_unit.name,
                        field="replicas",
                    )
                names = [(f"{raw_unit.name}@{i}", i) for i in range(count)]
                replicated[raw_unit.name] = [n for n, _ in names]
            port_table = raw_unit.table.get("ports", {})
            if not isinstance(port_table, dict):
                raise SpecError(
                    "must be a table of name = port",
                    file=raw_unit.source,
                    unit=raw_unit.name,
                    field="ports",
                )
            if len(port_table) > limits.MAX_PORTS_PER_UNIT:
                raise SpecError(
                    f"{len(port_table)} ports; a unit may have at most {limits.MAX_PORTS_PER_UNIT}",
                    file=raw_unit.source,
                    unit=raw_unit.name,
                    field="ports",
                )
            for instance, index in names:
                if len(instances) >= limits.MAX_INSTANCES:
                    raise SpecError(
                        f"more than {limits.MAX_INSTANCES} unit instances in the stack",
                        file=raw_unit.source,
                        unit=instance,
                    )
                instances[instance] = (raw_unit, index)
                context = {**base_context, "index": index if index is not None else 0}
                ports[instance] = {}
                for port_name, port_value in port_table.items():
                    where_port = f"ports.{port_name}"
                    rendered = renderer.field(port_value, context, raw_unit, where_port)
                    number = _as_int(rendered, raw_unit, where_port, 0, limits.MAX_PORT)
                    if number == 0 and runs_on.get(raw_unit.name):
                        raise SpecError(
                            f"runs on node {runs_on[raw_unit.name]} and a unit of node "
                            f"{cluster.node if cluster else '?'} depends on it: it needs a "
                            "fixed port (each node has its own), not 0",
                            file=raw_unit.source,
                            unit=instance,
                            field=where_port,
                        )
                    if number == 0:
                        allocated += 1
                        number = (pinned or {}).get(instance, {}).get(port_name) or _allocate(
                            allocate_port, allocated, raw_unit, instance, where_port
                        )
                    elif index is not None and isinstance(port_value, int):
                        number += index  # a fixed base port: instance i listens on base + i
                        if number > limits.MAX_PORT:
                            raise SpecError(
                                f"base port {port_value} + replica index {index} = {number} "
                                f"is above {limits.MAX_PORT}",
                                file=raw_unit.source,
                                unit=instance,
                                field=where_port,
                            )
                    ports[instance][port_name] = number
        except SpecError as exc:
            errors.append(exc)
            _check_error_count(errors)
    if errors:
        raise SpecErrors(errors)

    units_context: dict[str, Any] = {name: {"ports": p} for name, p in ports.items()}
    for base, members in replicated.items():
        units_context.setdefault(base, {"instances": members})

    # 2. render and validate every instance.
    specs: dict[str, UnitSpec] = {}
    for instance, (raw_unit, index) in instances.items():
        _check_error_count(errors)
        remote = runs_on.get(raw_unit.name)
        context = {
            **base_context,
            **(cluster.context(remote) if cluster and remote else {}),
            "name": instance,
            "unit": raw_unit.name,
            "index": index if index is not None else 0,
            "unit_dir": str(raw_unit.source.parent),
            "ports": ports[instance],
            "units": units_context,
        }
        try:
            if "remote" in raw_unit.table:
                raise SpecError(
                    "unknown key (dynamod sets it for units of other nodes)",
                    file=raw_unit.source,
                    unit=raw_unit.name,
                    field="remote",
                )
            deps = {} if remote else _dependencies(raw_unit)
            table = {
                k: v
                for k, v in raw_unit.table.items()
                if k not in {"replicas", "ports", "depends_on", "nodes"}
            }
            rendered = renderer.field(table, context, raw_unit, "")
            if remote and rendered.get("ready") is None:
                raise SpecError(
                    f"runs on node {remote} and a unit of node "
                    f"{cluster.node if cluster else '?'} depends on it: it needs a ready "
                    "probe to check it by from there",
                    file=raw_unit.source,
                    unit=raw_unit.name,
                    field="ready",
                )
            if cluster is not None and not remote:
                env = rendered.get("env", {})
                if isinstance(env, dict):
                    rendered["env"] = {**cluster.environment(), **env}
        except SpecError as exc:
            errors.append(exc)
            continue
        expanded_deps: dict[str, Condition] = {}
        for dep, cond in deps.items():
            targets = replicated.get(dep, [dep])
            for target in targets:
                if target not in instances:
                    errors.append(
                        SpecError(
                            f"depends on unknown unit {dep!r}"
                            + _known_hint(sorted({r.name for r in raw.units.values()})),
                            file=raw_unit.source,
                            unit=instance,
                            field=f"depends_on.{dep}",
                        )
                    )
                    continue
                if target == instance:
                    errors.append(
                        SpecError(
                            "a unit cannot depend on itself",
                            file=raw_unit.source,
                            unit=instance,
                            field=f"depends_on.{dep}",
                        )
                    )
                    continue
                expanded_deps[target] = cond
        try:
            specs[instance] = UnitSpec.model_validate(
                {
                    **rendered,
                    "name": instance,
                    "unit": raw_unit.name,
                    "index": index,
                    "source": str(raw_unit.source),
                    "ports": ports[instance],
                    "depends_on": expanded_deps,
                    "remote": remote,
                }
            )
        except ValidationError as exc:
            errors.extend(_pydantic_errors(exc, raw_unit, instance))
    if errors:
        raise SpecErrors(errors)

    edges = {name: list(spec.depends_on) for name, spec in specs.items()}
    try:
        order = graph.start_order(edges)
    except graph.Cycle as exc:
        first = specs[exc.cycle[0]]
        raise SpecErrors([CycleError(exc.cycle, file=first.source)]) from None
    _check_completed_deps(specs, errors)
    policy_context = {**base_context, "units": units_context}
    policy = _resolve_policy(raw, policy_context, specs, errors, renderer)
    if errors:
        raise SpecErrors(errors)
    source = StackSource(raw, state_dir, python, node)
    return Stack(
        name=raw.name,
        path=raw.path,
        units=specs,
        order=order,
        policy=policy,
        source=source,
        cluster=cluster,
    )


@dataclass(frozen=True)
class _Where:
    """Which units this node runs (`local`) and which it only depends on (`remote`:
    unit -> the node whose copy is checked)."""

    local: frozenset[str]
    remote: dict[str, str]
    placed: dict[str, list[str]]


def _cluster_of(raw: RawStack, node: str | None) -> ClusterSpec | None:
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


def _placements(raw: RawStack, cluster: ClusterSpec | None) -> _Where:
    if cluster is None:
        return _Where(frozenset(raw.units), {}, {})
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
        for dep in _dependencies(raw.units[name]):
            base = dep if dep in raw.units else dep.partition("@")[0]
            if base in raw.units and base not in local:
                remote[base] = placement.runner_of(placed[base], cluster.head)
    return _Where(local, remote, placed)


def _with_registry(
    cluster: ClusterSpec,
    raw: RawStack,
    context: Mapping[str, Any],
    renderer: _Renderer,
    where: _Where,
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
        deps = _dependencies(unit)
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
        return _http_url(str(value))
    except ValueError as exc:
        raise SpecError(str(exc), file=path, field="cluster.registry") from None


def _spare_replicas(
    raw: RawStack, context: Mapping[str, Any], renderer: _Renderer
) -> dict[str, int]:
    """`[policy] spares = K` adds K instances to the shard unit's replicas: the spares
    run beside the serving shards, which keep their own count."""
    if raw.policy is None or "spares" not in raw.policy:
        return {}
    holder = RawUnit(name="[policy]", source=raw.path, table=raw.policy)
    value = renderer.field(raw.policy["spares"], context, holder, "policy.spares")
    try:
        count = int(str(value)) if not isinstance(value, bool) else -1
    except ValueError:
        count = -1
    if not 0 <= count <= limits.MAX_INSTANCES:
        raise SpecError(
            f"must be an integer between 0 and {limits.MAX_INSTANCES}, got {value!r}",
            file=raw.path,
            field="policy.spares",
        )
    shards = raw.policy.get("shards")
    if count == 0 or not isinstance(shards, list):
        return {}
    if len(shards) != 1:
        raise SpecError(
            f"spares = {count} needs exactly one shard unit, got {shards!r}",
            file=raw.path,
            field="policy.spares",
        )
    unit = raw.units.get(str(shards[0]))
    if unit is not None and "replicas" not in unit.table:
        raise SpecError(
            f"spares = {count} needs shard unit {shards[0]!r} to have replicas",
            file=raw.path,
            field="policy.spares",
        )
    return {str(shards[0]): count}


def _resolve_policy(
    raw: RawStack,
    context: Mapping[str, Any],
    specs: Mapping[str, UnitSpec],
    errors: list[SpecError],
    renderer: _Renderer,
) -> PolicySpec | None:
    if raw.policy is None:
        return None
    holder = RawUnit(name="[policy]", source=raw.path, table=raw.policy)
    try:
        rendered = renderer.field(raw.policy, context, holder, "policy")
        policy = PolicySpec.model_validate(rendered)
    except SpecError as exc:
        errors.append(exc)
        return None
    except ValidationError as exc:
        errors.extend(
            SpecError(e.message, file=raw.path, field=f"policy.{e.field}" if e.field else "policy")
            for e in _pydantic_errors(exc, holder, "[policy]")
        )
        return None
    bases = {s.unit for s in specs.values()}
    for name in policy.shards:
        if name not in bases:
            errors.append(
                SpecError(
                    f"shard unit {name!r} is not in the stack", file=raw.path, field="policy.shards"
                )
            )
        elif not any(s.dynamo for s in specs.values() if s.unit == name):
            errors.append(
                SpecError(
                    f"shard unit {name!r} needs a [units.{name}.dynamo] table (system_url) so "
                    "dynamod can reach its engine routes",
                    file=raw.path,
                    field="policy.shards",
                )
            )
    if policy.store == "etcd" and not policy.etcd:
        errors.append(
            SpecError(
                "store = 'etcd' needs etcd = \"http://host:port\"",
                file=raw.path,
                field="policy.etcd",
            )
        )
    return policy


def _check_completed_deps(specs: Mapping[str, UnitSpec], errors: list[SpecError]) -> None:
    for spec in specs.values():
        for dep, cond in spec.depends_on.items():
            target = specs[dep]
            if cond is Condition.COMPLETED and target.restart.policy == "always":
                errors.append(
                    SpecError(
                        f"waits for {dep!r} to complete, but {dep!r} has restart policy "
                        "'always' and never completes",
                        file=spec.source,
                        unit=spec.name,
                        field=f"depends_on.{dep}",
                    )
                )


def _known_hint(names: list[str], shown: int = 20) -> str:
    listed = names[:shown] + ([f"... {len(names) - shown} more"] if len(names) > shown else [])
    return f" (units in this stack: {', '.join(listed)})" if names else ""


def _check_error_count(errors: list[SpecError]) -> None:
    """Stop early once enough is wrong: a hostile stack must not cost a problem per byte."""
    if len(errors) >= limits.MAX_COLLECTED_ERRORS:
        raise SpecErrors(errors[: limits.MAX_COLLECTED_ERRORS], more=True)


def load(
    path: Path,
    *,
    state_dir: Path,
    allocate_port: PortAllocator,
    var_overrides: Mapping[str, Any] | None = None,
    node: str | None = None,
) -> Stack:
    """load_stack + resolve_stack: the one call the CLI and the daemon use."""
    raw = load_stack(path, var_overrides)
    return resolve_stack(raw, state_dir=state_dir, allocate_port=allocate_port, node=node)


def parse_var(text: str) -> tuple[str, Any]:
    """`--var key=value`: ints stay ints so `replicas = "{vars.workers}"` just works."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SpecError(f"--var expects key=value, got {text!r}", field="--var")
    try:
        return key, int(value)
    except ValueError:
        return key, value
