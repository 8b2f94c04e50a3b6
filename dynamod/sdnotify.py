"""sd_notify(3) over the datagram socket systemd names in NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket


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
