"""bench/fleet_cpu.py and fleet_threads.Waits: an early stall's CPU put to the fleet's parts, on
fixed /proc text; the reads, the window and the threads' waits on this machine's own
processes and threads."""

from __future__ import annotations

import math
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from bench import fleet_cpu
from bench.fleet_cpu import BENCH, DAEMONS, FIRST, HEAD_DAEMON, HEAD_SHARDS, SHARDS
from bench.fleet_threads import Waits, schedstat
from bench.procs import TICK

# pid -> (comm, ppid, CPU seconds): before and after a window
BEFORE = {
    2: ("kthreadd", 0, 0.0),
    40: ("kworker/1:2", 2, 1.00),
    100: ("python", 1, 5.00),  # the bench
    200: ("python3", 100, 3.00),  # the head's daemon
    201: ("python3", 200, 7.00),  # its shard worker@0: the first to ack
    202: ("python3", 200, 7.00),  # its shard worker@1
    203: ("sh", 202, 0.10),  # a child of worker@1
    300: ("python3", 100, 3.00),  # the other node's daemon
    301: ("python3", 300, 7.00),  # its shard worker@0
    302: ("etcd", 300, 9.00),
    400: ("sleep", 1, 0.50),  # of no unit
}
PARTS = {100: BENCH, 200: HEAD_DAEMON, 201: "worker@0", 202: "worker@1",
         300: DAEMONS, 301: SHARDS, 302: "other nodes' etcd"}  # fmt: skip


def later(**used: float) -> dict[int, tuple[str, int, float]]:
    """BEFORE with `p<pid>=seconds` added to those pids' CPU."""
    after = dict(BEFORE)
    for key, seconds in used.items():
        comm, ppid, cpu = after[int(key[1:])]
        after[int(key[1:])] = (comm, ppid, cpu + seconds)
    return after


def test_each_process_s_cpu_goes_to_its_part_the_first_shard_apart() -> None:
    after = later(p201=0.05, p202=0.02, p301=0.03, p200=0.01, p300=0.02, p100=0.04, p302=0.06)
    got = fleet_cpu.spent(BEFORE, after, PARTS, "worker@0")
    assert got == pytest.approx({FIRST: 0.05, HEAD_SHARDS: 0.02, SHARDS: 0.03, HEAD_DAEMON: 0.01,
                                 DAEMONS: 0.02, BENCH: 0.04, "other nodes' etcd": 0.06})
    # another of the head's shards first
    assert fleet_cpu.spent(BEFORE, later(p201=0.05, p202=0.02), PARTS, "worker@1") == (
        pytest.approx({HEAD_SHARDS: 0.05, FIRST: 0.02})
    )


def test_a_unit_s_child_counts_to_it_and_the_rest_goes_by_its_name() -> None:
    after = later(p203=0.02, p40=0.03, p400=0.01)
    after[500] = ("kworker/0:1", 2, 0.04)  # born in the window: counted from 0
    after[501] = ("ssh", 203, 0.01)  # a grandchild of worker@1
    after[502] = ("curl", 200, 0.02)  # the head's daemon's probe, born in the window
    del after[200]  # the daemon ended in the window: its probe is still its
    after[503] = ("git", 999, 0.05)  # its parent is gone and was no unit: by its own name
    got = fleet_cpu.spent(BEFORE, after, PARTS, "worker@0")
    assert got == pytest.approx(
        {HEAD_SHARDS: 0.03, HEAD_DAEMON: 0.02, "kworker/:": 0.07, "sleep": 0.01, "git": 0.05}
    )


def test_nothing_used_is_an_empty_split_and_a_parent_loop_ends() -> None:
    assert fleet_cpu.spent(BEFORE, BEFORE, PARTS, None) == {}
    loop = {7: ("a", 8, 1.0), 8: ("b", 7, 1.0)}
    assert fleet_cpu.spent({}, loop, {}, None) == {"a": 1.0, "b": 1.0}


def test_a_stat_line_is_read_through_a_command_name_with_spaces_and_parentheses(
    tmp_path: Path,
) -> None:
    fields = ["S", "77"] + ["0"] * 9 + [str(3 * TICK), str(TICK)] + ["0"] * 40
    (tmp_path / "123").mkdir()
    (tmp_path / "123" / "stat").write_text(f"123 (we (ir) d) {' '.join(fields)}\n")
    (tmp_path / "self").mkdir()  # not a pid: left out
    (tmp_path / "124").mkdir()  # gone between the listing and the read: left out
    with fleet_cpu.Scan(tmp_path) as scan:
        assert scan.read() == {123: ("we (ir) d", 77, 4.0)}


def test_a_scan_reads_its_files_again_in_place_and_drops_a_process_that_ended() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        with fleet_cpu.Scan() as scan:
            first = scan.read()
            assert first[child.pid][:2] == ("sleep", os.getpid())
            busy(0.05)  # this process's CPU moves between two reads (in 10 ms ticks)
            assert scan.read()[os.getpid()][2] - first[os.getpid()][2] >= 0.04 - 1e-9
            child.kill()
            child.wait()
            assert child.pid not in scan.read() and child.pid not in scan.files.fds
            opened = len(scan.files.fds)
        assert opened > 0 and not scan.files.fds  # closed on the way out
    finally:
        child.kill()
        child.wait()


