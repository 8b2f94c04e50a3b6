"""Containment in cgroup v2: find a writable hierarchy at daemon start, give the stack one
cgroup per daemon run and each unit instance a child of it, and list, kill and remove what
is in them. A process in a unit's cgroup cannot leave it by forking, changing session or
clearing its environment, so "nothing left" is one file: `cgroup.events` says
`populated 0`. Without such a hierarchy (or with DYNAMOD_CONTAINMENT=pgroup) the daemon
falls back to process groups, markers and the subreaper, and `Containment` says why.
Standard library only: the guardian and the CLI's sweep use it too.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from dynamod.core.errors import DynamodError

CONTAINMENT_ENV = "DYNAMOD_CONTAINMENT"  # auto (default) | cgroup | pgroup
CONTROLLERS = ("memory", "cpu", "cpuset", "pids")  # what a unit's `limits` use
_SETTINGS = ("auto", "cgroup", "pgroup")


class Kind(StrEnum):
    CGROUP = "cgroup"
    PGROUP = "pgroup"  # process groups + env markers + subreaper


class CgroupError(DynamodError):
    """A cgroup operation failed; names the cgroup and what was tried."""

    def __init__(self, path: Path, what: str, error: OSError | str) -> None:
        self.path, self.what = path, what
        why = error.strerror or str(error) if isinstance(error, OSError) else error
        super().__init__(f"cgroup {path}: {what} failed: {why}")


@dataclass(frozen=True)
class Containment:
    """Which containment is in force for one daemon run, and why."""

    kind: Kind
    root: Path | None  # the stack's cgroup (kind CGROUP)
    reason: str = ""  # why the fallback (kind PGROUP)

    def describe(self) -> str:
        if self.kind is Kind.CGROUP:
            return f"cgroup v2 at {self.root}"
        return f"process groups + markers ({self.reason})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "cgroup": str(self.root) if self.root else None,
            "reason": self.reason or None,
            "summary": self.describe(),
        }

    def unit(self, name: str) -> Path | None:
        return self.root / name if self.root is not None else None


def setting(environ: dict[str, str] | None = None) -> str:
    """The containment asked for; raises ValueError naming the variable if it is not known."""
    value = (environ if environ is not None else os.environ).get(CONTAINMENT_ENV, "auto")
    value = value.strip().lower() or "auto"
    if value not in _SETTINGS:
        raise ValueError(
            f"environment variable {CONTAINMENT_ENV}={value!r}: expected one of "
            f"{', '.join(_SETTINGS)}"
        )
    return value


def own_cgroup_dir(
    mountinfo: str | None = None, proc_cgroup: str | None = None
) -> tuple[Path | None, str]:
    """The directory of this process's own cgroup v2, or None and why there is none."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError as exc:
            return None, f"cannot read /proc/self/cgroup: {exc.strerror}"
    own = next((line[3:] for line in proc_cgroup.splitlines() if line.startswith("0::")), None)
    if own is None:
        return None, "no cgroup v2 entry in /proc/self/cgroup"
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError as exc:
            return None, f"cannot read /proc/self/mountinfo: {exc.strerror}"
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        if fstype != "cgroup2":
            continue
        root, mountpoint = fields[3], fields[4]
        if own == root or own.startswith(root.rstrip("/") + "/"):
            rel = own[len(root.rstrip("/")) :].lstrip("/")
            return Path(mountpoint) / rel if rel else Path(mountpoint), ""
    return None, "no cgroup2 mount holds this process's cgroup"


def detect(run_id: str, environ: dict[str, str] | None = None) -> Containment:
    """Choose the containment for a daemon run and, for cgroups, create the stack's cgroup.

    Raises ValueError for an unknown setting, CgroupError if cgroups were required
    (DYNAMOD_CONTAINMENT=cgroup) and cannot be had.
    """
    wanted = setting(environ)
    if wanted == "pgroup":
        return Containment(Kind.PGROUP, None, f"forced by {CONTAINMENT_ENV}=pgroup")
    base, why = own_cgroup_dir()
    root = base / f"dynamod-{run_id}" if base is not None else None
    if root is not None:
        try:
            root.mkdir()
            if not (root / "cgroup.kill").exists():
                os.rmdir(root)
                why = f"{base} has no cgroup.kill (kernel older than 5.14)"
            else:
                return Containment(Kind.CGROUP, root)
        except OSError as exc:
            why = f"cannot create {root}: {exc.strerror}"
    if wanted == "cgroup":
        raise CgroupError(root or Path("/sys/fs/cgroup"), f"{CONTAINMENT_ENV}=cgroup", why)
    return Containment(Kind.PGROUP, None, f"no writable cgroup v2: {why}")


