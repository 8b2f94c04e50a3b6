"""A restarted worker serves nothing before dynamod admits it (issue 11's known gap), on the
real stack: etcd, NATS, the Dynamo frontend (kv router) and CPU workers under a `[policy]`.

A SIGKILLed shard comes back and registers with Dynamo a moment before dynamod can hold
it. Plain requests (no routing constraint) sent through the router meanwhile, and requests
pinned to the new instance the moment its etcd registration appears, must all be served at
the ledger's current version: never with the boot weights and no version, as they were
before the worker started paused."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import Dynamod, unit_by_name
from tests.integration.policystack import (
    MODEL,
    History,
    checkpoint,
    frontend,
    model_dir,
    push,
    write_stack,
)

pytestmark = pytest.mark.slow

INSTANCES = "v1/instances/"
BURST_S = 2.0  # how long requests are pinned to the new instance once it registered
BURST_EVERY_S = 0.025


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def instance_ids(session: aiohttp.ClientSession, etcd: str) -> set[int]:
    """Every registered instance id, read over etcd's JSON gateway."""
    body = {"key": _b64(INSTANCES), "range_end": _b64(INSTANCES[:-1] + "0"), "keys_only": True}
    async with session.post(f"{etcd}/v3/kv/range", json=body) as resp:
        kvs = (await resp.json()).get("kvs") or []
    found = set()
    for kv in kvs:
        key = base64.b64decode(kv["key"]).decode()
        if key.split("/")[-2:-1] == ["generate"]:
            found.add(int(key.rsplit("/", 1)[1], 16))
    return found


class PinnedBurst:
    """Waits for an instance id that `known` does not hold to register in etcd, then sends
    plain requests pinned to it (`nvext.backend_instance_id`) for BURST_S, recording what
    served each: the closest a test gets to the router picking the new worker at once."""

    def __init__(self, url: str, etcd: str, known: set[int]) -> None:
        self.url, self.etcd, self.known = url, etcd, known
        self.new_instance: int | None = None
        self.registered_at: float | None = None
        self.rows: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join(timeout=90)
        assert not self._thread.is_alive(), "the pinned burst did not finish"

    async def _one(self, session: aiohttp.ClientSession, instance: int) -> None:
        nvext = {"backend_instance_id": instance, "extra_fields": ["engine_data"]}
        body = {"model": MODEL, "prompt": "just registered", "max_tokens": 4, "nvext": nvext}
        sent = time.monotonic()
        try:
            async with session.post(f"{self.url}/v1/completions", json=body) as resp:
                status, text = resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            status, text = -1, repr(exc)
        row: dict[str, Any] = {"sent": sent, "done": time.monotonic(), "status": status}
        if status == 200:
            engine = json.loads(text)["nvext"]["engine_data"]
            row.update(version=engine["weight_version"], instance=engine["instance_id"],
                       digest=engine["weight_digest"])
        else:
            row["error"] = text[:200]
        self.rows.append(row)

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            deadline = time.monotonic() + 60
            while self.new_instance is None and time.monotonic() < deadline:
                fresh = await instance_ids(session, self.etcd) - self.known
                if fresh:
                    self.new_instance = fresh.pop()
                    self.registered_at = time.monotonic()
                else:
                    await asyncio.sleep(0.005)
            if self.new_instance is None:
                return
            tasks = []
            while time.monotonic() - (self.registered_at or 0) < BURST_S:
                tasks.append(asyncio.create_task(self._one(session, self.new_instance)))
                await asyncio.sleep(BURST_EVERY_S)
            await asyncio.gather(*tasks)


def test_a_restarted_worker_serves_no_plain_request_before_it_is_admitted(
    dm: Dynamod, tmp_path: Path
) -> None:
    stack = write_stack(tmp_path / "start-paused.toml", "startpaused")
    dm.run("up", str(stack), "--detach", timeout=300, check=True)
    status = dm.status()
    boot = model_dir(status)
    pushed = push(dm, 1, checkpoint(boot, tmp_path / "step-1", 1.01))
    assert pushed["ok"] and pushed["stale"] == [], pushed
    status = dm.status()
    etcd = f"http://127.0.0.1:{unit_by_name(status, 'etcd')['ports']['client']}"
    url = frontend(status)
    known = asyncio.run(_registered(etcd))
    victim = unit_by_name(status, "worker@1")
    assert set(victim["dynamo"]["instance_ids"]) <= known

    stream = History(url)
    stream.run(lambda: None, rate=10)  # plain traffic: the router may pick any worker
    stream.wait_served(10)
    burst = PinnedBurst(url, etcd, known)
    burst.start()
    os.kill(victim["pid"], signal.SIGKILL)
    back = dm.wait_ready_again("worker@1", victim["pid"], timeout=90, what="rejoin")
    burst.join()
    stream.wait_served(10, after=time.monotonic())  # plain traffic with the shard back
    stream.stop()

    assert back["policy_version"] == 1
    new_instance = back["dynamo"]["instance_ids"][0]
    assert burst.new_instance == new_instance, (burst.new_instance, back["dynamo"])
    served = [r for r in stream.rows + burst.rows if r["status"] == 200]
    unversioned = [r for r in served if r["version"] != 1]
    # Before the fix: the new instance answered with its boot weights and no version.
    assert unversioned == [], (
        f"{len(unversioned)} of {len(served)} completions served below version 1, e.g. "
        f"{unversioned[:3]} (new instance {new_instance:x})"
    )
    pinned = [r for r in burst.rows if r["status"] == 200]
    assert pinned and {r["instance"] for r in pinned} == {new_instance}, burst.rows[:5]
    assert {r["digest"] for r in pinned} == {pushed["digest"]}
    assert [r for r in stream.rows if r["status"] != 200] == [], "plain requests were lost"
    waits = sorted(r["done"] - r["sent"] for r in pinned)
    print(f"pinned to the new instance: {len(pinned)} served of {len(burst.rows)}, "
          f"longest wait {waits[-1]:.3f} s, median {waits[len(waits) // 2]:.3f} s")
    assert "paused until resume_generation admits it" in (
        dm.state_dir / "logs" / "worker@1.log"
    ).read_text()


async def _registered(etcd: str) -> set[int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        return await instance_ids(session, etcd)
