"""Spawning and ending process trees. All OS calls the engine makes go through here.

- With cgroup v2 (dynamod.core.cgroups) each unit instance runs in its own cgroup, entered
  between fork and exec, so nothing it starts can leave; ending the unit is the stop signal
  to every process in it, the stop timeout, then `cgroup.kill`.
- Without cgroups: each unit gets its own session (and so process group), every spawned
  process carries DYNAMOD_RUN_ID / DYNAMOD_UNIT in its environment, and dynamod is a child
  subreaper, so a descendant that left the group and dropped the marker is re-parented to
  dynamod: any child of dynamod the Reaper is not waiting for is such a leftover.
- Children get PDEATHSIG=SIGKILL; a guardian process (dynamod.core.guardian) sweeps the rest
  if dynamod itself is SIGKILLed.
- Exits arrive as events: a watched child's exit wakes the event loop through its pidfd
  and is reaped in that same step; one SIGCHLD handler reaps everything else (orphans)
  and is the fallback where there are no pidfds.
- Units are forked on a spawner thread of their own (`Spawner`), so a kill that lands
  while another unit is being started is still reaped and recorded at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import structlog

from dynamod.core import cgroups, enforce, ports, proctable, shmleft
from dynamod.core.logs import OutputSink
from dynamod.core.proctable import (
    MARK_RUN,
    MARK_UNIT,
    ProcInfo,
    children_of,
    descendants,
    group_below,
    is_zombie,
    marked_pids,
    start_time,
)
from dynamod.core.resources import Confinement, Plan
from dynamod.core.restart import Exit
from dynamod.core.spec.models import LimitsSpec

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

    A watched pid also gets a pidfd read by the loop: its exit wakes the loop's thread
    directly, and it is reaped and recorded in that same turn of the loop. SIGCHLD (the
    path for orphans, and the fallback without pidfds) needs asyncio's wakeup fd and one
    more turn; and the kernel aims it at the thread that forked the child (the spawner),
    so dynamod's worker threads block it (`block_child_signals`) and leave it to the
    loop's thread: no other thread is woken to compete with it for the CPU and the GIL.
    """

    def __init__(self) -> None:
        self._waiters: dict[int, asyncio.Future[Exit]] = {}
        self._unclaimed: dict[int, Exit] = {}
        self._claimed: set[int] = set()  # orphans a stop is ending
        self._on_exit: dict[int, Callable[[Exit], None]] = {}
        self._pidfds: dict[int, int] = {}  # watched pid -> its pidfd, read by the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self.orphans_reaped = 0
        self._spawning = 0  # spawns in flight (Spawner): their pids are not watched yet
        self._settled: asyncio.Event | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_signal_handler(signal.SIGCHLD, self.reap)

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_signal_handler(signal.SIGCHLD)
        for pid in list(self._pidfds):
            self._unread(pid)
        self._loop = None

    def spawn_began(self) -> None:
        self._spawning += 1

    def spawn_ended(self) -> None:
        self._spawning -= 1
        if self._spawning == 0 and self._settled is not None:
            self._settled.set()

    async def spawns_settled(self) -> None:
        """Return once no spawn is in flight: from then on, a child of ours that was seen
        in /proc before this call and is not watched is not one we are starting."""
        while self._spawning:
            if self._settled is None or self._settled.is_set():
                self._settled = asyncio.Event()
            await self._settled.wait()

    def orphans(self, children: Iterable[int]) -> list[int]:
        """Of `children` (live children of this process), those nobody waits for. Call it
        after `spawns_settled`, or a process being spawned may be among them."""
        return [pid for pid in children if pid not in self._waiters and _live_child(pid)]

    def claim_orphans(self, children: Iterable[int]) -> list[int]:
        """Of `children` (live children of this process), those nobody waits for and no
        other stop has claimed: descendants of a unit re-parented to the subreaper, the
        fallback's only way to find leftovers that dropped the marker. Which unit they came
        from is not known; the unit being stopped takes them. Call it after
        `spawns_settled`."""
        found = [
            pid
            for pid in children
            if pid not in self._waiters and pid not in self._claimed and _live_child(pid)
        ]
        self._claimed.update(found)
        return found

    def watch(
        self, pid: int, on_exit: Callable[[Exit], None] | None = None
    ) -> asyncio.Future[Exit]:
        """A future for pid's exit; `on_exit` (if given) is called in the very step that
        reaps it, before the future's waiters wake (the engine records exits there)."""
        future: asyncio.Future[Exit] = asyncio.get_running_loop().create_future()
        if on_exit is not None:
            self._on_exit[pid] = on_exit
        if pid in self._unclaimed:
            self._resolve(pid, future, self._unclaimed.pop(pid))
        else:
            self._waiters[pid] = future
            self._read_exit(pid)
        return future

    def _read_exit(self, pid: int) -> None:
        """Have the loop read pid's pidfd: readable once pid is a zombie. Without pidfds
        (an old kernel, out of fds) SIGCHLD still brings the exit, a moment later."""
        if self._loop is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:
            log.debug("reaper.no_pidfd", pid=pid, error=str(exc))
            return
        self._pidfds[pid] = fd
        self._loop.add_reader(fd, self._pidfd_ready, pid)

    def _unread(self, pid: int) -> None:
        fd = self._pidfds.pop(pid, None)
        if fd is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(fd)
        os.close(fd)

    def _pidfd_ready(self, pid: int) -> None:
        if not self._try_reap(pid):  # not waitable yet (or gone): stop reading, SIGCHLD brings it
            self._unread(pid)

    def _try_reap(self, pid: int) -> bool:
        """Reap pid if it has exited; False if it has not, or was reaped already (the
        SIGCHLD path resolved it)."""
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return False
        if got == 0:
            return False
        self._reaped(pid, status)
        return True

    def _resolve(self, pid: int, future: asyncio.Future[Exit], result: Exit) -> None:
        callback = self._on_exit.pop(pid, None)
        if callback is not None:
            try:
                callback(result)
            except Exception:  # a broken callback must not stop reaping
                log.exception("reaper.on_exit_failed", pid=pid)
        if not future.done():
            future.set_result(result)

    def poll(self, pid: int, spin: float = 0.0) -> bool:
        """Reap pid now if it has exited, trying for up to `spin` seconds (yielding the CPU
        between tries); True if it was reaped. For the end of a unit's output pipe: the
        kernel closes a dying process's files just before it makes it waitable."""
        if pid not in self._waiters:
            return False
        deadline = time.monotonic() + spin
        while not self._try_reap(pid):
            if pid not in self._waiters or time.monotonic() >= deadline:
                return False  # reaped by the SIGCHLD path meanwhile, or not exiting
            os.sched_yield()
        return True

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._reaped(pid, status)

    def _reaped(self, pid: int, status: int) -> None:
        result = _exit_from_status(status)
        self._claimed.discard(pid)
        future = self._waiters.pop(pid, None)
        if future is None:
            self.orphans_reaped += 1
            self._unclaimed[pid] = result
            if len(self._unclaimed) > 1000:  # orphans nobody will ask about
                self._unclaimed.pop(next(iter(self._unclaimed)))
        else:
            self._resolve(pid, future, result)  # the exit is recorded first, then tidying
        self._unread(pid)


