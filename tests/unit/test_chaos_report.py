"""The journal's Chaos Toolkit shape, the summary table, the timeline picture and the
report index, from a small recorded history (no processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dynamod.chaos import report
from dynamod.chaos.history import CacheSample, Fault, History, Request, StateChange, VersionSample
from dynamod.chaos.journal import Journal, RunStatus, summary, timed
from dynamod.chaos.timeline import draw


def history() -> History:
    return History(
        requests=[Request(1, 1.05, 200, version=0, instance="a"), Request(2, 2.5, 503)],
        states=[StateChange(0, "worker@0", "none", "ready"),
                StateChange(1.5, "worker@0", "ready", "backoff"),
                StateChange(2.5, "worker@0", "held", "ready")],
        versions=[VersionSample(0, 0, {"worker@0": 0}, {"worker@0": True}),
                  VersionSample(3, 1, {"worker@0": 1}, {"worker@0": True})],
        faults=[Fault(1.5, "SIGKILL worker@0", "worker@0", healed_at=2.0)],
        cache=[CacheSample(1, "frontend", 0.9), CacheSample(2, "frontend", 0.1)], end=4)


def test_journal_has_chaos_toolkits_shape_and_a_failed_activity_fails_only_itself(
    tmp_path: Path,
) -> None:
    journal = Journal({"name": "demo"}, "quick")
    journal.run.append(timed("action", "ok step", {}, lambda: {"x": 1}))
    journal.run.append(timed("action", "bad step", {}, lambda: 1 / 0))
    journal.checks = [{"check": "client_errors", "ok": False, "detail": "2 of 3 failed",
                       "measured": {}}]
    journal.end = time.time()
    journal.verdict = "FAILED"
    journal.write(tmp_path / "journal.json")
    data = json.loads((tmp_path / "journal.json").read_text())
    assert {"status", "deviated", "steady_states", "run", "rollbacks"} <= set(data)
    assert set(data["steady_states"]) == {"before", "after", "during"}
    ok, bad = data["run"]
    assert ok["status"] == "succeeded" and ok["output"] == {"x": 1}
    assert bad["status"] == "failed" and "ZeroDivisionError" in bad["exception"]
    assert {"start", "end", "duration"} <= set(bad)
    assert not data["passed"]
    table = summary([data])
    assert "demo" in table and "client_errors=FAIL" in table and "bad step" in table


def test_passed_needs_completed_not_deviated_and_every_check() -> None:
    journal = Journal({"name": "demo"}, "quick")
    journal.checks = [{"check": "x", "ok": True, "detail": "", "measured": {}}]
    assert journal.passed
    journal.deviated = True
    assert not journal.passed
    journal.deviated, journal.status = False, RunStatus.ABORTED
    assert not journal.passed


def test_timeline_and_index(tmp_path: Path) -> None:
    run_dir = tmp_path / "20260101T000000-demo"
    run_dir.mkdir()
    picture = draw(history(), "demo: FAILED", run_dir / "timeline.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    journal = Journal({"name": "demo"}, "quick", end=time.time(), verdict="passed")
    journal.write(run_dir / "journal.json")
    index = report.write_index(tmp_path)
    page = index.read_text()
    assert "demo" in page and "20260101T000000-demo/timeline.png" in page and "passed" in page
