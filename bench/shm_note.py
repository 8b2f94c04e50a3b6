"""Benchmark 20 - the /dev/shm note dynamod takes as each unit turns ready, timed.

    python -m bench.shm_note [--quick] [--json]

At each unit's readiness the daemon notes the /dev/shm files its processes hold, so that a
file only a main process killed first held is still removed at the unit's stop
(`OsHost.note_shm`, docs/operations.md "Shared memory a killed unit leaves"). The note is
two parts, each timed here as the daemon runs them (`OsHost._shm_held`, then
`shmleft.identities`), in CPU ms of the calling thread:

- finding the unit's processes: with cgroups, its cgroup's `cgroup.procs`; without, its
  process group, looked for below its leader and among the daemon's children
  (`process._group_pids`), beside the way before 2026-12-08 in the same run, one pass
  over the whole of /proc;
- reading each of them: its open files and its memory map.

Beside them, what the stop of a unit that held files adds: whether any process on the host
still holds them (`shmleft.remove_unheld`: every process's open files and maps read).

The timing runs in a stand-in for the daemon (this script again, `--stand-in`): the unit
is its child as a unit is the daemon's, beside OTHERS idle processes of its own (the node's
other units), while CROWD idle processes run elsewhere on the host (this script's own, in a
process group of their own, ended by it). The unit: a Python process that imported torch
(the size of a real shard's maps matters more than its count of files) holding one
/dev/shm file open and mapped, with THREADS idle threads and CHILDREN children (`sleep`),
in a process group of its own and, where this host gives a writable cgroup v2, in a
cgroup of its own.

--quick (the suite's smoke run): 3 rounds, no crowd.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
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
from bench.procs import MARK, ROOT, bench_mark, exit_on_signals
from bench.report import Report, Table, emit, entry, options, summary
from dynamod.core import cgroups, proctable, shmleft
from dynamod.core.process import OsHost, _group_pids

CROWD = 1000
CHILDREN = 3
THREADS = 32
OTHERS = 96  # the rest of a node of 32 shards, 3 processes each
ROUNDS = 25
SHM = Path("/dev/shm")
PR_SET_PDEATHSIG = 1

UNIT = """
import mmap, os, subprocess, sys, threading, time
import torch  # noqa: F401  (a real shard's map size)
path = sys.argv[1]
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
held = mmap.mmap(fd, 4096)
kids = [subprocess.Popen(["sleep", "infinity"]) for _ in range(int(sys.argv[2]))]
for _ in range(int(sys.argv[3])):  # an engine's process runs many threads
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


def shm_prefix() -> str:
    """The units' /dev/shm files are named for this run, so its end finds any left."""
    return f"dynamod-bench-{os.environ[MARK]}-"


def remove_left_files() -> None:
    for path in SHM.glob(f"{shm_prefix()}*"):
        path.unlink(missing_ok=True)


def die_with_parent() -> None:
    """The stand-in gets SIGTERM when the benchmark ends, however it ends, and so ends its
    units and processes in its own `finally` clauses."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    exit_on_signals()


class Unit:
    """The unit's main process, its group and (where one could be made) its cgroup."""

    def __init__(self, cgroup: Path | None) -> None:
        self.shm = SHM / f"{shm_prefix()}{uuid.uuid4().hex[:8]}"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", UNIT, str(self.shm), str(CHILDREN), str(THREADS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            process_group=0,
        )
        self.pid = self.proc.pid
        self.cgroup = cgroup
        try:
            self._started()
        except BaseException:
            self.close()
            raise

    def _started(self) -> None:
        """Into its cgroup, then until it says ready; its children must have followed."""
        if self.cgroup is not None:
            cgroups.make(self.cgroup)
            (self.cgroup / "cgroup.procs").write_text(str(self.pid))
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the unit (pid {self.pid}) did not start: {self.proc.poll()}")
        if self.cgroup is not None:  # forked before it was moved, they would be outside
            missing = {self.pid, *self.children()} - set(cgroups.procs(self.cgroup))
            if missing:
                raise RuntimeError(f"{self.cgroup} lacks the unit's processes {sorted(missing)}")

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


def whole_proc_pass(pgid: int) -> set[int]:
    """The process group's members as `_group_pids` found them before 2026-12-08: every
    process's stat read."""
    return {pid for pid, info in proctable.snapshot().items() if info.pgid == pgid}


