"""Dynamo registrations of supervised workers.

- When a worker unit turns ready, learn its instance ids (= its etcd lease ids).
- The moment its process dies, revoke those leases, so the frontend's router (which
  watches etcd) drops it within milliseconds instead of after the ~30 s lease TTL. This
  runs before the restart decision, from the exit event itself.
- A revocation that fails (etcd away) is kept and retried until etcd answers again, so an
  outage never leaves a dead worker's registration behind for the rest of its lease.
- Each live worker's lease ids are kept in etcd beside the ledger (`LeaseRecords`), where
  they survive the daemon. Before the stack's first worker starts, revoke every
  registration in the stack's namespaces that belongs to no live unit: this stack's (a
  previous daemon's workers, e.g. after it was SIGKILLed; none of ours runs yet) and any
  no stack records, but never one that another stack records for its live worker.
- While running, report per worker whether the frontend currently routes to it, from the
  frontend's own discovery view.
- Before an apply stops a worker (`drain`), withdraw it from routing: its `generate`
  instance key is deleted (its lease and the streams it serves live on) and the drain waits
  until the stack's frontends no longer list it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from dynamod.core.extensions import Extension
from dynamod.core.restart import Exit
from dynamod.core.state import UnitState
from dynamod.core.status import DynamoStatus, ExtensionUnitStatus
from dynamod.rollout import dynamo, frontend_probe
from dynamod.rollout.etcd import EtcdAuth, EtcdClient, EtcdError
from dynamod.rollout.ledger import LeaseRecords
from dynamod.rollout.worker_table import DynamoFrontendProbe, worker_of

if TYPE_CHECKING:
    from dynamod.core.engine import Unit
    from dynamod.core.extensions import ExtensionHost

log = structlog.get_logger("dynamod.rollout.registrations")

_ID_ATTEMPTS = 50  # /health can turn ready a moment before etcd holds the registration
_ID_RETRY_S = 0.1
_ROUTED_REFRESH_S = 1.0
_PENDING_RETRY_S = 0.5
_SWEEP_TIMEOUT_S = 2.0
_WITHDRAW_WAIT_S = 5.0  # a frontend drops a withdrawn instance within ms (its etcd watch)
_WITHDRAW_POLL_S = 0.02


def stale_leases(
    registered: set[int], ours: set[int], others: set[int], *, shared: bool = False
) -> set[int]:
    """The leases to revoke before any of this stack's workers has started: this stack's
    own recorded ones (its units are all dead now) even where no instance key is left, and
    every registered one that no other stack records for a live unit, unless the namespace
    is `shared` with another live stack (its worker may not have recorded its lease yet:
    a registration whose owner may be alive is never revoked)."""
    return (ours | (set() if shared else registered)) - others


def _log_sweep(namespace: str, leases: list[int], kept: list[int], sharing: list[str]) -> None:
    """What a namespace's start-up sweep revoked and kept (or that it found nothing)."""
    if not leases and not kept:
        log.info("dynamo.swept", namespace=namespace, revoked=0, shared_with=sharing)
        return
    log.warning(
        "dynamo.stale_revoked",
        namespace=namespace,
        leases=[f"{lease:x}" for lease in leases],
        why="registered by no live unit (left by an earlier run of this stack, "
        "or recorded by no stack)",
        kept_for_other_stacks=[f"{lease:x}" for lease in kept],
        shared_with=sharing,
    )


@dataclass
class Registration:
    """What dynamod knows of one Dynamo worker's registration (`dynamo` in status)."""

    namespace: str
    system_url: str
    instance_ids: list[int]  # its etcd lease ids, as found when it turned ready
    routed: bool | None = None  # the frontend routes to it (None: no frontend view yet)

    def as_status(self) -> DynamoStatus:
        return {
            "namespace": self.namespace,
            "system_url": self.system_url,
            "instance_ids": list(self.instance_ids),
            "routed": self.routed,
        }


_RETRIED = "retried until etcd answers; until then the router may route to it"
_LAST_TRY = (
    "this daemon is stopping and tries no more: the registration stays until its Dynamo "
    "lease expires, or this stack's next start sweeps it (its lease record is kept)"
)


