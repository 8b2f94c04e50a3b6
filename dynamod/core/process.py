"""Spawning and ending process trees. All OS calls the engine makes go through here.

- Each unit gets its own session (and so process group).
- dynamod is a child subreaper: descendants that double-fork are re-parented to it,
  so they can be reaped and found.
- Children get PDEATHSIG=SIGKILL; a guardian process (dynamod.core.guardian) sweeps the rest
  if dynamod itself is SIGKILLed.
- Every spawned process carries DYNAMOD_RUN_ID / DYNAMOD_UNIT in its environment, which
  the sweep uses to find descendants that left the unit's process group.
- Exits arrive as events: one SIGCHLD handler reaps every child and resolves futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from dynamod.core.proctable import MARK_RUN, MARK_UNIT, group_pids, is_zombie, marked_pids
from dynamod.core.restart import Exit

log = structlog.get_logger("dynamod.core.process")


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(err)}")


def _exit_from_status(status: int) -> Exit:
    if os.WIFSIGNALED(status):
        return Exit(code=None, signal=os.WTERMSIG(status))
    return Exit(code=os.waitstatus_to_exitcode(status), signal=None)


class Reaper:
    """Owns SIGCHLD for the whole daemon: every child exit is reaped here.

    Units, exec probes and orphans re-parented to the subreaper all end up here; callers
    that care about a pid get a future. Nothing else in dynamod may call waitpid.
    """

    def __init__(self) -> None:
        self._waiters: dict[int, asyncio.Future[Exit]] = {}
        self._unclaimed: dict[int, Exit] = {}
        self.orphans_reaped = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGCHLD, self.reap)

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_signal_handler(signal.SIGCHLD)

    def watch(self, pid: int) -> asyncio.Future[Exit]:
        future: asyncio.Future[Exit] = asyncio.get_running_loop().create_future()
        if pid in self._unclaimed:
            future.set_result(self._unclaimed.pop(pid))
        else:
            self._waiters[pid] = future
        return future

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            result = _exit_from_status(status)
            future = self._waiters.pop(pid, None)
            if future is None:
                self.orphans_reaped += 1
                self._unclaimed[pid] = result
                if len(self._unclaimed) > 1000:  # orphans nobody will ask about
                    self._unclaimed.pop(next(iter(self._unclaimed)))
            elif not future.done():
                future.set_result(result)


@dataclass
class Child:
    """A spawned unit process: its pid is also its process-group and session id."""

    pid: int
    exited: asyncio.Future[Exit]
    started_at: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    async def wait(self) -> Exit:
        """Wait for the exit. Shielded: cancelling the waiter must not cancel the fact."""
        return await asyncio.shield(self.exited)


def _child_setup(parent_pid: int) -> None:  # runs in the child between fork and exec
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(137)


def spawn(
    reaper: Reaper,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path | None = None,
    stdout_fd: int | None = None,
) -> Child:
    """Start argv in a new session with PDEATHSIG; returns at once with an exit future.

    Must be called from the event loop's thread: PDEATHSIG fires when the *thread*
    that forked the child ends.
    """
    parent = os.getpid()
    proc = subprocess.Popen(
        list(argv),
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout_fd if stdout_fd is not None else subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: _child_setup(parent),
        close_fds=True,
    )
    proc.returncode = 0  # the Reaper owns waiting; stop Popen from ever calling waitpid
    return Child(pid=proc.pid, exited=reaper.watch(proc.pid))


# --------------------------------------------------------------------------- ending


def _signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    if pgid <= 1:  # never our own group's 0 nor init's; only a unit's session leader
        raise ValueError(f"refusing to signal process group {pgid}")
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_group_now(pgid: int) -> None:
    """SIGKILL a unit's process group at once (hung or timed-out units)."""
    _signal_group(pgid, signal.SIGKILL)


async def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait (event-driven, via pidfd) until every pid has exited; return the survivors."""
    loop = asyncio.get_running_loop()
    pending: dict[int, asyncio.Future[None]] = {}
    fds: list[int] = []
    for pid in set(pids):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        fds.append(fd)
        future: asyncio.Future[None] = loop.create_future()

        def _done(fut: asyncio.Future[None] = future, fd: int = fd) -> None:
            loop.remove_reader(fd)
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(fd, _done)
        pending[pid] = future
    try:
        if pending:
            await asyncio.wait(pending.values(), timeout=timeout)
        return [pid for pid, fut in pending.items() if not fut.done() and not is_zombie(pid)]
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


@dataclass(frozen=True)
class TreeStopped:
    """What ending a unit's tree took: whether SIGKILL was needed, what survived."""

    escalated: bool
    killed_outside_group: int
    survivors: list[int]


async def stop_tree(
    pgid: int,
    *,
    run_id: str,
    unit: str,
    sig: int,
    timeout: float,
    kill_wait: float = 5.0,
) -> TreeStopped:
    """Signal the unit's process group and any marked descendants outside it; after
    `timeout`, SIGKILL whatever is left; return anything that still survives."""
    _signal_group(pgid, sig)
    strays = [p for p in marked_pids(run_id, unit) if p not in group_pids(pgid)]
    for pid in strays:
        _signal_pid(pid, sig)
    targets = set(group_pids(pgid)) | set(strays) | {pgid}
    left = await wait_gone(targets, timeout)
    escalated = False
    # Re-scan: a process may have forked while we waited.
    left = sorted(set(left) | set(group_pids(pgid)) | set(marked_pids(run_id, unit)))
    if left:
        escalated = True
        _signal_group(pgid, signal.SIGKILL)
        for pid in left:
            _signal_pid(pid, signal.SIGKILL)
        left = await wait_gone(left, kill_wait)
    return TreeStopped(escalated=escalated, killed_outside_group=len(strays), survivors=left)


async def sweep(run_id: str, timeout: float = 5.0) -> list[int]:
    """SIGKILL every process still carrying this run's marker; return survivors."""
    pids = marked_pids(run_id)
    for pid in pids:
        _signal_pid(pid, signal.SIGKILL)
    return await wait_gone(pids, timeout) if pids else []


def base_environment(run_id: str, unit: str, extra: Mapping[str, str]) -> dict[str, str]:
    """Inherited environment + the unit's env + markers; the venv's bin dir leads PATH so
    binaries installed into dynamod's environment (etcd, nats-server) are found."""
    import sys

    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    path = env.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        env["PATH"] = bindir + (os.pathsep + path if path else "")
    env.update(extra)
    env[MARK_RUN] = run_id
    env[MARK_UNIT] = unit
    env.pop("NOTIFY_SOCKET", None)  # systemd notifications are dynamod's, not the units'
    return env
