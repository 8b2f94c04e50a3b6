"""Per-unit output: a pipe from the child, a size-rotated log file, and a tail in memory."""

from __future__ import annotations

import asyncio
import os
import re
from collections import deque
from collections.abc import Callable
from pathlib import Path

LineWatcher = Callable[[str], None]


class LogFile:
    """Append-only file rotated by size: NAME.log, NAME.log.1 .. NAME.log.{keep}."""

    def __init__(self, path: Path, max_bytes: int = 20 * 1024 * 1024, keep: int = 3) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("ab", buffering=0)
        self._size = self._fh.tell()

    def write(self, data: bytes) -> None:
        if self._size + len(data) > self.max_bytes and self._size > 0:
            self._rotate()
        self._fh.write(data)
        self._size += len(data)

    def _rotate(self) -> None:
        self._fh.close()
        for i in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.keep > 0:
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._fh = self.path.open("ab", buffering=0)
        self._size = 0

    def close(self) -> None:
        self._fh.close()


class OutputSink:
    """Reads a child's stdout+stderr pipe; writes the log file; keeps recent lines.

    Lines also go to watchers (log-regex readiness probes). The sink lives as long as the
    unit, across restarts: each spawn attaches a new pipe.
    """

    def __init__(self, logfile: LogFile, tail_lines: int = 200) -> None:
        self.logfile = logfile
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self._watchers: list[LineWatcher] = []
        self._partial = b""
        self._pumps: set[asyncio.Task[None]] = set()  # strong refs: tasks are weakly held

    def header(self, text: str) -> None:
        self.logfile.write(f"--- dynamod: {text}\n".encode())

    def attach(self, read_fd: int) -> None:
        task = asyncio.get_running_loop().create_task(self._pump(read_fd))
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)

    async def _pump(self, read_fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        protocol = asyncio.StreamReaderProtocol(reader)
        pipe = os.fdopen(read_fd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(lambda: protocol, pipe)
        try:
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                self._feed(chunk)
        finally:
            if self._partial:
                self._emit(self._partial)
                self._partial = b""
            transport.close()

    def _feed(self, chunk: bytes) -> None:
        self.logfile.write(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            self._emit(line)

    def _emit(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        self.tail.append(line)
        for watcher in list(self._watchers):
            watcher(line)

    def watch(self, callback: LineWatcher) -> Callable[[], None]:
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback)

    def last(self, n: int = 15) -> list[str]:
        return list(self.tail)[-n:]

    def seen(self, pattern: re.Pattern[str]) -> bool:
        return any(pattern.search(line) for line in self.tail)

    async def drain(self, timeout: float = 1.0) -> None:
        """Give the pumps a moment to read what the dead process left in the pipe."""
        if self._pumps:
            await asyncio.wait(list(self._pumps), timeout=timeout)

    def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        self.logfile.close()
