"""The fleet benchmark's second push: the trainer's call answered early.

`dynamod policy push --serving 1`: the head's daemon answers once one of its shards
serves the step and the ledger is at it; the rest of its shards, and every other node's
(which replay the step from the ledger meanwhile), update after the answer. Measured beside
the full push in the same fleet: the trainer's stall, and until every shard of the fleet
holds the step (the head's `policy.push_finished`, logged once its own shards are done and
the registry shows every other node's at the step)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dynamod.chaos.cluster import ClusterError, ClusterRig
from dynamod.chaos.node_loss import make_checkpoint
from dynamod.client import Client

SERVING = 1  # the head's shards serving the step before the trainer goes on


class LogTail:
    """A daemon log's JSON records of one event, read from where the last read ended."""

    def __init__(self, path: Path, event: str) -> None:
        self.path, self.quoted = path, f'"{event}"'
        self.offset = path.stat().st_size if path.exists() else 0

    def new(self) -> list[dict[str, Any]]:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(complete)
        return [json.loads(line) for line in complete.decode(errors="replace").splitlines()
                if self.quoted in line]  # fmt: skip


def push_early(rig: ClusterRig, step: int, shards: int) -> dict[str, Any]:
    """Push `step` with `serving = 1`: the trainer's stall, the shards the answer left
    updating on the head, and until every shard of the fleet held the step."""
    checkpoint = make_checkpoint(rig, rig.work_dir / f"step-{step}", 1.0 + 0.01 * step)
    tail = LogTail(rig.state_dir(rig.names[0]) / "daemon.log", "policy.push_finished")
    started = time.monotonic()
    answer = Client(rig.state_dir(rig.names[0]), timeout=900).policy_push(
        step, checkpoint, serving=SERVING
    )
    stall = time.monotonic() - started
    bad = {k: v.get("error") for k, v in answer["acks"].items() if not v.get("ok")}
    if bad:
        raise ClusterError(f"push of step {step} (serving {SERVING}) failed on {bad}")
    finished: list[dict[str, Any]] = []

    def done() -> bool:
        finished.extend(r for r in tail.new() if r.get("version") == step)
        return bool(finished) or not answer.get("updating")

    rig.wait(f"every shard at step {step} after the early answer", done, max(300, 2 * shards),
             0.2)  # fmt: skip
    event = finished[0] if finished else {"seconds": answer["seconds"], "behind": [], "stale": []}
    return {
        "serving": SERVING,
        "stall_s": stall,
        "acked_at_answer": len(answer["acks"]),
        "updating_at_answer": len(answer.get("updating", [])),
        "every_shard_s": float(event["seconds"]),
        "behind": event.get("behind", []),
        "stale": event.get("stale", []),
    }
