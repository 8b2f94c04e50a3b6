"""The stack's phase, as the daemon reports it and its extensions watch it."""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    STARTING = "starting"
    UP = "up"
    DEGRADED = "degraded"  # was up; a unit is not ready now (see Daemon.degraded_units)
    FAILED = "failed"  # bring-up failed; tearing down
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def running(self) -> bool:
        """Starting or up: commands that change the stack may still run."""
        return self in {Phase.STARTING, Phase.UP, Phase.DEGRADED}
