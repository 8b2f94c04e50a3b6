"""Faults under verl's own trainer (`main_ppo`, 1 FSDP2 rank, 2 CPU shards): a shard
killed -9 in the middle of a rollout step, the frontend killed -9 in the middle of one,
and the trainer itself killed -9 and resumed from its checkpoint. Each run must finish
with every step's version right; the ledger never goes backwards. And the trainer rank
killed -9 inside its IPC update (`weight_sync: ipc`), the shards it paused still paused:
the run fails, and dynamod rejoins the shards at the ledger's version.

Each is a full trainer run (two for the resume), several minutes on 2 shared cores, so
they run with `make validate-cpu` (DYNAMOD_VERL_FAULTS=1), not in the CI suite; the
numbers are in docs/verl.md."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Loopback Ray: read by ray when it is imported, and `import verl` imports ray; a module
# collected before test_verl_rollout.py would otherwise leave it unset for that one too.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
if not os.environ.get("DYNAMOD_VERL_FAULTS"):
    pytest.skip("full trainer runs under faults: `make validate-cpu` (DYNAMOD_VERL_FAULTS=1)",
                allow_module_level=True)

from dynamod.chaos.stack import engine_call
from dynamod.client import Client
from dynamod.integrations.verl import dataset, run
from dynamod.integrations.verl.updates import read_updates
from tests.conftest import Dynamod

pytestmark = pytest.mark.slow

STEPS = 3
LONGER = ["data.max_response_length=48"]


@pytest.fixture
def stack() -> Iterator[Dynamod]:
    state = Path(tempfile.mkdtemp(prefix="dmvf-", dir="/tmp"))
    dm = Dynamod(state)
    try:
        dm.run("up", "units/stacks/verl-cpu.toml", "--detach", "--var", "workers=2",
               timeout=400, check=True)
        yield dm
    finally:
        dm.teardown()


def start(stack: Dynamod, steps: int = STEPS, extra: list[str] | None = None) -> Any:
    data = stack.state_dir / "data"
    if not (data / "train.parquet").exists():
        dataset.write(data)
    cmd = run.command(stack.state_dir, data, steps, 1, extra=[*LONGER, *(extra or [])])
    log = (stack.state_dir / f"main_ppo-{time.monotonic_ns()}.log").open("w")
    return subprocess.Popen(cmd, env=run.environment(), stdout=log, stderr=subprocess.STDOUT,
                            cwd=stack.state_dir, start_new_session=True)


def wait_update(stack: Dynamod, proc: Any, verl_step: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(u.get("verl_step") == verl_step for u in read_updates(stack.state_dir)):
            return
        assert proc.poll() is None, f"main_ppo exited {proc.returncode} before step {verl_step}"
        time.sleep(0.05)
    raise AssertionError(f"no update for verl step {verl_step} in {timeout} s")


def finish(proc: Any, timeout: float = 900) -> None:
    assert proc.wait(timeout=timeout) == 0, f"main_ppo exited {proc.returncode}"


def assert_versions_forward(stack: Dynamod, last: int) -> list[dict[str, Any]]:
    records = read_updates(stack.state_dir)
    versions = [r["step"] for r in records]
    assert versions == sorted(versions) and len(set(versions)) == len(versions), versions
    assert Client(stack.state_dir).policy_status()["current"] == versions[-1] == last
    stack.wait_for(
        lambda s: all(u.get("policy_version") == last for u in s["units"]
                      if u["name"].startswith("worker@")),
        timeout=120, what=f"every shard at version {last}",
    )
    return records


def kill_mid_rollout(stack: Dynamod, unit: str) -> tuple[int, float]:
    """Kill -9 `unit` just after verl's step-1 update, while step 2 generates."""
    pid = stack.unit(unit)["pid"]
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


def test_shard_killed_mid_rollout_step(stack: Dynamod) -> None:
    proc = start(stack)
    wait_update(stack, proc, 1)
    old, _ = kill_mid_rollout(stack, "worker@1")
    finish(proc)
    records = assert_versions_forward(stack, STEPS)
    assert [r["verl_step"] for r in records] == list(range(STEPS + 1))
    shard = stack.unit("worker@1")
    assert shard["pid"] != old and shard["restarts"] >= 1


