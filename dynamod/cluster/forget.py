"""`dynamod cluster forget NODE`: an operator says a lost node is gone for good.

Until then a node whose lease expired stays `lost`: the leader pings it where it last
echoed (so that it hears its link is back), its lost record keeps the registrations the
leader withdrew, and its shards' lease and ledger records stay in etcd. A node that was
never marked lost (its entry expired with every other one in an etcd outage, and no leader
judged it since) is worse off: every push waits `route_timeout` for it (`unseen_nodes`).

Forgetting it, in one etcd transaction that holds only while the node has no registry
entry (a node that is up is refused): its lost record goes, a forgotten record
(`cluster/forgotten/<node>`) comes, and its lease records (`leases/<node>/`) and ledger
acks (`shards/<node>/`) go. Then each Dynamo lease those records named is revoked, which
takes the node's workers' remaining keys (model cards, event channels) out of etcd now
rather than at the lease's expiry. Every daemon then shows the node `forgotten`, stops
pinging it and waiting for it.

A forgotten node that comes back after all is a node like any other: its daemon publishes
its entry (the node is `up` again), deletes the forgotten record, and restarts each shard
whose registration is gone (cluster/membership.py `_after_return`)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import structlog

from dynamod.cluster import registry
from dynamod.cluster.registry import ForgottenRecord
from dynamod.core.errors import DynamodError
from dynamod.rollout import dynamo
from dynamod.rollout.etcd import EtcdClient, EtcdError
from dynamod.rollout.etcd.records import Compare, TxnDelete, TxnPut
from dynamod.rollout.ledger import lease_key, stack_prefix

log = structlog.get_logger("dynamod.cluster.forget")


class ForgetRefused(DynamodError):
    """The node may not be forgotten (it is up, or it is this node): nothing changed."""


@dataclass(frozen=True)
class Forgotten:
    """What forgetting a node removed."""

    node: str
    by: str  # the node whose daemon was asked
    at: float  # wall clock: the forgotten record's
    was_lost: bool  # it had a lost record (else it was only unseen, or already forgotten)
    shards: list[str]  # its shards, as its lost record named them
    lease_records: list[str]  # units whose lease record went
    ledger_records: list[str]  # its shards' acks that went from the ledger
    revoked: dict[str, int]  # lease id (hex) -> keys that went with it
    revoke_error: str | None  # a revocation etcd did not take (the lease expires anyway)

    @property
    def record(self) -> ForgottenRecord:
        return ForgottenRecord(node=self.node, by=self.by, at=self.at)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _lease_ids(raw: bytes) -> list[int]:
    try:
        return [int(i) for i in json.loads(raw)["instance_ids"]]
    except (ValueError, KeyError, TypeError):
        return []  # not a record this version wrote: deleted with the rest, nothing revoked


async def forget_node(etcd: EtcdClient, stack: str, node: str, by: str) -> Forgotten:
    """Forget `node` of `stack` (module docstring); ForgetRefused if it has a registry
    entry. `by`: the node whose daemon was asked."""
    if node == by:
        raise ForgetRefused(f"{node} is this node: forget it from another node's daemon")
    leases_prefix = lease_key(stack, node, "")
    ledger_prefix = f"{stack_prefix(stack)}shards/{node}/"
    lost_kv = await etcd.get_kv(registry.lost_key(stack, node))
    lease_kvs = await etcd.get_prefix(leases_prefix)
    ledger_kvs = await etcd.get_prefix(ledger_prefix)
    record = ForgottenRecord(node=node, by=by, at=time.time())
    held = await etcd.txn(
        [Compare(registry.node_key(stack, node), "version", "==", 0)],
        [
            TxnDelete(registry.lost_key(stack, node)),
            TxnPut(registry.forgotten_key(stack, node), record.encode()),
            TxnDelete(leases_prefix, prefix=True),
            TxnDelete(ledger_prefix, prefix=True),
        ],
    )
    if not held:
        raise ForgetRefused(
            f"node {node} is up (its daemon publishes its registry entry): not forgotten; "
            f"stop it first (`dynamod down` on {node}), or wait until it is marked lost"
        )
    lost = registry.LostRecord.decode(lost_kv.value) if lost_kv is not None else None
    revoked: dict[str, int] = {}
    error = None
    for lease in sorted({i for kv in lease_kvs for i in _lease_ids(kv.value)}):
        try:
            revoked[f"{lease:x}"] = len(await dynamo.revoke_instance(etcd, lease))
        except (TimeoutError, EtcdError) as exc:  # the lease expires on its own all the same
            error = f"revoking lease {lease:x}: {exc}"
            break
    done = Forgotten(
        node=node,
        by=by,
        at=record.at,
        was_lost=lost is not None,
        shards=list(lost.shards) if lost is not None else [],
        lease_records=sorted(kv.key[len(leases_prefix) :] for kv in lease_kvs),
        ledger_records=sorted(kv.key[len(ledger_prefix) :] for kv in ledger_kvs),
        revoked=revoked,
        revoke_error=error,
    )
    log.warning("cluster.node_forgotten", **done.as_dict())
    return done
