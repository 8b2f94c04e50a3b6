"""The daemon: owns the state dir, the engine, the control socket and the guardian.

Lifecycle: lock state dir -> sweep what a dead previous run left -> containment (the
stack's cgroup, or the fallback) -> subreaper + SIGCHLD -> guardian (restarted if it dies)
-> control socket -> engine.start -> wait until every unit is ready (or fail, tear down,
exit 1) -> serve until `down`, SIGTERM or SIGINT -> stop units in reverse order -> sweep the
stack's cgroup, marked processes and every child but the guardian. Once up, the phase is
`degraded` whenever a unit is not ready (or completed), naming which and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import aiohttp
import structlog
from aiohttp import web

from dynamod.core import (
    api,
    cgroups,
    leftovers,
    live,
    loopwatch,
    opstop,
    paths,
    ports,
    process,
    runrecord,
    statedir,
    unittmp,
)
from dynamod.core.atomicfile import StateWriteError, write_atomic
from dynamod.core.engine import Engine, Unit
from dynamod.core.errors import DaemonError, DynamodError, StateDirError, UnitFailed
from dynamod.core.events import EventLog, events_path, watch_units
from dynamod.core.extensions import Extension
from dynamod.core.guardianship import Guardianship
from dynamod.core.phase import Phase
from dynamod.core.spec import Stack
from dynamod.core.spec.diff import diff, lines
from dynamod.core.state import UnitState
from dynamod.core.status import EngineUnitStatus, ExtensionUnitStatus, UnitStatus

log = structlog.get_logger("dynamod.core.daemon")

_SERVING = {UnitState.READY, UnitState.COMPLETED}
EXTENSION_STOP_S = 10.0  # after `down`: an extension that takes longer is left behind


class StateDir:
    """The per-stack directory: lock, socket, pid file, logs. Mode 0700."""

    def __init__(self, path: Path) -> None:
        self.path = path.absolute()
        self._lock: IO[bytes] | None = None

    def acquire(self) -> None:
        statedir.create(self.path)
        try:
            lock = (self.path / "dynamod.lock").open("a+b")
        except OSError as exc:
            raise StateDirError(self.path, f"cannot write its lock file: {exc.strerror}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise DaemonError(
                f"{self._holder()} already runs with state dir {self.path}; "
                "stop it with `dynamod down` or use another --state-dir"
            ) from None
        self._lock = lock
        write_atomic(self.path / "dynamod.pid", f"{os.getpid()}\n".encode())

    def _holder(self) -> str:
        """The daemon holding the lock, by pid and stack. A winner that has just taken the
        lock may not have written run.json yet: wait for it a moment."""
        deadline = time.monotonic() + 2.0
        while True:
            run = runrecord.read(self.path)
            if run is not None and run.pid != os.getpid() and run.daemon_alive():
                return f"a dynamod daemon (pid {run.pid}, stack {run.stack_name}, run {run.run_id})"
            if time.monotonic() >= deadline:
                return f"a dynamod daemon (pid {self.read_pid()})"
            time.sleep(0.05)

    def read_pid(self) -> int | None:
        try:
            return int((self.path / "dynamod.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def write_json(self, name: str, data: Any) -> None:
        """Replace NAME atomically; raises StateWriteError (old version kept) if it cannot."""
        write_atomic(self.path / name, json.dumps(data, indent=2).encode())

    def release(self) -> None:
        for name in ("dynamod.sock", "dynamod.pid"):
            (self.path / name).unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.close()
            self._lock = None


@dataclass
class Daemon:
    stack: Stack
    state: StateDir
    extensions: list[Extension] = field(default_factory=list)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    phase: Phase = Phase.STARTING
    error: str | None = None
    engine: Engine | None = None
    started_at: float = field(default_factory=time.monotonic)
    _shutdown: asyncio.Event = field(default_factory=asyncio.Event)
    _down_result: asyncio.Future[dict[str, Any]] | None = None
    on_phase: list[Callable[[Phase], None]] = field(default_factory=list)
    containment: cgroups.Containment | None = None
    units_host: process.OsHost | None = None  # the engine's, kept for the teardown
    guardian: Guardianship | None = None
    swept: leftovers.Leftovers | None = None  # what a dead previous run had left
    events: EventLog = field(init=False)  # the events file `dynamod events` reads
    applying: str | None = None  # an apply in progress, in words

    def __post_init__(self) -> None:
        self.events = EventLog(events_path(self.state.path))

    @property
    def state_dir(self) -> Path:
        return self.state.path

    def set_phase(self, phase: Phase) -> None:
        self.phase = phase
        log.info(
            "stack.phase",
            stack=self.stack.name,
            phase=str(phase),
            degraded=self.degraded_units() or None,
        )
        self.events.emit("phase", None, phase=str(phase), reason=self.error)
        for callback in self.on_phase:
            callback(phase)

    def degraded_units(self) -> dict[str, str]:
        """Once the stack was up: unit -> why it is not serving (its state and detail)."""
        if self.engine is None or self.phase not in {Phase.UP, Phase.DEGRADED}:
            return {}
        return {
            unit.name: f"{unit.state}: {unit.detail.splitlines()[0] if unit.detail else ''}"
            for unit in self.engine.units.values()
            if unit.state not in _SERVING
        }

    def _on_unit_change(self, unit: Unit, old: UnitState, new: UnitState) -> None:
        if self.phase not in {Phase.UP, Phase.DEGRADED}:
            return
        wanted = Phase.DEGRADED if self.degraded_units() else Phase.UP
        if wanted is not self.phase:
            self.set_phase(wanted)

    # -------------------------------------------------------------- control API

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "stack": self.stack.name,
            "stack_file": str(self.stack.path),
            "state_dir": str(self.state.path),
            "daemon_pid": os.getpid(),
            "run_id": self.run_id,
            "phase": str(self.phase),
            "error": self.error,
            "degraded": self.degraded_units(),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "units": self.unit_rows(),
            "containment": self.containment.as_dict() if self.containment else None,
            "guardian": self.guardian.as_dict() if self.guardian else None,
            "swept_previous": self.swept.as_dict() if self.swept else None,
            "start_slots": (
                self.engine.start_slots.as_dict()
                if self.engine is not None and self.engine.start_slots.limit is not None
                else None
            ),
        }
        dropped = sum(u["log_dropped_bytes"] for u in status["units"])
        if dropped:
            reasons = {u["log_drop_reason"] for u in status["units"]} - {None}
            status["logs"] = {
                "dropped_bytes": dropped,
                "reason": ", ".join(sorted(reasons)) if reasons else "earlier; writing again",
            }
        if self.engine is not None:
            for extension in self.extensions:
                status.update(extension.status())
        return status

    def unit_rows(self) -> list[UnitStatus]:
        """Every unit's row in `status`: the engine's keys, then each extension's own."""
        if self.engine is None:
            return []
        rows: list[UnitStatus] = []
        for row in self.engine.snapshot():
            merged: dict[str, Any] = dict(row)
            merged.update(self.extension_status(self.engine.units[row["name"]]))
            rows.append(cast(UnitStatus, merged))
        return rows

    def extension_status(self, unit: Unit) -> ExtensionUnitStatus:
        """Each extension's keys of `unit`'s row. A key already taken (the engine's, or
        another extension's) is not overwritten: the first owner keeps it."""
        merged: dict[str, Any] = {}
        for extension in self.extensions:
            for key, value in extension.unit_status(unit).items():
                if key in merged or key in EngineUnitStatus.__required_keys__:
                    log.error("extension.status_key_taken", extension=type(extension).__name__,
                              unit=unit.name, key=key)  # fmt: skip
                    continue
                merged[key] = value
        return cast(ExtensionUnitStatus, merged)

    def require_running(self, what: str) -> None:
        """Raise unless the stack is starting or up (for commands that change it), and no
        apply is changing it (they never interleave)."""
        if not self.phase.running:
            raise DynamodError(f"stack is {self.phase}; {what} needs a running stack")
        if self.applying is not None:
            raise DynamodError(
                f"an apply is changing the stack ({self.applying}); {what} is refused "
                "until it is done: try again then"
            )

    async def apply(self, body: object) -> dict[str, Any]:
        """`apply FILE` / `scale UNIT=N`: the diff, and (unless a dry run) the change made."""
        assert self.engine is not None
        request = live.Request.from_json(body)
        if self.phase not in {Phase.UP, Phase.DEGRADED}:
            raise DynamodError(f"stack is {self.phase}; apply needs a stack that is up")
        if self.applying is not None:
            raise DynamodError(f"another apply is in progress ({self.applying}); try again then")
        running = self.engine.stack
        allocate = (
            ports.PortAllocator(claim=False) if request.dry_run else self.engine.host.allocate_port
        )
        new = live.next_stack(running, request, allocate)
        change = diff(running, new)
        bases = {n: u.unit for s in (running, new) for n, u in s.units.items()}
        answer: dict[str, Any] = {
            "stack": running.name,
            "file": str(new.path),
            "dry_run": request.dry_run,
            "diff": change.as_json(),
            "lines": lines(change, bases),
            "done": [],
        }
        if request.dry_run or change.empty:
            return answer
        self.applying = f"apply of {new.path}" if request.scale is None else "scale"
        try:
            for extension in self.extensions:  # a policy push in flight finishes first
                await extension.settle()
            self.events.emit("apply", None, file=str(new.path), diff=answer["lines"])
            applier = live.Applier(self.engine, self.extensions, request.timeout,
                                   self.events.emit)  # fmt: skip
            answer["done"] = await applier.run(new, change)
        finally:
            self.applying = None
            self.stack = self.engine.stack
            if self.guardian is not None:
                with contextlib.suppress(StateWriteError):
                    self._write_run(self.guardian.pid)
        return answer

    async def down(self) -> dict[str, Any]:
        self._shutdown.set()
        assert self._down_result is not None
        return await asyncio.shield(self._down_result)

    async def restart(self, unit: str) -> dict[str, Any]:
        assert self.engine is not None
        if unit not in self.engine.units:
            known = ", ".join(self.engine.units)
            raise DynamodError(f"no unit {unit!r} in stack {self.stack.name} (units: {known})")
        if self.phase not in {Phase.UP, Phase.DEGRADED}:
            raise DynamodError(f"stack is {self.phase}; restart needs a running stack")
        await self.engine.restart_unit(unit)
        return {"ok": True, "unit": unit}

    async def operator(self, action: str, name: str) -> dict[str, Any]:
        """`stop UNIT` / `start UNIT`: hold units stopped, or start the held ones again."""
        assert self.engine is not None
        engine = self.engine
        names = opstop.select(name, {n: u.spec.unit for n, u in engine.units.items()})
        if self.phase not in {Phase.UP, Phase.DEGRADED}:
            raise DynamodError(f"stack is {self.phase}; {action} needs a running stack")
        views = [
            opstop.UnitView(n, engine.units[n].state, engine.units[n].operator_stop is not None)
            for n in names
        ]
        todo = opstop.plan(action, views)
        if action == "stop":
            for extension in self.extensions:  # a policy push in flight finishes first
                await extension.settle()
            await asyncio.gather(*(self._take_out(engine.units[n]) for n in todo.act))
        else:
            for n in todo.act:
                engine.release(n)
        return {"ok": True, "action": action, "done": todo.act, "already": todo.already}

    async def _take_out(self, unit: Unit) -> None:
        """An operator's stop, as an apply removes a unit: out of service first (a shard
        leaves the frontend's routing and finishes its in-flight requests), then held
        stopped."""
        assert self.engine is not None
        if unit.state.running:
            for extension in self.extensions:
                await extension.drain(unit, f"stopped by {opstop.STOPPED_BY}")
        await self.engine.hold_stopped(unit.name, opstop.STOPPED_BY)

    # -------------------------------------------------------------- run

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        reaper = self._prepare(loop)
        guardian = self.guardian
        assert self.containment is not None and guardian is not None
        census = None
        stalls = loop.create_task(loopwatch.watch(), name="loop-watch")
        if self.containment.kind is cgroups.Kind.PGROUP:
            census = loop.create_task(guardian.watch_orphans(), name="guardian-census")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._shutdown.set)
        runner = None
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        exit_code = 0
        try:
            runner = await self._start_engine(reaper, session)
            exit_code = await self._bring_up_and_serve()
        finally:
            survivors = await self._teardown()
            if survivors:
                exit_code = exit_code or 3
            if runner is not None:
                with contextlib.suppress(Exception):
                    await runner.cleanup()
            await self._stop_extensions()
            await session.close()
            if census is not None:
                census.cancel()
            stalls.cancel()
            guardian.close()  # the guardian sees EOF, finds nothing left, exits
            self.state.release()
            self.set_phase(Phase.STOPPED)
        return exit_code

    def _prepare(self, loop: asyncio.AbstractEventLoop) -> process.Reaper:
        """Take the state dir, sweep what a previous daemon left, find the containment and
        start the guardian: everything before the first unit can start."""
        self._down_result = loop.create_future()
        self.state.acquire()
        self.events.emit("phase", None, phase=str(self.phase), stack=self.stack.name,
                         run_id=self.run_id, daemon_pid=os.getpid())  # fmt: skip
        self.swept = leftovers.sweep_held(self.state.path)
        if self.swept is not None:
            log.warning("stack.swept_previous", **self.swept.as_dict())
        try:
            self.containment = cgroups.detect(self.run_id)
        except (ValueError, cgroups.CgroupError) as exc:
            self.state.release()
            raise DaemonError(str(exc)) from exc
        log.info("stack.containment", containment=self.containment.describe())
        reaper = process.Reaper()
        process.become_subreaper()
        reaper.install(loop)
        # asyncio.to_thread's workers (sweeps, scans) never take SIGCHLD from the loop
        executor = ThreadPoolExecutor(
            thread_name_prefix="asyncio", initializer=process.block_child_signals
        )
        loop.set_default_executor(executor)
        self.guardian = Guardianship(
            self.run_id, self.containment.root, reaper, on_change=self._write_run
        )
        self.guardian.start()
        return reaper

    async def _start_engine(
        self, reaper: process.Reaper, session: aiohttp.ClientSession
    ) -> web.AppRunner:
        """The engine, its extensions and the control socket; the engine's loop running."""
        self.engine = Engine(
            self.stack,
            state_dir=self.state.path,
            run_id=self.run_id,
            host=self._units_host(reaper),
            session=session,
            hooks=[],
        )
        self.engine.listeners.append(watch_units(self.events))
        self.engine.env_sources.extend(e.spawn_env for e in self.extensions)
        for extension in self.extensions:
            await extension.start(self)  # as its ExtensionHost
        app = api.build_app(self)
        for extension in self.extensions:
            app.router.add_routes(extension.routes())
        runner = await api.serve(app, paths.socket_path(self.state.path))
        self.engine.start()
        return runner

    async def _stop_extensions(self) -> None:
        for extension in self.extensions:  # each in bounded time: the daemon exits
            try:
                async with asyncio.timeout(EXTENSION_STOP_S):
                    await extension.stop()
            except TimeoutError:
                log.error("extension.stop_timeout", extension=type(extension).__name__,
                          seconds=EXTENSION_STOP_S)  # fmt: skip
            except Exception:
                log.exception("extension.stop_failed", extension=type(extension).__name__)

    def _units_host(self, reaper: process.Reaper) -> process.OsHost:
        self.units_host = process.OsHost(self.run_id, reaper, self.containment)
        return self.units_host

    def _write_run(self, guardian_pid: int | None) -> None:
        """run.json: what a later `up` or `down` needs to sweep this run if we die."""
        assert self.containment is not None
        root = self.containment.root
        runrecord.write(
            self.state.path,
            runrecord.RunRecord(
                run_id=self.run_id,
                pid=os.getpid(),
                stack=str(self.stack.path),
                stack_name=self.stack.name,
                guardian_pid=guardian_pid,
                containment=str(self.containment.kind),
                cgroup=str(root) if root else None,
                orphans=tuple(sorted(self.guardian.orphans.items())) if self.guardian else (),
                stopping=self._shutdown.is_set(),
            ),
        )

    async def _bring_up_and_serve(self) -> int:
        assert self.engine is not None
        bring_up = asyncio.ensure_future(self.engine.wait_up())
        shutdown = asyncio.ensure_future(self._shutdown.wait())
        await asyncio.wait([bring_up, shutdown], return_when=asyncio.FIRST_COMPLETED)
        if not bring_up.done():
            bring_up.cancel()
            self.error = "shutdown requested before the stack was ready"
            log.warning("stack.abandoned", reason=self.error)
            return 1
        try:
            bring_up.result()
        except UnitFailed as exc:
            shutdown.cancel()
            self.error = str(exc)
            self.set_phase(Phase.FAILED)
            log.error("stack.failed", unit=exc.unit, reason=exc.reason)
            return 1
        took = time.monotonic() - self.started_at
        # What bring-up built (modules, specs, the app) lives as long as the daemon: kept
        # out of the cyclic collector, whose passes over it held the loop 2-130 ms (an
        # exit seen meanwhile waits); what is allocated from here on is collected as ever.
        gc.freeze()
        self.set_phase(Phase.UP)
        self.engine.listeners.append(self._on_unit_change)
        log.info(
            "stack.ready",
            stack=self.stack.name,
            seconds=round(took, 3),
            units=len(self.engine.units),
        )
        await shutdown
        return 0

    async def _teardown(self) -> list[int]:
        assert self._down_result is not None
        if self._shutdown.is_set() and self.guardian is not None:
            with contextlib.suppress(StateWriteError):  # a later sweep: "died during `down`"
                self._write_run(self.guardian.pid)
        if self.phase is not Phase.FAILED:
            self.set_phase(Phase.STOPPING)
        started = time.monotonic()
        survivors: list[int] = []
        if self.engine is not None:
            survivors = await self.engine.stop()
        guardian = self.guardian.pid if self.guardian else None
        swept = await process.sweep(
            self.run_id,
            cgroup=self.containment.root if self.containment else None,
            reaper=self.engine.host.reaper if self.engine else None,
            keep=frozenset({guardian} if guardian else set()),
        )
        survivors = sorted(set(survivors) | set(swept.survivors))
        if self.units_host is not None:
            for path in self.units_host.enforcer.remove_all():  # v1 cgroups of `limits`
                log.error("limits.cgroup_left", path=str(path))
        # Every unit's private TMPDIR (engines' socket files, per-start JSON files) goes
        # with its processes: `down` leaves no file behind outside the state dir.
        left_files = unittmp.remove_all(self.state.path)
        killed = dict(self.engine.killed) if self.engine else {}
        if swept.killed:
            killed["(final sweep)"] = swept.killed
        result = {
            "run_id": self.run_id,
            "daemon_pid": os.getpid(),
            "stack": self.stack.name,
            "ok": not survivors,
            "seconds": round(time.monotonic() - started, 3),
            "killed": killed,  # who needed SIGKILL / cgroup.kill: unit -> pids
            "survivors": survivors,  # what could not be killed
            "temp_files_removed": left_files,  # units whose private TMPDIR held files
            "containment": self.containment.describe() if self.containment else None,
            "units": self.unit_rows(),
            "error": self.error,
        }
        try:
            self.state.write_json("last-down.json", result)
        except StateWriteError as exc:  # `down` still answers, and says what it could not keep
            result["warning"] = str(exc)
            log.error("state.write_failed", error=str(exc))
        runrecord.mark_ended(self.state.path, "down")
        log.info("stack.down", seconds=result["seconds"], killed=killed, survivors=survivors)
        if not self._down_result.done():
            self._down_result.set_result(result)
        await asyncio.sleep(0.05)  # let a waiting /down request get its answer out
        return survivors
