"""run.json: the record a daemon keeps of its run in the state dir, so that whoever comes
after it (a new `up`, a `down` that finds no daemon, `up --detach` that lost a race) knows
whose run it was and what to sweep if the daemon died. One typed record, written and read
only here. Standard library only: the CLI reads it before it imports the daemon."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamod.core import proctable
from dynamod.core.atomicfile import StateWriteError, write_atomic

RUN_FILE = "run.json"


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    pid: int | None  # the daemon's
    stack: str  # the stack file
    stack_name: str
    guardian_pid: int | None = None
    containment: str | None = None
    cgroup: str | None = None  # the run's cgroup, if it had one
    orphans: tuple[tuple[int, int], ...] = ()  # unmarked leftovers: (pid, start time)
    stopping: bool = False  # the daemon had begun a `down` (or SIGTERM)
    ended: str | None = None  # "down" or "swept": nothing of this run is left to sweep

    def daemon_alive(self) -> bool:
        """Whether the run's daemon process is still running. A zombie is not: it holds no
        lock and serves no socket, and a detached daemon's zombie waits for whatever reaps
        orphans here (in a local run of the suite it outlived the daemon, so a losing `up`
        named the previous run's daemon as the winner)."""
        return self.pid is not None and not proctable.is_zombie(self.pid)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["orphans"] = [list(o) for o in self.orphans]
        return data

    @classmethod
    def from_json(cls, data: object) -> RunRecord | None:
        """The record in DATA, or None if it is not one (no run id). Fields of the wrong
        type read as absent, so a damaged file never stops a sweep."""
        if not isinstance(data, dict):
            return None
        run_id, pid = data.get("run_id"), data.get("pid")
        if not isinstance(run_id, str):
            return None
        stack = _str_or_none(data.get("stack")) or ""
        return cls(
            run_id=run_id,
            pid=pid if _is_int(pid) else None,
            stack=stack,
            stack_name=_str_or_none(data.get("stack_name")) or Path(stack).stem,
            guardian_pid=data["guardian_pid"] if _is_int(data.get("guardian_pid")) else None,
            containment=_str_or_none(data.get("containment")),
            cgroup=_str_or_none(data.get("cgroup")),
            orphans=tuple(
                (entry[0], entry[1])
                for entry in data.get("orphans") or []
                if isinstance(entry, list) and len(entry) == 2 and all(map(_is_int, entry))
            ),
            stopping=data.get("stopping") is True,
            ended=_str_or_none(data.get("ended")),
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def read(state_dir: Path) -> RunRecord | None:
    """The state dir's run record; None if there is none or it cannot be read."""
    try:
        data = json.loads((state_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return RunRecord.from_json(data)


def write(state_dir: Path, record: RunRecord) -> None:
    """Replace run.json; raises StateWriteError (the old one kept) if it cannot."""
    write_atomic(state_dir / RUN_FILE, json.dumps(record.to_json(), indent=2).encode())


def mark_ended(state_dir: Path, how: str) -> None:
    """Record that the run is over (`down` finished, or it was swept)."""
    record = read(state_dir)
    if record is None:
        return
    # A full disk keeps the old run.json: the next up/down then finds nothing alive to sweep.
    with contextlib.suppress(StateWriteError):
        write(state_dir, dataclasses.replace(record, ended=how))
