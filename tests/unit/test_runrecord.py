"""run.json, the one record of a daemon's run: what is written reads back the same, and a
damaged or older file reads as what can be trusted of it, never as an exception."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dynamod.core import proctable, runrecord
from dynamod.core.runrecord import RunRecord


def _record(**changes: object) -> RunRecord:
    fields: dict[str, object] = {
        "run_id": "0123456789abcdef",
        "pid": 4242,
        "stack": "/stacks/local.toml",
        "stack_name": "local",
        "guardian_pid": 4243,
        "containment": "cgroup",
        "cgroup": "/sys/fs/cgroup/dynamod-x",
        "orphans": ((7, 1234),),
    }
    fields.update(changes)
    return RunRecord(**fields)  # type: ignore[arg-type]


def test_a_written_record_reads_back_equal(tmp_path: Path) -> None:
    record = _record(stopping=True)
    runrecord.write(tmp_path, record)
    assert runrecord.read(tmp_path) == record


def test_mark_ended_keeps_the_rest_of_the_record(tmp_path: Path) -> None:
    runrecord.write(tmp_path, _record())
    runrecord.mark_ended(tmp_path, "swept")
    assert runrecord.read(tmp_path) == _record(ended="swept")


def test_no_file_a_broken_file_or_no_run_id_is_no_record(tmp_path: Path) -> None:
    assert runrecord.read(tmp_path) is None
    (tmp_path / runrecord.RUN_FILE).write_text("{not json")
    assert runrecord.read(tmp_path) is None
    (tmp_path / runrecord.RUN_FILE).write_text(json.dumps({"pid": 5}))
    assert runrecord.read(tmp_path) is None
    runrecord.mark_ended(tmp_path, "down")  # nothing to mark: the file is left as it was
    assert json.loads((tmp_path / runrecord.RUN_FILE).read_text()) == {"pid": 5}


def test_fields_of_the_wrong_type_read_as_absent() -> None:
    record = RunRecord.from_json(
        {
            "run_id": "r1",
            "pid": "4242",
            "stack": "/s/local.toml",
            "guardian_pid": True,
            "cgroup": 3,
            "orphans": [[1, 2], [3], "x", [4, "5"], [6, 7]],
            "stopping": "yes",
        }
    )
    assert record == RunRecord(
        run_id="r1", pid=None, stack="/s/local.toml", stack_name="local",
        orphans=((1, 2), (6, 7)),
    )


def test_daemon_alive_follows_the_recorded_pid() -> None:
    assert _record(pid=os.getpid()).daemon_alive()
    assert not _record(pid=None).daemon_alive()
    assert not _record(pid=2**22 + 1).daemon_alive()  # above pid_max's ceiling: no such process


def test_a_daemon_that_exited_but_is_not_reaped_is_not_alive() -> None:
    """Its zombie holds no lock and serves nothing (the CI machine reaps orphans late)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while not proctable.is_zombie(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Path(f"/proc/{child.pid}").exists()  # exited, not reaped: still in /proc
        assert not _record(pid=child.pid).daemon_alive()
    finally:
        child.wait()
