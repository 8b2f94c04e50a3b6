"""What a push left in etcd's history, key by key: etcd keeps every revision until a
compaction (the stock units compact after an hour, so none happens inside a fleet run),
and a watch opened at the revision before the push replays every write since. Each
write's bytes (key and value) are summed by the kind of key it is."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from dynamod.rollout.etcd import EtcdClient

REPLAY_S = 5.0  # a historic watch delivers at once: this bounds the read, whatever happens
LAST_S = 0.2  # after the last revision's first event, for the rest of its transaction


def key_class(key: str) -> str:
    """The kind of an etcd key, for the breakdown: dynamod's by area under the stack
    (`dynamod/<stack>/cluster/nodes/n1` -> `cluster/nodes`, `dynamod/<stack>/shards/w` ->
    `shards`), Dynamo's by its second segment (`v1/instances/...` -> `dynamo instances`)."""
    parts = key.split("/")
    if parts[0] == "dynamod" and len(parts) >= 4:
        area = parts[2]
        return f"{area}/{parts[3]}" if area in ("cluster", "policy") else area
    if parts[0] == "v1" and len(parts) >= 2:
        return f"dynamo {parts[1]}"
    return parts[0] or "(empty)"


def add_write(totals: dict[str, dict[str, float]], key: str, value: bytes) -> None:
    entry = totals.setdefault(key_class(key), {"writes": 0.0, "kb": 0.0})
    entry["writes"] += 1
    entry["kb"] += (len(key.encode()) + len(value)) / 1024


async def writes_between(url: str, first: int, last: int) -> dict[str, dict[str, float]]:
    """Writes (puts and deletes) etcd made from revision `first` to `last`, by key class."""
    totals: dict[str, dict[str, float]] = {}
    if last < first:
        return totals
    async with EtcdClient([url]) as etcd:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REPLAY_S) as deadline:
                async for event in etcd.watch_prefix("", start_revision=first):
                    if event.mod_revision > last:
                        break
                    add_write(totals, event.key, event.value)
                    if event.mod_revision == last:  # its transaction's other keys come with it
                        deadline.reschedule(asyncio.get_running_loop().time() + LAST_S)
    return totals


def by_class(totals: dict[str, dict[str, float]]) -> list[tuple[str, float, float]]:
    """(class, writes, KB), most KB first."""
    rows = [(name, v["writes"], v["kb"]) for name, v in totals.items()]
    return sorted(rows, key=lambda row: -row[2])


def summary_of(totals: dict[str, Any]) -> str:
    return ", ".join(f"{name} {kb:.0f} KB ({writes:.0f})" for name, writes, kb in by_class(totals))
