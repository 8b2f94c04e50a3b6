"""`up`'s progress: a waiting unit is reported every 2 s while waits are short, and every
15 s once one has waited a minute (a real engine loads for minutes)."""

from __future__ import annotations

import itertools
from typing import Any

from dynamod.control.render import Progress


def snapshot(since_s: float) -> dict[str, Any]:
    unit = {"name": "worker@0", "state": "starting", "pid": 7, "since_s": since_s,
            "detail": "GET /health: 503"}  # fmt: skip
    return {"units": [unit]}


def summaries(progress: Progress, start: float, stop: float) -> list[float]:
    seen, now = [], start
    while now < stop:
        if any(line.startswith("  … ") for line in progress.update(snapshot(now), now)):
            seen.append(now)
        now += 0.25
    return seen


def test_long_waits_are_reported_less_often() -> None:
    progress = Progress()
    short = summaries(progress, 0.0, 20.0)
    assert len(short) == 10 and short[1] - short[0] == 2.0
    long = summaries(progress, 120.0, 180.0)
    assert len(long) == 4 and all(b - a == 15.0 for a, b in itertools.pairwise(long))
