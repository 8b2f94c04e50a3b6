"""The default stack (units/stacks/local.toml): real etcd, NATS, Dynamo frontend and CPU
workers. Completions are served; a kill -9'd worker stops receiving traffic at once;
`down` leaves no process, port or registration behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dynamod.core.ports import listening
from dynamod.rollout import dynamo
from tests.conftest import Dynamod, unit_by_name, wait_dead
from tests.integration import etcd_history

pytestmark = pytest.mark.slow

MODEL = "tiny-cpu"


def frontend_url(status: dict[str, Any]) -> str:
    return f"http://127.0.0.1:{unit_by_name(status, 'frontend')['ports']['http']}"


async def complete(
    session: aiohttp.ClientSession, url: str, prompt: str, **nvext: Any
) -> tuple[int, dict[str, Any] | str]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
    if nvext:
        body["nvext"] = nvext
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text


def etcd_keys(etcd_port: int, prefix: str) -> list[str]:
    """Keys under prefix, read with the real etcdctl (separate from dynamod's client)."""
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "etcdctl"),
            "--endpoints",
            f"127.0.0.1:{etcd_port}",
            "get",
            "--prefix",
            prefix,
            "--keys-only",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
        env={**os.environ, "ETCDCTL_API": "3"},
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def etcd_healthy(etcd_port: int) -> bool:
    """etcd's own /health says true (it has a leader and serves reads)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{etcd_port}/health", timeout=2) as r:
            return bool(json.loads(r.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def test_default_stack_serves_and_down_leaves_nothing(dm: Dynamod, tmp_path: Path) -> None:
    result = dm.run("up", "--detach", timeout=300, check=True)
    assert "ready in" in result.stdout
    status = dm.status()
    names = [u["name"] for u in status["units"]]
    assert {"etcd", "nats", "worker@0", "worker@1", "frontend"} <= set(names)
    url = frontend_url(status)
    etcd_port = unit_by_name(status, "etcd")["ports"]["client"]

    async def one() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            return await complete(session, url, "hello world", extra_fields=["worker_id"])

    code, reply = asyncio.run(one())
    assert code == 200, reply
    assert isinstance(reply, dict) and reply["usage"]["completion_tokens"] > 0
    instances = {
        i
        for u in status["units"]
        if u["name"].startswith("worker@")
        for i in u["dynamo"]["instance_ids"]
    }
    assert len(instances) == 2
    assert reply["nvext"]["worker_id"]["decode_worker_id"] in instances
    keys = etcd_keys(etcd_port, "v1/instances/local/")
    assert {int(k.rsplit("/", 1)[1], 16) for k in keys} >= instances

    ports = [p for u in status["units"] for p in u["ports"].values()]
    pids = [u["pid"] for u in status["units"] if u["pid"]] + [status["daemon_pid"]]
    # every unit ran with a private TMPDIR under the state dir, which `down` removes
    assert (dm.state_dir / "tmp" / "worker@0").is_dir()
    down = dm.run("down", "--json", timeout=120, check=True)
    assert json.loads(down.stdout)["survivors"] == []
    assert not (dm.state_dir / "tmp").exists()
    assert wait_dead(pids) == []
    assert [p for p in ports if listening(p)] == []
    # Bring etcd back up on the same data dir: no registration survived `down`.
    etcd = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "etcd"),
            "--data-dir",
            str(dm.state_dir / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{etcd_port + 1 if etcd_port < 65535 else 2380}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # serving, not only listening: under the suite's load a restarted etcd listened
        # before it answered, and etcdctl's read failed (CI at 281e747)
        deadline = time.monotonic() + 30
        while not etcd_healthy(etcd_port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert etcd_keys(etcd_port, "v1/") == []
    finally:
        os.killpg(etcd.pid, signal.SIGKILL)
        etcd.wait()


async def steady_load(
    url: str, rate: float, seconds: float, events: list[tuple[float, int, str]]
) -> None:
    """`rate` requests/s for `seconds`, each on its own task; bounded, stops by itself."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(i: int) -> None:
            started = time.monotonic()
            try:
                code, reply = await complete(session, url, f"request {i}")
                events.append((started, code, "" if code == 200 else str(reply)[:200]))
            except (aiohttp.ClientError, TimeoutError) as exc:
                events.append((started, -1, repr(exc)))

        tasks = []
        start = time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)