def _live_child(pid: int) -> bool:
    """Whether pid is still a running child of ours. `children` come from a /proc pass made
    a moment earlier (in a worker thread): a unit's main process alive then may have died
    and been reaped since, and is then no longer among the waiters, yet no orphan either
    (an orphan claimed that way was reported as killed by the stop that claimed it)."""
    try:
        exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False  # not our child any more: reaped meanwhile
    return exited is None  # None: running (or stopped); a result: a zombie about to be reaped


@dataclass
class Child:
    """A spawned unit process: its pid is also its process-group and session id."""

    pid: int
    exited: asyncio.Future[Exit]
    started_at: float = field(default_factory=time.monotonic)
    start_ticks: int | None = None  # kernel start time: its descendants cannot be older
    output: int | None = None  # its output pipe's read end, until a log takes it

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    async def wait(self) -> Exit:
        """Wait for the exit. Shielded: cancelling the waiter must not cancel the fact."""
        return await asyncio.shield(self.exited)


def block_child_signals() -> None:
    """Block SIGCHLD in the calling thread: for dynamod's own worker threads (the spawner,
    the loop's executor), so the kernel hands SIGCHLD to the event loop's thread and never
    wakes a worker that would then compete with the loop for the CPU and the GIL."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})


def _child_setup(parent_pid: int, cgroup_fds: Sequence[int], confine: Confinement) -> None:
    # between fork and exec. A child forked by the spawner thread inherits its mask:
    # start it as the loop would.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    for fd in cgroup_fds:  # "0" moves the writer: the unit starts inside its cgroups
        os.write(fd, b"0")
    for which, value in confine.rlimits:  # limits no cgroup controller could carry
        resource.setrlimit(which, (value, value))
    if confine.cpus is not None:
        os.sched_setaffinity(0, confine.cpus)
    if confine.nice is not None:
        os.setpriority(os.PRIO_PROCESS, 0, confine.nice)
        if confine.autogroup:  # this new session is weighed as one: it takes the nice
            _autogroup_nice(confine.nice)
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(137)


def _autogroup_nice(nice: int) -> None:
    """Give the calling process's session (its autogroup) `nice`. The kernel lets one
    caller without CAP_SYS_ADMIN do so only once per 100 ms (EAGAIN): tried for up to 1 s,
    which the spawner's one start at a time leaves plenty of."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            with open("/proc/self/autogroup", "w") as autogroup:
                autogroup.write(str(nice))
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _popen(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path | None,
    stdout_fd: int | None,
    cgroup: Path | None,
    parent: int,
    confine: Confinement | None = None,
) -> tuple[int, int | None]:
    """fork+exec argv in a new session with PDEATHSIG (inside `cgroup` and the cgroups of
    `confine`, with its rlimits, CPUs and priority); returns its pid and kernel start time.
    Blocking: it returns once the child has exec'd."""
    confine = confine or Confinement()
    procs = ([cgroup / "cgroup.procs"] if cgroup is not None else []) + list(confine.procs_files)
    fds: list[int] = []
    try:
        for path in procs:
            try:
                fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            except OSError as exc:
                raise OSError(
                    exc.errno, f"cannot enter cgroup {path.parent}: {exc.strerror}"
                ) from exc
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout_fd if stdout_fd is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_child_setup, parent, fds, confine),
            close_fds=True,
        )
    except subprocess.SubprocessError as exc:  # a cgroup write or a limit in the child failed
        where = ", ".join(str(p.parent) for p in procs) or "its limits"
        raise OSError(0, f"cannot confine the new process ({where}): {exc}") from exc
    finally:
        for fd in fds:
            os.close(fd)
    proc.returncode = 0  # the Reaper owns waiting; stop Popen from ever calling waitpid
    return proc.pid, start_time(proc.pid)


