"""Which etcd members a client may talk to: parsing `ETCD_ENDPOINTS`-style input into endpoints,
and the order in which a client fails over between them. Pure logic, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from dynamod.core.errors import DynamodError

DEFAULT_PORT = 2379


class EndpointError(DynamodError, ValueError):
    """An endpoint string that names no usable host and port. Still a ValueError: callers
    that check a list of endpoints catch it as bad input."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # normalised: scheme://host:port
    host: str
    port: int
    tls: bool  # the URL said https

    @property
    def address(self) -> str:
        """host:port, as people write it in messages."""
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    raw = text.strip().rstrip("/")
    if "://" not in raw:
        raw = f"http://{raw}"
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https"):
        raise EndpointError(f"etcd endpoint {text!r}: scheme must be http or https")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise EndpointError(f"etcd endpoint {text!r}: the port is not a number") from None
    if not parts.hostname:
        raise EndpointError(f"etcd endpoint {text!r}: no host")
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    return Endpoint(f"{parts.scheme}://{shown}:{port}", shown, port, parts.scheme == "https")


def parse_endpoints(endpoints: str | Sequence[str]) -> list[Endpoint]:
    """One endpoint, a comma-separated list (as ETCD_ENDPOINTS holds), or a list of them."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = [parse_endpoint(item) for item in items if item.strip()]
    if not parsed:
        raise EndpointError(f"no etcd endpoint in {endpoints!r}")
    return parsed


class Rotation:
    """The endpoint in use, and the order to try the others when it fails.

    A call starts at the endpoint in use; each failure moves "in use" to the next one, so the
    next call starts where the last one succeeded or gave up.
    """

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self.endpoints = list(endpoints)
        self._current = 0

    @property
    def current(self) -> Endpoint:
        return self.endpoints[self._current]

    def advance(self, failed: Endpoint) -> None:
        """`failed` did not answer: use the next endpoint (unless another call already moved on)."""
        if self.current == failed:
            self._current = (self._current + 1) % len(self.endpoints)

    def attempt_order(self) -> list[Endpoint]:
        """Every endpoint once, starting with the one in use."""
        n = len(self.endpoints)
        return [self.endpoints[(self._current + i) % n] for i in range(n)]
