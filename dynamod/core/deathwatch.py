"""Early notice that a process is dying, before the kernel has torn it down.

A killed process is reaped (SIGCHLD, its pidfd) only after its last thread has unmapped
its memory: 30-140 ms for a torch worker on a quiet machine, hundreds under load. Its
other threads end within a millisecond of the fatal signal. So this watch holds a
thread pidfd (`PIDFD_THREAD`, Linux >= 6.9) on each of the process's threads but the
main one; when one of them ends it reads the main thread: exiting (`PF_EXITING`), a
SIGKILL pending (a fatal signal reaches every thread as one), a zombie, or gone means the
process is dying, and `on_dying` is called once. A thread that simply ended (a pool
shrinking) is dropped, and threads started since are watched instead. Where the kernel
has no thread pidfds the watch does nothing and the exit event stays the first notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger("dynamod.core.deathwatch")

PIDFD_THREAD = os.O_EXCL  # the kernel's value: a pidfd for one thread, not the group
_PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit
_SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL in the SigPnd / ShdPnd masks


def dying(pid: int, proc: Path = Path("/proc")) -> str | None:
    """Why process `pid`'s main thread is on its way out, or None if it is not."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        status = (proc / str(pid) / "status").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    state, flags = fields[0], int(fields[6])
    if state in {"Z", "X", "x"}:
        return "zombie"
    if flags & _PF_EXITING:
        return "exiting"
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in {"SigPnd", "ShdPnd"} and int(value.strip(), 16) & _SIGKILL_BIT:
            return "SIGKILL pending"
    return None


class DeathWatch:
    """Calls `on_dying(why)` once, soon after process `pid` got a fatal signal."""

    def __init__(self, pid: int, on_dying: Callable[[str], None]) -> None:
        self.pid = pid
        self.on_dying = on_dying
        self._fds: dict[int, int] = {}  # pidfd -> thread id
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fired = False

    def start(self) -> bool:
        """Watch from the running loop; False if the kernel has no thread pidfds or the
        process is gone already (the exit event is then the only notice)."""
        self._loop = asyncio.get_running_loop()
        self._rearm()
        return bool(self._fds)

    def close(self) -> None:
        for fd in list(self._fds):
            self._drop(fd)

    def _rearm(self) -> None:
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{self.pid}/task")} - {self.pid}
        except OSError:
            return
        watched = set(self._fds.values())
        assert self._loop is not None
        for tid in sorted(tids - watched):
            try:
                fd = os.pidfd_open(tid, PIDFD_THREAD)
            except ProcessLookupError:
                continue  # that thread ended meanwhile
            except OSError as exc:  # EINVAL: no PIDFD_THREAD in this kernel
                log.debug("deathwatch.unsupported", pid=self.pid, error=str(exc))
                return
            self._fds[fd] = tid
            self._loop.add_reader(fd, self._ended, fd)

    def _drop(self, fd: int) -> None:
        self._fds.pop(fd, None)
        if self._loop is not None:
            self._loop.remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    def _ended(self, fd: int) -> None:
        self._drop(fd)
        why = dying(self.pid)
        if why is None:
            self._rearm()  # one thread ended on its own: watch the ones there are now
            return
        self.close()
        if not self.fired:
            self.fired = True
            self.on_dying(why)
