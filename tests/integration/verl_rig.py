"""What the verl and Ray integration tests share: verl's config for the `dynamod` rollout,
the stock Ray units' commands rendered for a network-namespace sandbox, and a Ray head and
worker started across two of its nodes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from dynamod.chaos.netns import Sandbox

BIN = Path(sys.executable).parent
UNITS = Path(__file__).resolve().parents[2] / "units"
RAY_GCS_PORT = 6379  # the stock units' default


def verl_config(state_dir: Path, n_gpus: int = 2, nnodes: int = 1) -> Any:
    """verl's generated PPO config with the `dynamod` rollout on the tiny model:
    `n_gpus` x `nnodes` one-GPU replicas attached to the stack at `state_dir`."""
    import verl
    from omegaconf import OmegaConf

    from dynamod.core.paths import cache_dir

    base = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    config = OmegaConf.load(base)
    config.actor_rollout_ref.model.path = str(cache_dir() / "models" / "tiny-cpu")
    rollout = config.actor_rollout_ref.rollout
    rollout.name = "dynamod"
    rollout.mode = "async"
    rollout.nnodes = nnodes
    rollout.n_gpus_per_node = n_gpus
    rollout.tensor_model_parallel_size = 1
    rollout.data_parallel_size = 1
    rollout.pipeline_model_parallel_size = 1
    rollout.prompt_length = 32
    rollout.response_length = 8
    rollout.engine_kwargs = {"dynamod": {"state_dir": str(state_dir)}}
    rollout.checkpoint_engine.backend = "naive"
    return config


def render(path: Path, unit: str, context: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """A unit's command and env with its templates filled from `context` (a flat dict)."""
    data = tomllib.loads(path.read_text())
    variables = {f"vars.{k}": str(v) for k, v in data.get("vars", {}).items()}
    table = data["units"][unit]
    scope = {**variables, **context}

    def fill(text: str) -> str:
        return re.sub(r"\{([\w.@-]+)\}", lambda m: scope[m.group(1)], text)

    ports = {f"ports.{k}": fill(str(v)) for k, v in table.get("ports", {}).items()}
    scope.update(ports)
    command = [fill(w) for w in table["command"]]
    command[0] = str(BIN / command[0]) if command[0] == "ray" else command[0]
    return command, {k: fill(v) for k, v in table.get("env", {}).items()}


def start_ray(box: Sandbox, work: Path, head: int = 0, worker: int = 1,
              timeout: float = 240) -> list[subprocess.Popen[bytes]]:  # fmt: skip
    """The stock Ray head on node `head` and a Ray worker on node `worker` (their commands
    from units/cluster/ray-head.toml and units/ray-worker.toml; logs and temp dirs under
    `work`, short enough for Ray's socket paths), returned once the head's GCS counts both
    nodes alive; AssertionError with `ray status` and the logs when it does not in
    `timeout`. The sandbox's close ends them (each runs in a process group of its own)."""
    head_address, worker_address = box.address(head), box.address(worker)
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    head_cmd, head_env = render(UNITS / "cluster" / "ray-head.toml", "ray-head", {
        "node.address": head_address, "node.name": "head", "state_dir": str(work / "h"),
    })  # fmt: skip
    worker_cmd, worker_env = render(UNITS / "ray-worker.toml", "ray-worker", {
        "node.address": worker_address, "node.name": "n1", "cluster.head_address": head_address,
        "state_dir": str(work / "w"),
    })  # fmt: skip
    head_log, worker_log = work / "head.log", work / "worker.log"
    with head_log.open("wb") as out:
        ray_head = box.run(head, head_cmd, env=env | head_env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while "Ray runtime started" not in head_log.read_text(errors="replace"):
        assert time.monotonic() < deadline and ray_head.poll() is None, (
            head_log.read_text(errors="replace")[-3000:]
        )
        time.sleep(0.5)
    with worker_log.open("wb") as out:
        ray_worker = box.run(worker, worker_cmd, env=env | worker_env, stdout=out,
                             stderr=subprocess.STDOUT)  # fmt: skip
    alive = ""
    while time.monotonic() < deadline:
        status = subprocess.run(
            box.command(head, [str(BIN / "ray"), "status", "--address",
                               f"{head_address}:{RAY_GCS_PORT}"]),
            capture_output=True, text=True, env=env | head_env, timeout=60,
        )  # fmt: skip
        active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        alive = status.stdout + status.stderr
        if len(re.findall(r"\bnode_[0-9a-f]+", active)) == 2:
            return [ray_head, ray_worker]
        time.sleep(1)  # between `ray status` calls (each a CLI start) until the deadline
    raise AssertionError(
        f"the Ray worker never joined; ray status:\n{alive[-2000:]}\nworker log:\n"
        + worker_log.read_text(errors="replace")[-3000:]
    )