def test_this_machine_s_processes_include_this_one() -> None:
    with fleet_cpu.Scan() as scan:
        comm, ppid, cpu = scan.read()[os.getpid()]
    assert comm == Path("/proc/self/comm").read_text().strip()
    assert ppid == os.getppid() and cpu > 0


def test_the_split_table_has_a_row_per_early_push_and_the_rest_largest_first() -> None:
    parts = {FIRST: 0.02, SHARDS: 0.1, DAEMONS: 0.04, "etcd": 0.01, "frontend": 0.03,
             BENCH: 0.005}  # fmt: skip
    split = {"window_s": 0.16, "busy_s": 0.2, "parts": parts}  # read before irq_s and reads_ms
    fleet = {"nodes": 8, "shards": 256,
             "early": {"step": 2, "stall_s": 0.15, "cpu_split": split},
             "early_again": [{"step": 3, "stall_s": 0.1}]}  # fmt: skip
    table = fleet_cpu.split_table([fleet], lambda f: [f["early"], *f["early_again"]])
    assert table.rows == [  # the push without a split (an older result) has no row
        [8, 256, 2, 150.0, "160 (-)", "200 (-)", 20.0, 0.0, 0.0, 100.0, 40.0, 5.0,
         "frontend 30, etcd 10", "-", "-"]
    ]


def test_a_split_s_window_holds_what_it_brackets_and_the_machine_s_busy_time() -> None:
    split = fleet_cpu.Split({os.getpid(): HEAD_DAEMON})  # this process as the head's daemon
    split.start()
    began = time.monotonic()
    busy(0.05)
    spun = time.monotonic() - began
    split.stop()
    got = split.result(None)
    assert got["window_s"] >= spun and not split.scan.files.fds and not split.waits.files.fds
    assert len(got["reads_ms"]) == 2 and sum(got["reads_ms"]) <= got["window_s"] * 1000 - spun
    assert 0 <= got["irq_s"] <= got["busy_s"]
    assert got["parts"][HEAD_DAEMON] >= 0.04 - 1e-9 and got["busy_s"] >= 0.04 - 1e-9
    # its threads' own count, in ns: at least the CPU spun, and no first shard to show
    assert set(got["waits"]) == {HEAD_DAEMON}
    assert got["waits"][HEAD_DAEMON]["ran_ms"] >= 50 - 1e-6, got["waits"]


def test_a_process_s_threads_run_and_wait_for_a_core_and_an_ended_one_is_counted() -> None:
    stop, spun, done = threading.Event(), threading.Event(), threading.Event()
    short = threading.Thread(target=stop.wait)
    fresh = threading.Thread(target=lambda: (busy(0.03), spun.set(), done.wait()))
    short.start()
    waits = Waits([os.getpid()])
    try:
        stop.set()
        short.join()  # ended in the window: its time is lost, its end counted
        fresh.start()  # born in the window, alive at its end: counted from 0
        spun.wait()
        got = waits.since()[os.getpid()]
    finally:
        waits.close()
        stop.set()
        done.set()
        if fresh.is_alive():
            fresh.join()
    assert got["ran_ms"] >= 30 - 1e-6 and got["waited_ms"] >= 0, got
    assert got["threads_ended"] == 1, got


def test_a_schedstat_line_is_run_then_waited_ns() -> None:
    assert schedstat(b"123456789 2000000 17\n") == (123456789, 2000000)


def test_the_waits_cell_shows_run_and_wait_and_the_threads_that_ended() -> None:
    cut = {"waits": {FIRST: {"ran_ms": 20.04, "waited_ms": 31.26, "threads_ended": 2}}}
    assert fleet_cpu.waited(cut, FIRST, ended=True) == "20.0 / 31.3 (2)"
    assert fleet_cpu.waited(cut, HEAD_DAEMON) == "-"


def busy(cpu_s: float) -> None:
    """Spin until this process has used `cpu_s` more CPU."""
    until = time.process_time() + cpu_s
    while time.process_time() < until:
        pass


def test_a_whole_with_its_part_and_a_part_not_read() -> None:
    assert fleet_cpu.with_part(160.4, 12.6) == "160 (13)"
    assert fleet_cpu.with_part(160.4, math.nan) == "160 (-)"


def test_the_reads_go_ahead_of_the_fleet_and_back(tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-7 nice 3\n")
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with fleet_cpu.ahead(-10, group):
        assert group.read_text() == "-10"
        inside = os.getpriority(os.PRIO_PROCESS, 0)
    assert group.read_text() == "3" and os.getpriority(os.PRIO_PROCESS, 0) == before
    assert inside == (-10 if os.geteuid() == 0 else before)  # only root may raise it


def test_without_an_autogroup_the_reads_run_as_they_are(tmp_path: Path) -> None:
    with fleet_cpu.ahead(-10, tmp_path / "none"):
        pass
    assert not (tmp_path / "none").exists()