class DynamoRegistrations(Extension):
    """A daemon extension that is also the engine hook for Dynamo worker units. It keeps
    each worker's registration (unit name -> Registration) since the worker first turned
    ready; the policy manager and the cluster membership read its instance ids here."""

    def __init__(self, etcd_auth: EtcdAuth | None = None) -> None:
        self.host: ExtensionHost | None = None
        self.etcd_auth = etcd_auth  # a cluster stack's credentials for the workers' etcd
        self._refresher: asyncio.Task[None] | None = None
        self._retrier: asyncio.Task[None] | None = None
        # key -> (unit name, etcd endpoint, instance ids) whose revocation failed; retried
        self.pending: dict[str, tuple[str, str, list[int]]] = {}
        self._swept = False
        self._sweep_lock = asyncio.Lock()
        # Set by a multi-node layer: the instance ids other nodes' live workers hold, which
        # the sweep must leave alone (it raises EtcdError while it cannot tell).
        self.others_live: Callable[[], Awaitable[set[int]]] | None = None
        # Set by the stack identity (rollout/identity.py): the other live stacks whose
        # workers use a namespace, described; their registrations are not this sweep's to
        # judge.
        self.others_in_namespace: Callable[[str], Awaitable[list[str] | None]] | None = None
        self.registered: dict[str, Registration] = {}

    def instance_ids(self, unit: Unit) -> list[int]:
        """The worker's Dynamo instance ids (its etcd leases); [] while it has none."""
        registration = self.registered.get(unit.name)
        return list(registration.instance_ids) if registration else []

    def unit_status(self, unit: Unit) -> ExtensionUnitStatus:
        registration = self.registered.get(unit.name)
        return {"dynamo": registration.as_status()} if registration else {}

    async def start(self, host: ExtensionHost) -> None:
        assert host.engine is not None
        self.host = host
        host.engine.hooks.append(self)
        if any(worker_of(u.spec) for u in host.engine.units.values()):
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_routed())
            frontend_probe.count_only(self.live_instances, self.unregistered)

    def live_instances(self, namespace: str) -> set[int]:
        """Instance ids of this stack's running Dynamo workers in `namespace`."""
        assert self.host is not None and self.host.engine is not None
        return {
            instance
            for unit in self.host.engine.units.values()
            if (worker := worker_of(unit.spec)) is not None
            and worker.namespace == namespace
            and unit.state.running
            and unit.pid is not None
            for instance in self.instance_ids(unit)
        }

    def unregistered(self, namespace: str) -> list[str]:
        """This stack's Dynamo workers in `namespace` that are up (past their readiness
        probe, or their min_uptime without one) but whose registration dynamod looked
        for and could not find. Workers still starting are not named: they may yet."""
        assert self.host is not None and self.host.engine is not None
        return sorted(
            unit.name
            for unit in self.host.engine.units.values()
            if (worker := worker_of(unit.spec)) is not None
            and worker.namespace == namespace
            and unit.state.running
            and unit.pid is not None
            and unit.name in self.registered
            and not self.registered[unit.name].instance_ids
        )

    async def stop(self) -> None:
        frontend_probe.count_only(None)
        for task in (self._refresher, self._retrier):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._revoke_pending(last=True)  # one last try: leave no registration behind

    @property
    def stack(self) -> str:
        """The stack's identity: its lease records live under `dynamod/<identity>/`."""
        assert self.host is not None
        return self.host.stack.identity

    @property
    def node(self) -> str | None:
        """This daemon's node in a cluster stack (its lease records are keyed by it)."""
        assert self.host is not None
        cluster = self.host.stack.cluster
        return cluster.node if cluster is not None else None

    async def _sweep_stale(self) -> None:
        async with self._sweep_lock:  # two workers' starts, or a start and a readiness
            await self._sweep_once()

    async def _sweep_once(self) -> None:
        """Once, before any Dynamo worker unit has started: revoke every registration in the
        stack's namespaces that belongs to no live unit (`stale_leases`), and forget this
        stack's lease records. Skipped (and tried at the next unit's readiness, or before a
        worker's start) while etcd does not answer; given up once a worker has started (a
        booting worker's registration is not known yet and must not be taken for a stale
        one)."""
        assert self.host is not None and self.host.engine is not None
        engine = self.host.engine
        workers = [u for u in engine.units.values() if worker_of(u.spec) is not None]
        if self._swept or not workers:
            return
        if any(u.starts > 0 for u in workers):
            self._swept = True  # too late to tell stale from live: a worker may be booting
            log.warning("dynamo.sweep_given_up", why="a worker started before the start-up "
                        "sweep could read etcd (see dynamo.sweep_deferred): registrations "
                        "an earlier run left stay until their leases expire")  # fmt: skip
            return
        targets = {(w.etcd, w.namespace) for w in (worker_of(u.spec) for u in workers) if w}
        for endpoint, namespace in sorted(targets):
            try:
                async with EtcdClient(
                    endpoint, session=engine.session, timeout_s=_SWEEP_TIMEOUT_S,
                    auth=self.etcd_auth,
                ) as etcd:
                    store = LeaseRecords(etcd, self.stack, self.node)
                    records = [r for r in await store.every_stack() if r.namespace == namespace]
                    # other nodes' live workers (a multi-node stack) are never revoked here
                    keep = await self.others_live() if self.others_live is not None else set()
                    sharing = await self._sharing(namespace)
                    if sharing is None:  # another live daemon holds this stack's identity
                        log.error("dynamo.sweep_skipped", namespace=namespace,
                                  why="this stack's identity is held by another live daemon")
                        self._swept = True  # its records are that daemon's: revoke none
                        return
                    mine = [r for r in records if r.owned_by(self.stack, self.node)]
                    ours = {i for r in mine for i in r.instance_ids}
                    others = {i for r in records if r not in mine for i in r.instance_ids}
                    registered = {
                        inst.lease_id or inst.instance_id
                        for inst in await dynamo.list_instances(etcd, namespace)
                        if inst.instance_id not in keep and inst.lease_id not in keep
                    }
                    leases = sorted(
                        stale_leases(registered, ours - keep, others, shared=bool(sharing))
                    )
                    for lease in leases:
                        await dynamo.revoke_instance(etcd, lease)
                    for record in mine:
                        await store.forget(record)
            except (TimeoutError, EtcdError) as exc:  # tried again at the next hook
                log.info("dynamo.sweep_deferred", namespace=namespace,
                         error=str(exc) or type(exc).__name__)  # fmt: skip
                return
            kept = sorted((registered & others) | (registered - ours if sharing else set()))
            _log_sweep(namespace, leases, kept, sharing)
        self._swept = True

    async def _sharing(self, namespace: str) -> list[str] | None:
        """The other live stacks that use `namespace` (raises EtcdError while unknown; None:
        this stack's identity is another daemon's)."""
        if self.others_in_namespace is None:
            return []
        return await self.others_in_namespace(namespace)

    # ------------------------------------------------------------------ hooks

    async def before_start(self, unit: Unit) -> None:
        """Before the first Dynamo worker starts: the sweep's last window (its units'
        readiness may all come before etcd answers this stack's user, as in
        cluster-ha.toml, whose workers start when a oneshot completes)."""
        if worker_of(unit.spec) is not None:
            await self._sweep_stale()

    async def on_ready(self, unit: Unit) -> None:
        if self.host is None or self.host.engine is None:
            return
        await self._sweep_stale()
        spec = worker_of(unit.spec)
        if spec is None:
            return
        session = self.host.engine.session
        ids: list[int] = []
        error = None
        async with EtcdClient(spec.etcd, session=session, auth=self.etcd_auth) as etcd:
            for _ in range(_ID_ATTEMPTS):
                try:
                    ids = await dynamo.instance_ids_for_worker(
                        session, etcd, spec.namespace, spec.system_url
                    )
                except (EtcdError, dynamo.DynamoHTTPError) as exc:
                    error = str(exc)
                if ids:
                    break
                await asyncio.sleep(_ID_RETRY_S)
        self.registered[unit.name] = Registration(spec.namespace, spec.system_url, ids)
        if ids:
            log.info("dynamo.registered", unit=unit.name, instances=[f"{i:x}" for i in ids])
            await self._record(unit.name, spec.etcd, spec.namespace, ids)
        else:
            log.warning(
                "dynamo.instance_unknown",
                unit=unit.name,
                error=error,
                hint="its registration cannot be revoked at once if it dies",
            )

    async def on_exit(self, unit: Unit, exit: Exit) -> None:
        spec = worker_of(unit.spec)
        registration = self.registered.get(unit.name)
        if spec is None or not registration or not registration.instance_ids or not self.host:
            return
        assert self.host.engine is not None
        ids = registration.instance_ids
        registration.instance_ids, registration.routed = [], False
        if not await self._revoke(unit.name, spec.etcd, ids, why=exit.describe()):
            self.pending[unit.name + f"#{ids[0]:x}"] = (unit.name, spec.etcd, ids)
            self._ensure_retrier()

    async def drain(self, unit: Unit, why: str) -> None:
        """Before an apply stops a Dynamo worker: out of the frontend's routing first, so no
        request of any kind (a plain one too, which no taint keeps away) is sent to it
        while its in-flight ones finish (the next extension's drain waits for those)."""
        spec = worker_of(unit.spec)
        registration = self.registered.get(unit.name)
        if spec is None or registration is None or not registration.instance_ids:
            return
        assert self.host is not None and self.host.engine is not None
        started = time.monotonic()
        ids = set(registration.instance_ids)
        try:
            async with EtcdClient(
                spec.etcd, session=self.host.engine.session, auth=self.etcd_auth
            ) as etcd:
                keys = await dynamo.withdraw_instance(etcd, spec.namespace, ids)
                seen = await self._until_unrouted(spec.namespace, ids, etcd)
        except (TimeoutError, EtcdError) as exc:
            keys, seen = [], f"not withdrawn ({exc})"
        registration.routed = False if keys else registration.routed
        took = round((time.monotonic() - started) * 1000, 1)
        log.info("dynamo.withdrawn", unit=unit.name, why=why, keys=keys, frontends=seen, ms=took)
        self.host.events.emit("dynamo.withdrawn", unit.name, why=why, keys=len(keys),
                              frontends=seen, ms=took)  # fmt: skip

    async def _until_unrouted(self, namespace: str, ids: set[int], etcd: EtcdClient) -> str:
        """Until no ready frontend of the stack in `namespace` lists any of `ids` (its
        router picks from that list); what was seen, in words. An empty list while etcd
        holds other instances is a frontend whose etcd read failed: asked again."""
        assert self.host is not None and self.host.engine is not None
        engine = self.host.engine
        urls = [
            probe.url
            for u in engine.units.values()
            if isinstance(probe := u.spec.ready, DynamoFrontendProbe)
            and probe.namespace == namespace
            and u.state is UnitState.READY
        ]
        deadline = time.monotonic() + _WITHDRAW_WAIT_S
        left = set(urls)
        while left and time.monotonic() < deadline:
            for url in sorted(left):
                with contextlib.suppress(dynamo.DynamoHTTPError, asyncio.TimeoutError, EtcdError):
                    view = await dynamo.frontend_routed_checked(
                        engine.session, url, namespace, etcd
                    )
                    if not ids & view:
                        left.discard(url)
            if left:
                await asyncio.sleep(_WITHDRAW_POLL_S)
        if not urls:
            return "no ready frontend"
        if left:
            return f"still listed by {', '.join(sorted(left))} after {_WITHDRAW_WAIT_S:g}s"
        return f"dropped by {len(urls)} frontend(s)"

    async def _record(self, name: str, endpoint: str, namespace: str, ids: list[int]) -> None:
        """Keep a live worker's lease ids where they outlive this daemon."""
        assert self.host is not None and self.host.engine is not None
        try:
            async with EtcdClient(
                endpoint, session=self.host.engine.session, auth=self.etcd_auth
            ) as etcd:
                await LeaseRecords(etcd, self.stack, self.node).record(name, namespace, ids)
        except (TimeoutError, EtcdError) as exc:
            log.warning(
                "dynamo.lease_record_failed",
                unit=name,
                error=str(exc),
                consequence="if this daemon dies, the next one sweeps this registration only "
                "as one that no stack records",
            )

    async def _revoke(
        self, name: str, endpoint: str, ids: list[int], *, why: str, last: bool = False
    ) -> bool:
        """Revoke a dead worker's leases, then drop its lease record (unless it has
        registered again meanwhile with other ids). `last`: the stopping daemon's final
        try, which its failure says (no retry comes; the record stays for the next
        start's sweep)."""
        assert self.host is not None and self.host.engine is not None
        started = time.monotonic()
        revoked: dict[str, Any] = {}
        try:
            async with EtcdClient(
                endpoint, session=self.host.engine.session, auth=self.etcd_auth
            ) as etcd:
                for instance_id in ids:
                    keys = await dynamo.revoke_instance(etcd, instance_id)
                    revoked[f"{instance_id:x}"] = len(keys)
                await LeaseRecords(etcd, self.stack, self.node).forget_if(name, ids)
        except (TimeoutError, EtcdError) as exc:
            log.error(
                "dynamo.revoke_failed",
                unit=name,
                error=str(exc),
                consequence=_LAST_TRY if last else _RETRIED,
            )
            return False
        took_ms = (time.monotonic() - started) * 1000
        log.info("dynamo.revoked", unit=name, exit=why, keys=revoked, ms=round(took_ms, 1))
        if self.host is not None:
            self.host.events.emit("dynamo.revoked", name, exit=why, keys=revoked,
                                  ms=round(took_ms, 1))  # fmt: skip
        return True

    def _ensure_retrier(self) -> None:
        if self._retrier is None or self._retrier.done():
            self._retrier = asyncio.get_running_loop().create_task(self._retry_pending())

    async def _retry_pending(self) -> None:
        while self.pending:
            await asyncio.sleep(_PENDING_RETRY_S)
            await self._revoke_pending()

    async def _revoke_pending(self, last: bool = False) -> None:
        for key, (name, endpoint, ids) in list(self.pending.items()):
            why = "revocation pending since etcd was away"
            if await self._revoke(name, endpoint, ids, why=why, last=last):
                self.pending.pop(key, None)

    # ------------------------------------------------------------------ routed view

    async def _refresh_routed(self) -> None:
        while True:
            await asyncio.sleep(_ROUTED_REFRESH_S)
            views = await self._routed_views()
            for registration in self.registered.values():
                view = views.get(registration.namespace)
                registration.routed = (
                    None if view is None else any(i in view for i in registration.instance_ids)
                )

    async def _routed_views(self) -> dict[str, set[int]]:
        """The instances each namespace's ready frontends list; a namespace none of them
        answered for is left out (its shards' `routed` unknown, not false)."""
        assert self.host is not None and self.host.engine is not None
        views: dict[str, set[int]] = {}
        for unit in self.host.engine.units.values():
            probe = unit.spec.ready
            if isinstance(probe, DynamoFrontendProbe) and unit.state is UnitState.READY:
                with contextlib.suppress(dynamo.DynamoHTTPError, asyncio.TimeoutError, EtcdError):
                    view = await self._routed_view(probe.url, probe.namespace)
                    views.setdefault(probe.namespace, set()).update(view)
        return views

    async def _routed_view(self, url: str, namespace: str) -> set[int]:
        """What the frontend at `url` lists in `namespace`; an empty list checked against
        etcd (dynamo.confirm_unrouted), read through the namespace's workers' etcd."""
        assert self.host is not None and self.host.engine is not None
        session = self.host.engine.session
        routed = await dynamo.frontend_routed_instances(session, url, namespace)
        if routed:
            return routed
        endpoint = next(
            (
                w.etcd
                for u in self.host.engine.units.values()
                if (w := worker_of(u.spec)) is not None and w.namespace == namespace
            ),
            None,
        )
        if endpoint is not None:
            async with EtcdClient(endpoint, session=session, auth=self.etcd_auth) as etcd:
                await dynamo.confirm_unrouted(url, namespace, etcd)
        return routed
