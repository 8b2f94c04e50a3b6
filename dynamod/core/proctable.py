"""Finding processes by marker, process group or parent in /proc. Standard library only, so
the guardian can import it without the daemon's dependencies."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

MARK_RUN = "DYNAMOD_RUN_ID"
MARK_UNIT = "DYNAMOD_UNIT"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (another user's counts: it is not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def proc_pids(proc: str = "/proc") -> Iterator[int]:
    """Every process `proc` (/proc) lists now."""
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            yield int(entry.name)


def _environ(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read()
    except OSError:
        return None


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"Z", b"X")


def marked_pids(
    run_id: str, unit: str | None = None, among: Iterable[int] | None = None
) -> list[int]:
    """Live processes carrying this run's marker (and this unit's, if given); only those
    in `among` are read, if given (reading a process's environ is the costly part)."""
    run_mark = f"{MARK_RUN}={run_id}".encode()
    unit_mark = f"{MARK_UNIT}={unit}".encode() if unit is not None else None
    me = os.getpid()
    found = []
    for pid in among if among is not None else proc_pids():
        if pid == me:
            continue
        env = _environ(pid)
        if not env:
            continue
        entries = env.split(b"\0")
        if run_mark not in entries:
            continue
        if unit_mark is not None and unit_mark not in entries:
            continue
        if not is_zombie(pid):
            found.append(pid)
    return found


def children_of(parent: int) -> list[int]:
    """Live (non-zombie) processes whose parent is `parent`."""
    return list(children(parent))


def command_line(pid: int, limit: int = 80) -> str:
    """The process's command line in one line (cut at `limit`), or "?" if it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode()[:limit].strip()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a pid from its reuse)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else None


@dataclass(frozen=True)
class ProcInfo:
    ppid: int
    pgid: int
    started: int  # clock ticks since boot


def snapshot() -> dict[int, ProcInfo]:
    """Every live (non-zombie) process with its parent, group and start time: one read of
    /proc/PID/stat each, so one pass answers "in this group", "children of" and "younger
    than" together."""
    found: dict[int, ProcInfo] = {}
    for pid in proc_pids():
        info = _info(pid)
        if info is not None:
            found[pid] = info
    return found


def _info(pid: int) -> ProcInfo | None:
    """The process's parent, group and start time; None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) <= 19 or fields[0] in (b"Z", b"X"):
        return None
    return ProcInfo(ppid=int(fields[1]), pgid=int(fields[2]), started=int(fields[19]))


def children(parent: int) -> dict[int, ProcInfo]:
    """The live children of `parent` with their infos. Reads the kernel's per-thread
    child lists (/proc/PID/task/TID/children): a few files, however many processes the
    host runs; a full /proc pass only where the kernel lacks them (CONFIG_PROC_CHILDREN)."""
    try:
        tids = os.listdir(f"/proc/{parent}/task")
    except OSError:
        return {}
    pids: set[int] = set()
    for tid in tids:
        try:
            with open(f"/proc/{parent}/task/{tid}/children", "rb") as fh:
                pids.update(int(x) for x in fh.read().split())
        except FileNotFoundError:
            if os.path.exists(f"/proc/{parent}/task/{tid}"):  # no such file in this kernel
                return {pid: i for pid, i in snapshot().items() if i.ppid == parent}
        except OSError:
            continue  # the thread ended meanwhile; its children moved to another one
    found = {}
    for pid in pids:
        info = _info(pid)
        if info is not None and info.ppid == parent:
            found[pid] = info
    return found


def descendants(root: int) -> dict[int, ProcInfo]:
    """Every live process below `root` (children, their children, ...) with its info,
    found through the per-thread child lists: the cost is the size of the tree, not of
    the host's process table."""
    found: dict[int, ProcInfo] = {}
    todo = [root]
    while todo:
        for pid, info in children(todo.pop()).items():
            if pid not in found:
                found[pid] = info
                todo.append(pid)
    return found


def group_below(pgid: int, adopter: int) -> set[int]:
    """The live processes of process group `pgid`, whose leader is a child of `adopter`, a
    child subreaper: the adopter's children in the group (the leader, and the orphans it
    left, which the adopter took in) and every process below them in the group, through
    the per-thread child lists. The cost is the group's tree and the adopter's children,
    not the host's process table. A member below a process that forked it, then left the
    group and was then orphaned is not found (no unit we run does that; the stop's scan
    still walks the adopter's whole tree)."""
    roots = {pid for pid, info in children(adopter).items() if info.pgid == pgid}
    found = set(roots)
    for root in roots:
        found |= {pid for pid, info in descendants(root).items() if info.pgid == pgid}
    return found
