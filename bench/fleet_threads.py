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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.host import PROC
from bench.procs import Reread, stat_cpu
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


class Waits:
    """Each thread's run time and wait for a core, from the kernel's schedstat
    (/proc/<pid>/task/<tid>/schedstat: ns on a core, ns runnable but waiting for one), for
    some processes, read twice over a window: each file opened once and read again in
    place. A thread born in the window counts from 0; one that ended in it is lost (its
    process's count of them is kept), so a process's wait is at least what is shown."""

    def __init__(self, pids: list[int], proc: Path = PROC) -> None:
        self.proc = proc
        self.pids = pids
        self.files: Reread[tuple[int, int], tuple[int, int]] = Reread(schedstat)
        self.mark()

    def mark(self) -> None:
        """Where the window starts."""
        self.before = self.read()

    def read(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(pid, tid) -> (ns run, ns waited) so far, for every live thread of the pids."""
        return self.files.read(self._threads())

    def _threads(self) -> Iterator[tuple[tuple[int, int], Path]]:
        for pid in self.pids:
            try:
                tids = os.listdir(self.proc / str(pid) / "task")
            except OSError:  # gone: its threads are read no more
                continue
            for tid in tids:
                yield (pid, int(tid)), self.proc / str(pid) / "task" / tid / "schedstat"

    def since(self) -> dict[int, dict[str, float]]:
        """Per pid, from `mark` to now: ms its threads ran, ms they waited for a
        core, and how many of them ended meanwhile (their time lost)."""
        after = self.read()
        out = {pid: {"ran_ms": 0.0, "waited_ms": 0.0, "threads_ended": 0} for pid in self.pids}
        for (pid, tid), (ran, waited) in after.items():
            ran0, waited0 = self.before.get((pid, tid), (0, 0))
            out[pid]["ran_ms"] += (ran - ran0) / 1e6
            out[pid]["waited_ms"] += (waited - waited0) / 1e6
        for pid, _ in set(self.before) - set(after):
            out[pid]["threads_ended"] += 1
        return out

    def close(self) -> None:
        self.files.close()


def schedstat(text: bytes) -> tuple[int, int]:
    """(ns run, ns waited for a core) of a schedstat file's text."""
    ran, waited, _ = text.split()[:3]
    return int(ran), int(waited)
