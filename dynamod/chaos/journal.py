"""The run journal, shaped like Chaos Toolkit's so people who know it can read it:
`status`, `deviated`, `steady_states` (`before`/`after`/`during`), `run[]`, `rollbacks[]`,
each activity with `start`, `end`, `duration`, `status` and `output`; plus every measured
value and each checker's verdict. Also the human summary table printed at the end."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any


class RunStatus(StrEnum):
    """Chaos Toolkit's run statuses."""

    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"
    INTERRUPTED = "interrupted"


def _iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).isoformat()


@dataclass
class Activity:
    type: str  # "action" | "probe"
    name: str
    spec: dict[str, Any]
    start: float = 0.0
    end: float = 0.0
    status: str = "succeeded"
    output: Any = None
    exception: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"activity": {"type": self.type, "name": self.name, **self.spec},
               "start": _iso(self.start), "end": _iso(self.end),
               "duration": round(self.end - self.start, 3), "status": self.status,
               "output": self.output}
        if self.exception:
            out["exception"] = self.exception
        return out


def timed(type_: str, name: str, spec: dict[str, Any], fn: Callable[[], Any]) -> Activity:
    """Run `fn` as one activity; an exception fails the activity, never the run loop."""
    act = Activity(type_, name, spec, start=time.time())
    try:
        act.output = fn()
    except Exception as exc:
        act.status, act.exception = "failed", f"{type(exc).__name__}: {exc}"
    act.end = time.time()
    return act


@dataclass
class Journal:
    runbook: dict[str, Any]
    profile: str
    start: float = field(default_factory=time.time)
    end: float = 0.0
    status: RunStatus = RunStatus.COMPLETED
    deviated: bool = False
    before: list[Activity] = field(default_factory=list)
    after: list[Activity] = field(default_factory=list)
    during: list[dict[str, Any]] = field(default_factory=list)
    run: list[Activity] = field(default_factory=list)
    rollbacks: list[Activity] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    verdict: str = ""
    expect: str = "pass"
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status is RunStatus.COMPLETED and not self.deviated and all(
            c["ok"] for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        def state(acts: list[Activity]) -> dict[str, Any]:
            return {"steady_state_met": all(a.status == "succeeded" for a in acts),
                    "probes": [a.as_dict() for a in acts]}

        return {
            "chaoslib-version": None, "dynamod-journal": 1,
            "experiment": self.runbook, "profile": self.profile,
            "start": _iso(self.start), "end": _iso(self.end),
            "duration": round(self.end - self.start, 3),
            "status": str(self.status), "deviated": self.deviated,
            "steady_states": {"before": state(self.before), "after": state(self.after),
                              "during": self.during},
            "run": [a.as_dict() for a in self.run],
            "rollbacks": [a.as_dict() for a in self.rollbacks],
            "measurements": self.measurements, "checks": self.checks,
            "passed": self.passed, "expect": self.expect, "verdict": self.verdict,
            "notes": self.notes,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_dict(), indent=2, default=str) + "\n")


def summary(journals: list[dict[str, Any]]) -> str:
    """One table: each runbook's status, its checkers and the verdict against `expect`."""
    lines = [f"{'RUNBOOK':<28} {'STATUS':<11} {'SECONDS':>7}  {'VERDICT':<22} CHECKS"]
    for j in journals:
        checks = " ".join(f"{c['check']}={'ok' if c['ok'] else 'FAIL'}" for c in j["checks"])
        if j["deviated"]:
            checks = "steady-state-deviated " + checks
        lines.append(f"{j['experiment']['name']:<28} {j['status']:<11} {j['duration']:>7.1f}  "
                     f"{j['verdict']:<22} {checks}")
        lines += [f"    {c['check']}: {c['detail']}" for c in j["checks"] if not c["ok"]]
        lines += [f"    step failed: {r['activity']['name']}: {r.get('exception')}"
                  for r in j["run"] if r["status"] != "succeeded"]
    return "\n".join(lines)
