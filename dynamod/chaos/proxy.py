"""A small asyncio TCP fault proxy, run as a unit in front of etcd, NATS or a worker:
added latency (+ jitter), resets (of new connections, and of live ones once a second, each
with probability `reset_rate`), a bandwidth limit, or a full outage, all set at
run time over its HTTP control port (`GET /faults`, `POST /faults` with a JSON object;
zero values heal). Toxiproxy is not packaged here and netem is not in this kernel."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import struct
import time
from dataclasses import asdict, dataclass

from aiohttp import web


@dataclass
class Faults:
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    reset_rate: float = 0.0
    bandwidth_kbps: float = 0.0
    down: bool = False

    def update(self, values: dict[str, object]) -> None:
        for key, value in values.items():
            if key not in self.__dataclass_fields__:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(asdict(self))}")
            current = getattr(self, key)
            setattr(self, key, bool(value) if isinstance(current, bool) else float(str(value)))


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST instead of FIN (SO_LINGER 0), the way a crashed peer looks."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.faults = Faults()
        self.connections: set[asyncio.StreamWriter] = set()
        self.counts = {"accepted": 0, "reset": 0, "refused": 0}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                f = self.faults
                delay = f.latency_ms / 1000
                if f.jitter_ms:
                    delay += random.uniform(0, f.jitter_ms / 1000)
                if f.bandwidth_kbps:
                    delay += len(data) * 8 / (f.bandwidth_kbps * 1000)
                if delay:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counts["accepted"] += 1
        if self.faults.down:
            self.counts["refused"] += 1
            _reset(writer)
            return
        if self.faults.reset_rate and random.random() < self.faults.reset_rate:
            self.counts["reset"] += 1
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(writer)
            return
        self.connections.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self.connections.difference_update((writer, up_writer))

    async def flake(self) -> None:
        """Once a second, each live connection is reset with probability `reset_rate`."""
        while True:
            await asyncio.sleep(1.0)
            rate = self.faults.reset_rate
            if not rate:
                continue
            for writer in list(self.connections):
                if random.random() < rate:
                    self.counts["reset"] += 1
                    _reset(writer)
                    self.connections.discard(writer)

    def cut_all(self) -> None:
        for writer in list(self.connections):
            _reset(writer)
        self.connections.clear()

    def control_app(self) -> web.Application:
        async def get(_: web.Request) -> web.Response:
            return web.json_response({**asdict(self.faults), **self.counts,
                                      "open": len(self.connections)})

        async def post(request: web.Request) -> web.Response:
            try:
                self.faults.update(await request.json())
            except ValueError as exc:
                return web.json_response({"error": str(exc)}, status=400)
            if self.faults.down:
                self.cut_all()
            return await get(request)

        app = web.Application()
        app.router.add_get("/faults", get)
        app.router.add_post("/faults", post)
        return app


async def serve(listen: int, upstream: str, control: int) -> None:
    host, _, port = upstream.rpartition(":")
    proxy = FaultProxy(host or "127.0.0.1", int(port))
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", listen)
    runner = web.AppRunner(proxy.control_app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", control).start()
    print(f"fault proxy 127.0.0.1:{listen} -> {upstream}, control :{control}", flush=True)
    started = time.monotonic()
    flaking = asyncio.get_running_loop().create_task(proxy.flake())
    async with server:
        await server.serve_forever()
    flaking.cancel()
    print(f"fault proxy done after {time.monotonic() - started:.0f}s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    parser.add_argument("--control", type=int, required=True)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.listen, args.upstream, args.control))


if __name__ == "__main__":
    main()
