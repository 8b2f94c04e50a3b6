"""verl's weights (a stream of `(name, tensor)`) as a checkpoint directory dynamod can push.

The directory is `<checkpoint_dir>/step-<N>/model.safetensors`, the layout every shard's
`update_weights_from_disk` loads and the ledger replays from; the last `keep` steps are
kept (the ledger's current version must stay loadable for a shard that rejoins later).

The colocated path sends the weights over IPC and keeps no file, so for replays it
writes one every step with `CheckpointWriter`: the trainer's stall is a host copy of the
tensors (`HostCopy`, taken while they are sent); the file is written on a background
thread, one step at a time (a step waits only if the previous write is still running,
which bounds the host copies held to two). Each directory appears atomically, so a
replay that starts before its write ends finds no directory, fails and is retried.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from dynamod.workers.weights import WEIGHTS_FILE

STEP_PREFIX = "step-"

log = structlog.get_logger("dynamod.integrations.verl")


ORIGIN = "verl.json"


def write_checkpoint(weights: Iterable[tuple[str, Any]], root: Path, step: int,
                     origin: dict[str, Any] | None = None) -> Path:
    """Write the tensors for `step`; returns the step's directory. Atomic per directory.
    `origin` (verl's run and step) goes beside them as verl.json."""
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights}
    final = step_dir(root, step)
    partial = root / f".{STEP_PREFIX}{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / WEIGHTS_FILE))
    if origin is not None:
        (partial / ORIGIN).write_text(json.dumps({**origin, "version": step}) + "\n")
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


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step}"


class HostCopy:
    """The tensors of one update copied to host memory as they go by (a sender's tap)."""

    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}
        self.seconds = 0.0

    def __call__(self, name: str, tensor: Any) -> None:
        started = time.monotonic()
        self.tensors[name] = tensor.detach().to("cpu", copy=True)
        self.seconds += time.monotonic() - started


class CheckpointWriter:
    """Step checkpoints for replays, written in the background (`submit`) or inline
    (`write`); then the directories beyond the newest `keep` are pruned."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root = root
        self.keep = keep
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dynamod-checkpoint")
        self._last: Future[Path] | None = None
        self.last_write_s: float | None = None

    def write(self, tensors: dict[str, Any], step: int) -> Path:
        started = time.monotonic()
        path = write_checkpoint(tensors.items(), self.root, step)
        prune(self.root, self.keep, step)
        self.last_write_s = time.monotonic() - started
        log.info("verl.checkpoint_written", step=step, path=str(path),
                 seconds=round(self.last_write_s, 3))
        return path

    def submit(self, tensors: dict[str, Any], step: int) -> Path:
        """Queue the write; returns where it will be. Waits for the previous one first."""
        self.wait()
        self._last = self._pool.submit(self.write, tensors, step)
        return step_dir(self.root, step)

    def wait(self) -> Path | None:
        """The previous background write's directory, once written (its error raised)."""
        last, self._last = self._last, None
        return last.result() if last is not None else None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
