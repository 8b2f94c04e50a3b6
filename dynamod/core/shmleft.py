"""The shared memory a unit's killed processes leave in /dev/shm, removed once they are gone.

A process that makes a POSIX shared-memory segment or a named semaphore (a file in
/dev/shm: Python's `multiprocessing.shared_memory`, vLLM's message queues between its
engine and its workers) removes it when it ends cleanly. A process that is killed
cannot: the file stays in /dev/shm, in memory as far as it was written, and nothing
removes it. A real `dynamo.vllm` shard killed -9 left two segments (160 and 240 MiB,
sparse) and a semaphore behind at each kill.

So before dynamod ends what is left of a unit (`process.OsHost.stop_tree`), it notes the
/dev/shm files the unit's live processes hold, open or mapped (`held`). It noted them
once before too, when the unit turned ready (`identities`): a file that only a process
already dead held (the main process, killed first) is known from then, as long as it is
still the same file (`same`). Once the unit's processes are all gone, it removes each of
those files that still exists, belongs to dynamod's own user and that no live process
holds (`remove_unheld`). A file no process holds at all is not known here: the semaphore
a real shard's start leaves registered with Python's resource tracker goes with the
tracker, which dynamod kills after the rest (`process._trackers_last`). Standard library
only; blocking (the daemon calls it in a worker thread).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from dynamod.core import proctable

SHM = Path("/dev/shm")
PROC = Path("/proc")
_DELETED = " (deleted)"  # how /proc names a file that was unlinked while held


def held(pids: Iterable[int], *, shm: Path = SHM, proc: Path = PROC) -> set[Path]:
    """The files under `shm` that the processes `pids` hold: open (their fds) or mapped
    (their maps). A process that is gone, or whose /proc is not ours to read, holds none."""
    prefix = f"{shm}/"
    found: set[Path] = set()
    for pid in pids:
        found |= _held_by(proc / str(pid), prefix)
    return found


def _held_by(root: Path, prefix: str) -> set[Path]:
    found: set[Path] = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root / "fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(entry.path)
                if target.startswith(prefix) and not target.endswith(_DELETED):
                    found.add(Path(target))
    maps = root / "maps"
    with contextlib.suppress(OSError), open(maps, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            at = line.find(prefix)
            if at >= 0:
                path = line[at:].rstrip("\n")
                if not path.endswith(_DELETED):
                    found.add(Path(path))
    return found


def identities(paths: Iterable[Path]) -> dict[Path, int]:
    """Each of `paths` that exists, with its inode: what `same` compares with later."""
    found: dict[Path, int] = {}
    for path in paths:
        with contextlib.suppress(OSError):
            found[path] = os.lstat(path).st_ino
    return found


def same(noted: dict[Path, int]) -> set[Path]:
    """The noted files that are still the files noted (same inode): one removed and made
    again since, by whoever, is not the unit's."""
    kept: set[Path] = set()
    for path, inode in noted.items():
        with contextlib.suppress(OSError):
            if os.lstat(path).st_ino == inode:
                kept.add(path)
    return kept


def remove_unheld(paths: Iterable[Path], *, shm: Path = SHM, proc: Path = PROC,
                  owner: int | None = None) -> list[Path]:
    """Remove each of `paths` that still exists, is owned by `owner` (default: this
    process's effective user) and that no live process holds; the ones removed. Another
    user's file is left: its holders may be processes whose /proc cannot be read."""
    owner = os.geteuid() if owner is None else owner
    candidates = set()
    for path in paths:
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if path.parent == shm and stat.S_ISREG(info.st_mode) and info.st_uid == owner:
                candidates.add(path)
    if not candidates:
        return []
    candidates -= held(proctable.proc_pids(str(proc)), shm=shm, proc=proc)
    removed = []
    for path in sorted(candidates):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed
