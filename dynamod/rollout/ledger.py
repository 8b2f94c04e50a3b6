"""The policy ledger: the job's current policy version and what each shard has applied.

Kept in etcd (shared by every node, survives dynamod's own restart) or, for stacks
without etcd, in a JSON file in the state dir. Keys (etcd):

    dynamod/<stack>/policy/current          {"version", "path", "digest", "published_at", "how"}
    dynamod/<stack>/policy/history/<v:012>  the same, one per kept version (last K)
    dynamod/<stack>/shards/<name>           {"applied_version", "digest", "acked_at", "last_error"}
    dynamod/<stack>/leases/<unit>           {"namespace", "instance_ids", "recorded_at"}
    dynamod/<stack>/leases/<node>/<unit>    the same, in a cluster stack (one key a node's unit)

The `leases` keys (`LeaseRecords`) are kept in the etcd the workers register in, for every
Dynamo stack, with or without a ledger: each live worker unit's Dynamo instance ids (= its
etcd lease ids), so a daemon started after one that was SIGKILLed knows which
registrations its own dead units left, and which belong to another stack's live units. In
a cluster stack every node has workers of the same unit names (`worker@0`), so the key
names the node too; a record of the single-node shape is still read (as no node's).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from dynamod.core.atomicfile import write_atomic
from dynamod.rollout.etcd import (
    TXN_OPS,
    EtcdClient,
    EtcdPermissionDenied,
    KeyValue,
    TxnDelete,
    TxnOp,
    TxnPut,
    WatchEvent,
)


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    path: str
    digest: str | None
    published_at: float  # wall-clock seconds, for people
    how: str  # "push" (dynamod loaded it into the shards) or "publish" (the trainer did)


@dataclass(frozen=True)
class ShardRecord:
    name: str
    applied_version: int | None
    digest: str | None
    acked_at: float | None
    last_error: str | None = None


class Ledger(Protocol):
    async def current(self) -> PolicyVersion | None: ...

    async def history(self) -> list[PolicyVersion]: ...

    async def versions(self) -> tuple[PolicyVersion | None, list[PolicyVersion]]: ...

    async def advance(
        self,
        version: PolicyVersion,
        keep: int,
        records: Sequence[ShardRecord] = (),
        history: Sequence[PolicyVersion] | None = None,
    ) -> list[ShardRecord]: ...

    async def shards(self) -> dict[str, ShardRecord]: ...

    async def shard(self, name: str) -> ShardRecord | None: ...

    async def record_shards(self, records: Sequence[ShardRecord]) -> None: ...


def _version_from(data: dict[str, Any]) -> PolicyVersion:
    return PolicyVersion(
        version=int(data["version"]),
        path=str(data["path"]),
        digest=data.get("digest"),
        published_at=float(data.get("published_at", 0)),
        how=str(data.get("how", "push")),
    )


def _shard_from(name: str, data: dict[str, Any]) -> ShardRecord:
    return ShardRecord(
        name=name,
        applied_version=data.get("applied_version"),
        digest=data.get("digest"),
        acked_at=data.get("acked_at"),
        last_error=data.get("last_error"),
    )


def _sorted(versions: Iterable[PolicyVersion]) -> list[PolicyVersion]:
    return sorted(versions, key=lambda v: v.version)


def _shard_json(record: ShardRecord) -> dict[str, Any]:
    data = asdict(record)
    data.pop("name")
    return data


class EtcdLedger:
    def __init__(self, etcd: EtcdClient, stack: str) -> None:
        self.etcd = etcd
        self.prefix = stack_prefix(stack)

    async def current(self) -> PolicyVersion | None:
        raw = await self.etcd.get(self.prefix + "policy/current")
        return _version_from(json.loads(raw)) if raw else None

    def changes(self, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        """Every write of the current version from now on, or from the store's
        `start_revision` (an etcd watch)."""
        return self.etcd.watch_prefix(self.prefix + "policy/current", start_revision=start_revision)

    async def current_at(self) -> tuple[PolicyVersion | None, int]:
        """The current version and the store's revision as of that read: a watch from the
        revision after it misses no write that this read did not see."""
        kvs, revision = await self.etcd.get_prefix_at(self.prefix + "policy/current")
        raw = next((kv.value for kv in kvs if kv.key == self.prefix + "policy/current"), None)
        return (_version_from(json.loads(raw)) if raw else None), revision

    async def history(self) -> list[PolicyVersion]:
        kvs = await self.etcd.get_prefix(self.prefix + "policy/history/")
        return _sorted(_version_from(json.loads(kv.value)) for kv in kvs)

    async def versions(self) -> tuple[PolicyVersion | None, list[PolicyVersion]]:
        """The current version and the kept history, in one read: a push reads both as it
        begins, so that its commit is one write and no read."""
        kvs = await self.etcd.get_prefix(self.prefix + "policy/")
        current, history = None, []
        for kv in kvs:
            if kv.key == self.prefix + "policy/current":
                current = _version_from(json.loads(kv.value))
            elif kv.key.startswith(self.prefix + "policy/history/"):
                history.append(_version_from(json.loads(kv.value)))
        return current, _sorted(history)

    async def advance(
        self,
        version: PolicyVersion,
        keep: int,
        records: Sequence[ShardRecord] = (),
        history: Sequence[PolicyVersion] | None = None,
    ) -> list[ShardRecord]:
        """The version into the history and current, the history beyond the newest `keep`
        out, and the shards' `records` (those that acknowledged it), in one transaction (a
        push answers after it, and each write is a round of etcd's consensus; as separate
        writes the history could also hold a version the current never was, or the current
        a version no shard's record held). `history`: the kept versions as read before
        (`versions()`); without it they are read first. A read made earlier may miss a
        version written since (another writer's): the history then keeps more than `keep`
        until the next advance, and never loses one of the newest `keep`. The records that
        do not fit in the transaction (of TXN_OPS operations) are returned, for
        `record_shards`: once the advance is through, a failure to write them is no failed
        advance."""
        data = json.dumps(asdict(version))
        if history is None:
            history = await self.history()
        before = [v.version for v in history if v.version != version.version]
        beyond = sorted([*before, version.version])[:-keep] if keep > 0 else before
        dropped = [v for v in beyond if v != version.version]
        ops: list[TxnOp] = [
            TxnPut(self._history_key(version.version), data),
            TxnPut(self.prefix + "policy/current", data),
            *(TxnDelete(self._history_key(v)) for v in dropped),
        ]
        room = max(0, TXN_OPS - len(ops))
        # sent twice, it leaves the same keys (an election's retry)
        await self.etcd.txn([], [*ops, *self._record_puts(records[:room])], idempotent=True)
        return list(records[room:])

    def _history_key(self, version: int) -> str:
        return f"{self.prefix}policy/history/{version:012d}"

    async def shards(self) -> dict[str, ShardRecord]:
        kvs = await self.etcd.get_prefix(self.prefix + "shards/")
        result = {}
        for kv in kvs:
            name = kv.key[len(self.prefix + "shards/") :]
            result[name] = _shard_from(name, json.loads(kv.value))
        return result

    async def shard(self, name: str) -> ShardRecord | None:
        """One shard's record: one key read, not the folder of every shard's."""
        raw = await self.etcd.get(f"{self.prefix}shards/{name}")
        return _shard_from(name, json.loads(raw)) if raw else None

    async def record_shards(self, records: Sequence[ShardRecord]) -> None:
        """Each record under `shards/<name>`, in one transaction (of TXN_OPS at most): a
        push's commit records every shard that acknowledged it, one write, not one a shard
        on the push's way to its answer."""
        puts = self._record_puts(records)
        for start in range(0, len(puts), TXN_OPS):
            await self.etcd.txn([], puts[start : start + TXN_OPS], idempotent=True)

    def _record_puts(self, records: Sequence[ShardRecord]) -> list[TxnOp]:
        return [
            TxnPut(f"{self.prefix}shards/{r.name}", json.dumps(_shard_json(r))) for r in records
        ]


ROOT = "dynamod/"  # every stack's folder of keys is under it


def stack_prefix(stack: str) -> str:
    return f"{ROOT}{stack}/"


class KeyReader(Protocol):
    """What a read of every stack's keys needs of etcd (EtcdClient)."""

    async def first_key(self, start: str, prefix: str) -> str | None: ...

    async def get_prefix(self, prefix: str) -> list[KeyValue]: ...


async def every_stack_keys(etcd: KeyReader, part: str) -> list[KeyValue]:
    """Every stack's keys under `dynamod/<id>/<part>`, read stack by stack: each stack's
    folder is found by its first key, its `part` is read, and the rest of the folder is
    skipped. Reading all of `dynamod/` carried every stack's unit, shard and lease records,
    which grow with the fleet, and every daemon's identity look reads its part every ~1.7 s:
    at 8 nodes x 32 shards a look cost the daemon 5.0 ms of CPU and etcd 5.5; read so, 1.7
    and 4.0, and 1.3-1.8 ms of CPU from 1 node to 8 (three small reads: at 1 x 32 the whole
    read was the cheaper, 0.8 ms against 1.3; bench.fleet's identity table,
    docs/benchmarks.md 16)."""
    found = []
    cursor = ROOT
    while (key := await etcd.first_key(cursor, ROOT)) is not None:
        slash = key.find("/", len(ROOT))
        if slash < 0:  # a foreign key right under dynamod/, in no folder
            cursor = key + "\0"
            continue
        folder = key[: slash + 1]
        found += await etcd.get_prefix(folder + part)
        cursor = folder[:-1] + "0"  # the first key past the folder ("/" + 1)
    return found


async def visible_stack_keys(etcd: KeyReader, part: str, own: str) -> tuple[list[KeyValue], bool]:
    """(every stack's keys under `<part>`, False), or (its own stack's, True) under etcd's
    auth, where a stack's role covers its own folder and Dynamo's `v1/`, not the others'
    (cluster/etcd_auth.py), and etcd refuses a read of every stack's whole."""
    try:
        return await every_stack_keys(etcd, part), False
    except EtcdPermissionDenied:
        return await etcd.get_prefix(stack_prefix(own) + part), True


@dataclass(frozen=True)
class LeaseRecord:
    stack: str
    unit: str
    namespace: str
    instance_ids: tuple[int, ...]
    node: str | None = None  # None: a single-node stack's record (or one from before nodes)

    def owned_by(self, stack: str, node: str | None) -> bool:
        """Whether the daemon of `stack` on `node` owns this record: its stack's, and its
        node's or of the single-node shape (which only a single node, or the same node
        before its stack had a [cluster] table, wrote)."""
        return self.stack == stack and self.node in (None, node)


def lease_key(stack: str, node: str | None, unit: str) -> str:
    """The key of a unit's lease record (`leases/<unit>`, or `leases/<node>/<unit>`)."""
    return stack_prefix(stack) + "leases/" + (f"{node}/{unit}" if node else unit)


def parse_lease_key(key: str) -> tuple[str, str | None, str] | None:
    """(stack, node or None, unit) of a lease record's key; None for any other key."""
    stack, sep, rest = key.removeprefix("dynamod/").partition("/leases/")
    if not key.startswith("dynamod/") or not sep or "/" in stack or not stack or not rest:
        return None
    node, slash, unit = rest.partition("/")
    if not slash:
        return stack, None, rest
    if not node or not unit or "/" in unit:
        return None
    return stack, node, unit


class LeaseRecords:
    """Each live Dynamo worker unit's lease ids, in etcd beside the ledger (one key a unit,
    per node in a cluster stack)."""

    def __init__(self, etcd: EtcdClient, stack: str, node: str | None = None) -> None:
        self.etcd = etcd
        self.stack = stack
        self.node = node

    async def record(self, unit: str, namespace: str, instance_ids: list[int]) -> None:
        data = {"namespace": namespace, "instance_ids": instance_ids, "recorded_at": now()}
        await self.etcd.put(lease_key(self.stack, self.node, unit), json.dumps(data))

    async def forget(self, record: LeaseRecord) -> None:
        await self.etcd.delete(lease_key(record.stack, record.node, record.unit))

    async def forget_if(self, unit: str, instance_ids: list[int]) -> None:
        """Forget the unit's record if it still names these ids (a restarted unit may have
        recorded its new ones already)."""
        key = lease_key(self.stack, self.node, unit)
        raw = await self.etcd.get(key)
        if raw is None:
            return
        try:
            held = {int(i) for i in json.loads(raw)["instance_ids"]}
        except (ValueError, KeyError, TypeError):
            held = set()
        if not held or held <= set(instance_ids):
            await self.etcd.delete(key)

    async def every_stack(self) -> list[LeaseRecord]:
        """The records of every stack that keeps them in this etcd (this one included);
        this stack's alone where etcd's auth limits its user to its own keys (the sweep
        then takes the namespace for shared: identity.look)."""
        kvs, _ = await visible_stack_keys(self.etcd, "leases/", self.stack)
        records = []
        for kv in kvs:
            parsed = parse_lease_key(kv.key)
            if parsed is None:
                continue
            try:
                data = json.loads(kv.value)
                ids = tuple(int(i) for i in data["instance_ids"])
                namespace = str(data["namespace"])
            except (ValueError, KeyError, TypeError):
                continue  # not ours to judge: a foreign key under dynamod/
            stack, node, unit = parsed
            records.append(LeaseRecord(stack, unit, namespace, ids, node))
        return records


class FileLedger:
    """The same ledger in one JSON file, replaced atomically on every write."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _load(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.path.read_text())
        except FileNotFoundError:
            data = {}
        data.setdefault("current", None)
        data.setdefault("history", [])
        data.setdefault("shards", {})
        return data

    def _save(self, data: dict[str, Any]) -> None:
        write_atomic(self.path, json.dumps(data, indent=2).encode())

    async def current(self) -> PolicyVersion | None:
        current = self._load()["current"]
        return _version_from(current) if current else None

    async def history(self) -> list[PolicyVersion]:
        return [_version_from(v) for v in self._load()["history"]]

    async def versions(self) -> tuple[PolicyVersion | None, list[PolicyVersion]]:
        data = self._load()
        current = _version_from(data["current"]) if data["current"] else None
        return current, [_version_from(v) for v in data["history"]]

    async def advance(
        self,
        version: PolicyVersion,
        keep: int,
        records: Sequence[ShardRecord] = (),
        history: Sequence[PolicyVersion] | None = None,
    ) -> list[ShardRecord]:
        """As the etcd ledger's: one replace of the file, every record in it (`history` is
        not needed: the file is read whole anyway)."""
        data = self._load()
        entry = asdict(version)
        kept = [v for v in data["history"] if v["version"] != version.version] + [entry]
        data["history"] = sorted(kept, key=lambda v: v["version"])[-keep:]
        data["current"] = entry
        for record in records:
            data["shards"][record.name] = _shard_json(record)
        self._save(data)
        return []

    async def shards(self) -> dict[str, ShardRecord]:
        return {n: _shard_from(n, d) for n, d in self._load()["shards"].items()}

    async def shard(self, name: str) -> ShardRecord | None:
        data = self._load()["shards"].get(name)
        return _shard_from(name, data) if data is not None else None

    async def record_shards(self, records: Sequence[ShardRecord]) -> None:
        data = self._load()
        for record in records:
            data["shards"][record.name] = _shard_json(record)
        self._save(data)


def now() -> float:
    return time.time()
