"""How the Reaper notices exits (issue 9 §3): a watched child's exit reaches the event loop
through its pidfd, with SIGCHLD not even handled; an exit the SIGCHLD path reaps first is
recorded once and its pidfd closed; dynamod's worker threads block SIGCHLD (so it goes to
the loop's thread) while the units they fork start with it unblocked. Real processes, in a
child interpreter (the Reaper owns SIGCHLD there). Correctness only: nothing is timed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, Dynamod, pid_alive

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """\
    import asyncio, json, os, signal, subprocess, sys, threading, time
    from dynamod.core import process, proctable

    scenario = sys.argv[1]
    SIGCHLD_BIT = 1 << (signal.SIGCHLD - 1)

    def blocked(path):
        for line in open(path):
            if line.startswith("SigBlk:"):
                return bool(int(line.split()[1], 16) & SIGCHLD_BIT)
        raise SystemExit(f"no SigBlk in {path}")

    def fds():
        return len(os.listdir("/proc/self/fd"))

    async def guard(awaitable, what):
        try:
            return await asyncio.wait_for(awaitable, 20)  # a hang guard, not a timing assertion
        except TimeoutError:
            raise SystemExit(f"never happened: {what}")

    async def main():
        loop = asyncio.get_running_loop()
        reaper = process.Reaper()
        reaper.install(loop)
        out = {}
        env = {"PATH": os.environ["PATH"]}
        if scenario == "pidfd-only":
            loop.remove_signal_handler(signal.SIGCHLD)  # no SIGCHLD path: the pidfd alone
        before = fds()
        recorded = []

        def spawn_and_kill():
            child = process.spawn(reaper, ["sleep", "1000"], env=env,
                                  on_exit=lambda c, exit: recorded.append(exit.describe()))
            out["pid"] = child.pid
            os.kill(child.pid, signal.SIGKILL)
            return child

        if scenario == "pidfd-only":
            child = spawn_and_kill()
            exit = await guard(child.wait(), "the exit, through the pidfd")
            out["exit"] = exit.describe()
            out["recorded"] = recorded
            out["fds_left"] = fds() - before
        elif scenario == "sigchld-first":
            child = spawn_and_kill()
            while not proctable.is_zombie(child.pid):  # blocking: the loop does not turn,
                time.sleep(0.001)  # so the pidfd is not read before reap() below
            reaper.reap()  # the SIGCHLD path gets there first
            exit = await guard(child.wait(), "the exit, through SIGCHLD")
            for _ in range(20):  # turns of the loop: a stale reader would fire here
                await asyncio.sleep(0.01)
            out["exit"] = exit.describe()
            out["recorded"] = recorded
            out["fds_left"] = fds() - before
        elif scenario == "claim-after-pass":
            # a /proc pass (as a stop's scan makes in a worker thread) sees a watched unit
            # alive and an unwaited child (an adopted orphan, as far as the Reaper knows)
            unit = process.spawn(reaper, ["sleep", "1000"], env=env)
            stray = subprocess.Popen(["sleep", "1000"])  # nobody waits for it
            stray.returncode = 0  # the Reaper owns waiting, as in the daemon
            seen = sorted(proctable.children(os.getpid()))
            out["pid"], out["stray"] = unit.pid, stray.pid
            out["seen"] = [p in seen for p in (unit.pid, stray.pid)]
            os.kill(unit.pid, signal.SIGKILL)  # ... then the unit dies and is reaped
            await guard(unit.wait(), "the unit's exit")
            out["claimed"] = reaper.claim_orphans(seen)
            out["orphans"] = reaper.orphans(seen)
            os.kill(stray.pid, signal.SIGKILL)
            while proctable.children(os.getpid()):
                await asyncio.sleep(0.01)
        else:  # spawner: the thread blocks SIGCHLD, the unit it forks does not
            spawner = process.Spawner()
            child = await spawner.spawn(reaper, ["sleep", "1000"], env=env)
            out["pid"] = child.pid
            thread = next(t for t in threading.enumerate() if t.name.startswith("dynamod-spawner"))
            out["spawner_blocks"] = blocked(f"/proc/self/task/{thread.native_id}/status")
            out["loop_blocks"] = blocked(f"/proc/self/task/{threading.get_native_id()}/status")
            out["child_blocks"] = blocked(f"/proc/{child.pid}/status")
            os.kill(child.pid, signal.SIGKILL)
            out["exit"] = (await guard(child.wait(), "the spawned child's exit")).describe()
        reaper.uninstall(loop)
        print(json.dumps(out))

    asyncio.run(main())
    """
)


def _run(scenario: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, scenario],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outcome: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    pid = outcome["pid"]
    assert isinstance(pid, int) and not pid_alive(pid)
    return outcome


def test_an_exit_reaches_the_loop_through_the_pidfd_without_sigchld() -> None:
    out = _run("pidfd-only")
    assert out["exit"] == "killed by SIGKILL"
    assert out["recorded"] == ["killed by SIGKILL"]  # recorded once, in the reaping step
    assert out["fds_left"] == 0  # the pidfd is closed once the exit is reaped


def test_an_exit_sigchld_reaps_first_is_recorded_once_and_its_pidfd_closed() -> None:
    out = _run("sigchld-first")
    assert out["exit"] == "killed by SIGKILL"
    assert out["recorded"] == ["killed by SIGKILL"]
    assert out["fds_left"] == 0


def test_the_spawner_thread_blocks_sigchld_and_its_units_do_not() -> None:
    out = _run("spawner")
    assert out["spawner_blocks"] is True  # SIGCHLD goes to the loop's thread instead
    assert out["loop_blocks"] is False
    assert out["child_blocks"] is False  # a unit starts with the mask the loop has
    assert out["exit"] == "killed by SIGKILL"


def test_the_daemons_worker_threads_block_sigchld(dm: Dynamod, stack_file: Any) -> None:
    """In a running daemon every thread but the loop's blocks SIGCHLD (the spawner, the
    loop's executor), its units start with it unblocked, and a kill is still recorded."""
    stack = stack_file("""
        [units.svc]
        command = ["sleep", "1000"]
        [units.svc.restart]
        min_uptime = 0.2
    """)
    dm.run("up", str(stack), "--detach", check=True)
    daemon = dm.status()["daemon_pid"]
    first = dm.unit("svc")
    threads = {int(t): _blocks_sigchld(Path(f"/proc/{daemon}/task/{t}/status"))
               for t in os.listdir(f"/proc/{daemon}/task")}
    assert threads.pop(daemon) is False, threads  # the loop's thread takes SIGCHLD
    assert threads and all(threads.values()), threads  # the spawner (at least) blocks it
    assert _blocks_sigchld(Path(f"/proc/{first['pid']}/status")) is False
    os.kill(first["pid"], signal.SIGKILL)
    second = dm.wait_ready_again("svc", first["pid"], what="the restart after a kill")
    assert second["last_exit"] == "killed by SIGKILL"


