"""verl's own trainer, end to end on CPU: `python -m verl.trainer.main_ppo` for 2 GRPO steps
(the legacy TaskRunner, 1 FSDP2 rank over gloo) against a real dynamod stack (etcd, NATS,
the Dynamo frontend, one CPU worker, a Ray head), with `rollout.name=dynamod`, on a parquet
dataset built here. verl's trainer sleeps the replicas after each generation and wakes
them through the rollout adapter before each weight update, which a test driving the
adapter directly never does. One stack for the module (Ray and verl start slowly)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Loopback Ray: read by ray when it is imported, and `import verl` imports ray; a module
# collected before test_verl_rollout.py would otherwise leave it unset for that one too.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from dynamod.client import Client
from dynamod.integrations.verl import dataset, run
from dynamod.integrations.verl.updates import read_updates
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
        dm.teardown()


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


def pushes_of(stack: Dynamod) -> list[dict[str, Any]]:
    return read_updates(stack.state_dir)


def test_main_ppo_two_grpo_steps(stack: Dynamod) -> None:
    # saves verl's own checkpoint at its last step, for the resumed run below
    result = main_ppo(stack, extra=[f"trainer.save_freq={STEPS}"])
    assert result.returncode == 0, tail(result)
    policy = Client(stack.state_dir).policy_status()
    # verl pushes its step 0 (the loaded weights) once initialised, then one step per update.
    assert policy["current"] == STEPS, policy
    pushes = pushes_of(stack)
    # a fresh stack: verl's steps are the ledger's versions, all from one run
    assert [(p["verl_step"], p["step"]) for p in pushes] == [(s, s) for s in range(STEPS + 1)]
    assert len({p["run"] for p in pushes}) == 1
    digests = [p["digest"] for p in pushes]
    # step 0 is the loaded weights; each update changes them
    assert all(digests) and len(set(digests)) == len(digests), digests
    shard = stack.unit("worker@0")
    assert shard["policy_version"] == STEPS
    answer = generate(stack, STEPS)
    tokens = answer["choices"][0]
    assert tokens["text"] is not None and answer["usage"]["completion_tokens"] > 0, answer


def test_resumed_run_continues_after_the_ledger(stack: Dynamod) -> None:
    """verl resumes from its own checkpoint (step 2, saved above) and restarts its step
    count there, below the ledger's version 2: its steps become versions after the
    ledger's, recorded with the new run and verl's steps. With free_cache_engine off verl
    never wakes the shards, so the replica must not sleep them either."""
    before = pushes_of(stack)
    assert before, "the first run pushed nothing (it runs first in this module)"
    result = main_ppo(stack, steps=STEPS + 1,
                      extra=["actor_rollout_ref.rollout.free_cache_engine=False"])
    assert result.returncode == 0, tail(result)
    output = result.stdout + result.stderr
    assert "Resuming from" in output, tail(result)
    new = pushes_of(stack)[len(before):]
    last = before[-1]["step"]
    assert [(p["verl_step"], p["step"]) for p in new] == [(STEPS, last + 1), (STEPS + 1, last + 2)]
    assert {p["run"] for p in new} != {before[0]["run"]} and len({p["run"] for p in new}) == 1
    assert Client(stack.state_dir).policy_status()["current"] == last + 2
    assert stack.unit("worker@0")["policy_version"] == last + 2
    assert "verl.sleep_skipped" in output and "call=sleep" not in output
    generate(stack, last + 2)


def test_fresh_run_on_a_stack_whose_ledger_is_ahead(stack: Dynamod) -> None:
    """A new verl run (its step 0) on a stack that served an earlier run continues from
    the ledger instead of failing `step 0 is older than the current policy version`."""
    current = Client(stack.state_dir).policy_status()["current"]
    assert current > 0
    before = len(pushes_of(stack))
    result = main_ppo(stack, steps=1,
                      extra=[f"trainer.default_local_dir={stack.state_dir / 'fresh-run'}"])
    assert result.returncode == 0, tail(result)
    new = pushes_of(stack)[before:]
    assert [(p["verl_step"], p["step"]) for p in new] == [(0, current + 1), (1, current + 2)]
    assert len({p["digest"] for p in new}) == 2
    assert Client(stack.state_dir).policy_status()["current"] == current + 2


def refusal(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused config prints; nothing of Ray's start in the output."""
    assert result.returncode == 2, tail(result)
    lines = [ln for ln in result.stderr.splitlines() if "refused" in ln]
    assert len(lines) == 1, tail(result)
    assert "Traceback" not in result.stderr and "ray init kwargs" not in result.stdout
    return lines[0]


# One refusal end to end (verl's main_ppo, the plugin's check, exit 2 and one line before
# Ray starts); the other rules (trainer.device=cuda without a GPU, ...) are the same check
# on other keys, tested on the config alone in tests/unit/test_verl_preflight.py.
def test_too_many_ranks_for_the_stacks_ray_refused_before_ray_starts(stack: Dynamod) -> None:
    version = Client(stack.state_dir).policy_status()["current"]
    line = refusal(main_ppo(stack, ranks=3))
    assert "trainer.n_gpus_per_node" in line and "--var ray_num_gpus=N" in line, line
    assert Client(stack.state_dir).policy_status()["current"] == version
