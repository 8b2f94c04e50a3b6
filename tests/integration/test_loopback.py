"""A single-node stack stays on loopback: every socket that any process of the default stack
listens on (TCP) or holds bound (UDP), found in the stack's cgroups through /proc (each
process's socket inodes against its network namespace's tables), is on 127.0.0.1 or ::1:
none at all beyond loopback (Dynamo's ZMQ event publisher, which binds 0.0.0.0 whatever
DYN_EVENT_PLANE_HOST says, is gone with DYN_EVENT_PLANE=nats on the workers and the
frontend), so `status` warns about nothing; a unit that listens on every interface is
named by `status`, with its pid, process and port."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dynamod.cluster import exposure
from dynamod.core import cgroups
from tests.conftest import Dynamod

pytestmark = pytest.mark.slow


def stack_pids(status: dict[str, Any]) -> dict[str, list[int]]:
    """unit -> every pid of its cgroup (or its main pid without cgroups)."""
    root = (status.get("containment") or {}).get("cgroup")
    found: dict[str, list[int]] = {}
    for unit in status["units"]:
        pids = cgroups.procs(Path(root) / unit["name"]) if root else []
        if not pids and unit["pid"]:
            pids = exposure.group_pids(unit["pid"])
        if pids:
            found[unit["name"]] = pids
    return found


def ss_listeners(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP listener `ss` attributes to `pids`: a second opinion."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
    found: set[tuple[str, int]] = set()
    for line in out.splitlines():
        fields = line.split()
        if any(f"pid={pid}," in line for pid in pids):
            host, _, port = fields[3].rpartition(":")
            found.add((host.strip("[]").split("%")[0], int(port)))
    return found


def advertised_ports(status: dict[str, Any], prefix: str) -> set[int]:
    """Ports named in the values under `prefix` in the stack's etcd (what Dynamo advertises)."""
    etcd = next(u for u in status["units"] if u["name"] == "etcd")["ports"]["client"]
    out = subprocess.run(
        [str(Path(sys.executable).parent / "etcdctl"), "--endpoints", f"127.0.0.1:{etcd}",
         "get", "--prefix", prefix, "--print-value-only"],
        capture_output=True, text=True, timeout=10,
    ).stdout  # fmt: skip
    print(f"{prefix}: {out[:2000]}")
    return {int(port) for port in re.findall(r"127\.0\.0\.1:(\d+)", out)}


def zmq_publisher_ports(status: dict[str, Any]) -> set[int]:
    """Ports of the ZMQ event publishers the workers advertise (etcd v1/event_channels/)."""
    return advertised_ports(status, "v1/event_channels/")


def sampled_exposure(dm: Dynamod, *, within_s: float = 15) -> list[str]:
    """`status`'s exposure lines once the daemon has sampled them (it reads the units'
    sockets in the background, every few seconds and when a unit becomes ready)."""
    deadline = time.monotonic() + within_s
    while True:
        warned: list[str] = dm.status()["exposure"]
        if warned or time.monotonic() > deadline:
            return warned
        time.sleep(0.2)


def test_default_stack_listens_on_loopback_only(dm: Dynamod) -> None:
    dm.run("up", "--detach", "--var", "workers=1", "--timeout", "240", timeout=300, check=True)
    status = dm.status()
    pids = stack_pids(status)
    assert {"etcd", "nats", "worker@0", "frontend"} <= pids.keys(), pids
    found = {unit: exposure.listeners(p) for unit, p in pids.items()}
    table = "\n".join(f"  {unit}: {x}" for unit, xs in found.items() for x in xs)
    print(f"listeners of the default stack:\n{table}")
    # With DYN_EVENT_PLANE=nats (units/frontend.toml, worker-cpu.toml) no ZMQ event
    # publisher is advertised, and nothing listens beyond loopback.
    assert zmq_publisher_ports(status) == set()
    print(f"advertised instance endpoints: {advertised_ports(status, 'v1/instances/')}")
    outside = [f"{unit}: {x}" for unit, xs in found.items() for x in xs if not x.loopback]
    assert outside == [], "beyond loopback:\n" + "\n".join(outside)
    ports = {unit: {x.port for x in xs} for unit, xs in found.items()}
    by_name = {u["name"]: u["ports"] for u in status["units"]}
    for unit in ("etcd", "nats", "worker@0", "frontend"):
        assert set(by_name[unit].values()) <= ports[unit], (unit, by_name[unit], ports[unit])
    # the worker's Dynamo runtime opens its planes beside the system port (the request
    # plane and its response stream; no event publisher over NATS)
    assert len(ports["worker@0"]) >= 3, found["worker@0"]
    every = {(x.address, x.port) for xs in found.values() for x in xs if x.proto.startswith("tcp")}
    assert ss_listeners({p for ps in pids.values() for p in ps}) <= every
    # `status` warns about nothing (its sampler looks every few seconds).
    assert sampled_exposure(dm, within_s=8) == []
    text = dm.run("status", check=True).stdout
    assert [line for line in text.splitlines() if line.startswith("warning:")] == []


def test_status_warns_about_a_listener_beyond_loopback(dm: Dynamod, stack_file: Any) -> None:
    serve = (
        "import socket, time; s = socket.create_server(('0.0.0.0', 0)); "
        "print('listening', s.getsockname()[1], flush=True); time.sleep(600)"
    )
    path = stack_file(f"""
        [units.open]
        command = ["{sys.executable}", "-c", "{serve}"]
        [units.open.ready]
        kind = "log"
        pattern = "listening"
    """)
    dm.run("up", "--detach", str(path), "--timeout", "60", timeout=90, check=True)
    unit = dm.unit("open")
    warnings = sampled_exposure(dm)
    assert len(warnings) == 1 and warnings[0].startswith(f"open: pid {unit['pid']} (python")
    assert "tcp 0.0.0.0:" in warnings[0] and warnings[0].endswith("beyond loopback, without auth")
    assert f"warning: {warnings[0]}" in dm.run("status", check=True).stdout


def test_the_mocker_engine_s_sockets_beyond_loopback_are_named_by_check_and_by_status(
    dm: Dynamod,
) -> None:
    """Our CPU worker puts Dynamo's planes on loopback, but Dynamo's mocker engine binds its
    ZMQ sockets on every interface whatever DYN_*_HOST say: `dynamod check` says so from
    the stack file, before anything runs, and `status` then finds them on the worker's
    process, and on no other unit's."""
    mocker = ("--var", "workers=1", "--var", "worker_engine=mocker")
    checked = dm.run("check", *mocker, check=True)
    assert f"warning: worker@0: {exposure.MOCKER_EVERYWHERE}" in checked.stderr
    dm.run("up", "--detach", *mocker, "--timeout", "240", timeout=300, check=True)
    warnings = sampled_exposure(dm)
    print("\n".join(warnings))
    pid = dm.unit("worker@0")["pid"]
    assert warnings and all(w.startswith(f"worker@0: pid {pid} (python") for w in warnings)
    assert all(" tcp 0.0.0.0:" in w for w in warnings), warnings
