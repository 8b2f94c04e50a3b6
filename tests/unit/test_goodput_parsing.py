"""bench.aiperf_run's pure parts: reading AIPerf's exports (per-request records, the
summary) and the seconds until goodput is back to 95 %. Record lines have the shape
aiperf 0.13.0 writes to profile_export.jsonl (--export-level records)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import aiperf_run
from bench.aiperf_run import AiperfError, Record, read_records, read_summary, recovery_s

T0 = 1_796_291_191.0


def line(start: float, end: float, *, good: bool = True, error: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {
        "metadata": {
            "session_num": 1,
            "x_request_id": "r",
            "request_start_ns": int((T0 + start) * 1e9),
            "request_end_ns": int((T0 + end) * 1e9),
            "benchmark_phase": "profiling",
            "was_cancelled": False,
        },
        "metrics": {
            "time_to_first_token": {"value": 155.2, "unit": "ms"},
            "inter_token_latency": {"value": 2.7, "unit": "ms"},
            "good_request_count": {"value": 1 if good else 0, "unit": "requests"},
        },
    }
    if error:
        out["metrics"] = {}
        out["error"] = {"code": 500, "type": "ServerError", "message": error}
    return out


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_records_are_read_with_errors_and_goodness(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "profile_export.jsonl",
        [line(2, 3, good=False), line(0, 1), line(1, 1.5, error="worker died")],
    )
    records = read_records(path)
    assert [r.start - T0 for r in records] == pytest.approx([0, 1, 2])
    first, failed, slow = records
    assert first.ok and first.good and first.ttft_ms == 155.2 and first.itl_ms == 2.7
    assert not failed.ok and not failed.good
    assert failed.error == "ServerError: worker died"
    assert math.isnan(failed.ttft_ms)
    assert slow.ok and not slow.good
    assert slow.end - T0 == pytest.approx(3)


def test_a_line_that_is_not_a_record_names_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "profile_export.jsonl", [line(0, 1), {"metrics": {}}])
    with pytest.raises(AiperfError, match=r"profile_export.jsonl:2: not an aiperf record"):
        read_records(path)
    with pytest.raises(AiperfError, match="wrote no per-request records"):
        read_records(tmp_path / "missing.jsonl")


def test_summary_figures_and_error_count(tmp_path: Path) -> None:
    path = tmp_path / "profile_export_aiperf.json"
    path.write_text(
        json.dumps(
            {
                "aiperf_version": "0.13.0",
                "time_to_first_token": {"unit": "ms", "p50": 143.1, "p99": 440.0},
                "inter_token_latency": {"unit": "ms", "p50": 0.8, "p99": 10.3},
                "goodput": {"unit": "requests/sec", "avg": 13.1},
                "request_count": {"unit": "requests", "avg": 110},
                "error_summary": [
                    {"error_details": {"message": "a"}, "count": 3},
                    {"error_details": {"message": "b"}, "count": 2},
                ],
            }
        )
    )
    got = read_summary(path)
    assert got["ttft_p50_ms"] == 143.1 and got["ttft_p99_ms"] == 440.0
    assert got["itl_p99_ms"] == 10.3 and got["goodput_rps"] == 13.1
    assert got["requests"] == 110 and got["aiperf_errors"] == 5
    assert math.isnan(got["throughput_rps"])  # not in this summary: NaN, not 0


def test_a_summary_that_is_not_aiperfs_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "profile_export_aiperf.json"
    path.write_text(json.dumps({"goodput": {"avg": 1}}))
    with pytest.raises(AiperfError, match="not an aiperf summary"):
        read_summary(path)
    path.write_text("{not json")
    with pytest.raises(AiperfError, match="no aiperf summary"):
        read_summary(path)


def steady(seconds: float, per_s: int, *, gap: tuple[float, float] | None = None) -> list[Record]:
    """`per_s` good requests ending each second, none ending inside `gap`."""
    out = []
    for i in range(int(seconds * per_s)):
        end = T0 + (i + 0.5) / per_s
        if gap and gap[0] <= end - T0 < gap[1]:
            continue
        out.append(Record(end - 0.1, end, "", True, 100.0, 3.0))
    return out


def test_no_dip_is_zero_seconds() -> None:
    records = steady(30, 10)
    assert recovery_s(records, T0 + 8, T0 + 30, 10.0) == 0.0


def test_recovery_is_measured_from_the_fault_to_the_first_window_back() -> None:
    # nothing good ends from 8 s to 12 s: the 3 s windows starting from 12 s are full again
    records = steady(30, 10, gap=(8, 12))
    assert recovery_s(records, T0 + 8, T0 + 30, 10.0) == pytest.approx(4.0)
    # a window just short of 95 % of the baseline is not back
    assert recovery_s(records, T0 + 8, T0 + 30, 10.0, share=1.0) == pytest.approx(4.0)
    assert recovery_s(records, T0 + 8, T0 + 30, 11.0) is None


def test_goodput_that_never_comes_back_is_never() -> None:
    """The check must fail: a stack left dead (no supervisor) gives None, not a number."""
    records = steady(30, 10, gap=(8, 30))
    assert recovery_s(records, T0 + 8, T0 + 30, 10.0) is None
    # slow requests are not good: completions without goodput do not count as back
    slow = [Record(r.start, r.end, "", r.end - T0 < 8, 5000.0, 3.0) for r in steady(30, 10)]
    assert recovery_s(slow, T0 + 8, T0 + 30, 10.0) is None
    # failed requests are not good either
    failed = [Record(r.start, r.end, "x" if r.end - T0 >= 8 else "", r.end - T0 < 8, 1, 1)
              for r in steady(30, 10)]  # fmt: skip
    assert recovery_s(failed, T0 + 8, T0 + 30, 10.0) is None


def test_recovery_needs_a_positive_baseline() -> None:
    with pytest.raises(ValueError, match="baseline goodput must be positive"):
        recovery_s(steady(10, 5), T0 + 2, T0 + 10, 0.0)
    assert recovery_s(steady(10, 5), T0 + 9, T0 + 10, 5.0) is None  # no window fits


def test_good_rate_counts_good_requests_by_end_time() -> None:
    records = steady(10, 4)
    assert aiperf_run.good_rate(records, T0, T0 + 10) == pytest.approx(4.0)
    assert aiperf_run.good_rate(records, T0 + 5, T0 + 5) != aiperf_run.good_rate(
        records, T0 + 5, T0 + 5
    )  # NaN: an empty window has no rate


def test_the_command_is_offline_and_exports_records(tmp_path: Path) -> None:
    load = aiperf_run.Load("http://127.0.0.1:1", "tiny-cpu", 16, 30.0)
    cmd = aiperf_run.command(load, tmp_path)
    flags = dict(zip(cmd, [*cmd[1:], ""], strict=True))
    assert flags["--concurrency"] == "16" and flags["--endpoint-type"] == "chat"
    assert "--streaming" in cmd and flags["--export-level"] == "records"
    assert flags["--tokenizer"] == aiperf_run.TOKENIZER
    assert flags["--goodput"] == "time_to_first_token:1000 inter_token_latency:50"
    env = aiperf_run.environment(tmp_path)
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == str(tmp_path)
    assert "PYTHONDONTWRITEBYTECODE" not in env


def test_hf_cache_lays_out_the_tokenizer(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    cache = aiperf_run.hf_cache(model, tmp_path / "hub")
    repo = cache / "models--dynamod--tiny-cpu"
    assert (repo / "refs" / "main").read_text() == "local"
    assert (repo / "snapshots" / "local" / "tokenizer.json").resolve() == model / "tokenizer.json"
    assert not (repo / "snapshots" / "local" / "model.safetensors").exists()
    aiperf_run.hf_cache(model, tmp_path / "hub")  # again: idempotent


def test_without_aiperf_the_benchmark_refuses_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from bench import goodput

    monkeypatch.setattr(aiperf_run, "AIPERF", aiperf_run.VENV / "no" / "aiperf")
    monkeypatch.setattr(sys, "argv", ["bench/goodput.py", "--quick"])
    with pytest.raises(SystemExit) as exited:
        goodput.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("python -m bench.goodput: .venv-aiperf/no/aiperf not found: ")
    assert "run `make install-aiperf` first" in err


def test_the_full_profile_narrows_by_flag() -> None:
    from types import SimpleNamespace

    from bench import goodput

    assert goodput._levels("4,16") == [4, 16]
    assert goodput._names("none,dynamod") == ["no supervisor", "dynamod"]
    for bad in ("0", "x"):
        with pytest.raises(ValueError):
            goodput._levels(bad)
    with pytest.raises(ValueError):
        goodput._names("dynamod,systemd")
    assert goodput._faults("none") == []  # the fault-free runs alone
    assert goodput._faults("push,etcd_kill") == ["push", "etcd_kill"]
    for bad in ("push,reboot", ""):
        with pytest.raises(ValueError):
            goodput._faults(bad)
    assert goodput._rounds("3") == 3
    for bad in ("0", "21", "x"):
        with pytest.raises(ValueError):
            goodput._rounds(bad)
    args = SimpleNamespace(quick=False, concurrency=[16], supervisors=["no supervisor"],
                           faults=list(goodput.FAULTS))  # fmt: skip
    runs, levels, faults = goodput.plan(args)
    assert runs == [goodput.PlainRun] and levels == (16,) and faults == list(goodput.FAULTS)
    args.faults = []
    assert goodput.plan(args)[2] == []
    quick = goodput.plan(SimpleNamespace(quick=True, concurrency=[16], supervisors=[]))
    assert quick == ([goodput.DynamodRun], (4,), ["worker_kill"])


def test_each_supervisor_is_compared_with_no_supervisor_in_the_same_round() -> None:
    """--rounds: a supervisor's goodput over no supervisor's of its own round, the median
    over the rounds (a machine that slows down between rounds slows both alike)."""
    from bench import goodput

    def run(who: str, turn: int, goodput_rps: float) -> dict[str, Any]:
        return {"supervisor": who, "concurrency": 16, "round": turn, "fault": "none",
                "goodput_rps": goodput_rps, "ttft_p50_ms": 50.0, "itl_p50_ms": 4.0}  # fmt: skip

    base = [
        run("dynamod", 1, 60.0), run("no supervisor", 1, 66.0),
        run("dynamod", 2, 30.0), run("no supervisor", 2, 30.0),  # the machine slowed
        run("dynamod", 3, 45.0), run("no supervisor", 3, 50.0),
    ]  # fmt: skip
    rows = {r[0]: r for r in goodput.rounds_table(base).rows}
    assert rows["dynamod"][2] == "60.0 / 30.0 / 45.0"
    assert rows["dynamod"][3] == 45.0  # the median goodput
    assert rows["dynamod"][4] == pytest.approx(60 / 66)  # the median of 60/66, 1.0, 0.9
    assert rows["no supervisor"][4] == 1.0


def test_failures_split_around_the_fault() -> None:
    """A failure that ended before the fault is not the fault's; one in flight across it
    is; how long failing lasted counts from the fault."""
    from types import SimpleNamespace

    from bench import goodput

    records = [
        Record(T0 + 0.0, T0 + 0.5, "500: early", False, 1, 1),  # before the fault
        Record(T0 + 7.0, T0 + 8.2, "payload cut", False, 1, 1),  # in flight at 8 s
        Record(T0 + 9.0, T0 + 9.4, "refused", False, 1, 1),  # sent after
        Record(T0 + 1.0, T0 + 2.0, "", True, 1, 1),
    ]
    injector = SimpleNamespace(at=T0 + 8.0, error="", pushes=[], push_failures=[])
    load = aiperf_run.Load("http://x", "m", 4, 30.0)
    got = goodput.measured("dynamod", load, sorted(records, key=lambda r: r.start), {}, injector)
    assert got["failed"] == 3 and got["failed_before"] == 1 and got["failed_in_flight"] == 1
    assert got["failing_until_s"] == pytest.approx(1.4)
    assert got["fault_at_s"] == pytest.approx(8.0)


def test_the_pictures_windows_are_the_ones_recovery_judges() -> None:
    """The goodput series drawn is recovery_s's windows: a gap in good requests from 8 to
    12 s shows as windows below the line until the one that starts at 12 s."""
    from bench import goodput

    records = steady(30, 10, gap=(8, 12))
    result = {"start": T0, "run_end": T0 + 30}
    got = goodput.windows(records, result, quick=False)
    rps, step = got["rps"], got["step_s"]
    assert got["window_s"] == 3.0 and step == 0.5 and len(rps) == int((30 - 3) / 0.5) + 1
    assert rps[0] == pytest.approx(10.0) and rps[int(8 / step)] == 0.0
    first_back = next(i for i in range(int(8 / step), len(rps)) if rps[i] >= 9.5)
    assert first_back * step - 8 == recovery_s(records, T0 + 8, T0 + 30, 10.0) == 4.0


def test_a_picture_is_drawn_per_fault_with_a_panel_per_concurrency(tmp_path: Path) -> None:
    """Runs without their windows (an older JSON) are left out; a fault with none left is
    not drawn; the redraw from a --json output refuses one with no windows at all."""
    import subprocess
    import sys

    from bench import goodput, goodput_plot

    def run(who: str, fault: str, level: int, windows: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"supervisor": who, "fault": fault, "concurrency": level,
                               "fault_at_s": 8.0, "recovery_s": 4.0,
                               "pre_fault_goodput_rps": 10.0}  # fmt: skip
        if windows:
            rps = [10.0] * 10 + [0.0] * 8 + [10.0] * 37
            out["goodput_windows"] = {"window_s": 3.0, "step_s": 0.5, "rps": rps}
        return out

    runs = [run("dynamod", "worker_stop", 4), run("no supervisor", "worker_stop", 4),
            run("dynamod", "worker_stop", 16), run("dynamod", "etcd_kill", 4, windows=False),
            run("dynamod", "none", 4)]  # fmt: skip
    drawn = goodput_plot.draw(runs, tmp_path / "png", goodput.FAULTS)
    assert drawn == [tmp_path / "png" / "goodput-worker_stop.png"]
    assert drawn[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = tmp_path / "old.json"
    saved.write_text(json.dumps({"data": {"runs": [runs[3]]}}))
    proc = subprocess.run([sys.executable, "-m", "bench.goodput_plot", str(saved),
                           str(tmp_path / "again")], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and "no run with its goodput windows" in proc.stderr
    saved.write_text(json.dumps({"data": {"runs": runs}}))
    proc = subprocess.run([sys.executable, "-m", "bench.goodput_plot", str(saved),
                           str(tmp_path / "again")], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("goodput-worker_stop.png")


def test_the_host_table_has_a_row_per_run_that_read_the_host() -> None:
    from bench import goodput

    machine = {"busy_s": 40.0, "steal_s": 1.5, "iowait_s": 0.0, "kdamond_s": 0.2,
               "major_faults": 7, "paged_in_kb": 512}  # fmt: skip
    runs = [
        {"supervisor": "dynamod", "fault": "etcd_kill", "concurrency": 16, "host": machine},
        {"supervisor": "dynamod", "fault": "none", "concurrency": 16},  # an older JSON's run
    ]
    assert goodput.host_table(runs).rows == [
        ["dynamod", "etcd_kill", 16, 40.0, 1.5, 0.0, 0.2, 7, 0.5]  # iowait 0.0
    ]


def test_the_fault_free_run_s_own_figure_is_its_noise() -> None:
    """A dip of the machine's own 18 s after the (unfaulted) fault time reads as ~19 s
    there: the figure a fault that cost nothing may get, beside each fault's."""
    from bench import goodput

    steady_run = steady(30, 10)
    reference = {"start": T0, "run_end": T0 + 30}
    assert goodput.noise_floor(steady_run, reference) == 0.0
    late_dip = steady(30, 10, gap=(26, 27))  # 1 s with nothing good, 18 s after 8 s
    assert goodput.noise_floor(late_dip, reference) == pytest.approx(19.0)
    assert goodput.noise_floor([], reference) is None  # nothing good before: no baseline


def test_each_fault_s_row_carries_the_fault_free_run_s_noise() -> None:
    from bench import goodput

    run = {"supervisor": "dynamod", "concurrency": 16, "records": 10, "failed": 0,
           "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "itl_p50_ms": 1.0, "itl_p99_ms": 2.0,
           "goodput_rps": 5.0, "fault_at_s": 8.0, "recovery_s": 18.25,
           "reference": {"goodput_rps": 5.0, "ttft_p99_ms": 2.0}}  # fmt: skip
    noise_at = goodput.HEADERS.index("s to 95 % in the fault-free run (its noise)")
    assert goodput.row(run)[noise_at] == "-"  # quick: no fault-free run
    assert goodput.row({**run, "no_fault_recovery_s": 11.5})[noise_at] == 11.5
    assert goodput.row({**run, "no_fault_recovery_s": None})[noise_at] == "never"
    assert len(goodput.row(run)) == len(goodput.HEADERS)
