"""What the spare pool (spares.py) drives a shard with: the policy manager's operations on
one shard (policy.py), named here so neither module needs the other's class. A shard's
acknowledgement of a version, `ShardAck`, is what those operations return; `ShardPolicy`
is what the manager knows of each shard's policy, which the pool reads."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dynamod.core.status import ExtensionUnitStatus, PolicyStatus

if TYPE_CHECKING:
    from dynamod.core.engine import Engine, Unit
    from dynamod.rollout.ledger import Ledger, PolicyVersion
    from dynamod.rollout.policy_table import PolicySpec


@dataclass
class ShardAck:
    """A shard holds `version` (its weights' `digest`), verified; `timings_ms` per step;
    `waited_ms` in line for an update slot before the first (`[policy] max_updating`)."""

    shard: str
    version: int
    digest: str | None
    timings_ms: dict[str, float] = field(default_factory=dict)
    waited_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": True,
            "version": self.version,
            "digest": self.digest,
            "ms": {k: round(v, 1) for k, v in self.timings_ms.items()},
            "total_ms": round(sum(self.timings_ms.values()), 1),
            "waited_ms": round(self.waited_ms, 1),
        }


@dataclass
class ShardPolicy:
    """One shard's policy as the policy manager knows it: `policy` and `policy_version` in
    its status row. The manager alone writes it; the spare pool reads it."""

    current: int | None = None  # the ledger's version, as last read
    version: int | None = None  # the version it holds, verified; None since it (re)started
    version_known: bool = False  # it acknowledged a version, or exited since: status says so
    admitted: bool = False
    digest: str | None = None
    last_ack_ms: dict[str, float] = field(default_factory=dict)
    last_error: str | None = None
    routed_version: int | None = None  # a canary through the frontend reached it at this one

    def acknowledged(self, ack: ShardAck, *, current: int | None, admitted: bool) -> None:
        self.version, self.version_known, self.digest = ack.version, True, ack.digest
        self.current, self.admitted = current, admitted
        self.last_ack_ms, self.last_error = ack.as_dict()["ms"], None

    def exited(self) -> None:
        self.version, self.version_known, self.admitted = None, True, False

    def as_status(self) -> ExtensionUnitStatus:
        policy: PolicyStatus = {
            "current": self.current,
            "admitted": self.admitted,
            "digest": self.digest,
            "last_ack_ms": dict(self.last_ack_ms),
            "last_error": self.last_error,
            "routed_version": self.routed_version,
        }
        if not self.version_known:
            return {"policy": policy}
        policy["version"] = self.version
        return {"policy": policy, "policy_version": self.version}


class ShardDriver(Protocol):
    """The shard operations the policy manager offers the spare pool, and what they read."""

    @property
    def spec(self) -> PolicySpec: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def shard_names(self) -> set[str]: ...

    @property
    def current_version(self) -> int | None: ...  # the ledger's, as last read

    @property
    def lock(self) -> asyncio.Lock: ...  # one policy operation (push, publish, admission) at a time

    def ledger(self) -> Ledger: ...

    def shard_policy(self, unit: Unit) -> ShardPolicy:
        """What the manager knows of the shard's policy (read it; the manager writes it)."""
        ...

    def note_error(self, unit: Unit, error: str) -> None:
        """A replay into the shard failed (its `last_error` in status)."""

    def event(self, kind: str, unit: str | None, **fields: Any) -> None:
        """Record what happened in the stack's events file (`dynamod events`)."""

    def note_current(self, current: PolicyVersion | None) -> None:
        """The ledger was read: `current` is its version now."""

    async def call(self, unit: Unit, route: str, payload: dict[str, Any]) -> dict[str, Any]:
        """One engine admin route of the shard; raises a DynamodError if it failed."""
        ...

    async def apply(self, unit: Unit, target: PolicyVersion | None) -> ShardAck:
        """Replay `target` into the shard: pause, load, flush, verify, taint, resume."""
        ...

    async def routed(self, unit: Unit, version: int) -> None:
        """Until a canary with this version's taint reaches the shard through the frontend."""

    async def warm(self, unit: Unit) -> float | None:
        """One generation served by the shard itself (pinned to its instance through the
        frontend), so that its engine's first step is behind it; the ms it took, or None
        when no frontend is ready. Raises a DynamodError if it was not served."""

    async def record_ack(self, unit: Unit, ack: ShardAck) -> None:
        """The shard holds `ack.version`: record it (its ShardPolicy; a serving shard's in
        the ledger too)."""

    def routing_taints(self, unit: Unit, version: int) -> tuple[list[str], list[str]]:
        """(the version's taint, none for a spare; the shard's own instance taints)."""
        ...
