"""The node's etcd relay (dynamod/cluster/etcd_relay.py) on loopback sockets: a connection
reaches the first member that accepts, passing over one that refuses, and stays with the
member that accepted last; the members' list is checked."""

from __future__ import annotations

import asyncio
import socket

import pytest

from dynamod.cluster import etcd_relay


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _echo_member() -> tuple[asyncio.Server, int, list[int]]:
    accepted: list[int] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1]), accepted


async def test_a_connection_reaches_the_first_member_that_accepts() -> None:
    dead = _closed_port()
    server, port, accepted = await _echo_member()
    relay = etcd_relay.Relay([("127.0.0.1", dead), ("127.0.0.1", port)])
    front = await asyncio.start_server(relay.serve, "127.0.0.1", 0)
    front_port = front.sockets[0].getsockname()[1]
    async with server, front:
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", front_port)
            writer.write(b"ping")
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(4), 2) == b"ping"
            writer.close()
        assert relay.preferred == 1 and relay.order() == [1, 0] and len(accepted) == 2


async def test_no_member_accepting_ends_the_client_connection() -> None:
    relay = etcd_relay.Relay([("127.0.0.1", _closed_port())])
    front = await asyncio.start_server(relay.serve, "127.0.0.1", 0)
    async with front:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", front.sockets[0].getsockname()[1]
        )
        assert await asyncio.wait_for(reader.read(10), 3) == b""  # closed, nothing relayed
        writer.close()


def test_members_are_checked() -> None:
    assert etcd_relay.parse_members("https://10.0.0.1:2379, 10.0.0.2:2379") == [
        ("10.0.0.1", 2379), ("10.0.0.2", 2379)
    ]  # fmt: skip
    for bad in ("10.0.0.1", "10.0.0.1:x", ":2379", "10.0.0.1:70000", "10.0.0.1:2379,",
                "https://10.0.0.1"):
        with pytest.raises(etcd_relay.RelayError, match="--members"):
            etcd_relay.parse_members(bad)


async def test_a_member_that_accepts_and_resets_is_passed_over() -> None:
    """A half-open member (it accepts, then ends the connection without a byte) is tried
    last for a while, so the next connection goes to one that answers."""

    async def resets(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    half_open = await asyncio.start_server(resets, "127.0.0.1", 0)
    server, port, accepted = await _echo_member()
    relay = etcd_relay.Relay(
        [("127.0.0.1", int(half_open.sockets[0].getsockname()[1])), ("127.0.0.1", port)]
    )
    front = await asyncio.start_server(relay.serve, "127.0.0.1", 0)
    front_port = front.sockets[0].getsockname()[1]
    async with half_open, server, front:
        reader, writer = await asyncio.open_connection("127.0.0.1", front_port)
        assert await asyncio.wait_for(reader.read(10), 2) == b""  # the half-open one
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", front_port)
        writer.write(b"ping")
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(4), 2) == b"ping"
        writer.close()
        assert relay.order()[0] == 1 and len(accepted) == 1
