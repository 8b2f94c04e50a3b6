"""The extension seam: behaviour that lives beside the engine for the daemon's lifetime.

sd_notify, metrics, Dynamo lease revocation and the rollout layer's policy manager all
plug in here, so the core never imports a layer above it. An extension may add control
socket routes and a section of `status`; what it wants per unit it gets by appending an
`UnitHooks` to `daemon.engine.hooks` or a listener to `daemon.engine.listeners` in `start`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from dynamod.core.daemon import Daemon
    from dynamod.core.spec import UnitSpec


class Extension:
    """Base class with no-op defaults; override what the extension needs.

    `start` runs once the engine exists, before any unit starts; `stop` runs after
    teardown. `routes` are added to the control socket before it listens. `status`
    returns top-level keys merged into the daemon's status (cheap and synchronous: it is
    called for every `dynamod status`). `spawn_env` returns variables merged into a unit's
    environment each time it is spawned (after the unit's own `env`): the way secrets reach
    a process without entering its rendered command line, `status` or the state files."""

    async def start(self, daemon: Daemon) -> None:
        return None

    async def stop(self) -> None:
        return None

    def routes(self) -> list[web.RouteDef]:
        return []

    def status(self) -> dict[str, Any]:
        return {}

    def spawn_env(self, unit: UnitSpec) -> Mapping[str, str]:
        return {}
