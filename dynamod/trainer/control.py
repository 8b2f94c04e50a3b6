"""What the trainer asks dynamod: the ledger's version, which shard is which instance, push.

The control-socket client is synchronous; every call here runs in a worker thread so
in-flight rollouts keep streaming meanwhile.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamod.client import Client


@dataclass(frozen=True)
class LedgerState:
    version: int
    path: str | None  # checkpoint of that version; None for the boot weights
    digest: str | None  # what the shards reported loading from it
    shards: dict[str, int | None]  # shard -> applied policy version


@dataclass(frozen=True)
class PushResult:
    version: int
    seconds: float
    digest: str | None
    ack_ms: dict[str, float | str]  # shard -> total ms, or the error of a stale shard
    stale: list[str] = field(default_factory=list)


class Control:
    def __init__(self, state_dir: Path) -> None:
        self.client = Client(state_dir)
        self._shard_of: dict[int, str] = {}

    async def ledger(self) -> LedgerState:
        answer = await asyncio.to_thread(self.client.policy_status)
        return LedgerState(
            version=int(answer["current"]),
            path=answer.get("current_path"),
            digest=answer.get("current_digest"),
            shards={s["name"]: s.get("policy_version") for s in answer.get("shards", [])},
        )

    async def current_version(self) -> int:
        return (await self.ledger()).version

    async def shard_of(self, instance_id: int | None) -> str | None:
        """The unit serving Dynamo instance `instance_id` (status is re-read on a miss,
        since a restarted shard registers under a new instance id)."""
        if instance_id is None:
            return None
        if instance_id not in self._shard_of:
            status = await asyncio.to_thread(self.client.status)
            self._shard_of = _instances(status)
        return self._shard_of.get(instance_id)

    async def push(self, step: int, path: Path) -> PushResult:
        answer = await asyncio.to_thread(self.client.policy_push, step, path)
        acks: dict[str, float | str] = {}
        for shard, ack in sorted(answer.get("acks", {}).items()):
            acks[shard] = float(ack["total_ms"]) if ack.get("ok") else str(ack.get("error"))
        return PushResult(
            version=int(answer["version"]),
            seconds=float(answer["seconds"]),
            digest=answer.get("digest"),
            ack_ms=acks,
            stale=list(answer.get("stale", [])),
        )


def _instances(status: dict[str, Any]) -> dict[int, str]:
    found: dict[int, str] = {}
    for unit in status.get("units", []):
        for instance in (unit.get("dynamo") or {}).get("instance_ids", []):
            found[int(instance)] = unit["name"]
    return found
