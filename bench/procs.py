"""Safe process handling for benchmarks: everything a benchmark starts inherits
DYNAMOD_BENCH_MARK=<this run>; the final sweep SIGKILLs, by pid, only processes carrying
that marker. Nothing is ever killed by name."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime as dt
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PROC = ROOT / "tests" / "fixtures" / "proc.py"
MARK = "DYNAMOD_BENCH_MARK"
TICK = os.sysconf("SC_CLK_TCK")
K = TypeVar("K")
V = TypeVar("V")

# --------------------------------------------------------------------------- processes


def bench_mark() -> str:
    """This run's marker; set once and inherited by everything we start.

    The benchmark also becomes a child subreaper, so a detached dynamod daemon (orphaned
    when `dynamod up --detach` returns) is re-parented to us and reaped the moment it
    exits, as systemd or a normal init would. This machine's pid 1 reaps orphans only
    every second or two, and `dynamod down` waits until kill(pid, 0) fails, which a
    zombie still passes."""
    mark = os.environ.get(MARK)
    if not mark:
        mark = uuid.uuid4().hex[:12]
        os.environ[MARK] = mark
        _own_tmpdir(mark)
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        atexit.register(_at_exit)
        exit_on_signals()
    return mark


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP end the benchmark as an exception (exit status 128 + the signal),
    so its `finally` clauses run: a fleet's daemons are stopped and its namespaces and
    kernel limits put back, where the default action left them all behind."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)


_PR_SET_CHILD_SUBREAPER = 36


def _own_tmpdir(mark: str) -> None:
    """The benchmark and everything it starts get a TMPDIR of the run's own, removed at its
    exit: processes it runs outside dynamod (supervisord's programs, plain processes) write
    there, Dynamo a logging config per process start (25 files left in /tmp by one goodput
    run). The state dirs it names (dir="/tmp") stay where they say."""
    own = tempfile.mkdtemp(prefix=f"bench-tmp-{mark}-", dir="/tmp")
    os.environ["TMPDIR"] = tempfile.tempdir = own
    atexit.register(shutil.rmtree, own, ignore_errors=True)  # runs after _at_exit's sweep


def _at_exit() -> None:
    sweep()
    reap_zombies()


def reap_zombies() -> None:
    """Reap adopted children that have exited (never blocks)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def reap_when_adopted(pid: int) -> None:
    """Reap `pid` the moment it exits; it must already be our (adopted) child."""

    def wait() -> None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    threading.Thread(target=wait, name=f"reap-{pid}", daemon=True).start()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def marked() -> list[int]:
    """Live processes (not us, not zombies) carrying this run's marker."""
    needle = f"{MARK}={os.environ.get(MARK, '')}".encode()
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
        except OSError:
            continue
        if alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def sweep() -> list[int]:
    """SIGKILL every live process carrying this run's marker (by pid); return them."""
    if not os.environ.get(MARK):
        return []
    pids = marked()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    wait_dead(pids, 5)
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def wait_dead(pids: Iterable[int], timeout: float, interval: float = 0.005) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(interval)
        left = [p for p in left if alive(p)]
    return left


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    if pgid > 1:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rss_mb(pid: int) -> float:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan


def pss_mb(pid: int) -> float:
    """Proportional set size: private pages plus a share of those mapped by others too
    (one more process of the same program costs about this)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return math.nan


def stat_cpu(path: str) -> tuple[str, float]:
    """(comm, utime + stime in seconds) of a /proc stat file: a process's
    (/proc/<pid>/stat) or one of its threads' (/proc/<pid>/task/<tid>/stat)."""
    with open(path, "rb") as fh:
        comm, _, cpu = parse_stat(fh.read())
    return comm, cpu


def parse_stat(stat: bytes) -> tuple[str, int, float]:
    """(comm, ppid, utime + stime in seconds) of a /proc stat file's text; the command's
    name may hold spaces and parentheses, so the fields are counted from the last `)`."""
    comm = stat[stat.find(b"(") + 1 : stat.rfind(b")")].decode(errors="replace")
    fields = stat[stat.rfind(b")") + 2 :].split()
    return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


class Reread(Generic[K, V]):
    """/proc files opened once and read again in place (a procfs read at offset 0 is
    fresh each time): ~5 us of CPU a file, against ~25 us to open it each time. A file
    whose read fails (its process or thread ended) is closed and dropped."""

    def __init__(self, parse: Callable[[bytes], V]) -> None:
        self.parse = parse
        self.fds: dict[K, int] = {}

    def read(self, found: Iterable[tuple[K, Path]]) -> dict[K, V]:
        """Every file held, read again, and each of `found` (key, path) not held yet,
        opened and read: key -> its parsed text."""
        out: dict[K, V] = {}
        for key, fd in list(self.fds.items()):
            try:
                out[key] = self.parse(os.pread(fd, 4096, 0))
            except (OSError, ValueError, IndexError):  # ended (ESRCH): its id may come again
                os.close(self.fds.pop(key))
        for key, path in found:
            if key not in out:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    self.fds[key] = os.open(path, os.O_RDONLY)
                    out[key] = self.parse(os.pread(self.fds[key], 4096, 0))
        return out

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, in seconds."""
    return stat_cpu(f"/proc/{pid}/stat")[1]


def cpu_of(pids: list[int]) -> dict[int, float]:
    """Each process's CPU seconds so far; one that is gone is left out."""
    got = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            got[pid] = cpu_seconds(pid)
    return got


def cpu_since(before: dict[int, float]) -> dict[int, float]:
    """CPU seconds each process used since `before`; one that is gone now (a shard that
    restarted meanwhile) is left out: the bench.fleet 4 x 32 run of 2026-12-04 failed on
    it with FileNotFoundError."""
    now = cpu_of(list(before))
    return {pid: now[pid] - before[pid] for pid in now}


def started_at(pid: int) -> float:
    """When a process was started, as epoch seconds (kernel clock ticks: 10 ms steps).
    /proc/PID/stat counts from boot; CLOCK_BOOTTIME is the same clock."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        stat = fh.read()
    ticks = int(stat[stat.rfind(b")") + 2 :].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def wait_until(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.02, what: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def state_dir(prefix: str) -> Iterator[Path]:
    """A short state dir under /tmp (unix socket paths are short), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"b{prefix}-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def iso_epoch(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).timestamp()
