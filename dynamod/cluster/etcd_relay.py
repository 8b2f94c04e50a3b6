"""The node's etcd relay (`python -m dynamod.cluster.etcd_relay`): one address on
127.0.0.1 for Dynamo's processes, relaying each connection, as bytes, to the first member of
the cluster's etcd that accepts it (the last one that did, first).

Why: Dynamo 1.6.1's etcd client, given the members' list, keeps sending a share of its calls
to a member that is gone, and answers each failure by reconnecting (13-25 times while the HA
test held one member down); a watch it has just resynced before such a reconnect goes silent,
so the frontend never saw a shard's new taints and the push failed its route check. Through
the relay Dynamo has one endpoint: when its member goes, its connections end, and the next
ones reach a member that is there.

TLS stays end to end: Dynamo's client certificate logs it in at the member (its CN is the
stack's user), and it checks the member's certificate, which is valid for 127.0.0.1. etcd's
own gRPC proxy was tried first: it refuses a client certificate with a CN, and through it
Dynamo's transactions reached the members without their login ("permission denied").

Bad input: one line, exit 2."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence

from dynamod.core.errors import DynamodError

CONNECT_S = 1.0  # a member that takes longer to accept is passed over
PASS_OVER_S = 5.0  # a member that ended a connection without a byte is tried last this long
CHUNK = 64 * 1024


class RelayError(DynamodError, ValueError):
    """A bad argument: the members' list or a port."""


def parse_members(spec: str) -> list[tuple[str, int]]:
    """'https://10.0.0.1:2379,10.0.0.2:2379' -> [('10.0.0.1', 2379), ('10.0.0.2', 2379)]:
    the members' client URLs as the stack lists them for every other client (the scheme is
    the members' business, the relay only carries bytes), or bare HOST:PORT."""
    members = []
    for part in spec.split(","):
        address = part.strip().removeprefix("https://").removeprefix("http://")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RelayError(f"--members: expected [https://]HOST:PORT,..., got {part!r}")
        members.append((host, int(port)))
    return members


class Relay:
    def __init__(self, members: list[tuple[str, int]]) -> None:
        self.members = members
        self.preferred = 0  # index of the member that accepted last
        self.passed_over: dict[int, float] = {}  # member -> monotonic time it is tried again

    def order(self) -> list[int]:
        """The members to try, in turn: the preferred one first, those that ended a
        connection without answering (a half-open member: it accepts, then resets) last."""
        n = len(self.members)
        now = asyncio.get_running_loop().time()
        turn = [(self.preferred + i) % n for i in range(n)]
        return sorted(turn, key=lambda i: self.passed_over.get(i, 0.0) > now)

    async def connect(self) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter] | None:
        """(member index, reader, writer) of the first member that accepts, or None."""
        for index in self.order():
            host, port = self.members[index]
            try:
                async with asyncio.timeout(CONNECT_S):
                    up_reader, up_writer = await asyncio.open_connection(host, port)
            except (OSError, TimeoutError):
                continue
            self.preferred = index
            return index, up_reader, up_writer
        return None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = await self.connect()
        if upstream is None:  # no member accepts: the client sees its connection end
            writer.close()
            return
        index, up_reader, up_writer = upstream
        pipes = [
            asyncio.ensure_future(_pipe(reader, up_writer)),
            asyncio.ensure_future(_pipe(up_reader, writer)),
        ]
        try:
            done, _ = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            if pipes[1] in done and not pipes[1].result():  # the member ended it, silent
                self.passed_over[index] = asyncio.get_running_loop().time() + PASS_OVER_S
                if self.preferred == index:
                    self.preferred = (index + 1) % len(self.members)
        finally:
            for task in pipes:
                task.cancel()
            for w in (writer, up_writer):
                w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """Copy until EOF or a broken connection; how many bytes went through."""
    moved = 0
    with contextlib.suppress(OSError):
        while data := await reader.read(CHUNK):
            moved += len(data)
            writer.write(data)
            await writer.drain()
    return moved


async def run(members: list[tuple[str, int]], port: int) -> None:
    relay = Relay(members)
    server = await asyncio.start_server(relay.serve, "127.0.0.1", port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynamod.cluster.etcd_relay", description=__doc__)
    parser.add_argument("--members", required=True, help="every etcd member's client URL")
    parser.add_argument("--port", type=int, default=23790, help="the relay's, on 127.0.0.1")
    args = parser.parse_args(argv)
    try:
        members = parse_members(args.members)
        if not 0 < args.port < 65536:
            raise RelayError(f"--port: expected 1-65535, got {args.port}")
    except RelayError as exc:
        print(f"dynamod.cluster.etcd_relay: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run(members, args.port))
    except OSError as exc:
        print(f"dynamod.cluster.etcd_relay: cannot listen on 127.0.0.1:{args.port}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
