"""The status page (opt-in: `dynamod up --web 127.0.0.1:PORT`): one self-contained HTML
page served by the daemon, showing the unit tree with states, pids, restarts and policy
versions per shard (the rows `dynamod status --json` gives), the last events of
`dynamod events`, and the chaos runs kept in the state dir's `chaos-runs/`. The page polls
`api/status` twice a second, so it follows the stack by itself and, left open while the
daemon is restarted, shows the new daemon once one answers on the same address.

Beyond loopback it is served only with a token (`--web-token FILE`), checked on every
request (`Authorization: Bearer TOKEN` or `?token=TOKEN`); on loopback without one, only
requests naming a loopback host are answered, so a web page elsewhere cannot reach it
through a DNS name it points at 127.0.0.1. Nothing the page uses is fetched from outside.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from dynamod.core import events
from dynamod.core.errors import DynamodError
from dynamod.core.events import describe
from dynamod.core.extensions import Extension
from dynamod.ops.httpsite import Site
from dynamod.ops.statuspage_html import PAGE

if TYPE_CHECKING:
    from dynamod.core.extensions import ExtensionHost

log = structlog.get_logger("dynamod.ops.statuspage")

EVENTS_SHOWN = 50
CHAOS_DIR = "chaos-runs"  # in the state dir: `dynamod chaos run --report STATE_DIR/chaos-runs`
CHAOS_FILES = {"timeline.png": "image/png", "journal.json": "application/json"}
MIN_TOKEN_CHARS = 16
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    # the page is one file: nothing may load from anywhere else
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'",
}

ChaosRuns = Callable[[Path], list[tuple[Path, dict[str, Any]]]]


class WebAddressError(DynamodError):
    pass


@dataclass(frozen=True)
class WebSettings:
    """Where the page is served and the token it asks for (None: loopback only)."""

    host: str
    port: int
    token: str | None = None


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` or `[::1]:PORT`, HOST an IP address or `localhost`, PORT 1-65535 (a
    fixed port: the open page finds a restarted daemon there). Raises WebAddressError."""
    host, sep, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_text.isascii() or not port_text.isdigit():
        raise WebAddressError(f"expects HOST:PORT (e.g. 127.0.0.1:8470), got {text!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise WebAddressError(f"expects a port from 1 to 65535, got {text!r}")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise WebAddressError(
                f"expects an IP address or localhost before the port, got {host!r}"
            ) from None
    return host, port


def is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def read_token(path: Path) -> str:
    """The token in FILE (its first line, stripped). Raises WebAddressError."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise WebAddressError(f"{path}: cannot read the token file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise WebAddressError(f"{path}: the token file is not text") from None
    token = text.strip().split("\n", 1)[0].strip()
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or " " in token:
        raise WebAddressError(
            f"{path}: expects a token of at least {MIN_TOKEN_CHARS} printable characters "
            "on its first line (e.g. from `openssl rand -hex 16`)"
        )
    return token


def settings(address: str, token_file: Path | None) -> WebSettings:
    """`--web ADDR [--web-token FILE]` checked: beyond loopback only with a token."""
    host, port = parse_address(address)
    token = read_token(token_file) if token_file is not None else None
    if token is None and not is_loopback(host):
        raise WebAddressError(
            f"{address} is not a loopback address; the status page is served beyond "
            "loopback only with --web-token FILE (a token checked on every request)"
        )
    return WebSettings(host, port, token)


def allowed(request_host: str | None, token: str | None, given: str | None) -> bool:
    """Whether a request may see the page: with a token, it carries it; without one, it
    names a loopback host (a DNS name pointed at 127.0.0.1 is not one)."""
    if token is not None:
        return given is not None and hmac.compare_digest(given.encode(), token.encode())
    try:
        return is_loopback(_host_name(request_host or ""))
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a Host header: `127.0.0.1:8470` -> 127.0.0.1, `[::1]:8470` -> ::1."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def folder_stamp(folder: Path) -> tuple[tuple[str, int], ...]:
    """Each run folder's name and change time: a new run, or a journal written into its
    folder, changes it (the page asks every 0.5 s; journals are read again only then)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return ()
    return tuple(sorted((e.name, e.stat().st_mtime_ns) for e in entries if e.is_dir()))


