"""The fleet benchmark's look at one daemon cost: the exposure scan (which sockets of a
node's units are beyond loopback, `dynamod/cluster/exposure.py`) over a live node, timed
the two ways side by side in one run: every process's open files read, as every scan did
before `SocketMemo` (and as a scan still does for a process it has not read), and a scan
with a memo already warmed by one, as the daemon's scans run in steady state."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from dynamod.chaos.cluster import ClusterRig
from dynamod.cluster import exposure

ROUNDS = 5


def cpu_ms(work: Callable[[], list[str]]) -> tuple[float, int]:
    """The calling thread's CPU for `work`, in ms, and how many lines it found."""
    started = time.thread_time()
    found = work()
    return (time.thread_time() - started) * 1000, len(found)


def exposure_scan(rig: ClusterRig, node: str, rounds: int = ROUNDS) -> dict[str, Any]:
    """Median CPU ms of one scan of `node`'s units, read-everything vs memo, and what each
    found (the two must agree: a scan that finds less is not a cheaper scan)."""
    # every unit, the members too; /proc names each process's namespace, so this need not
    # run inside the node's
    units = rig.status(node)["units"]
    pids = {u["name"]: exposure.tree_pids(int(u["pid"])) for u in units if u.get("pid")}
    memo = exposure.SocketMemo()
    exposure.process_warnings(pids, memo=memo)  # warmed, as by the daemon's first scan
    every, memoized = [], []
    for _ in range(rounds):
        every.append(cpu_ms(lambda: exposure.process_warnings(pids)))
        memoized.append(cpu_ms(lambda: exposure.process_warnings(pids, memo=memo)))
    return {
        "processes": sum(map(len, pids.values())),
        "every_process_ms": statistics.median(ms for ms, _ in every),
        "memo_ms": statistics.median(ms for ms, _ in memoized),
        "found": sorted({n for _, n in every} | {n for _, n in memoized}),
    }