def _child(
    reaper: Reaper,
    pid: int,
    start_ticks: int | None,
    on_exit: Callable[[Child, Exit], None] | None,
) -> Child:
    child = Child(pid=pid, exited=asyncio.get_running_loop().create_future())
    child.start_ticks = start_ticks
    callback = (lambda exit: on_exit(child, exit)) if on_exit is not None else None
    child.exited = reaper.watch(pid, callback)
    return child


def spawn(
    reaper: Reaper,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path | None = None,
    stdout_fd: int | None = None,
    cgroup: Path | None = None,
    on_exit: Callable[[Child, Exit], None] | None = None,
) -> Child:
    """Start argv in a new session with PDEATHSIG (inside `cgroup` if given); returns
    with an exit future once it has exec'd, blocking the event loop meanwhile (exec probes;
    units start through `Spawner`, off the loop).

    Must be called from the event loop's thread: PDEATHSIG fires when the *thread*
    that forked the child ends.
    """
    pid, ticks = _popen(argv, env, cwd, stdout_fd, cgroup, os.getpid())
    return _child(reaper, pid, ticks, on_exit)


class Spawner:
    """Starts unit processes on one thread of its own, so the event loop goes on reaping,
    recording exits and answering `status` while a fork+exec (and the child's move into
    its cgroup) takes its milliseconds.

    The thread is started on first use and never ends before the process does: PDEATHSIG
    fires when the *thread* that forked a child ends, not the process. While a spawn is in
    flight its pid may already be a child of ours that nobody waits for: the Reaper counts
    spawns in flight, and whoever takes unwaited children for orphans first waits for
    `Reaper.spawns_settled`.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    async def spawn(
        self,
        reaper: Reaper,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path | None = None,
        stdout_fd: int | None = None,
        cgroup: Path | None = None,
        on_exit: Callable[[Child, Exit], None] | None = None,
        confine: Confinement | None = None,
    ) -> Child:
        """Like `spawn`, without blocking the loop. Run it as a task of its own and
        shield it: cancelled while the thread forks, the child would exist unwatched."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="dynamod-spawner", initializer=block_child_signals
            )
        reaper.spawn_began()
        try:
            pid, ticks = await asyncio.wrap_future(
                self._pool.submit(
                    _popen, argv, env, cwd, stdout_fd, cgroup, os.getpid(), confine
                )
            )
            return _child(reaper, pid, ticks, on_exit)
        finally:
            reaper.spawn_ended()


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
class Tree:
    """Where one unit instance's processes are: its cgroup when there is one, else its
    process group, the run's markers and (via the Reaper) unmarked re-parented orphans."""

    pgid: int
    run_id: str
    unit: str
    cgroup: Path | None = None
    reaper: Reaper | None = None
    since: int | None = None  # the unit's start (clock ticks): older processes are not its


