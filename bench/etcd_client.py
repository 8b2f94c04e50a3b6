"""Benchmark 11 - etcd clients side by side: the JSON gateway (dynamod before issue 14), aetcd
1.0.0 over gRPC, and dynamod's EtcdClient as it is now, against one real etcd on loopback.

    python -m bench.etcd_client [--quick] [--json]

Per client, in one run and alternating clients per round (so load drifts hit every column
alike): OPS sequential put, get and range (a 100-key prefix) calls; lease grant and one
keepalive; a watch event's latency (put -> event seen by a prefix watcher); and, in fresh
interpreters, the import time of the client module and the RSS it adds (import, connect, one put
and one get). Latencies are per call, median and p99, in ms. OPS is 1000 (--quick: 200).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bench.report import Report, Table, emit, entry, options, ratio, summary
from dynamod.core.ports import PortAllocator

BIN = Path(sys.executable).parent
CLIENTS = ("gateway", "aetcd", "dynamod")
RANGE_KEYS = 100


class Client(Protocol):
    async def put(self, key: str, value: bytes) -> None: ...
    async def get(self, key: str) -> bytes | None: ...
    async def range(self, prefix: str) -> int: ...
    async def lease_grant(self, ttl: int) -> int: ...
    async def lease_keepalive(self, lease_id: int) -> int | None: ...
    def watch(self, prefix: str) -> AsyncIterator[str]: ...
    async def close(self) -> None: ...


@dataclass
class Gateway:
    """dynamod's client before issue 14 (bench/etcd_gateway.py)."""

    url: str

    def __post_init__(self) -> None:
        from bench.etcd_gateway import EtcdClient

        self.client = EtcdClient(self.url)

    async def put(self, key: str, value: bytes) -> None:
        await self.client.put(key, value)

    async def get(self, key: str) -> bytes | None:
        return await self.client.get(key)

    async def range(self, prefix: str) -> int:
        return len(await self.client.get_prefix(prefix))

    async def lease_grant(self, ttl: int) -> int:
        return await self.client.lease_grant(ttl)

    async def lease_keepalive(self, lease_id: int) -> int | None:
        return await self.client.lease_keepalive(lease_id)

    async def watch(self, prefix: str) -> AsyncIterator[str]:
        async for _kind, key in self.client.watch_prefix(prefix):
            yield key

    async def close(self) -> None:
        await self.client.close()


@dataclass
class Aetcd:
    """aetcd 1.0.0 used directly (no dynamod code between)."""

    url: str

    def __post_init__(self) -> None:
        import aetcd

        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.client = aetcd.Client(host=host, port=int(port), timeout=2)

    async def put(self, key: str, value: bytes) -> None:
        await self.client.put(key.encode(), value)

    async def get(self, key: str) -> bytes | None:
        got = await self.client.get(key.encode())
        return None if got is None else bytes(got.value)

    async def range(self, prefix: str) -> int:
        return len(list(await self.client.get_prefix(prefix.encode())))

    async def lease_grant(self, ttl: int) -> int:
        return int((await self.client.lease(ttl)).id)

    async def lease_keepalive(self, lease_id: int) -> int | None:
        reply = await self.client.refresh_lease(lease_id)
        return int(reply.TTL) if reply.TTL > 0 else None

    async def watch(self, prefix: str) -> AsyncIterator[str]:
        async for event in await self.client.watch_prefix(prefix.encode()):
            yield event.kv.key.decode()

    async def close(self) -> None:
        await self.client.close()


