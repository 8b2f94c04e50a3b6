"""What the machine itself did during a benchmark's window, beside what our processes did:
its busy CPU, the CPU its hypervisor took from it (steal), its kernel's DAMON monitor's own
CPU (`kdamond`, whose pageout scheme this VM runs), and the pages it had to read back in
(major faults; with no swap these are file pages, the shards' libraries among them, that
were paged out and touched again). Two runs of the same code that differ in their stall
but not in these counters differ in something else; a slower run with more steal or more
major faults was slowed by the host, not by the code.

Pure parsing of /proc and /sys text, so the parsers are tested on fixed text."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import procs

PROC = Path("/proc")
DAMON = Path("/sys/kernel/mm/damon/admin/kdamonds")
TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class HostCounters:
    """Cumulative counters since boot, all cores together; subtract two to get a window."""

    busy_s: float  # user + nice + system + irq + softirq
    irq_s: float  # irq + softirq (in busy_s): interrupts' time, no process's (the network's)
    steal_s: float  # time the hypervisor ran something else while this VM had work
    iowait_s: float
    kdamond_s: float  # the DAMON kernel threads' own CPU (part of busy_s: system time)
    major_faults: int  # pages read back in from disk on a touch
    paged_in_kb: int  # everything read from block devices (pgpgin, KB)

    def since(self, before: HostCounters) -> dict[str, float]:
        now, then = asdict(self), asdict(before)
        return {k: now[k] - then[k] for k in now}


def cpu_line(stat_text: str) -> dict[str, float]:
    """/proc/stat's aggregate `cpu` line as seconds: busy, steal, iowait, idle."""
    first = stat_text.split("\n", 1)[0].split()
    if not first or first[0] != "cpu":
        raise ValueError(f"not /proc/stat: first line {first[:1]!r}")
    ticks = [int(x) for x in first[1:]] + [0] * 10  # old kernels: fewer columns
    user, nice, system, idle, iowait, irq, softirq, steal = ticks[:8]
    return {
        "busy_s": (user + nice + system + irq + softirq) / TICK,
        "irq_s": (irq + softirq) / TICK,
        "steal_s": steal / TICK,
        "iowait_s": iowait / TICK,
        "idle_s": idle / TICK,
    }


def vmstat(text: str, *names: str) -> dict[str, int]:
    """Named counters from /proc/vmstat text (0 for a counter this kernel lacks)."""
    found = dict.fromkeys(names, 0)
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in found:
            found[key] = int(value)
    return found


def kdamond_pids(damon: Path = DAMON) -> list[int]:
    """The pids of the running DAMON kernel threads (none where DAMON is off or absent)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for kd in sorted(damon.iterdir()):
            with contextlib.suppress(OSError, ValueError):
                pid = int((kd / "pid").read_text())
                if pid > 0:
                    pids.append(pid)
    return pids


def counters(proc: Path = PROC, damon: Path = DAMON) -> HostCounters:
    cpu = cpu_line((proc / "stat").read_text())
    vm = vmstat((proc / "vmstat").read_text(), "pgmajfault", "pgpgin")
    kdamond = 0.0
    for pid in kdamond_pids(damon):
        with contextlib.suppress(OSError):
            kdamond += procs.stat_cpu(str(proc / str(pid) / "stat"))[1]
    return HostCounters(
        busy_s=cpu["busy_s"],
        irq_s=cpu["irq_s"],
        steal_s=cpu["steal_s"],
        iowait_s=cpu["iowait_s"],
        kdamond_s=kdamond,
        major_faults=vm["pgmajfault"],
        paged_in_kb=vm["pgpgin"],
    )


def window(before: HostCounters) -> dict[str, Any]:
    """The machine's counters from `before` to now."""
    return counters().since(before)


# a window's columns in a benchmark's table, and its cells
COLUMNS = ["busy CPU s", "stolen CPU s", "iowait s", "kdamond CPU s", "major faults",
           "read in MB"]  # fmt: skip


def cells(window: dict[str, Any]) -> list[Any]:
    """One window (`since`, `window`) as the COLUMNS' cells."""
    return [window["busy_s"], window["steal_s"], window["iowait_s"], window["kdamond_s"],
            window["major_faults"], window["paged_in_kb"] / 1024]  # fmt: skip