@dataclass(frozen=True)
class TreeStopped:
    """What ending a unit's tree took: whether SIGKILL was needed, whom it reached (pids
    found alive when it was sent), what survived it."""

    escalated: bool
    killed_outside_group: int
    survivors: list[int]
    killed: list[int] = field(default_factory=list)
    # /dev/shm files its processes held and left, removed once they were gone (shmleft)
    shm_removed: list[str] = field(default_factory=list)


# How long a unit's Python resource trackers get to clean up and exit by themselves once
# every other process of the unit is gone (they unlink what their program registered).
TRACKER_WAIT = 2.0
_TRACKER = b"from multiprocessing.resource_tracker import main"


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return _TRACKER in fh.read()
    except OSError:
        return False


async def _trackers_last(pids: Iterable[int], kill_wait: float) -> set[int]:
    """SIGKILL `pids` but the Python resource trackers among them; once the rest are gone,
    let the trackers end by themselves (within TRACKER_WAIT): the pids that did.

    A program that uses multiprocessing's spawn start method (vLLM does) registers its named
    semaphores and shared memory with a tracker process, which ignores SIGTERM and, once
    every other process of the program has closed its pipe, unlinks whatever is left
    registered and exits. A kill -9 of the whole tree takes the tracker too, and what it
    would have removed stays in /dev/shm (a real shard's `sem.mp-*`, which no process maps,
    so shmleft cannot know it)."""
    members = set(pids)
    trackers = {pid for pid in members if _is_resource_tracker(pid)}
    if not trackers:
        return set()
    for pid in members - trackers:
        _signal_pid(pid, signal.SIGKILL)
    await wait_gone(members - trackers, kill_wait)
    left = set(await wait_gone(trackers, TRACKER_WAIT))
    return trackers - left


