"""What a chaos run records, as plain data: requests, unit state changes, shard policy
versions and ledger changes, fault marks, teardown findings. Times are seconds since the
run started (one monotonic origin), so every record lines up on one axis."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Request:
    sent: float
    done: float
    status: int  # HTTP status; -1: no answer (connection error, timeout)
    required: int | None = None  # the policy version the request required (trainer-style)
    version: int | None = None  # the weight version that served it (engine_data)
    instance: str | None = None
    error: str | None = None
    finish: str | None = None  # finish_reason of the choice
    token_ids: int | None = None  # len(nvext.completion_token_ids), when asked
    logprobs: int | None = None  # len(choices[0].logprobs.token_logprobs), when asked
    usage_tokens: int | None = None  # usage.completion_tokens

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def latency(self) -> float:
        return self.done - self.sent


@dataclass(frozen=True)
class StateChange:
    at: float
    unit: str
    old: str
    new: str
    pid: int | None = None


@dataclass(frozen=True)
class VersionSample:
    """One status poll: the ledger's current version and each shard's applied one."""

    at: float
    current: int | None
    shards: dict[str, int | None]
    admitted: dict[str, bool]


@dataclass(frozen=True)
class Fault:
    at: float
    name: str
    target: str | None = None
    healed_at: float | None = None


@dataclass(frozen=True)
class CacheSample:
    at: float
    unit: str
    hit_rate: float


@dataclass(frozen=True)
class UnitSeen:
    """One status poll of a unit while a fault holds: its state, detail and ports."""

    at: float
    state: str
    detail: str
    ports: dict[str, int]


@dataclass
class PortTake:
    """A port the chaos runner listened on before `unit` could bind it again, and what
    dynamod reported of the unit while it was taken."""

    at: float
    unit: str
    port_name: str
    port: int
    owner_pid: int
    owner: str  # the owner's command name, as /proc/PID/comm says
    released_at: float | None = None
    seen: list[UnitSeen] = field(default_factory=list)


@dataclass
class Teardown:
    """What was left once the stack was down (every field empty is a clean teardown)."""

    alive_pids: list[int] = field(default_factory=list)
    bound_ports: list[int] = field(default_factory=list)
    stale_registrations: list[str] = field(default_factory=list)
    down_ok: bool = True
    down_output: str = ""


@dataclass
class History:
    requests: list[Request] = field(default_factory=list)
    states: list[StateChange] = field(default_factory=list)
    versions: list[VersionSample] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    cache: list[CacheSample] = field(default_factory=list)
    port_takes: list[PortTake] = field(default_factory=list)
    teardown: Teardown | None = None
    final_status: dict[str, Any] | None = None
    start_version: int | None = None
    end: float = 0.0
    up_returncode: int | None = None
    up_output: str = ""

    def ledger_changes(self) -> list[tuple[float, int]]:
        """(time first seen, version) each time the ledger's current version moved."""
        out: list[tuple[float, int]] = []
        for sample in self.versions:
            if sample.current is not None and (not out or out[-1][1] != sample.current):
                out.append((sample.at, sample.current))
        return out

    def write(self, path: Path) -> None:
        with path.open("w") as fh:
            for kind in ("requests", "states", "versions", "faults", "cache", "port_takes"):
                for row in getattr(self, kind):
                    fh.write(json.dumps({"kind": kind, **asdict(row)}) + "\n")
