"""The control socket: HTTP/JSON over a unix socket only its owner can use.

The CLI and `dynamod.client` only ever ask the daemon through here; the handlers only
ask the daemon object. Routes:
  GET  /status           stack phase and every unit
  POST /down             tear down; answers once everything is gone
  POST /restart/{unit}   operator restart of one unit
  POST /stop/{unit}      hold a unit (a replica, or every replica of a base name) stopped
  POST /start/{unit}     start units held stopped again
  POST /apply            {"path" | "scale", "vars", "dry_run"}: the diff to a new stack
                         definition, applied unless a dry run (an invalid one: 422)
Extensions add their own routes (the rollout layer's /policy family).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from dynamod.core.errors import DynamodError, SpecError, SpecErrors, UnknownUnit

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Controlled(Protocol):
    def status(self) -> dict[str, Any]: ...

    async def down(self) -> dict[str, Any]: ...

    async def restart(self, unit: str) -> dict[str, Any]: ...

    async def operator(self, action: str, name: str) -> dict[str, Any]: ...

    async def apply(self, body: object) -> dict[str, Any]: ...


def _peer(request: web.Request) -> tuple[int, int] | None:
    """The pid and uid of the process at the other end of the request's socket, as the
    kernel recorded them at connect (SO_PEERCRED): not something the caller says."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def _peer_uid(request: web.Request) -> int | None:
    peer = _peer(request)
    return None if peer is None else peer[1]


def peer_pid(request: web.Request) -> int | None:
    """The calling process's pid (None where the socket has none, or the caller is in a
    pid namespace this daemon cannot see: the kernel then says 0)."""
    peer = _peer(request)
    return peer[0] if peer is not None and peer[0] > 0 else None


@web.middleware
async def _owner_only(request: web.Request, handler: Handler) -> web.StreamResponse:
    uid = _peer_uid(request)
    if uid is not None and uid != os.getuid():
        return web.json_response(
            {"error": "only the daemon's owner may use this socket"}, status=403
        )
    try:
        return await handler(request)
    except DynamodError as exc:
        status = (
            404 if isinstance(exc, UnknownUnit)
            else 422 if isinstance(exc, SpecError | SpecErrors)
            else 400
        )  # fmt: skip
        return web.json_response({"error": str(exc)}, status=status)


def build_app(daemon: Controlled) -> web.Application:
    app = web.Application(middlewares=[_owner_only])

    async def status(_: web.Request) -> web.Response:
        return web.json_response(daemon.status())

    async def down(_: web.Request) -> web.Response:
        return web.json_response(await daemon.down())

    async def restart(request: web.Request) -> web.Response:
        return web.json_response(await daemon.restart(request.match_info["unit"]))

    async def stop(request: web.Request) -> web.Response:
        return web.json_response(await daemon.operator("stop", request.match_info["unit"]))

    async def start(request: web.Request) -> web.Response:
        return web.json_response(await daemon.operator("start", request.match_info["unit"]))

    async def apply(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            raise DynamodError("expected a JSON body") from None
        return web.json_response(await daemon.apply(body))

    app.router.add_get("/status", status)
    app.router.add_post("/apply", apply)
    app.router.add_post("/down", down)
    app.router.add_post("/restart/{unit}", restart)
    app.router.add_post("/stop/{unit}", stop)
    app.router.add_post("/start/{unit}", start)
    return app


async def serve(app: web.Application, path: Path) -> web.AppRunner:
    """Listen on `path` with mode 0600 (the state dir itself is 0700)."""
    path.unlink(missing_ok=True)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    old_umask = os.umask(0o177)
    try:
        site = web.UnixSite(runner, str(path))
        await site.start()
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    return runner
