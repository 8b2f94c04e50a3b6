"""The death watch: what the main thread's /proc entries say (pure parsing), and, on real
short-lived child processes, that a SIGKILL is seen before the exit is, and that a thread
ending on its own is not taken for a death."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamod.core.deathwatch import DeathWatch, dying

STATUS = "Name:\tpython\nState:\tS (sleeping)\nSigPnd:\t{sig}\nShdPnd:\t{shd}\n"


def fake_proc(tmp_path: Path, state: str = "S", flags: int = 0x400040, sig: str = "0" * 16,
              shd: str = "0" * 16) -> Path:
    entry = tmp_path / "42"
    entry.mkdir(exist_ok=True)
    (entry / "stat").write_text(f"42 (py (x) y) {state} 1 42 42 0 -1 {flags} 0 0 0\n")
    (entry / "status").write_text(STATUS.format(sig=sig, shd=shd))
    return tmp_path


def test_dying_reads_the_main_threads_flags_pending_signals_and_state(tmp_path: Path) -> None:
    assert dying(42, fake_proc(tmp_path)) is None, "a live, sleeping process is not dying"
    assert dying(42, fake_proc(tmp_path, flags=0x400044)) == "exiting"
    assert dying(42, fake_proc(tmp_path, sig="0000000000000100")) == "SIGKILL pending"
    assert dying(42, fake_proc(tmp_path, shd="0000000000000100")) == "SIGKILL pending"
    assert dying(42, fake_proc(tmp_path, sig="0000000000004000")) is None, "SIGTERM: may be handled"
    assert dying(42, fake_proc(tmp_path, state="Z")) == "zombie"
    assert dying(43, tmp_path) == "gone"


CHILD = """
import sys, threading, time
ballast = bytearray(100 * 1024 * 1024)  # touched pages: the kernel's teardown takes a while
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
for _ in range(4):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
threading.Thread(target=time.sleep, args=(float(sys.argv[1]),), daemon=True).start()
print("up", flush=True)
time.sleep(60)
"""


def child(short_thread_s: float) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(short_thread_s)], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return proc


async def watch_then_kill(
    proc: subprocess.Popen[bytes], wait_before_kill: float
) -> dict[str, float]:
    seen: dict[str, float] = {}
    fired = asyncio.Event()

    def on_dying(why: str) -> None:
        seen["dying"] = time.monotonic()
        fired.set()

    watch = DeathWatch(proc.pid, on_dying)
    if not watch.start():
        pytest.skip("this kernel has no thread pidfds (PIDFD_THREAD, Linux 6.9)")
    exited = os.pidfd_open(proc.pid)
    try:
        await asyncio.sleep(wait_before_kill)
        seen["fired_before_kill"] = float(watch.fired)
        seen["kill"] = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        loop.add_reader(exited, lambda: done.done() or done.set_result(time.monotonic()))
        seen["exit"] = await asyncio.wait_for(done, 20)
        loop.remove_reader(exited)
        await asyncio.wait_for(fired.wait(), 5)
    finally:
        watch.close()
        os.close(exited)
        proc.wait()
    return seen


def test_a_killed_process_is_seen_dying_before_its_exit_is() -> None:
    seen = asyncio.run(watch_then_kill(child(60), 0.1))
    assert seen["kill"] <= seen["dying"] <= seen["exit"], seen


def test_a_thread_that_ends_on_its_own_is_not_a_death() -> None:
    seen = asyncio.run(watch_then_kill(child(0.1), 0.6))
    assert seen["fired_before_kill"] == 0.0, "a thread ending on its own was taken for a death"
    assert seen["kill"] <= seen["dying"] <= seen["exit"], "the watch stopped watching"
