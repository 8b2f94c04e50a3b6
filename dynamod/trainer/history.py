"""The rollout history: one JSON line per request the trainer sent, and its invariant.

Each line says what the trainer asked for (the ledger's version when it sent the request,
which it required as a taint) and what it got (the weight version and digest the serving
shard reported in `nvext.engine_data`, which instance and which unit that was). The
invariant, checkable over the whole file: no response was served at a version older than
the ledger's version at request time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True)
class RequestRecord:
    requested_at: float  # unix time the request was sent
    phase: str  # "train" (rollouts for the next step) or "eval" (after the last push)
    ledger_version: int  # the ledger's current version when the request was sent
    required_version: int  # the version whose taint the request required
    required_taint: str
    prompt_index: int
    sample: int
    attempt: int
    ok: bool
    http_status: int | None
    error: str | None
    served_version: int | str | None  # engine_data.weight_version
    served_digest: str | None  # engine_data.weight_digest
    instance_id: int | None  # engine_data.instance_id: the worker that produced the tokens
    routed_worker_id: int | None  # nvext.worker_id.decode_worker_id: the router's pick
    shard: str | None  # the dynamod unit of instance_id
    completion_tokens: int
    reward: float | None
    latency_ms: float


class HistoryWriter:
    """Appends records, one flushed line each, so the file survives a crash mid-step."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: IO[str] = path.open("a", encoding="utf-8")

    def write(self, record: RequestRecord) -> None:
        self._fh.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_history(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def violations(records: Iterable[dict[str, Any]]) -> list[str]:
    """Every served response whose weight version is not the one the trainer required,
    or older than the ledger's version when it was requested; [] when the invariant holds."""
    found = []
    for i, r in enumerate(records):
        if not r["ok"]:
            continue
        served = r["served_version"]
        where = f"line {i + 1} (shard {r['shard']}, instance {r['instance_id']})"
        if not isinstance(served, int):
            found.append(f"{where}: served at version {served!r}, not an integer version")
        elif served < r["ledger_version"]:
            found.append(f"{where}: served at {served}, ledger was at {r['ledger_version']}")
        elif served != r["required_version"]:
            found.append(f"{where}: served at {served} but required {r['required_taint']}")
    return found
