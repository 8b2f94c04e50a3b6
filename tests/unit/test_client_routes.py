"""The control client over a real Unix socket: a route the daemon does not serve (aiohttp's
plain-text 404, as for /policy on a stack without a [policy] table) is named as such, not
reported as "non-JSON"."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from dynamod.client.control import Client
from dynamod.core.errors import DaemonError
from dynamod.core.paths import socket_path


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/status":
            body, status, kind = b'{"stack": "s"}', 200, "application/json"
        elif self.path == "/broken":
            body, status, kind = b"<html>oops</html>", 200, "text/html"
        else:
            body, status, kind = b"404: Not Found", 404, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:  # a Unix socket has no (host, port)
        return "unix"

    def log_message(self, *args: object) -> None:
        pass


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    server = _Server(str(socket_path(tmp_path)), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Client(tmp_path, timeout=5)
    finally:
        server.shutdown()
        server.server_close()


def test_a_served_route_answers(client: Client) -> None:
    assert client.status() == {"stack": "s"}


def test_policy_on_a_stack_without_policy_names_the_missing_table(client: Client) -> None:
    with pytest.raises(DaemonError) as caught:
        client.request("GET", "/policy")
    message = str(caught.value)
    assert "does not serve /policy" in message and "[policy] table" in message
    assert "non-JSON" not in message


def test_an_unknown_route_is_named(client: Client) -> None:
    with pytest.raises(DaemonError, match=r"does not serve /nope"):
        client.request("GET", "/nope")


def test_a_non_json_answer_that_is_not_a_404_is_still_reported_as_such(client: Client) -> None:
    with pytest.raises(DaemonError, match="non-JSON"):
        client.request("GET", "/broken")