# --------------------------------------------------------------------------- v1


def v1_hierarchies(
    proc_cgroup: str | None = None, mountinfo: str | None = None
) -> dict[str, Path]:
    """controller -> this process's cgroup directory in that controller's v1 hierarchy
    (hybrid and older hosts), for the controllers a unit's `limits` use."""
    try:
        proc_cgroup = proc_cgroup or Path("/proc/self/cgroup").read_text()
        mountinfo = mountinfo or Path("/proc/self/mountinfo").read_text()
    except OSError:
        return {}
    own: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[1]:
            for controller in parts[1].split(","):
                own[controller] = parts[2]
    found: dict[str, Path] = {}
    for line in mountinfo.splitlines():
        if " - " not in line:
            continue
        fields, (fstype, _source, options) = line.split(), line.split(" - ", 1)[1].split()[:3]
        if fstype != "cgroup" or len(fields) < 5:
            continue
        root, mountpoint = fields[3], fields[4]
        for controller in options.split(","):
            path = own.get(controller)
            if controller not in CONTROLLERS or path is None:
                continue
            if path == root or path.startswith(root.rstrip("/") + "/"):
                rel = path[len(root.rstrip("/")) :].lstrip("/")
                found[controller] = Path(mountpoint) / rel if rel else Path(mountpoint)
    return found


def remove_v1_run(run_id: str, hierarchies: dict[str, Path] | None = None) -> list[Path]:
    """Remove a run's cgroups from every v1 hierarchy (made for its units' limits) once
    their processes are gone (the guardian's and the next command's sweep of a daemon
    that died); returns those that could not be removed."""
    bases = set((v1_hierarchies() if hierarchies is None else hierarchies).values())
    paths = [base / f"dynamod-{run_id}" for base in sorted(bases)]
    return [path for path in paths if path.exists() and not remove_waiting(path, 1.0)]


# --------------------------------------------------------------------------- one cgroup


def make(path: Path) -> None:
    try:
        path.mkdir(exist_ok=True)
    except OSError as exc:
        raise CgroupError(path, "mkdir", exc) from exc


def procs(path: Path) -> list[int]:
    """Pids in this cgroup and every cgroup below it."""
    found: list[int] = []
    try:
        text = (path / "cgroup.procs").read_text()
    except OSError:
        return found
    found += [int(x) for x in text.split()]
    for entry in _children(path):
        found += procs(entry)
    return found


def populated(path: Path) -> bool:
    """True while any process lives in this cgroup or below. One file read."""
    try:
        text = (path / "cgroup.events").read_text()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CgroupError(path, "reading cgroup.events", exc) from exc
    return "populated 1" in text


def kill(path: Path) -> None:
    """SIGKILL every process in this cgroup and below, atomically with respect to forks."""
    try:
        (path / "cgroup.kill").write_text("1")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CgroupError(path, "writing cgroup.kill", exc) from exc


def remove(path: Path) -> bool:
    """Remove an empty cgroup and its (empty) children; False if one still holds processes."""
    ok = True
    for entry in _children(path):
        ok = remove(entry) and ok
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return ok


def remove_waiting(path: Path, wait: float) -> bool:
    """`remove`, retried for up to `wait` seconds: a process just reaped may keep a
    cgroup busy for a moment."""
    deadline = time.monotonic() + wait
    while not remove(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def empty_and_remove(path: Path, timeout: float = 5.0) -> tuple[list[int], list[int]]:
    """Kill whatever is in `path` (and below), wait until it is empty, remove it.

    Returns (killed, survivors): the pids found before the kill, and those still in it
    when the timeout ran out. Blocking (10 ms steps): for the guardian and the sweeps.
    """
    if not path.exists():
        return [], []
    found = procs(path)
    if found:
        kill(path)
    deadline = time.monotonic() + timeout
    while populated(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    survivors = procs(path) if populated(path) else []
    remove(path)
    return found, survivors


def _children(path: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
