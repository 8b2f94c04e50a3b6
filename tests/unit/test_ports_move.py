"""Moving a taken allocated port before a spawn (portmove): the stack is re-rendered with
the new number in every unit that references it, every other port kept; fixed ports stay."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

from dynamod.core import portmove
from dynamod.core.spec import Stack, load

STACK = """
[units.db]
command = ["db", "--port", "{ports.client}", "--peer", "{ports.peer}"]
ports = { client = 0, peer = 0 }

[units.app]
command = ["app", "--db", "127.0.0.1:{units.db.ports.client}", "--http", "{ports.http}"]
ports = { http = 0 }
depends_on = { db = "started" }

[units.fixed]
command = ["fixed", "{ports.admin}"]
ports = { admin = 20999 }
"""


def _stack(tmp_path: Path) -> Stack:
    path = tmp_path / "s.toml"
    path.write_text(STACK)
    counter = itertools.count(21000)
    return load(path, state_dir=tmp_path / "state", allocate_port=lambda: next(counter))


def test_a_moved_port_is_re_rendered_where_it_is_referenced(tmp_path: Path) -> None:
    stack = _stack(tmp_path)
    assert stack.units["db"].ports == {"client": 21000, "peer": 21001}
    moved = portmove.move(stack, "db", {"client"}, allocate_port=lambda: 22000)
    assert moved is not None
    assert moved.ports == {"client": (21000, 22000)}
    assert moved.stack.units["db"].ports == {"client": 22000, "peer": 21001}
    assert moved.stack.units["db"].command == ["db", "--port", "22000", "--peer", "21001"]
    assert moved.stack.units["app"].command == ["app", "--db", "127.0.0.1:22000", "--http", "21002"]
    assert moved.referencing == ["app"]  # `fixed` does not reference it: untouched
    assert moved.stack.units["fixed"] == stack.units["fixed"]


def test_a_fixed_port_is_never_moved(tmp_path: Path) -> None:
    stack = _stack(tmp_path)
    assert portmove.move(stack, "fixed", {"admin"}, allocate_port=lambda: 22000) is None


def test_taken_names_the_ports_something_listens_on(tmp_path: Path) -> None:
    stack = _stack(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        moved = portmove.move(stack, "app", {"http"}, allocate_port=lambda: port)
        assert moved is not None
        assert portmove.taken(moved.stack, "app") == {"http": port}
