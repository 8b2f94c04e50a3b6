"""Last line of defence when dynamod itself dies without `down` (e.g. SIGKILL).

The daemon starts `python -m dynamod.core.guardian RUN_ID [CGROUP]` in its own session with
a pipe on stdin and keeps the write end open (and restarts it if it dies, see
dynamod.core.guardianship); without cgroups it also writes "PID STARTTIME" lines for the
unmarked orphans it has adopted. When the daemon dies the pipe reaches EOF and the guardian
empties the stack's cgroup (`cgroup.kill`, then removes it), SIGKILLs every process that
still carries the run's marker and every reported orphan still alive, then exits.
PDEATHSIG already kills the units' direct children; this catches their descendants
(engine subprocesses, double-forked daemons). Standard library only: it must start fast.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from dynamod.core import cgroups
from dynamod.core.proctable import marked_pids, start_time


def _kill_marked(run_id: str) -> int:
    killed = 0
    for _ in range(20):  # repeat: a dying parent may still fork once
        pids = marked_pids(run_id)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return killed


def _kill_orphans(orphans: dict[int, int]) -> int:
    killed = 0
    for pid, started in orphans.items():
        if start_time(pid) != started:  # gone, or the pid now belongs to someone else
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def _parse(lines: list[bytes], orphans: dict[int, int]) -> None:
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            orphans[int(fields[0])] = int(fields[1])


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m dynamod.core.guardian RUN_ID [CGROUP]", file=sys.stderr)
        return 2
    run_id = argv[0]
    cgroup = Path(argv[1]) if len(argv) == 2 else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the daemon to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    orphans: dict[int, int] = {}
    pending = b""
    while True:
        try:
            data = os.read(0, 4096)
        except InterruptedError:
            continue
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        _parse(lines, orphans)
    killed = 0
    if cgroup is not None:
        try:
            found, survivors = cgroups.empty_and_remove(cgroup)
        except cgroups.CgroupError as exc:
            print(f"dynamod guardian: {exc}", file=sys.stderr)
        else:
            killed += len(found)
            if survivors:
                print(f"dynamod guardian: could not kill {survivors} in {cgroup}", file=sys.stderr)
    killed += _kill_marked(run_id)
    killed += _kill_orphans(orphans)
    for path in cgroups.remove_v1_run(run_id):  # its units' limits; their processes are gone
        print(f"dynamod guardian: could not remove {path}", file=sys.stderr)
    if killed:
        print(
            f"dynamod guardian: daemon gone, killed {killed} leftover process(es)", file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
