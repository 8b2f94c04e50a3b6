"""The fleet benchmark's second push: the trainer's call answered early.

`dynamod policy push --serving 1`: the head's daemon answers once one of its shards
serves the step and the ledger is at it; the rest of its shards, and every other node's
(which replay the step from the ledger meanwhile), update after the answer. Measured beside
the full push in the same fleet: the trainer's stall, and until every shard of the fleet
holds the step (the head's `policy.push_finished` event, once its own shards are done and
the registry shows every other node's at the step). Under load from inside the head (the
fleet's, half of it trainer-style), which asks for the new step from the answer on: the
requests for it until the push finished, how many failed, and their latency beside the
load's before the push (what the early answer trades: the step's capacity grows from one
shard)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from bench.report import Table
from dynamod.chaos.cluster import ClusterError, ClusterRig
from dynamod.chaos.history import Request
from dynamod.chaos.model import Load
from dynamod.chaos.node_loss import make_checkpoint
from dynamod.client import Client
from dynamod.core import events

SERVING = 1  # the head's shards serving the step before the trainer goes on
TAIL = 200  # the head's last events looked at for push_finished (each look reads the end)
# Load after every shard holds the step: at the fleet's 6 req/s, ~12 requests, of which the
# load's seeded draws make at least one trainer-style (no 8 plain ones in a row)
AFTER_S = 2.0


def push_early(rig: ClusterRig, step: int, shards: int, load: Load, steady_s: float
               ) -> dict[str, Any]:
    """Push `step` with `serving = 1` under `load` (`steady_s` of it before): the trainer's
    stall, the shards the answer left updating on the head, until every shard of the fleet
    held the step, and the step's requests meanwhile."""
    checkpoint = make_checkpoint(rig, rig.work_dir / f"step-{step}", 1.0 + 0.01 * step)
    asked = [step - 1]  # the step trainer-style requests require: the new one from the answer
    gen = rig.load(load, "tiny-cpu", lambda: asked[0])
    gen.start()
    try:
        time.sleep(steady_s)
        started = time.monotonic()
        answer = Client(rig.state_dir(rig.names[0]), timeout=900).policy_push(
            step, checkpoint, serving=SERVING
        )
        answered = time.monotonic()
        asked[0] = step
        bad = {k: v.get("error") for k, v in answer["acks"].items() if not v.get("ok")}
        if bad:
            raise ClusterError(f"push of step {step} (serving {SERVING}) failed on {bad}")
        finished: list[dict[str, Any]] = []

        def done() -> bool:  # the head's event for this step (the events file's last ones)
            finished[:] = [e for e in events.tail(rig.state_dir(rig.names[0]), TAIL)
                           if e["kind"] == "policy.push_finished" and e.get("version") == step]
            return bool(finished) or not answer.get("updating")

        rig.wait(f"every shard at step {step} after the early answer", done,
                 max(300, 2 * shards), 0.2)  # fmt: skip
        whole = time.monotonic()
        time.sleep(AFTER_S)  # the step's traffic on the whole fleet
    finally:
        gen.stop()
    event = finished[0] if finished else {"seconds": answer["seconds"], "behind": [], "stale": []}
    rows = list(gen.requests)
    wrong = sum(r.ok and r.version != step for r in rows if r.required == step)
    at = {name: t - gen.origin for name, t in
          (("push", started), ("answer", answered), ("whole", whole))}  # fmt: skip
    return {
        "serving": SERVING,
        "stall_s": answered - started,
        "daemon_s": float(answer["seconds"]),  # the rest of the stall: the CLI's call
        "commit_ms": answer.get("commit_ms"),
        "first_ack_ms": min(float(a["total_ms"]) for a in answer["acks"].values() if a["ok"]),
        "acked_at_answer": len(answer["acks"]),
        "updating_at_answer": len(answer.get("updating", [])),
        "every_shard_s": float(event["seconds"]),
        "head_shards_s": float(event.get("here_s", event["seconds"])),
        "behind": event.get("behind", []),
        "stale": event.get("stale", []),
        "load": {
            "before": latencies([r for r in rows if r.sent < at["push"]]),
            "in_push": latencies([r for r in rows if at["push"] <= r.sent < at["answer"]]),
            "step_until_whole": latencies(
                [r for r in rows if r.required == step and r.sent < at["whole"]]
            ),
            "step_all": latencies([r for r in rows if r.required == step]),
            "step_wrong_version": wrong,  # served, at another version: never expected
        },
    }


def latencies(rows: list[Request]) -> dict[str, Any]:
    """Requests, failed, and the answered ones' latency p50 / p99 in ms."""
    ms = sorted(r.latency * 1000 for r in rows if r.ok)
    return {
        "requests": len(rows),
        "failed": sum(not r.ok for r in rows),
        "p50_ms": statistics.median(ms) if ms else float("nan"),
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else float("nan"),
    }


def early_table(fleets: list[dict[str, Any]]) -> Table:
    """Per fleet: the push answered at one shard serving, and the load around it."""
    table = Table(
        f"The second push answered once {SERVING} of the head's shards serve it (`policy push "
        f"--serving {SERVING}`), under load asking for the new step from the answer on",
        ["nodes", "shards", "trainer's stall s", "of it: first shard's update / commit ms",
         "updating after the answer (head)",
         "the head's shards at the step s", "every shard at the step s",
         "before: p50 / p99 ms", "in the stall: requests, failed",
         "the step's requests until every shard: n", "failed", "p50 ms", "p99 ms",
         "served at another version"],
        digits=2,
    )  # fmt: skip
    for f in fleets:
        e = f.get("early")
        if e is None:
            continue
        load = e["load"]
        before, stall, step = load["before"], load["in_push"], load["step_until_whole"]
        table.rows.append(
            [f["nodes"], f["shards"], e["stall_s"],
             f"{e.get('first_ack_ms', math.nan):.0f} / {e.get('commit_ms') or math.nan:.0f}",
             e["updating_at_answer"], e["head_shards_s"],
             e["every_shard_s"],
             f"{before['p50_ms']:.0f} / {before['p99_ms']:.0f}",
             f"{stall['requests']}, {stall['failed']}", step["requests"], step["failed"],
             step["p50_ms"], step["p99_ms"], load["step_wrong_version"]]
        )  # fmt: skip
    return table
