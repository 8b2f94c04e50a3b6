"""Enforcer.reweigh (dynamod/core/enforce.py) on a real child process: a unit at its own
`nice` weighed as at the daemon's for a while, then as its own again, by every mechanism
its nice was enforced with here (each thread's priority; its session's autogroup where
the kernel groups sessions). Lowering a nice takes root."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamod.core import cgroups
from dynamod.core.enforce import Enforcer
from dynamod.core.spec.models import LimitsSpec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice takes root")
THREADS = "import threading, time; [threading.Thread(target=time.sleep, args=(60,)).start() " \
          "for _ in range(2)]; time.sleep(60)"  # fmt: skip


def nice_ten() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, 10)
    if Path("/proc/self/autogroup").exists():
        Path("/proc/self/autogroup").write_text("10")


@pytest.fixture
def child() -> Iterator[int]:
    """A process with three threads in a session of its own at nice 10, as a unit with
    `nice = 10` is spawned."""
    proc = subprocess.Popen([sys.executable, "-c", THREADS], start_new_session=True,
                            preexec_fn=nice_ten)  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{proc.pid}/task")) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def weighed(pid: int) -> tuple[set[int], str | None]:
    """Its threads' nice values, and its autogroup's nice (None without autogroups)."""
    nices = {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}
    group = Path(f"/proc/{pid}/autogroup")
    return nices, group.read_text().split()[-1] if group.exists() else None


def enforcer(nice: int | None) -> Enforcer:
    made = Enforcer("t", cgroups.Containment(cgroups.Kind.PGROUP, None), hierarchies={})
    made.prepare("worker@0", LimitsSpec(nice=nice))
    return made


def test_a_unit_is_lifted_to_a_nice_then_set_back_to_its_own(child: int) -> None:
    limits = enforcer(10)
    grouped = limits.plans["worker@0"].autogroup
    assert len(os.listdir(f"/proc/{child}/task")) == 3
    assert weighed(child) == ({10}, "10" if grouped else None)
    assert limits.reweigh("worker@0", child, 0)
    assert weighed(child) == ({0}, "0" if grouped else None)  # every thread, and its session
    assert limits.reweigh("worker@0", child, None)
    assert weighed(child) == ({10}, "10" if grouped else None)


def test_a_unit_without_a_nice_of_its_own_is_left_as_it_is(child: int) -> None:
    assert not enforcer(None).reweigh("worker@0", child, 0)
    assert not enforcer(10).reweigh("worker@1", child, 0)  # a unit it has no plan for
    assert weighed(child)[0] == {10}


def test_a_process_that_is_gone_says_so() -> None:
    gone = subprocess.Popen(["sleep", "60"], preexec_fn=nice_ten, start_new_session=True)
    gone.kill()
    gone.wait()  # reaped: its pid names nothing now
    with pytest.raises(FileNotFoundError):
        enforcer(10).reweigh("worker@0", gone.pid, 0)
