"""The extension seam: behaviour that lives beside the engine for the daemon's lifetime.

sd_notify, metrics, Dynamo lease revocation and the rollout layer's policy manager all
plug in here, so the core never imports a layer above it. An extension may add control
socket routes, a section of `status` and its own keys in each unit's row of it
(`unit_status`, keys declared in core/status.py's ExtensionUnitStatus); what it wants per
unit it gets by appending an `UnitHooks` to `host.engine.hooks` or a listener to
`host.engine.listeners` in `start`, and it keeps what it learns of a unit itself, in a
typed record of its own. It sees the daemon only through `ExtensionHost`, the part of it
extensions use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from dynamod.core.status import ExtensionUnitStatus

if TYPE_CHECKING:
    from dynamod.core.engine import Engine, Unit
    from dynamod.core.events import EventLog
    from dynamod.core.phase import Phase
    from dynamod.core.spec import Stack, UnitSpec


class ExtensionHost(Protocol):
    """What an extension may see and ask of the daemon that runs it (core/daemon.py)."""

    @property
    def stack(self) -> Stack: ...

    @property
    def engine(self) -> Engine | None: ...  # set before any extension starts

    @property
    def state_dir(self) -> Path: ...

    @property
    def run_id(self) -> str: ...

    @property
    def events(self) -> EventLog: ...  # what happened, for `dynamod events`: emit(kind, unit, ...)

    @property
    def phase(self) -> Phase: ...

    @property
    def on_phase(self) -> list[Callable[[Phase], None]]: ...  # append to hear phase changes

    def degraded_units(self) -> dict[str, str]: ...

    def status(self) -> dict[str, Any]:
        """What `dynamod status --json` answers: the stack and every unit's row."""
        ...

    def extension_status(self, unit: Unit) -> ExtensionUnitStatus:
        """What every extension reports of `unit` (its row in `status`, less the engine's)."""
        ...

    def require_running(self, what: str) -> None: ...

    async def down(self) -> dict[str, Any]: ...


class Extension:
    """Base class with no-op defaults; override what the extension needs.

    `start` runs once the engine exists, before any unit starts; `stop` runs after
    teardown. `routes` are added to the control socket before it listens. `status`
    returns top-level keys merged into the daemon's status and `unit_status` this
    extension's keys of one unit's row (both cheap and synchronous: they are called for
    every `dynamod status` and metrics scrape). `spawn_env` returns variables merged into a unit's
    environment each time it is spawned (after the unit's own `env`): the way secrets reach
    a process without entering its rendered command line, `status` or the state files."""

    async def start(self, host: ExtensionHost) -> None:
        return None

    async def stop(self) -> None:
        return None

    def routes(self) -> list[web.RouteDef]:
        return []

    def status(self) -> dict[str, Any]:
        return {}

    def unit_status(self, unit: Unit) -> ExtensionUnitStatus:
        return {}

    def spawn_env(self, unit: UnitSpec) -> Mapping[str, str]:
        return {}

    # `apply` / `scale` (core/live.py): what a live change must wait for or go through

    async def settle(self) -> None:
        """Return once no operation an apply must not interleave with (a policy push) is in
        flight; the daemon refuses new ones until the apply is done."""
        return None

    async def prepare(self, new: Stack, removed: list[str], timeout: float) -> None:
        """An apply is about to remove the units `removed` (drained, then stopped) and then
        adopt `new`: make ready for it (a spare takes a removed shard's place first).
        Returns within `timeout`."""
        return None

    def may_stop(self, unit: Unit) -> str | None:
        """Why `unit` may not be taken out of service now (too few shards would be left),
        or None. An apply waits until no extension objects."""
        return None

    async def drain(self, unit: Unit, why: str) -> None:
        """Take `unit` out of service before an apply stops it (out of routing, its
        in-flight requests finished)."""
        return None
