"""Where a short wait of the daemon went: its wall time, the CPU the daemon used meanwhile
(all its threads) and how long the calling thread (the event loop's) was ready to run
while the kernel ran something else (its `run_delay` in /proc/thread-self/schedstat). A
wait whose thread waited for a core was the machine's; one with the CPU near the wall ran
in the daemon; one that is long while both are small was spent outside the loop's thread
(the peer it called, or another thread or process waiting for a core). The wait for a core
is NaN where the kernel does not keep schedstat.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

SCHEDSTAT = "/proc/thread-self/schedstat"  # on-CPU ns, run-queue ns, timeslices


def run_delay_s() -> float:
    """Seconds the calling thread has spent ready to run but not running; NaN without
    schedstat."""
    try:
        with open(SCHEDSTAT) as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return math.nan


@dataclass(frozen=True)
class Spent:
    wall_ms: float
    cpu_ms: float  # the daemon's, all its threads
    waited_ms: float  # the calling thread's, ready but not on a core

    def as_dict(self, name: str) -> dict[str, float | None]:
        """`{name}_ms`, `{name}_cpu_ms`, `{name}_waited_ms` (None: not kept)."""
        return {
            f"{name}_ms": self.wall_ms,
            f"{name}_cpu_ms": self.cpu_ms,
            f"{name}_waited_ms": None if math.isnan(self.waited_ms) else self.waited_ms,
        }


class Stopwatch:
    """Started at creation, read with `spent()` on the same thread."""

    def __init__(self) -> None:
        self._wall, self._cpu, self._delay = time.monotonic(), time.process_time(), run_delay_s()

    def spent(self) -> Spent:
        wall, cpu, delay = time.monotonic(), time.process_time(), run_delay_s()
        return Spent(
            wall_ms=round((wall - self._wall) * 1000, 1),
            cpu_ms=round((cpu - self._cpu) * 1000, 1),
            waited_ms=round((delay - self._delay) * 1000, 1),
        )
