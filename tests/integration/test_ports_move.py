"""A port found taken by another process when a unit spawns is allocated again: a worker's
system port is taken by a foreign listener between the worker's death and its restart; the
restart moves to a new port (status shows it) and the worker serves there."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import ROOT, Dynamod, unit_by_name
from tests.integration.test_local_stack import complete, frontend_url

pytestmark = pytest.mark.slow

RESTART_DELAY_S = 3  # room to take the port between the death and the restart


def stack(tmp_path: Path) -> Path:
    units = ROOT / "units"
    worker = (units / "worker-cpu.toml").read_text().replace(
        "[units.worker.restart]\n", f"[units.worker.restart]\nfirst_delay = {RESTART_DELAY_S}\n"
    )
    assert f"first_delay = {RESTART_DELAY_S}" in worker
    (tmp_path / "worker-cpu.toml").write_text(worker)
    path = tmp_path / "ports.toml"
    path.write_text(f"""
[stack]
name = "ports"
include = ["{units}/etcd.toml", "{units}/nats.toml", "{tmp_path}/worker-cpu.toml",
           "{units}/frontend.toml"]
[vars]
workers = 2
""")
    return path


def test_a_port_taken_before_a_restart_is_allocated_again(dm: Dynamod, tmp_path: Path) -> None:
    dm.run("up", str(stack(tmp_path)), "--detach", timeout=300, check=True)
    first = dm.status()
    before = unit_by_name(first, "worker@0")
    port = before["ports"]["system"]
    os.kill(before["pid"], signal.SIGKILL)
    dm.wait_for(lambda s: unit_by_name(s, "worker@0")["state"] == "backoff", timeout=10,
                what="worker@0 in backoff")
    foreign = socket.socket()
    foreign.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    foreign.bind(("127.0.0.1", port))
    foreign.listen()
    try:
        after = dm.wait_ready_again("worker@0", before["pid"], timeout=90)
        moved = after["ports"]["system"]
        assert moved != port, after
        assert f"port system {port} taken by pid {os.getpid()}" in dm.daemon_log()
        assert f"moved to {moved}" in dm.daemon_log()
        with urllib.request.urlopen(f"http://127.0.0.1:{moved}/health", timeout=5) as resp:
            assert resp.status == 200
        # it serves through the frontend, at its new address
        instance = after["dynamo"]["instance_ids"][0]
        status = dm.status()

        async def served() -> tuple[int, object]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                deadline = time.monotonic() + 30
                while True:
                    code, body = await complete(s, frontend_url(status), "moved",
                                                backend_instance_id=instance,
                                                extra_fields=["worker_id"])
                    if code == 200 or time.monotonic() > deadline:
                        return code, body
                    await asyncio.sleep(0.5)

        code, body = asyncio.run(served())
        assert code == 200, body
        assert isinstance(body, dict)
        assert body["nvext"]["worker_id"]["decode_worker_id"] == instance
        # the other units kept their ports
        for name in ("etcd", "nats", "worker@1", "frontend"):
            assert unit_by_name(status, name)["ports"] == unit_by_name(first, name)["ports"]
    finally:
        foreign.close()
