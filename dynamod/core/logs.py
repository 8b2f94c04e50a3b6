"""Per-unit output: a pipe from the child, a size-rotated log file, and a bounded tail in
memory. Output costs time linear in its size, a line longer than `max_line` bytes is cut
into pieces marked as such, and output that cannot be written (a full disk) is dropped and
counted instead of ending the pump; writing resumes by itself once the file takes data."""

from __future__ import annotations

import asyncio
import errno
import os
import re
from collections import deque
from collections.abc import Callable
from pathlib import Path

from dynamod.core import causes

LineWatcher = Callable[[str], None]

CUT_MARK = " [dynamod: line cut at {n} bytes, continues]"
# Lines worth showing from further back than the last few when a unit fails: the causes
# an operator can fix first, then any line that says it failed.
CAUSES = re.compile(
    r"no space left|ENOSPC|disk full|quota exceeded|permission denied|address already in use"
    r"|out of memory|too many open files",
    re.IGNORECASE,
)
FAILURES = re.compile(r"\b(fatal|panic|error|exception|failed)\b", re.IGNORECASE)


class LogFile:
    """Append-only file rotated by size: NAME.log, NAME.log.1 .. NAME.log.{keep}.

    A write that fails (ENOSPC, EIO, a rotation that cannot rename) drops that data and
    counts it in `dropped_bytes`; the next write tries again, and the first one that
    succeeds after a gap says how much was lost."""

    def __init__(self, path: Path, max_bytes: int = 20 * 1024 * 1024, keep: int = 3) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.dropped_bytes = 0
        self.drop_reason: str | None = None  # why the last write failed; None once writing works
        self._unreported = 0  # dropped since the last successful write
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = os.fstat(self._fd).st_size

    def write(self, data: bytes) -> None:
        if not data:
            return
        try:
            if self._unreported:
                note = (
                    f"--- dynamod: {self._unreported} bytes of output dropped "
                    f"({self.drop_reason})\n"
                ).encode()
                self._write_all(note)
                self._unreported = 0
                self.drop_reason = None
            self._write_all(data)
        except OSError as exc:
            self.dropped_bytes += len(data)
            self._unreported += len(data)
            self.drop_reason = _reason(exc)

    def _write_all(self, data: bytes) -> None:
        if self._size + len(data) > self.max_bytes and self._size > 0:
            self._rotate()
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._size = os.fstat(self._fd).st_size
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            self._size += written
            view = view[written:]

    def _rotate(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for i in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.keep > 0:
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _reason(exc: OSError) -> str:
    if exc.errno in {errno.ENOSPC, errno.EDQUOT}:
        return "disk full"
    return exc.strerror or str(exc)


class OutputSink:
    """Reads a child's stdout+stderr pipe; writes the log file; keeps recent lines.

    Lines also go to watchers (log-regex readiness probes). The sink lives as long as the
    unit, across restarts: each spawn attaches a new pipe. Memory held is bounded by
    `tail_lines` lines of at most `max_line` bytes each, plus one pending line.
    """

    def __init__(self, logfile: LogFile, tail_lines: int = 200, max_line: int = 16384) -> None:
        self.logfile = logfile
        self.max_line = max_line
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self._watchers: list[LineWatcher] = []
        self._partial = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pipes: dict[int, asyncio.Future[None]] = {}  # read fd -> done at its EOF
        self._on_end: dict[int, Callable[[], object]] = {}

    def header(self, text: str) -> None:
        self.logfile.write(f"--- dynamod: {text}\n".encode())

    def attach(self, read_fd: int, on_end: Callable[[], object] | None = None) -> None:
        """Read a new process's pipe straight from the loop: a callback per chunk, and at
        EOF the fd is closed in that same callback, then `on_end` is called. No task and
        no transport: a dying unit's pipe reports EOF a moment before its pidfd does, and
        its exit should be recorded in that turn of the loop (`on_end`), or the loop be
        back waiting for the pidfd, not stepping a reader task through two more turns."""
        self._loop = loop = asyncio.get_running_loop()
        os.set_blocking(read_fd, False)
        self._pipes[read_fd] = loop.create_future()
        if on_end is not None:
            self._on_end[read_fd] = on_end
        loop.add_reader(read_fd, self._readable, read_fd)

    def _readable(self, fd: int) -> None:
        try:
            chunk = os.read(fd, 65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""  # the pipe is unreadable (EIO): as good as its end
        if chunk:
            self.feed(chunk)
        else:
            self._end(fd)

    def _end(self, fd: int) -> None:
        on_end = self._on_end.pop(fd, None)
        if on_end is not None:  # first: it may record the exit of the pipe's process
            on_end()
        done = self._pipes.pop(fd)
        if self._loop is not None:
            self._loop.remove_reader(fd)
        os.close(fd)
        if self._partial:
            self._emit(bytes(self._partial))
            self._partial.clear()
        if not done.done():
            done.set_result(None)

    def feed(self, chunk: bytes) -> None:
        """Take one chunk of output: to the file as it is, to the tail line by line."""
        self.logfile.write(chunk)
        start = 0
        while (newline := chunk.find(b"\n", start)) >= 0:
            self._add(chunk, start, newline)
            self._emit(bytes(self._partial))
            self._partial.clear()
            start = newline + 1
        self._add(chunk, start, len(chunk))

    def _add(self, chunk: bytes, start: int, end: int) -> None:
        """Append chunk[start:end] to the pending line, emitting full `max_line` pieces."""
        while end - start > self.max_line - len(self._partial):
            take = self.max_line - len(self._partial)
            self._partial += chunk[start : start + take]
            start += take
            self._emit(bytes(self._partial), cut=True)
            self._partial.clear()
        self._partial += chunk[start:end]

    def _emit(self, raw: bytes, cut: bool = False) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if cut:
            line += CUT_MARK.format(n=self.max_line)
        self.tail.append(line)
        for watcher in list(self._watchers):
            watcher(line)

    def watch(self, callback: LineWatcher) -> Callable[[], None]:
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback)

    def last(self, n: int = 15) -> list[str]:
        return list(self.tail)[-n:]

    def telling(self, n: int = 12, earlier: int = 3) -> tuple[list[str], list[str]]:
        """The last `n` lines, and before them up to `earlier` lines that name a failure
        (a process that dies of ENOSPC logs that once, then a long stack trace)."""
        lines = list(self.tail)
        last = lines[-n:]
        older = lines[: len(lines) - len(last)]
        if any(CAUSES.search(line) for line in last):
            return [], last
        before = [line for line in older if CAUSES.search(line)]
        before = before or [line for line in older if FAILURES.search(line)]
        return before[-earlier:], last

    def cause(self) -> str | None:
        """The process's own cause line in the tail (core/causes.py), if it names one."""
        return causes.cause_line(list(self.tail))

    def seen(self, pattern: re.Pattern[str]) -> bool:
        return any(pattern.search(line) for line in self.tail)

    async def drain(self, timeout: float = 1.0) -> None:
        """Give the readers a moment to read what the dead process left in the pipe."""
        if self._pipes:
            await asyncio.wait(list(self._pipes.values()), timeout=timeout)

    def close(self) -> None:
        self._on_end.clear()
        for fd in list(self._pipes):
            self._end(fd)
        self.logfile.close()
