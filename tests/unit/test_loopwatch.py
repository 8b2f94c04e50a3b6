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


def _run(block: float, busy: bool, stall: float = 0.2) -> list[dict[str, Any]]:
    async def main() -> None:
        watcher = asyncio.get_running_loop().create_task(loopwatch.watch(0.02, stall))
        await asyncio.sleep(0.1)
        if busy:
            end = time.monotonic() + block
            while time.monotonic() < end:  # the loop blocked, burning CPU
                pass
        else:
            time.sleep(block)  # the loop blocked, using no CPU
        await asyncio.sleep(0.1)
        watcher.cancel()

    with capture_logs() as logs:
        asyncio.run(main())
    return [e for e in logs if e["event"] == "daemon.loop_stalled"]


def _longest(stalls: list[dict[str, Any]]) -> dict[str, Any]:
    assert stalls, "a 0.4 s block must be logged"
    return max(stalls, key=lambda e: float(e["seconds"]))


def test_a_blocked_loop_is_logged_with_its_length_and_whether_it_was_busy() -> None:
    busy = _longest(_run(0.4, busy=True))
    assert 0.3 <= busy["seconds"] < 1.0 and busy["cpu_s"] >= 0.05, busy
    assert 0 < busy["cpu_share"] <= 1, busy
    idle = _longest(_run(0.4, busy=False))
    assert idle["cpu_s"] < 0.05 and idle["cpu_share"] < 0.15, idle


def test_a_turning_loop_logs_no_stall() -> None:
    assert _run(0.05, busy=True, stall=0.5) == []  # 0.5 s: the stock threshold
