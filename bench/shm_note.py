"""Benchmark 20 - the /dev/shm note dynamod takes as each unit turns ready, timed.

    python -m bench.shm_note [--quick] [--json]

At each unit's readiness the daemon notes the /dev/shm files its processes hold, so that a
file only a main process killed first held is still removed at the unit's stop
(`OsHost.note_shm`, docs/operations.md "Shared memory a killed unit leaves"). The note is
two parts, each timed here as the daemon runs them (`OsHost._shm_held`, then
`shmleft.identities`), in CPU ms of the calling thread:

- finding the unit's processes: with cgroups, its cgroup's `cgroup.procs`; without, one
  pass over /proc for its process group (a read of every process's stat);
- reading each of them: its open files and its memory map.

The unit: a Python process that imported torch (the size of a real shard's maps matters
more than its count of files) holding one /dev/shm file open and mapped, with CHILDREN
children of its own (`sleep`), in a process group of its own and, where this host gives
a writable cgroup v2, in a cgroup of its own. Each row runs with the host as it is and
with CROWD extra idle processes (started by this benchmark in a process group of its own,
ended by it), since the /proc pass grows with the host's process table.

--quick (the suite's smoke run): 3 rounds, no crowd.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.detect import crowd, host_processes
from bench.report import Report, Table, emit, entry, options, summary
from dynamod.core import cgroups, shmleft
from dynamod.core.process import OsHost, _group_pids

CROWD = 1000
CHILDREN = 3
ROUNDS = 25

UNIT = """
import mmap, os, subprocess, sys, time
import torch  # noqa: F401  (a real shard's map size)
path = sys.argv[1]
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
held = mmap.mmap(fd, 4096)
kids = [subprocess.Popen(["sleep", "infinity"]) for _ in range(int(sys.argv[2]))]
print("ready", flush=True)
sys.stdin.read()
"""


class Unit:
    """The unit's main process, its group and (where one could be made) its cgroup."""

    def __init__(self, cgroup: Path | None) -> None:
        self.shm = Path(f"/dev/shm/dynamod-bench-{uuid.uuid4().hex[:8]}")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", UNIT, str(self.shm), str(CHILDREN)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            process_group=0,
        )
        self.pid = self.proc.pid
        self.cgroup = cgroup
        if cgroup is not None:
            cgroups.make(cgroup)
            (cgroup / "cgroup.procs").write_text(str(self.pid))
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the unit (pid {self.pid}) did not start: {self.proc.poll()}")
        if cgroup is not None:  # its children were forked inside it; the check is ours
            missing = {self.pid, *self.children()} - set(cgroups.procs(cgroup))
            if missing:
                raise RuntimeError(f"{cgroup} lacks the unit's processes {sorted(missing)}")

    def children(self) -> list[int]:
        text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        return [int(p) for p in text.split()]

    def maps_lines(self) -> int:
        with open(f"/proc/{self.pid}/maps", encoding="utf-8", errors="replace") as fh:
            return sum(1 for _ in fh)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait()
        if self.cgroup is not None:
            cgroups.empty_and_remove(self.cgroup)
        self.shm.unlink(missing_ok=True)


@contextlib.contextmanager
def unit_in(cgroup: Path | None) -> Iterator[Unit]:
    unit = Unit(cgroup)
    try:
        yield unit
    finally:
        unit.close()


@contextlib.contextmanager
def stack_cgroup() -> Iterator[Path | None]:
    """A cgroup of this run's own, as the daemon makes one; None where this host has none."""
    containment = cgroups.detect(f"bench-{uuid.uuid4().hex[:8]}")
    try:
        yield containment.root
    finally:
        if containment.root is not None:
            cgroups.empty_and_remove(containment.root)


def cpu_ms(work: Callable[[], Any], rounds: int) -> tuple[list[float], Any]:
    samples, found = [], None
    for _ in range(rounds):
        started = time.thread_time()
        found = work()
        samples.append((time.thread_time() - started) * 1000)
    return samples, found


def measure(unit: Unit, cgroup: Path | None, rounds: int) -> dict[str, Any]:
    """The note's parts, in CPU ms per note, for the unit found through `cgroup` (None: its
    process group); what it found must be the unit's one file, or the timing means nothing."""

    class Child:  # what `_shm_held` reads of a unit's Child
        pid = unit.pid

    def note() -> dict[Path, int]:
        return shmleft.identities(OsHost._shm_held(cgroup, Child))  # type: ignore[arg-type]

    def find() -> set[int]:
        return set(cgroups.procs(cgroup)) if cgroup is not None else _group_pids(unit.pid)

    def read() -> set[Path]:
        return shmleft.held(pids)

    pids = find()
    whole, noted = cpu_ms(note, rounds)
    if set(noted) != {unit.shm}:
        raise RuntimeError(f"the note found {sorted(map(str, noted))}, not {unit.shm}")
    found_ms, _ = cpu_ms(find, rounds)
    read_ms, _ = cpu_ms(read, rounds)
    return {
        "processes": len(pids),
        "host_processes": host_processes(),
        "note_ms": whole,
        "find_ms": found_ms,
        "read_ms": read_ms,
    }


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0].split(" - ", 1)[1]).parse_args()
    rounds = 3 if args.quick else ROUNDS
    loads = (0,) if args.quick else (0, CROWD)
    report = Report("shm_note", "The /dev/shm note at a unit's readiness", args.quick)
    rows: list[dict[str, Any]] = []
    with stack_cgroup() as root:
        ways: list[tuple[str, Path | None]] = [("process group", None)]
        if root is not None:
            ways.insert(0, ("cgroup", root / "unit"))
        else:
            report.notes.append("no writable cgroup v2 here: the process-group way alone")
        for extra in loads:
            with crowd(extra):
                for way, cgroup in ways:
                    with unit_in(cgroup) as unit:
                        row = measure(unit, cgroup, rounds)
                        row.update(way=way, extra=extra, maps_lines=unit.maps_lines())
                        rows.append(row)
    table = Table(
        f"CPU ms per note, median of {rounds} (p95 in brackets)",
        ["found by", "host processes", "unit's processes", "its main's maps lines",
         "the note", "finding them", "reading them"],
        digits=2,
    )
    for row in rows:
        cells = []
        for key in ("note_ms", "find_ms", "read_ms"):
            stats = summary(row[key])
            cells.append(f"{stats['median']:.2f} ({stats['p95']:.2f})")
        table.rows.append(
            [row["way"], row["host_processes"], row["processes"], row["maps_lines"], *cells]
        )
    report.tables.append(table)
    report.notes += [
        "The note runs once per readiness, on a worker thread (asyncio.to_thread), not on "
        "the daemon's loop; 'the note' is both parts and a stat of each file found.",
        f"The unit: a Python process that imported torch, holding one /dev/shm file open and "
        f"mapped, with {CHILDREN} `sleep` children; the crowd: {CROWD} idle `sleep` processes "
        "(quick: no crowd).",
    ]
    report.data["rows"] = rows
    emit(report, args.json)


if __name__ == "__main__":
    main()
