"""The cluster registry's keys and records, and the cluster view built from them. Pure
logic (no I/O): what each node's daemon writes, how it is read back, and which nodes count
as up, lost or behind. Keys, under `dynamod/<stack>/cluster/`:

    nodes/<node>      NodeEntry's header (JSON: every field but its units', and their
                      names in order) on the node's own lease (`lease_ttl`)
    units/<node>/<unit>  one unit of that entry (UnitEntry, JSON), on the same lease: a
                      unit's change rewrites its own ~300 bytes, not the node's whole entry
                      (~10 KB at 32 shards, rewritten ~30 times a push at 8 x 32)
    lost/<node>       LostRecord: the node's lease expired; its shards and what was revoked
    forgotten/<node>  ForgottenRecord: an operator said the node is gone for good
                      (`dynamod cluster forget`); deleted by the node itself if it returns
    leader            the node that handles losses, on its own lease
    down              a cluster-wide stop request: {"id", "step", "units", "by"}
    down-acks/<node>  {"id", "step", "stopped": [...]} per node
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from dynamod.rollout.etcd.endpoints import EndpointError, parse_endpoint
from dynamod.rollout.etcd.records import TXN_OPS, KeyValue, TxnDelete, TxnOp, TxnPut

_DETAIL_MAX = 200
LEASE_EXPIRED = "its registry lease expired"  # why a node is lost, unless the leader says


def prefix(stack: str) -> str:
    return f"dynamod/{stack}/cluster/"


def node_key(stack: str, node: str) -> str:
    return f"{prefix(stack)}nodes/{node}"


def unit_key(stack: str, node: str, unit: str) -> str:
    return f"{prefix(stack)}units/{node}/{unit}"


def lost_key(stack: str, node: str) -> str:
    return f"{prefix(stack)}lost/{node}"


def forgotten_key(stack: str, node: str) -> str:
    return f"{prefix(stack)}forgotten/{node}"


def leader_key(stack: str) -> str:
    return f"{prefix(stack)}leader"


def down_key(stack: str) -> str:
    return f"{prefix(stack)}down"


def down_ack_key(stack: str, node: str) -> str:
    return f"{prefix(stack)}down-acks/{node}"


def local_first(endpoints: list[str], address: str) -> list[str]:
    """The registry's endpoints with this node's own member first (the others in their
    order): each node keeps its lease alive through its own member, so another node's member
    going away costs it nothing, where a list naming the head first sent every node's
    keepalives through the head's member and they stalled with it."""

    def here(url: str) -> bool:
        try:
            return parse_endpoint(url).host.strip("[]") == address.strip("[]")
        except EndpointError:
            return False

    return [u for u in endpoints if here(u)] + [u for u in endpoints if not here(u)]


def call_timeout(lease_ttl: float, most: float) -> float:
    """One registry call's deadline: at most `most`, and a quarter of the lease, so that a
    keepalive that waits out one silent member and goes on to the next still lands within
    the lease (its period is a third of it: 1/3 + 1/4 leaves the rest for the next call)."""
    return min(most, lease_ttl / 4)


def shard_id(node: str, unit: str) -> str:
    """A shard's name across the cluster (ledger acks, status): `<node>/worker@0`."""
    return f"{node}/{unit}"


class NodeState(StrEnum):
    UP = "up"  # its entry is there, on a live lease
    LOST = "lost"  # its lease expired (or a lost record says so and no entry came back)
    UNKNOWN = "unknown"  # configured, never seen in this daemon's life
    FORGOTTEN = "forgotten"  # gone for good, an operator said (`dynamod cluster forget`)


@dataclass(frozen=True)
class UnitEntry:
    name: str
    unit: str
    state: str
    pid: int | None
    ports: dict[str, int]
    detail: str
    policy_version: int | None = None
    instance_ids: list[int] = field(default_factory=list)
    shard: bool = False


