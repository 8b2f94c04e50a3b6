"""The unit state machine: an explicit enum and the transitions it allows. Pure logic.

    inactive --spawn--> starting --probe ok--> ready <--> degraded (liveness failing)
                            |                   |  \\
                            |                   |   held (rollout shard not admitted yet)
                            v                   v
                         backoff <---exit--- (any running state)
                            |                   |
                            |                   +--exit while a dependency is away--> waiting
                            |                                                            |
                            +--limit hit--> failed    waiting --dependency back--> starting
    oneshot exit 0 -> completed;  any state --down--> stopping -> stopped
"""

from __future__ import annotations

from enum import StrEnum


class UnitState(StrEnum):
    INACTIVE = "inactive"  # not started yet (waiting for dependencies)
    STARTING = "starting"  # spawned; readiness probe not yet passed
    READY = "ready"
    HELD = "held"  # running but kept out of routing (rollout shard catching up)
    DEGRADED = "degraded"  # liveness probe failing, below the restart threshold
    BACKOFF = "backoff"  # exited; waiting before the next start
    WAITING = "waiting"  # exited while a dependency was away; starts again once it is back
    FAILED = "failed"  # gave up: restart limit, policy 'never', or cannot start
    COMPLETED = "completed"  # exited 0 and is not to be restarted
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def running(self) -> bool:
        return self in _RUNNING

    @property
    def settled(self) -> bool:
        """No process and nothing scheduled: the unit stays like this until told otherwise."""
        return self in {UnitState.FAILED, UnitState.COMPLETED, UnitState.STOPPED}


_RUNNING = {UnitState.STARTING, UnitState.READY, UnitState.HELD, UnitState.DEGRADED}

_ANY_RUNNING_EXIT = {
    UnitState.BACKOFF,
    UnitState.WAITING,
    UnitState.FAILED,
    UnitState.COMPLETED,
    UnitState.STOPPING,
}

ALLOWED: dict[UnitState, frozenset[UnitState]] = {
    UnitState.INACTIVE: frozenset({UnitState.STARTING, UnitState.FAILED, UnitState.STOPPED}),
    UnitState.STARTING: frozenset({UnitState.READY, UnitState.HELD, *_ANY_RUNNING_EXIT}),
    UnitState.READY: frozenset({UnitState.DEGRADED, UnitState.HELD, *_ANY_RUNNING_EXIT}),
    UnitState.HELD: frozenset({UnitState.READY, UnitState.DEGRADED, *_ANY_RUNNING_EXIT}),
    UnitState.DEGRADED: frozenset({UnitState.READY, UnitState.HELD, *_ANY_RUNNING_EXIT}),
    UnitState.BACKOFF: frozenset(
        {UnitState.STARTING, UnitState.WAITING, UnitState.FAILED, UnitState.STOPPED}
    ),
    UnitState.WAITING: frozenset({UnitState.STARTING, UnitState.FAILED, UnitState.STOPPED}),
    UnitState.FAILED: frozenset({UnitState.STARTING, UnitState.STOPPED}),
    UnitState.COMPLETED: frozenset({UnitState.STARTING, UnitState.STOPPED}),
    UnitState.STOPPING: frozenset({UnitState.STOPPED}),
    UnitState.STOPPED: frozenset({UnitState.STARTING}),
}


class IllegalTransition(Exception):
    def __init__(self, unit: str, old: UnitState, new: UnitState) -> None:
        self.unit, self.old, self.new = unit, old, new
        allowed = ", ".join(sorted(ALLOWED[old])) or "nothing"
        super().__init__(f"{unit}: {old} -> {new} is not allowed (from {old}: {allowed})")


def check_transition(unit: str, old: UnitState, new: UnitState) -> None:
    if new not in ALLOWED[old]:
        raise IllegalTransition(unit, old, new)
