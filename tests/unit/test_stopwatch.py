"""dynamod/core/stopwatch.py: a wait's wall time split into the daemon's CPU and its
thread's wait for a core."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from dynamod.core import stopwatch
from dynamod.core.stopwatch import Spent, Stopwatch, run_delay_s


def test_a_sleep_is_wall_time_with_little_cpu() -> None:
    watch = Stopwatch()
    time.sleep(0.05)
    spent = watch.spent()
    assert spent.wall_ms >= 50
    assert spent.cpu_ms < 0.5 * spent.wall_ms


def test_a_busy_loop_is_cpu_and_its_wait_no_longer_than_the_wall() -> None:
    watch, used = Stopwatch(), time.process_time()
    while time.process_time() - used < 0.03:  # 30 ms of CPU, however busy the machine
        pass
    spent = watch.spent()
    assert spent.cpu_ms >= 30
    assert spent.wall_ms >= spent.cpu_ms - 1  # one thread: no more CPU than wall time
    assert math.isnan(spent.waited_ms) or 0 <= spent.waited_ms <= spent.wall_ms + 1


def test_without_schedstat_the_wait_is_unknown(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:  # fmt: skip
    monkeypatch.setattr(stopwatch, "SCHEDSTAT", str(tmp_path / "absent"))
    assert math.isnan(run_delay_s())
    spent = Stopwatch().spent()
    assert math.isnan(spent.waited_ms)
    assert spent.as_dict("commit")["commit_waited_ms"] is None
    (tmp_path / "garbled").write_text("12\n")
    monkeypatch.setattr(stopwatch, "SCHEDSTAT", str(tmp_path / "garbled"))
    assert math.isnan(run_delay_s())


def test_its_dict_names_each_part_after_the_wait() -> None:
    assert Spent(12.5, 3.0, 7.25).as_dict("commit") == {
        "commit_ms": 12.5, "commit_cpu_ms": 3.0, "commit_waited_ms": 7.25,
    }  # fmt: skip