def _blocks_sigchld(status: Path) -> bool:
    for line in status.read_text().splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGCHLD - 1)))
    raise AssertionError(f"no SigBlk line in {status}")


def test_a_unit_reaped_after_a_proc_pass_is_not_claimed_as_an_orphan() -> None:
    """A stop's scan reads /proc in a worker thread, then claims our unwaited children on
    the loop. A unit that died and was reaped in between is neither waited for nor an
    orphan; claimed, it was reported as killed by an unrelated unit's stop (CI, pgroup
    containment: "had to kill 2 process(es): other: 485, escaper: 488")."""
    out = _run("claim-after-pass")
    assert out["seen"] == [True, True]
    assert out["claimed"] == [out["stray"]]  # the live unwaited child, and only it
    assert out["orphans"] == [out["stray"]]  # the guardian's census sees the same


def test_a_unit_that_closes_its_output_and_runs_on_is_not_taken_for_dead(
    dm: Dynamod, stack_file: Any
) -> None:
    """The end of a unit's output pipe has the Reaper look for its exit at once (a dying
    process's files close just before it becomes waitable). A unit that closes stdout and
    stderr and goes on running ends its pipe too: it stays up, under the same pid, and its
    exit, when it comes, is recorded once, through its pidfd."""
    stack = stack_file("""
        [units.quiet]
        command = ["sh", "-c", "echo about to close; exec >/dev/null 2>&1; exec sleep 1000"]
        ready = { kind = "log", pattern = "about to close", deadline = 10 }
        [units.quiet.restart]
        first_delay = 0
    """)
    dm.run("up", str(stack), "--detach", check=True)
    first = dm.unit("quiet")
    time.sleep(1.0)  # long past the pipe's end and the spin that follows it
    still = dm.unit("quiet")
    assert (still["state"], still["pid"], still["restarts"]) == ("ready", first["pid"], 0)
    os.kill(first["pid"], signal.SIGKILL)
    second = dm.wait_ready_again("quiet", first["pid"], what="the restart after a kill")
    assert second["last_exit"] == "killed by SIGKILL" and second["restarts"] == 1
    exits = [
        r for line in dm.daemon_log().splitlines() if line.strip()
        if (r := json.loads(line))["event"] == "unit.state" and r["old"] == "ready"
    ]
    assert [(r["new"], r["detail"].split(";")[0]) for r in exits] == [
        ("backoff", "killed by SIGKILL")
    ]
