"""Where the shards' (and the daemons') CPU in a push goes, by thread: each process's
threads read from /proc/<pid>/task/<tid>/stat before and after the push, summed over the
processes by the thread's name (its `comm`, digits dropped: tokio names its workers alike).

A thread that ended inside the push (a flushed engine's runtime shuts its threads down)
leaves no entry to read afterwards; its CPU stays in the process's own total, so what the
process used less what its surviving threads used is reported as "threads that ended"."""

from __future__ import annotations

import contextlib
import os
import re
from collections import defaultdict
from typing import Any

from bench.procs import stat_cpu
from bench.report import Table

ENDED = "(threads that ended in the push)"


def threads_of(pids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (thread name, CPU seconds so far) for every thread of `pids`."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    out[(pid, int(tid))] = stat_cpu(f"/proc/{pid}/task/{tid}/stat")
    return out


def group(name: str) -> str:
    """A thread's name without its digits: `tokio-runtime-w`, `ZMQbg/IO/0` -> `ZMQbg/IO/`."""
    return re.sub(r"\d+", "", name).strip() or name


def by_thread(
    before: dict[tuple[int, int], tuple[str, float]],
    after: dict[tuple[int, int], tuple[str, float]],
    used: dict[int, float],
) -> dict[str, float]:
    """CPU seconds in the window, summed over the processes in `used` (pid -> the
    process's own CPU in the window) by thread name; a thread born in the window counts
    from 0, and what the process used beyond its surviving threads goes to ENDED."""
    out: dict[str, float] = defaultdict(float)
    counted: dict[int, float] = defaultdict(float)
    for (pid, tid), (name, secs) in after.items():
        if pid not in used:
            continue
        start = before.get((pid, tid), (name, 0.0))[1]
        out[group(name)] += secs - start
        counted[pid] += secs - start
    out[ENDED] = sum(max(0.0, used[pid] - counted[pid]) for pid in used)
    return dict(out)


def thread_table(fleets: list[dict[str, Any]], whose: str = "shards", top: int = 8) -> Table:
    """The shards' (or the daemons') CPU in the push by thread, ms a shard, for every fleet
    size: the thread groups that used the most at the largest size first."""
    key = f"{whose}_by_thread"
    sized = [f for f in fleets if f["push"]["cpu"].get(key)]
    if not sized:
        return Table(f"The {whose}' CPU in the push by thread: not measured", ["-"])
    last = sized[-1]["push"]["cpu"][key]
    names = sorted(last, key=lambda n: -last[n])[:top]
    table = Table(
        f"The {whose}' CPU in the push by thread, ms a shard (the threads' names as the "
        "kernel has them, digits dropped; the largest at the last size first)",
        ["thread", *(f"{f['nodes']} x {f['shards'] // f['nodes']}" for f in sized)],
        digits=1,
    )
    for name in [*names, "all"]:
        row: list[Any] = [name]
        for f in sized:
            cut = f["push"]["cpu"][key]
            total = sum(cut.values()) if name == "all" else cut.get(name, 0.0)
            row.append(total / f["shards"] * 1000)
        table.rows.append(row)
    return table
