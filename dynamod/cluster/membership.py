"""A node's membership in its cluster, as a daemon extension: it writes this node's entry in
the registry on a lease of its own (kept alive three times per `lease_ttl`; the entry's keys
written when they change, or when a read finds one gone or not as written), reads everyone's
entries for `status` from a copy of the stack's registry prefix kept by a watch (read whole
again only when the watch breaks, after this daemon's own registry calls failed, and every
RESYNC_S), and, while it holds the leader key, turns a node whose lease expired (or whose
heartbeats fell silent: cluster/heartbeat.py, the leader then revokes that lease) into a lost
record the moment etcd deletes its entry and withdraws that node's Dynamo registrations
(cluster/parking.py) so the router stops using its shards. Back
in contact after its own lease expired, it puts its shards' registrations back (each paused,
then replayed at the ledger's current version before it is admitted) or, where a
registration is gone for good, restarts the shard; and it follows the ledger, so a push made
on another node reaches this node's shards. `down --cluster` (cluster/shutdown.py) is served
from here."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import structlog
from aiohttp import web

from dynamod.cluster import heartbeat, join, parking, registry
from dynamod.cluster.forget import ForgetRefused, forget_node
from dynamod.cluster.parking import ParkedKey
from dynamod.cluster.registry import ForgottenRecord, LostRecord, NodeEntry, UnitEntry
from dynamod.cluster.secrets import load_etcd_auth
from dynamod.cluster.shutdown import ClusterShutdown, carry_out
from dynamod.core.errors import DynamodError
from dynamod.core.extensions import Extension
from dynamod.core.placement import ClusterSpec
from dynamod.core.state import UnitState
from dynamod.rollout import dynamo, policy_table
from dynamod.rollout.etcd import EtcdAuth, EtcdClient, EtcdError, reconnect_all
from dynamod.rollout.etcd.mirror import PrefixMirror
from dynamod.rollout.etcd.records import Compare, KeyValue, TxnDelete
from dynamod.rollout.worker_table import worker_of

if TYPE_CHECKING:
    from dynamod.core.engine import Engine, Unit
    from dynamod.core.extensions import ExtensionHost
    from dynamod.rollout.ledger import PolicyVersion
    from dynamod.rollout.policy import PolicyManager
    from dynamod.rollout.registrations import DynamoRegistrations

log = structlog.get_logger("dynamod.cluster.membership")

READ_FALLBACK_S = 1.0  # a look without a change seen: a deferred loss is judged again
# Reads after a put under the registry prefix (an entry rewritten) are at least this far
# apart; a delete (a lease's expiry: a node to mark lost) is read at once. Every read is the
# whole prefix, every node's entry: at 8 nodes x 32 shards ~260 KB, and during a start or
# after a loss entries change many times a second, so reads back to back on every daemon
# kept etcd's members busy past the registry lease (keepalives answered in 1-2 s).
READ_GAP_S = 0.5
# With the copy kept by the watch (PrefixMirror) a look costs etcd nothing: a put is looked
# at this soon (a push waits for the other nodes' entries to show its version).
MIRROR_GAP_S = 0.1
# ... and this soon in the first AWAITED_FOR_S of a push's or a publish's wait for the
# other nodes' entries to show its step (`await_other_nodes`): with the 0.1 s gap a 2-node
# publish answered ~100 ms after the other node's shards held the step (bench.publish_nodes).
# A longer wait (a big fleet's push on shared cores, 17 s at 8 x 32) looks at 0.1 s again,
# so that its looks cost the daemon no more than they did.
AWAITED_GAP_S = 0.02
AWAITED_FOR_S = 1.0
# The copy is read whole again this often even while its watch looks healthy: a stream
# that went silent without an error (a cut link, before gRPC's keepalive notices) leaves
# it stale for no longer than this.
RESYNC_S = 10.0
WATCH_RETRY_S = 0.5
CALL_TIMEOUT_S = 1.0
PUBLISH_RETRY_S = 0.1  # a failed publish round or keepalive is tried again this soon
ROUND_TIMEOUT_S = 8.0  # a publish or read round: a few calls, each failing over in turn
# The follower's own look at the ledger while no watch of it is open, or after a look that
# did not go through; with a watch open it looks at each move and every RESYNC_S (2 reads a
# second a node were most of an idle 8-node fleet's etcd reads).
LEDGER_FOLLOW_S = 0.5
HEARTBEAT_LOOK_S = 0.1  # the leader looks at what its pinger heard this often
LOOP_RESTART_S = 1.0  # a loop that ended anyway (a bug) starts again this much later
STOP_GRACE_S = 3.0  # stop(): the loops' cancel, then the lease's revocation, each this long
_T = TypeVar("_T")
_FAILURES = (EtcdError, TimeoutError, aiohttp.ClientError, OSError)
# An unchanged entry is not rewritten: every write wakes every node's registry watch into a
# read of the whole prefix, so rewriting it at each keepalive (as once) made idle reads grow
# as nodes squared (bench.fleet: 6 -> 120 reads/s from 1 to 8 nodes), and a rewrite of every
# key every 10 leases (as next) was an idle 8 x 32 fleet's every write, ~270 KB of etcd
# history a minute. A key lost some other way than its lease is found by the reads instead
# (`not_as_written`) and put back.


class Membership(Extension):
    """Control socket routes:
    GET  /cluster        the cluster view (also the `cluster` key of `status`)
    POST /cluster/down   stop every node in reverse dependency order (cluster/shutdown.py)
    POST /cluster/forget a node gone for good: {"node"} (cluster/forget.py)
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        registrations: DynamoRegistrations,
        policy: PolicyManager | None,
    ) -> None:
        self.cluster = cluster
        self.registrations = registrations
        self.policy = policy
        self.host: ExtensionHost | None = None
        self.etcd: EtcdClient | None = None
        self.lease: int | None = None
        self.entries: dict[str, NodeEntry] = {}
        # the registry prefix as the watch keeps it (None: not in step; reads go to etcd)
        self._mirror: PrefixMirror | None = None
        self._resync = asyncio.Event()  # this daemon's own calls failed: read it whole again
        self._decoded = registry.EntryCache()
        self.lost: dict[str, LostRecord] = {}
        self.forgotten: dict[str, ForgottenRecord] = {}  # `dynamod cluster forget`
        # Nodes whose entry vanished and that the leader has not marked lost yet: a marking
        # that failed (etcd) is tried again at the next read while the entry is still gone.
        self._unmarked: dict[str, NodeEntry] = {}
        self._deferred: set[str] = set()  # of those, the ones whose marking waits (logged once)
        self.trouble_at: float | None = None  # monotonic: the last failed registry round
        self._reconnected_at = 0.0  # monotonic: the last `back_at` that reopened etcd's
        self.seen: set[str] = set()
        self.leader: str | None = None
        self.down_request: dict[str, Any] | None = None
        self.down_acks: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self._outage = Outage()  # the failed registry calls since every loop went through
        self._failed_since_renewal = False  # a renewal after it reads the registry anew
        self.last_published: float | None = None  # monotonic, last successful publish
        self.renewed_at: float | None = None  # monotonic, the lease's last renewal (or grant)
        self._lease_gone = False  # the keepalive found the lease expired: a publish reports it
        self._away = False  # the keepalive went through again after more than a lease
        # each key of the entry as last put on this lease, and the store's revision after the
        # put; and the keys a read found gone or not as put (put again by the next publish)
        self._written: dict[str, tuple[str, int]] | None = None
        self._not_as_written: set[str] = set()
        self._read_once = False
        self._stale_down_id: str | None = None  # a stop request older than this daemon
        self._handled_down: set[tuple[str, str]] = set()
        self._dirty = asyncio.Event()
        self._changed = asyncio.Event()  # the watch saw a change under the registry prefix
        self._urgent = asyncio.Event()  # ... and it was a delete (or the watch broke)
        self._fresh = asyncio.Event()  # a read ended (a push waits on the other nodes' entries)
        self._awaiting, self._awaited_until = 0, 0.0  # waits on other nodes; looks sooner till
        self._ledger_moved = asyncio.Event()  # the watch saw the ledger's current version move
        self._ledger_watched = False  # a ledger watch is open (the follower waits longer)
        self._ledger_resync = asyncio.Event()  # this daemon's own calls failed: watch anew
        # what the read that opened the ledger's watch found: the follower's next look
        self._ledger_read: tuple[PolicyVersion | None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._restarting: set[str] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._auth: EtcdAuth | None = None
        self._stopping = False
        self._returning = False  # back after our lease expired: registrations to restore
        self._hearing = heartbeat.Hearing()  # this node's echo; the leader's pinger

    # ------------------------------------------------------------------ lifecycle

    @property
    def stack(self) -> str:
        assert self.host is not None
        return self.host.stack.name

    @property
    def engine(self) -> Engine:
        assert self.host is not None and self.host.engine is not None
        return self.host.engine

    async def start(self, host: ExtensionHost) -> None:
        self.host = host
        engine = self.engine
        # Every registry endpoint (the client fails over between them), with the cluster's
        # etcd credentials when the stack has a secrets directory.
        self._auth = load_etcd_auth(self.cluster.secrets, self.cluster.node)
        self.etcd = self._new_client()
        engine.listeners.append(self._on_change)
        self.registrations.others_live = self.others_live
        if self.policy is not None:
            self.policy.after_commit = self.await_other_nodes
        loops = {
            "cluster-keepalive": self._keepalive_loop,
            "cluster-publish": self._publish_loop,
            "cluster-watch": self._watch_loop,
            "cluster-read": self._read_loop,
        }
        if self.cluster.heartbeat_timeout > 0:
            self._hearing.responder = self._respond()
            loops["cluster-heartbeat"] = self._heartbeat_loop
        if self.policy is not None:
            loops["cluster-ledger"] = self._follow_loop
            if self.policy.spec.store == "etcd":
                loops["cluster-ledger-watch"] = self._ledger_watch_loop
        for name, body in loops.items():
            self._spawn(name, body)

    def _spawn(self, name: str, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
        task = asyncio.get_running_loop().create_task(body(), name=name)
        self._tasks.append(task)
        task.add_done_callback(lambda done: self._loop_ended(done, name, body))

    def _loop_ended(
        self, task: asyncio.Task[None], name: str, body: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        """A loop never ends while this daemon runs: one that does is logged and started
        again (a node whose loop ended would stay unseen, or frozen, for good)."""
        if task in self._tasks:
            self._tasks.remove(task)
        if self._stopping:
            return
        why = "cancelled" if task.cancelled() else repr(task.exception())
        log.error("cluster.loop_ended", node=self.cluster.node, loop=name, why=why,
                  action=f"started again in {LOOP_RESTART_S:g}s")  # fmt: skip
        asyncio.get_running_loop().call_later(LOOP_RESTART_S, self._respawn, name, body)

    def _respawn(self, name: str, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if not self._stopping:
            self._spawn(name, body)

    def _new_client(self) -> EtcdClient:
        return EtcdClient(
            registry.local_first(list(self.cluster.registry), self.cluster.address),
            timeout_s=registry.call_timeout(self.cluster.lease_ttl, CALL_TIMEOUT_S),
            auth=self._auth,
        )

    async def _bounded(self, what: str, round_: Awaitable[_T]) -> _T:
        """One publish, read or keepalive round, cut off after ROUND_TIMEOUT_S: every call
        has its own deadline, yet the cluster-ha test saw a node's rounds stop for good after the
        start-up TLS and auth failures with nothing logged. A round that overruns gets a
        fresh client (new connections); the old one is closed behind it. asyncio.timeout,
        not wait_for: Python 3.11's wait_for returns the round's result when the round ends
        just as the loop is cancelled, and the loop then ran on after stop() (a daemon that
        did not exit after `down`)."""
        try:
            async with asyncio.timeout(ROUND_TIMEOUT_S):
                return await round_
        except TimeoutError:
            log.warning("cluster.registry_stuck", node=self.cluster.node, round=what,
                        seconds=ROUND_TIMEOUT_S, action="new etcd client")  # fmt: skip
            old, self.etcd = self.etcd, self._new_client()
            if old is not None:
                task = asyncio.get_running_loop().create_task(old.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            raise

    async def stop(self) -> None:
        """End the loops and revoke this node's lease, in bounded time: the daemon exits
        after this, whatever a loop or etcd does."""
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
            if stuck:
                names = sorted(t.get_name() for t in stuck)
                log.error("cluster.loops_not_stopped", node=self.cluster.node, loops=names,
                          seconds=STOP_GRACE_S)  # fmt: skip
        self._hearing.close()
        if self.etcd is not None and self.lease is not None:
            with contextlib.suppress(*_FAILURES, TimeoutError):  # else it expires in lease_ttl
                async with asyncio.timeout(STOP_GRACE_S):
                    await self.etcd.lease_revoke(self.lease)

    async def _down_here(self) -> dict[str, Any]:
        assert self.host is not None
        return await self.host.down()

    def routes(self) -> list[web.RouteDef]:
        async def view(_: web.Request) -> web.Response:
            return web.json_response(self.view())

        async def down(request: web.Request) -> web.Response:
            body: dict[str, Any] = {}
            with contextlib.suppress(ValueError):
                body = await request.json()
            wait = float(body.get("wait_s", 30))
            report = await ClusterShutdown(self, wait_s=wait).run()
            report["this_node_down"] = await self._down_here()
            return web.json_response(report)

        async def forget(request: web.Request) -> web.Response:
            body: dict[str, Any] = {}
            with contextlib.suppress(ValueError):
                body = await request.json()
            return web.json_response(await self.forget(str(body.get("node", ""))))

        return [
            web.get("/cluster", view),
            web.post("/cluster/down", down),
            web.post("/cluster/forget", forget),
        ]

    async def forget(self, node: str) -> dict[str, Any]:
        """`dynamod cluster forget NODE` (cluster/forget.py): what went, and its state."""
        if node not in self.cluster.nodes:
            raise ForgetRefused(
                f"no node {node!r} in stack {self.stack}'s [cluster] nodes "
                f"({', '.join(self.cluster.nodes)})"
            )
        assert self.etcd is not None and self.host is not None
        done = await forget_node(self.etcd, self.stack, node, self.cluster.node)
        self.host.events.emit("cluster.node_forgotten", node=node, by=self.cluster.node,
                              was_lost=done.was_lost, revoked=done.revoked)  # fmt: skip
        # this daemon's view at once (the watch's copy of the registry may lag the write)
        self.forgotten[node] = done.record
        self.lost.pop(node, None)
        self.seen.discard(node)
        return {**done.as_dict(), "state": self._state_of(node)}

    def _state_of(self, node: str) -> str:
        return str(registry.node_state(node, self.entries, self.lost, self.seen, self.forgotten))

    def status(self) -> dict[str, Any]:
        return {"cluster": self.view()}

    def view(self) -> dict[str, Any]:
        return registry.view(
            self.cluster.nodes,
            self.cluster.head,
            self.cluster.node,
            self.entries,
            self.lost,
            self.seen,
            self.leader,
            self.error,
            self.forgotten,
        )

    # ------------------------------------------------------------------ our entry

    def _on_change(self, unit: Unit, old: UnitState, new: UnitState) -> None:
        self._dirty.set()

    def entry(self) -> NodeEntry:
        assert self.host is not None
        shards = set(policy_table.shards(self.host.stack))
        units = [
            UnitEntry(
                name=unit.name,
                unit=unit.spec.unit,
                state=str(unit.state),
                pid=unit.pid,
                ports=dict(unit.spec.ports),
                detail=registry.short_detail(unit.detail),
                policy_version=self.policy.shard_version(unit) if self.policy else None,
                instance_ids=self.registrations.instance_ids(unit),
                shard=unit.name in shards,
            )
            for unit in self.engine.units.values()
            if unit.spec.remote is None
        ]
        return NodeEntry(
            node=self.cluster.node,
            address=self.cluster.address,
            daemon_pid=os.getpid(),
            run_id=self.host.run_id,
            phase=str(self.host.phase),
            head=self.cluster.is_head,
            units=units,
            policy_current=self.policy.current_version if self.policy else None,
            heartbeat_port=responder.port if (responder := self._hearing.responder) else None,
            state_dir=str(self.host.state_dir),
        )

    async def _publish_loop(self) -> None:
        period = self.cluster.lease_ttl / 3
        failed = 0  # rounds in a row
        while not self._stopping:
            try:
                await self._bounded("publish", self._publish())
                failed = 0
            except (Exception, asyncio.CancelledError) as exc:  # see _failed
                self._failed("publish", exc)
                failed += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(publish_wait(failed, period)):
                    await self._dirty.wait()
            self._dirty.clear()
            await asyncio.sleep(0.05)  # a burst of transitions makes one write

    async def _keepalive_loop(self) -> None:
        """Renew the lease every third of it, on a task of its own: a publish round may
        take seconds (an entry write on a loaded etcd, or putting back 32 shards'
        registrations and pausing each after a loss), and a keepalive that waited behind
        it let the lease expire again: at 4 nodes x 32 shards the head was marked lost
        4-9 times in one start, each return round ending in the next loss."""
        period = self.cluster.lease_ttl / 3
        failed = 0
        while not self._stopping:
            lease = self.lease
            self._reconnect_if_back()
            if lease is not None:
                try:
                    await self._renew(lease)
                    failed = 0
                except (Exception, asyncio.CancelledError) as exc:  # see _failed
                    self._failed("keepalive", exc)
                    failed += 1
            await asyncio.sleep(publish_wait(failed, period))

    def _reconnect_if_back(self) -> None:
        """While this daemon's registry calls fail, a ping that comes after a silence says
        its link is back: every etcd connection of the process is opened afresh. The ones
        open across the cut wait for TCP's next retransmission, whose interval doubled
        through the cut: a node's return waited 1.4-4.3 s on them."""
        responder = self._hearing.responder
        back = responder.back_at if responder is not None else None
        if self.error is None or back is None or back <= self._reconnected_at:
            return
        self._reconnected_at = back
        reconnect_all()
        log.info("cluster.link_back", node=self.cluster.node, after=self.error,
                 action="etcd connections opened afresh")  # fmt: skip

    async def _renew(self, lease: int) -> None:
        assert self.etcd is not None
        asked = time.monotonic()
        alive = await self._bounded("keepalive", self.etcd.lease_keepalive(lease)) is not None
        if self.lease != lease:  # a publish round replaced it meanwhile
            return
        now = time.monotonic()
        if not alive:  # etcd's answer that it is gone: a publish round takes a new one
            self.lease, self._lease_gone = None, True
        else:
            since = None if self.renewed_at is None else now - self.renewed_at
            if since is not None and since > self.cluster.lease_ttl / 2:
                # how near this node came to being marked lost, and where the time went
                log.warning("cluster.lease_renewed_late", node=self.cluster.node,
                            since_last_s=round(since, 3), call_s=round(now - asked, 3),
                            lease_ttl=self.cluster.lease_ttl)  # fmt: skip
            late = since is not None and since > self.cluster.lease_ttl
            self._away |= late
            self.renewed_at = now
        self._reachable("keepalive")  # an expired lease's answer went through as well
        if not alive or self._away:
            self._dirty.set()

    def _reachable(self, what: str) -> None:
        """A call of loop `what` went through. A renewal (keepalive or publish) after a
        failure of another loop than the watch reads the registry whole again and watches
        it anew: the failure may have moved the watch to a member that is cut off (an
        election times calls out on live members too), and a watch there is silent (a
        non-leader's view of a cut node came 1.5 s after the router had dropped it). The
        watch's own failure needs none: its loop reads and watches anew once a call goes
        through. Once every loop that failed went through, the outage is said to be over,
        with how many calls failed and for how long."""
        if what in ("keepalive", "publish") and self._failed_since_renewal:
            self._failed_since_renewal = False
            self._resync.set()
        ended = self._outage.through(what)
        if ended is not None:
            calls, failing_s = ended
            log.info("cluster.registry_reachable", node=self.cluster.node, after=self.error,
                     failed_calls=calls, failing_s=failing_s)  # fmt: skip
            self.error = None

    async def _publish(self) -> None:
        assert self.etcd is not None
        lease_lost, self._lease_gone = self._lease_gone, False
        called = False  # whether this round went to etcd (else it says nothing of etcd)
        if self.lease is None:
            self.lease = await self.etcd.lease_grant(max(1, math.ceil(self.cluster.lease_ttl)))
            self.renewed_at = time.monotonic()
            self._written = None  # a new lease: the entry goes on it
            called = True
        records = self.entry().records(self.stack)
        puts, deletes = must_write(self._written, records, self._not_as_written)
        if puts or deletes:
            done = 0  # the store's revision after the last write: a view at it sees them all
            for ops in registry.entry_writes(self.stack, self.cluster.node, puts, deletes,
                                             self.lease):  # fmt: skip
                done = (await self.etcd.txn_at([], ops))[1]
            kept = {k: v for k, v in (self._written or {}).items() if k in records}
            self._written = {**kept, **{k: (v, done) for k, v in puts.items()}}
            self._not_as_written = (self._not_as_written - puts.keys()) & records.keys()
            called = True
        if self.last_published is None:  # a lost record of this node's earlier run is stale
            await self._unforget(with_lost_record=True)
            if self.cluster.is_head:  # what `up --join` on another node reads
                await self.etcd.put(join.spec_key(self.stack), self._bundle().encode())
        now = time.monotonic()
        away = self._away or (
            self.last_published is not None and now - self.last_published > self.cluster.lease_ttl
        )
        self._away = False
        self.last_published = now
        if called:
            self._reachable("publish")
        if lease_lost or away:
            log.warning(
                "cluster.back_in_contact",
                node=self.cluster.node,
                lease_expired=lease_lost,
                why="this node may have been marked lost: its shards' registrations come back",
            )
            self._returning = True
        if self._returning:  # until it went through: a failed round tries again
            await self._after_return()

    def _bundle(self) -> join.StackBundle:
        assert self.host is not None
        stack = self.host.stack
        variables = stack.source.raw.vars if stack.source is not None else {}
        return join.bundle(stack.path, self.stack, variables, self.cluster.nodes)

    async def _after_return(self) -> None:
        """Back after our lease expired (the leader may have withdrawn our shards' instance
        keys): put back the keys it parked for shards whose Dynamo lease lived through it,
        each shard paused first and then replayed (held until admitted); restart every
        running shard whose registration is gone all the same."""
        assert self.etcd is not None
        record = await self.etcd.get_kv(registry.lost_key(self.stack, self.cluster.node))
        lost = LostRecord.decode(record.value) if record is not None else None
        parked = [ParkedKey.from_dict(p) for p in lost.parked] if lost is not None else []
        rejoining = [await self._put_back(unit, parked) for unit in self._local_shards()]
        namespaces = {w.namespace for w in (worker_of(u.spec) for u in self._local_shards()) if w}
        registered: set[int] = set()
        for namespace in namespaces:
            registered |= {i.instance_id for i in await dynamo.list_instances(self.etcd, namespace)}
        for unit in self._local_shards():
            ids = set(self.registrations.instance_ids(unit))
            if (
                unit.state.running
                and ids
                and not ids & registered
                and unit.name not in self._restarting
            ):
                log.warning(
                    "cluster.shard_restart", unit=unit.name, why="its registration is gone"
                )
                self._restarting.add(unit.name)
                asyncio.get_running_loop().create_task(self._restart(unit.name))
        for unit in filter(None, rejoining):
            if self.policy is not None and unit.state.running:
                self.policy.rejoin(unit, "its node was lost; back, replaying the current policy")
        if record is not None:  # a newer record (lost again meanwhile) is the next return's
            await parking.clear_record(self.etcd, record)
        await self._unforget()
        self._returning = False

    async def _unforget(self, *, with_lost_record: bool = False) -> None:
        """This node publishes its entry: a forgotten record of it (`cluster forget`, while
        it was cut off or stopped) no longer holds; at this run's first publish neither does
        a lost record of an earlier run. One transaction either way, whose compare says
        whether the node had been forgotten."""
        assert self.etcd is not None
        forgotten = registry.forgotten_key(self.stack, self.cluster.node)
        lost = [TxnDelete(registry.lost_key(self.stack, self.cluster.node))]
        also = lost if with_lost_record else []
        if await self.etcd.txn(
            [Compare(forgotten, "version", ">", 0)], [TxnDelete(forgotten), *also], also
        ):
            log.warning("cluster.back_after_forgotten", node=self.cluster.node,
                        why="an operator said this node was gone for good; it is back")  # fmt: skip

    async def _put_back(self, unit: Unit, parked: list[ParkedKey]) -> Unit | None:
        """The shard's parked keys back on its lease, it paused first; the unit if done."""
        assert self.etcd is not None
        ids = set(self.registrations.instance_ids(unit))
        mine = [key for key in parked if key.instance_id in ids]
        if not mine or not unit.state.running:
            return None
        if self.policy is not None and unit.hold_reason is None:  # held: its replay owns it
            try:  # not one request before its replay
                await self.policy.call(unit, "pause_generation", {})
            except DynamodError as exc:
                log.warning("cluster.put_back_skipped", unit=unit.name, why=str(exc))
                return None
        restored, gone = await parking.put_back(self.etcd, mine)
        log.info("cluster.registration_put_back", unit=unit.name,
                 keys=[k.key for k in restored], lease_gone=[k.key for k in gone])  # fmt: skip
        return unit if restored else None

    async def _restart(self, name: str) -> None:
        try:
            await self.engine.restart_unit(name)
        except Exception as exc:  # a down began meanwhile; nothing to restart then
            log.info("cluster.shard_restart_skipped", unit=name, why=str(exc))
        finally:
            self._restarting.discard(name)

    def _local_shards(self) -> list[Unit]:
        assert self.host is not None
        return [self.engine.units[n] for n in policy_table.shards(self.host.stack)]

    def _failed(self, what: str, exc: BaseException) -> None:
        """Record a failed registry round. The loops survive every exception, and a
        CancelledError that is no cancel of this task: gRPC raises one in a call whose
        channel another call closed, and it used to end the publish loop silently (the
        cluster-ha test's nodes that stayed `unknown`). A real cancel (stop) goes on up."""
        if isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise exc
        self.trouble_at = time.monotonic()
        # the watch loop reads the registry whole and watches it anew after its own failure;
        # a renewal's resync on top of that was one more whole read a renewal while it failed
        if what != "watch":
            self._failed_since_renewal = True
        if what in ("keepalive", "publish"):  # out of contact: the watches may be silent too
            self._resync.set()
            self._ledger_resync.set()
        text = f"registry {self.cluster.registry[0]} {what}: {exc.__class__.__name__}: {exc}"
        first = self._outage.failed(what, exc.__class__.__name__)
        unexpected = not isinstance(exc, _FAILURES)
        # once a loop and kind until every loop went through (`_reachable` says how many
        # and how long); a failure that is no etcd trouble (a bug) each time it reads
        # otherwise
        if first or (unexpected and text != self.error):
            log.warning("cluster.registry_unreachable", node=self.cluster.node, error=text,
                        unexpected=unexpected)  # fmt: skip
        self.error = text

    # ------------------------------------------------------------------ everyone's entries

    async def _watch_loop(self) -> None:
        """Keep the copy of the registry prefix: one read, then every change from the
        watch from the revision after it, each waking the reader (a node's entry deleted
        by its lease's expiry is acted on at once). The copy goes, and the reader reads
        etcd, from the moment the watch breaks until a new read and watch are in step;
        it is read whole again every RESYNC_S, and after this daemon's own calls failed.
        On the planned read every RESYNC_S the copy, whole up to then, serves the reader
        until the new read replaces it (it once went for WATCH_RETRY_S, the reader reading
        the whole registry from etcd meanwhile: two or three whole reads a resync)."""
        while not self._stopping:
            self._resync.clear()
            planned = False
            try:
                planned = await self._keep_mirror()
            except (Exception, asyncio.CancelledError) as exc:  # as in _publish_loop
                self._failed("watch", exc)
            if planned:
                continue
            self._mirror = None
            self._urgent.set()  # read now: changes may have been missed
            self._changed.set()
            if not self._resync.is_set():
                await asyncio.sleep(WATCH_RETRY_S)

    async def _keep_mirror(self) -> bool:
        """Read the prefix into a new copy and keep it by the watch, until `watch_until`
        ends it; True where that was the planned resync (the copy is whole up to now)."""
        assert self.etcd is not None
        prefix = registry.prefix(self.stack)
        kvs, revision = await self._bounded("read", self.etcd.get_prefix_at(prefix))
        mirror = PrefixMirror(kvs, revision)
        self._mirror = mirror
        self._reachable("watch")
        self._urgent.set()
        self._changed.set()

        async def follow(etcd: EtcdClient) -> None:
            async for event in etcd.watch_prefix(prefix, start_revision=revision + 1):
                mirror.apply(event)
                if event.kind == "delete":
                    self._urgent.set()
                self._changed.set()

        return await watch_until(follow(self.etcd), self._resync)

    async def _read_loop(self) -> None:
        while not self._stopping:
            self._changed.clear()
            self._urgent.clear()
            began = time.monotonic()
            try:
                await self._bounded("read", self.read())
                self._reachable("read")
            except (Exception, asyncio.CancelledError) as exc:  # as in _publish_loop
                self._failed("read", exc)
            self._fresh.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(READ_FALLBACK_S):
                    await self._changed.wait()
            gap = began + self._read_gap() - time.monotonic()
            if gap > 0 and not self._urgent.is_set():  # a put: not before the gap, unless a
                with contextlib.suppress(TimeoutError):  # delete comes meanwhile
                    async with asyncio.timeout(gap):
                        await self._urgent.wait()

    def _read_gap(self) -> float:
        """Between a read and the next one after a put: etcd's reads are the costly ones;
        a look at the watch's copy costs etcd nothing, and a push that began waiting on
        the other nodes less than AWAITED_FOR_S ago looks soonest."""
        if self._mirror is None:
            return READ_GAP_S
        soon = self._awaiting and time.monotonic() < self._awaited_until
        return AWAITED_GAP_S if soon else MIRROR_GAP_S

    async def read(self) -> None:
        """Everything under the stack's registry prefix, into the fields above: from the
        copy the watch keeps, or from etcd while there is none."""
        assert self.etcd is not None
        mirror = self._mirror
        if mirror is not None:
            kvs, revision = mirror.values(), mirror.revision
        else:
            kvs, revision = await self.etcd.get_prefix_at(registry.prefix(self.stack))
        found = registry.parse(self.stack, kvs, self._decoded)
        if self._written is not None and self.lease is not None:
            gone = not_as_written(self._written, kvs, self.lease, revision)
            if gone - self._not_as_written:
                log.warning("cluster.entry_not_as_written", node=self.cluster.node,
                            keys=sorted(gone)[:5], count=len(gone))  # fmt: skip
                self._not_as_written |= gone
                self._dirty.set()
        for key, error in found.bad:
            log.warning("cluster.bad_record", key=key, error=error)
        entries, leader, down = found.entries, found.leader, found.down
        before = self.entries
        # a forgotten node is neither lost (pinged, its record shown) nor unseen (waited
        # for), whatever record a marking that raced the forget left; its entry, if it comes
        # back, decides
        forgotten = {n: r for n, r in found.forgotten.items() if n not in entries}
        lost = {n: r for n, r in found.lost.items() if n not in forgotten}
        self.entries, self.lost, self.leader = entries, lost, leader
        self.forgotten = found.forgotten
        self.down_request, self.down_acks = down, found.acks
        self.seen = (self.seen | set(entries)) - set(forgotten)
        if not self._read_once:  # a request older than this daemon is not for it
            self._read_once = True
            self._stale_down_id = str(down.get("id")) if down else None
        await self._handle_down()
        if (
            leader is None
            and self.lease is not None
            and self._running()
            and await self.etcd.put_if(
                registry.leader_key(self.stack), self.cluster.node, 0, self.lease
            )
        ):
            self.leader = self.cluster.node
            log.info("cluster.leader", node=self.cluster.node)
        stopping = self._cluster_stopping()
        if self.leader != self.cluster.node or stopping:
            self._unmarked.clear()
            self._deferred.clear()
            return
        for name in registry.newly_lost(before, entries, stopping=stopping):
            self._unmarked[name] = before[name]
        await self._judge(entries)

    async def _judge(self, entries: dict[str, NodeEntry]) -> None:
        """As the leader: mark lost each node whose entry vanished and is still gone, once
        this daemon may judge (registry.may_judge), or at once where it revoked that
        entry's lease itself (the heartbeats judged it: an election that failed this
        daemon's calls meanwhile is no outage that expired every entry)."""
        judge = registry.may_judge(self.trouble_at, time.monotonic(), self.cluster.lease_ttl)
        revoked = self._hearing.why_lost
        # read() also runs from a push (await_other_nodes) beside the read loop: a marking is
        # taken out of _unmarked before it starts, so no other read starts it again
        for name in list(self._unmarked):
            if name in self.forgotten and name not in entries:  # gone for good, it was said
                self._unmarked.pop(name, None)
                self._deferred.discard(name)
                continue
            if name in entries:  # it published again: nothing to mark
                self._unmarked.pop(name, None)
                revoked.pop(name, None)
                self._back_before_judged(name)
                continue
            if not judge and name not in revoked:
                self._defer(name)
                continue
            entry = self._unmarked.pop(name, None)
            if entry is None:
                continue
            self._deferred.discard(name)
            try:
                await self._mark_lost(name, entry)
            except BaseException:  # an etcd failure: tried again at the next read
                self._unmarked.setdefault(name, entry)
                raise

    def _defer(self, name: str) -> None:
        if name in self._deferred:
            return
        self._deferred.add(name)
        assert self.trouble_at is not None
        log.info("cluster.node_loss_deferred", node=name,
                 own_trouble_s_ago=round(time.monotonic() - self.trouble_at, 2),
                 why="its entry vanished while this daemon's own registry calls failed (an "
                     "etcd outage expires every entry at once): marked lost only if still gone "
                     "once this daemon has been in contact for a whole lease")  # fmt: skip

    def _back_before_judged(self, name: str) -> None:
        if name in self._deferred:
            self._deferred.discard(name)
            log.info("cluster.node_back_before_judged", node=name)

    def _cluster_stopping(self) -> bool:
        """A `down --cluster` is under way (a request newer than this daemon): nodes going
        away are not lost."""
        down = self.down_request
        return down is not None and str(down.get("id")) != self._stale_down_id

    def _running(self) -> bool:
        assert self.host is not None
        return self.host.phase.running

    async def _mark_lost(self, name: str, entry: NodeEntry) -> None:
        """Its lease expired: withdraw its shards' registrations (their instance keys, kept
        in the lost record for the node to put back) and record it lost; neither if it is
        back in the registry by then (parking.py: the two sides race)."""
        assert self.etcd is not None
        started = time.monotonic()
        shards = [registry.shard_id(name, u.name) for u in entry.shards()]
        since = time.time()
        why = self._hearing.why_lost.get(name, registry.LEASE_EXPIRED)  # kept for a retry

        def record(parked: list[ParkedKey]) -> LostRecord:
            return LostRecord(
                node=name,
                since=since,
                by=self.cluster.node,
                shards=shards,
                revoked=sorted({f"{key.instance_id:x}" for key in parked}),
                parked=[key.as_dict() for key in parked],
                why=why,
                address=entry.address,
                heartbeat_port=entry.heartbeat_port,
            )

        parked = await parking.withdraw(
            self.etcd,
            [i for unit in entry.units for i in unit.instance_ids],
            absent=registry.node_key(self.stack, name),
            record_key=registry.lost_key(self.stack, name),
            record=lambda parked: record(parked).encode(),
            earlier=[ParkedKey.from_dict(p) for p in self.lost[name].parked]
            if name in self.lost
            else [],
        )
        ms = round((time.monotonic() - started) * 1000, 1)
        self._hearing.why_lost.pop(name, None)
        if parked is None:
            log.info("cluster.node_back_before_lost", node=name, ms=ms)
            return
        self.lost[name] = record(parked)
        log.warning("cluster.node_lost", node=name, shards=shards,
                    revoked=self.lost[name].revoked, ms=ms)  # fmt: skip

    async def others_live(self) -> set[int]:
        """Instance ids of the live workers of the other nodes (never swept here)."""
        await self.read()
        return {
            instance
            for name, entry in self.entries.items()
            if name != self.cluster.node
            for unit in entry.units
            for instance in unit.instance_ids
        }

    # ------------------------------------------------------------------ down --cluster

    async def _handle_down(self) -> None:
        request = self.down_request
        if request is None or str(request.get("id")) == self._stale_down_id:
            return
        step = str(request.get("step"))
        key = (str(request.get("id")), step)
        if key in self._handled_down or self.cluster.node not in request.get("nodes", []):
            return
        self._handled_down.add(key)
        asyncio.get_running_loop().create_task(
            carry_out(self, self.engine, self._down_here, request)
        )

    # ------------------------------------------------------------------ heartbeats

    def _respond(self) -> heartbeat.Responder | None:
        """This node's echo of the leader's heartbeats, on its cluster address; without one
        (the address cannot be bound) the registry lease alone decides this node's loss."""
        try:
            return heartbeat.Responder(self.cluster.address)
        except OSError as exc:
            log.warning("cluster.heartbeat_unavailable", node=self.cluster.node,
                        address=self.cluster.address, error=str(exc),
                        action="its loss is judged by its registry lease alone")  # fmt: skip
            return None

    def _heard_by_me(self) -> dict[str, tuple[str, int]]:
        """The nodes this daemon pings, at (address, heartbeat port): as the leader, every
        other node, and each lost one where its lost record says it last echoed (its pings
        after a heal tell it that its link is back: `_reconnect_if_back`); as the deputy
        (the first of the other nodes by name), the leader alone, whom no one else hears;
        none otherwise."""
        me, leader = self.cluster.node, self.leader
        others = {
            name: (e.address, e.heartbeat_port)
            for name, e in self.entries.items()
            if name != me and e.heartbeat_port
        }
        if leader == me:
            lost = {
                name: where
                for name, record in self.lost.items()
                if name not in others and name != me and (where := record.heard_at) is not None
            }
            return {**others, **lost}
        deputy = min((name for name in self.entries if name != leader), default=None)
        if leader is not None and deputy == me and leader in others:
            return {leader: others[leader]}
        return {}

    async def _heartbeat_loop(self) -> None:
        """Ping the nodes this daemon hears (`_heard_by_me`: the leader every other node,
        the deputy the leader) that give a heartbeat port in their entry, and revoke the
        registry lease of one that answered before and has been silent for
        `heartbeat_timeout` (heartbeat.judge), while this daemon is in contact with etcd
        (`_in_contact`)."""
        timeout, hearing = self.cluster.heartbeat_timeout, self._hearing
        while not self._stopping:
            await asyncio.sleep(HEARTBEAT_LOOK_S)
            targets = self._heard_by_me() if self._running() else {}
            if not targets:
                hearing.stop_pinging()
                continue
            if self._cluster_stopping():  # nodes fall silent as they stop: not lost
                continue
            if hearing.pinger is None:
                hearing.pinger = heartbeat.Pinger(self.stack)
            hearing.pinger.aim(targets)
            heard = hearing.pinger.heard()
            for name, when in list(hearing.silenced.items()):  # it answered again: armed
                if heard.answered.get(name, -1.0) > when:
                    del hearing.silenced[name]
            for name in list(hearing.waiting):
                last = heard.answered.get(name)
                if last is None:  # no longer pinged (its entry went): its loss is marked
                    hearing.waiting.discard(name)
                elif heard.now - last < timeout:  # it answered again: no loss to say why of
                    hearing.waiting.discard(name)
                    hearing.why_lost.pop(name, None)
            # a lost node is pinged only to hear that its link is back: never judged
            gone = set(self.lost) - set(self.entries)
            armed = {n for n in heard.answered if n not in hearing.silenced and n not in gone}
            judgment = heartbeat.judge(heard, armed, timeout)
            lost, overdue, withheld = judgment.lost, judgment.overdue, judgment.withheld
            if lost and not self._in_contact():
                lost, overdue = [], lost
                withheld = "this daemon's own last registry call failed"
            self._say_withheld(heard, overdue, withheld)
            await self._revoke_each(lost, heard)

    def _in_contact(self) -> bool:
        """Whether this daemon's last registry call went through (no failure since its
        lease's last renewal). The heartbeats judge only then: a daemon cut off from etcd
        may be cut off from the nodes too. Not a whole lease, as for an expiry: an etcd
        electing a leader holds every call for a second or two, and the node cut off may
        have held etcd's leader (its loss then waits for the election, not a lease more)."""
        if self.trouble_at is None:
            return True
        return self.renewed_at is not None and self.renewed_at > self.trouble_at

    async def _revoke_each(self, lost: list[str], heard: heartbeat.Heard) -> None:
        """Revoke each judged node's lease; one whose revocation failed (etcd electing a
        leader, or out of reach) stays judged and is tried again at the next look, while
        it is silent and this daemon in contact, until its lease expires."""
        hearing = self._hearing
        for name in lost:
            try:
                await self._revoke_silent(name, heard.now - heard.answered[name])
            except _FAILURES as exc:
                self._say_revoke_waits(name, exc)
                continue
            hearing.silenced[name] = heard.now  # judged: not again before it answers again
            hearing.waiting.discard(name)

    def _say_withheld(self, heard: heartbeat.Heard, overdue: list[str], why: str) -> None:
        """Log once per silence each node that the heartbeats found silent and did not
        judge, with why (its lease decides)."""
        said = self._hearing.withheld
        said &= set(overdue)  # a node that answered again may be said again later
        for name in overdue:
            if name not in said:
                said.add(name)
                log.warning("cluster.heartbeat_withheld", node=name,
                            silent_s=round(heard.now - heard.answered[name], 2), why=why,
                            action="left to its registry lease")  # fmt: skip

    def _say_revoke_waits(self, name: str, exc: BaseException) -> None:
        """Log once per silence that a silent node's revocation failed for now (most often
        etcd electing a leader: the node cut off may have held it)."""
        if name not in self._hearing.waiting:
            self._hearing.waiting.add(name)
            log.warning("cluster.node_silent_revoke_waits", node=name, error=str(exc),
                        action="tried again every heartbeat look until etcd takes it "
                               "or the node's lease expires")  # fmt: skip

    async def _revoke_silent(self, name: str, silent_s: float) -> None:
        """Revoke the registry lease of `name`'s entry: etcd deletes the entry, and the
        leader marks the node lost at once, as at the lease's expiry. The deputy judging
        the leader silent first takes the leader key over from it (the key was on that
        lease), so the record of the loss it judged says why: taken after the revocation,
        another node that saw the key go free took it first, and its record waited a lease
        more (it had not judged the loss, and the election that the cut had started had
        failed its calls)."""
        assert self.etcd is not None
        record = await self.etcd.get_kv(registry.node_key(self.stack, name))
        if record is None or not record.lease:
            return  # gone already (its lease expired, or it stopped)
        if name == self.leader:
            await self._take_leader_key(name)
        why = f"silent for {silent_s:.1f}s (heartbeat)"
        # before the call: the watch may bring the delete; kept if the call fails (one that
        # timed out may still apply), until the node answers again
        self._hearing.why_lost[name] = why
        await self.etcd.lease_revoke(record.lease)
        log.warning("cluster.node_silent", node=name, silent_s=round(silent_s, 2),
                    timeout_s=self.cluster.heartbeat_timeout,
                    action="lease revoked: marked lost now, not at its expiry")  # fmt: skip
        # read the registry whole again, not from the watch's copy: after a cut, the watch
        # may sit on a connection to a member that was on the cut node (one cut that ended
        # etcd's leader left the delete unseen here for 1.1-1.2 s after the revocation)
        self._resync.set()
        self._urgent.set()
        self._changed.set()

    async def _take_leader_key(self, silent: str) -> None:
        """As the deputy: put this node in the leader key, on this node's lease, if the
        silent leader still holds it (compared by revision: no other node's takeover is
        overwritten)."""
        assert self.etcd is not None
        key = registry.leader_key(self.stack)
        held = await self.etcd.get_kv(key)
        if held is None or held.value.decode(errors="replace") != silent or self.lease is None:
            return
        if await self.etcd.put_if(key, self.cluster.node, held.mod_revision, self.lease):
            self.leader = self.cluster.node
            log.info("cluster.leader", node=self.cluster.node, after=silent)

    # ------------------------------------------------------------------ policy across nodes

    async def _ledger_watch_loop(self) -> None:
        """Wake the follower below when a push (another node's) moves the ledger's current
        version: this node's shards start their replay at once. The watch starts from the
        revision of a read of the current version, and the follower looks at what that
        read found (no second read), so no move falls between the two. While it is open
        the follower looks only at a move and when the watch is opened again: every
        RESYNC_S, and after this daemon's own calls failed (a watch on a cut link can go
        silent); while it is not, every LEDGER_FOLLOW_S."""
        assert self.policy is not None
        while not self._stopping:
            self._ledger_resync.clear()
            broke = False
            try:
                await self._watch_ledger()
            except (Exception, asyncio.CancelledError) as exc:  # as in _publish_loop
                self._failed("ledger watch", exc)
                broke = True
            self._ledger_watched = False
            self._ledger_moved.set()  # look now: a move may have been missed
            if broke:
                await asyncio.sleep(WATCH_RETRY_S)

    async def _watch_ledger(self) -> None:
        """One watch of the ledger's current version, for up to RESYNC_S."""
        assert self.policy is not None
        async with asyncio.timeout(ROUND_TIMEOUT_S):
            read = await self.policy.ledger_read()
        self._reachable("ledger watch")
        changes = None if read is None else self.policy.ledger_changes(read[1] + 1)
        if read is None or changes is None:  # a file ledger: no other node's push to follow
            await asyncio.sleep(RESYNC_S)
            return
        self._ledger_watched = True
        # the follower looks at what this read found: the watch carries every move after it
        self._ledger_read = (read[0],)
        self._ledger_moved.set()

        async def follow() -> None:
            async for _ in changes:
                self._ledger_moved.set()

        await watch_until(follow(), self._ledger_resync)

    async def _follow_loop(self) -> None:
        """Bring this node's shards to the ledger when it moves (`_ledger_watch_loop` says
        when). A look that did not go through (a push or an admission here held the policy
        lock, the daemon was not running, etcd failed) is tried again after
        LEDGER_FOLLOW_S, as is every look while no watch is open."""
        assert self.policy is not None
        looked = False
        while not self._stopping:
            # with a watch open, its re-opening every RESYNC_S brings a look; this wait is
            # only in case that loop stopped
            wait = 2 * RESYNC_S if self._ledger_watched and looked else LEDGER_FOLLOW_S
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._ledger_moved.wait()
            self._ledger_moved.clear()
            looked = False
            read, self._ledger_read = self._ledger_read, None  # a look later reads anew
            if not self._running() or self.policy.lock.locked():
                continue  # a push or an admission here reads the ledger itself
            with contextlib.suppress(*_FAILURES):
                if await self.policy.follow_ledger(read) is not None:
                    self._dirty.set()
                looked = True

    async def await_other_nodes(self, step: int) -> dict[str, Any]:
        """After a push committed here: wait until every shard of the other nodes that are
        not lost holds `step` (their own daemons replay it), up to the policy's
        route_timeout. Returns `nodes` (node -> its shards' versions) and `behind`."""
        assert self.policy is not None
        deadline = time.monotonic() + self.policy.spec.route_timeout
        self._awaiting += 1  # the read loop looks at each change sooner for a while
        self._awaited_until = max(self._awaited_until, time.monotonic() + AWAITED_FOR_S)
        try:
            while True:
                others = {n: e for n, e in self.entries.items() if n != self.cluster.node}
                late = registry.behind(others, step)
                unseen = self.unseen()
                left = deadline - time.monotonic()
                if (not late and not unseen) or left <= 0:
                    break
                # the read loop's next read (its own reads every 0.1 s, on top, cost etcd
                # ~2.6 MB/s at 8 x 32 for as long as a push waited)
                self._fresh.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, READ_FALLBACK_S + READ_GAP_S)):
                        await self._fresh.wait()
        finally:
            self._awaiting -= 1
        return {
            "nodes": {
                name: {registry.shard_id(name, u.name): u.policy_version for u in e.shards()}
                for name, e in others.items()
            },
            "behind": sorted(s for shards in late.values() for s in shards),
            "lost_nodes": sorted(set(self.lost) - set(self.entries)),
            "unseen_nodes": unseen,
        }

    def unseen(self) -> list[str]:
        """Other nodes seen in this daemon's life whose registry entry is gone and that no
        one has marked lost: after an etcd outage longer than the registry lease every
        entry expires at once and comes back as its node gets through again. A push waits
        for them (or names them) instead of answering as if they did not exist."""
        return sorted(self.seen - set(self.entries) - set(self.lost) - {self.cluster.node})


class Outage:
    """The registry calls that failed since every loop last went through: each loop warns
    at its first failure of a kind, not at each (with several members the endpoints' order
    in the error turns from call to call: the ~7 s without etcd at cluster-ha.toml's first
    start logged ~60 warnings a daemon). The outage ends when each loop that failed has
    gone through again, not at the next renewal: a loop failing alone while the renewals
    go through (the ledger watch refused, say) warned again and said "reachable" at each
    renewal, two lines a second."""

    def __init__(self) -> None:
        self.said: set[tuple[str, str]] = set()  # (loop, error class) warned this outage
        self.failing: set[str] = set()  # the loops whose last call failed
        self.calls = 0
        self.since: float | None = None  # monotonic, the outage's first failed call

    def failed(self, what: str, kind: str) -> bool:
        """Count one failed call of loop `what`; True where it is that loop's first of
        this kind in this outage."""
        first = (what, kind) not in self.said
        self.said.add((what, kind))
        self.failing.add(what)
        self.calls += 1
        if self.since is None:
            self.since = time.monotonic()
        return first

    def through(self, what: str) -> tuple[int, float | None] | None:
        """Loop `what` went through. Where it was the last loop failing, the outage is
        over: how many calls failed, for how many seconds (counted afresh from here)."""
        if what not in self.failing:
            return None
        self.failing.discard(what)
        if self.failing:
            return None
        calls = self.calls
        failing_s = None if self.since is None else round(time.monotonic() - self.since, 2)
        self.said, self.calls, self.since = set(), 0, None
        return calls, failing_s


async def watch_until(following: Coroutine[Any, Any, None], resync: asyncio.Event) -> bool:
    """Run a watch (`following`) until its stream ends, `resync` is set or RESYNC_S passed,
    then stop it. Its error is raised; a stream that was closed (a new client) just ends.
    True where RESYNC_S passed with the stream still open (a planned resync: what the watch
    kept is whole up to now)."""
    task = asyncio.ensure_future(following)
    wake = asyncio.ensure_future(resync.wait())
    try:
        done, _ = await asyncio.wait({task, wake}, timeout=RESYNC_S,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    finally:
        for pending in (task, wake):
            pending.cancel()
        await asyncio.gather(task, wake, return_exceptions=True)
    if task in done:
        task.result()
    return not done


def publish_wait(failed: int, period: float) -> float:
    """Seconds to the next publish round after `failed` failed rounds in a row: the period
    (a third of the lease) after a success; after a failure again soon, doubling up to the
    period. The lease has already lost the time the failed round took (a call waits up to a
    quarter of the lease on a silent member); a full period on top left a 2 s lease 0.1 s
    to spare, and a loaded machine's delay then let it expire."""
    if failed <= 0:
        return period
    return min(period, PUBLISH_RETRY_S * 2.0 ** min(failed - 1, 16))


def must_write(
    written: dict[str, tuple[str, int]] | None,
    records: dict[str, str],
    not_as_written: AbstractSet[str],
) -> tuple[dict[str, str], list[str]]:
    """What of a node's registry entry must be written: (keys to put, keys to delete). All
    of it when none was written on this lease yet (`written`: each key as last put, and
    when); else the keys that changed or that a read found not as written, and the keys of
    units that are gone. Nothing: the lease's keepalive alone keeps the entry."""
    if written is None:
        return dict(records), []
    deletes = sorted(written.keys() - records.keys())
    puts = {
        key: value
        for key, value in records.items()
        if key not in written or written[key][0] != value or key in not_as_written
    }
    return puts, deletes


def not_as_written(
    written: Mapping[str, tuple[str, int]], kvs: Iterable[KeyValue], lease: int, revision: int
) -> set[str]:
    """The keys of this node's entry that a view of the registry (`kvs`, as of the store's
    `revision`) found gone, changed, or on another lease than this node's: deleted or
    overwritten some other way than by its lease's expiry. Only keys whose put the view
    includes (`written`: each key's value and the store's revision after its put)."""
    found = {kv.key: kv for kv in kvs if kv.key in written}
    out = set()
    for key, (value, at) in written.items():
        if at > revision:
            continue
        kv = found.get(key)
        if kv is None or kv.lease != lease or kv.value != value.encode():
            out.add(key)
    return out
