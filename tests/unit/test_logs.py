"""Per-unit log files (size rotation, `dynamod logs` reading them) and the daemon's own
structured logging (JSON off a terminal, human lines on one)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog

from dynamod.control import logview
from dynamod.core import logsetup
from dynamod.core.errors import DynamodError
from dynamod.core.logs import CUT_MARK, LogFile, OutputSink


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


def test_logs_read_across_rotated_files_from_the_spawn_header(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "worker@0.log"
    log = LogFile(path, max_bytes=60, keep=3)
    log.write(b"--- dynamod: start #1 pid 10: worker\n")
    log.write(b"old output\n")
    log.write(b"--- dynamod: start #2 pid 11: worker\n")  # rotates: #1 goes to .1
    for i in range(6):
        log.write(f"line {i} of spawn 2\n".encode())  # rotates once more
    log.close()
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "worker@0.log", "worker@0.log.1", "worker@0.log.2", "worker@0.log.3"]
    out: list[str] = []
    logview.show(tmp_path, "worker@0", lines=4, follow=False, out=out.append)
    assert out == ["--- dynamod: start #2 pid 11: worker",  # from an older file
                   "line 2 of spawn 2", "line 3 of spawn 2", "line 4 of spawn 2",
                   "line 5 of spawn 2"]
    everything: list[str] = []
    logview.show(tmp_path, "worker@0", lines=100, follow=False, out=everything.append)
    assert everything[:3] == ["--- dynamod: start #1 pid 10: worker", "old output",
                              "--- dynamod: start #2 pid 11: worker"]
    assert len(everything) == 9


# ------------------------------------------------------------------------- unit output


def test_a_huge_line_is_cut_into_marked_pieces_and_memory_stays_bounded(
    tmp_path: Path,
) -> None:
    path = tmp_path / "big.log"
    sink = OutputSink(LogFile(path), tail_lines=10, max_line=1000)
    seen: list[str] = []
    sink.watch(seen.append)
    for _ in range(250):  # 1 MB in one line, fed as a pipe would
        sink.feed(b"x" * 4000)
        assert len(sink._partial) <= 1000  # never more than one piece pending
    sink.feed(b"tail of it\nnext line\n")
    mark = CUT_MARK.format(n=1000)
    assert len(seen) == 1000 + 2
    assert all(line == "x" * 1000 + mark for line in seen[:1000])
    assert seen[1000:] == ["tail of it", "next line"]
    assert len(sink.tail) == 10 and sum(map(len, sink.tail)) < 10 * (1000 + len(mark))
    sink.close()
    assert path.read_bytes() == b"x" * 1_000_000 + b"tail of it\nnext line\n"  # the file as-is


def test_lines_split_across_chunks_are_joined(tmp_path: Path) -> None:
    sink = OutputSink(LogFile(tmp_path / "a.log"), max_line=8)
    for chunk in (b"ab", b"c\nde", b"f\r\n", b"12345678", b"\n"):
        sink.feed(chunk)
    sink.close()
    assert list(sink.tail) == ["abc", "def", "12345678"]  # exactly max_line: not cut


def test_output_that_cannot_be_written_is_dropped_and_counted(tmp_path: Path) -> None:
    full = Path("/dev/full")  # every write fails with ENOSPC
    log = LogFile(full)
    sink = OutputSink(log)
    sink.feed(b"lost line\n")
    sink.header("start #2 pid 1: x")
    assert log.dropped_bytes == len(b"lost line\n") + len(b"--- dynamod: start #2 pid 1: x\n")
    assert log.drop_reason == "disk full"
    assert sink.last() == ["lost line"]  # still in memory, for failure messages
    sink.close()


def test_writing_resumes_and_says_what_was_lost(tmp_path: Path) -> None:
    path = tmp_path / "w.log"
    log = LogFile(path)
    real_fd = log._fd
    log._fd = os.open("/dev/full", os.O_WRONLY)  # the disk fills up
    log.write(b"gone\n")
    assert log.dropped_bytes == 5 and log.drop_reason == "disk full"
    os.close(log._fd)
    log._fd = real_fd  # space is back
    log.write(b"back\n")
    log.close()
    assert path.read_bytes() == b"--- dynamod: 5 bytes of output dropped (disk full)\nback\n"
    assert log.dropped_bytes == 5 and log.drop_reason is None


def test_failure_lines_from_further_back_are_picked(tmp_path: Path) -> None:
    sink = OutputSink(LogFile(tmp_path / "etcd.log"))
    sink.feed(b'{"level":"info","msg":"starting"}\n')
    fatal = '{"level":"fatal","msg":"failed to write","error":"no space left on device"}'
    sink.feed(fatal.encode() + b"\n")
    sink.feed(b"panic: boom\n")
    sink.feed(b"".join(f"goroutine frame {i}\n".encode() for i in range(20)))
    earlier, last = sink.telling(12)
    assert earlier == [fatal]
    assert last[-1] == "goroutine frame 19" and len(last) == 12
    sink.feed(b"Error: no space left on device\n")  # the cause is in the last lines already
    assert sink.telling(12)[0] == []
    sink.close()


def test_daemon_log_lines_that_cannot_be_written_do_not_raise(
    restore_structlog: None,
) -> None:
    with open("/dev/full", "w") as full:
        stream = logsetup.configure(full, json_output=True)
        structlog.get_logger().info("unit.state", unit="etcd")  # must not raise
        structlog.get_logger().info("unit.state", unit="nats")
    assert stream.dropped_lines == 2 and "No space left" in (stream.last_error or "")


def test_follow_starts_where_the_history_stopped(tmp_path: Path) -> None:
    """A line written after the history was read and before following began is shown once
    (the follow went on from the stat of the file, and lost such a line)."""
    path = tmp_path / "logs" / "etcd.log"
    log = LogFile(path, max_bytes=1 << 20, keep=1)
    log.write(b"one\n")
    seen: list[str] = []
    real_history = logview._history

    def history_then_a_write(p: Path, lines: int) -> tuple[list[str], tuple[int, int] | None]:
        got = real_history(p, lines)
        log.write(b"two\n")  # in the gap between the history and the follow
        return got

    def out(line: str) -> None:
        seen.append(line)
        if line == "three":
            raise _Seen

    logview._history = history_then_a_write  # type: ignore[assignment]
    try:
        reader = threading.Thread(target=lambda: _follow_until_seen(tmp_path, out), daemon=True)
        reader.start()
        deadline = time.monotonic() + 5
        while "two" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        log.write(b"three\n")
        reader.join(timeout=5)
    finally:
        logview._history = real_history  # type: ignore[assignment]
        log.close()
    assert not reader.is_alive()
    assert seen == ["one", "two", "three"]


def _follow_until_seen(state_dir: Path, out: Callable[[str], None]) -> None:
    with contextlib.suppress(_Seen):
        logview.show(state_dir, "etcd", lines=10, follow=True, out=out, poll=0.01)
