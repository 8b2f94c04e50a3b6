"""`dynamod logs`: a unit's log across its rotated files, with the header of the spawn the
shown lines belong to; `--follow` keeps reading across further rotations."""

from __future__ import annotations

import glob
import os
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


HEADER = "--- dynamod: start #"
MAX_LINE = 65536  # a longer line in the file is read (and shown) in pieces of this size


def rotated(path: Path) -> list[Path]:
    """NAME.log.N .. NAME.log.1, NAME.log: oldest first."""
    numbered = []
    for older in path.parent.glob(f"{glob.escape(path.name)}.*"):
        suffix = older.name[len(path.name) + 1 :]
        if suffix.isdigit():
            numbered.append((int(suffix), older))
    return [p for _, p in sorted(numbered, reverse=True)] + [path]


def history(path: Path, lines: int) -> list[str]:
    """The last `lines` lines across the rotated files. If they begin inside a spawn, the
    spawn's header line (`--- dynamod: start #N pid ...`) comes first, wherever it is."""
    return _history(path, lines)[0]


def _history(path: Path, lines: int) -> tuple[list[str], tuple[int, int] | None]:
    """`history`, and where reading stopped in the live file (inode, offset): a follow
    goes on from there, so a line written in between is neither lost nor shown twice."""
    window: deque[tuple[str, str | None]] = deque(maxlen=lines)
    header: str | None = None
    where: tuple[int, int] | None = None
    for part in rotated(path):
        try:
            fh = part.open("rb")
        except FileNotFoundError:  # rotated away while we read
            continue
        with fh:
            while raw := fh.readline(MAX_LINE):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if line.startswith(HEADER):
                    header = line
                window.append((line, header))
            if part == path:
                where = (os.fstat(fh.fileno()).st_ino, fh.tell())
    if not window:
        return [], where
    first, its_header = window[0]
    shown = [line for line, _ in window]
    if its_header is not None and first != its_header:
        shown.insert(0, its_header)
    return shown, where


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
    shown, where = _history(path, lines)
    for line in shown:
        out(line)
    if not follow:
        return
    inode, position = where if where is not None else (-1, 0)
    while True:
        try:
            stat = path.stat()
        except FileNotFoundError:
            time.sleep(poll)
            continue
        if stat.st_ino != inode or stat.st_size < position:  # rotated (or new)
            inode, position = stat.st_ino, 0
        if stat.st_size > position:
            with path.open("rb") as fh:
                fh.seek(position)
                while raw := fh.readline(MAX_LINE):
                    out(raw.decode("utf-8", "replace").rstrip("\n"))
                position = fh.tell()
        time.sleep(poll)
