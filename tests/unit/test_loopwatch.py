"""The daemon's event-loop watcher, on a real loop: a blocking call is logged as a stall
with its length and the CPU spent in it (a busy loop's share is its part of the machine,
so under a parallel test run it is well below 1); a loop that keeps turning logs
nothing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from structlog.testing import capture_logs

from dynamod.core import loopwatch


def _run(block: float, busy: bool, stall: float = 0.2) -> tuple[list[dict[str, Any]], float]:
    """Blocks a watched loop once: busy, until the process has burnt `block` s of CPU (on
    a loaded machine that takes longer than `block` of wall time); idle, sleeping `block`
    s. Returns the stalls logged and how long the block lasted by the wall clock."""
    lasted = 0.0

    async def main() -> None:
        nonlocal lasted
        watcher = asyncio.get_running_loop().create_task(loopwatch.watch(0.02, stall))
        await asyncio.sleep(0.1)
        began = time.monotonic()
        if busy:
            end = time.process_time() + block
            while time.process_time() < end:  # the loop blocked, burning CPU
                pass
        else:
            time.sleep(block)  # the loop blocked, using no CPU
        lasted = time.monotonic() - began
        await asyncio.sleep(0.1)
        watcher.cancel()

    with capture_logs() as logs:
        asyncio.run(main())
    return [e for e in logs if e["event"] == "daemon.loop_stalled"], lasted


def _longest(stalls: list[dict[str, Any]]) -> dict[str, Any]:
    assert stalls, "a 0.4 s block must be logged"
    return max(stalls, key=lambda e: float(e["seconds"]))


def test_a_blocked_loop_is_logged_with_its_length_and_whether_it_was_busy() -> None:
    stalls, lasted = _run(0.4, busy=True)
    busy = _longest(stalls)
    # its length: the block's, less at most one tick (it began between two), plus however
    # late the machine woke the loop after it
    assert lasted - 0.05 <= busy["seconds"] <= lasted + 0.5, (busy, lasted)
    assert busy["cpu_s"] >= 0.35, busy
    assert 0 < busy["cpu_share"] <= 1, busy
    stalls, lasted = _run(0.4, busy=False)
    idle = _longest(stalls)
    assert lasted - 0.05 <= idle["seconds"] <= lasted + 0.5, (idle, lasted)
    assert idle["cpu_s"] < 0.05 and idle["cpu_share"] < 0.15, idle


def test_a_turning_loop_logs_no_stall() -> None:
    assert _run(0.05, busy=False, stall=0.5)[0] == []  # 0.5 s: the stock threshold
