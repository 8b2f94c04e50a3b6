"""The engine: one lifecycle task per unit, dependency-gated start, restart with backoff,
liveness watching, reverse-order stop. Exits arrive as events from the Reaper.

The operating system is reached only through a `process.ProcessHost` (spawn, signal,
the unit's processes, ports), and what an exit means is decided by the pure
`exits.decide_exit`: tests/unit/test_engine.py drives this state machine against a fake
host without a process.

Policies that are not about processes (Dynamo lease revocation, shard admission) plug
in through `UnitHooks`, so the engine stays about units and states.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import structlog

from dynamod.core import cgroups, exits, graph, portmove, process, unittmp
from dynamod.core.errors import DynamodError, SpecErrors, UnitFailed
from dynamod.core.logs import LogFile, OutputSink
from dynamod.core.probes import (
    ProbeContext,
    Prober,
    ProbeResult,
    describe,
    make_prober,
    ready_pause,
)
from dynamod.core.restart import Decision, Exit, RestartTracker
from dynamod.core.slots import Slots
from dynamod.core.spec import Condition, Stack, UnitSpec
from dynamod.core.state import ALLOWED, UnitState, check_transition
from dynamod.core.status import EngineUnitStatus

log = structlog.get_logger("dynamod.engine")



def _place(spec: UnitSpec) -> str:
    """Where a unit this daemon does not run runs: another node, or outside the stack."""
    if spec.outside:
        return f"at {spec.outside} (outside the stack)"
    return f"on node {spec.remote}"

class UnitHooks(Protocol):
    """Extension points around a unit's life. Hooks must not raise for normal outcomes."""

    async def before_start(self, unit: Unit) -> None:
        """The unit is about to be spawned (every start, a restart's too), before it waits
        for a start slot: what its process must find done (the start-up sweep of the
        registrations an earlier run left, before the first Dynamo worker starts)."""

    async def on_ready(self, unit: Unit) -> None:
        """The readiness probe passed; runs before the unit counts as ready."""

    async def on_exit(self, unit: Unit, exit: Exit) -> None:
        """The unit's main process exited (before any restart decision)."""


Listener = Callable[["Unit", UnitState, UnitState], None]
# Extra environment for a unit at spawn (secrets): never rendered into its spec or status.
EnvSource = Callable[[UnitSpec], Mapping[str, str]]
ProbeListener = Callable[["Unit", str, ProbeResult], None]  # unit, "ready" | "live", result
LostListener = Callable[["Unit", str], None]  # unit, why: about to be killed as lost (hung)
RestackListener = Callable[[Stack], None]  # the stack re-rendered (a port moved at a spawn)


@dataclass(eq=False)  # identity: one object per supervised instance
class Unit:
    spec: UnitSpec
    sink: OutputSink
    log_path: Path
    tracker: RestartTracker
    state: UnitState = UnitState.INACTIVE
    state_since: float = field(default_factory=time.monotonic)
    child: Process | None = None
    detail: str = ""  # the last probe answer, or why the unit is where it is
    hold_reason: str | None = None  # set while a hook keeps the unit out of service
    last_exit: Exit | None = None
    ready_at: float | None = None
    starts: int = 0
    task: asyncio.Task[None] | None = None
    attempt_since: float | None = None  # a probe attempt is in flight since then
    attempt_what: str = ""  # that attempt, in words
    failure_hint: str | None = None  # why its last run ended early, added to its exit's line
    cause: str | None = None  # its own words for its last failed exit, until it is ready again
    # (child, decision, when) as recorded at reap time for that child's exit
    recorded: tuple[Process | None, Decision, float] | None = None
    # held stopped by an operator: (who, monotonic since); no restart until released
    operator_stop: tuple[str, float] | None = None
    last_oom: exits.OomKill | None = None  # the last exit was the kernel's OOM killer's
    oom_kills: int = 0  # exits by the OOM killer, over the daemon's run

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child and self.child.alive else None


Process = process.Child


def _failing(unit: Unit) -> bool:
    """Failed, in backoff, or trying again after a failed exit: what `status` explains
    with the unit's telling log lines. A retry's new attempt counts (seen: `up` timing out
    while etcd on a full disk was starting once more, and showing only its probe's
    "cannot connect" instead of the ENOSPC that ended every attempt)."""
    if unit.state in {UnitState.BACKOFF, UnitState.FAILED}:
        return True
    retrying = unit.state in {UnitState.STARTING, UnitState.WAITING}
    return retrying and unit.last_exit is not None and not unit.last_exit.clean


def _satisfied(state: UnitState, condition: Condition) -> bool:
    if condition is Condition.COMPLETED:
        return state is UnitState.COMPLETED
    if condition is Condition.READY:
        return state in {UnitState.READY, UnitState.DEGRADED, UnitState.COMPLETED}
    return state in {
        UnitState.STARTING,
        UnitState.READY,
        UnitState.HELD,
        UnitState.DEGRADED,
        UnitState.COMPLETED,
    }


_DEAD_END = {UnitState.FAILED, UnitState.STOPPING, UnitState.STOPPED}


