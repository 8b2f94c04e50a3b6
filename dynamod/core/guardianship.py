"""Keeping the guardian alive and informed: the daemon starts it, watches its exit through
the Reaper, and starts a new one at once (and logs it) if it dies while the daemon runs, so
a later SIGKILL of the daemon is still cleaned up. Without cgroups it also tells the
guardian, over the pipe, which unmarked orphans the subreaper has adopted (a census every
second, also kept in run.json for the next sweep), since after the daemon's death nothing
else could find them. Closing the pipe on
a clean exit ends it."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from dynamod.core.process import Reaper
from dynamod.core.proctable import ProcInfo, children
from dynamod.core.restart import Exit

log = structlog.get_logger("dynamod.core.guardianship")


def start_guardian(run_id: str, cgroup: Path | None) -> tuple[int, int]:
    """Start the guardian in its own session; return its pid and the pipe end we keep."""
    read_fd, write_fd = os.pipe()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNAMOD_RUN")}
    argv = [sys.executable, "-m", "dynamod.core.guardian", run_id]
    if cgroup is not None:
        argv.append(str(cgroup))
    try:
        guardian = subprocess.Popen(
            argv, stdin=read_fd, env=env, start_new_session=True, close_fds=True
        )
    except OSError:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    os.set_inheritable(write_fd, False)
    guardian.returncode = 0  # the Reaper reaps it
    return guardian.pid, write_fd


class Guardianship:
    """One guardian at a time for this daemon run; `on_change(pid)` hears of each new one
    and of each change in the orphans it was told about."""

    def __init__(
        self,
        run_id: str,
        cgroup: Path | None,
        reaper: Reaper,
        on_change: Callable[[int], None] = lambda pid: None,
    ) -> None:
        self.run_id, self.cgroup, self.reaper = run_id, cgroup, reaper
        self.on_change = on_change
        self.pid: int | None = None
        self.restarts = 0
        self.last_death: str | None = None
        self._fd: int | None = None
        self._closing = False
        self.orphans: dict[int, int] = {}  # pid -> start time, as told to the guardian

    def start(self) -> int:
        pid, fd = start_guardian(self.run_id, self.cgroup)
        self.pid, self._fd = pid, fd
        self._tell(self.orphans)  # a new guardian learns what the old one knew
        self.reaper.watch(pid).add_done_callback(functools.partial(self._exited, pid))
        self.on_change(pid)
        return pid

    def _exited(self, pid: int, fut: asyncio.Future[Exit]) -> None:
        if self._closing or fut.cancelled():
            return
        how = fut.result().describe()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.restarts += 1
        self.last_death = how
        try:
            new = self.start()
        except OSError as exc:
            self.pid = None
            log.error("guardian.died", pid=pid, exit=how, restarted=False, error=str(exc))
            return
        log.warning("guardian.died", pid=pid, exit=how, restarted=True, new_pid=new)

    def _tell(self, orphans: dict[int, int]) -> None:
        if self._fd is None or not orphans:
            return
        lines = "".join(f"{pid} {started}\n" for pid, started in orphans.items())
        try:
            os.write(self._fd, lines.encode())
        except OSError as exc:  # the guardian is dying; its successor will be told
            log.warning("guardian.tell_failed", error=str(exc))

    def census(self, children: dict[int, ProcInfo]) -> None:
        """Tell the guardian about orphans adopted since the last census; forget dead ones.
        `children`: our live children with their start times (from a /proc pass)."""
        alive = set(self.reaper.orphans(children)) - {self.pid}
        new = {pid: children[pid].started for pid in alive - set(self.orphans)}
        known = {p: t for p, t in self.orphans.items() if p in alive} | new
        changed = known != self.orphans
        self.orphans = known
        self._tell(new)
        if changed and self.pid is not None:  # run.json keeps them for a later sweep
            self.on_change(self.pid)

    async def watch_orphans(self, interval: float = 1.0) -> None:
        """The fallback's census loop (not needed with cgroups: the cgroup holds them)."""
        me = os.getpid()
        while not self._closing:
            # Our children only: a few files whatever the host runs (a full /proc pass
            # held the GIL against the event loop once a second), off the loop all the same.
            ours = await asyncio.to_thread(children, me)
            await self.reaper.spawns_settled()  # a unit being started is no orphan
            self.census(ours)
            await asyncio.sleep(interval)

    def close(self) -> None:
        """The daemon is done: the guardian sees EOF, finds nothing left and exits."""
        self._closing = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "restarts": self.restarts,
            "last_death": self.last_death,
            "orphans_known": len(self.orphans),
        }
