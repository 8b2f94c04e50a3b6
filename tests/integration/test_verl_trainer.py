"""verl's own trainer, end to end on CPU: `python -m verl.trainer.main_ppo` for 2 GRPO steps
(the legacy TaskRunner, 1 FSDP2 rank over gloo) against a real dynamod stack (etcd, NATS,
the Dynamo frontend, one CPU worker, a Ray head), with `rollout.name=dynamod`, on a parquet
dataset built here. verl's trainer sleeps the replicas after each generation and wakes
them through the rollout adapter before each weight update, which a test driving the
adapter directly never does. One stack for the module (Ray and verl start slowly)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install -e '.[verl]')")

from dynamod.client import Client
from dynamod.core.proctable import marked_pids
from dynamod.integrations.verl import checkpoint, dataset, run
from tests.conftest import Dynamod

pytestmark = pytest.mark.slow

STEPS = 2


@pytest.fixture(scope="module")
def stack() -> Iterator[Dynamod]:
    state = Path(tempfile.mkdtemp(prefix="dmvt-", dir="/tmp"))
    dm = Dynamod(state)
    try:
        dm.run("up", "units/stacks/verl-cpu.toml", "--detach", "--var", "workers=1",
               timeout=400, check=True)
        yield dm
    finally:
        run_id = dm.run_id()
        if (state / "dynamod.sock").exists():
            dm.run("down", timeout=120)
        if run_id:
            for pid in marked_pids(run_id):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(state, ignore_errors=True)


def main_ppo(stack: Dynamod, steps: int = STEPS, ranks: int = 1,
             extra: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    data = stack.state_dir / "data"
    if not (data / "train.parquet").exists():
        dataset.write(data)
    cmd = run.command(stack.state_dir, data, steps, ranks, extra=extra)
    env = run.environment({**os.environ, "PYTHONUNBUFFERED": "1"})
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                            cwd=stack.state_dir)
    return result


def tail(result: subprocess.CompletedProcess[str], lines: int = 40) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])


def generate(stack: Dynamod, version: int) -> dict[str, Any]:
    """One completion through the frontend, required to come from `version`'s weights."""
    import json
    import urllib.request

    from dynamod.integrations.verl import completions
    from dynamod.integrations.verl.config import RolloutSettings
    from dynamod.integrations.verl.stack import read_stack

    view = read_stack(stack.state_dir)
    body = completions.build_request(
        model=view.model or "", prompt_ids=[1, 5, 9, 13], sampling_params={"logprobs": True},
        max_tokens=4, version=version, settings=RolloutSettings(), request_id="after-update",
    )
    request = urllib.request.Request(
        f"{view.frontend_url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        result: dict[str, Any] = json.loads(answer.read())
    return result


def test_main_ppo_two_grpo_steps(stack: Dynamod) -> None:
    result = main_ppo(stack)
    assert result.returncode == 0, tail(result)
    policy = Client(stack.state_dir).policy_status()
    # verl pushes its step 0 (the loaded weights) once initialised, then one step per update.
    assert policy["current"] == STEPS, policy
    pushes = checkpoint.read_pushes(stack.state_dir / "verl" / "checkpoints")
    # a fresh stack: verl's steps are the ledger's versions, all from one run
    assert [(p["step"], p["version"]) for p in pushes] == [(s, s) for s in range(STEPS + 1)]
    assert len({p["run"] for p in pushes}) == 1
    digests = [p["digest"] for p in pushes]
    # step 0 is the loaded weights; each update changes them
    assert all(digests) and len(set(digests)) == len(digests), digests
    shard = stack.unit("worker@0")
    assert shard["policy_version"] == STEPS
    answer = generate(stack, STEPS)
    tokens = answer["choices"][0]
    assert tokens["text"] is not None and answer["usage"]["completion_tokens"] > 0, answer
