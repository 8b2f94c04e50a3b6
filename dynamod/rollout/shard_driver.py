"""What the spare pool (spares.py) drives a shard with: the policy manager's operations on
one shard (policy.py), named here so neither module needs the other's class. A shard's
acknowledgement of a version, `ShardAck`, is what those operations return."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from dynamod.core.engine import Engine, Unit
    from dynamod.core.spec import PolicySpec
    from dynamod.rollout.ledger import Ledger, PolicyVersion


@dataclass
class ShardAck:
    """A shard holds `version` (its weights' `digest`), verified; `timings_ms` per step."""

    shard: str
    version: int
    digest: str | None
    timings_ms: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": True,
            "version": self.version,
            "digest": self.digest,
            "ms": {k: round(v, 1) for k, v in self.timings_ms.items()},
            "total_ms": round(sum(self.timings_ms.values()), 1),
        }


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

    async def record_ack(self, unit: Unit, ack: ShardAck) -> None:
        """The shard holds `ack.version`: record it (the ledger, status)."""

    def routing_taints(self, unit: Unit, version: int) -> tuple[list[str], list[str]]:
        """(the version's taint, none for a spare; the shard's own instance taints)."""
        ...