@dataclass
class Dynamod:
    """dynamod.rollout.etcd.EtcdClient as the tree has it now."""

    url: str

    def __post_init__(self) -> None:
        from dynamod.rollout.etcd import EtcdClient

        self.client = EtcdClient(self.url)

    async def put(self, key: str, value: bytes) -> None:
        await self.client.put(key, value)

    async def get(self, key: str) -> bytes | None:
        return await self.client.get(key)

    async def range(self, prefix: str) -> int:
        return len(await self.client.get_prefix(prefix))

    async def lease_grant(self, ttl: int) -> int:
        return await self.client.lease_grant(ttl)

    async def lease_keepalive(self, lease_id: int) -> int | None:
        keepalive = getattr(self.client, "lease_keepalive", None)
        if keepalive is None:  # the tree before the switch has no keepalive
            return None
        result: int | None = await keepalive(lease_id)
        return result

    async def watch(self, prefix: str) -> AsyncIterator[str]:
        watch_prefix = getattr(self.client, "watch_prefix", None)
        if watch_prefix is None:  # the tree before the switch has no watch
            return
        async for event in watch_prefix(prefix):
            yield event.key

    async def close(self) -> None:
        await self.client.close()


MAKERS: dict[str, Callable[[str], Client]] = {
    "gateway": Gateway,
    "aetcd": Aetcd,
    "dynamod": Dynamod,
}

# What each fresh interpreter imports and does for the import-time and RSS rows.
PROBE = r"""
import asyncio, json, sys, time
def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
name, url = sys.argv[1], sys.argv[2]
base = rss_kb()
t0 = time.perf_counter()
if name == "gateway":
    import bench.etcd_gateway
elif name == "aetcd":
    import aetcd
else:
    import dynamod.rollout.etcd
took = time.perf_counter() - t0
from bench.etcd_client import MAKERS
async def one():
    client = MAKERS[name](url)
    await client.put("bench/rss", b"x")
    await client.get("bench/rss")
    await client.close()
asyncio.run(one())
print(json.dumps({"import_s": took, "rss_kb": rss_kb() - base}))
"""


async def timed(samples: list[float], call: Awaitable[Any]) -> Any:
    started = time.perf_counter()
    result = await call
    samples.append((time.perf_counter() - started) * 1000)
    return result


