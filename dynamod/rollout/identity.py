"""A stack's identity in the etcd it shares with other stacks.

Every stack has one (`vars.stack_id`: `[stack] id`, else its name; `--var stack_id=NAME`
for a second copy). dynamod's own keys live under `dynamod/<id>/` (ledger, shard records,
lease records: rollout/ledger.py) and the stock units' Dynamo namespace is the id, so two
stacks of different ids on one etcd do not see each other's ledger or workers.

The daemon holds `dynamod/<id>/daemon` (`dynamod/<id>/daemon/<node>` in a cluster stack)
on an etcd lease of its own, kept alive every TTL/3: whose it is (host, pid, state dir,
run id) and which Dynamo namespaces its workers use. A key that is there is a live daemon
(etcd deletes it when the lease lapses), so:
- `up` of a stack whose identity a live daemon holds is refused before anything starts,
  naming that daemon (`check_before_up`); so is a Dynamo namespace another live stack's
  workers use. The nodes of one cluster stack share its identity, one key per node; a
  second copy of a node, or a single-node stack of the cluster's identity, is refused;
- the start-up sweep of stale registrations leaves a namespace's unrecorded registrations
  alone while another live stack uses that namespace (rollout/registrations.py);
- `status` shows a namespace shared with another stack's workers, with their count.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import structlog

from dynamod.core.errors import DynamodError
from dynamod.core.extensions import Extension
from dynamod.core.proctable import pid_alive
from dynamod.rollout import dynamo
from dynamod.rollout.etcd import EtcdAuth, EtcdClient, EtcdError, KeyValue
from dynamod.rollout.ledger import KeyReader, every_stack_keys, stack_prefix, visible_stack_keys
from dynamod.rollout.policy_table import policy_of
from dynamod.rollout.worker_table import worker_of

if TYPE_CHECKING:
    from dynamod.core.extensions import ExtensionHost
    from dynamod.core.spec import Stack
    from dynamod.rollout.registrations import DynamoRegistrations

log = structlog.get_logger("dynamod.rollout.identity")

LEASE_TTL_S = 5  # a dead daemon's identity is free again this long after it died
CHECK_TIMEOUT_S = 1.5  # `up`'s look: an etcd that does not answer is the stack's own, not up
REFRESH_S = 2.0  # the shared-namespace view in status
STOP_REVOKE_S = 0.5  # `down`: a stack's own etcd is stopped already; don't wait on it


class IdentityTaken(DynamodError):
    """Another live daemon holds this stack's identity, or uses its Dynamo namespace."""


