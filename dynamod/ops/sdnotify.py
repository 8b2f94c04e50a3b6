"""sd_notify(3) over the datagram socket systemd names in NOTIFY_SOCKET.

`notify()` sends one message. `SystemdNotifier` is the daemon extension that tells systemd
how the stack is doing:

  READY=1      once the whole stack is ready (phase `up`), not when the daemon starts
  STATUS=...   one line per burst of unit state changes ("2/3 units ready; nats backoff")
  WATCHDOG=1   every WATCHDOG_USEC/2 from a task on the daemon's own event loop, so a
               wedged loop stops petting; a unit lifecycle task that died with an
               exception (the engine no longer supervises that unit) stops it too
  STOPPING=1   when teardown begins (phase stopping, or failed bring-up)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import structlog

from dynamod.core.extensions import Extension
from dynamod.core.phase import Phase
from dynamod.core.state import UnitState

if TYPE_CHECKING:
    from dynamod.core.engine import Engine, Unit
    from dynamod.core.extensions import ExtensionHost

log = structlog.get_logger("dynamod.ops.sdnotify")

_STATUS_MAX_UNITS = 4  # not-ready units named in STATUS; the rest are counted
_DONE = {UnitState.READY, UnitState.COMPLETED}


def notify(message: str, socket_path: str | None = None) -> bool:
    """Send one notification; False (and nothing sent) when not run under systemd."""
    path = socket_path if socket_path is not None else os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(message.encode(), address)
        except OSError:
            return False
    return True


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when systemd
    expects none from this process (unset, unparsable, or WATCHDOG_PID is another pid)."""
    owner = environ.get("WATCHDOG_PID")
    if owner and owner != str(pid):
        return None
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2 / 1_000_000 if usec > 0 else None


def status_line(
    stack: str,
    phase: Phase,
    units: Iterable[tuple[str, UnitState]],
    why: Mapping[str, str] | None = None,
) -> str:
    """One line for STATUS=: how many units are ready and what the others are doing (and,
    given `why`, the reason each is not ready)."""
    units = list(units)
    ready = sum(1 for _, state in units if state in _DONE)
    line = f"{ready}/{len(units)} units ready"
    reasons = why or {}
    others = [
        f"{name} {state}" + (f" ({_short(reasons[name])})" if reasons.get(name) else "")
        for name, state in units
        if state not in _DONE
    ]
    if others:
        shown = others[:_STATUS_MAX_UNITS]
        more = len(others) - len(shown)
        line += "; " + ", ".join(shown) + (f" (+{more} more)" if more else "")
    return line if phase is Phase.UP else f"stack {stack} {phase}: {line}"


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def engine_fault(engine: Engine) -> str | None:
    """Why the engine is not making progress, or None. A lifecycle task that ended with
    an exception leaves its unit unsupervised; the daemon must be restarted."""
    for unit in engine.units.values():
        task = unit.task
        if task is None or not task.done() or task.cancelled():
            continue
        exc = task.exception()
        if exc is not None:
            return f"lifecycle task of {unit.name} died: {exc!r}"
    return None


class SystemdNotifier(Extension):
    """Daemon extension: READY, STATUS, WATCHDOG and STOPPING for systemd (Type=notify)."""

    def __init__(
        self, socket_path: str, *, watchdog_interval: float | None, coalesce: float = 0.2
    ) -> None:
        self.socket_path = socket_path
        self.watchdog_interval = watchdog_interval
        self.coalesce = coalesce
        self.host: ExtensionHost | None = None
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_status = ""
        self._stopping_sent = False

    @classmethod
    def from_environment(cls) -> SystemdNotifier | None:
        path = os.environ.get("NOTIFY_SOCKET")
        if not path:
            return None
        return cls(path, watchdog_interval=watchdog_interval(os.environ, os.getpid()))

    # ---------------------------------------------------------------- Extension

    async def start(self, host: ExtensionHost) -> None:
        assert host.engine is not None
        self.host = host
        host.on_phase.append(self._on_phase)
        host.engine.listeners.append(self._on_unit_change)
        self._send_status(force=True)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._status_loop(), name="sdnotify:status"))
        if self.watchdog_interval is not None:
            self._tasks.append(loop.create_task(self._watchdog_loop(), name="sdnotify:watchdog"))
        log.info(
            "sdnotify.start", socket=self.socket_path, watchdog_interval=self.watchdog_interval
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._send("STATUS=stopped")

    # ---------------------------------------------------------------- events

    def _on_phase(self, phase: Phase) -> None:
        if phase is Phase.UP:
            self._send(f"READY=1\nSTATUS={self._status_now()}")
        elif phase in {Phase.STOPPING, Phase.FAILED} and not self._stopping_sent:
            self._stopping_sent = True
            self._send(f"STOPPING=1\nSTATUS={self._status_now()}")
        elif phase is Phase.DEGRADED:
            self._send_status(force=True)

    def _on_unit_change(self, unit: Unit, old: UnitState, new: UnitState) -> None:
        self._dirty.set()

    async def _status_loop(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.coalesce)  # one message per burst of transitions
            self._dirty.clear()
            self._send_status()

    async def _watchdog_loop(self) -> None:
        assert self.watchdog_interval is not None and self.host is not None
        engine = self.host.engine
        assert engine is not None
        withheld = False
        while True:
            fault = engine_fault(engine)
            if fault is None:
                self._send("WATCHDOG=1")
            elif not withheld:  # systemd will kill and restart us; say why, once
                log.error("sdnotify.watchdog_withheld", reason=fault)
            withheld = fault is not None
            await asyncio.sleep(self.watchdog_interval)

    # ---------------------------------------------------------------- sending

    def _status_now(self) -> str:
        """The current STATUS line (remembered, so an unchanged one is not sent again)."""
        host = self.host
        assert host is not None and host.engine is not None
        units = [(u.name, u.state) for u in host.engine.units.values()]
        why = {name: reason.split(": ", 1)[-1] for name, reason in host.degraded_units().items()}
        self._last_status = status_line(host.stack.name, host.phase, units, why)
        return self._last_status

    def _send_status(self, *, force: bool = False) -> None:
        previous = self._last_status
        line = self._status_now()
        if force or line != previous:
            self._send(f"STATUS={line}")

    def _send(self, message: str) -> None:
        if not notify(message, self.socket_path):
            log.warning("sdnotify.send_failed", socket=self.socket_path, message=message)
