"""Runbook files (TOML) -> typed, validated runbooks; errors name file, runbook and field.

A runbook is a Chaos Toolkit experiment made typed: the stack it runs on, a steady state
(probes that must hold before and after), load, a method (ordered, timed steps), the
invariants judged over the recorded history, rollbacks that always run, abort conditions
and time bounds. Two profiles: `quick` (CI, one pass of the method, at most ~60 s of load)
and `full` (`make chaos`: the method repeated, longer load).
"""

from __future__ import annotations

import signal as _signal
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dynamod.core.errors import SpecError, SpecErrors


class RunbookError(SpecError):
    """A runbook file is invalid: names the file, the runbook and the field."""

    def __str__(self) -> str:
        where = [self.file or "runbook"]
        if self.unit:
            where.append(f"runbook {self.unit!r}")
        if self.field:
            where.append(f"field {self.field!r}")
        return f"{', '.join(where)}: {self.message}"


class Profile(StrEnum):
    QUICK = "quick"
    FULL = "full"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _signal_name(value: str) -> str:
    name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
    if not hasattr(_signal, name):
        raise ValueError(f"unknown signal {value!r} (e.g. SIGKILL, SIGTERM, SIGSTOP)")
    return name


# --------------------------------------------------------------------------- steps


class _Step(_Model):
    after: float = Field(0.0, ge=0, description="seconds to wait before this step")
    timeout: float = Field(60.0, gt=0, description="seconds this step may take")


class KillStep(_Step):
    """Send a signal to a unit's process (a replica by name: worker@1)."""

    action: Literal["kill"]
    unit: str
    signal: str = "SIGKILL"

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        return _signal_name(value)


class PauseStep(_Step):
    """SIGSTOP a unit for `seconds` (0: until a `resume` step or the rollbacks)."""

    action: Literal["pause"]
    unit: str
    seconds: float = Field(0.0, ge=0)


class ResumeStep(_Step):
    action: Literal["resume"]
    unit: str


class OrphanPauseStep(_Step):
    """A process outside dynamod (as verl's trainer) claims `unit`'s pause and pauses it at
    its system port (`python -m dynamod.chaos.pauser`); after `seconds` it is killed -9
    with its claim still open, and nothing but dynamod will resume the shard."""

    action: Literal["orphan_pause"]
    unit: str
    seconds: float = Field(2.0, ge=0, description="how long the pauser holds it paused")


class WaitStep(_Step):
    action: Literal["wait"]
    seconds: float = Field(gt=0)


class WaitStateStep(_Step):
    """An assertion between faults: `unit` reaches `state` (under a new pid if `new_pid`)."""

    action: Literal["wait_state"]
    unit: str
    state: str = "ready"
    new_pid: bool = False


class PushStep(_Step):
    """Push a new policy version (current + 1), a checkpoint made from the boot weights."""

    action: Literal["push"]
    expect: Literal["ok", "refused", "any"] = "ok"
    corrupt: Literal["none", "truncated", "garbage"] = "none"
    kill_unit: str | None = Field(None, description="SIGKILL this shard while the push runs")
    kill_after: float = Field(0.5, ge=0, description="seconds into the push for kill_unit")
    kill_daemon_after: float | None = Field(
        None, ge=0, description="SIGKILL the daemon this many seconds into the push, then up")
    pad_mb: int = Field(0, ge=0, description="pad the checkpoint so it loads slowly")


class ProxyStep(_Step):
    """Set the faults of a fault-proxy unit (zero values heal)."""

    action: Literal["proxy"]
    unit: str
    latency_ms: float = Field(0.0, ge=0)
    jitter_ms: float = Field(0.0, ge=0)
    reset_rate: float = Field(0.0, ge=0, le=1, description="fraction of connections reset")
    bandwidth_kbps: float = Field(0.0, ge=0, description="0 = unlimited")
    down: bool = Field(False, description="refuse and cut every connection (an outage)")
    seconds: float = Field(0.0, ge=0, description="heal after this long (0: keep)")


class DaemonKillStep(_Step):
    """SIGKILL the dynamod daemon; `restart` brings it up again on the same state dir."""

    action: Literal["kill_daemon"]
    restart: bool = True
    down_for: float = Field(0.0, ge=0)


