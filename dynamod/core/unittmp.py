"""Each unit's private temporary directory: `<state dir>/tmp/<unit>`.

Engines leave files in the temporary directory whatever their exit: vLLM its ZMQ socket
files (`/tmp/<uuid>`) and `vllm_dist_*`, Dynamo a `tmpXXXX.json` per process start,
Prometheus' multiprocess dirs. Each unit is spawned with TMPDIR (and TMP, TEMP) pointing
at a directory of its own, made empty at every spawn (what a killed run left is gone
before the next one starts) and removed with the whole tree when the stack is torn down,
so `down` leaves no file behind outside the state dir.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT_NAME = "tmp"
VARIABLES = ("TMPDIR", "TMP", "TEMP")


def root(state_dir: Path) -> Path:
    return state_dir / ROOT_NAME


def path(state_dir: Path, unit: str) -> Path:
    return root(state_dir) / unit


def fresh(state_dir: Path, unit: str) -> dict[str, str]:
    """Empty (or make) the unit's directory; the variables that point its process there."""
    where = path(state_dir, unit)
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True, mode=0o700)
    return {name: str(where) for name in VARIABLES}


def remove_all(state_dir: Path) -> list[str]:
    """Remove every unit's directory; the names of those that held anything."""
    top = root(state_dir)
    if not top.is_dir():
        return []
    used = sorted(p.name for p in top.iterdir() if p.is_dir() and any(p.iterdir()))
    shutil.rmtree(top, ignore_errors=True)
    return used
