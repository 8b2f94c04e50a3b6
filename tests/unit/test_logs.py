"""Per-unit log files (size rotation, `dynamod logs` reading them) and the daemon's own
structured logging (JSON off a terminal, human lines on one)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from dynamod.control import logview
from dynamod.core import logsetup
from dynamod.core.errors import DynamodError
from dynamod.core.logs import LogFile


def files(log: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(log.parent.iterdir())}


def test_rotation_keeps_the_newest_files_and_drops_the_oldest(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "worker@0.log"
    log = LogFile(path, max_bytes=10, keep=2)
    for line in (b"aaaa\n", b"bbbb\n"):  # exactly max_bytes: no rotation yet
        log.write(line)
    assert files(path) == {"worker@0.log": b"aaaa\nbbbb\n"}

    log.write(b"cccc\n")
    assert files(path) == {"worker@0.log": b"cccc\n", "worker@0.log.1": b"aaaa\nbbbb\n"}

    for line in (b"dddd\n", b"eeee\n", b"ffff\n", b"gggg\n"):
        log.write(line)
    log.close()
    assert files(path) == {
        "worker@0.log": b"gggg\n",
        "worker@0.log.1": b"eeee\nffff\n",
        "worker@0.log.2": b"cccc\ndddd\n",  # aaaa/bbbb went when .2 was needed again
    }


def test_reopened_file_counts_what_it_already_holds(tmp_path: Path) -> None:
    path = tmp_path / "etcd.log"
    path.write_bytes(b"12345678\n")
    log = LogFile(path, max_bytes=12, keep=1)
    log.write(b"abcd\n")  # 9 + 5 > 12: rotate before writing
    log.close()
    assert files(path) == {"etcd.log": b"abcd\n", "etcd.log.1": b"12345678\n"}


def test_a_write_larger_than_the_limit_is_never_split(tmp_path: Path) -> None:
    path = tmp_path / "nats.log"
    log = LogFile(path, max_bytes=4, keep=1)
    log.write(b"one long line\n")
    log.write(b"next\n")
    log.close()
    assert files(path) == {"nats.log": b"next\n", "nats.log.1": b"one long line\n"}


def test_keep_zero_truncates_instead_of_keeping_history(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    log = LogFile(path, max_bytes=5, keep=0)
    log.write(b"old!\n")
    log.write(b"new!\n")
    log.close()
    assert files(path) == {"x.log": b"new!\n"}


# ------------------------------------------------------------------------- dynamod logs


def test_logs_prints_the_last_lines_and_names_replicas(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "etcd.log").write_text("".join(f"line {i}\n" for i in range(10)))
    (logs / "worker@0.log").write_text("w0\n")
    (logs / "worker@1.log").write_text("w1\n")
    out: list[str] = []
    logview.show(tmp_path, "etcd", lines=3, follow=False, out=out.append)
    assert out == ["line 7", "line 8", "line 9"]
    with pytest.raises(DynamodError, match="name one of: worker@0, worker@1"):
        logview.show(tmp_path, "worker", lines=3, follow=False, out=out.append)
    with pytest.raises(DynamodError, match=r"no log for unit 'nope'.*etcd, worker@0, worker@1"):
        logview.show(tmp_path, "nope", lines=3, follow=False, out=out.append)


class _Seen(Exception):
    pass


def test_follow_continues_across_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "nats.log"
    log = LogFile(path, max_bytes=40, keep=1)
    log.write(b"before\n")
    seen: list[str] = []

    def out(line: str) -> None:
        seen.append(line)
        if line == "after rotation":
            raise _Seen

    def follow() -> None:
        with contextlib.suppress(_Seen):
            logview.show(tmp_path, "nats", lines=10, follow=True, out=out, poll=0.01)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    log.write(b"x" * 39 + b"\n")  # over the limit: the next write rotates
    time.sleep(0.05)
    log.write(b"after rotation\n")
    log.close()
    reader.join(timeout=5)
    assert not reader.is_alive()
    assert seen[0] == "before" and seen[-1] == "after rotation"


# ------------------------------------------------------------------------- daemon logs


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def test_json_lines_when_the_log_stream_is_not_a_terminal(restore_structlog: None) -> None:
    stream = io.StringIO()
    logsetup.configure(stream)
    structlog.get_logger("dynamod.engine").info("unit.state", unit="etcd", new="ready")
    record = json.loads(stream.getvalue())
    assert record["event"] == "unit.state"
    assert record["unit"] == "etcd" and record["new"] == "ready"
    assert record["level"] == "info" and record["timestamp"].endswith("Z")


def test_human_lines_on_a_terminal(restore_structlog: None) -> None:
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        logsetup.configure(terminal)
        structlog.get_logger().info("unit.state", unit="etcd")
        terminal.flush()
        line = os.read(leader, 4096).decode()
    os.close(leader)
    assert "unit.state" in line and "unit=etcd" in line
    assert not line.lstrip().startswith("{")