@dataclass(frozen=True)
class NodeEntry:
    node: str
    address: str
    daemon_pid: int
    run_id: str
    phase: str
    head: bool
    units: list[UnitEntry]
    policy_current: int | None = None
    heartbeat_port: int | None = None  # where its daemon echoes heartbeats (None: it does not)
    state_dir: str | None = None  # its daemon's, on that node: where a process there reaches it

    def records(self, stack: str) -> dict[str, str]:
        """The keys this entry is written as, with their values: its header at
        `nodes/<node>` (the units' names, in order, in place of the units) and each unit at
        `units/<node>/<unit>`."""
        header = {k: v for k, v in asdict(self).items() if k != "units"}
        header["unit_names"] = [u.name for u in self.units]
        out = {node_key(stack, self.node): json.dumps(header, sort_keys=True)}
        for unit in self.units:
            out[unit_key(stack, self.node, unit.name)] = json.dumps(asdict(unit), sort_keys=True)
        return out

    @classmethod
    def assemble(
        cls,
        header: bytes | str,
        units: Mapping[str, bytes | str],
        bad: list[tuple[str, str]] | None = None,
    ) -> NodeEntry:
        """An entry from its header and its units' values by unit name. A unit the header
        names but `units` lacks is left out: a node with more units than one transaction
        takes writes them in several, and a read may fall between two. So is a unit whose
        value does not decode ((unit, why) in `bad`): one bad key is not the node gone,
        which the leader would take for a lost node."""
        data = json.loads(header)
        names = data.pop("unit_names", [])
        if not isinstance(names, list):
            raise ValueError("unit_names is not a list")
        found = []
        for name in names:
            if name not in units:
                continue
            try:
                found.append(UnitEntry(**json.loads(units[name])))
            except (ValueError, TypeError) as exc:
                if bad is not None:
                    bad.append((name, str(exc)))
        return cls(units=found, **data)

    def shards(self) -> list[UnitEntry]:
        return [u for u in self.units if u.shard]

    @functools.cached_property
    def unit_rows(self) -> list[dict[str, Any]]:
        """The units as `status --json` shows them; made once per entry (an entry is
        replaced, never changed), not at every status call: at 4 nodes x 32 shards this
        conversion was most of what each `status` cost the daemon. Read-only."""
        return [asdict(u) for u in self.units]


