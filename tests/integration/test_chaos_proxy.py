"""The TCP fault proxy on loopback, between a real client and a real echo server: added
latency, a bandwidth limit, resets, an outage, all set at run time over its control port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from dynamod.chaos.proxy import FaultProxy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


class Proxied:
    def __init__(self, port: int, control: str, proxy: FaultProxy) -> None:
        self.port, self.control, self.proxy = port, control, proxy

    async def set(self, **faults: object) -> dict[str, object]:
        async with aiohttp.ClientSession() as session, session.post(
            f"{self.control}/faults", json=faults
        ) as resp:
            answer: dict[str, object] = await resp.json()
            assert resp.status == 200, answer
            return answer

    async def round_trip(self, payload: bytes = b"ping") -> tuple[bytes, float]:
        """What came back (b"" when the proxy cut or reset the connection) and how long."""
        started = time.monotonic()
        got = b""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            writer.write(payload)
            await writer.drain()
            while len(got) < len(payload):
                chunk = await asyncio.wait_for(reader.read(65536), 10)
                if not chunk:
                    break
                got += chunk
            writer.close()
        except ConnectionResetError:
            pass
        return got, time.monotonic() - started


@pytest_asyncio.fixture
async def proxied() -> AsyncIterator[Proxied]:
    upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
    up_port = upstream.sockets[0].getsockname()[1]
    proxy = FaultProxy("127.0.0.1", up_port)
    listen = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    runner = web.AppRunner(proxy.control_app())
    await runner.setup()
    control_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", control_port).start()
    yield Proxied(listen.sockets[0].getsockname()[1], f"http://127.0.0.1:{control_port}", proxy)
    await runner.cleanup()
    listen.close()
    upstream.close()


@pytest.mark.asyncio
async def test_healthy_proxy_passes_bytes_through(proxied: Proxied) -> None:
    got, seconds = await proxied.round_trip(b"x" * 100_000)
    assert got == b"x" * 100_000 and seconds < 5  # loopback: milliseconds, unless starved


@pytest.mark.asyncio
async def test_latency_and_bandwidth_are_added_and_healed(proxied: Proxied) -> None:
    await proxied.set(latency_ms=150)
    _, slow = await proxied.round_trip()
    assert slow >= 0.3  # once each way
    await proxied.set(latency_ms=0, bandwidth_kbps=400)
    _, limited = await proxied.round_trip(b"y" * 25_000)  # 200 kbit each way at 400 kbit/s
    assert limited >= 0.9
    await proxied.set(bandwidth_kbps=0)
    _, healed = await proxied.round_trip()
    # the latency left (0.3 s a round trip, as `slow` measured with it), on a machine
    # slow enough to stretch a loopback round trip, would still be at least slow / 2
    assert healed < slow / 2, (healed, slow)


@pytest.mark.asyncio
async def test_reset_and_outage_cut_connections(proxied: Proxied) -> None:
    await proxied.set(reset_rate=1)
    got, _ = await proxied.round_trip()
    assert got == b""
    await proxied.set(reset_rate=0)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxied.port)
    writer.write(b"hi")
    assert await reader.read(2) == b"hi"
    answer = await proxied.set(down=True)  # the live connection is cut too
    assert answer["open"] == 0
    with contextlib.suppress(ConnectionResetError):
        assert await asyncio.wait_for(reader.read(10), 5) == b""
    got, _ = await proxied.round_trip()
    assert got == b"" and proxied.proxy.counts["refused"] >= 1
    await proxied.set(down=False)
    assert (await proxied.round_trip())[0] == b"ping"


@pytest.mark.asyncio
async def test_unknown_fault_is_refused_by_name(proxied: Proxied) -> None:
    async with aiohttp.ClientSession() as session, session.post(
        f"{proxied.control}/faults", json={"packet_loss": 0.1}
    ) as resp:
        assert resp.status == 400 and "packet_loss" in (await resp.json())["error"]
