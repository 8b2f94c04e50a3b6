"""bench.fleet_profile against a real py-spy: a live asyncio process sampled, its busy
samples counted under the task its loop ran and what py-spy cost read back; a daemon that
is not there refused in one line naming py-spy's own words, with no py-spy left running."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import fleet_profile, procs

BUSY = """
import asyncio, time

async def spin():
    end = time.monotonic() + 8
    while time.monotonic() < end:
        sum(i * i for i in range(20000))
        await asyncio.sleep(0)

asyncio.run(spin())
"""


def py_spies_of_ours() -> list[int]:
    """py-spy processes this test process started and that still run (zombies reaped)."""
    found = []
    for pid in procs.descendants(os.getpid()):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "py-spy" and procs.alive(pid):
                found.append(pid)
    return found


@pytest.fixture
def busy_loop() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    time.sleep(0.5)  # its loop running
    yield proc
    proc.kill()
    proc.wait(10)


def test_a_live_loop_s_samples_are_counted_under_its_task(
    busy_loop: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    if (why := fleet_profile.missing()) is not None:
        pytest.fail(why)  # `make install` brings py-spy: its absence is a broken install
    profilers = fleet_profile.start({"head": busy_loop.pid}, tmp_path, "1x1")
    time.sleep(1.5)
    found = fleet_profile.stop(profilers)["head"]
    assert found["samples"] > 20, found  # ~2.5 s of a busy loop at 100 a second
    top = max(found["by_task"], key=found["by_task"].get)
    assert top == "spin (<string>)", found["by_task"]
    assert found["py_spy_cpu_s"] >= 0 and Path(found["file"]).stat().st_size > 0
    assert all(p.proc.poll() is not None for p in profilers) and py_spies_of_ours() == []


def test_a_process_that_is_not_there_is_refused_and_no_py_spy_is_left(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)  # a pid that was ours and is no more
    live = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        with pytest.raises(fleet_profile.ProfileError, match=r"py-spy on n1's shard worker@3 "
                           r"\(pid \d+\) exited: see .*2x1-n1-worker-3\.log"):  # fmt: skip
            fleet_profile.start({"head": live.pid, "n1/worker@3": gone.pid}, tmp_path, "2x1")
        # the head's py-spy, which had attached, was stopped with the refusal
        assert py_spies_of_ours() == []
        said = (tmp_path / "2x1-n1-worker-3.log").read_text()
        assert said.strip(), "py-spy's own words are kept"
    finally:
        live.kill()
        live.wait(10)
