"""Ray as units across nodes: the stock units/cluster/ray-head.toml and units/ray-worker.toml
commands (rendered here for two network namespaces) start a head on one node and a worker on
the other, and the worker joins: the head's GCS counts two alive nodes. Needs `ray` (the
verl extra) beside the interpreter."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamod.chaos.netns import Sandbox, can_create_namespaces

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("netns")]
BIN = Path(sys.executable).parent
UNITS = Path(__file__).resolve().parents[2] / "units"
REASON = can_create_namespaces()
if REASON is not None:
    pytest.skip(f"no network namespaces: {REASON}", allow_module_level=True)
if not (BIN / "ray").exists():
    pytest.skip(f"ray is not installed beside {sys.executable} (the verl extra)",
                allow_module_level=True)  # fmt: skip


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


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Ray's socket paths under its temp dir must fit AF_UNIX's 107 bytes: not tmp_path."""
    path = Path(tempfile.mkdtemp(prefix="dr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_ray_worker_joins_the_head_across_nodes(short_dir: Path) -> None:
    tmp_path = short_dir
    with Sandbox(2, prefix="dmray") as box:
        head, worker = box.addresses
        env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        head_cmd, head_env = render(UNITS / "cluster" / "ray-head.toml", "ray-head", {
            "node.address": head, "node.name": "head", "state_dir": str(tmp_path / "h"),
        })  # fmt: skip
        worker_cmd, worker_env = render(UNITS / "ray-worker.toml", "ray-worker", {
            "node.address": worker, "node.name": "n1", "cluster.head_address": head,
            "state_dir": str(tmp_path / "w"),
        })  # fmt: skip
        logs = [open(tmp_path / f"{n}.log", "wb") for n in ("head", "worker")]  # noqa: SIM115
        ray_head = box.run(0, head_cmd, env=env | head_env, stdout=logs[0],
                           stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 240
        while "Ray runtime started" not in (tmp_path / "head.log").read_text(errors="replace"):
            assert time.monotonic() < deadline and ray_head.poll() is None, (
                tmp_path / "head.log"
            ).read_text()[-3000:]
            time.sleep(0.5)
        box.run(1, worker_cmd, env=env | worker_env, stdout=logs[1], stderr=subprocess.STDOUT)
        alive = ""
        while time.monotonic() < deadline:
            status = subprocess.run(
                box.command(0, [str(BIN / "ray"), "status", "--address", f"{head}:6379"]),
                capture_output=True, text=True, env=env | head_env, timeout=60,
            )  # fmt: skip
            active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
            alive = status.stdout + status.stderr
            if len(re.findall(r"\bnode_[0-9a-f]+", active)) == 2:
                break
            time.sleep(1)  # between `ray status` calls (each a CLI start) until the deadline
        else:
            raise AssertionError(
                f"the worker never joined; ray status:\n{alive[-2000:]}\nworker log:\n"
                + (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
            )
        for log in logs:
            log.close()