@dataclass(frozen=True)
class DaemonRecord:
    """The value of a daemon key: which daemon holds the identity, and its namespaces."""

    id: str
    stack: str
    host: str
    pid: int
    state_dir: str
    run_id: str
    namespaces: tuple[str, ...]
    node: str | None = None
    lease: int = field(default=0, compare=False)  # the etcd lease its key hangs on, as read

    def encode(self) -> str:
        data = {**asdict(self), "namespaces": list(self.namespaces)}
        data.pop("lease")
        return json.dumps(data)

    @classmethod
    def decode(cls, raw: bytes | str) -> DaemonRecord | None:
        """None for a value that is not one (a foreign key under `dynamod/`)."""
        try:
            data = json.loads(raw)
            return cls(
                id=str(data["id"]), stack=str(data["stack"]), host=str(data["host"]),
                pid=int(data["pid"]), state_dir=str(data["state_dir"]),
                run_id=str(data["run_id"]), namespaces=tuple(map(str, data["namespaces"])),
                node=None if data.get("node") is None else str(data["node"]),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        where = f" node {self.node}" if self.node else ""
        return (
            f"stack {self.stack!r} (identity {self.id!r}{where}): daemon pid {self.pid} on "
            f"host {self.host}, state dir {self.state_dir}"
        )


def daemon_key(stack_id: str, node: str | None = None) -> str:
    """`dynamod/<id>/daemon`, or `dynamod/<id>/daemon/<node>` for a cluster stack's node."""
    return stack_prefix(stack_id) + "daemon" + (f"/{node}" if node else "")


def is_daemon_key(key: str) -> bool:
    parts = key.split("/")
    return len(parts) in (3, 4) and parts[0] == "dynamod" and parts[2] == "daemon"


def stack_etcd(stack: Stack) -> str | None:
    """The etcd the stack's identity lives in: its ledger's, else its Dynamo workers'
    (None: a stack with neither keeps nothing in etcd and has nothing to keep apart)."""
    policy = policy_of(stack)
    if policy is not None and policy.store == "etcd" and policy.etcd:
        return str(policy.etcd)
    for unit in stack.units.values():
        worker = worker_of(unit)
        if worker is not None and unit.remote is None:
            return str(worker.etcd)
    return None


def namespaces(stack: Stack) -> tuple[str, ...]:
    """The Dynamo namespaces this node's workers register in."""
    found = {w.namespace for u in stack.units.values() if (w := worker_of(u)) and not u.remote}
    return tuple(sorted(found))


def record_of(stack: Stack, *, pid: int, state_dir: str, run_id: str) -> DaemonRecord:
    cluster = stack.cluster
    return DaemonRecord(
        id=stack.identity, stack=stack.name, host=socket.gethostname(), pid=pid,
        state_dir=state_dir, run_id=run_id, namespaces=namespaces(stack),
        node=cluster.node if cluster is not None else None,
    )  # fmt: skip


def left_behind(other: DaemonRecord, me: DaemonRecord) -> bool:
    """A key whose daemon is gone though its lease still runs: one of this host whose pid
    is dead, or one of this state dir (whose lock says its daemon is gone), e.g. a daemon
    SIGKILLed a moment ago, or a stack's own etcd restarted with its old data."""
    if other.host != me.host:
        return False
    return (bool(me.state_dir) and other.state_dir == me.state_dir) or not pid_alive(other.pid)


def holds_mine(other: DaemonRecord, me: DaemonRecord) -> bool:
    """Whether `other` holds the identity `me` would take. The nodes of one cluster stack
    share it, each under a key of its own; anything else of the same identity holds it
    whole: a single-node stack beside a cluster's nodes (or a cluster node beside a
    single-node stack) would share their ledger though their daemon keys differ."""
    if other.id != me.id:
        return False
    peers = other.node is not None and me.node is not None and other.stack == me.stack
    return other.node == me.node or not peers


def shares_registry(other: DaemonRecord, me: DaemonRecord) -> bool:
    """Two cluster stacks of one [stack] name and different identities: a node registry
    is kept under the stack's name (cluster/registry.py), so theirs would be one."""
    both_clusters = other.node is not None and me.node is not None
    return both_clusters and other.stack == me.stack and other.id != me.id


def conflicts(me: DaemonRecord, live: Iterable[DaemonRecord]) -> list[str]:
    """Why `me` may not start beside the live daemons: one holds its identity (and node),
    or one's workers use a Dynamo namespace of its own. Empty: nothing in the way."""
    problems = []
    for other in live:
        if other.run_id == me.run_id or left_behind(other, me):
            continue
        if holds_mine(other, me):
            problems.append(
                f"stack identity {me.id!r} is held by a live daemon: {other.describe()}; "
                f"`--var stack_id=OTHER` runs a second copy beside it"
            )
        elif shares_registry(other, me):
            problems.append(
                f"cluster stack {me.stack!r} keeps its node registry under "
                f"dynamod/{me.stack}/cluster/, which {other.describe()} uses; give this "
                f"stack another [stack] name"
            )
        elif other.id != me.id and (shared := sorted(set(other.namespaces) & set(me.namespaces))):
            problems.append(
                f"Dynamo namespace {shared[0]!r} is used by the workers of {other.describe()}; "
                f"give this stack another (`--var stack_id=OTHER` or `--var namespace=OTHER`)"
            )
    return problems


def sharers(me: DaemonRecord, live: Iterable[DaemonRecord]) -> dict[str, list[DaemonRecord]]:
    """Namespace -> the other live stacks whose workers use it too."""
    out: dict[str, list[DaemonRecord]] = {}
    for other in live:
        if other.id == me.id or left_behind(other, me):
            continue
        for namespace in sorted(set(other.namespaces) & set(me.namespaces)):
            out.setdefault(namespace, []).append(other)
    return out


async def live_daemons(etcd: KeyReader) -> list[DaemonRecord]:
    """Every daemon key in this etcd: each is a live daemon (its lease keeps it). Read
    stack by stack (ledger.every_stack_keys), not by reading every key of every stack."""
    return _daemons(await every_stack_keys(etcd, "daemon"))


def _daemons(kvs: Iterable[KeyValue]) -> list[DaemonRecord]:
    found = []
    for kv in kvs:
        if is_daemon_key(kv.key) and (record := DaemonRecord.decode(kv.value)) is not None:
            found.append(replace(record, lease=kv.lease))
    return found


@dataclass(frozen=True)
class Look:
    """The live daemons a look found, and whether it could see other stacks' at all."""

    daemons: list[DaemonRecord]
    others_hidden: bool = False


HIDDEN = (
    "other stacks on this etcd cannot be seen: its auth limits this stack's user to its "
    "own keys"
)


async def look(etcd: KeyReader, own: str) -> Look:
    """The live daemons this stack's user can see: every stack's, or under etcd's auth,
    where a stack's role covers its own folder (and Dynamo's `v1/`) and not the others'
    (cluster/etcd_auth.py), its own identity's alone. Read all of `dynamod/` there and
    etcd refuses the look whole: no node of an authenticated cluster held its identity."""
    kvs, hidden = await visible_stack_keys(etcd, "daemon", own)
    return Look(_daemons(kvs), others_hidden=hidden)


def check_before_up(stack: Stack, state_dir: str, auth: EtcdAuth | None = None) -> None:
    """`up`: raise IdentityTaken if a live daemon holds the identity or uses a namespace of
    the stack, in the etcd the stack would use. An etcd that does not answer is one the
    stack starts itself: no other daemon can be in it yet."""
    endpoint = stack_etcd(stack)
    if endpoint is None:
        return
    # A cluster node looks too: a head whose etcd is not up yet refuses the connection at
    # once (nothing is held there), and a node's second copy would otherwise start its
    # shards beside the first's, in its Dynamo namespace, under its registry entry.
    me = record_of(stack, pid=os.getpid(), state_dir=state_dir, run_id="")
    problems = conflicts(me, _look_in_child(endpoint, auth, me.id))
    if problems:
        raise IdentityTaken(f"{problems[0]} (etcd {endpoint}); nothing was started")


def _look_in_child(endpoint: str, auth: EtcdAuth | None, own: str) -> list[DaemonRecord]:
    """The live daemons in etcd, read by a forked child: `up` forks the daemon next, and a
    process that has run gRPC cannot fork one that uses it (seen: the daemon aborted in
    gRPC's channel teardown). [] when etcd does not answer."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover  (the child; its answer is what the parent checks)
        code = 1
        try:
            os.close(read)
            with os.fdopen(write, "w") as out:
                out.write(json.dumps([r.encode() for r in asyncio.run(_look(endpoint, auth, own))]))
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as got:
        raw = got.read()
    os.waitpid(pid, 0)
    try:
        encoded = json.loads(raw) if raw else []
    except ValueError:
        encoded = []
    return [r for r in (DaemonRecord.decode(e) for e in encoded) if r is not None]


async def _look(endpoint: str, auth: EtcdAuth | None, own: str) -> list[DaemonRecord]:
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S * 2):
            async with EtcdClient(endpoint, timeout_s=CHECK_TIMEOUT_S, auth=auth) as etcd:
                return (await look(etcd, own)).daemons
    except (TimeoutError, EtcdError):
        return []


class StackIdentity(Extension):
    """Holds the stack's daemon key on a lease while the daemon runs, and keeps the view
    of other stacks sharing its Dynamo namespaces (`identity` in status)."""

    def __init__(self, registrations: DynamoRegistrations, auth: EtcdAuth | None = None) -> None:
        self.registrations = registrations
        self.auth = auth
        self.host: ExtensionHost | None = None
        self.endpoint: str | None = None
        self.etcd: EtcdClient | None = None
        self.lease: int | None = None
        self.record: DaemonRecord | None = None
        self.refused: str | None = None  # another daemon took the identity first
        self.shared: dict[str, dict[str, Any]] = {}
        self.others_hidden = False  # etcd's auth: this stack's user sees its own keys only
        self._task: asyncio.Task[None] | None = None

    async def start(self, host: ExtensionHost) -> None:
        self.host = host
        self.endpoint = stack_etcd(host.stack)
        if self.endpoint is None:
            return
        state_dir = str(host.state_dir.absolute())
        pid, run_id = os.getpid(), host.run_id
        self.record = record_of(host.stack, pid=pid, state_dir=state_dir, run_id=run_id)
        self.etcd = EtcdClient(self.endpoint, timeout_s=CHECK_TIMEOUT_S, auth=self.auth)
        self.registrations.others_in_namespace = self.others_in_namespace
        if host.stack.cluster is None:  # a node's members may not be up: claim later (`up` looked)
            with contextlib.suppress(TimeoutError, EtcdError):
                async with asyncio.timeout(CHECK_TIMEOUT_S):
                    await self.claim()  # an outside etcd: now, before any unit starts
        if self.refused is not None:
            raise IdentityTaken(f"{self.refused}; nothing was started")
        self._task = asyncio.get_running_loop().create_task(self._keep())

    async def claim(self) -> bool:
        """Put the daemon key on a new lease unless a live daemon holds it; True once held."""
        assert self.etcd is not None and self.record is not None
        if self.lease is not None:
            return True
        me = self.record
        live = (await look(self.etcd, me.id)).daemons
        problems = [p for p in conflicts(me, live) if p.startswith("stack identity")]
        if problems:
            self.refused = problems[0]
            return False
        for other in live:  # this identity's key, left by a daemon that is gone
            if other.id == me.id and other.node == me.node and other.lease:
                await self.etcd.lease_revoke(other.lease)
        lease = await self.etcd.lease_grant(LEASE_TTL_S)
        key = daemon_key(me.id, me.node)
        if not await self.etcd.put_if(key, me.encode(), 0, lease):
            await self.etcd.lease_revoke(lease)
            held = await self.etcd.get_kv(key)  # ours, from a claim cut short by its timeout?
            record = DaemonRecord.decode(held.value) if held is not None else None
            if held is None or record is None or record.run_id != me.run_id:
                self.refused = f"stack identity {me.id!r} was taken by another daemon meanwhile"
                return False
            lease = held.lease
        self.lease = lease
        log.info("identity.held", key=daemon_key(me.id, me.node), lease=f"{lease:x}")
        return True

    async def others_in_namespace(self, namespace: str) -> list[str] | None:
        """The other live stacks whose workers use `namespace`, described (the sweep asks;
        it raises EtcdError while etcd cannot tell); where etcd's auth hides the other
        stacks, HIDDEN: any of them may. Claims the identity first if not yet held; None
        if another daemon holds it (then this stack's lease records are that daemon's)."""
        assert self.etcd is not None and self.record is not None
        if not await self.claim():
            return None
        found = await look(self.etcd, self.record.id)
        if found.others_hidden:
            return [HIDDEN]
        return [o.describe() for o in sharers(self.record, found.daemons).get(namespace, [])]

    async def _keep(self) -> None:
        """Keep the lease alive (claim again if it lapsed), refresh the shared view."""
        assert self.etcd is not None
        while True:
            try:
                if self.lease is None or await self.etcd.lease_keepalive(self.lease) is None:
                    self.lease = None
                    await self.claim()
                await self._refresh_shared()
            except (TimeoutError, EtcdError) as exc:
                log.debug("identity.etcd_unavailable", error=str(exc))
            await asyncio.sleep(min(LEASE_TTL_S / 3, REFRESH_S))

    async def _refresh_shared(self) -> None:
        assert self.etcd is not None and self.record is not None
        shared = {}
        found = await look(self.etcd, self.record.id)
        self.others_hidden = found.others_hidden
        for namespace, others in sharers(self.record, found.daemons).items():
            mine = self.registrations.live_instances(namespace)
            theirs = [i for i in await dynamo.list_instances(self.etcd, namespace)
                      if i.instance_id not in mine]  # fmt: skip
            shared[namespace] = {
                "stacks": [o.describe() for o in others],
                "workers": len({i.instance_id for i in theirs}),
            }
        self.shared = shared

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.etcd is not None:
            if self.lease is not None:  # the identity is free at once (where etcd still is)
                with contextlib.suppress(TimeoutError, EtcdError):
                    async with asyncio.timeout(STOP_REVOKE_S):
                        await self.etcd.lease_revoke(self.lease)
            await self.etcd.close()

    def status(self) -> dict[str, Any]:
        if self.record is None:
            return {}
        return {
            "identity": {
                "id": self.record.id,
                "etcd": self.endpoint,
                "key": daemon_key(self.record.id, self.record.node),
                "held": self.lease is not None,
                "refused": self.refused,
                "shared_namespaces": self.shared,
                # whether the look could see other stacks' daemons (not under etcd's auth)
                "others_visible": not self.others_hidden,
            }
        }

