"""A unit's `limits` on the real host: a unit allocating past memory_max is shown as
killed by the kernel's OOM killer (status, events, `up`'s failure), an operator's kill -9
of a limited unit is not, pids_max refuses forks past it, cpuset is the unit's
Cpus_allowed_list, nice its scheduling priority, and `down` leaves no cgroup of the run in
any hierarchy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dynamod.control.render import status_table
from dynamod.core import cgroups, events
from tests.conftest import Dynamod, unit_by_name

CGROUP_ROOT = Path("/sys/fs/cgroup")
OOM = "killed by the kernel's OOM killer (memory_max 48M)"
CPU = min(os.sched_getaffinity(0))

STACK = f"""
    [units.hog]
    command = ["{{python}}", "@PROC@", "allocate", "200", "--after", "@AFTER@"]
    limits = {{ memory_max = "48M" }}
    restart = {{ policy = "never", min_uptime = 0.2 }}
    [units.victim]
    command = ["{{python}}", "@PROC@", "sleep"]
    limits = {{ memory_max = "48M" }}
    restart = {{ policy = "never", min_uptime = 0.2 }}
    [units.forker]
    command = ["{{python}}", "@PROC@", "forks", "20"]
    limits = {{ pids_max = 6, cpuset = "{CPU}", nice = 7 }}
    restart = {{ min_uptime = 0.2 }}
"""


def _run_cgroups(run_id: str) -> list[Path]:
    """Every cgroup directory of this run, in every hierarchy (v1 and v2)."""
    found: list[Path] = []
    for top in CGROUP_ROOT.iterdir():
        for path in top.rglob(f"dynamod-{run_id}") if top.is_dir() else ():
            found.append(path)
    return found


def _memory_cgroup() -> bool:
    """Whether dynamod can give a unit a memory cgroup here: the v2 controller enabled
    below our own cgroup, or the v1 memory hierarchy writable."""
    base, _ = cgroups.own_cgroup_dir()
    try:
        if base is not None and "memory" in (base / "cgroup.subtree_control").read_text():
            return True
        v1 = cgroups.v1_hierarchies().get("memory")
    except OSError:
        return False
    return v1 is not None and os.access(v1, os.W_OK)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _memory_cgroup(), reason="no memory cgroup dynamod may create"),
]


def test_oom_kill_is_named_kill_9_is_not_and_down_leaves_no_cgroup(
    dm: Dynamod, stack_file: Any
) -> None:
    stack = stack_file(STACK.replace("@AFTER@", "1.5"))
    dm.run("up", str(stack), "--detach", check=True)
    run_id = dm.run_id()
    assert run_id is not None
    status = dm.status()
    hog = unit_by_name(status, "hog")
    assert hog["limits"] is not None and hog["limits"]["mechanism"].startswith("cgroup v")
    assert _run_cgroups(run_id), "the limited units have cgroups of this run"

    # (b) the must-fail side: an operator's kill -9 of a limited unit keeps today's words
    victim = unit_by_name(status, "victim")
    assert victim["pid"] is not None
    os.kill(victim["pid"], 9)
    # (a) the hog allocates past memory_max 1.5 s after its start
    dm.wait_for(lambda s: all(unit_by_name(s, n)["state"] == "failed" for n in ("hog", "victim")),
                timeout=20, what="hog OOM-killed and victim killed")  # fmt: skip
    status = dm.status()
    hog, victim = unit_by_name(status, "hog"), unit_by_name(status, "victim")
    assert hog["last_exit"] == OOM and hog["detail"].startswith(OOM)
    assert hog["limits"] is not None and hog["limits"]["oom_kills"] == 1
    assert victim["last_exit"] == "killed by SIGKILL" and "OOM" not in victim["detail"]
    assert victim["limits"] is not None and victim["limits"]["oom_kills"] == 0
    shown = status_table(status)  # what `status` prints (the CLI's own tests run the CLI)
    assert OOM in shown and "limits hog (cgroup v" in shown and "OOM-killed 1 time(s)" in shown
    ooms = [e for e in events.read(dm.state_dir)[0] if e["kind"] == "oom_kill"]
    assert [(e["unit"], e["limit"]) for e in ooms] == [("hog", "memory_max 48M")]
    assert '"event": "unit.oom_killed"' in dm.daemon_log()

    # (c) pids_max 6: the unit itself and 5 children; cpuset: its Cpus_allowed_list
    forker = unit_by_name(status, "forker")
    log = Path(forker["log"]).read_text()
    assert forker["limits"] is not None
    if " via cgroup " in forker["limits"]["limits"]["pids_max"]:  # RLIMIT_NPROC: per user
        assert "forked 5 of 20" in log, log
    proc_status = Path(f"/proc/{forker['pid']}/status").read_text()
    allowed = next(x for x in proc_status.splitlines() if x.startswith("Cpus_allowed_list"))
    assert allowed.split()[-1] == str(CPU)
    assert os.getpriority(os.PRIO_PROCESS, forker["pid"]) == 7  # nice: the daemon's is 0
    nice = forker["limits"]["limits"]["nice"]
    assert nice.startswith("7 via priority setpriority"), nice  # + its session's or cgroup's

    # (d) nothing of the run is left in any cgroup hierarchy
    dm.run("down", check=True)
    assert _run_cgroups(run_id) == []


def test_up_fails_naming_the_oom_kill(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file("""
        [units.hog]
        command = ["{python}", "@PROC@", "allocate", "200"]
        limits = { memory_max = "48M" }
        restart = { policy = "never", min_uptime = 5 }
    """)
    result = dm.run("up", str(stack), "--detach")
    run_id = dm.run_id()
    assert result.returncode == 1, result.stderr
    assert OOM in result.stderr, result.stderr
    assert run_id is not None and _run_cgroups(run_id) == []
