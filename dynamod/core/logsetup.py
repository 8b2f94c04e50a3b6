"""structlog configuration: human lines on a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure(
    stream: TextIO | None = None, *, json_output: bool | None = None, level: int = logging.INFO
) -> None:
    stream = stream or sys.stderr
    if json_output is None:
        json_output = not stream.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if json_output
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
