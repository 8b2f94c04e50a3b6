"""The update log: one line per weight update verl made, `<state_dir>/verl/updates.jsonl`.

Both weight paths write it (`push`: a checkpoint and `policy push`; `ipc`: the colocated
transfer and `policy publish`), so the validation's second boundary reads one format:
the ledger version (`step`), verl's run and step (`run`, `verl_step`), the shards
admitted at the time, each one's acknowledged digest (`acks`), their errors, the shards
the commit held (`stale`), the agreed digest and the checkpoint a replay loads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

UPDATES_LOG = "updates.jsonl"


def log_path(state_dir: Path) -> Path:
    return state_dir / "verl" / UPDATES_LOG


def log_update(state_dir: Path, record: Mapping[str, Any]) -> None:
    path = log_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps({**record, "at": time.time()}) + "\n")


def read_updates(state_dir: Path) -> list[dict[str, Any]]:
    path = log_path(state_dir)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def push_record(version: int, origin: Mapping[str, Any] | None, answer: Mapping[str, Any],
                path: Path) -> dict[str, Any]:
    """The log line for a committed `policy push` answer."""
    acks: Mapping[str, Any] = answer.get("acks") or {}
    return {
        "step": answer.get("version", version),
        **(origin or {}),
        "shards": sorted(acks),
        "acks": {name: a.get("digest") for name, a in acks.items() if a.get("ok")},
        "errors": {name: a.get("error") for name, a in acks.items() if not a.get("ok")},
        "stale": list(answer.get("stale") or []),
        "behind": list(answer.get("behind") or []),  # other nodes' shards not at the step
        "digest": answer.get("digest"),
        "checkpoint": str(path),
        "seconds": answer.get("seconds"),
    }