def test_frontend_restarted_mid_rollout_step(stack: Dynamod) -> None:
    proc = start(stack)
    wait_update(stack, proc, 1)
    old, _ = kill_mid_rollout(stack, "frontend")
    finish(proc)
    records = assert_versions_forward(stack, STEPS)
    assert [r["verl_step"] for r in records] == list(range(STEPS + 1))
    assert stack.unit("frontend")["pid"] != old


def test_trainer_killed_and_resumed_from_its_checkpoint(stack: Dynamod) -> None:
    proc = start(stack, extra=["trainer.save_freq=1"])
    wait_update(stack, proc, 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    before = read_updates(stack.state_dir)
    current = before[-1]["step"]
    proc = start(stack, extra=["trainer.save_freq=1"])
    finish(proc)
    records = assert_versions_forward(stack, current + 2)
    resumed = records[len(before):]
    # verl resumes from its step-2 checkpoint: steps 2 and 3 become the versions after
    assert [(r["verl_step"], r["step"]) for r in resumed] == [(2, current + 1), (3, current + 2)]


def _claimed(stack: Dynamod, seen: int) -> tuple[dict[str, Any] | None, int]:
    """The first pause claim a verl rank took after the daemon log's first `seen` bytes."""
    log = stack.state_dir / "daemon.log"
    with log.open("rb") as file:
        file.seek(seen)
        text = file.read()
    for line in text.splitlines():
        if b'"policy.pause_claimed"' in line and b"verl rank" in line:
            return json.loads(line), seen
    return None, seen + text.rfind(b"\n") + 1


def _liveness(unit: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = engine_call(unit["dynamo"]["system_url"], "liveness_probe")
    return answer


def test_trainer_rank_killed_in_its_ipc_update_leaves_no_shard_paused(stack: Dynamod) -> None:
    """The rank is stopped (SIGSTOP) the moment its claim shows in dynamod's log, before its
    update's publish, so the shards it paused are still paused; then killed -9."""
    proc = start(stack, extra=["+actor_rollout_ref.rollout.engine_kwargs.dynamod.weight_sync=ipc"])
    wait_update(stack, proc, 0)
    current = Client(stack.state_dir).policy_status()["current"]
    seen = (stack.state_dir / "daemon.log").stat().st_size
    claim = None
    deadline = time.monotonic() + 600
    while claim is None:
        assert proc.poll() is None and time.monotonic() < deadline, "no claim in the run"
        claim, seen = _claimed(stack, seen)
        if claim is None:
            time.sleep(0.002)
    rank = int(claim["pid"])
    os.kill(rank, signal.SIGSTOP)  # ours: a Ray worker of the stack's ray-head unit
    try:
        shown = {u["name"]: u for u in stack.status()["units"] if u["name"].startswith("worker@")}
        paused = [n for n, u in shown.items() if u["policy"].get("paused_by")]
        assert paused == claim["shards"], (paused, claim)
        assert all(u["policy"]["paused_by"][0]["pid"] == rank for n, u in shown.items()
                   if n in paused)  # fmt: skip
        ledger = Client(stack.state_dir).policy_status()
    finally:
        os.kill(rank, signal.SIGKILL)
    assert proc.wait(timeout=300) != 0  # verl's run ends with its rank
    last = ledger["current"]
    assert last >= current
    back = stack.wait_for(
        lambda s: all(u["state"] == "ready" and u.get("policy_version") == last
                      and u["policy"]["admitted"] and not u["policy"].get("paused_by")
                      for u in s["units"] if u["name"].startswith("worker@"))
        and s["policy"]["paused_outside"] == [] and s,
        timeout=120, what=f"every shard rejoined at version {last}",
    )  # fmt: skip
    # nothing was published after the rank stopped: the shards are back at that version
    assert Client(stack.state_dir).policy_status()["current"] == last
    for unit in (u for u in back["units"] if u["name"].startswith("worker@")):
        assert _liveness(unit)["paused"] is False, unit["name"]  # the engine agrees
        assert unit["policy"]["digest"] == ledger["current_digest"], unit
    orphaned = [json.loads(line) for line in stack.daemon_log().splitlines()
                if '"policy.pause_orphaned"' in line]  # fmt: skip
    assert sorted(o["shard"] for o in orphaned) == sorted(claim["shards"]), orphaned
    assert all(o["pid"] == rank for o in orphaned)
