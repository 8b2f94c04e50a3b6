"""Live changes to a running stack (`dynamod apply FILE`, `dynamod scale UNIT=N`): the stack
it would become, the diff, and the change applied with the least disruption.

  1. removed units: the extensions prepare (a spare that stays is promoted for each
     removed serving shard the new [policy] table still needs); then dependents first,
     each waits until no extension objects to it going out of service (a rollout shard:
     never below [policy] min_ready_shards), is drained (out of the frontend's routing,
     in-flight requests finished) and stopped;
  2. the engine adopts the new stack: added units start in dependency order and go the
     way of any start (a rollout shard is held, replayed to the current policy version and
     verified before it is admitted); the apply waits until they serve;
  3. changed units: a change to what the process is started with (command, env, ports,
     ...) restarts them one at a time in start order: the same wait and drain, then a
     restart with the new spec, then the wait until it serves again before the next one.
     Any other change (dependencies, probes, restart settings) is taken in place at step 2.

A file that fails validation changes nothing (SpecErrors before step 1). Adding or removing
a stack table ([policy]), changing a [cluster] table or the stack's identity (`stack_id`) is
refused: the extensions that own them, and the etcd keys, were chosen at `up`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from dynamod.core import graph
from dynamod.core.engine import Engine, Unit
from dynamod.core.errors import DynamodError, SpecError, SpecErrors, UnitFailed
from dynamod.core.extensions import Extension
from dynamod.core.spec import PortAllocator, Stack
from dynamod.core.spec import change as respec
from dynamod.core.spec.diff import StackDiff
from dynamod.core.state import UnitState

log = structlog.get_logger("dynamod.core.live")

DEFAULT_TIMEOUT_S = 300.0
_GUARD_POLL_S = 0.5
_COMING = {UnitState.STARTING, UnitState.HELD, UnitState.BACKOFF, UnitState.WAITING}


class ApplyError(DynamodError):
    """An apply could not go on; what it did until then is kept and named."""

    def __init__(self, message: str, done: list[str]) -> None:
        self.done = done
        super().__init__(f"{message}; done before: {', '.join(done) or 'nothing'}")


@dataclass(frozen=True)
class Request:
    """One `apply` or `scale`, as the CLI sends it over the control socket."""

    path: str | None = None  # the stack file (None: the running stack's definition)
    vars: dict[str, Any] = field(default_factory=dict)
    scale: tuple[str, int] | None = None
    dry_run: bool = False
    timeout: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_json(cls, body: object) -> Request:
        if not isinstance(body, dict):
            raise DynamodError("expected a JSON object")
        path, variables, scale = body.get("path"), body.get("vars") or {}, body.get("scale")
        timeout = body.get("timeout", DEFAULT_TIMEOUT_S)
        if path is not None and not isinstance(path, str):
            raise DynamodError('"path" must be a string')
        if not isinstance(variables, dict) or not all(
            isinstance(k, str) and isinstance(v, int | str) for k, v in variables.items()
        ):
            raise DynamodError('"vars" must map names to integers or strings')
        if scale is not None and not (
            isinstance(scale, list) and len(scale) == 2 and isinstance(scale[0], str)
            and isinstance(scale[1], int) and not isinstance(scale[1], bool)
        ):  # fmt: skip
            raise DynamodError('"scale" must be ["UNIT", N]')
        if (path is None) == (scale is None):
            raise DynamodError('give either "path" (apply) or "scale"')
        if not isinstance(timeout, int | float) or not 0 < timeout <= 86400:
            raise DynamodError('"timeout" must be seconds above 0')
        return cls(path, dict(variables), (scale[0], scale[1]) if scale else None,
                   bool(body.get("dry_run")), float(timeout))  # fmt: skip


def next_stack(running: Stack, request: Request, allocate_port: PortAllocator) -> Stack:
    """The stack `request` makes of `running`; SpecErrors (or UnknownUnit) if none."""
    if request.scale is not None:
        unit, count = request.scale
        new = respec.scaled(running, unit, count, allocate_port=allocate_port)
    else:
        assert request.path is not None
        new = respec.reread(Path(request.path), running, request.vars, allocate_port=allocate_port)
    refused = _refused(running, new)
    if refused:
        raise SpecErrors([SpecError(refused, file=new.path)])
    return new


def _refused(running: Stack, new: Stack) -> str | None:
    """What an apply cannot change in a running stack."""
    for key in sorted({*running.tables} ^ {*new.tables}):
        verb = "adds" if key in new.tables else "removes"
        return f"{verb} the [{key}] table: that needs `dynamod down` and `dynamod up`"
    if running.id != new.id:
        return (f"changes the stack's identity ({running.id!r} -> {new.id!r}): that needs "
                "`dynamod down` and `dynamod up`")  # fmt: skip
    if running.cluster != new.cluster:
        return "changes the [cluster] table: that needs `dynamod down` and `dynamod up`"
    return None


@dataclass
class Applier:
    """Carries one apply out on the running engine (see the module's steps)."""

    engine: Engine
    extensions: Sequence[Extension]
    timeout: float
    emit: Callable[..., None]
    done: list[str] = field(default_factory=list)

    async def run(self, new: Stack, change: StackDiff) -> list[str]:
        deadline = time.monotonic() + self.timeout
        try:
            for extension in self.extensions:  # e.g. a spare promoted for a removed shard
                await extension.prepare(new, change.removed, max(deadline - time.monotonic(), 0.1))
            await self._remove(change.removed, deadline)
            restarted = change.restarted()
            added = self.engine.adopt(new, restarted)
            if in_place := [n for n in change.changed if n not in restarted]:
                self._did(f"updated {', '.join(in_place)} in place")
            if added:
                self.engine.start_added(added)
                await self.engine.wait_serving(added, max(deadline - time.monotonic(), 0.1))
                self._did(f"started {', '.join(added)}")
            for name in [n for n in new.order if n in restarted]:
                await self._replace(name, new, change.changed[name], deadline)
        except UnitFailed as exc:
            raise ApplyError(str(exc), self.done) from None
        return self.done

    def _did(self, what: str) -> None:
        self.done.append(what)
        self.emit("apply.step", None, step=what)
        log.info("apply.step", step=what)

    async def _remove(self, names: list[str], deadline: float) -> None:
        if not names:
            return
        edges = {n: list(u.spec.depends_on) for n, u in self.engine.units.items()}
        order = [n for n in reversed(graph.start_order(edges)) if n in names]
        for name in order:
            unit = self.engine.units[name]
            await self._out_of_service(unit, "removed by `dynamod apply`", deadline)
            await self.engine.stop_unit(unit, why="removed by `dynamod apply`")
            self._did(f"stopped {name}")

    async def _replace(self, name: str, new: Stack, fields: list[str], deadline: float) -> None:
        unit = self.engine.units[name]
        why = f"{', '.join(fields)} changed by `dynamod apply`"
        if unit.operator_stop is None:
            await self._out_of_service(unit, why, deadline)
        if not await self.engine.replace(name, new.units[name], why):
            self._did(f"changed {name} (held stopped by the operator: not started)")
            return
        await self.engine.wait_serving([name], max(deadline - time.monotonic(), 0.1))
        self._did(f"restarted {name} ({', '.join(fields)})")

    async def _out_of_service(self, unit: Unit, why: str, deadline: float) -> None:
        """Wait until no extension objects to `unit` going out of service, then drain it."""
        if not unit.state.running:
            return
        while objections := [o for e in self.extensions if (o := e.may_stop(unit))]:
            # only a unit on its way to service (starting, held, ...) can lift an objection
            coming = [u for u in self.engine.units.values() if u.state in _COMING]
            if not coming or time.monotonic() >= deadline:
                raise ApplyError(f"{unit.name} not taken out of service: {objections[0]}",
                                 self.done)  # fmt: skip
            await self.engine.changed(timeout=_GUARD_POLL_S)
        for extension in self.extensions:
            await extension.drain(unit, why)
