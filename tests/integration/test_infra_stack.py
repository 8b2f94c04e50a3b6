"""units/stacks/infra.toml: real etcd and real nats-server under dynamod."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest

from dynamod.core.ports import listening
from tests.conftest import Dynamod, unit_by_name, wait_dead
from tests.integration import etcd_history

pytestmark = pytest.mark.slow


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return json.loads(resp.read())


def test_infra_up_kill_nats_restart_down_leaves_nothing(dm: Dynamod) -> None:
    dm.run("up", "infra", "--detach", check=True)
    status = dm.status()
    etcd, nats = unit_by_name(status, "etcd"), unit_by_name(status, "nats")
    assert get_json(f"http://127.0.0.1:{etcd['ports']['client']}/health") == {
        "health": "true", "reason": ""}
    assert get_json(f"http://127.0.0.1:{nats['ports']['monitor']}/healthz") == {"status": "ok"}

    os.kill(nats["pid"], signal.SIGKILL)
    again = dm.wait_ready_again("nats", nats["pid"], what="nats restarted and ready")
    assert again["restarts"] == 1 and again["last_exit"] == "killed by SIGKILL"
    assert again["ports"] == nats["ports"]  # same ports after a restart
    assert get_json(f"http://127.0.0.1:{nats['ports']['monitor']}/healthz") == {"status": "ok"}

    ports = [*etcd["ports"].values(), *nats["ports"].values()]
    pids = [etcd["pid"], again["pid"], status["daemon_pid"]]
    result = dm.run("down", check=True)
    assert "nothing left running" in result.stdout
    assert wait_dead(pids, timeout=5) == []
    assert [p for p in ports if listening(p)] == []


def test_listen_addresses_are_loopback_only(dm: Dynamod) -> None:
    dm.run("up", "infra", "--detach", check=True)
    status = dm.status()
    ports = {p for u in status["units"] for p in u["ports"].values()}
    listeners = set()
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                addr, port = local.split(":")
                if int(port, 16) in ports:
                    listeners.add((addr, int(port, 16)))
    assert {port for _, port in listeners} == ports
    assert {addr for addr, _ in listeners} == {"0100007F"}  # 127.0.0.1
    tcp6 = Path("/proc/net/tcp6").read_text()
    assert not any(f":{p:04X} " in tcp6 for p in ports)


def test_etcd_compacts_its_history_as_the_stack_says(dm: Dynamod) -> None:
    """The stock etcd unit keeps `etcd_history` of old revisions (a periodic compaction):
    without one, every rewrite of a key stays in the store until etcd's 2 GiB quota
    refuses every write. 2 s here: the old revisions are gone within seconds. With "0" (no
    compaction, etcd's own default and the units' before) they stay."""
    dm.run("up", "infra", "--detach", "--var", "etcd_history=2s", check=True)
    port = unit_by_name(dm.status(), "etcd")["ports"]["client"]
    assert etcd_history.kept(port, etcd_history.rewrite(port, 20)[0], wait_s=10) is False
    dm.run("down", check=True)

    dm.run("up", "infra", "--detach", "--var", "etcd_history=0", check=True)
    port = unit_by_name(dm.status(), "etcd")["ports"]["client"]
    assert etcd_history.kept(port, etcd_history.rewrite(port, 20)[0], wait_s=5) is True
    dm.run("down", check=True)
