"""Per-replica CPU placement on the real host: `placement = { cpus_per_replica = N,
cpus_env = VAR }` runs replica i on CPUs i*N .. i*N+N-1 (its affinity, via a cpuset cgroup
where the host has one) and puts that list in VAR (a real-engine shard's
VLLM_CPU_OMP_THREADS_BIND); a placement beyond the machine's CPUs is refused before
anything starts, in one line naming the unit and the fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Dynamod, unit_by_name

pytestmark = pytest.mark.skipif(
    not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1 to place two replicas"
)

STACK = """
    [vars]
    shards = 2
    [units.shard]
    command = ["{python}", "@PROC@", "sleep"]
    replicas = "{vars.shards}"
    placement = { cpus_per_replica = 1, cpus_env = "BIND" }
    env = { BIND = "nobind" }
    restart = { min_uptime = 0.2 }
"""


def _allowed(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list")).split()[-1]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_each_replica_runs_on_its_own_cpus(dm: Dynamod, stack_file: Any) -> None:
    stack = str(stack_file(STACK))
    dm.run("up", stack, "--detach", check=True)
    status = dm.status()
    for index in (0, 1):
        pid = unit_by_name(status, f"shard@{index}")["pid"]
        assert _allowed(pid) == str(index)
        assert _environ(pid)["BIND"] == str(index)

    more = os.cpu_count() or 2
    refused = dm.run("check", stack, "--var", f"shards={more + 1}")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert f"unit 'shard@{more}'" in lines[0] and "fewer replicas or fewer CPUs each" in lines[0]
