"""A failed process's own cause, picked from the last lines of its output: the line an
operator would read first. An engine that dies at start (dynamo.vllm refusing a flag or a
model) prints a traceback whose last exception names the cause; a program that refuses its
arguments prints `prog: error: ...`; a Rust or structured logger prints `ERROR target:
...`. Pure: the lines come from the unit's log tail (core/logs.py).

    the last exception line of a traceback (`pkg.mod.ValueError: msg`, with the indented
        lines that continue it, as pydantic writes its validation errors), unless it only
        points at another one ("see root cause above"): then the one before it
    else the last `prog: error: ...` line (argparse)
    else the last log record at level ERROR, CRITICAL or FATAL
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MAX_CAUSE = 300  # characters; a cause is one line in status and in `up`'s message

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# vLLM prefixes its engine process's lines: "(EngineCore_DP0 pid=1234) "
_PREFIX = re.compile(r"^\([\w.:-]+ pid=\d+\)\s?")
_EXCEPTION = re.compile(
    r"^(?P<type>(?:[A-Za-z_]\w*\.)*(?:[A-Za-z_]\w*(?:Error|Exception|Failure|Fault)|Exception))"
    r"(?::\s*(?P<message>.*))?$"
)
# An exception that only points at another one, or says nothing of the cause.
_POINTERS = re.compile(r"see (the )?(root cause|stack trace|error|logs?) above", re.IGNORECASE)
_NOT_CAUSES = {"CancelledError", "KeyboardInterrupt", "SystemExit", "BrokenPipeError"}
_ARGPARSE = re.compile(r"^\S+: error: .+")
_LOG_ERROR = re.compile(r"\b(ERROR|CRITICAL|FATAL)\b[\s:]+(?P<rest>\S.*)$")
_CONTINUATION_END = re.compile(r"^\s*(For further information visit|$)")
_MAX_CONTINUATION = 3


def cause_line(lines: Sequence[str]) -> str | None:
    """The process's own cause in one line (at most MAX_CAUSE characters), or None if
    its output names none."""
    clean = [_PREFIX.sub("", _ANSI.sub("", line)).rstrip() for line in lines]
    cause = _last_exception(clean)
    if cause is None:
        cause = next((line for line in reversed(clean) if _ARGPARSE.match(line)), None)
    if cause is None:
        found = (_LOG_ERROR.search(line) for line in reversed(clean))
        match = next((m for m in found if m is not None), None)
        cause = f"{match.group(1)} {match.group('rest')}" if match else None
    if cause is None:
        return None
    cause = " ".join(cause.split())
    return cause if len(cause) <= MAX_CAUSE else cause[: MAX_CAUSE - 1] + "…"


def _last_exception(lines: list[str]) -> str | None:
    for at in range(len(lines) - 1, -1, -1):
        match = _EXCEPTION.match(lines[at])
        if match is None:
            continue
        kind = match.group("type").rsplit(".", 1)[-1]
        message = (match.group("message") or "").strip()
        if kind in _NOT_CAUSES or _POINTERS.search(message):
            continue
        more = _continuation(lines, at + 1)
        text = ": ".join(part for part in (message, *more) if part)
        return f"{kind}: {text}" if text else kind
    return None


def _continuation(lines: list[str], start: int) -> list[str]:
    """The indented lines right after an exception line that continue its message."""
    more: list[str] = []
    for line in lines[start : start + _MAX_CONTINUATION]:
        if not line[:1].isspace() or _CONTINUATION_END.match(line):
            break
        more.append(line.strip())
    return more
