"""bench.publish_nodes' pure logic: a step's record from rank 0 is taken only where every
node's every shard holds the step, and bad flags are one line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from bench.publish_nodes import one_update
from tests.conftest import ROOT


def record(step: int = 3, **publish: Any) -> dict[str, Any]:
    answer = {"ok": True, "seconds": 0.1, "behind": [],
              "acks": {"worker@0": {"total_ms": 12.0}},
              "nodes": {"n1": {"n1/worker@0": step}}, **publish}  # fmt: skip
    return {"step": step, "wall_s": 0.4, "send_s": 0.2, "acks_wait_s": 0.05, "errors": {},
            "stale": [],
            "acks": {"head/worker@0": "d", "n1/worker@0": "d"}, "checkpoint": "/c/step-3",
            "publish": answer}  # fmt: skip


def test_a_step_every_shard_holds_is_taken() -> None:
    update = one_update(record())
    assert update == {"step": 3, "stall_s": 0.4, "send_s": 0.2, "acks_wait_s": 0.05,
                      "publish_s": 0.1, "acked": 2,
                      "other_nodes_shards": 1, "head_slowest_ms": 12.0,
                      "checkpoint": "/c/step-3"}  # fmt: skip


@pytest.mark.parametrize("publish", [
    {"nodes": {"n1": {"n1/worker@0": 2}}},  # n1's shard still at the step before
    {"behind": ["n1/worker@0"]},
    {"ok": False},
])  # fmt: skip
def test_a_step_a_shard_missed_is_refused(publish: dict[str, Any]) -> None:
    with pytest.raises(RuntimeError, match="did not reach every shard"):
        one_update(record(**publish))


@pytest.mark.parametrize(("args", "says"), [
    (["--nodes", "2,4"], "--nodes '2,4': rising counts starting at 1"),
    (["--nodes", "1,9"], "--nodes 9: at most 8 nodes"),
    (["--shards-per-node", "0"], "--shards-per-node 0: at least 1"),
    (["--updates", "0"], "--updates 0: at least 1"),
])  # fmt: skip
def test_bad_flags_are_one_line_and_exit_2(args: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.publish_nodes", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
