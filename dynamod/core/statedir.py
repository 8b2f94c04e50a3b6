"""Whether a path can be a state dir, decided before anything is created; and creating it.

A state dir that is a file, lies under a file, cannot be written or is too deep for the
control socket's path is refused with one StateDirError naming it, before any command
writes a byte or spawns a process. `create` turns the OS's refusal into the same error.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dynamod.core import paths
from dynamod.core.errors import StateDirError


def check(path: Path, *, will_create: bool) -> None:
    """Raise StateDirError if `path` cannot be a state dir. Reads only; with `will_create`
    also whether this user could create (or write into) it."""
    if "\0" in str(path):
        raise StateDirError(path, "contains a NUL character")
    too_deep = paths.check_socket_path(path)
    if too_deep:
        raise StateDirError(path, too_deep.removeprefix(f"state dir {path} "))
    existing, info = _deepest_existing(path)
    if not stat.S_ISDIR(info.st_mode):
        what = (
            "exists and is not a directory"
            if existing == path
            else f"cannot be created: {existing} is not a directory"
        )
        raise StateDirError(path, what)
    if will_create and not os.access(existing, os.W_OK | os.X_OK):
        what = (
            "is not writable"
            if existing == path
            else f"cannot be created: {existing} is not writable"
        )
        raise StateDirError(path, what)


def _deepest_existing(path: Path) -> tuple[Path, os.stat_result]:
    """From / down: the last component of `path` that exists, stopping at a non-directory."""
    found = Path(path.anchor or "/")
    info = os.stat(found)
    for part in path.parts[1:]:
        if not stat.S_ISDIR(info.st_mode):
            break
        try:
            info = os.stat(found / part)
        except FileNotFoundError:
            break
        except OSError as exc:
            raise StateDirError(path, f"cannot be used: {exc.strerror or exc}") from None
        found = found / part
    return found, info


def create(path: Path) -> None:
    """mkdir -p, mode 0700. Raises StateDirError with the OS's reason."""
    check(path, will_create=True)
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
    except OSError as exc:
        raise StateDirError(path, f"cannot be created: {exc.strerror or exc}") from None
