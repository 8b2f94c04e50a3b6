"""An HTTP listener the daemon keeps for its lifetime (metrics, the status page): bound
when it is made, so a taken port fails `dynamod up` before anything starts, and served by
aiohttp on the daemon's own loop, so handlers read the engine from the loop's thread."""

from __future__ import annotations

import os
import socket

from aiohttp import web

from dynamod.core.errors import DaemonError


class Site:
    def __init__(self, host: str, port: int, *, what: str, option: str) -> None:
        """Bind `host:port` now; DaemonError naming `what` and the `option` to change."""
        try:
            self.sock = socket.create_server(
                (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
            )
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise DaemonError(
                f"cannot serve {what} on {host}:{port}: {reason} "
                f"(is another process listening there? pick another {option})"
            ) from None
        bound = self.sock.getsockname()[1]
        self.base_url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        self._runner: web.AppRunner | None = None

    async def start(self, app: web.Application) -> None:
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, self.sock).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.sock.close()
