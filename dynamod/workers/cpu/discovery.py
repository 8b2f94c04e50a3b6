"""The engine's private discovery directory (Dynamo's file KV, `DYN_FILE_KV`): one per
worker process, `<TMPDIR>/dynamod-cpu-worker-<pid>-<random>`.

The worker removes it at exit; a worker killed by SIGKILL cannot. Under dynamod that is no
litter (each unit's TMPDIR is its own, emptied at every spawn), but under supervisord, a
shell or a test harness every kill -9 left an empty directory in /tmp (162 of them on a
development machine in a day of test runs). So each worker, as it starts, also removes
those of the workers that are gone: the pid in the name, no such process any more.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from dynamod.core.proctable import pid_alive

PREFIX = "dynamod-cpu-worker-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-")


def directory() -> tempfile.TemporaryDirectory[str]:
    """This process's directory (removed when the context ends), after sweeping the
    directories of workers that are gone."""
    sweep(Path(tempfile.gettempdir()))
    return tempfile.TemporaryDirectory(prefix=f"{PREFIX}{os.getpid()}-")


def sweep(where: Path) -> list[Path]:
    """Remove the discovery directories in `where` whose worker process is gone; the ones
    removed. A directory whose pid is alive (another worker, or a process that took its
    pid) is left alone."""
    removed = []
    for path in where.glob(f"{PREFIX}*"):
        match = _NAME.match(path.name)
        if match is None or not path.is_dir() or path.is_symlink():
            continue
        if pid_alive(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
