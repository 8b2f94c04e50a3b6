"""The events file's pure parts: records, parsing, `--since`, the line for people, the
bounded file with one rotation, and following across a rotation."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamod.control.commands import events as cmd
from dynamod.core import events as ev
from dynamod.core.exits import OomKill
from dynamod.core.restart import Decision, Exit
from dynamod.core.state import UnitState


def test_record_keeps_the_fixed_keys_first_and_never_overwritten() -> None:
    rec = ev.record("state", "w", {"from": "ready", "kind": "x"}, wall=1.23456, mono=7.0)
    assert list(rec) == ["time", "mono", "unit", "kind", "from", "_kind"]
    assert rec["time"] == 1.235 and rec["kind"] == "state" and rec["_kind"] == "x"


@pytest.mark.parametrize("line", ["", "{", '{"kind": "x"', "[1]", '{"time": 1}',
                                  '{"kind": "x", "time": "now"}', "not json"])  # fmt: skip
def test_torn_or_foreign_lines_are_skipped(line: str) -> None:
    assert ev.parse_line(line) is None


def test_a_whole_line_parses() -> None:
    assert ev.parse_line('{"time": 1.5, "mono": 2, "unit": null, "kind": "phase"}') == {
        "time": 1.5, "mono": 2, "unit": None, "kind": "phase"}  # fmt: skip


def test_since_takes_durations_and_date_times() -> None:
    now = datetime(2026, 12, 2, 22, 50, 0).timestamp()
    assert ev.parse_since("90s", now=now) == now - 90
    assert ev.parse_since("10m", now=now) == now - 600
    assert ev.parse_since("1.5h", now=now) == now - 5400
    assert ev.parse_since("1d", now=now) == now - 86400
    assert ev.parse_since("2026-12-02 22:40", now=now) == now - 600
    assert ev.parse_since("22:40:30", now=now) == now - 570
    with pytest.raises(ev.BadSince, match="'10 parsecs'"):
        ev.parse_since("10 parsecs", now=now)
    with pytest.raises(ev.BadSince):
        ev.parse_since("25:99", now=now)


def test_lines_for_people_say_when_who_what_and_why() -> None:
    at = datetime(2026, 12, 2, 22, 41, 5, 123000).timestamp()
    why = "killed by SIGKILL; restarting in 0.30s"
    state = ev.record("state", "worker@1", {"from": "ready", "to": "backoff", "reason": why},
                      wall=at, mono=1)  # fmt: skip
    assert ev.format_line(state) == (
        "2026-12-02 22:41:05.123  worker@1       ready -> backoff  "
        "(killed by SIGKILL; restarting in 0.30s)"
    )
    restart = ev.record("restart", "w", {"exit": "exited 3", "delay_s": 0.8, "restarts": 2,
                        "reason": "restarting in 0.80s"}, wall=at, mono=1)  # fmt: skip
    assert ev.describe(restart) == "restart #2 in 0.8s  (exited 3)"
    push = ev.record("policy.push", None, {"version": 4, "shards": {"w@0": "acked"},
                     "duration_s": 1.2, "note": "two words"}, wall=at, mono=1)  # fmt: skip
    line = ev.format_line(push)
    assert "  -              policy.push  version=4 " in line
    assert 'shards={"w@0":"acked"}' in line and 'note="two words"' in line


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_file_is_bounded_with_one_rotation(tmp_path: Path) -> None:
    log = ev.EventLog(ev.events_path(tmp_path), max_bytes=400)
    for i in range(40):
        log.emit("tick", "u", i=i)
    live, old = ev.events_path(tmp_path), tmp_path / "events.jsonl.1"
    assert live.stat().st_size <= 400 and old.stat().st_size <= 400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "events.jsonl.1"]
    records, where = ev.read(tmp_path)
    numbers = [r["i"] for r in records]
    assert numbers == list(range(numbers[0], 40)) and numbers[0] > 0  # oldest dropped, in order
    assert where == (live.stat().st_ino, live.stat().st_size)


def test_a_torn_last_line_is_neither_shown_nor_counted_as_read(tmp_path: Path) -> None:
    log = ev.EventLog(ev.events_path(tmp_path))
    log.emit("a")
    size = ev.events_path(tmp_path).stat().st_size
    with ev.events_path(tmp_path).open("a") as fh:
        fh.write('{"time": 1, "kind": "b"')  # a writer between its bytes
    records, where = ev.read(tmp_path)
    assert [r["kind"] for r in records] == ["a"] and where is not None and where[1] == size


def test_a_write_that_fails_loses_the_event_and_raises_nothing(tmp_path: Path) -> None:
    log = ev.EventLog(tmp_path / "missing" / "events.jsonl")
    log.emit("a")  # no directory: logged once, supervision goes on
    assert not (tmp_path / "missing").exists()


def test_unit_listener_records_transitions_and_each_restart_once(tmp_path: Path) -> None:
    log = ev.EventLog(ev.events_path(tmp_path))
    tracker = SimpleNamespace(last=None, total=0)
    unit = SimpleNamespace(name="w", detail="spawned pid 7", tracker=tracker, last_exit=None,
                           last_oom=None, oom_kills=0)  # fmt: skip
    listener = ev.watch_units(log)
    listener(unit, UnitState.INACTIVE, UnitState.STARTING)  # type: ignore[arg-type]
    tracker.last, tracker.total = Decision(True, 0.5, "restarting in 0.50s"), 1
    unit.last_exit = SimpleNamespace(describe=lambda: "killed by SIGKILL")
    unit.detail = "killed by SIGKILL; restarting in 0.50s (restart 1)"
    listener(unit, UnitState.STARTING, UnitState.BACKOFF)  # type: ignore[arg-type]
    unit.detail = "supervision error: boom; starting again in 1s"
    listener(unit, UnitState.STARTING, UnitState.BACKOFF)  # type: ignore[arg-type]  # no new decision
    got = _lines(ev.events_path(tmp_path))
    assert [(r["kind"], r.get("to")) for r in got] == [
        ("state", "starting"), ("state", "backoff"), ("restart", None), ("state", "backoff")]
    assert got[2]["delay_s"] == 0.5 and got[2]["exit"] == "killed by SIGKILL"
    assert got[2]["restarts"] == 1


def test_an_oom_kill_is_recorded_once_with_its_limit_and_names_the_restart(
    tmp_path: Path,
) -> None:
    log = ev.EventLog(ev.events_path(tmp_path))
    tracker = SimpleNamespace(last=Decision(True, 0.1, "restarting"), total=1)
    unit = SimpleNamespace(name="w", detail="killed by the kernel's OOM killer (memory_max 64M)",
                           tracker=tracker, last_exit=Exit(code=None, signal=9),
                           last_oom=OomKill("memory_max 64M"), oom_kills=1)  # fmt: skip
    listener = ev.watch_units(log)
    listener(unit, UnitState.READY, UnitState.BACKOFF)  # type: ignore[arg-type]
    listener(unit, UnitState.BACKOFF, UnitState.STARTING)  # type: ignore[arg-type]
    got = _lines(ev.events_path(tmp_path))
    assert [r["kind"] for r in got] == ["oom_kill", "state", "restart", "state"]
    assert got[0]["limit"] == "memory_max 64M" and got[0]["oom_kills"] == 1
    assert got[2]["exit"] == "killed by the kernel's OOM killer (memory_max 64M)"
    assert "killed by the kernel's OOM killer (memory_max 64M)" in ev.describe(got[0])


def test_show_filters_by_unit_and_time_and_keeps_the_last_n(tmp_path: Path) -> None:
    path = ev.events_path(tmp_path)
    rows = [ev.record("state", u, {"to": "ready"}, wall=t, mono=t)
            for t, u in [(10, "a"), (20, "b@0"), (30, "b@1"), (40, None)]]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out: list[str] = []

    def show(**kw: Any) -> list[float]:
        out.clear()
        cmd.show(tmp_path, follow=False, out=out.append, render=lambda e: str(e["time"]), **kw)
        return [float(x) for x in out]

    assert show(lines=50, unit=None, since=None) == [10, 20, 30, 40]
    assert show(lines=2, unit=None, since=None) == [30, 40]
    assert show(lines=50, unit="b", since=None) == [20, 30]
    assert show(lines=50, unit="b@1", since=None) == [30]
    assert show(lines=50, unit=None, since=25) == [30, 40]
    assert show(lines=0, unit=None, since=None) == []


def test_tail_reads_the_last_records_across_the_rotation_from_the_ends(tmp_path: Path) -> None:
    log = ev.EventLog(ev.events_path(tmp_path), max_bytes=400)
    for i in range(40):
        log.emit("tick", "u", i=i)
    everything = [r["i"] for r in ev.read(tmp_path)[0]]
    live = [r["i"] for r in _lines(ev.events_path(tmp_path))]
    for count in (1, len(live), len(live) + 2, 1000):  # a small chunk: several rounds back
        assert [r["i"] for r in ev.tail(tmp_path, count, chunk=50)] == everything[-count:]
    assert ev.tail(tmp_path, 0) == [] and ev.tail(tmp_path / "none", 5) == []


def test_tail_skips_a_torn_last_line_and_a_line_cut_by_the_chunk(tmp_path: Path) -> None:
    log = ev.EventLog(ev.events_path(tmp_path))
    for kind in ("a", "b", "c"):
        log.emit(kind, reason="x" * 30)
    with ev.events_path(tmp_path).open("a") as fh:
        fh.write('{"time": 1, "kind": "d"')
    assert [r["kind"] for r in ev.tail(tmp_path, 2, chunk=40)] == ["b", "c"]
