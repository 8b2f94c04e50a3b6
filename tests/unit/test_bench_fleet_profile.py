"""bench.fleet_profile's cut of py-spy's raw samples: each busy sample under what the
daemon's event loop ran (the frame below its last Handle._run), a thread's outside the
loop, waiting samples left out; and its table."""

from __future__ import annotations

import pytest

from bench import fleet_profile
from bench.fleet_profile import by_task, short, task_of

LOOP = [
    "<module> (dynamod/__main__.py:3)",
    "BaseEventLoop.run_forever (asyncio/base_events.py:608)",
    "BaseEventLoop._run_once (asyncio/base_events.py:1922)",
    "Handle._run (asyncio/events.py:80)",
]
PROBE = "HttpProber.check (/work/main/dynamod/core/probes.py:110)"
PUBLISH = "Membership._publish (dynamod/cluster/membership.py:470)"


def line(frames: list[str], count: int) -> str:
    return ";".join(frames) + f" {count}"


def test_a_frame_is_shortened_to_its_function_and_package_path() -> None:
    assert short(PROBE) == "HttpProber.check (core/probes.py)"
    assert short("ClientSession.request (/x/site-packages/aiohttp/client.py:9)") == (
        "ClientSession.request (aiohttp/client.py)"
    )
    assert short("odd frame") == "odd frame"


def test_a_sample_is_counted_under_the_task_the_loop_ran() -> None:
    assert task_of([*LOOP, PROBE, "timed (dynamod/core/probes.py:60)"]) == (
        "HttpProber.check (core/probes.py)"
    )
    # a task that ran a nested loop callback is counted under the innermost one
    nested = [*LOOP, PUBLISH, "Handle._run (asyncio/events.py:80)", PROBE]
    assert task_of(nested) == "HttpProber.check (core/probes.py)"
    assert task_of(LOOP) == "the event loop itself"
    assert task_of(LOOP[:3]) == "the event loop itself"


def test_outside_the_loop_a_sample_is_its_thread_s() -> None:
    thread = ["Thread._bootstrap (threading.py:1002)", "Thread.run (threading.py:982)",
              "Responder._serve (dynamod/cluster/heartbeat.py:102)"]  # fmt: skip
    assert task_of(thread) == "thread: Responder._serve (cluster/heartbeat.py)"


def test_waiting_samples_are_left_out_and_the_rest_summed() -> None:
    raw = "\n".join([
        line([*LOOP[:3], "EpollSelector.select (selectors.py:468)"], 50),
        line([*LOOP, PROBE], 7),
        line([*LOOP, PROBE, "ClientSession.request (aiohttp/client.py:550)"], 3),
        line([*LOOP, PUBLISH], 4),
        line(["Thread.run (threading.py:982)", "Condition.wait (threading.py:320)"], 9),
        "",
        "not a sample line",
    ])  # fmt: skip
    busy, tasks = by_task(raw)
    assert busy == 14
    assert tasks == {"HttpProber.check (core/probes.py)": 10,
                     "Membership._publish (cluster/membership.py)": 4}  # fmt: skip


def test_the_table_gives_each_daemon_s_total_then_its_largest_tasks() -> None:
    profile = {"head": {"rate": 100, "samples": 40, "by_task": {"a": 30, "b": 6, "c": 4}}}
    fleets = [{"nodes": 8, "shards": 256, "push": {"profile": profile}},
              {"nodes": 1, "shards": 1, "push": {"profile": None}}]  # fmt: skip
    rows = fleet_profile.profile_table(fleets, top=2).rows
    assert [r[3] for r in rows] == ["all", "a", "b"]
    assert rows[0][4] == pytest.approx(400.0)  # 40 samples at 100 Hz: 400 ms
    assert rows[1][5] == pytest.approx(300.0 / 32)  # a shard of its node's 32
    assert rows[1][6] == pytest.approx(75.0)
