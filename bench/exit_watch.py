"""A reference clock for exits: when did the kernel finish a killed process's exit?

A SIGKILL is not an exit. The killed process still runs its exit in the kernel (unmapping
its memory, closing its files) and only then becomes a zombie and wakes its pidfd's
waiters and its parent. A supervisor can notice no sooner. This process times that
moment for the benchmark, beside the supervisor under test, so that each kill's
kill -> noticed splits into kill -> exit complete (the kernel's share) and exit complete ->
noticed (the supervisor's).

    python -m bench.exit_watch

It runs SCHED_FIFO (priority 1) where allowed, so that its own wake-up is not delayed
behind ordinary tasks; the first stdout line says "fifo" or "normal". stdin: one pid per
line, which it opens a pidfd for and answers "watching PID" (or "gone PID"); when that
pid's exit completes it prints "exit PID T" (time.time() at its wake). It ends at EOF.

`ExitClock` starts it and talks to it.
"""

from __future__ import annotations

import os
import queue
import select
import subprocess
import sys
import threading
import time

from bench.procs import ROOT


class ExitClock:
    """The harness's end: watch(pid) before the kill, exited(pid) after it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.exit_watch"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=ROOT,  # `-m bench...` from wherever the harness was started
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.policy = self._next(10)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def _next(self, timeout: float) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            code = self.proc.poll()
            why = f"exited with status {code}" if code is not None else "is still running"
            raise RuntimeError(
                f"bench.exit_watch said nothing for {timeout:g} s (it {why})"
            ) from None

    def watch(self, pid: int) -> bool:
        """True once the pid is watched; False if it was already gone."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{pid}\n")
        self.proc.stdin.flush()
        answer = self._next(5)
        if answer not in (f"watching {pid}", f"gone {pid}"):
            raise RuntimeError(f"bench.exit_watch answered {answer!r} to pid {pid}")
        return answer.startswith("watching")

    def exited(self, pid: int, timeout: float = 10) -> float:
        """The time.time() at which pid's exit completed."""
        answer = self._next(timeout).split()
        if answer[:2] != ["exit", str(pid)]:
            raise RuntimeError(f"bench.exit_watch said {answer!r}, expected pid {pid}'s exit")
        return float(answer[2])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        print("fifo", flush=True)
    except OSError:
        print("normal", flush=True)
    poller = select.epoll()
    watched: dict[int, int] = {}  # pidfd -> pid
    os.set_blocking(0, False)
    poller.register(0, select.EPOLLIN)
    pending = b""
    while True:
        for fd, _ in poller.poll():
            if fd != 0:
                woke = time.time()
                poller.unregister(fd)
                os.close(fd)
                print(f"exit {watched.pop(fd)} {woke!r}", flush=True)
                continue
            data = os.read(0, 4096)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = int(line)
                try:
                    pidfd = os.pidfd_open(pid)
                except ProcessLookupError:
                    print(f"gone {pid}", flush=True)
                    continue
                watched[pidfd] = pid
                poller.register(pidfd, select.EPOLLIN)
                print(f"watching {pid}", flush=True)


if __name__ == "__main__":
    main()