def measure(unit: Unit, cgroup: Path | None, rounds: int) -> dict[str, Any]:
    """The note's parts, in CPU ms per note, for the unit found through `cgroup` (None: its
    process group); what it found must be the unit's one file, or the timing means nothing."""

    class Child:  # what `_shm_held` reads of a unit's Child
        pid = unit.pid

    def note() -> dict[Path, int]:
        return shmleft.identities(OsHost._shm_held(cgroup, Child))  # type: ignore[arg-type]

    def find() -> set[int]:
        return set(cgroups.procs(cgroup)) if cgroup is not None else _group_pids(unit.pid)

    pids = find()
    whole, noted = cpu_ms(note, rounds)
    if set(noted) != {unit.shm}:
        raise RuntimeError(f"the note found {sorted(map(str, noted))}, not {unit.shm}")
    row: dict[str, Any] = {
        "way": "cgroup" if cgroup is not None else "process group",
        "processes": len(pids),
        "maps_lines": unit.maps_lines(),
        "host_processes": host_processes(),
        "tree_processes": len(proctable.descendants(os.getpid())),
        "note_ms": whole,
        "find_ms": cpu_ms(find, rounds)[0],
        "read_ms": cpu_ms(lambda: shmleft.held(pids), rounds)[0],
    }
    # at the stop, before a noted file is removed: does any process on the host hold it
    row["anyone_ms"], anyone = cpu_ms(lambda: shmleft.held(proctable.proc_pids()), rounds)
    if unit.shm not in anyone:  # its holder is alive: a look that misses it measures nothing
        raise RuntimeError(f"the look at every process missed {unit.shm}, held by {unit.pid}")
    if cgroup is None:
        old_ms, old = cpu_ms(lambda: whole_proc_pass(unit.pid), rounds)
        if old != pids:
            raise RuntimeError(f"the group's tree gave {sorted(pids)}, /proc {sorted(old)}")
        row["whole_proc_ms"] = old_ms
    return row


def stand_in(cgroup_root: Path | None, rounds: int, others: int) -> list[dict[str, Any]]:
    """The daemon's side: `others` processes of its own, then the unit each way, timed."""
    rows = []
    with crowd(others):
        ways = [root / "unit" for root in [cgroup_root] if root is not None] + [None]
        for cgroup in ways:
            with unit_in(cgroup) as unit:
                rows.append(measure(unit, cgroup, rounds))
    return rows


def run_stand_in(cgroup_root: Path | None, rounds: int, others: int) -> list[dict[str, Any]]:
    argv = [sys.executable, "-m", "bench.shm_note", "--stand-in", str(cgroup_root or "-"),
            "--rounds", str(rounds), "--others", str(others)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the stand-in ended with status {done.returncode}: "
                           f"{done.stderr.strip()[-600:]}")
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def cell(samples: list[float] | None) -> str:
    if not samples:
        return "-"
    stats = summary(samples)
    return f"{stats['median']:.2f} ({stats['p95']:.2f})"


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0].split(" - ", 1)[1])
    parser.add_argument("--stand-in", help=argparse.SUPPRESS)  # the daemon's side: its cgroup
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=argparse.SUPPRESS)
    parser.add_argument("--others", type=int, default=OTHERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stand_in is not None:
        die_with_parent()
        root = None if args.stand_in == "-" else Path(args.stand_in)
        print(json.dumps(stand_in(root, args.rounds, args.others)))
        return
    bench_mark()  # what this run starts is swept at its end, even on SIGTERM
    rounds = 3 if args.quick else ROUNDS
    loads = (0,) if args.quick else (0, CROWD)
    report = Report("shm_note", "The /dev/shm note at a unit's readiness", args.quick)
    rows: list[dict[str, Any]] = []
    with stack_cgroup() as root:
        if root is None:
            report.notes.append("no writable cgroup v2 here: the process-group way alone")
        try:
            for extra in loads:
                with crowd(extra):
                    for row in run_stand_in(root, rounds, OTHERS):
                        rows.append(row | {"extra": extra})
        finally:
            remove_left_files()  # a unit's, where its stand-in was killed before its end
    table = Table(
        f"CPU ms per note, median of {rounds} (p95 in brackets)",
        ["found by", "host processes", "dynamod's tree", "unit's processes",
         "its main's maps lines", "the note", "finding them",
         "finding them, a pass over /proc (before)", "reading them",
         "the stop's look: held by anyone?"],
        digits=2,
    )
    for row in rows:
        table.rows.append(
            [row["way"], row["host_processes"], row["tree_processes"], row["processes"],
             row["maps_lines"], cell(row["note_ms"]), cell(row["find_ms"]),
             cell(row.get("whole_proc_ms")), cell(row["read_ms"]), cell(row["anyone_ms"])]
        )
    report.tables.append(table)
    report.notes += [
        "The note runs once per readiness, on a worker thread (asyncio.to_thread), not on "
        "the daemon's loop; 'the note' is both parts and a stat of each file found.",
        "'The stop's look': once a stopped unit's processes are gone, whether any process on "
        "the host still holds the files it held (every process's open files and maps read), "
        "before they are removed; only at the stop of a unit that held any, on a worker "
        "thread.",
        f"The unit: a Python process that imported torch, holding one /dev/shm file open and "
        f"mapped, with {CHILDREN} `sleep` children and {THREADS} idle threads, beside "
        f"{OTHERS} other processes in the stand-in daemon's tree; the crowd elsewhere on "
        f"the host: {CROWD} idle `sleep` processes (quick: no crowd).",
    ]
    report.data["rows"] = rows
    emit(report, args.json)


if __name__ == "__main__":
    main()
