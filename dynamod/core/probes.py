"""Readiness and liveness probes. One small class per kind, one `check()` each.

A probe answer always says what was expected and what was seen, so a failed start can
be explained without opening another terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from dynamod.core import process
from dynamod.core.errors import DynamodError
from dynamod.core.logs import OutputSink
from dynamod.core.spec import (
    ExecProbe,
    HttpProbe,
    LogProbe,
    Probe,
    TcpProbe,
)


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str
    latency: float = 0.0


class Prober(Protocol):
    async def check(self) -> ProbeResult: ...

    def close(self) -> None: ...


@dataclass
class ProbeContext:
    """What probes may use: one HTTP session, the reaper (exec), the unit's output (log)."""

    session: aiohttp.ClientSession
    reaper: process.Reaper
    sink: OutputSink
    env: Mapping[str, str]


def json_matches(expected: Any, actual: Any) -> bool:
    """Every key in `expected` is in `actual` with a matching value; lists match exactly."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            key in actual and json_matches(value, actual[key]) for key, value in expected.items()
        )
    return bool(expected == actual)


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def timed(spec: Probe, attempt: Any) -> ProbeResult:
    start = time.monotonic()
    try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a stop's cancel
        async with asyncio.timeout(spec.timeout):
            ok, detail = await attempt
    except TimeoutError:
        ok, detail = False, f"no answer within {spec.timeout:g}s"
    return ProbeResult(ok, detail, time.monotonic() - start)


class TcpProber:
    def __init__(self, spec: TcpProbe) -> None:
        self.spec = spec

    async def check(self) -> ProbeResult:
        return await timed(self.spec, self._attempt())

    async def _attempt(self) -> tuple[bool, str]:
        target = f"{self.spec.host}:{self.spec.port}"
        try:
            _, writer = await asyncio.open_connection(self.spec.host, self.spec.port)
        except OSError as exc:
            return False, f"tcp {target}: {exc.strerror or exc}"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True, f"tcp {target} accepts connections"

    def close(self) -> None:
        pass


class HttpProber:
    def __init__(self, spec: HttpProbe, session: aiohttp.ClientSession) -> None:
        self.spec = spec
        self.session = session

    async def check(self) -> ProbeResult:
        return await timed(self.spec, self._attempt())

    async def _attempt(self) -> tuple[bool, str]:
        spec = self.spec
        what = f"{spec.method} {spec.url}"
        try:
            # per request: the daemon's shared session has its own (shorter) total timeout
            timeout = aiohttp.ClientTimeout(total=spec.timeout)
            async with self.session.request(spec.method, spec.url, timeout=timeout) as resp:
                body = await resp.text()
                status = resp.status
        except aiohttp.ClientConnectorError as exc:
            return False, f"{what}: cannot connect ({exc.os_error.strerror or exc.os_error})"
        except aiohttp.ClientError as exc:
            return False, f"{what}: {exc.__class__.__name__}: {_short(str(exc))}"
        if status != spec.expect_status:
            return (
                False,
                f"{what}: expected status {spec.expect_status}, got {status}: {_short(body)}",
            )
        if spec.expect_json is None:
            return True, f"{what}: {status}"
        try:
            payload = json.loads(body)
        except ValueError:
            return False, f"{what}: expected JSON matching {spec.expect_json}, got {_short(body)}"
        if not json_matches(spec.expect_json, payload):
            return False, (
                f"{what}: expected JSON matching {json.dumps(spec.expect_json)}, got {_short(body)}"
            )
        return True, f"{what}: {status} {_short(body, 80)}"

    def close(self) -> None:
        pass


class ExecProber:
    def __init__(self, spec: ExecProbe, ctx: ProbeContext) -> None:
        self.spec = spec
        self.ctx = ctx

    async def check(self) -> ProbeResult:
        start = time.monotonic()
        read_fd, write_fd = os.pipe()
        try:
            child = process.spawn(
                self.ctx.reaper, self.spec.command, env=self.ctx.env, stdout_fd=write_fd
            )
        except OSError as exc:
            os.close(read_fd)
            os.close(write_fd)
            return ProbeResult(False, f"exec {self.spec.command[0]}: {exc}", 0.0)
        os.close(write_fd)
        try:
            async with asyncio.timeout(self.spec.timeout):
                result = await asyncio.shield(child.exited)
        except TimeoutError:
            await _end(child, read_fd)
            return ProbeResult(
                False,
                f"exec {self.spec.command[0]}: no exit within {self.spec.timeout:g}s",
                time.monotonic() - start,
            )
        except asyncio.CancelledError:  # the attempt was cut (a deadline): end its process
            await _end(child, read_fd)
            raise
        output = _drain(read_fd)
        detail = f"exec {' '.join(self.spec.command)}: {result.describe()}"
        if output:
            detail += f": {_short(output)}"
        return ProbeResult(result.clean, detail, time.monotonic() - start)

    def close(self) -> None:
        pass


async def _end(child: process.Child, read_fd: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    await asyncio.shield(child.wait())
    os.close(read_fd)


def _drain(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            if sum(map(len, chunks)) > 65536:
                break
    os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace").strip()


class LogProber:
    """Passes once a line matching the pattern appears after this spawn."""

    def __init__(self, spec: LogProbe, sink: OutputSink) -> None:
        self.spec = spec
        self.pattern = re.compile(spec.pattern)
        self.matched: str | None = None
        self._unwatch = sink.watch(self._on_line)

    def _on_line(self, line: str) -> None:
        if self.matched is None and self.pattern.search(line):
            self.matched = line

    async def check(self) -> ProbeResult:
        if self.matched is not None:
            return ProbeResult(
                True, f"log line matched /{self.spec.pattern}/: {_short(self.matched, 120)}"
            )
        return ProbeResult(False, f"no log line matching /{self.spec.pattern}/ yet")

    def close(self) -> None:
        self._unwatch()


# A start is probed at its unit's own `interval` for READY_FAST_S; a start that takes longer
# is probed less often, the pause growing with the wait (READY_SLOW_SHARE of it) up to
# READY_SLOW_MAX_S. At 4 nodes x 32 shards on two cores each daemon probed its starting
# shards every 0.05 s: 640 connection attempts a second. Once the shards yielded the CPU to
# the daemons (their `nice` reaching their sessions), those attempts were a third of the
# head daemon's samples in the start (py-spy), and the daemons' CPU in the start 67-87 s.
READY_FAST_S = 2.0
READY_SLOW_SHARE = 0.05
READY_SLOW_MAX_S = 0.5


def ready_pause(interval: float, waited: float) -> float:
    """The pause before the next readiness attempt of a start that has waited `waited` s:
    the unit's `interval` at first, then up to 5 % of the wait (a start of 10 s is seen
    ready at most 0.5 s late), never shorter than `interval`, never over 0.5 s unless the
    unit asks for that."""
    if waited < READY_FAST_S:
        return interval
    return max(interval, min(READY_SLOW_MAX_S, waited * READY_SLOW_SHARE))


def describe(spec: Probe) -> str:
    """A probe in a few words, for progress lines and deadline messages."""
    if isinstance(spec, TcpProbe):
        return f"tcp {spec.host}:{spec.port}"
    if isinstance(spec, HttpProbe):
        return f"{spec.method} {spec.url}"
    if isinstance(spec, ExecProbe):
        return f"exec {' '.join(spec.command)}"
    if isinstance(spec, LogProbe):
        return f"log /{spec.pattern}/"
    return f"{spec.kind} probe"


class ProbeKindError(DynamodError):
    """A stack names a probe kind whose layer was not loaded (a programming error)."""


ProberFactory = Callable[[Any, ProbeContext], Prober]

# Probe kinds whose checks live in a layer above the core (the Dynamo frontend probe is
# the rollout layer's): that layer registers its factory at start-up.
_REGISTERED: dict[type, ProberFactory] = {}


def register_prober(kind: type, factory: ProberFactory) -> None:
    _REGISTERED[kind] = factory


def make_prober(spec: Probe, ctx: ProbeContext) -> Prober:
    """Build the prober for one spawn (log probes watch output from now on)."""
    if isinstance(spec, TcpProbe):
        return TcpProber(spec)
    if isinstance(spec, HttpProbe):
        return HttpProber(spec, ctx.session)
    if isinstance(spec, ExecProbe):
        return ExecProber(spec, ctx)
    if isinstance(spec, LogProbe):
        return LogProber(spec, ctx.sink)
    factory = _REGISTERED.get(type(spec))
    if factory is None:
        raise ProbeKindError(f"no prober is registered for probe kind {spec.kind!r}")
    return factory(spec, ctx)