async def stop_tree(tree: Tree, *, sig: int, timeout: float, kill_wait: float = 5.0) -> TreeStopped:
    """Send `sig` to the unit's processes; after `timeout`, SIGKILL whatever is left;
    return whom that reached and anything that still survives. timeout=0: the main
    process is gone already and the rest gets SIGKILL at once."""
    if tree.cgroup is not None:
        return await _stop_cgroup(
            tree.cgroup, tree.pgid, sig=sig, timeout=timeout, kill_wait=kill_wait
        )
    return await _stop_group(tree, sig=sig, timeout=timeout, kill_wait=kill_wait)


def _emptied(path: Path) -> TreeStopped:
    """A unit's cgroup with no process left: removed, nothing to stop."""
    cgroups.remove(path)
    return TreeStopped(escalated=False, killed_outside_group=0, survivors=[])


async def _stop_cgroup(
    path: Path, pgid: int, *, sig: int, timeout: float, kill_wait: float
) -> TreeStopped:
    if not cgroups.populated(path):  # the common case after an exit: one file read
        return _emptied(path)
    outside = 0
    if timeout > 0 and sig != signal.SIGKILL:
        members = cgroups.procs(path)
        for pid in members:
            _signal_pid(pid, sig)
        outside = sum(1 for pid in members if _pgid(pid) not in (pgid, None))
        deadline = time.monotonic() + timeout
        while cgroups.populated(path) and (left := deadline - time.monotonic()) > 0:
            await wait_gone(cgroups.procs(path), left)
    killed: list[int] = []
    if cgroups.populated(path):
        members = cgroups.procs(path)
        ended = await _trackers_last(members, kill_wait)  # they clean up, then go
        killed = [pid for pid in members if pid not in ended]
        cgroups.kill(path)
        deadline = time.monotonic() + kill_wait
        while cgroups.populated(path) and (left := deadline - time.monotonic()) > 0:
            await wait_gone(cgroups.procs(path), left)
    survivors = cgroups.procs(path) if cgroups.populated(path) else []
    if not survivors:
        cgroups.remove(path)
    return TreeStopped(
        escalated=bool(killed) and timeout > 0 and sig != signal.SIGKILL,
        killed_outside_group=outside,
        survivors=survivors,
        killed=killed,
    )


def _scan(tree: Tree) -> tuple[set[int], set[int], list[int]]:
    """One pass over dynamod's own process tree: the unit's process group, the marked
    processes of the unit outside it, and our children outside it; only processes younger
    than the unit are looked at outside the group. Every process of a unit descends from
    dynamod (orphans are re-parented to it, the subreaper; a process can only join a group
    of its own session), so the pass costs the size of the stack, not of the host's process
    table; the final sweep still reads all of /proc for the marker. Blocking: runs in a
    worker thread, so exits keep being recorded."""
    me = os.getpid()
    snap = descendants(me)
    group = {pid for pid, info in snap.items() if info.pgid == tree.pgid}
    young = [pid for pid, info in snap.items() if _younger(info, tree.since) and pid not in group]
    marked = set(marked_pids(tree.run_id, tree.unit, among=young))
    return group, marked, [p for p in young if snap[p].ppid == me]


async def _members(tree: Tree) -> tuple[set[int], list[int]]:
    """The unit's process group, and its processes outside it: marked ones, and (the
    subreaper's catch) children of dynamod that nobody waits for."""
    group, found, children = await asyncio.to_thread(_scan, tree)
    if tree.reaper is not None:
        await tree.reaper.spawns_settled()  # a unit being started is no orphan
        found |= set(tree.reaper.claim_orphans(children))
    return group, sorted(found - group - {tree.pgid})


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _group_pids(pgid: int) -> set[int]:
    """The processes of the unit's process group `pgid` now: its leader and the orphans
    dynamod (the subreaper) took in, and theirs (`proctable.group_below`). The cost is the
    unit's tree, not the host's process table (a pass over all of /proc, as before
    2026-12-08, took 18 ms with 1,000 other processes; bench.shm_note)."""
    return group_below(pgid, os.getpid())