def chaos_listing(folder: Path, list_runs: ChaosRuns) -> list[dict[str, Any]]:
    """The chaos runs kept under `folder`, newest first: what the page links to."""
    if not folder.is_dir():
        return []
    out = []
    for run_dir, journal in list_runs(folder):
        experiment = journal.get("experiment")
        out.append({
            "run": run_dir.name,
            "name": str(experiment.get("name", run_dir.name))
            if isinstance(experiment, dict) else run_dir.name,
            "start": str(journal.get("start", "")),
            "verdict": str(journal.get("verdict", "")),
            "passed": bool(journal.get("passed")),
            "timeline": (run_dir / "timeline.png").is_file(),
        })  # fmt: skip
    return out


class StatusPage(Extension):
    """Daemon extension: serves the page and its JSON for the daemon's lifetime. The
    address is bound when it is made, so a taken port fails `up` before anything starts."""

    def __init__(self, web_settings: WebSettings, list_runs: ChaosRuns) -> None:
        self.settings = web_settings
        self.list_runs = list_runs
        self.site = Site(web_settings.host, web_settings.port, what="the status page",
                         option="--web address")  # fmt: skip
        self.url = f"{self.site.base_url}/"
        self._host: ExtensionHost | None = None
        self._chaos: tuple[tuple[tuple[str, int], ...], list[dict[str, Any]]] | None = None

    def status(self) -> dict[str, Any]:
        return {"web": {"url": self.url, "token": self.settings.token is not None}}

    async def start(self, host: ExtensionHost) -> None:
        self._host = host
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._page)
        app.router.add_get("/api/status", self._api)
        app.router.add_get("/chaos/{run}/{name}", self._chaos_file)
        await self.site.start(app)
        log.info("statuspage.serving", url=self.url)

    async def stop(self) -> None:
        await self.site.stop()

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        given = request.query.get("token")
        bearer = request.headers.get("Authorization", "")
        if bearer.startswith("Bearer "):
            given = bearer[len("Bearer "):]
        if not allowed(request.headers.get("Host"), self.settings.token, given):
            why = "a valid token" if self.settings.token else "a loopback Host"
            return web.Response(status=403, text=f"forbidden: this page needs {why}\n",
                                headers=_HEADERS)  # fmt: skip
        response: web.StreamResponse = await handler(request)
        response.headers.update(_HEADERS)
        return response

    async def _page(self, _: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html", charset="utf-8")

    async def _api(self, _: web.Request) -> web.Response:
        assert self._host is not None
        state_dir = self._host.state_dir
        recent = [
            {"time": e["time"], "unit": e.get("unit"), "kind": e["kind"], "text": describe(e)}
            for e in events.tail(state_dir, EVENTS_SHOWN)
        ]
        return web.json_response({
            "status": self._host.status(),
            "events": recent,
            "chaos": self._chaos_runs(state_dir / CHAOS_DIR),
        }, dumps=_dumps)  # fmt: skip

    def _chaos_runs(self, folder: Path) -> list[dict[str, Any]]:
        stamp = folder_stamp(folder)
        if self._chaos is None or self._chaos[0] != stamp:
            self._chaos = (stamp, chaos_listing(folder, self.list_runs))
        return self._chaos[1]

    async def _chaos_file(self, request: web.Request) -> web.StreamResponse:
        assert self._host is not None
        run, name = request.match_info["run"], request.match_info["name"]
        if name not in CHAOS_FILES or not _RUN_NAME.match(run) or ".." in run:
            raise web.HTTPNotFound()
        path = self._host.state_dir / CHAOS_DIR / run / name
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.Response(body=path.read_bytes(), content_type=CHAOS_FILES[name])


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str)
