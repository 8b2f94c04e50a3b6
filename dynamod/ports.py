"""Loopback port allocation and in-use checks."""

from __future__ import annotations

import socket


class PortAllocator:
    """Hands out free loopback ports, never the same one twice in one stack."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.given: set[int] = set()

    def __call__(self) -> int:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((self.host, 0))
                port = int(sock.getsockname()[1])
            if port not in self.given:
                self.given.add(port)
                return port
        raise OSError("could not find a free loopback port after 100 tries")


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
