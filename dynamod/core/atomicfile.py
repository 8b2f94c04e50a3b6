"""Writing a file that must survive: temp file in the same directory, fsync, rename, fsync
the directory. A write that fails (a full disk) leaves the old version in place and raises
StateWriteError naming the file."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from dynamod.core.errors import DynamodError


class StateWriteError(DynamodError):
    """A state file could not be replaced; the previous version is still there."""

    def __init__(self, path: Path, cause: OSError) -> None:
        self.path = path
        self.cause = cause
        why = "disk full" if cause.errno in {errno.ENOSPC, errno.EDQUOT} else cause.strerror
        super().__init__(f"cannot write {path}: {why or cause}; the previous version is kept")


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise StateWriteError(path, exc) from exc
    with contextlib.suppress(OSError):  # the rename is durable once the directory is
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
