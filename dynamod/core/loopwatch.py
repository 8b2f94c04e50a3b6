"""The daemon's own event loop, watched: every timer, probe and etcd keepalive runs on it, so
a stall is what turns a 2 s registry lease into a node marked lost or a probe into a false
miss. A stall of at least `STALL_S` is logged (`daemon.loop_stalled`) with its length, the
CPU the daemon used meanwhile and that CPU's share of the stall: near 1, something ran in
the loop without yielding; near 0, the machine gave the daemon no CPU (or paused it); in
between, both (a busy loop on a saturated machine).
"""

from __future__ import annotations

import asyncio
import time

import structlog

log = structlog.get_logger("dynamod.core.loopwatch")

TICK_S = 0.1
STALL_S = 0.5


async def watch(tick_s: float = TICK_S, stall_s: float = STALL_S) -> None:
    """Runs until cancelled; logs each tick that came `stall_s` or more late."""
    last, used = time.monotonic(), time.process_time()
    while True:
        await asyncio.sleep(tick_s)
        now, spent = time.monotonic(), time.process_time()
        late = now - last - tick_s
        if late >= stall_s:
            log.warning(
                "daemon.loop_stalled",
                seconds=round(late, 3),
                cpu_s=round(spent - used, 3),
                cpu_share=round(min(1.0, (spent - used) / (now - last)), 2),
            )
        last, used = now, spent
