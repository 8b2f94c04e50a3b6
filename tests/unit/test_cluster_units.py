"""The cluster's stock unit files (etcd and NATS members, the auth oneshot, the Ray head and
workers) make a stack `dynamod check` accepts, rendered with the node's addresses and no
secret in any command line. Needs the [cluster] spec (dynamod.core.placement) and `ray`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests import cli_inprocess

pytest.importorskip("dynamod.core.placement", reason="the [cluster] spec is not on this branch")
# `make test` runs .venv/bin/pytest without the venv on PATH: look beside the interpreter too.
if shutil.which("ray") is None and not (Path(sys.executable).parent / "ray").exists():
    pytest.skip("ray is not installed (the verl extra)", allow_module_level=True)

UNITS = Path(__file__).resolve().parents[2] / "units"


def test_check_accepts_a_cluster_stack_with_ray_workers(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    made = cli_inprocess.run([
        "secrets", "init", str(secrets), "--nodes", "head=10.77.0.1,n1=10.77.0.2,n2=10.77.0.3",
    ])  # fmt: skip
    assert made.code == 0, made.stderr
    stack = tmp_path / "stack.toml"
    stack.write_text(f"""
[stack]
name = "cluster"
include = ["{UNITS}/cluster/etcd-member.toml", "{UNITS}/cluster/nats-member.toml",
           "{UNITS}/cluster/etcd-auth.toml", "{UNITS}/cluster/ray-head.toml",
           "{UNITS}/ray-worker.toml"]

[cluster]
nodes = {{ head = "10.77.0.1", n1 = "10.77.0.2", n2 = "10.77.0.3" }}
secrets = "{secrets}"
""")
    result = cli_inprocess.run(["--state-dir", str(tmp_path / "s"), "check", str(stack)])
    assert result.code == 0, result.stderr
    assert "is valid" in result.stdout
    # Ray has no auth of its own: its binds on the node's address are warned about.
    assert "ray-head: --node-ip-address binds 10.77.0.1 beyond loopback" in result.stderr
    assert "etcd:" not in result.stderr and "nats:" not in result.stderr
