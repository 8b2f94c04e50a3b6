"""One gRPC connection to one etcd member, on aetcd 1.0.0: aetcd's client with the two things it
lacks, a TLS channel (CA and client certificate as PEM contents) and authentication that can be
repeated when etcd lets the token expire. Everything else (requests, replies, watch streams) is
aetcd's. A client's connections share one `Login`: a token etcd issued is good on every member.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher

from dynamod.rollout.etcd.endpoints import Endpoint
from dynamod.rollout.etcd.records import EtcdAuth

# Reconnect quickly after an etcd restart (gRPC's default backoff grows to 120 s), and notice
# a silent peer on an open stream within ~15 s. etcd refuses pings more often than every 5 s.
# Not "grpc.min_reconnect_backoff_ms": gRPC takes it as the *minimum connect timeout*
# (default 20 s); at 100 ms each attempt to open a connection was cut off after its backoff
# (100 ms .. 1 s), so a member slower than that to answer the HTTP/2 handshake (a restarted
# etcd on a loaded machine) could never be reached. (gRPC's global subchannel pool is
# kept: a failover to another member reuses a connection another client of this process
# has open to it; with a pool per channel, each failover paid a new TLS handshake and the
# cluster-ha test's nodes missed their 2 s registry lease.)
CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}
# The connections' generation, in their channel arguments: gRPC's pool keys a connection by
# its address and arguments, so connections opened after `reconnect_all` are new TCP
# connections (shared among themselves), not the ones open before it.
_GENERATION_ARG = "dynamod.etcd_generation"
_generation = 0


def reconnect_all() -> None:
    """Every etcd client of this process opens its connections afresh at its next call.
    For a link that has just come back: the connections open across its cut are stuck
    until TCP's next retransmission, whose interval doubled through the cut (seconds)."""
    global _generation
    _generation += 1


def generation() -> int:
    return _generation


class Login:
    """The auth token one client's connections share, so a new connection (a failover, a
    member's connection dropped after a call it did not answer) logs in only when there is
    no token yet or etcd refused ours.

    A login is the costliest call etcd serves: it checks the password with bcrypt and puts
    the token through raft, so it needs the leader and a disk write. With a login per
    connection, the cluster-ha test's nodes, failing over while their members elected a new
    leader on a loaded machine, logged in again on every attempt; each login outlasted the
    call's deadline, the next attempt dropped the connection and logged in again, and every
    node's registry lease expired with two members up (CI, and 4 of 8 runs here beside two
    CPU hogs and a disk writer). etcd puts a simple token through raft, so every member
    knows it; one that does not yet (or has let it lapse) answers "invalid auth token", and
    the client logs in again (`renew`).
    """

    def __init__(self, auth: EtcdAuth | None) -> None:
        self._auth = auth
        self.token: str | None = None
        self.logins = 0  # how many times etcd was asked for a token (tests and logs read it)
        self._lock = asyncio.Lock()

    @property
    def needed(self) -> bool:
        return self._auth is not None and self._auth.user is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("token", self.token),) if self.token is not None else None

    async def ensure(self, stub: Any, timeout_s: float) -> None:
        """A token, logging in only if there is none yet."""
        if self.needed and self.token is None:
            await self.renew(stub, timeout_s, stale=None)

    async def renew(self, stub: Any, timeout_s: float, stale: str | None) -> None:
        """A new token in place of `stale` (the one etcd refused). Calls refused at once log
        in once: those that waited find the token already replaced and use it."""
        if not self.needed:
            return
        assert self._auth is not None
        async with self._lock:
            if self.token != stale:
                return
            self.logins += 1
            reply = await stub.Authenticate(
                rpc.AuthenticateRequest(name=self._auth.user, password=self._auth.password or ""),
                timeout=timeout_s,
            )
            self.token = str(reply.token)


class Connection(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type information
    """aetcd's Client bound to one endpoint, with TLS and the client's shared login."""

    def __init__(
        self, endpoint: Endpoint, auth: EtcdAuth | None, timeout_s: float, login: Login
    ) -> None:
        self.login = login  # before aetcd's __init__, which sets `metadata`
        super().__init__(
            host=endpoint.host, port=endpoint.port, timeout=timeout_s, options=CHANNEL_OPTIONS
        )
        self.endpoint = endpoint
        self.generation = _generation
        self._auth = auth
        self._connect_lock = asyncio.Lock()
        self._retired = False  # closed: calls still holding it fail, it never reconnects

    @property
    def tls(self) -> bool:
        return self.endpoint.tls or (self._auth is not None and self._auth.tls)

    async def connect(self) -> None:
        """Open the channel and, with a user, authenticate; raises gRPC's errors as they come."""
        if self._connected.is_set():
            return
        async with self._connect_lock:
            if self._connected.is_set():
                return
            if self._retired:
                raise grpc.aio.UsageError("Channel is closed.")
            channel = self._open_channel()
            self.channel = channel
            self.auth_stub = rpc.AuthStub(channel)
            self.kvstub = rpc.KVStub(channel)
            self.clusterstub = rpc.ClusterStub(channel)
            self.leasestub = rpc.LeaseStub(channel)
            self.maintenancestub = rpc.MaintenanceStub(channel)
            try:
                await self.login.ensure(self.auth_stub, self._timeout)
                if self._retired:  # closed while we logged in: not connected after all
                    raise grpc.aio.UsageError("Channel is closed.")
            except BaseException:
                await channel.close()
                raise
            self._connected.set()

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """What aetcd's calls carry: the shared login's current token."""
        return self.login.metadata

    @metadata.setter
    def metadata(self, value: object) -> None:
        """aetcd's __init__ sets it to None; the token lives in the shared login."""

    async def authenticate(self, stale: str | None) -> None:
        """Get a new token for our user in place of `stale`, the one etcd refused."""
        await self.login.renew(self.auth_stub, self._timeout, stale)

    def new_watcher(self) -> Any:
        """A watch stream of its own, carrying the current token."""
        return watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )

    async def close_gracefully(self, grace_s: float) -> None:
        """Close, letting calls already in flight finish within `grace_s`. The stubs stay:
        a call that reaches one afterwards gets gRPC's UsageError ("Channel is closed"),
        which the client takes as a call cut off, where a reset stub (None) made it an
        AttributeError (seen: a push answered 500 in the cluster-ha test)."""
        self._retired = True
        self._connected.clear()
        if self.channel is not None:
            await self.channel.close(grace=grace_s)

    def _open_channel(self) -> Any:
        target = self.endpoint.address
        options = list(CHANNEL_OPTIONS.items())
        if self.generation:
            options.append((_GENERATION_ARG, self.generation))
        if not self.tls:
            return grpc.aio.insecure_channel(target, options=options)
        auth = self._auth or EtcdAuth()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_pem(auth.ca_pem),
            private_key=_pem(auth.key_pem),
            certificate_chain=_pem(auth.cert_pem),
        )
        return grpc.aio.secure_channel(target, credentials, options=options)


def _pem(text: str | None) -> bytes | None:
    return text.encode() if text else None
