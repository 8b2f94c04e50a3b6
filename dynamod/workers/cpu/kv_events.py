"""Relays the engine's KV events to the router as the public worker's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any


class KvEventBridge:
    """Relays the engine's KV events to the router under the public worker's identity.

    Each engine publishes vLLM-format KV events on its own ZMQ port. The bridge
    forwards them to one stable ZMQ socket that Dynamo's `KvEventPublisher` relays to
    the router as events of the public endpoint. When an engine is replaced, the
    bridge tells the router all of this worker's blocks are gone (`AllBlocksCleared`),
    so the router's view is flushed together with the engine.
    """

    def __init__(self, endpoint: Any, block_size: int) -> None:
        import zmq
        import zmq.asyncio
        from dynamo.llm import KvEventPublisher

        self._zmq = zmq
        self._context = zmq.asyncio.Context()
        self._out = self._context.socket(zmq.PUB)
        self._out.setsockopt(zmq.LINGER, 0)
        port = self._out.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=32767)
        self._sequence = 0
        self._forwarding: asyncio.Task[None] | None = None
        self._relay = KvEventPublisher(
            endpoint,
            kv_block_size=block_size,
            zmq_endpoint=f"tcp://127.0.0.1:{port}",
            enable_local_indexer=True,
        )

    def attach(self, engine_port: int) -> None:
        """Forward the events an engine publishes on `engine_port` from now on."""
        source = self._context.socket(self._zmq.SUB)
        source.setsockopt(self._zmq.LINGER, 0)
        source.setsockopt(self._zmq.SUBSCRIBE, b"")
        source.connect(f"tcp://127.0.0.1:{engine_port}")
        self._forwarding = asyncio.create_task(self._forward(source))

    async def _forward(self, source: Any) -> None:
        try:
            while True:
                topic, _, payload = await source.recv_multipart()
                await self._send(topic, payload)
        finally:
            source.close()

    async def _send(self, topic: bytes, payload: bytes) -> None:
        # Sequence numbers must keep rising across engines; each engine counts from 0.
        sequence = self._sequence.to_bytes(8, "big")
        self._sequence += 1
        await self._out.send_multipart([topic, sequence, payload])

    async def publish(self, events: list[dict[str, Any]]) -> None:
        """Send events an in-process engine produced (vLLM's format) to the router."""
        import msgspec

        await self._send(b"", msgspec.msgpack.encode([time.time(), events, 0]))

    async def detach_and_clear(self) -> None:
        """Stop forwarding (the engine is gone) and clear the router's view of this worker."""
        if self._forwarding is not None:
            self._forwarding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._forwarding
            self._forwarding = None
        await self.clear()

    async def clear(self) -> None:
        """Tell the router that none of this worker's blocks are cached any more."""
        import msgspec

        batch = [time.time(), [{"type": "AllBlocksCleared"}], 0]
        await self._send(b"", msgspec.msgpack.encode(batch))

    async def close(self) -> None:
        if self._forwarding is not None:
            self._forwarding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._forwarding
        self._relay.shutdown()
        self._out.close()
        self._context.term()