def _younger(info: ProcInfo, since: int | None) -> bool:
    return since is None or info.started >= since


async def _stop_group(tree: Tree, *, sig: int, timeout: float, kill_wait: float) -> TreeStopped:
    pgid = tree.pgid
    at_once = sig == signal.SIGKILL  # all of it in the kill below, resource trackers last
    if not at_once:
        _signal_group(pgid, sig)
    group, strays = await _members(tree)
    if not at_once:
        for pid in strays:
            _signal_pid(pid, sig)
    targets = group | set(strays) | {pgid}
    left = await wait_gone(targets, 0 if at_once else timeout)
    escalated = False
    killed: list[int] = []
    # Re-scan: a process may have forked while we waited. What the /proc pass saw may
    # have ended since: only what is alive now is reported killed.
    group, more = await _members(tree)
    left = sorted(pid for pid in set(left) | group | set(more) if not is_zombie(pid))
    if left:
        escalated = sig != signal.SIGKILL
        ended = await _trackers_last(left, kill_wait)  # they clean up, then go
        killed = [pid for pid in left if pid not in ended]
        _signal_group(pgid, signal.SIGKILL)
        for pid in left:
            _signal_pid(pid, signal.SIGKILL)
        left = await wait_gone(left, kill_wait)
    return TreeStopped(
        escalated=escalated, killed_outside_group=len(strays), survivors=left, killed=killed
    )


@dataclass(frozen=True)
class Swept:
    """What the final sweep of a run found and SIGKILLed, and what survived it."""

    killed: list[int]
    survivors: list[int]


async def sweep(
    run_id: str,
    *,
    cgroup: Path | None = None,
    reaper: Reaper | None = None,
    keep: frozenset[int] = frozenset(),
    timeout: float = 5.0,
) -> Swept:
    """End everything of this run that is still there: the stack's cgroup, processes
    carrying its marker, and every child of dynamod but `keep` (the guardian). `down` is
    not finished while any of them lives. Returns whom it killed and who survived."""
    killed: set[int] = set()
    survivors: set[int] = set()
    if cgroup is not None and cgroups.populated(cgroup):
        killed |= set(cgroups.procs(cgroup))
        cgroups.kill(cgroup)
    for _ in range(5):  # a dying parent may still fork once
        targets = set(await asyncio.to_thread(marked_pids, run_id))
        if reaper is not None:
            targets |= set(await asyncio.to_thread(children_of, os.getpid()))
        targets -= keep
        if cgroup is not None and cgroups.populated(cgroup):
            targets |= set(cgroups.procs(cgroup))
        if not targets:
            break
        killed |= targets
        for pid in targets:
            _signal_pid(pid, signal.SIGKILL)
        survivors = set(await wait_gone(targets, timeout))
        if survivors:
            break
    if cgroup is not None:
        if cgroups.populated(cgroup):
            survivors |= set(cgroups.procs(cgroup))
        else:
            cgroups.remove(cgroup)
    return Swept(killed=sorted(killed), survivors=sorted(survivors))


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


# --------------------------------------------------------------------------- the host


# How long the end of a unit's output pipe has the Reaper look for the exit, yielding the
# CPU between looks. The kernel closes a dying process's files (the pipe's EOF wakes the
# loop) a moment before it makes it waitable, and the woken loop often runs on the dying
# process's CPU: without the yield the exit did not come within 0.5 ms in 75 of 100 kills;
# with it, it came in 98-100 of 100, and a second wake from idle (0.5-4 ms on this VM)
# is saved. A unit that closes its output and runs on costs this once.
EOF_SPIN = 0.0005

OnExit = Callable[[Child, Exit], None]


