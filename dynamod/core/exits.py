"""What a unit's exit means: the state it leads to, the words status shows, and whether
and when it starts again. Pure logic (the restart tracker keeps the count; times are
passed in), so every rule here is tested without a process.

    exit while a dependency is away (and the policy would restart) -> waiting, not counted
    restart policy says no: clean and not premature -> completed, else -> failed
    restart policy says yes: within the restart limit -> backoff; past it -> failed
        (or, with give_up = false, backoff at backoff_max)
    killed by SIGKILL while its memory cgroup counted an OOM kill -> the same decision,
        named "killed by the kernel's OOM killer (memory_max 64M)", not "killed by SIGKILL"
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from dynamod.core.restart import Decision, Exit, RestartTracker
from dynamod.core.spec import UnitSpec
from dynamod.core.state import UnitState


def premature(spec: UnitSpec, *, was_ready: bool) -> bool:
    """Whether an exit counts as a failure even with status 0: a service (not a oneshot)
    that exits before it was ready, or after it, unless its spec says a clean exit after
    it was ready is final."""
    if spec.type == "oneshot":
        return False
    return not was_ready or not spec.restart.clean_exit_final


def before_ready_hint(spec: UnitSpec, last_probe: str) -> str:
    """Why a service that exited before it was ready failed, in words for status."""
    if spec.ready is not None:
        return f"exited before it was ready; last probe: {last_probe}"
    return f"exited within min_uptime {spec.restart.min_uptime:g}s, before it counted as ready"


@dataclass(frozen=True)
class OomKill:
    """The kernel's OOM killer ended the unit: its memory cgroup counted a kill."""

    limit: str | None  # "memory_max 64M"; None when the unit has no memory_max


def oom_kill(exit: Exit, kills: int, limit: str | None) -> OomKill | None:
    """An exit by SIGKILL while the unit's memory cgroup counted `kills` OOM kills since
    its spawn is the OOM killer's; any other exit (an operator's kill -9: no kill counted)
    is not."""
    if exit.signal != signal.SIGKILL or kills <= 0:
        return None
    return OomKill(limit)


def describe_exit(exit: Exit, oom: OomKill | None) -> str:
    """How the process ended, in words: an OOM kill named as such, with its limit."""
    if oom is None:
        return exit.describe()
    return "killed by the kernel's OOM killer" + (f" ({oom.limit})" if oom.limit else "")


@dataclass(frozen=True)
class ExitFacts:
    """What is known when the exit is recorded."""

    exit: Exit
    premature: bool
    uptime: float  # seconds the process was up
    now: float  # monotonic time of the exit
    away: Sequence[str] = ()  # dependencies not meeting their condition, in words
    hint: str | None = None  # why it exited, as far as the engine knows (probe, liveness)
    oom: OomKill | None = None  # the kernel's OOM killer ended it (see `oom_kill`)


@dataclass(frozen=True)
class ExitOutcome:
    state: UnitState
    detail: str
    decision: Decision


def decide_exit(facts: ExitFacts, tracker: RestartTracker) -> ExitOutcome:
    """The state an exit leads to. A restart it decides on is recorded in `tracker`
    (backoff and the restart limit count it); an exit while a dependency is away is not."""
    exit = facts.exit
    what = describe_exit(exit, facts.oom) + (f" ({facts.hint})" if facts.hint else "")
    if facts.away and tracker.should_restart(exit, premature=facts.premature):
        # It exited because what it needs is gone (e.g. Dynamo's lease with etcd): not its
        # own failure, so it does not count against its restart limit; it starts again
        # once the dependency is back.
        return ExitOutcome(
            UnitState.WAITING,
            f"{what}; waiting for {', '.join(facts.away)} (not counted as a restart)",
            Decision(restart=True, reason="dependency away"),
        )
    decision = tracker.decide(exit, now=facts.now, uptime=facts.uptime, premature=facts.premature)
    if decision.restart:
        return ExitOutcome(
            UnitState.BACKOFF, f"{what}; {decision.reason} (restart {tracker.total})", decision
        )
    if exit.clean and not facts.premature:
        return ExitOutcome(UnitState.COMPLETED, what, decision)
    return ExitOutcome(UnitState.FAILED, f"{what}; {decision.reason}", decision)
