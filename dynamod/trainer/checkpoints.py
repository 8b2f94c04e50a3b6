"""Step checkpoints: `<dir>/step-<N>/model.safetensors`, written atomically, last K kept."""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dynamod.workers.weights import WEIGHTS_FILE

_STEP_DIR = re.compile(r"^step-(\d+)$")
_PARTIAL = ".partial"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def step_dirs(root: Path) -> dict[int, Path]:
    """Complete step directories under `root`, by step."""
    if not root.is_dir():
        return {}
    found: dict[int, Path] = {}
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return found


def save_step(root: Path, step: int, tensors: Mapping[str, Any]) -> Path:
    """Write `tensors` as step `step` and return its directory.

    The file is written into `step-<N>.partial` and renamed into place, so a shard never
    loads a half-written checkpoint; a leftover from a crashed run is replaced.
    """
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    staging = final.with_name(final.name + _PARTIAL)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    contiguous = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    save_file(contiguous, str(staging / WEIGHTS_FILE), metadata={"step": str(step)})
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` step directories (and partial leftovers)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    removed: list[Path] = []
    steps = step_dirs(root)
    for step in sorted(steps)[:-keep]:
        shutil.rmtree(steps[step])
        removed.append(steps[step])
    for partial in root.glob(f"step-*{_PARTIAL}") if root.is_dir() else ():
        shutil.rmtree(partial, ignore_errors=True)
        removed.append(partial)
    return removed
