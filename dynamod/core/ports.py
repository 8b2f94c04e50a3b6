"""Loopback port allocation and in-use checks."""

from __future__ import annotations

import random
import socket


class PortAllocator:
    """Hands out free loopback ports, never the same one twice in one stack.

    Ports come from below the kernel's ephemeral range (which starts at 32768 here):
    Dynamo refuses a DYN_SYSTEM_PORT above 32767, and a port from the ephemeral range can
    be taken by any outgoing connection between allocation and the unit's bind.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        low: int = 20000,
        high: int = 32767,
        rng: random.Random | None = None,
    ) -> None:
        self.host = host
        self.low, self.high = low, high
        self.rng = rng or random.Random()
        self.given: set[int] = set()

    def __call__(self) -> int:
        for _ in range(500):
            port = self.rng.randint(self.low, self.high)
            if port in self.given or in_use(port, self.host):
                continue
            self.given.add(port)
            return port
        raise OSError(f"no free loopback port in {self.low}-{self.high} after 500 tries")


def in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if something listens on host:port (binding it fails the way a server's would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def listening(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    """True if a TCP connect to host:port succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
