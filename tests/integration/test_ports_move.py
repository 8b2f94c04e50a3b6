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


def take(port: int) -> socket.socket:
    """A foreign listener on `port` (this test's own process)."""
    foreign = socket.socket()
    foreign.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    foreign.bind(("127.0.0.1", port))
    foreign.listen()
    return foreign


def test_a_port_taken_before_a_restart_is_allocated_again(dm: Dynamod, tmp_path: Path) -> None:
    dm.run("up", str(stack(tmp_path)), "--detach", timeout=300, check=True)
    first = dm.status()
    before = unit_by_name(first, "worker@0")
    port = before["ports"]["system"]
    os.kill(before["pid"], signal.SIGKILL)
    dm.wait_for(lambda s: unit_by_name(s, "worker@0")["state"] == "backoff", timeout=10,
                what="worker@0 in backoff")
    foreign = take(port)
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


def test_etcd_moved_to_a_new_port_takes_the_policy_ledger_with_it(
    dm: Dynamod, tmp_path: Path
) -> None:
    """etcd's client port taken between its death and its restart: etcd moves, the units
    that name the port restart against it, and the [policy] ledger (kept in etcd, its
    endpoint templated from that port) follows, so a push after the move commits."""
    from tests.integration.policystack import checkpoint, model_dir, push, write_stack

    units = ROOT / "units"
    etcd = (units / "etcd.toml").read_text().replace(
        "[units.etcd.restart]\n", f"[units.etcd.restart]\nfirst_delay = {RESTART_DELAY_S}\n"
    )
    assert f"first_delay = {RESTART_DELAY_S}" in etcd
    (tmp_path / "etcd.toml").write_text(etcd)
    path = write_stack(tmp_path / "policy-ports.toml", "policyports")
    path.write_text(path.read_text().replace(f'"{units / "etcd.toml"}"', f'"{tmp_path}/etcd.toml"'))
    assert f"{tmp_path}/etcd.toml" in path.read_text()
    dm.run("up", str(path), "--detach", timeout=300, check=True)
    first = dm.status()
    before = unit_by_name(first, "etcd")
    port = before["ports"]["client"]
    os.kill(before["pid"], signal.SIGKILL)
    dm.wait_for(lambda s: unit_by_name(s, "etcd")["state"] == "backoff", timeout=10,
                what="etcd in backoff")
    foreign = take(port)  # accepts and never answers: a client left on it hangs
    try:
        after = dm.wait_ready_again("etcd", before["pid"], timeout=60)
        assert after["ports"]["client"] != port, after
        dm.wait_for(lambda s: s["phase"] == "up" and all(
            unit_by_name(s, f"worker@{i}").get("policy", {}).get("admitted") for i in (0, 1)),
            timeout=120, what="the stack up again with both shards admitted")
        pushed = push(dm, 1, checkpoint(model_dir(first), tmp_path / "ckpt-1", 1.01))
        assert pushed["version"] == 1 and not pushed.get("stale"), pushed
        assert all(ack["ok"] for ack in pushed["acks"].values()), pushed
        assert "policy.etcd_moved" in dm.daemon_log()
    finally:
        foreign.close()
