"""The policy stack the policy and spare tests share: the default stack's units (etcd, NATS,
CPU workers, the Dynamo frontend with the kv router) under a `[policy]` table, new
checkpoints made from the tiny model's weights, and a request history that records which
instance served each answer at which weight version (`nvext.engine_data`)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from dynamod.core.paths import units_dir
from tests.conftest import Dynamod, unit_by_name

MODEL = "tiny-cpu"


def write_stack(path: Path, name: str, workers: int = 2, **policy: Any) -> Path:
    """A stack file at `path`: the default stack's units, `workers` shards, and a `[policy]`
    with an etcd ledger, a 3 s engine-call timeout (stuck shards fail fast), a 0.2 s first
    replay backoff, and any further `[policy]` keys given (e.g. keep=2, spares=1)."""
    units = units_dir()
    includes = ", ".join(
        f'"{units / n}"' for n in ("etcd.toml", "nats.toml", "worker-cpu.toml", "frontend.toml")
    )
    extra = "".join(f"{key} = {json.dumps(value)}\n" for key, value in policy.items())
    path.write_text(f"""
[stack]
name = "{name}"
include = [{includes}]

[vars]
workers = {workers}

[policy]
store = "etcd"
etcd = "http://127.0.0.1:{{units.etcd.ports.client}}"
shards = ["worker"]
call_timeout = 3
replay_backoff_initial = 0.2
{extra}""")
    return path


async def ledger_revisions(dm: Dynamod) -> dict[str, int]:
    """The stack's ledger keys (`policy/current`, `shards/<name>`...) with the store's
    revision each was last written at, read from the stack's etcd."""
    from dynamod.rollout.etcd import EtcdClient

    identity = dm.status()["identity"]
    prefix = f"dynamod/{identity['id']}/"
    async with EtcdClient(identity["etcd"]) as etcd:
        kvs = await etcd.get_prefix(prefix)
    return {kv.key[len(prefix) :]: kv.mod_revision for kv in kvs}


def model_dir(status: dict[str, Any]) -> Path:
    worker = unit_by_name(status, "worker@0")
    return Path(worker["command"][worker["command"].index("--model-path") + 1])


def checkpoint(base: Path, out: Path, scale: float, pad_mb: int = 0) -> Path:
    """A new policy: the base weights scaled (and optionally padded to be slow to load)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(base / "model.safetensors"))
    tensors = {k: (v.float() * scale).to(v.dtype) for k, v in tensors.items()}
    if pad_mb:
        tensors["padding"] = torch.ones(pad_mb * 256 * 1024, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    return out


class History:
    """Requests at a bounded rate; every answer recorded with what served it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def one(
        self, session: aiohttp.ClientSession, version: int | None, asked: float | None = None
    ) -> None:
        """One request for `version`. `asked`: when that version was read (monotonic), which
        is before `sent` (the task's first run): filter on it to be sure of what a request
        asked for after some moment."""
        nvext: dict[str, Any] = {"extra_fields": ["worker_id", "engine_data"]}
        if version is not None:
            nvext["routing_constraints"] = {"required_taints": [f"dynamod.policy/{version}"]}
        body = {"model": MODEL, "prompt": "the policy says", "max_tokens": 4, "nvext": nvext}
        sent = time.monotonic()
        try:
            async with session.post(f"{self.url}/v1/completions", json=body) as resp:
                status, text = resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            status, text = -1, repr(exc)
        row: dict[str, Any] = {
            "asked": sent if asked is None else asked,
            "sent": sent,
            "done": time.monotonic(),
            "required": version,
            "status": status,
        }
        if status == 200:
            engine = json.loads(text)["nvext"]["engine_data"]
            row.update(version=engine["weight_version"], instance=engine["instance_id"])
        else:
            row["error"] = text[:200]
        self.rows.append(row)

    def run(self, version_of: Any, rate: float = 8, limit_s: float = 120) -> None:
        async def loop() -> None:
            timeout = aiohttp.ClientTimeout(total=20)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                tasks = []
                start = time.monotonic()
                while not self._stop.is_set() and time.monotonic() - start < limit_s:
                    asked = time.monotonic()
                    request = self.one(session, version_of(), asked)
                    tasks.append(asyncio.create_task(request))
                    await asyncio.sleep(1 / rate)
                await asyncio.gather(*tasks)

        self._thread = threading.Thread(target=lambda: asyncio.run(loop()), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=60)

    def wait_served(self, count: int, *, after: float = 0.0, timeout: float = 60) -> None:
        """Until `count` requests asked at or after `after` (monotonic) were answered 200:
        traffic that has flowed, not a guess at how long it takes to."""
        deadline = time.monotonic() + timeout
        while sum(r["asked"] >= after and r["status"] == 200 for r in self.rows) < count:
            if time.monotonic() > deadline:
                since = [r for r in self.rows if r["sent"] >= after]
                raise AssertionError(
                    f"{count} requests not served within {timeout:g}s: {len(since)} sent, "
                    f"last {since[-3:]}"
                )
            time.sleep(0.05)


def push(dm: Dynamod, step: int, path: Path) -> dict[str, Any]:
    result = dm.run(
        "policy", "push", "--step", str(step), "--path", str(path), "--json", check=True
    )
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def frontend(status: dict[str, Any]) -> str:
    return f"http://127.0.0.1:{unit_by_name(status, 'frontend')['ports']['http']}"


async def served_by(url: str, n: int) -> list[int]:
    """The Dynamo worker instance that served each of n completions through the frontend."""
    body = {"model": MODEL, "max_tokens": 4, "nvext": {"extra_fields": ["worker_id"]}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        served = []
        for i in range(n):
            async with session.post(f"{url}/v1/completions",
                                    json={**body, "prompt": f"round {i}"}) as resp:
                reply = await resp.json(content_type=None)
                assert resp.status == 200, reply
            served.append(int(reply["nvext"]["worker_id"]["decode_worker_id"]))
        return served
