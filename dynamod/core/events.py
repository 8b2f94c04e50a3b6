"""The events file: one JSON object per line in the state dir, appended as things happen
(unit state changes, restarts, phase changes, and what extensions report: pushes,
promotions, revocations), read by `dynamod events` during a run or after it.

A record is {"time": wall-clock seconds (for people), "mono": monotonic seconds (for
ordering and durations), "unit": name or null (the stack), "kind": what happened, ...its
fields}. Each record is one write(2) on an O_APPEND descriptor, so a reader sees whole
lines or a torn last line, which it skips. The file is bounded: past `max_bytes` it is
renamed to `events.jsonl.1` (replacing the previous one) and begun again.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from dynamod.core.errors import DynamodError
from dynamod.core.exits import describe_exit

if TYPE_CHECKING:
    from dynamod.core.engine import Unit
    from dynamod.core.state import UnitState

log = structlog.get_logger("dynamod.events")

FILE = "events.jsonl"
MAX_BYTES = 4 * 1024 * 1024
RESERVED = ("time", "mono", "unit", "kind")


def events_path(state_dir: Path) -> Path:
    return state_dir / FILE


def record(kind: str, unit: str | None, fields: Mapping[str, Any],
           *, wall: float, mono: float) -> dict[str, Any]:  # fmt: skip
    """The record as written: the four fixed keys first, then the fields (a field named
    like a fixed key is kept under a leading underscore rather than overwrite it)."""
    out: dict[str, Any] = {"time": round(wall, 3), "mono": round(mono, 3), "unit": unit,
                           "kind": kind}  # fmt: skip
    for key, value in fields.items():
        out[f"_{key}" if key in RESERVED else key] = value
    return out


class EventLog:
    """Appends records to the events file; never raises (a full disk loses events, which
    the daemon's log says once, and supervision goes on)."""

    def __init__(self, path: Path, *, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._failed = False

    def emit(self, kind: str, unit: str | None = None, **fields: Any) -> None:
        line = json.dumps(
            record(kind, unit, fields, wall=time.time(), mono=time.monotonic()),
            separators=(",", ":"),
            default=str,
        )
        data = (line + "\n").encode()
        try:
            self._rotate_if_full(len(data))
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            self._failed = False
        except OSError as exc:
            if not self._failed:
                log.warning("events.write_failed", path=str(self.path), error=str(exc))
            self._failed = True

    def _rotate_if_full(self, adding: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size and size + adding > self.max_bytes:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))


def watch_units(events: EventLog) -> Callable[[Unit, UnitState, UnitState], None]:
    """An engine listener that records each unit's state change with its reason, each
    decided restart with the exit that caused it and the delay before it, and each exit
    by the kernel's OOM killer with the unit's memory limit."""
    counted: dict[str, int] = {}  # unit -> restarts already recorded
    ooms: dict[str, int] = {}  # unit -> OOM kills already recorded

    def listener(unit: Unit, old: UnitState, new: UnitState) -> None:
        if unit.oom_kills > ooms.get(unit.name, 0) and unit.last_oom is not None:
            ooms[unit.name] = unit.oom_kills
            events.emit("oom_kill", unit.name, limit=unit.last_oom.limit,
                        oom_kills=unit.oom_kills)  # fmt: skip
        events.emit("state", unit.name, **{"from": str(old), "to": str(new),
                                           "reason": unit.detail})  # fmt: skip
        decision, total = unit.tracker.last, unit.tracker.total
        if str(new) == "backoff" and decision is not None and total > counted.get(unit.name, 0):
            counted[unit.name] = total
            events.emit(
                "restart",
                unit.name,
                exit=describe_exit(unit.last_exit, unit.last_oom) if unit.last_exit else None,
                delay_s=round(decision.delay, 3),
                restarts=unit.tracker.total,
                reason=decision.reason,
            )

    return listener


# ---------------------------------------------------------------- reading


def parse_line(line: str) -> dict[str, Any] | None:
    """One record, or None for a torn or foreign line."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
        return None
    if not isinstance(value.get("time"), int | float):
        return None
    return value


def read(state_dir: Path) -> tuple[list[dict[str, Any]], tuple[int, int] | None]:
    """Every record, oldest first, across the rotated file and the live one; and where
    reading stopped in the live file (inode, offset after its last whole line), so a
    follow goes on from there with nothing lost or shown twice."""
    path = events_path(state_dir)
    records: list[dict[str, Any]] = []
    where: tuple[int, int] | None = None
    for part in (path.with_name(path.name + ".1"), path):
        try:
            fh = part.open("rb")
        except FileNotFoundError:
            continue
        with fh:
            data = fh.read()
            if part == path:
                where = (os.fstat(fh.fileno()).st_ino, data.rfind(b"\n") + 1)
        for line in data.decode("utf-8", "replace").splitlines():
            parsed = parse_line(line)
            if parsed is not None:
                records.append(parsed)
    return records, where


def tail(state_dir: Path, count: int, *, chunk: int = 64 * 1024) -> list[dict[str, Any]]:
    """The last `count` records, oldest first, read from the files' ends (the status page
    asks for them every second: the whole file each time would be megabytes)."""
    path = events_path(state_dir)
    records: list[dict[str, Any]] = []
    for part in (path, path.with_name(path.name + ".1")):
        if len(records) >= count:
            break
        records = _last_records(part, count - len(records), chunk) + records
    return records[-count:] if count > 0 else []


def _last_records(path: Path, count: int, chunk: int) -> list[dict[str, Any]]:
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return []
    with fh:
        size = os.fstat(fh.fileno()).st_size
        start = size
        while True:
            start = max(0, start - chunk)
            fh.seek(start)
            data = fh.read(size - start)
            lines = data.decode("utf-8", "replace").splitlines()
            if start > 0:
                lines = lines[1:]  # begun mid-line: that line is read whole next round
            parsed = [r for r in map(parse_line, lines) if r is not None]
            if len(parsed) >= count or start == 0:
                return parsed[-count:]
            chunk *= 2


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class BadSince(DynamodError):
    pass


def parse_since(text: str, *, now: float) -> float:
    """`--since`: a duration back from now (`90s`, `10m`, `2h`, `1d`) or a local date-time
    (`2026-12-02 22:40`, `22:40:05` for today, ISO 8601 with or without a zone). The
    wall-clock time it names."""
    text = text.strip()
    match = _DURATION.match(text)
    if match:
        return now - float(match.group(1)) * _UNIT_S[match.group(2)]
    try:
        if re.fullmatch(r"\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?", text):
            today = datetime.fromtimestamp(now).strftime("%Y-%m-%d")
            text = f"{today} {text}"
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise BadSince(
            f"--since {text!r}: not a duration (90s, 10m, 2h, 1d) or a date-time "
            "(2026-12-02 22:40, 22:40:05)"
        ) from None


def describe(event: Mapping[str, Any]) -> str:
    """What happened, in words: the middle of a line for people."""
    kind = event["kind"]
    fields = {k: v for k, v in event.items() if k not in RESERVED}
    if kind == "state":
        head = f"{fields.pop('from', '?')} -> {fields.pop('to', '?')}"
    elif kind == "oom_kill":
        limit = fields.pop("limit", None)
        head = "killed by the kernel's OOM killer" + (f" ({limit})" if limit else "")
    elif kind == "restart":
        head = f"restart #{fields.pop('restarts', '?')} in {fields.pop('delay_s', '?')}s"
        fields.pop("reason", None)  # "restarting in N s": the head says it
    else:
        head = kind
    why = fields.pop("reason", None) or fields.pop("exit", None)
    rest = " ".join(f"{k}={_short(v)}" for k, v in fields.items() if v not in (None, ""))
    return "  ".join(part for part in (head, rest, f"({why})" if why else "") if part)


def _short(value: Any) -> str:
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return json.dumps(value, separators=(",", ":"), default=str)


def format_line(event: Mapping[str, Any]) -> str:
    """One line for people: local time to the millisecond, unit (or `-` for the stack),
    what happened, why."""
    stamp = datetime.fromtimestamp(float(event["time"]))
    when = stamp.strftime("%Y-%m-%d %H:%M:%S.") + f"{stamp.microsecond // 1000:03d}"
    unit = event.get("unit") or "-"
    return f"{when}  {unit:<14} {describe(event)}"
