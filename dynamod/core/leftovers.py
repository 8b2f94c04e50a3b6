"""Sweeping what a dead daemon left: a new `up`, or a `down` that finds no daemon, reads the
previous run's record (core/runrecord.py) and, under the state dir's lock (so never a live
daemon's run), empties and removes that run's cgroup and SIGKILLs the processes carrying its
marker and the unmarked orphans it recorded (pid + start time, so never a reused pid), then
marks the run as swept. Standard library only: the CLI runs it before it imports the
daemon."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamod.core import cgroups, runrecord
from dynamod.core.proctable import marked_pids, start_time
from dynamod.core.runrecord import RunRecord

LOCK_FILE = "dynamod.lock"


@dataclass(frozen=True)
class Leftovers:
    """What the sweep of one dead run found."""

    run_id: str
    daemon_pid: int | None
    cgroup: str | None
    killed: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    during_down: bool = False  # it died after it had begun a `down` (or SIGTERM)

    def describe(self) -> str:
        where = f"cgroup {self.cgroup} and marker" if self.cgroup else "marker and pid"
        when = "during" if self.during_down else "without"
        text = (
            f"the previous daemon (pid {self.daemon_pid}, run {self.run_id}) died {when} "
            f"`down`; swept {len(self.killed)} leftover process(es) by {where}"
        )
        if self.survivors:
            text += f"; COULD NOT KILL {self.survivors}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "daemon_pid": self.daemon_pid,
            "cgroup": self.cgroup,
            "killed": self.killed,
            "survivors": self.survivors,
            "during_down": self.during_down,
        }


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[bool]:
    """Hold the state dir's lock if nobody does; yields False if a daemon holds it."""
    try:
        fh = (state_dir / LOCK_FILE).open("a+b")
    except OSError:
        yield False
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def held_by_daemon(state_dir: Path) -> bool:
    """Whether a daemon holds the state dir's lock (it may not answer on its socket yet).
    Creates nothing: no lock file, no daemon ever ran there."""
    try:
        fh = (state_dir / LOCK_FILE).open("rb")
    except OSError:
        return False
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def sweep_previous(state_dir: Path) -> Leftovers | None:
    """Sweep the previous run if its daemon died; None if there is nothing to sweep (no
    run recorded, it ended cleanly, or a daemon holds the state dir)."""
    if not (state_dir / runrecord.RUN_FILE).exists():
        return None
    with _locked(state_dir) as held:
        if not held:
            return None
        return sweep_held(state_dir)


def sweep_held(state_dir: Path) -> Leftovers | None:
    """`sweep_previous` for a caller that already holds the state dir's lock (the daemon)."""
    run = runrecord.read(state_dir)
    if run is None or run.ended:
        return None
    return _sweep(state_dir, run)


def _sweep(state_dir: Path, run: RunRecord) -> Leftovers:
    killed: set[int] = set()
    survivors: set[int] = set()
    if run.cgroup is not None:
        found, left = cgroups.empty_and_remove(Path(run.cgroup))
        killed |= set(found)
        survivors |= set(left)
    for _ in range(20):  # a dying parent may still fork once
        pids = marked_pids(run.run_id)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed |= set(pids)
        time.sleep(0.05)
    for pid, started in run.orphans:  # the fallback's unmarked leftovers, by start time
        if start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
    survivors |= set(marked_pids(run.run_id))
    if not survivors:  # the v1 cgroups of its units' limits, empty now
        cgroups.remove_v1_run(run.run_id)
    runrecord.mark_ended(state_dir, "swept")
    return Leftovers(
        run_id=run.run_id,
        daemon_pid=run.pid,
        cgroup=run.cgroup,
        killed=sorted(killed),
        survivors=sorted(survivors),
        during_down=run.stopping,
    )