class ProcessHost(Protocol):
    """Everything the engine asks of the operating system about its units' processes.
    `OsHost` is the real one; the engine's unit tests drive the whole state machine
    against a fake in milliseconds, with no process spawned (Supervisor's DummyOptions)."""

    @property
    def reaper(self) -> Reaper:
        """The daemon's Reaper: exec probes spawn through it, the final sweep asks it."""
        ...

    def cgroup(self, unit: str) -> Path | None:
        """The unit's own cgroup, or None where units are contained by process group."""
        ...

    def environment(self, unit: str, extra: Mapping[str, str]) -> dict[str, str]:
        """The environment a process of `unit` (or of its probes) starts with."""
        ...

    async def spawn(
        self, unit: str, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path | None,
        on_exit: OnExit, limits: LimitsSpec | None = None,
    ) -> Child:
        """Start the unit's main process, its output on a pipe (`Child.output`), under
        `limits`. Raises OSError or CgroupError if it cannot. `on_exit` is called in the
        step that reaps it, before anyone awaiting `Child.exited` wakes."""
        ...

    def limits(self, unit: str) -> Plan | None:
        """How the unit's limits are enforced since its last spawn; None without limits."""
        ...

    def oom_kills(self, unit: str) -> int:
        """OOM kills in the unit's memory cgroup since its last spawn (0 where unknown)."""
        ...

    def attach_output(self, child: Child, sink: OutputSink) -> None:
        """Hand the child's output pipe to the unit's log."""
        ...

    def kill_group_now(self, child: Child) -> None:
        """SIGKILL the unit's process group at once (hung or timed-out units)."""
        ...

    async def stop_tree(self, unit: str, child: Child, *, sig: int, timeout: float) -> TreeStopped:
        """End the unit's processes: `sig`, then SIGKILL after `timeout` (0: at once)."""
        ...

    def unit_pids(self, unit: str, child: Child) -> set[int]:
        """The unit's processes now: its cgroup's, or its group's and marked ones."""
        ...

    async def note_shm(self, unit: str, child: Child) -> None:
        """Note the /dev/shm files the unit's processes hold now (it turned ready): at its
        stop, those left are removed even where the process that held them died first."""
        ...

    def port_in_use(self, port: int) -> bool:
        """Whether something listens on (or holds) the local TCP port."""
        ...

    def port_owners(self, port: int, among: set[int] | None = None) -> set[int]:
        """The pids listening on the local TCP port, as far as they can be seen (of
        `among` only, when given)."""
        ...

    def allocate_port(self) -> int:
        """A free loopback port, for a unit's port that another process took; OSError if
        none can be had."""
        ...

    def command_line(self, pid: int) -> str:
        """The process's command line, short, for messages."""
        ...


