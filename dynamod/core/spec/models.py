"""The typed, validated shape of a unit: its probes, restart and stop settings, and the
base models and field helpers every spec table (core's and extensions') is built from."""

from __future__ import annotations

import signal as _signal
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationInfo,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

from dynamod.core import limits
from dynamod.core.spec import quantities


class Condition(StrEnum):
    """What a dependent waits for: process spawned, probe passed, or exited 0."""

    STARTED = "started"
    READY = "ready"
    COMPLETED = "completed"


class SpecModel(BaseModel):
    """Every spec table: unknown keys are errors and a resolved spec never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def seconds(default: float, *, positive: bool, description: str | None = None) -> Any:
    """A duration: finite, at most a day; zero allowed unless `positive`."""
    return Field(
        default,
        gt=0 if positive else None,
        ge=None if positive else 0,
        le=limits.MAX_SECONDS,
        allow_inf_nan=False,
        description=description,
    )


def count(
    default: int, *, minimum: int, maximum: int = limits.MAX_COUNT, description: str | None = None
) -> Any:
    """A count from `minimum` to `maximum`."""
    return Field(default, ge=minimum, le=maximum, description=description)


def http_url(value: str) -> str:
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


HttpUrl = Annotated[str, AfterValidator(http_url)]


def http_urls(value: str) -> str:
    """One http(s) URL or a comma-separated list of them (as ETCD_ENDPOINTS holds: every
    member of a replicated etcd, so a client fails over between them); each is checked."""
    items = [item.strip() for item in value.split(",")]
    if not all(items):
        raise ValueError(f"expected comma-separated http(s) URLs, got {value!r}")
    for item in items:
        http_url(item)
    return value


HttpUrls = Annotated[str, AfterValidator(http_urls)]


class ProbeBase(SpecModel):
    """What every probe kind has; `kind` picks the model (see `register_probe`)."""

    kind: str
    interval: float = seconds(0.2, positive=True, description="seconds between attempts")
    timeout: float = seconds(2.0, positive=True, description="seconds one attempt may take")
    deadline: float = seconds(
        120.0,
        positive=True,
        description="readiness: seconds from spawn until the unit must be ready",
    )
    failure_threshold: int = count(
        3, minimum=1, description="liveness: consecutive failures before the unit is restarted"
    )


class TcpProbe(ProbeBase):
    kind: Literal["tcp"]
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=limits.MAX_PORT)


class HttpProbe(ProbeBase):
    kind: Literal["http"]
    url: HttpUrl
    method: Literal["GET", "POST"] = "GET"
    expect_status: int = Field(200, ge=100, le=599)
    expect_json: dict[str, Any] | None = Field(
        None, description="every key given must be present with this value (recursive)"
    )


class ExecProbe(ProbeBase):
    kind: Literal["exec"]
    command: list[str] = Field(min_length=1)


class LogProbe(ProbeBase):
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


_CORE_PROBES: dict[str, type[ProbeBase]] = {
    "tcp": TcpProbe,
    "http": HttpProbe,
    "exec": ExecProbe,
    "log": LogProbe,
}
# kinds a layer above the core adds (the Dynamo frontend probe is the rollout layer's)
_EXTRA_PROBES: dict[str, type[ProbeBase]] = {}


def register_probe(kind: str, model: type[ProbeBase]) -> None:
    """Let stack files use probe `kind`, validated by `model` (idempotent)."""
    if kind in _CORE_PROBES or _EXTRA_PROBES.get(kind, model) is not model:
        raise ValueError(f"probe kind {kind!r} is already taken")
    _EXTRA_PROBES[kind] = model


def _probe(value: Any, handler: Any) -> ProbeBase:
    """A probe table -> the model its `kind` names (core's or a registered one)."""
    if isinstance(value, ProbeBase):
        return value
    if not isinstance(value, dict):
        raise PydanticCustomError("probe_table", "must be a table with a `kind`")
    kinds = {**_CORE_PROBES, **_EXTRA_PROBES}
    model = kinds.get(value.get("kind"))  # type: ignore[arg-type]
    if model is None:
        raise PydanticCustomError(
            "probe_kind",
            "unknown probe kind {kind} (expected one of: {known})",
            {"kind": repr(value.get("kind")), "known": ", ".join(kinds)},
        )
    return model.model_validate(value)


# A readiness or liveness probe: serialised with all of its kind's fields.
Probe = Annotated[SerializeAsAny[ProbeBase], WrapValidator(_probe)]


class RestartSpec(SpecModel):
    policy: Literal["never", "on-failure", "always"] = "on-failure"
    first_delay: float = seconds(
        0.0, positive=False, description="delay of the first restart after the unit ran well"
    )
    backoff_initial: float = seconds(
        0.1, positive=False, description="delay of the second restart in a row"
    )
    backoff_max: float = seconds(30.0, positive=False)
    backoff_factor: float = Field(2.0, ge=1, le=100, allow_inf_nan=False)
    jitter: float = Field(0.2, ge=0, le=1, description="+/- fraction of each delay")
    limit_burst: int = count(5, minimum=1, description="restarts allowed within limit_interval")
    limit_interval: float = seconds(60.0, positive=True)
    reset_after: float = seconds(
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


class StopSpec(SpecModel):
    signal: str = "SIGTERM"
    timeout: float = seconds(
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


Size = Annotated[
    int, BeforeValidator(quantities.parse_size),
    Field(ge=quantities.MIN_MEMORY, le=quantities.MAX_MEMORY),
]
Percent = Annotated[
    float, BeforeValidator(quantities.parse_percent), Field(ge=1, le=quantities.MAX_CPUS * 100)
]
CpuList = Annotated[str, BeforeValidator(quantities.cpuset)]


class LimitsSpec(SpecModel):
    """A unit's `limits` table, named as systemd's resource control names them (MemoryMax=,
    MemoryHigh=, CPUWeight=, CPUQuota=, AllowedCPUs=, TasksMax=, and Nice= from its
    execution settings); each one unset is not limited. How the host enforces them is
    core/resources.py's.

        limits = { memory_max = "2G", memory_high = "1.5G", cpu_weight = 100,
                   cpu_quota = "150%", cpuset = "0-1", pids_max = 512, nice = 10 }
    """

    memory_max: Size | None = Field(None, description="hard memory limit; past it: OOM kill")
    memory_high: Size | None = Field(
        None, description="memory above which the unit is throttled and reclaimed first"
    )
    cpu_weight: int | None = Field(
        None, ge=1, le=10000, description="relative CPU share (100 is the default)"
    )
    cpu_quota: Percent | None = Field(None, description='CPU time cap, "150%" = 1.5 CPUs')
    cpuset: CpuList | None = Field(None, description='the CPUs it may run on, e.g. "0-1"')
    pids_max: int | None = Field(None, ge=1, le=4194304, description="processes and threads")
    nice: int | None = Field(
        None,
        ge=-20,
        le=19,
        description="scheduling priority: higher yields the CPU to the rest when CPUs are "
        "short (0 is everyone's default; below 0 needs root)",
    )

    @field_validator("memory_high")
    @classmethod
    def _high_below_max(cls, high: int | None, info: ValidationInfo) -> int | None:
        top = info.data.get("memory_max")
        if high is not None and top is not None and high > top:
            raise ValueError(
                f"memory_high {quantities.size_text(high)} is above memory_max "
                f"{quantities.size_text(top)}"
            )
        return high

    def words(self) -> dict[str, str]:
        """Each limit set, as a person would write it: {"memory_max": "64M", ...}."""
        out: dict[str, str] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None:
                continue
            if name.startswith("memory_"):
                out[name] = quantities.size_text(value)
            elif name == "cpu_quota":
                out[name] = f"{value:g}%"
            else:
                out[name] = str(value)
        return out


class PlacementSpec(SpecModel):
    """Where each replica of a unit runs on this machine (`placement` table): with
    `cpus_per_replica = N`, replica i gets CPUs i*N .. i*N+N-1 as its `limits.cpuset`
    (unless the unit sets one) and, with `cpus_env`, that CPU list in the named environment
    variable (a real-engine shard's VLLM_CPU_OMP_THREADS_BIND): the CPU analogue of one
    GPU per shard. N = 0 places nothing.

        placement = { cpus_per_replica = 1, cpus_env = "VLLM_CPU_OMP_THREADS_BIND" }
    """

    cpus_per_replica: int = Field(0, ge=0, le=4096, description="CPUs each replica gets")
    cpus_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable that receives the replica's CPU list",
    )

    def cpus(self, index: int | None) -> str | None:
        """The CPU list of replica `index` (a unit without replicas is replica 0)."""
        n = self.cpus_per_replica
        if n == 0:
            return None
        first = (index or 0) * n
        return str(first) if n == 1 else f"{first}-{first + n - 1}"


class UnitSpec(SpecModel):
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
    limits: LimitsSpec | None = Field(
        None, description="memory, CPU, CPU set and process limits (core/resources.py)"
    )
    placement: PlacementSpec | None = Field(
        None, description="CPUs per replica, as its cpuset and in an environment variable"
    )
    install_hint: str | None = None
    preflight: list[str] | None = Field(
        None,
        min_length=1,
        description="a command `up` runs before anything spawns; a non-zero exit refuses "
        "the stack with the last line it wrote to stderr",
    )
    tables: dict[str, SerializeAsAny[SpecModel]] = Field(
        default_factory=dict,
        description="set by the resolver: the unit's tables that a layer above the core "
        "registered (e.g. `dynamo`), each validated by its own model",
    )
    remote: str | None = Field(
        None,
        description="set by the resolver, never in a file: the node that runs this unit; "
        "here it is only a dependency, ready when its probe passes against that node",
    )
    outside: str | None = Field(
        None,
        description="set by the resolver from the unit's `outside = \"HOST:PORT\"`: it runs "
        "outside the stack there (`remote` is that address too); never spawned, ready while "
        "the address takes a connection",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not key or "=" in key:
                raise ValueError(f"environment variable name {key!r} is empty or has '='")
        return value