def _serving(unit: Unit) -> bool:
    return unit.state is UnitState.COMPLETED or (
        unit.state is UnitState.READY and unit.hold_reason is None
    )



class Engine:
    def __init__(
        self,
        stack: Stack,
        *,
        state_dir: Path,
        run_id: str,
        host: process.ProcessHost,
        session: aiohttp.ClientSession,
        hooks: Iterable[UnitHooks] = (),
        log_max_bytes: int = 20 * 1024 * 1024,
    ) -> None:
        self.stack = stack
        self.state_dir = state_dir
        self.run_id = run_id
        self.host = host  # every OS call about the units' processes goes through it
        self.session = session
        self.hooks = list(hooks)
        self.listeners: list[Listener] = []
        self.probe_listeners: list[ProbeListener] = []
        self.lost_listeners: list[LostListener] = []
        self.restack_listeners: list[RestackListener] = []
        self.env_sources: list[EnvSource] = []
        self.units: dict[str, Unit] = {}
        self.stopping = False
        self.killed: dict[str, list[int]] = {}  # unit -> pids SIGKILL reached while stopping
        self._changed = asyncio.Event()
        self.start_slots = Slots(stack.max_starting)  # `[stack] max_starting`
        self.log_max_bytes = log_max_bytes
        logs = state_dir / "logs"
        for name in stack.order:
            spec = stack.units[name]
            path = logs / f"{name}.log"
            self.units[name] = Unit(
                spec=spec,
                sink=OutputSink(LogFile(path, max_bytes=log_max_bytes)),
                log_path=path,
                tracker=RestartTracker(spec.restart),
            )

    # ------------------------------------------------------------------ state

    def transition(self, unit: Unit, new: UnitState, detail: str | None = None) -> None:
        """Move the unit to `new` (checked against the state table), logged and told to
        the listeners. Re-entering the state it is in only updates the detail."""
        old = unit.state
        if old is new:
            if detail is not None:
                unit.detail = detail
            return
        check_transition(unit.name, old, new)
        unit.state = new
        unit.state_since = time.monotonic()
        if new is UnitState.READY:
            unit.cause = None
        if detail is not None:
            unit.detail = detail
        log.info("unit.state", unit=unit.name, old=str(old), new=str(new), detail=unit.detail)
        for listener in self.listeners:
            listener(unit, old, new)
        self._changed.set()
        self._changed = asyncio.Event()

    def set_detail(self, unit: Unit, detail: str) -> None:
        """Say why the unit is where it is (a probe's answer, a port moved, a stop under
        way) without changing its state."""
        unit.detail = detail

    def hold(self, unit: Unit, reason: str) -> None:
        """Keep a running unit out of service (e.g. a shard catching up to the policy)."""
        if not unit.state.running:  # it exited meanwhile; the exit is what counts
            return
        unit.hold_reason = reason
        self.transition(unit, UnitState.HELD, reason)

    def admit(self, unit: Unit, detail: str | None) -> None:
        """End a hold. A unit that is also degraded stays so until its liveness recovers,
        and then goes to ready, not back to held."""
        unit.hold_reason = None
        if unit.state is UnitState.HELD:
            self.transition(unit, UnitState.READY, detail)
        elif detail is not None:
            self.set_detail(unit, detail)

    async def changed(self, timeout: float | None = None) -> None:
        """Wait for the next state change (or the timeout)."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()

    def all_up(self) -> bool:
        return all(u.state in {UnitState.READY, UnitState.COMPLETED} for u in self.units.values())

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        for unit in self.units.values():
            unit.task = asyncio.get_running_loop().create_task(
                self._supervise(unit), name=f"unit:{unit.name}"
            )

    async def wait_up(self) -> None:
        """Return once every unit is ready (or completed); raise UnitFailed if one fails."""
        while True:
            failed = [u for u in self.units.values() if u.state is UnitState.FAILED]
            if failed:
                unit = failed[0]
                await unit.sink.drain(timeout=0.5)  # its last lines may name the cause
                unit.cause = unit.cause or unit.sink.cause()
                raise UnitFailed(unit.name, self.explain(unit))
            if self.all_up():
                return
            if self.stopping:
                raise UnitFailed("stack", "shutdown requested before the stack was ready")
            await self.changed()

    def explain(self, unit: Unit) -> str:
        lines = [unit.detail]
        cause = unit.cause or unit.sink.cause()
        if cause:
            lines.append(f"its own cause: {cause}")
        lines.append(f"log: {unit.log_path}")
        earlier, tail = unit.sink.telling(12)
        if earlier:
            lines.append("earlier lines that say what went wrong:")
            lines += [f"  | {line}" for line in earlier]
        if tail:
            lines.append("last lines:")
            lines += [f"  | {line}" for line in tail]
        return "\n".join(lines)

    def _away(self, unit: Unit) -> list[str]:
        """Dependencies that do not meet their condition now, as 'name (condition)', or
        'name on NODE' for a unit another node runs."""
        return [
            (f"{dep} at {spec.outside}" if spec.outside else f"{dep} on {spec.remote}")
            if (spec := self.units[dep].spec).remote
            else f"{dep} ({condition})"
            for dep, condition in unit.spec.depends_on.items()
            if not _satisfied(self.units[dep].state, condition)
        ]

    async def _wait_for_dependencies(self, unit: Unit) -> str | None:
        """Block until every dependency meets its condition; return a reason if one never
        will. A unit that already ran waits in `waiting`, naming what it waits for."""
        while True:
            for dep, condition in unit.spec.depends_on.items():
                other = self.units[dep]
                if _satisfied(other.state, condition):
                    continue
                if (
                    other.state is UnitState.FAILED
                    or (other.state in _DEAD_END and self.stopping)
                    or (condition is Condition.COMPLETED and other.state is UnitState.COMPLETED)
                ):
                    return f"dependency {dep} is {other.state}: {other.detail}"
            waiting = self._away(unit)
            if not waiting:
                return None
            why = f"waiting for {', '.join(waiting)}"
            if unit.state in {UnitState.BACKOFF, UnitState.WAITING}:  # it ran before
                self.transition(unit, UnitState.WAITING, why)
            else:
                self.set_detail(unit, why)
            await self.changed()

    async def _supervise(self, unit: Unit) -> None:
        """Run the unit's lifecycle. An unexpected error inside it (a bug, an OS error) is
        logged and the unit is supervised again after a pause, never silently dropped."""
        while True:
            try:
                await self._lifecycle(unit)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # supervision must outlive any one error
                log.exception("unit.supervision_error", unit=unit.name)
                await self._recover(unit, exc)

    async def _recover(self, unit: Unit, exc: Exception) -> None:
        unit.attempt_since = None
        # Record why first: the kill below is then not taken for the unit's own exit.
        detail = f"supervision error: {exc.__class__.__name__}: {exc}; starting again in 1s"
        if UnitState.BACKOFF in ALLOWED[unit.state]:
            self.transition(unit, UnitState.BACKOFF, detail)
        else:
            self.set_detail(unit, detail)
        child = unit.child
        if child is not None and child.alive:
            self.host.kill_group_now(child)
            unit.last_exit = await child.wait()
            await self._reap_leftovers(unit)
        await asyncio.sleep(1.0)

    async def _lifecycle(self, unit: Unit) -> None:
        if unit.spec.remote is not None:
            await self._follow_remote(unit)
            return
        while True:
            blocked = await self._wait_for_dependencies(unit)
            if blocked is not None:
                self.transition(unit, UnitState.FAILED, blocked)
                return
            exit = await self._run_once(unit)
            if exit is None:  # could not even spawn
                return
            # The Reaper recorded the exit and its state change when it reaped the process
            # (`_exited`); hooks and the sweep come after.
            recorded = unit.recorded
            if recorded is None or recorded[0] is not unit.child:
                recorded = (unit.child, *self._record(unit, exit))
            _, decision, exited_at = recorded
            for hook in self.hooks:
                await hook.on_exit(unit, exit)
            await self._reap_leftovers(unit)
            await unit.sink.drain(timeout=0.5)
            if unit.state is not UnitState.COMPLETED:  # kept past `down` for last-down.json
                unit.cause = unit.sink.cause()
            if not decision.restart:
                return
            await asyncio.sleep(max(0.0, decision.delay - (time.monotonic() - exited_at)))

    async def _follow_remote(self, unit: Unit) -> None:
        """A unit another node runs: never spawned here. Its state follows its readiness
        probe, run against that node: starting (not answering yet), ready, and back to
        backoff while it does not answer (its dependents here then show it as away)."""
        spec = unit.spec.ready
        assert spec is not None and unit.spec.remote is not None
        prober = make_prober(spec, self._probe_context(unit))
        node = _place(unit.spec)
        try:
            while True:
                unit.attempt_since = time.monotonic()
                unit.attempt_what = describe(spec)
                try:
                    result = await prober.check()
                finally:
                    unit.attempt_since = None
                self._probed(unit, "ready", result)
                if result.ok:
                    if unit.state is not UnitState.READY:
                        if unit.state is not UnitState.STARTING:
                            self.transition(unit, UnitState.STARTING)
                        unit.ready_at = time.monotonic()
                    self.transition(unit, UnitState.READY, f"{node}: {result.detail}")
                else:
                    if unit.state is UnitState.READY:
                        self.transition(
                            unit, UnitState.BACKOFF, f"not ready {node}: {result.detail}"
                        )
                    if unit.state is not UnitState.STARTING:
                        self.transition(unit, UnitState.STARTING)
                    self.set_detail(unit, f"waiting for {unit.name} {node}: {result.detail}")
                await asyncio.sleep(spec.interval if not result.ok else max(spec.interval, 0.5))
        finally:
            prober.close()

    def _exited(self, unit: Unit, child: Process, exit: Exit) -> None:
        """Called by the Reaper in the same step that reaps `child`: record the exit and
        the state it leads to before anything else runs (probes, hooks, /proc sweeps)."""
        if unit.child is not child or self.stopping or not unit.state.running:
            return  # being stopped: stop_unit records it
        unit.recorded = (child, *self._record(unit, exit))

    def _record(self, unit: Unit, exit: Exit) -> tuple[Decision, float]:
        """The restart decision for this exit, and the transition it makes."""
        exited_at = time.monotonic()
        unit.last_exit = exit
        unit.last_oom = self._oom_kill(unit, exit)
        unit.hold_reason = None
        was_ready = unit.ready_at is not None
        if not was_ready and unit.spec.type != "oneshot" and unit.failure_hint is None:
            unit.failure_hint = exits.before_ready_hint(unit.spec, unit.detail)
        outcome = exits.decide_exit(
            exits.ExitFacts(
                exit=exit,
                premature=exits.premature(unit.spec, was_ready=was_ready),
                uptime=exited_at - (unit.child.started_at if unit.child else exited_at),
                now=exited_at,
                away=self._away(unit),
                hint=unit.failure_hint,
                oom=unit.last_oom,
            ),
            unit.tracker,
        )
        self.transition(unit, outcome.state, outcome.detail)
        return outcome.decision, exited_at

    def _oom_kill(self, unit: Unit, exit: Exit) -> exits.OomKill | None:
        """Whether the kernel's OOM killer ended the unit (read before its cgroups go)."""
        if exit.signal != signal.SIGKILL:
            return None
        plan = self.host.limits(unit.name)
        limit = plan.memory_max_words() if plan is not None else None
        oom = exits.oom_kill(exit, self.host.oom_kills(unit.name), limit)
        if oom is not None:
            unit.oom_kills += 1
            log.warning("unit.oom_killed", unit=unit.name, limit=limit,
                        pid=unit.child.pid if unit.child else None)  # fmt: skip
        return oom

    async def _run_once(self, unit: Unit) -> Exit | None:
        """Spawn, wait for readiness, watch. The exit, or None if it could not spawn. The
        start (spawn until its probe passes or it stayed up min_uptime; a oneshot's whole
        run) holds one of the node's start slots (`[stack] max_starting`)."""
        unit.failure_hint = None
        unit.recorded = None
        for hook in self.hooks:
            await hook.before_start(unit)
        await self._take_start_slot(unit)
        try:
            self._move_taken_ports(unit)
            if not await self._spawn(unit):
                return None
            child = unit.child
            assert child is not None
            if unit.spec.type == "oneshot":
                return await child.wait()
            ready = await self._become_ready(unit, child)
        finally:
            self.start_slots.give_back(unit.name)
        if not ready:
            return await child.wait()
        return await self._watch(unit, child)

    async def _take_start_slot(self, unit: Unit) -> None:
        """Wait for a start slot, saying so while it waits (the readiness deadline counts
        from the spawn, so the wait costs the unit none of it)."""
        slots = self.start_slots
        if slots.would_wait():
            self.set_detail(unit, f"waiting for a start slot ({slots.describe()})")
            log.info("unit.start_slot_wait", unit=unit.name, starting=slots.holders,
                     waiting=len(slots.waiting) + 1)  # fmt: skip
        await slots.take(unit.name)

    async def _become_ready(self, unit: Unit, child: Process) -> bool:
        """Readiness (its probe, or min_uptime up), then the hooks: True once the unit
        counts as ready; False if it exited meanwhile or was killed for not getting ready."""
        spec = unit.spec
        if spec.ready is not None:
            ready, detail = await self._await_ready(unit, child)
            if not ready:
                if child.alive:
                    unit.failure_hint = detail
                    self.host.kill_group_now(child)
                return False
        else:  # no probe: ready once it has stayed up min_uptime (supervisord's startsecs)
            await asyncio.wait([child.exited], timeout=spec.restart.min_uptime)
            if not child.alive:
                return False
        # Started: the hooks (a shard's replay) have no deadline to miss, and one may wait
        # on others (the ledger), so they run without a start slot.
        self.start_slots.give_back(unit.name)
        for hook in self.hooks:
            if await _race(hook.on_ready(unit), child.exited) is _EXITED:
                return False
        if not child.alive:  # exited as the last probe or hook finished: already recorded
            return False
        unit.ready_at = time.monotonic()
        await self.host.note_shm(unit.name, child)
        if unit.hold_reason is not None:
            self.admit(unit, None)
        elif spec.ready is None:
            self.transition(
                unit,
                UnitState.READY,
                f"running (no readiness probe; up {spec.restart.min_uptime:g}s)",
            )
        else:
            self.transition(unit, UnitState.READY)
        return True

    def _move_taken_ports(self, unit: Unit) -> None:
        """An allocated port of the unit that another process took since it was allocated:
        allocate it again and re-render the stack (portmove) before the spawn; a running unit
        whose templates reference the port is restarted with the new number."""
        taken = portmove.taken(self.stack, unit.name, in_use=self.host.port_in_use)
        if not taken:
            return
        try:
            moved = portmove.move(self.stack, unit.name, set(taken),
                                  allocate_port=self.host.allocate_port)
        except (SpecErrors, OSError) as exc:
            log.error("unit.ports_not_moved", unit=unit.name, taken=taken, error=str(exc))
            return
        if moved is None:  # fixed ports: the spawn fails as the operator's choice says
            return
        owners = {n: sorted(self.host.port_owners(p)) for n, p in taken.items()}
        what = "; ".join(
            f"port {n} {old} taken by {self._owners(owners.get(n, []))}, moved to {new}"
            for n, (old, new) in moved.ports.items()
        )
        self.stack = moved.stack
        for listener in self.restack_listeners:  # e.g. the [policy] table's etcd endpoint
            listener(moved.stack)
        for name in [unit.name, *moved.referencing]:
            self.units[name].spec = moved.stack.units[name]
        log.warning("unit.ports_moved", unit=unit.name, moved=what, re_rendered=moved.referencing)
        self.set_detail(unit, what)
        for name in moved.referencing:
            if self.units[name].state.running:
                asyncio.get_running_loop().create_task(self._restart_moved(name, unit.name))

    async def _restart_moved(self, name: str, mover: str) -> None:
        with contextlib.suppress(DynamodError):
            log.info("unit.restart_for_moved_port", unit=name, moved_by=mover)
            await self.restart_unit(name)

    async def _spawn(self, unit: Unit) -> bool:
        """Start the unit's process off the event loop (exits of other units keep being
        recorded meanwhile). A stop that cancels the lifecycle during the spawn still
        finds the child: it is kept and the unit is `starting` before the cancel goes on."""
        spec = unit.spec
        env = self.host.environment(unit.name, self._env(spec))
        if not any(name in spec.env for name in unittmp.VARIABLES):
            env.update(unittmp.fresh(self.state_dir, unit.name))  # emptied at every spawn
        cancelled = False
        try:
            spawning = asyncio.ensure_future(
                self.host.spawn(
                    unit.name,
                    spec.command,
                    env=env,
                    cwd=Path(spec.cwd) if spec.cwd else None,
                    on_exit=lambda c, exit: self._exited(unit, c, exit),
                    limits=spec.limits,
                )
            )
            while not spawning.done():
                try:
                    await asyncio.shield(spawning)
                except asyncio.CancelledError:
                    cancelled = True
            child = spawning.result()
        except (OSError, cgroups.CgroupError) as exc:
            hint = f" ({spec.install_hint})" if spec.install_hint else ""
            self.transition(
                unit,
                UnitState.FAILED,
                f"cannot start {spec.command[0]!r}: {getattr(exc, 'strerror', None) or exc}{hint}",
            )
            if cancelled:
                raise asyncio.CancelledError from None
            return False
        unit.starts += 1
        unit.child = child
        unit.ready_at = None
        unit.sink.header(f"start #{unit.starts} pid {child.pid}: {' '.join(spec.command)}")
        self.host.attach_output(child, unit.sink)
        self.transition(unit, UnitState.STARTING, f"spawned pid {child.pid}")
        if cancelled:
            raise asyncio.CancelledError
        return True

    def _env(self, spec: UnitSpec) -> dict[str, str]:
        env = dict(spec.env)
        for source in self.env_sources:
            env.update(source(spec))
        return env

    def _probe_context(self, unit: Unit) -> ProbeContext:
        return ProbeContext(
            session=self.session,
            reaper=self.host.reaper,
            sink=unit.sink,
            env=self.host.environment(f"{unit.name}:probe", self._env(unit.spec)),
        )

    async def _await_ready(self, unit: Unit, child: Process) -> tuple[bool, str]:
        spec = unit.spec.ready
        assert spec is not None
        prober = make_prober(spec, self._probe_context(unit))
        deadline = child.started_at + spec.deadline
        last: str | None = None
        try:
            while child.alive:
                result = await self._attempt(unit, prober, child, deadline)
                if result is _EXITED or not child.alive:
                    break
                if result is _DEADLINE:
                    cut = (
                        f"not ready within {spec.deadline:g}s: the attempt in flight "
                        f"({describe(spec)}, timeout {spec.timeout:g}s) was cut at the deadline"
                    )
                    return False, f"{cut}; last probe: {last}" if last else cut
                last = result.detail
                self._probed(unit, "ready", result)
                if result.ok and (impostor := self._answered_by_other(unit, child)):
                    result = ProbeResult(False, impostor)
                self.set_detail(unit, result.detail)
                if result.ok:
                    return True, result.detail
                waited = time.monotonic() - child.started_at
                pause = min(ready_pause(spec.interval, waited), deadline - time.monotonic())
                if pause > 0:
                    await asyncio.wait([child.exited], timeout=pause)
                if time.monotonic() >= deadline:
                    return False, (
                        f"not ready within {spec.deadline:g}s; last probe: {result.detail}"
                    )
            return False, unit.detail
        finally:
            prober.close()

    async def _attempt(
        self, unit: Unit, prober: Prober, child: Process, deadline: float | None
    ) -> Any:
        """One probe attempt, raced against the process's exit and (for readiness) the
        deadline: a result, _EXITED or _DEADLINE. The attempt in flight shows in status."""
        spec = unit.spec.ready if deadline is not None else unit.spec.live
        unit.attempt_since = time.monotonic()
        unit.attempt_what = describe(spec) if spec is not None else "probe"
        try:
            work = prober.check()
            if deadline is None:
                return await _race(work, child.exited)
            # asyncio.timeout, not wait_for: in Python 3.11 wait_for returns the result
            # when its inner task finishes as the outer one is cancelled, so a `down`
            # that landed then was swallowed and the unit went on restarting (seen: a
            # frontend cycling in backoff 17 min after its stack was told to stop).
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                    return await _race(work, child.exited)
            except TimeoutError:
                return _DEADLINE
        finally:
            unit.attempt_since = None

    def _answered_by_other(self, unit: Unit, child: Process) -> str | None:
        """A probe passed; if a port it targets is listened on by a process outside the
        unit's process tree (group or run/unit marker), say whose the answer was."""
        probe = unit.spec.ready
        url = urlsplit(str(getattr(probe, "url", "") or ""))
        targets = {getattr(probe, "port", None)}
        with contextlib.suppress(ValueError):
            targets.add(url.port)
        for name, port in unit.spec.ports.items():
            if port not in targets:
                continue
            if self.host.port_owners(port, among=self.host.unit_pids(unit.name, child)):
                continue  # one of the unit's own processes listens: the answer was its
            owners = self.host.port_owners(port)  # whose, then: every process's fds
            if not owners:
                continue
            who = self._owners(sorted(owners))
            return (
                f"port {name}={port} is answered by {who}, not by {unit.name}'s processes"
                f" (group {child.pid}): another process holds the port"
            )
        return None

    def _probed(self, unit: Unit, kind: str, result: ProbeResult) -> None:
        for listener in self.probe_listeners:
            listener(unit, kind, result)

    async def _watch(self, unit: Unit, child: Process) -> Exit:
        spec = unit.spec.live
        if spec is None:
            return await child.wait()
        prober: Prober = make_prober(spec, self._probe_context(unit))
        failures = 0
        try:
            while True:
                await asyncio.wait([child.exited], timeout=spec.interval)
                if not child.alive:
                    return await child.wait()
                result = await self._attempt(unit, prober, child, None)
                if result is _EXITED or not child.alive:
                    return await child.wait()
                self._probed(unit, "live", result)
                if result.ok:
                    failures = 0
                    if unit.state is UnitState.DEGRADED:
                        back = UnitState.HELD if unit.hold_reason else UnitState.READY
                        self.transition(unit, back, result.detail)
                    continue
                failures += 1
                if failures >= spec.failure_threshold:
                    unit.failure_hint = why = (
                        f"liveness failed {failures} times in a row: {result.detail}; killed"
                    )
                    for listener in self.lost_listeners:  # e.g. replace it before it is gone
                        listener(unit, why)
                    self.host.kill_group_now(child)
                    return await child.wait()
                self.transition(
                    unit,
                    UnitState.DEGRADED,
                    f"liveness {failures}/{spec.failure_threshold}: {result.detail}",
                )
        finally:
            prober.close()

    async def _reap_leftovers(self, unit: Unit) -> None:
        """The main process is gone; end whatever it left in its cgroup (with cgroups: one
        file read when it left nothing), or in its group, marked, or re-parented to us."""
        if unit.child is None:
            return
        await self.host.stop_tree(unit.name, unit.child, sig=signal.SIGKILL, timeout=0)

    # ------------------------------------------------------------------ stop

    async def stop(self) -> list[int]:
        """Stop every unit: dependents first, independent units in parallel. Returns the
        pids of any process that survived SIGKILL (should be none)."""
        self.stopping = True
        self.killed = {}  # from here on: what this stop had to kill
        done: dict[str, asyncio.Event] = {name: asyncio.Event() for name in self.units}
        dependents = graph.dependents({n: list(u.spec.depends_on) for n, u in self.units.items()})
        survivors: list[int] = []

        async def stop_one(unit: Unit) -> None:
            try:
                for other in dependents[unit.name]:
                    await done[other].wait()
                survivors.extend(await self.stop_unit(unit))
            finally:
                done[unit.name].set()

        await asyncio.gather(*(stop_one(u) for u in self.units.values()))
        for unit in self.units.values():
            await unit.sink.drain(timeout=0.5)
            unit.sink.close()
        return survivors

    async def stop_unit(self, unit: Unit, why: str = "") -> list[int]:
        """Stop one unit: its stop signal, its timeout, then SIGKILL to its group; the
        hooks see the exit (a registration is revoked). `why` leads the detail it ends with."""
        lead = f"{why}: " if why else ""
        if unit.task is not None and not unit.task.done():
            unit.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await unit.task
        if unit.state is UnitState.STOPPED:
            return []
        child = unit.child
        if unit.state.running:
            self.transition(unit, UnitState.STOPPING)
        if child is None:  # never spawned
            self.transition(unit, UnitState.STOPPED, f"{lead}never started" if why else None)
            return []
        if not child.alive:  # its main process is gone; end what it may have left
            result = await self.host.stop_tree(unit.name, child, sig=signal.SIGKILL, timeout=0)
            if result.killed:
                self.killed.setdefault(unit.name, []).extend(result.killed)
            self.transition(unit, UnitState.STOPPED, f"{lead}was not running" if why else None)
            return result.survivors
        started = time.monotonic()
        self.set_detail(
            unit,
            f"sending {unit.spec.stop.signal} to "
            + (
                f"cgroup {cg} (cgroup.kill"
                if (cg := self.host.cgroup(unit.name))
                else f"group {child.pid} (SIGKILL"
            )
            + f" after {unit.spec.stop.timeout:g}s)",
        )
        result = await self.host.stop_tree(
            unit.name, child, sig=unit.spec.stop.signum, timeout=unit.spec.stop.timeout
        )
        if result.killed:
            self.killed.setdefault(unit.name, []).extend(result.killed)
        exit = await child.wait()
        unit.last_exit, unit.last_oom = exit, None
        for hook in self.hooks:  # e.g. revoke a registration the unit did not remove itself
            await hook.on_exit(unit, exit)
        took = time.monotonic() - started
        how = "escalated to SIGKILL" if result.escalated else exit.describe()
        if result.killed_outside_group:
            how += f"; {result.killed_outside_group} outside its process group"
        detail = f"{lead}stopped in {took:.2f}s ({how})"
        if result.survivors:
            detail += f"; SURVIVORS: {result.survivors}"
        self.transition(unit, UnitState.STOPPED, detail)
        return result.survivors

    async def restart_unit(self, name: str) -> None:
        """Operator restart: stop this unit alone, forget its backoff, start it again."""
        unit = self.units[name]
        await self.stop_unit(unit)
        unit.operator_stop = None  # a restart starts an operator-stopped unit too
        if self.stopping:  # a `down` began meanwhile: starting it again would outlive it
            raise DynamodError(f"{name} was stopped, not started again: the stack is stopping")
        unit.tracker.reset()
        unit.task = asyncio.get_running_loop().create_task(
            self._supervise(unit), name=f"unit:{unit.name}"
        )

    async def hold_stopped(self, name: str, by: str) -> None:
        """Operator stop: stop the unit through the normal stop path and keep it stopped
        (no restart, no backoff) until `release`; the rest of the stack is untouched."""
        unit = self.units[name]
        if self.stopping:
            raise DynamodError(f"{name} not stopped: the stack is stopping")
        unit.operator_stop = (by, time.monotonic())
        log.info("unit.operator_stop", unit=name, by=by, state=str(unit.state))
        await self.stop_unit(unit, why=f"stopped by {by}")

    def release(self, name: str) -> None:
        """End an operator stop: start the unit through the normal path (dependencies,
        spawn, readiness, the hooks: a rollout shard is held and replayed before admission)."""
        unit = self.units[name]
        if self.stopping:
            raise DynamodError(f"{name} not started: the stack is stopping")
        log.info("unit.operator_start", unit=name)
        unit.operator_stop = None
        unit.tracker.reset()
        unit.task = asyncio.get_running_loop().create_task(
            self._supervise(unit), name=f"unit:{unit.name}"
        )

    # ------------------------------------------------------------------ live changes

    def adopt(self, stack: Stack, changed: Iterable[str] = ()) -> list[str]:
        """Take `stack` (the running one after `apply`) as the stack: units it no longer has
        must be stopped already and are dropped; units it adds get a record (started by
        `start_added`); units in both keep theirs and take the new spec, except the
        `changed` ones (a change that restarts them): they keep the spec they run with, here
        and in the stack, until `replace` gives them the new one (one at a time: an apply
        cut short leaves a stack that says what runs). Returns the added names."""
        keep = {n: self.units[n].spec for n in changed if n in self.units and n in stack.units}
        if keep:
            stack = dataclasses.replace(stack, units={**stack.units, **keep})
        added = [name for name in stack.order if name not in self.units]
        units: dict[str, Unit] = {}
        for name in stack.order:
            unit = self.units.get(name)
            if unit is None:
                spec = stack.units[name]
                path = self.state_dir / "logs" / f"{name}.log"
                unit = Unit(spec=spec, sink=OutputSink(LogFile(path, max_bytes=self.log_max_bytes)),
                            log_path=path, tracker=RestartTracker(spec.restart))  # fmt: skip
            elif name not in keep:
                unit.spec = stack.units[name]
                unit.tracker.spec = unit.spec.restart  # its count and backoff go on
            units[name] = unit
        for name, unit in self.units.items():
            if name not in units:
                unit.sink.close()
        self.units = units
        self.stack = stack
        self.start_slots.set_limit(stack.max_starting)
        for listener in self.restack_listeners:  # e.g. which units are rollout shards now
            listener(stack)
        self._changed.set()
        self._changed = asyncio.Event()
        return added

    def start_added(self, names: Iterable[str]) -> None:
        """Start units `adopt` added: each waits for its dependencies as at bring-up."""
        if self.stopping:
            raise DynamodError("not started: the stack is stopping")
        for name in names:
            unit = self.units[name]
            unit.task = asyncio.get_running_loop().create_task(
                self._supervise(unit), name=f"unit:{name}"
            )

    async def replace(self, name: str, spec: UnitSpec, why: str) -> bool:
        """Stop the unit, give it `spec` and start it again (a unit the operator holds
        stopped only gets the spec). Whether it was started."""
        unit = self.units[name]
        if unit.operator_stop is None:
            await self.stop_unit(unit, why=why)
        unit.spec = self.stack.units[name] = spec
        unit.tracker = RestartTracker(spec.restart)
        if unit.operator_stop is not None:
            return False
        if self.stopping:
            raise DynamodError(f"{name} was stopped, not started again: the stack is stopping")
        unit.task = asyncio.get_running_loop().create_task(
            self._supervise(unit), name=f"unit:{name}"
        )
        return True

    async def wait_serving(self, names: list[str], timeout: float) -> None:
        """Until every unit named is ready (or completed) and not held; UnitFailed if one
        fails or the timeout passes first, naming it and why."""
        deadline = time.monotonic() + timeout
        while True:
            units = [self.units[n] for n in names if n in self.units]
            failed = [u for u in units if u.state is UnitState.FAILED]
            if failed:
                raise UnitFailed(failed[0].name, self.explain(failed[0]))
            waiting = [u for u in units if not _serving(u)]
            if not waiting:
                return
            left = deadline - time.monotonic()
            if left <= 0 or self.stopping:
                first = waiting[0]
                why = "the stack is stopping" if self.stopping else f"not ready within {timeout:g}s"
                raise UnitFailed(first.name, f"{why}: {first.state}: {first.detail}")
            await self.changed(timeout=min(left, 1.0))

    # ------------------------------------------------------------------ views

    def snapshot(self) -> list[EngineUnitStatus]:
        """Each unit's row in `status`, the engine's part (the daemon adds the extensions')."""
        now = time.monotonic()
        rows: list[EngineUnitStatus] = []
        for unit in self.units.values():
            child = unit.child
            alive = child is not None and child.alive
            failing = _failing(unit)
            rows.append(
                {
                    "name": unit.name,
                    "unit": unit.spec.unit,
                    "index": unit.spec.index,
                    "state": str(unit.state),
                    "since_s": round(now - unit.state_since, 3),
                    "pid": child.pid if alive and child else None,
                    "uptime_s": round(now - child.started_at, 3) if alive and child else None,
                    "restarts": unit.tracker.total,
                    "starts": unit.starts,
                    "last_exit": (
                        exits.describe_exit(unit.last_exit, unit.last_oom)
                        if unit.last_exit else None
                    ),
                    "detail": self._current_detail(unit, now),
                    "log_dropped_bytes": unit.sink.logfile.dropped_bytes,
                    "log_drop_reason": unit.sink.logfile.drop_reason,
                    "ports": dict(unit.spec.ports),
                    "depends_on": {k: str(v) for k, v in unit.spec.depends_on.items()},
                    "log": str(unit.log_path),
                    # why a unit that keeps failing fails: its telling log lines (ENOSPC, ...)
                    "explain": self.explain(unit) if failing else None,
                    "cause": unit.cause or (unit.sink.cause() if failing else None),
                    "command": list(unit.spec.command),
                    "operator_stop": (
                        {"by": unit.operator_stop[0],
                         "since_s": round(now - unit.operator_stop[1], 3)}
                        if unit.operator_stop else None
                    ),
                    "limits": (
                        plan.status(unit.oom_kills)
                        if (plan := self.host.limits(unit.name)) is not None else None
                    ),
                }
            )
        return rows

    def _owners(self, pids: list[int]) -> str:
        if not pids:
            return "another process"
        return ", ".join(f"pid {pid} ({self.host.command_line(pid)})" for pid in pids)

    @staticmethod
    def _current_detail(unit: Unit, now: float) -> str:
        """The last answer, or, while an attempt has been waiting a while, that wait; for
        a unit the operator stopped, who stopped it and when."""
        if unit.operator_stop is not None and unit.state is UnitState.STOPPED:
            by, at = unit.operator_stop
            how = unit.detail.removeprefix(f"stopped by {by}: ")
            return f"stopped by {by} {now - at:.0f} s ago; {how}"
        since = unit.attempt_since
        if since is None or now - since < 1.0:
            return unit.detail
        waiting = f"waiting {now - since:.1f} s for an answer ({unit.attempt_what})"
        return f"{waiting}; before: {unit.detail}" if unit.detail else waiting


_EXITED = object()
_DEADLINE = object()


async def _race(work: Awaitable[Any], exited: asyncio.Future[Exit]) -> Any:
    """Run `work` (a probe attempt, a hook) unless the process exits first: then cancel
    it and return _EXITED."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait([task, exited], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # e.g. a deadline: end the attempt (and its process)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return _EXITED
