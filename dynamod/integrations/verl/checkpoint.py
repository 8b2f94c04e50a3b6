"""verl's weights (a stream of `(name, tensor)`) as a checkpoint directory dynamod can push.

The directory is `<checkpoint_dir>/step-<N>/model.safetensors`, the layout every shard's
`update_weights_from_disk` loads and the ledger replays from; the last `keep` steps are
kept (the ledger's current version must stay loadable for a shard that rejoins later).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dynamod.workers.weights import WEIGHTS_FILE

STEP_PREFIX = "step-"


def write_checkpoint(weights: Iterable[tuple[str, Any]], root: Path, step: int) -> Path:
    """Write the tensors for `step`; returns the step's directory. Atomic per directory."""
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights}
    final = root / f"{STEP_PREFIX}{step}"
    partial = root / f".{STEP_PREFIX}{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / WEIGHTS_FILE))
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final


def prune(root: Path, keep: int, current: int) -> list[Path]:
    """Remove all but the newest `keep` step directories (never `current`)."""
    steps = sorted(
        (int(p.name[len(STEP_PREFIX):]), p)
        for p in root.glob(f"{STEP_PREFIX}*")
        if p.name[len(STEP_PREFIX):].isdigit()
    )
    removed = []
    for step, path in steps[:-keep] if keep > 0 else steps:
        if step != current:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
