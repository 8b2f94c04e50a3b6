"""`dynamod logs`: read (and follow) a unit's log file, across rotations."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from dynamod.core.errors import DynamodError


def log_path(state_dir: Path, unit: str) -> Path:
    logs = state_dir / "logs"
    path = logs / f"{unit}.log"
    if path.exists():
        return path
    replicas = sorted(p.stem for p in logs.glob(f"{unit}@*.log")) if logs.exists() else []
    if replicas:
        raise DynamodError(f"{unit} has replicas; name one of: {', '.join(replicas)}")
    known = sorted(p.stem for p in logs.glob("*.log")) if logs.exists() else []
    hint = f" (logs here: {', '.join(known)})" if known else ""
    raise DynamodError(f"no log for unit {unit!r} in {logs}{hint}")


def show(
    state_dir: Path,
    unit: str,
    *,
    lines: int,
    follow: bool,
    out: Callable[[str], None],
    poll: float = 0.2,
) -> None:
    path = log_path(state_dir, unit)
    with path.open("rb") as fh:
        for line in deque(fh, maxlen=lines):
            out(line.decode("utf-8", "replace").rstrip("\n"))
        position = fh.tell()
    if not follow:
        return
    inode = path.stat().st_ino
    while True:
        try:
            stat = path.stat()
        except FileNotFoundError:
            time.sleep(poll)
            continue
        if stat.st_ino != inode or stat.st_size < position:  # rotated
            inode, position = stat.st_ino, 0
        if stat.st_size > position:
            with path.open("rb") as fh:
                fh.seek(position)
                for raw in fh:
                    out(raw.decode("utf-8", "replace").rstrip("\n"))
                position = fh.tell()
        time.sleep(poll)
