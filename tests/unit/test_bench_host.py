"""bench.host's parsers of /proc and /sys text (the host's steal, DAMON's kernel thread, the
pages read back in), on fixed text and on a fake /proc tree; then once on this machine,
where the counters only grow."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from bench import fleet, host, procs

STAT = (
    "cpu  1000 200 300 5000 40 5 6 70 0 0\n"
    "cpu0 500 100 150 2500 20 2 3 35 0 0\n"
)


def seconds(ticks: int) -> float:
    return ticks / host.TICK


def test_the_cpu_line_splits_busy_steal_iowait_and_idle() -> None:
    got = host.cpu_line(STAT)
    assert got["busy_s"] == pytest.approx(seconds(1000 + 200 + 300 + 5 + 6))
    assert got["steal_s"] == pytest.approx(seconds(70))
    assert got["iowait_s"] == pytest.approx(seconds(40))
    assert got["idle_s"] == pytest.approx(seconds(5000))
    assert got["irq_s"] == pytest.approx(seconds(5 + 6))


def test_an_old_kernel_s_short_cpu_line_has_no_steal() -> None:
    assert host.cpu_line("cpu 10 0 10 100 0\n")["steal_s"] == 0


def test_text_that_is_not_proc_stat_is_refused() -> None:
    with pytest.raises(ValueError, match="not /proc/stat"):
        host.cpu_line("intr 1 2 3\n")


def test_vmstat_reads_named_counters_and_zero_for_a_missing_one() -> None:
    text = "nr_free_pages 10\npgmajfault 43544\npgpgin 26925961\n"
    assert host.vmstat(text, "pgmajfault", "pgpgin", "pswpin") == {
        "pgmajfault": 43544, "pgpgin": 26925961, "pswpin": 0,
    }  # fmt: skip


def test_a_thread_s_cpu_is_counted_after_a_command_holding_spaces_and_parens(
    tmp_path: Path,
) -> None:
    """kdamond's CPU is read by bench.procs.stat_cpu, the benchmarks' one stat parser."""
    fields = ["S", *["0"] * 10, "300", "45", *["0"] * 30]  # utime, stime: fields 14, 15
    (tmp_path / "stat").write_text("83 (kdamond.0 (x) y) " + " ".join(fields))
    assert procs.stat_cpu(str(tmp_path / "stat"))[1] == pytest.approx(seconds(345))


def fake_proc(root: Path, *, busy: int, steal: int, kdamond: int, majfault: int) -> None:
    proc, damon = root / "proc", root / "damon"
    (proc / "83").mkdir(parents=True, exist_ok=True)
    (proc / "stat").write_text(f"cpu  {busy} 0 0 900 7 0 0 {steal} 0 0\n")
    (proc / "vmstat").write_text(f"pgmajfault {majfault}\npgpgin {majfault * 4}\n")
    stat = ["S", *["0"] * 10, str(kdamond), "0", *["0"] * 30]
    (proc / "83" / "stat").write_text("83 (kdamond.0) " + " ".join(stat))
    (damon / "0").mkdir(parents=True, exist_ok=True)
    (damon / "0" / "pid").write_text("83\n")
    (damon / "nr_kdamonds").write_text("1\n")  # not a kdamond: no pid file, skipped


def test_counters_read_a_proc_tree_and_a_window_is_their_difference(tmp_path: Path) -> None:
    fake_proc(tmp_path, busy=100, steal=10, kdamond=5, majfault=3)
    before = host.counters(tmp_path / "proc", tmp_path / "damon")
    fake_proc(tmp_path, busy=400, steal=70, kdamond=25, majfault=13)
    after = host.counters(tmp_path / "proc", tmp_path / "damon")
    got = after.since(before)
    assert got["busy_s"] == pytest.approx(seconds(300))
    assert got["steal_s"] == pytest.approx(seconds(60))
    assert got["kdamond_s"] == pytest.approx(seconds(20))
    assert got["major_faults"] == 10
    assert got["paged_in_kb"] == 40
    assert got["iowait_s"] == 0


def test_no_damon_means_no_kdamond_cpu(tmp_path: Path) -> None:
    fake_proc(tmp_path, busy=1, steal=0, kdamond=9, majfault=0)
    assert host.kdamond_pids(tmp_path / "nowhere") == []
    assert host.counters(tmp_path / "proc", tmp_path / "nowhere").kdamond_s == 0


def test_this_machine_s_counters_only_grow() -> None:
    before = host.counters()
    spent = time.process_time() + 0.2
    while time.process_time() < spent:  # 0.2 s of CPU of our own: 20 ticks, not 1 or 0
        sum(i * i for i in range(10_000))
    got = host.window(before)
    assert got["busy_s"] >= 0 and got["steal_s"] >= 0 and got["major_faults"] >= 0
    assert got["busy_s"] + got["steal_s"] + got["iowait_s"] > 0
    assert got["busy_s"] >= 0.1, got  # our own 0.2 s, give or take the ticks' edges


def test_the_host_table_has_a_row_per_phase_and_skips_runs_without_it() -> None:
    window = {"busy_s": 50.0, "steal_s": 2.5, "iowait_s": 0.1, "kdamond_s": 0.4,
              "major_faults": 120, "paged_in_kb": 2048}  # fmt: skip
    runs = [
        {"nodes": 8, "shards": 256, "up_s": 200.0, "up_cpu": {"host": window},
         "push": {"stall_s": 30.0, "cpu": {"host": window}}},
        {"nodes": 1, "shards": 32, "up_s": 8.0, "push": {"stall_s": 2.0, "cpu": {}}},
    ]  # fmt: skip
    rows = fleet.host_table(runs).rows
    assert [r[:4] for r in rows] == [[8, 256, "start", 200.0], [8, 256, "push", 30.0]]
    assert rows[1][5] == 2.5 and rows[1][8] == 120 and math.isclose(rows[1][9], 2.0)
