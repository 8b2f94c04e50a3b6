"""bench.exit_watch, the benchmark's reference clock for exits: it must time a real exit
after its kill, and it must not invent one."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from bench.exit_watch import ExitClock


@pytest.fixture
def clock():
    c = ExitClock()
    yield c
    c.close()


def test_an_exit_is_timed_after_its_kill_and_before_the_parent_reaps_it(clock: ExitClock) -> None:
    child = subprocess.Popen(["sleep", "infinity"])
    try:
        assert clock.policy in ("fifo", "normal")
        assert clock.watch(child.pid)
        t_kill = time.time()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(5)
        reaped = time.time()
        t_exit = clock.exited(child.pid)
        assert t_kill < t_exit
        if clock.policy == "fifo":  # it runs ahead of us: it saw the exit before we reaped
            assert t_exit < reaped
        else:  # a normal-priority watcher may wake after we did, but not much later
            assert t_exit < reaped + 5
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_process_that_lives_on_gets_no_exit(clock: ExitClock) -> None:
    child = subprocess.Popen(["sleep", "infinity"])
    try:
        assert clock.watch(child.pid)
        with pytest.raises(RuntimeError, match="said nothing"):
            clock.exited(child.pid, timeout=0.3)
    finally:
        child.kill()
        child.wait()


def test_a_pid_already_gone_is_not_watched(clock: ExitClock) -> None:
    child = subprocess.Popen(["true"])
    child.wait(5)
    assert clock.watch(child.pid) is False
