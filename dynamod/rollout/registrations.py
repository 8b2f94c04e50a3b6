"""Dynamo registrations of supervised workers.

- When a worker unit turns ready, learn its instance ids (= its etcd lease ids).
- The moment its process dies, revoke those leases, so the frontend's router (which
  watches etcd) drops it within milliseconds instead of after the ~30 s lease TTL. This
  runs before the restart decision, from the exit event itself.
- While running, report per worker whether the frontend currently routes to it, from the
  frontend's own discovery view.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import structlog

from dynamod.core.extensions import Extension
from dynamod.core.restart import Exit
from dynamod.core.spec import DynamoFrontendProbe
from dynamod.core.state import UnitState
from dynamod.rollout import dynamo
from dynamod.rollout.etcd import EtcdClient, EtcdError

if TYPE_CHECKING:
    from dynamod.core.daemon import Daemon
    from dynamod.core.engine import Unit

log = structlog.get_logger("dynamod.rollout.registrations")

_ID_ATTEMPTS = 50  # /health can turn ready a moment before etcd holds the registration
_ID_RETRY_S = 0.1
_ROUTED_REFRESH_S = 1.0


class DynamoRegistrations(Extension):
    """A daemon extension that is also the engine hook for Dynamo worker units."""

    def __init__(self) -> None:
        self.daemon: Daemon | None = None
        self._refresher: asyncio.Task[None] | None = None

    async def start(self, daemon: Daemon) -> None:
        assert daemon.engine is not None
        self.daemon = daemon
        daemon.engine.hooks.append(self)
        if any(u.spec.dynamo for u in daemon.engine.units.values()):
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_routed())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher

    # ------------------------------------------------------------------ hooks

    async def on_ready(self, unit: Unit) -> None:
        spec = unit.spec.dynamo
        if spec is None or self.daemon is None or self.daemon.engine is None:
            return
        session = self.daemon.engine.session
        ids: list[int] = []
        error = None
        async with EtcdClient(spec.etcd, session=session) as etcd:
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
        unit.extra["dynamo"] = {
            "namespace": spec.namespace,
            "system_url": spec.system_url,
            "instance_ids": ids,
            "routed": None,
        }
        if ids:
            log.info("dynamo.registered", unit=unit.name, instances=[f"{i:x}" for i in ids])
        else:
            log.warning(
                "dynamo.instance_unknown",
                unit=unit.name,
                error=error,
                hint="its registration cannot be revoked at once if it dies",
            )

    async def on_exit(self, unit: Unit, exit: Exit) -> None:
        spec = unit.spec.dynamo
        info = unit.extra.get("dynamo")
        if spec is None or not info or not info.get("instance_ids") or self.daemon is None:
            return
        assert self.daemon.engine is not None
        started = time.monotonic()
        revoked: dict[str, Any] = {}
        try:
            async with EtcdClient(spec.etcd, session=self.daemon.engine.session) as etcd:
                for instance_id in info["instance_ids"]:
                    keys = await dynamo.revoke_instance(etcd, instance_id)
                    revoked[f"{instance_id:x}"] = len(keys)
        except EtcdError as exc:
            log.error(
                "dynamo.revoke_failed",
                unit=unit.name,
                error=str(exc),
                consequence="the router may keep routing to it until its lease expires",
            )
            return
        took_ms = (time.monotonic() - started) * 1000
        info.update(instance_ids=[], routed=False, last_revoked=revoked)
        log.info(
            "dynamo.revoked",
            unit=unit.name,
            exit=exit.describe(),
            keys=revoked,
            ms=round(took_ms, 1),
        )

    # ------------------------------------------------------------------ routed view

    async def _refresh_routed(self) -> None:
        assert self.daemon is not None and self.daemon.engine is not None
        engine = self.daemon.engine
        while True:
            await asyncio.sleep(_ROUTED_REFRESH_S)
            views: dict[str, set[int]] = {}
            for unit in engine.units.values():
                probe = unit.spec.ready
                if isinstance(probe, DynamoFrontendProbe) and unit.state is UnitState.READY:
                    with contextlib.suppress(dynamo.DynamoHTTPError, asyncio.TimeoutError):
                        views.setdefault(probe.namespace, set()).update(
                            await dynamo.frontend_routed_instances(
                                engine.session, probe.url, probe.namespace
                            )
                        )
            for unit in engine.units.values():
                info = unit.extra.get("dynamo")
                if info is None:
                    continue
                view = views.get(info["namespace"])
                info["routed"] = (
                    None if view is None else any(i in view for i in info["instance_ids"])
                )