class OsHost:
    """The ProcessHost of a running daemon: fork+exec on the spawner thread, cgroups or
    process groups, /proc."""

    def __init__(
        self,
        run_id: str,
        reaper: Reaper,
        containment: cgroups.Containment | None = None,
        spawner: Spawner | None = None,
    ) -> None:
        self.run_id = run_id
        self._reaper = reaper
        self.containment = containment or cgroups.Containment(cgroups.Kind.PGROUP, None)
        self.spawner = spawner or Spawner()
        self.enforcer = enforce.Enforcer(run_id, self.containment)
        self._ports: ports.PortAllocator | None = None  # made when a port first moves
        self._shm_noted: dict[str, dict[Path, int]] = {}  # unit -> at its readiness (shmleft)

    @property
    def reaper(self) -> Reaper:
        return self._reaper

    def cgroup(self, unit: str) -> Path | None:
        return self.containment.unit(unit)

    def environment(self, unit: str, extra: Mapping[str, str]) -> dict[str, str]:
        return base_environment(self.run_id, unit, extra)

    async def spawn(
        self, unit: str, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path | None,
        on_exit: OnExit, limits: LimitsSpec | None = None,
    ) -> Child:
        read_fd, write_fd = os.pipe()
        try:
            cgroup = self.cgroup(unit)
            if cgroup is not None:
                cgroups.make(cgroup)
            confine = self.enforcer.prepare(unit, limits)
            child = await self.spawner.spawn(
                self._reaper, argv, env=env, cwd=cwd, stdout_fd=write_fd, cgroup=cgroup,
                on_exit=on_exit, confine=confine,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        child.output = read_fd
        return child

    def attach_output(self, child: Child, sink: OutputSink) -> None:
        fd, child.output = child.output, None
        if fd is not None:
            sink.attach(fd, on_end=functools.partial(self._reaper.poll, child.pid, EOF_SPIN))

    def kill_group_now(self, child: Child) -> None:
        kill_group_now(child.pid)

    async def stop_tree(self, unit: str, child: Child, *, sig: int, timeout: float) -> TreeStopped:
        # an exit that left no process in its cgroup (the common case): one file read, on
        # the loop; else what its live processes hold in /dev/shm, noted before any of them
        # is signalled, then the stop
        cgroup = self.cgroup(unit)
        held: set[Path] = set()
        noted = self._shm_noted.pop(unit, {})
        if cgroup is not None and not cgroups.populated(cgroup):
            stopped = _emptied(cgroup)
        else:
            held = await asyncio.to_thread(self._shm_held, cgroup, child)
            stopped = await stop_tree(self._tree(unit, child), sig=sig, timeout=timeout)
        if not stopped.survivors:
            self.enforcer.release(unit)
            if noted:  # what it held at its readiness, if still the same files
                held |= await asyncio.to_thread(shmleft.same, noted)
            if held:
                removed = await asyncio.to_thread(shmleft.remove_unheld, held)
                if removed:
                    log.info("unit.shm_removed", unit=unit, files=[str(p) for p in removed],
                             why="held by its processes, which are gone; held by no one now")
                    stopped = replace(stopped, shm_removed=[str(p) for p in removed])
        return stopped

    async def note_shm(self, unit: str, child: Child) -> None:
        def note() -> dict[Path, int]:
            try:
                return shmleft.identities(self._shm_held(self.cgroup(unit), child))
            except OSError:  # /proc read as processes come and go: nothing noted, as before
                return {}

        self._shm_noted[unit] = await asyncio.to_thread(note)

    @staticmethod
    def _shm_held(cgroup: Path | None, child: Child) -> set[Path]:
        """The /dev/shm files the unit's live processes hold: its cgroup's, or its
        process group's. Blocking: /proc reads."""
        pids = set(cgroups.procs(cgroup)) if cgroup is not None else _group_pids(child.pid)
        return shmleft.held(pid for pid in pids if not is_zombie(pid))

    def limits(self, unit: str) -> Plan | None:
        return self.enforcer.plans.get(unit)

    def oom_kills(self, unit: str) -> int:
        return self.enforcer.oom_kills(unit)

    def _tree(self, unit: str, child: Child) -> Tree:
        return Tree(
            pgid=child.pid,
            run_id=self.run_id,
            unit=unit,
            cgroup=self.cgroup(unit),
            reaper=self._reaper,
            since=child.start_ticks,
        )

    def unit_pids(self, unit: str, child: Child) -> set[int]:
        cgroup = self.cgroup(unit)
        if cgroup is not None:
            return set(cgroups.procs(cgroup)) | {child.pid}
        return _group_pids(child.pid) | set(marked_pids(self.run_id, unit)) | {child.pid}

    def port_in_use(self, port: int) -> bool:
        return ports.in_use(port)

    def port_owners(self, port: int, among: set[int] | None = None) -> set[int]:
        return ports.listener_pids(port, among=among)

    def allocate_port(self) -> int:
        if self._ports is None:
            self._ports = ports.PortAllocator()
        return self._ports()

    def command_line(self, pid: int) -> str:
        return proctable.command_line(pid)
