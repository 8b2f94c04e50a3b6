"""structlog configuration: human lines on a terminal, JSON lines otherwise. The daemon's
own log never raises into the code that logs: a line that cannot be written (a full disk,
a closed pipe) is dropped and counted, and the next line tries again."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TextIO

import structlog


class TolerantStream:
    """A write-only text stream that swallows OSError. Writes straight to the file
    descriptor where there is one, so a failed line is not kept in a buffer to grow."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.dropped_lines = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._pending: list[str] = []
        try:
            self._fd: int | None = stream.fileno()
        except (OSError, ValueError, AttributeError):
            self._fd = None

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    def write(self, text: str) -> int:
        with self._lock:
            self._pending.append(text)
            if text.endswith("\n"):
                self._flush_locked()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._pending:
            return
        text = "".join(self._pending)
        self._pending.clear()
        try:
            if self._fd is None:
                self.stream.write(text)
                self.stream.flush()
            else:
                view = memoryview(text.encode("utf-8", "replace"))
                while view:
                    view = view[os.write(self._fd, view) :]
            self.last_error = None
        except (OSError, ValueError) as exc:
            self.dropped_lines += 1
            self.last_error = str(exc)


def configure(
    stream: TextIO | None = None,
    *,
    json_output: bool | None = None,
    level: int = logging.INFO,
    cache: bool = False,
) -> TolerantStream:
    """Route structlog to `stream`. `cache`: each module's logger is built once, on first
    use, instead of at every call (tens of microseconds a line): for the daemon, whose
    exit path logs the state change before anything else; never where a test captures
    logs afterwards (a cached logger keeps the processors it was built with)."""
    raw = stream or sys.stderr
    if json_output is None:
        json_output = not raw.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if json_output
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    out = TolerantStream(raw)
    if out._fd is not None:
        raw.flush()  # what was printed before goes out before what we write to the fd
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(out),  # type: ignore[arg-type]
        cache_logger_on_first_use=cache,
    )
    return out