class EntryCache:
    """Every node's decoded entry, kept from one registry read to the next: a read decodes
    only the entries whose bytes changed since the last one. Each node re-reads the whole
    prefix at every change, and during a push at 8 x 32 every shard's new version changes
    its node's entry, so decoding every entry at every read made the work grow as nodes^2
    x shards (decoding was ~10 % of a daemon's samples in that push, py-spy)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[tuple[bytes, dict[str, bytes]], NodeEntry]] = {}

    def decode(
        self,
        node: str,
        header: bytes,
        units: dict[str, bytes],
        bad: list[tuple[str, str]] | None = None,
    ) -> NodeEntry:
        """The node's entry from its keys' bytes, or the same NodeEntry as last time if none
        changed (an entry is replaced, never changed, so handing out the same one is safe).
        `bad`: its units that do not decode, when it is decoded afresh (NodeEntry.assemble)."""
        raw = (header, units)
        kept = self._seen.get(node)
        if kept is not None and kept[0] == raw:
            return kept[1]
        entry = NodeEntry.assemble(header, units, bad)
        self._seen[node] = (raw, entry)
        return entry

    def keep_only(self, nodes: AbstractSet[str]) -> None:
        """Forget the nodes a read no longer found (their entry expired or was deleted)."""
        for node in self._seen.keys() - nodes:
            del self._seen[node]


def entry_writes(
    stack: str, node: str, puts: Mapping[str, str], deletes: list[str], lease: int
) -> list[list[TxnOp]]:
    """The transactions that write an entry's changed keys (`puts`) and delete its gone
    units' keys: usually one. Past TXN_OPS operations the units go first, then the header,
    then the deletes, so a read between two finds every unit its header names, or the
    header before it named the new ones."""
    header = node_key(stack, node)
    ops: list[TxnOp] = [TxnPut(k, v, lease) for k, v in sorted(puts.items()) if k != header]
    if header in puts:
        ops.append(TxnPut(header, puts[header], lease))
    ops += [TxnDelete(k) for k in deletes]
    return [ops[i : i + TXN_OPS] for i in range(0, len(ops), TXN_OPS)]


@dataclass
class Snapshot:
    """The registry prefix as one read found it; `bad`: (key, error) of records it could
    not decode (logged by the reader, and left out)."""

    entries: dict[str, NodeEntry] = field(default_factory=dict)
    lost: dict[str, LostRecord] = field(default_factory=dict)
    forgotten: dict[str, ForgottenRecord] = field(default_factory=dict)
    leader: str | None = None
    down: dict[str, Any] | None = None
    acks: dict[str, dict[str, Any]] = field(default_factory=dict)
    bad: list[tuple[str, str]] = field(default_factory=list)


def parse(stack: str, kvs: Iterable[KeyValue], cache: EntryCache) -> Snapshot:
    """Every key under the stack's registry prefix (one read, one revision) -> a Snapshot:
    each node's entry assembled from its header and its units' keys."""
    base = prefix(stack)
    out = Snapshot()
    headers: dict[str, bytes] = {}
    units: dict[str, dict[str, bytes]] = {}
    for kv in kvs:
        kind, _, name = kv.key[len(base) :].partition("/")
        try:
            if kind == "nodes":
                headers[name] = kv.value
            elif kind == "units":
                node, _, unit = name.partition("/")
                units.setdefault(node, {})[unit] = kv.value
            elif kind == "lost":
                out.lost[name] = LostRecord.decode(kv.value)
            elif kind == "forgotten":
                out.forgotten[name] = ForgottenRecord.decode(kv.value)
            elif kind == "leader":
                out.leader = kv.value.decode()
            elif kind == "down":
                out.down = _json(kv.value)
            elif kind == "down-acks":
                out.acks[name] = _json(kv.value)
        except (ValueError, TypeError, KeyError) as exc:
            out.bad.append((kv.key, str(exc)))
    for name, header in headers.items():
        bad: list[tuple[str, str]] = []
        try:
            out.entries[name] = cache.decode(name, header, units.get(name, {}), bad)
        except (ValueError, TypeError, KeyError) as exc:
            out.bad.append((node_key(stack, name), str(exc)))
        out.bad += [(unit_key(stack, name, unit), why) for unit, why in bad]
    cache.keep_only(out.entries.keys())
    return out


def _json(raw: bytes | str) -> dict[str, Any]:
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def short_detail(text: str) -> str:
    first = text.splitlines()[0] if text else ""
    return first if len(first) <= _DETAIL_MAX else first[: _DETAIL_MAX - 3] + "..."


@dataclass(frozen=True)
class LostRecord:
    node: str
    since: float  # wall clock, for people
    by: str  # the node that noticed
    shards: list[str]
    revoked: list[str]  # instance ids (hex) whose Dynamo registration was withdrawn
    # the withdrawn `v1/instances` keys (cluster/parking.py ParkedKey), for the node to put
    # back on return; a record written before they were kept has none
    parked: list[dict[str, Any]] = field(default_factory=list)
    # why its entry went: its lease's expiry, or the leader's revocation of a silent node
    # (cluster/heartbeat.py); a record written before this was kept has the first
    why: str = LEASE_EXPIRED
    # where its daemon last echoed heartbeats: the leader keeps pinging a lost node there,
    # so that it hears its link is back, whether or not that leader saw its entry (one that
    # restarted meanwhile did not); a record written before this was kept has none
    address: str = ""
    heartbeat_port: int | None = None

    @property
    def heard_at(self) -> tuple[str, int] | None:
        """(address, heartbeat port) where its daemon last echoed; None if not kept."""
        if self.address and self.heartbeat_port:
            return self.address, self.heartbeat_port
        return None

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> LostRecord:
        """The record, less any field this version does not know (a newer daemon's)."""
        data = _json(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class ForgottenRecord:
    """`dynamod cluster forget NODE`: who said the node is gone for good, and when."""

    node: str
    by: str  # the node whose daemon was asked
    at: float  # wall clock, for people

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> ForgottenRecord:
        data = _json(raw)
        return cls(node=str(data["node"]), by=str(data["by"]), at=float(data["at"]))


def node_state(
    name: str,
    entries: Mapping[str, NodeEntry],
    lost: Mapping[str, LostRecord],
    seen: AbstractSet[str],
    forgotten: Mapping[str, ForgottenRecord] | None = None,
) -> NodeState:
    """Its entry decides first (a forgotten node that came back is up), then a forgotten
    record, then a lost record or this daemon's memory of it."""
    if name in entries:
        return NodeState.UP
    if forgotten and name in forgotten:
        return NodeState.FORGOTTEN
    if name in lost or name in seen:
        return NodeState.LOST
    return NodeState.UNKNOWN


def newly_lost(
    before: dict[str, NodeEntry], now: dict[str, NodeEntry], stopping: bool
) -> list[str]:
    """Nodes whose entry vanished between two reads (their lease expired). None while the
    cluster is being stopped: entries vanish then because daemons exit."""
    if stopping:
        return []
    return sorted(set(before) - set(now))


def may_judge(trouble_at: float | None, now: float, lease_ttl: float) -> bool:
    """Whether the leader may mark a node lost whose entry vanished: only once its own
    registry calls have all gone through for a whole lease (`trouble_at`: the monotonic
    time its last one failed). An etcd that answers nobody for longer than the lease (its
    leader lost on a loaded machine: ~4.5 s in CI) expires every entry at once; the leader,
    in the same outage, is then no judge of whether a node was cut off or only etcd was.
    A node that was merely waiting on etcd puts its entry back within that lease."""
    return trouble_at is None or now - trouble_at >= lease_ttl


def behind(entries: dict[str, NodeEntry], current: int | None) -> dict[str, list[str]]:
    """Node -> its shards (`<node>/<unit>`) that do not hold the current version."""
    if current is None:
        return {}
    result: dict[str, list[str]] = {}
    for name, entry in entries.items():
        late = [shard_id(name, u.name) for u in entry.shards() if u.policy_version != current]
        if late:
            result[name] = late
    return result


def view(
    nodes: dict[str, str],
    head: str,
    this_node: str,
    entries: dict[str, NodeEntry],
    lost: dict[str, LostRecord],
    seen: set[str],
    leader: str | None,
    error: str | None,
    forgotten: dict[str, ForgottenRecord] | None = None,
) -> dict[str, Any]:
    """The `cluster` key of `status --json`: every configured node with its state and units."""
    current = max(
        (e.policy_current for e in entries.values() if e.policy_current is not None), default=None
    )
    late = behind(entries, current)
    rows = []
    for name, address in nodes.items():
        state = node_state(name, entries, lost, seen, forgotten)
        entry = entries.get(name)
        record = lost.get(name)
        gone = (forgotten or {}).get(name)
        rows.append(
            {
                "name": name,
                "address": address,
                "head": name == head,
                "state": str(state),
                "daemon_pid": entry.daemon_pid if entry else None,
                "state_dir": entry.state_dir if entry else None,
                "phase": entry.phase if entry else None,
                "units": list(entry.unit_rows) if entry else [],
                "behind": late.get(name, []),
                "lost": asdict(record) if record and state is NodeState.LOST else None,
                "forgotten": asdict(gone) if gone and state is NodeState.FORGOTTEN else None,
            }
        )
    return {
        "this_node": this_node,
        "head": head,
        "leader": leader,
        "policy_current": current,
        "nodes": rows,
        "behind": sorted(late),
        "error": error,
    }
