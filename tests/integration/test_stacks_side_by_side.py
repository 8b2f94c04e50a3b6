"""Stacks side by side on one machine: allocated ports never collide across daemons, and a
probe answered by a process that is not the unit's says whose answer it was."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PROC, Dynamod, unit_by_name

pytestmark = pytest.mark.slow

# The test is twenty rounds (`make soak-side-by-side`, DYNAMOD_SIDE_BY_SIDE_ROUNDS=20);
# CI runs the quick profile, 3 rounds (each round is 5 daemons + 5 CLIs starting at once).
ROUNDS = int(os.environ.get("DYNAMOD_SIDE_BY_SIDE_ROUNDS", "3"))
READY = ('ready = { kind = "http", url = "http://127.0.0.1:{ports.http}/health", '
         'interval = 0.05, deadline = 20 }')
STACK = f"""
[units.a]
command = ["{{python}}", "{PROC}", "serve", "{{ports.http}}"]
ports = {{ http = 0, spare = 0 }}
{READY}
"""


def test_a_probe_answered_by_another_process_names_it(dm: Dynamod, tmp_path: Path) -> None:
    stack = tmp_path / "s.toml"
    stack.write_text(f"""
[units.quiet]
command = ["{{python}}", "{PROC}", "sleep"]
ports = {{ http = 0 }}
ready = {{ kind = "http", url = "http://127.0.0.1:{{ports.http}}/health", deadline = 6 }}
restart = {{ policy = "never" }}
""")
    up = subprocess.Popen([sys.executable, "-m", "dynamod", "--state-dir", str(dm.state_dir),
                           "up", str(stack), "--detach"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    port = dm.wait_for(lambda s: unit_by_name(s, "quiet")["ports"]["http"], timeout=20,
                       what="quiet spawned")

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    impostor = http.server.HTTPServer(("127.0.0.1", port), Answer)
    thread = threading.Thread(target=impostor.serve_forever, daemon=True)
    thread.start()
    try:
        _out, err = up.communicate(timeout=60)
    finally:
        impostor.shutdown()
        impostor.server_close()
    assert up.returncode == 1
    assert f"port http={port} is answered by pid " in err, err
    assert "not by quiet's processes" in err


def _up_many(dirs: list[Path], stack: Path) -> None:
    ups = [subprocess.Popen([sys.executable, "-m", "dynamod", "--state-dir", str(d), "up",
                             str(stack), "--detach"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for d in dirs]
    for up in ups:
        out, err = up.communicate(timeout=120)
        assert up.returncode == 0, out + err


def _down_many(dirs: list[Path]) -> None:
    downs = [subprocess.Popen([sys.executable, "-m", "dynamod", "--state-dir", str(d), "down"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for d in dirs]
    for down in downs:
        down.wait(timeout=120)


def test_five_stacks_at_once_round_after_round_share_no_port(tmp_path: Path) -> None:
    stack = tmp_path / "stack.toml"
    stack.write_text(STACK)
    assert ROUNDS >= 1
    for round_ in range(ROUNDS):
        dirs = [Path(tempfile.mkdtemp(prefix=f"dm-{round_}-{i}-", dir="/tmp")) for i in range(5)]
        try:
            _up_many(dirs, stack)
            owners: dict[int, str] = {}
            for d in dirs:
                status: dict[str, Any] = Dynamod(d).status()
                for unit in status["units"]:
                    for port in unit["ports"].values():
                        where = f"{d.name}/{unit['name']}"
                        assert port not in owners, f"port {port}: {owners[port]} and {where}"
                        owners[port] = where
                    # the answer on the unit's port is the unit's own process
                    url = f"http://127.0.0.1:{unit['ports']['http']}/health"
                    with urllib.request.urlopen(url, timeout=5) as resp:
                        assert json.loads(resp.read())["pid"] == unit["pid"], (round_, unit)
            assert len(owners) == 5 * 2
        finally:
            _down_many(dirs)
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
