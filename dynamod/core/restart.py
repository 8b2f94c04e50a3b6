"""Restart decisions: policy, exponential backoff with jitter, burst limit. Pure logic.

Times are monotonic seconds passed in by the caller, so tests need no clock.
"""

from __future__ import annotations

import random
import signal
from collections import deque
from dataclasses import dataclass, field

from dynamod.core.spec import RestartSpec

# Looked up on the exit path, where a daemon just woken runs everything cold: a dict read,
# not an enum construction.
_SIGNAL_NAMES = {int(sig): sig.name for sig in signal.Signals}


@dataclass(frozen=True)
class Exit:
    """How a process ended: exit code, or the signal that killed it."""

    code: int | None
    signal: int | None

    @property
    def clean(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        if self.signal is not None:
            return f"killed by {_SIGNAL_NAMES.get(self.signal) or self.signal}"
        return f"exited with status {self.code}"


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay: float = 0.0
    reason: str = ""  # the policy's side: why (not) restarted; the exit is described apart


@dataclass
class RestartTracker:
    spec: RestartSpec
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0  # consecutive restarts since the unit last stayed up `reset_after`
    history: deque[float] = field(default_factory=deque)  # restart times within the window

    @property
    def total(self) -> int:
        return self._total

    def __post_init__(self) -> None:
        self._total = 0
        self.last: Decision | None = None  # the latest restart decided (its delay, why)

    def should_restart(self, exit: Exit, *, premature: bool) -> bool:
        """Policy only. `premature`: the service exited before it was ready or while a
        service is expected to keep running, which counts as a failure even with status 0."""
        policy = self.spec.policy
        if policy == "never":
            return False
        if policy == "always":
            return True
        return premature or not exit.clean

    def delay(self) -> float:
        """first_delay for the first restart after a good run, then backoff_initial growing
        by backoff_factor per consecutive restart, capped at backoff_max, +/- jitter."""
        if self.attempt == 0:
            base = self.spec.first_delay
        else:
            try:  # a unit that never stays up reset_after counts on without bound
                grown = self.spec.backoff_initial * self.spec.backoff_factor ** (self.attempt - 1)
            except OverflowError:
                grown = self.spec.backoff_max
            base = min(self.spec.backoff_max, grown)
        spread = base * self.spec.jitter
        if not spread:
            return max(0.0, base)
        return max(0.0, base + self.rng.uniform(-spread, spread))

    def decide(self, exit: Exit, *, now: float, uptime: float, premature: bool) -> Decision:
        """Record an exit at `now` after `uptime` seconds up; say whether and when to restart."""
        if not self.should_restart(exit, premature=premature):
            return Decision(
                False,
                reason=f"restart policy '{self.spec.policy}' does not restart it",
            )
        if uptime >= self.spec.reset_after:
            self.attempt = 0
        window_start = now - self.spec.limit_interval
        while self.history and self.history[0] < window_start:
            self.history.popleft()
        if len(self.history) >= self.spec.limit_burst:
            limit = (
                f"restart limit reached: {len(self.history)} restarts within"
                f" {self.spec.limit_interval:g}s (limit_burst={self.spec.limit_burst})"
            )
            if self.spec.give_up:
                return Decision(False, reason=limit)
            # An outage that ends must not leave the unit given up on: retry, slowly.
            self.history.append(now)
            self._total += 1
            delay = self.spec.backoff_max
            self.last = Decision(True, delay=delay, reason=f"{limit}; retrying in {delay:.2f}s")
            return self.last
        delay = self.delay()
        self.attempt += 1
        self.history.append(now)
        self._total += 1
        self.last = Decision(True, delay=delay, reason=f"restarting in {delay:.2f}s")
        return self.last

    def reset(self) -> None:
        """Manual restart: forget the burst window and backoff."""
        self.attempt = 0
        self.history.clear()