class DiskFullStep(_Step):
    """Mount a small tmpfs over a directory of the state dir and fill it (or remount it
    read-only): ENOSPC or EROFS for whoever writes there. Root only; skipped with the reason
    where the machine cannot mount. Unmounted by its healer."""

    action: Literal["disk_full"]
    path: str = Field(description="relative to the stack's state dir, e.g. checkpoints")
    size_kb: int = Field(1024, ge=64)
    readonly: bool = False
    seconds: float = Field(0.0, ge=0, description="heal after this long (0: keep)")


class TrainerProgressStep(_Step):
    """Wait until the ledger reaches `version` (the trainer pushes)."""

    action: Literal["wait_version"]
    version: int = Field(ge=1)


class TakePortStep(_Step):
    """Take a unit's port before it binds again: SIGKILL the unit (`restart = true`) and
    listen on its port from the chaos runner (loopback) before the replacement starts;
    watch what dynamod does for `seconds`, then let the port go (its healer)."""

    action: Literal["take_port"]
    unit: str
    port: str = Field(description="the unit's port name, e.g. http or system")
    restart: bool = Field(True, description="kill the unit so that it must bind again")
    seconds: float = Field(20.0, gt=0, description="how long the port stays taken")


Step = Annotated[
    KillStep
    | PauseStep
    | ResumeStep
    | OrphanPauseStep
    | WaitStep
    | WaitStateStep
    | PushStep
    | ProxyStep
    | DaemonKillStep
    | DiskFullStep
    | TrainerProgressStep
    | TakePortStep,
    Field(discriminator="action"),
]

STEP_ACTIONS = frozenset(
    get_args(cls.model_fields["action"].annotation)[0] for cls in get_args(get_args(Step)[0])
)


# --------------------------------------------------------------------------- the rest


class Probe(_Model):
    """A steady-state probe: `units_ready` (every unit ready or completed), `serves` (one
    completion at the current policy), `shards_current` (every shard at the ledger's)."""

    kind: Literal["units_ready", "serves", "shards_current"]
    timeout: float = Field(60.0, gt=0, description="seconds until it must hold")


class Load(_Model):
    clients: int = Field(4, ge=1, le=64, description="concurrent completion clients")
    rate: float = Field(8.0, gt=0, description="requests per second, all clients together")
    trainer_fraction: float = Field(
        0.5, ge=0, le=1, description="share of requests requiring the current policy's taint"
    )
    max_tokens: int = Field(4, ge=1)
    prompts: list[str] = Field(default_factory=lambda: ["the policy says", "once upon a time"])
    request_timeout: float = Field(20.0, gt=0)
    logprobs: bool = Field(False, description="ask for logprobs and completion token ids")
    settle: float = Field(3.0, ge=0, description="load keeps running this long after the method")


class Invariant(_Model):
    """One checker and its bound; see dynamod/chaos/checkers.py for what each judges."""

    check: Literal[
        "shards_current",
        "no_stale_serving",
        "client_errors",
        "recovery_time",
        "no_leftovers",
        "trainer_progress",
        "cache_hit_recovers",
        "up_fails_naming",
        "token_alignment",
        "port_conflict_truthful",
        "none_paused",
    ]
    traffic: Literal["all", "plain", "trainer"] = Field(
        "all", description="client_errors: which requests count (trainer = taint-constrained)")
    max_errors: int | None = Field(None, ge=0)
    max_error_rate: float | None = Field(None, ge=0, le=1)
    max_seconds: float | None = Field(None, gt=0)
    grace: float = Field(0.5, ge=0, description="seconds after an update boundary")
    min_versions: int = Field(1, ge=0)
    warmup: float = Field(5.0, ge=0)
    min_fraction: float = Field(0.5, ge=0, le=1)
    names: list[str] = Field(default_factory=list, description="up_fails_naming: must appear")


class Abort(_Model):
    max_error_rate: float = Field(1.0, ge=0, le=1, description="over the last 5 s of load")
    daemon_gone: bool = Field(True, description="abort when the daemon vanished unasked")