async def kv_round(client: Client, run: str, ops: int, out: dict[str, list[float]]) -> None:
    for i in range(ops):
        await timed(out["put"], client.put(f"bench/{run}/kv/{i % 50}", b"v" * 64))
    for i in range(ops):
        await timed(out["get"], client.get(f"bench/{run}/kv/{i % 50}"))
    for i in range(RANGE_KEYS):
        await client.put(f"bench/{run}/range/{i:03d}", b"r" * 64)
    for _ in range(max(ops // 10, 10)):
        count = await timed(out["range"], client.range(f"bench/{run}/range/"))
        assert count == RANGE_KEYS, f"range saw {count} keys, expected {RANGE_KEYS}"


async def lease_round(client: Client, ops: int, out: dict[str, list[float]]) -> None:
    for _ in range(max(ops // 10, 10)):
        lease = await timed(out["lease grant"], client.lease_grant(30))
        ttl = await timed(out["lease keepalive"], client.lease_keepalive(lease))
        if ttl is None:
            out["lease keepalive"].pop()  # a client without keepalive: no sample


async def watch_round(client: Client, run: str, events: int, out: dict[str, list[float]]) -> None:
    prefix = f"bench/{run}/watch/"
    seen: asyncio.Queue[tuple[str, float]] = asyncio.Queue()

    async def follow() -> None:
        async for key in client.watch(prefix):
            await seen.put((key, time.perf_counter()))

    task = asyncio.create_task(follow())
    try:
        await asyncio.sleep(0.3)  # the watch is registered before the first put
        if task.done():
            return  # no watch in this client
        for i in range(events):
            key = f"{prefix}{i}"
            sent = time.perf_counter()
            await client.put(key, b"w")
            got, at = await asyncio.wait_for(seen.get(), 5)
            assert got == key, f"watch saw {got!r}, expected {key!r}"
            out["watch event"].append((at - sent) * 1000)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def measure(url: str, ops: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {
        name: {
            k: [] for k in ("put", "get", "range", "lease grant", "lease keepalive", "watch event")
        }
        for name in CLIENTS
    }
    for r in range(rounds):
        for name in CLIENTS:
            client = MAKERS[name](url)
            run = f"{name}-{r}-{uuid.uuid4().hex[:6]}"
            try:
                await client.put(f"bench/{run}/warm", b"x")  # connect outside the samples
                await kv_round(client, run, ops // rounds, samples[name])
                await lease_round(client, ops // rounds, samples[name])
                await watch_round(client, run, max(ops // rounds // 5, 20), samples[name])
            finally:
                await client.close()
    return samples


def import_and_rss(url: str, repeats: int) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {
        name: {"import_ms": [], "rss_mb": []} for name in CLIENTS
    }
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for _ in range(repeats):
        for name in CLIENTS:
            out = subprocess.run(
                [sys.executable, "-c", PROBE, name, url],
                capture_output=True,
                text=True,
                env=env,
                cwd=repo,
                timeout=60,
                check=True,
            ).stdout
            data = json.loads(out.strip().splitlines()[-1])
            results[name]["import_ms"].append(data["import_s"] * 1000)
            results[name]["rss_mb"].append(data["rss_kb"] / 1024)
    return results


@contextlib.contextmanager
def etcd_on_loopback() -> Any:
    ports = PortAllocator()
    client, peer = ports(), ports()
    data = Path(tempfile.mkdtemp(prefix="bench-etcd-"))
    url = f"http://127.0.0.1:{client}"
    log = (data / "etcd.log").open("wb")
    proc = subprocess.Popen(
        [
            str(BIN / "etcd"),
            "--data-dir",
            str(data / "data"),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(f"{url}/health", timeout=1) as resp,
            ):
                if json.loads(resp.read()).get("health") == "true":
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not come up; see {data / 'etcd.log'}")
            time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        shutil.rmtree(data, ignore_errors=True)


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    ops, rounds, repeats = (200, 2, 3) if args.quick else (1000, 4, 7)
    report = Report("etcd_client", "etcd clients: JSON gateway vs aetcd vs dynamod", args.quick)
    with etcd_on_loopback() as url:
        samples = asyncio.run(measure(url, ops, rounds))
        startup = import_and_rss(url, repeats)

    latency = Table(
        f"Latency per call, ms ({ops} put, {ops} get, {max(ops // 10, 10)} ranges of "
        f"{RANGE_KEYS} keys, leases, watch events; median / p99)",
        [
            "operation",
            *[f"{n} median" for n in CLIENTS],
            *[f"{n} p99" for n in CLIENTS],
            "aetcd / gateway",
            "dynamod / gateway",
        ],
        digits=2,
    )
    for op in samples["gateway"]:
        stats = {n: summary(samples[n][op]) for n in CLIENTS}
        latency.rows.append(
            [
                op,
                *[stats[n]["median"] for n in CLIENTS],
                *[stats[n]["p99"] for n in CLIENTS],
                ratio(stats["aetcd"]["median"], stats["gateway"]["median"]),
                ratio(stats["dynamod"]["median"], stats["gateway"]["median"]),
            ]
        )
    cost = Table(
        f"Start-up cost in a fresh interpreter (median of {repeats})",
        ["client", "import ms", "RSS added MB (import + connect + put + get)"],
        digits=1,
    )
    for name in CLIENTS:
        cost.rows.append(
            [
                name,
                summary(startup[name]["import_ms"])["median"],
                summary(startup[name]["rss_mb"])["median"],
            ]
        )
    total = Table(
        f"Time for {ops} puts + {ops} gets, s (sum of per-call latencies)",
        ["client", "seconds", "vs gateway"],
        digits=3,
    )
    base = (sum(samples["gateway"]["put"]) + sum(samples["gateway"]["get"])) / 1000
    for name in CLIENTS:
        secs = (sum(samples[name]["put"]) + sum(samples[name]["get"])) / 1000
        total.rows.append([name, secs, ratio(secs, base) if not math.isnan(base) else math.nan])
    report.tables += [latency, total, cost]
    report.data = {"samples": samples, "startup": startup}
    report.notes.append(
        "gateway = bench/etcd_gateway.py (dynamod's client at 5eafa4c); aetcd = aetcd 1.0.0 "
        "directly; dynamod = dynamod.rollout.etcd.EtcdClient of this tree"
    )
    emit(report, args.json)


if __name__ == "__main__":
    main()
