"""bench.fleet_profile's cut of py-spy's raw samples: each busy sample under what the
process's event loop ran (a daemon's: the frame below its last Handle._run; a shard's, on
uvloop: the frame below the runner's, past the routes' wrappers), a thread's outside the
loop, waiting samples left out; and its table, a daemon's CPU also a shard of its node's,
a shard's its own."""

from __future__ import annotations

import math

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


UVLOOP = [
    "_run_module_as_main (<frozen runpy>:198)",
    "<module> (dynamod/workers/cpu/__main__.py:5)",
    "main (dynamod/workers/cpu/serve.py:230)",
    "run (uvloop/__init__.py:92)",
    "Runner.run (asyncio/runners.py:118)",
]
UPDATE = "CpuWorker.update_weights_from_disk (dynamod/workers/cpu/admission.py:340)"


def test_a_shard_s_sample_is_counted_under_the_route_below_its_wrappers() -> None:
    """uvloop runs a task's step from C: the task is the frame below the runner's, and a
    route's handler is the frame below `catching`'s and `serialised`'s wrappers."""
    wrapped = [*UVLOOP, "catching.<locals>.answer (dynamod/workers/cpu/routes.py:35)",
               "CpuWorker.serialised.<locals>.locked (dynamod/workers/cpu/admission.py:240)",
               UPDATE,
               "load_checkpoint (dynamod/workers/weights.py:112)"]  # fmt: skip
    assert task_of(wrapped) == "CpuWorker.update_weights_from_disk (workers/cpu/admission.py)"
    assert task_of([*UVLOOP, "serve (dynamod/workers/cpu/serve.py:90)"]) == (
        "serve (workers/cpu/serve.py)"
    )
    # a wrapper with nothing below it yet is its own task; the loop's C work is the loop's
    assert task_of([*UVLOOP, "catching.<locals>.answer (dynamod/workers/cpu/routes.py:35)"]) == (
        "catching.<locals>.answer (workers/cpu/routes.py)"
    )
    assert task_of(UVLOOP) == "the event loop itself"


def test_a_target_is_named_as_a_daemon_or_a_node_s_shard() -> None:
    assert fleet_profile.what("n1") == "n1's daemon"
    assert fleet_profile.what("n1/worker@31") == "n1's shard worker@31"


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


def test_the_table_gives_each_daemon_s_share_of_its_cpu_by_task() -> None:
    """The samples give each task's share; the CPU is the daemon's own from /proc (a
    sample on a machine busier than its cores may be a thread ready to run, not running)."""
    profile = {"head": {"rate": 100, "samples": 40, "cpu_s": 2.0, "py_spy_cpu_s": 0.25,
                        "by_task": {"a": 30, "b": 6, "c": 4}}}  # fmt: skip
    fleets = [{"nodes": 8, "shards": 256, "push": {"profile": profile}},
              {"nodes": 1, "shards": 1, "push": {"profile": None}}]  # fmt: skip
    rows = fleet_profile.profile_table(fleets, top=2).rows
    assert [r[3] for r in rows] == ["all", "a", "b"]
    assert rows[0][4:7] == [40, 100.0, 2000.0]  # all of its 2 s
    assert rows[0][8] == 250.0 and rows[1][8] == "-"  # what sampling it cost, once
    assert rows[1][5] == pytest.approx(75.0) and rows[1][6] == pytest.approx(1500.0)
    assert rows[1][7] == pytest.approx(1500.0 / 32)  # a shard of its node's 32
    # a shard's CPU is its own, not a share of its node's
    profile["head/worker@0"] = {"rate": 100, "samples": 10, "cpu_s": 0.5, "by_task": {"u": 10}}
    rows = fleet_profile.profile_table(fleets, top=1).rows
    assert [r[2] for r in rows] == ["head's daemon"] * 2 + ["head's shard worker@0"] * 2
    assert rows[3][6] == pytest.approx(500.0) and rows[3][7] == pytest.approx(500.0)
    del profile["head/worker@0"]
    profile["head"]["cpu_s"] = None  # its pid's CPU was not read: no CPU, the share stays
    rows = fleet_profile.profile_table(fleets, top=1).rows
    assert rows[1][5] == pytest.approx(75.0) and math.isnan(rows[1][6])


def test_a_partial_stack_counts_under_its_outermost_frame() -> None:
    """py-spy reads without pausing: a stack caught mid-change may start mid-task."""
    assert task_of([PROBE, "timed (dynamod/core/probes.py:60)"]) == (
        "HttpProber.check (core/probes.py)"
    )


def test_the_executor_s_work_is_counted_under_the_function_handed_to_it() -> None:
    frames = ["Thread._bootstrap (threading.py:1002)", "Thread.run (threading.py:982)",
              "_worker (concurrent/futures/thread.py:83)",
              "_WorkItem.run (concurrent/futures/thread.py:58)",
              "_scan (dynamod/cluster/exposure.py:440)",
              "Path.read_text (pathlib.py:1059)"]  # fmt: skip
    assert task_of(frames) == "executor: _scan (cluster/exposure.py)"
    native = ["Thread._bootstrap (threading.py:1002)", "Thread.run (threading.py:982)"]
    assert task_of(native) == "thread: a native target (Thread.run)"


def test_the_main_thread_outside_a_callback_is_the_loop_s_own_or_its_leaf() -> None:
    assert task_of([*LOOP[:3], "_BaseSelectorImpl._key_from_fd (selectors.py:2)"]) == (
        "the event loop itself"
    )
    starting = ["<module> (dynamod/__main__.py:3)", "main (dynamod/control/cli.py:9)"]
    assert task_of(starting) == "main thread: main (control/cli.py)"
