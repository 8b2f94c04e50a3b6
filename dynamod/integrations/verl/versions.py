"""verl's step -> the ledger's policy version, for one trainer process.

verl numbers its updates from its own `global_steps`: 0 for the weights it starts from,
then 1, 2, ... (or k+1, ... when it resumed from its checkpoint at step k). The ledger
only moves forward, and a stack outlives a training run: a second run, or a run resumed
from an older checkpoint, starts below the ledger's current version. So a trainer
process fixes an offset at its first update: none when its step is already ahead of the
ledger (a fresh stack: version = step), else the one that makes that step the version
right after the ledger's. Later steps keep the offset, so versions stay consecutive and
never go backwards. Each push records verl's run and step beside the version it became
(`<state_dir>/verl/updates.jsonl`, and `verl.json` in the checkpoint the ledger points to).
"""

from __future__ import annotations

import os
import time

import structlog

log = structlog.get_logger("dynamod.integrations.verl")


def new_run_id() -> str:
    """A name for this trainer process's run: start time and pid."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


class StepVersions:
    """State: the run's name and the offset fixed at its first update (None before)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.offset: int | None = None

    def version(self, step: int, current: int, initial: bool) -> int:
        """The ledger version for verl's `step`, the ledger being at `current` (`initial`:
        nothing pushed yet)."""
        if self.offset is None:
            self.offset = 0 if initial or step > current else current + 1 - step
            if self.offset:
                log.info("verl.steps_follow_ledger", run=self.run, step=step,
                         ledger=current, version=step + self.offset,
                         reason="the ledger is ahead of verl's step; versions move forward")
        return step + self.offset