def test_kill_9_worker_under_load_loses_no_request(dm: Dynamod) -> None:
    dm.run("up", "--detach", timeout=300, check=True)
    status = dm.status()
    url = frontend_url(status)
    victim = unit_by_name(status, "worker@1")
    events: list[tuple[float, int, str]] = []

    dead_ids = set(victim["dynamo"]["instance_ids"])

    async def scenario() -> tuple[float, float]:
        load = asyncio.create_task(steady_load(url, rate=5, seconds=16, events=events))
        await asyncio.sleep(5)  # the fault's place in the load's 16 s: traffic before and after
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        # The frontend's own view drops the dead worker at once (its lease is revoked),
        # not after its lease TTL (300 s in the stock units).
        async with aiohttp.ClientSession() as session:
            while time.monotonic() - killed_at < 20:
                view = await dynamo.frontend_routed_instances(session, url, "local")
                if not view & dead_ids:
                    break
                await asyncio.sleep(0.02)
        dropped_after = time.monotonic() - killed_at
        await load
        return killed_at, dropped_after

    killed_at, dropped_after = asyncio.run(scenario())
    print(f"\nthe frontend dropped the killed worker after {dropped_after * 1000:.0f} ms")
    # well inside the 300 s lease a dead worker's registration would otherwise outlive
    assert dropped_after < 30, "the frontend kept routing to the dead worker"
    outcomes = Counter(code for _, code, _ in events)
    failures = [e for e in events if e[1] != 200]
    print(f"\n{len(events)} requests, outcomes {dict(outcomes)}; failures: {failures[:5]}")
    assert len(events) == 80
    assert failures == [], f"{len(failures)} client-visible failures after kill -9"
    assert any(t > killed_at for t, _, _ in events)
    again = dm.wait_ready_again("worker@1", victim["pid"], timeout=60)
    assert again["restarts"] == 1 and again["last_exit"] == "killed by SIGKILL"
    new_ids = again["dynamo"]["instance_ids"]
    assert new_ids and set(new_ids).isdisjoint(victim["dynamo"]["instance_ids"])
    etcd_port = unit_by_name(status, "etcd")["ports"]["client"]
    registered = {
        int(k.rsplit("/", 1)[1], 16) for k in etcd_keys(etcd_port, "v1/instances/local/")
    }
    assert set(new_ids) <= registered
    assert not set(victim["dynamo"]["instance_ids"]) & registered
    log = dm.daemon_log()
    assert '"event": "dynamo.revoked"' in log


def test_the_router_follows_new_registrations_through_etcd_compactions(dm: Dynamod) -> None:
    """The stock etcd compacts its history (`etcd_history`: 1 h; 2 s here). Dynamo's frontend
    finds its workers through an etcd watch, and a watch that comes back asking for a
    revision etcd no longer keeps is refused. After etcd's kill -9 and restart (every watch
    comes back) and compactions past it, a restarted worker's new registration still
    reaches the router, and requests are served."""
    dm.run("up", "--detach", "--var", "trainer_steps=0", "--var", "etcd_history=2s",
           timeout=300, check=True)  # fmt: skip
    status = dm.status()
    url = frontend_url(status)
    etcd = unit_by_name(status, "etcd")
    port = etcd["ports"]["client"]
    first = etcd_history.rewrite(port, 30)[0]
    assert etcd_history.kept(port, first, wait_s=10) is False  # compacted past every watch
    os.kill(etcd["pid"], signal.SIGKILL)
    dm.wait_ready_again("etcd", etcd["pid"], timeout=60)
    again = etcd_history.rewrite(port, 30)[0]
    assert etcd_history.kept(port, again, wait_s=10) is False  # and past the watches' return

    victim = unit_by_name(dm.status(), "worker@0")
    os.kill(victim["pid"], signal.SIGKILL)
    back = dm.wait_ready_again("worker@0", victim["pid"], timeout=60)
    new_ids = set(back["dynamo"]["instance_ids"])
    assert new_ids and new_ids.isdisjoint(victim["dynamo"]["instance_ids"])

    async def routed_then_served() -> list[int]:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 30
            while not new_ids <= await dynamo.frontend_routed_instances(session, url, "local"):
                assert time.monotonic() < deadline, "the router never saw the new registration"
                await asyncio.sleep(0.1)
            return [(await complete(session, url, f"after {i}"))[0] for i in range(10)]

    assert asyncio.run(routed_then_served()) == [200] * 10


def test_wrong_model_directory_fails_up_cleanly(dm: Dynamod, tmp_path: Path) -> None:
    """Someone else's incomplete model dir is named, left untouched, and nothing runs."""
    model = tmp_path / "not-a-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = dm.run("up", "--detach", "--var", f"model_dir={model}", "--var",
                    "trainer_steps=0", timeout=300)
    assert result.returncode == 1
    assert f"model directory {model} lacks" in result.stderr
    assert "tokenizer.json" in result.stderr and "was not built by dynamod" in result.stderr
    assert "nothing was left running" in result.stderr
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    down = json.loads((dm.state_dir / "last-down.json").read_text())
    assert down["survivors"] == []
    assert all(u["state"] == "stopped" for u in down["units"])