class ProfileSpec(_Model):
    load_seconds: float = Field(gt=0, description="the least time the load runs")
    repeat: int = Field(1, ge=1, description="passes of the method")
    timeout: float = Field(120.0, gt=0, description="the whole run, up to teardown")


class Runbook(_Model):
    name: str
    description: str
    stack: str = Field("local", description="stock stack name or path relative to the runbook")
    vars: dict[str, str | int | float | bool] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict, description="extra env for the daemon")
    up_timeout: float = Field(300.0, gt=0, description="`up --timeout`: ready by then or torn down")
    shared_stack: bool = Field(
        True, description="may run on the stack an earlier runbook of the same stack, vars "
        "and env started, once its steady state holds again; false: a stack of its own")
    expect: Literal["pass", "fail", "fails-until-issue-15"] = "pass"
    expect_note: str = ""
    steady_state: list[Probe] = Field(default_factory=list)
    load: Load | None = None
    method: list[Step]
    rollbacks: list[Step] = Field(default_factory=list)
    invariants: list[Invariant]
    abort: Abort = Abort()
    quick: ProfileSpec = ProfileSpec(load_seconds=20, timeout=120)
    full: ProfileSpec = ProfileSpec(load_seconds=60, repeat=3, timeout=600)
    source: Path | None = Field(None, exclude=True)

    def profile(self, which: Profile) -> ProfileSpec:
        return self.quick if which is Profile.QUICK else self.full

    def stack_path(self) -> str:
        """A stock name as given; a path made absolute against the runbook's folder."""
        if "/" not in self.stack and not self.stack.endswith(".toml"):
            return self.stack
        base = self.source.parent if self.source else Path.cwd()
        return str((base / self.stack).resolve())


# --------------------------------------------------------------------------- loading

_TOP_KEYS = {"runbook", "steady_state", "load", "method", "rollbacks", "invariants", "abort",
             "quick", "full", "vars"}


def _errors(exc: ValidationError, path: Path, name: str) -> list[SpecError]:
    out: list[SpecError] = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if str(p) not in STEP_ACTIONS)
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required but missing"
        elif err["type"] == "union_tag_invalid":
            message = f"unknown action; one of {', '.join(sorted(STEP_ACTIONS))}"
        else:
            message = err["msg"]
            if "input" in err and not isinstance(err["input"], dict | list):
                message += f" (got {err['input']!r})"
        out.append(RunbookError(message, file=path, unit=name, field=loc or None))
    return out


def load(path: Path) -> Runbook:
    """Read and validate one runbook file. Raises SpecErrors listing every problem."""
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise SpecErrors([RunbookError("file not found", file=path)]) from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecErrors([RunbookError(f"not valid TOML: {exc}", file=path)]) from None
    head = raw.get("runbook")
    name = head.get("name", path.stem) if isinstance(head, dict) else path.stem
    problems: list[SpecError] = [
        RunbookError("unknown table", file=path, unit=name, field=key)
        for key in raw
        if key not in _TOP_KEYS
    ]
    if not isinstance(head, dict):
        problems.append(RunbookError("required but missing", file=path, unit=name,
                                     field="runbook"))
        raise SpecErrors(problems)
    rest = {k: v for k, v in raw.items() if k in _TOP_KEYS - {"runbook"}}
    body: dict[str, Any] = {**head, **rest}
    if problems:
        raise SpecErrors(problems)
    try:
        runbook = Runbook.model_validate({**body, "source": path.resolve()})
    except ValidationError as exc:
        raise SpecErrors(_errors(exc, path, name)) from None
    if runbook.name != path.stem:
        raise SpecErrors([RunbookError(f"must match the file name {path.stem!r}", file=path,
                                       unit=name, field="runbook.name")])
    return runbook


def runbooks_dir() -> Path:
    """The repository's runbooks/ folder (beside the dynamod package)."""
    return Path(__file__).resolve().parents[2] / "runbooks"


def find(name_or_path: str, folder: Path | None = None) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" or "/" in name_or_path:
        return candidate
    return (folder or runbooks_dir()) / f"{name_or_path}.toml"


def load_all(folder: Path | None = None) -> list[Runbook]:
    return [load(p) for p in sorted((folder or runbooks_dir()).glob("*.toml"))]
