"""The trainer unit on the default stack: real etcd, NATS, Dynamo frontend and CPU workers,
and `python -m dynamod.trainer` pushing three real policy updates through dynamod."""

from __future__ import annotations

import json
import os
import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from dynamod.client import Client
from dynamod.trainer.history import read_history, violations
from dynamod.workers.weights import WEIGHTS_FILE
from tests.conftest import Dynamod, unit_by_name

pytestmark = pytest.mark.slow

STEPS = 3
KEEP = 2


def trainer_events(log: Path) -> list[dict[str, Any]]:
    """The trainer's structlog JSON lines from its unit log (dynamod's headers skipped)."""
    events = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


def unix_time(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def test_trainer_pushes_every_step_and_never_reads_a_stale_shard(dm: Dynamod) -> None:
    dm.run("up", "--detach", "--var", f"trainer_steps={STEPS}", "--var",
           f"trainer_keep={KEEP}", timeout=300, check=True)

    def trainer_settled(status: dict[str, Any]) -> dict[str, Any] | None:
        unit = unit_by_name(status, "trainer")
        return unit if unit["state"] in {"completed", "failed"} else None

    trainer = dm.wait_for(trainer_settled, timeout=60, what="the trainer to finish")
    log = Path(trainer["log"])
    assert trainer["state"] == "completed", log.read_text()[-3000:]
    assert trainer["restarts"] == 0, log.read_text()[-3000:]

    # The ledger and every shard are at the last step.
    policy = Client(dm.state_dir).policy_status()
    assert policy["current"] == STEPS
    assert policy["current_path"] == str(dm.state_dir / "checkpoints" / f"step-{STEPS}")
    assert len(policy["shards"]) == 2
    assert {s["name"]: s["policy_version"] for s in policy["shards"]} == {
        "worker@0": STEPS, "worker@1": STEPS}
    assert all(s["admitted"] for s in policy["shards"])

    # One log line per step with the step, its reward, loss, push time and per-shard acks.
    events = trainer_events(log)
    steps = [e for e in events if e["event"] == "trainer.step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    for e in steps:
        assert 0.0 <= e["mean_reward"] <= 1.0
        assert isinstance(e["loss"], float)
        assert e["push_s"] > 0
        assert set(e["ack_ms"]) == {"worker@0", "worker@1"}
        assert all(isinstance(ms, float) and ms > 0 for ms in e["ack_ms"].values())
        assert e["rollout_version"] == e["step"] - 1
        assert e["stale"] == []
    assert [e["event"] for e in events][-3:] == ["trainer.eval", "trainer.curve", "trainer.done"]

    # The history: every request served at the version the ledger had when it was sent,
    # by a known shard, with the digest of the weights the trainer pushed for that version.
    history = read_history(dm.state_dir / "trainer" / "history.jsonl")
    per_round = 4 * 4  # trainer_prompts x trainer_group_size (the unit's defaults)
    ok = [r for r in history if r["ok"]]
    assert len(ok) == per_round * (STEPS + 1), [r for r in history if not r["ok"]]
    assert violations(history) == []
    assert {r["served_version"] for r in ok} == set(range(STEPS + 1))
    assert {r["shard"] for r in ok} == {"worker@0", "worker@1"}
    pushed_at = {e["step"]: unix_time(e["timestamp"]) for e in steps}
    digest_of = {e["step"]: e["digest"] for e in steps}
    for r in ok:
        version = r["served_version"]
        assert r["served_version"] >= r["ledger_version"]
        assert r["instance_id"] == r["routed_worker_id"]  # no migration on a healthy stack
        if version >= 1:
            assert r["requested_at"] >= pushed_at[version], r  # after v was pushed
            assert r["served_digest"].startswith(digest_of[version]), r
        if version + 1 in pushed_at:
            assert r["requested_at"] < pushed_at[version + 1], r  # before v + 1 was pushed

    # Checkpoints: the last KEEP steps, with the tensor names the workers load.
    checkpoint_dir = dm.state_dir / "checkpoints"
    kept = sorted(p.name for p in checkpoint_dir.iterdir())
    assert kept == [f"step-{s}" for s in range(STEPS - KEEP + 1, STEPS + 1)]
    worker = unit_by_name(dm.status(), "worker@0")
    model_dir = Path(worker["command"][worker["command"].index("--model-path") + 1])
    model_file = model_dir / WEIGHTS_FILE
    with safe_open(str(model_file), "pt") as base, \
            safe_open(str(checkpoint_dir / f"step-{STEPS}" / WEIGHTS_FILE), "pt") as step:
        assert sorted(step.keys()) == sorted(base.keys())


def test_a_killed_trainer_resumes_from_the_ledger_and_never_pushes_backwards(
    dm: Dynamod,
) -> None:
    steps = 20
    dm.run("up", "--detach", "--var", f"trainer_steps={steps}", timeout=300, check=True)
    trainer = unit_by_name(dm.status(), "trainer")
    log = Path(trainer["log"])

    def two_steps_done(status: dict[str, Any]) -> bool:
        done = [e for e in trainer_events(log) if e["event"] == "trainer.step"]
        return len(done) >= 2

    dm.wait_for(two_steps_done, timeout=60, what="two trainer steps")
    os.kill(trainer["pid"], signal.SIGKILL)

    def trainer_settled(status: dict[str, Any]) -> dict[str, Any] | None:
        unit = unit_by_name(status, "trainer")
        return unit if unit["state"] in {"completed", "failed"} else None

    trainer = dm.wait_for(trainer_settled, timeout=60, what="the restarted trainer to finish")
    assert trainer["state"] == "completed" and trainer["restarts"] == 1, log.read_text()[-3000:]

    events = trainer_events(log)
    starts = [e for e in events if e["event"] == "trainer.ready"]
    assert len(starts) == 2
    assert starts[1]["ledger_version"] >= 2
    assert starts[1]["weights"].endswith(f"step-{starts[1]['ledger_version']}")
    pushed = [e["step"] for e in events if e["event"] == "trainer.step"]
    assert pushed == sorted(set(pushed)), pushed  # strictly forward, across the restart
    assert pushed[-1] == steps
    assert Client(dm.state_dir).policy_status()["current"] == steps
    assert violations(read_history(dm.state_dir / "trainer" / "history.jsonl")) == []

    # Started again with the ledger at its final step: nothing is left to train, so it
    # builds no model (torch is not even imported), reads no checkpoint, and completes.
    dm.run("restart", "trainer", check=True)

    def third_run_done(status: dict[str, Any]) -> bool:
        readies = [e for e in trainer_events(log) if e["event"] == "trainer.ready"]
        return len(readies) == 3 and unit_by_name(status, "trainer")["state"] == "completed"

    dm.wait_for(third_run_done, timeout=60, what="the trainer started again to finish")
    last = [e for e in trainer_events(log) if e["event"] == "trainer.ready"][-1]
    assert last["steps_left"] == 0 and last["weights"] == "none (no step left)", last
    assert [e["step"] for e in trainer_events(log) if e["event"] == "trainer.step"] == pushed


def test_a_trainer_with_no_step_to_train_completes_at_once_without_a_restart(
    dm: Dynamod,
) -> None:
    """trainer_steps = 0 (most stacks here): the trainer builds no model and exits 0 in
    well under a second; that exit is its completion, not a failed start to retry (with
    the default min_uptime of 1 s it was retried until one run happened to last 1 s: up
    took 38 s and the trainer restarted 6 times)."""
    dm.run("up", "--detach", "--var", "trainer_steps=0", timeout=300, check=True)

    def trainer_settled(status: dict[str, Any]) -> dict[str, Any] | None:
        unit = unit_by_name(status, "trainer")
        return unit if unit["state"] in {"completed", "failed"} else None

    trainer = dm.wait_for(trainer_settled, timeout=60, what="the trainer to finish")
    log = Path(trainer["log"])
    assert trainer["state"] == "completed" and trainer["restarts"] == 0, log.read_text()[-3000:]
    (ready,) = [e for e in trainer_events(log) if e["event"] == "trainer.ready"]
    assert ready["steps_left"] == 0 and ready["weights"] == "none (no step left)", ready


def test_twenty_steps_from_a_fixed_seed_raise_the_reward(dm: Dynamod) -> None:
    """The tiny model learns the trainer's task (start new words) on the default stack,
    every step's logprobs match the trainer's (boundary 1), and the curve is drawn."""
    steps = 20
    dm.run("up", "--detach", "--var", f"trainer_steps={steps}", timeout=300, check=True)

    def trainer_settled(status: dict[str, Any]) -> dict[str, Any] | None:
        unit = unit_by_name(status, "trainer")
        return unit if unit["state"] in {"completed", "failed"} else None

    trainer = dm.wait_for(trainer_settled, timeout=240, what="20 trainer steps")
    log = Path(trainer["log"])
    assert trainer["state"] == "completed", log.read_text()[-3000:]
    events = trainer_events(log)
    rewards = [e["mean_reward"] for e in events if e["event"] == "trainer.step"]
    assert len(rewards) == steps
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    evaluated = next(e for e in events if e["event"] == "trainer.eval")["mean_reward"]
    assert late > early + 0.15, rewards
    assert evaluated > early + 0.15, (evaluated, rewards)

    checks = [e for e in events if e["event"] == "trainer.boundary"]
    assert len(checks) == steps
    assert all(c["ok"] and c["terminal"] + c["cancelled"] == 16 for c in checks)
    assert all(c["tokens"] > 0 and c["max_abs_diff"] <= c["tolerance"] for c in checks)

    curve = dm.state_dir / "trainer" / "reward.png"
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
