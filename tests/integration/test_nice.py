"""`limits.nice` orders a unit against the other units on the real host: two units that
burn the same CPU, one at nice 19, share it as the kernel weighs those nice values, not
half and half. Each unit starts in a session of its own; where the kernel groups sessions
(sched_autogroup_enabled) a process's nice alone orders nothing between units, so this
fails unless the unit's session gets the nice too."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tests.conftest import Dynamod, unit_by_name

CPU = min(os.sched_getaffinity(0))
BURN = 'while True: pass'
STACK = f"""
    [units.eager]
    command = ["{{python}}", "-c", "{BURN}"]
    limits = {{ cpuset = "{CPU}" }}
    [units.meek]
    command = ["{{python}}", "-c", "{BURN}"]
    limits = {{ cpuset = "{CPU}", nice = 19 }}
"""


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_a_nice_unit_yields_its_cpu_to_another_unit(dm: Dynamod, stack_file: Any) -> None:
    dm.run("up", str(stack_file(STACK)), "--detach", check=True)
    status = dm.status()
    eager, meek = (unit_by_name(status, name) for name in ("eager", "meek"))
    assert eager["pid"] is not None and meek["pid"] is not None
    assert os.getpriority(os.PRIO_PROCESS, meek["pid"]) == 19
    assert meek["limits"] is not None
    how = meek["limits"]["limits"]["nice"]
    assert how.startswith("19 via priority setpriority"), how
    autogroup = Path(f"/proc/{meek['pid']}/autogroup")
    if "autogroup" in how:  # the kernel groups sessions: the unit's own took the nice
        assert autogroup.read_text().split()[-2:] == ["nice", "19"]
    # the two share one CPU for 2 s: nice 19 weighs 15 against nice 0's 1024
    before = [_cpu_ticks(u["pid"]) for u in (eager, meek)]
    time.sleep(2.0)
    after = [_cpu_ticks(u["pid"]) for u in (eager, meek)]
    used = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(used) > 0, used
    share = used[1] / sum(used)
    assert share < 0.2, f"the nice-19 unit had {share:.0%} of the shared CPU: {used} ticks"
    dm.run("down", check=True)
