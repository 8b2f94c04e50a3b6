"""dynamod's asyncio etcd v3 client: the calls the supervisor makes (keys, prefixes, leases,
compare-and-swap, transactions, prefix watches), each with a per-call timeout, failover between
the cluster's endpoints, re-authentication when the token expires, and errors that name the
endpoint, the operation and the key. The wire work is aetcd's (see connection.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import grpc
from aetcd import exceptions as aetcd_errors
from aetcd import rpc

from dynamod.rollout.etcd.connection import Connection, Login, generation
from dynamod.rollout.etcd.endpoints import Endpoint, Rotation, parse_endpoints
from dynamod.rollout.etcd.errors import (
    EtcdAuthError,
    EtcdError,
    EtcdPermissionDenied,
    Failure,
    FailureKind,
    classify,
    electing,
)
from dynamod.rollout.etcd.records import (
    Compare,
    EtcdAuth,
    KeyValue,
    LeaseInfo,
    TxnDelete,
    TxnOp,
    TxnPut,
    WatchEvent,
    prefix_range_end,
)

if TYPE_CHECKING:
    import aiohttp

DEFAULT_TIMEOUT_S = 2.0
# A call that found the cluster electing a leader tries again this often, for this long: an
# election takes an election timeout or two (1 s each by default; longer on a loaded machine).
ELECTION_WAIT_S = 0.2
ELECTION_RETRY_S = 3.0
# An idempotent call whose connection broke under it (reset, closed) goes round the members
# again on new connections, up to this many rounds: the first at once, then after 0.05,
# 0.1 and 0.2 s. A link or proxy that resets 30 % of the connections failed a read it hit
# about 1 time in 11 with one round more (0.3 x 0.3; CI, the flaky-worker-network
# runbook's push, twice); with four, about 1 in 400 (0.3^5). A member that is gone refuses
# the new connections, which is no broken one: the rounds stop there.
BROKEN_ROUNDS = 4
BROKEN_WAIT_S = 0.05

T = TypeVar("T")

_COMPARE_RESULT = {
    "==": rpc.Compare.EQUAL,
    "!=": rpc.Compare.NOT_EQUAL,
    "<": rpc.Compare.LESS,
    ">": rpc.Compare.GREATER,
}


class _NoAnswer(Exception):
    """A member closed a call without an answer or an error: like one that did not answer."""


class _Missing(Exception):
    """etcd answered NOT_FOUND (a lease that is gone): some callers read that as an answer."""


class EtcdClient:
    """Typed etcd v3 client. Use as `async with EtcdClient(url) as etcd:`.

    `endpoints` is one URL, a comma-separated list (as ETCD_ENDPOINTS holds) or a list; a call
    that finds its member unreachable tries the next one. `auth` adds a user (re-authenticated
    when etcd expires the token) and TLS. `session` is accepted for callers written for the
    earlier HTTP client and not used: gRPC keeps its own connections.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        auth: EtcdAuth | None = None,
    ) -> None:
        del session  # see the class docstring
        self._rotation = Rotation(parse_endpoints(endpoints))
        self.timeout_s = timeout_s
        self.auth = auth
        self.login = Login(auth)  # one token for all of this client's connections
        self._connections: dict[Endpoint, Connection] = {}
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        """The URL of the member in use."""
        return self._rotation.current.url

    @property
    def endpoints(self) -> list[str]:
        return [e.url for e in self._rotation.endpoints]

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        connections, self._connections = list(self._connections.values()), {}
        for conn in connections:
            await conn.close_gracefully(0)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    # -- kv -------------------------------------------------------------------------------------

    async def get_kv(self, key: str) -> KeyValue | None:
        got = await self._call("get", key, lambda c: c.get(key.encode()))
        return None if got is None else _kv(got)

    async def get(self, key: str) -> bytes | None:
        kv = await self.get_kv(key)
        return kv.value if kv is not None else None

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        return (await self.get_prefix_at(prefix))[0]

    async def get_prefix_at(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the store's revision the read was made at: a watch
        from the revision after it sees every change since, none twice."""
        start, end = _range(prefix)
        got = await self._call("get_prefix", prefix, lambda c: c.get_range(start, end))
        return [_kv(item) for item in got], int(got.header.revision)

    async def first_key(self, start: str, prefix: str) -> str | None:
        """The first key under `prefix` at or after `start` (byte order), or None: one key
        and no value, however many the prefix holds. A caller that wants one kind of key
        from each folder under a prefix reads each folder's first key, then skips the
        folder whole (its range's end), instead of reading every key of every folder."""
        request = rpc.RangeRequest(
            key=start.encode(), range_end=prefix_range_end(prefix), limit=1, keys_only=True
        )

        async def send(conn: Connection) -> Any:
            return await conn.kvstub.Range(request, timeout=self.timeout_s, metadata=conn.metadata)

        reply = await self._call("first_key", prefix, send)
        return reply.kvs[0].key.decode() if reply.kvs else None

    async def put(self, key: str, value: str | bytes, lease: int = 0) -> None:
        await self._call("put", key, lambda c: c.put(key.encode(), _bytes(value), lease or None))

    async def delete(self, key: str) -> int:
        """Delete one key; returns how many keys went away (0 or 1)."""
        got = await self._call("delete", key, lambda c: c.delete(key.encode()))
        return 0 if got is None else int(got.deleted)

    async def delete_prefix(self, prefix: str) -> int:
        start, end = _range(prefix)
        got = await self._call("delete_prefix", prefix, lambda c: c.delete_range(start, end))
        return int(got.deleted)

    async def put_if(
        self, key: str, value: str | bytes, expected_mod_revision: int, lease: int = 0
    ) -> bool:
        """Compare-and-swap: write only if the key's mod_revision is still the expected one.

        `expected_mod_revision=0` means "only if the key does not exist". Returns whether the
        write happened.
        """
        compare = [Compare(key, "mod", "==", expected_mod_revision)]
        return (await self._txn("put_if", key, compare, [TxnPut(key, value, lease)], []))[0]

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
        *,
        idempotent: bool = False,
    ) -> bool:
        """If every `compare` holds apply `success`, else `failure` (atomically); True if held.
        `idempotent`: applying it twice leaves what once does (no compare; puts and deletes
        of fixed keys), so it may be sent again as a put is (see _call)."""
        return (await self.txn_at(compare, success, failure, idempotent=idempotent))[0]

    async def txn_at(
        self,
        compare: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
        *,
        idempotent: bool = False,
    ) -> tuple[bool, int]:
        """As txn, and the store's revision after it: a read or watch at that revision or
        later sees what it wrote."""
        key = compare[0].key if compare else (success[0].key if success else None)
        return await self._txn("txn", key, compare, success, failure, idempotent)

    async def _txn(
        self,
        operation: str,
        key: str | None,
        compare: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp],
        idempotent: bool = False,
    ) -> tuple[bool, int]:
        request = rpc.TxnRequest(
            compare=[_compare(c) for c in compare],
            success=[_request_op(op) for op in success],
            failure=[_request_op(op) for op in failure],
        )

        async def send(conn: Connection) -> Any:
            await conn.connect()
            return await conn.kvstub.Txn(request, timeout=self.timeout_s, metadata=conn.metadata)

        # A timed-out transaction may have applied; sending it to another member could apply it
        # twice, or report a compare that failed only because the first attempt succeeded
        # (unless the caller says applying it twice does no harm).
        reply = await self._call(operation, key, send, idempotent=idempotent and not compare)
        return bool(reply.succeeded), int(reply.header.revision)

    # -- watches --------------------------------------------------------------------------------

    async def watch_prefix(
        self, prefix: str, *, start_revision: int | None = None
    ) -> AsyncIterator[WatchEvent]:
        """Every change under `prefix` from now on (or from `start_revision`), in order.

        A stream broken by its member's loss or an expired token is opened again on the next
        endpoint from the revision after the last event, so no event is lost or repeated. Raises
        EtcdError when every endpoint has failed in a row, or when the revision to resume from
        has been compacted away (then read the prefix again and watch from there).
        """
        start, end = _range(prefix)
        next_revision = start_revision
        if next_revision is None:
            next_revision = (
                await self._call(
                    "watch_prefix",
                    prefix,
                    lambda c: _current_revision(c, start, end, self.timeout_s),
                )
                + 1
            )
        failures: list[tuple[Endpoint, Failure]] = []
        while True:
            endpoint = self._rotation.current
            conn = self._connection(endpoint)
            events: asyncio.Queue[Any] = asyncio.Queue()
            stream = None
            used = self.login.token
            try:
                await conn.connect()
                used = self.login.token
                stream = await _open_watch(conn, start, end, next_revision, events)
                while True:
                    item = await events.get()
                    if item is None:
                        return  # the stream was shut down (the client closed)
                    if item is _STREAM_ENDED:
                        raise _StreamEnded
                    if isinstance(item, BaseException):
                        raise item
                    failures.clear()
                    event = _event(item)
                    next_revision = event.mod_revision + 1
                    yield event
            except aetcd_errors.RevisionCompactedError as err:
                detail = (
                    f"revision {next_revision} was compacted (etcd keeps from "
                    f"{err.compacted_revision}): read {prefix!r} again and watch from there"
                )
                raise EtcdError(endpoint.url, "watch_prefix", prefix, detail) from None
            except (Exception, asyncio.CancelledError) as err:
                if isinstance(err, asyncio.CancelledError) and _cancelled():
                    raise
                await self._watch_broke(err, endpoint, conn, prefix, failures, used)
            finally:
                if stream is not None:
                    with contextlib.suppress(Exception):
                        await stream.shutdown()

    async def _watch_broke(
        self,
        err: Exception | asyncio.CancelledError,
        endpoint: Endpoint,
        conn: Connection,
        prefix: str,
        failures: list[tuple[Endpoint, Failure]],
        used: str | None,
    ) -> None:
        """A watch stream failed: return to open it again (after a new token, or on the
        next endpoint), or raise when that cannot help."""
        failure = (
            _CLOSED_UNDER_CALL
            if isinstance(err, asyncio.CancelledError | _StreamEnded | grpc.aio.UsageError)
            else self._failure(err)
        )
        if failure is None:
            raise err
        if failure.kind is FailureKind.TOKEN_EXPIRED and not _seen(failures, failure):
            failures.append((endpoint, failure))
            await self._reauthenticate(conn, "watch_prefix", prefix, used)
            return
        if not failure.try_another_endpoint:
            raise self._error(endpoint, "watch_prefix", prefix, failure) from None
        failures.append((endpoint, failure))
        self._drop(endpoint)
        if len(failures) >= len(self._rotation.endpoints):
            raise self._all_failed("watch_prefix", prefix, failures) from None

    # -- leases ---------------------------------------------------------------------------------

    async def lease_grant(self, ttl: int) -> int:
        lease = await self._call("lease_grant", None, lambda c: c.lease(ttl))
        return int(lease.id)

    async def lease_keepalive(self, lease_id: int) -> int | None:
        """Refresh a lease once; its TTL after the refresh, or None if it no longer exists.

        Only etcd's answer of TTL 0 says the lease is gone. A stream that ends without an
        answer is a member that did not answer (the next one is tried); read as "gone", it
        made a node take a new lease while its own was alive, on a member that was failing.
        """

        async def refresh(conn: Connection) -> Any:
            reply = await conn.refresh_lease(lease_id)
            if reply is None:
                raise _NoAnswer("the keepalive stream ended without an answer")
            return reply

        reply = await self._call("lease_keepalive", None, refresh)
        ttl = int(reply.TTL)
        return ttl if ttl > 0 else None

    async def lease_revoke(self, lease_id: int) -> bool:
        """Revoke a lease and delete every key attached to it.

        Idempotent: a lease that is already gone (revoked, expired) is not an error. Returns
        whether this call revoked it.
        """
        try:
            await self._call(
                "lease_revoke", None, lambda c: c.revoke_lease(lease_id), missing_ok=True
            )
        except _Missing:
            return False
        return True

    async def lease_time_to_live(self, lease_id: int) -> LeaseInfo | None:
        """The lease's remaining TTL and the keys attached to it; None if it no longer exists."""
        reply = await self._call(
            "lease_time_to_live", None, lambda c: c.get_lease_info(lease_id, keys=True)
        )
        ttl = int(reply.TTL)
        if ttl < 0:
            return None
        return LeaseInfo(
            lease_id=lease_id,
            ttl=ttl,
            granted_ttl=int(reply.grantedTTL),
            keys=sorted(bytes(k).decode(errors="replace") for k in reply.keys),
        )

    # -- calls, failover, errors -----------------------------------------------------------------

    async def _call(
        self,
        operation: str,
        key: str | None,
        send: Callable[[Connection], Awaitable[T]],
        *,
        idempotent: bool = True,
        missing_ok: bool = False,
    ) -> T:
        """`send` on the member in use; on to the next member when one does not answer.
        When the members that answered all said they are electing a leader, an idempotent
        call goes round them again every ELECTION_WAIT_S, for up to ELECTION_RETRY_S; when
        a connection broke under it (reset), again on new connections, up to BROKEN_ROUNDS
        times (a single member behind a proxy that resets failed a push's read outright)."""
        electing_until: float | None = None
        broken_rounds = 0
        while True:
            failures: list[tuple[Endpoint, Failure]] = []
            for endpoint in self._rotation.attempt_order():
                conn = self._connection(endpoint)
                failure: Failure | None
                try:
                    return await self._send_once(conn, operation, key, send)
                except asyncio.CancelledError:
                    if _cancelled():
                        raise
                    failure = _CLOSED_UNDER_CALL
                except grpc.aio.UsageError:  # the channel closed before the call reached it
                    failure = _CLOSED_UNDER_CALL
                except Exception as err:
                    failure = self._failure(err)
                    if failure is None:
                        raise
                if failure.kind is FailureKind.NOT_FOUND and missing_ok:
                    raise _Missing(failure.detail)
                if not failure.try_another_endpoint:
                    raise self._error(endpoint, operation, key, failure) from None
                failures.append((endpoint, failure))
                if failure.kind is not FailureKind.ELECTION:  # an electing member is up: kept
                    self._drop(endpoint)
                if failure.kind is FailureKind.TIMEOUT and not idempotent:
                    break
            if (idempotent and broken_rounds < BROKEN_ROUNDS
                    and any(f.broken for _, f in failures)):  # fmt: skip
                if broken_rounds:  # the first at once, then backing off
                    await asyncio.sleep(BROKEN_WAIT_S * 2 ** (broken_rounds - 1))
                broken_rounds += 1  # the broken connections were dropped: new ones now
                continue
            now = asyncio.get_running_loop().time()
            if electing_until is None:
                electing_until = now + ELECTION_RETRY_S
            if not (idempotent and electing([f for _, f in failures]) and now < electing_until):
                raise self._all_failed(operation, key, failures)
            await asyncio.sleep(ELECTION_WAIT_S)

    async def _send_once(
        self,
        conn: Connection,
        operation: str,
        key: str | None,
        send: Callable[[Connection], Awaitable[T]],
    ) -> T:
        """One member: send, and once more with a fresh token if etcd expired ours."""
        await conn.connect()
        used = self.login.token
        try:
            return await send(conn)
        except Exception as err:
            failure = self._failure(err)
            if failure is None or failure.kind is not FailureKind.TOKEN_EXPIRED:
                raise
        await self._reauthenticate(conn, operation, key, used)
        return await send(conn)

    async def _reauthenticate(
        self, conn: Connection, operation: str, key: str | None, used: str | None
    ) -> None:
        try:
            await conn.authenticate(used)
        except Exception as err:
            failure = self._failure(err)
            if failure is None:
                raise
            raise self._error(conn.endpoint, operation, key, failure) from None

    def _connection(self, endpoint: Endpoint) -> Connection:
        conn = self._connections.get(endpoint)
        if conn is not None and conn.generation != generation():  # after reconnect_all
            self._retire(self._connections.pop(endpoint))
            conn = None
        if conn is None:
            conn = Connection(endpoint, self.auth, self.timeout_s, self.login)
            self._connections[endpoint] = conn
        return conn

    def _drop(self, endpoint: Endpoint) -> None:
        """Forget a member's connection (the next call opens a fresh one) and move past it.

        Calls still in flight on it get time to finish before its channel closes: a login
        and a call, each up to `timeout_s` (a call cut off by the close fails over).
        """
        self._rotation.advance(endpoint)
        conn = self._connections.pop(endpoint, None)
        if conn is not None:
            self._retire(conn)

    def _retire(self, conn: Connection) -> None:
        """Close a connection this client no longer uses once its calls had their time."""
        grace = _CLOSE_GRACE_CALLS * self.timeout_s
        task = asyncio.get_running_loop().create_task(conn.close_gracefully(grace))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _failure(self, err: Exception) -> Failure | None:
        """What a gRPC / aetcd error means; None for anything else (a bug: let it propagate)."""
        if isinstance(err, aetcd_errors.WatchTimeoutError):
            code, details = "DEADLINE_EXCEEDED", ""
        elif isinstance(err, _NoAnswer):
            return Failure(FailureKind.UNREACHABLE, str(err))
        else:
            status = err if isinstance(err, grpc.aio.AioRpcError) else err.__cause__
            if not isinstance(status, grpc.aio.AioRpcError):
                return None
            code, details = status.code().name, status.details() or ""
        return classify(
            code,
            details,
            user=self._user,
            timeout_s=self.timeout_s,
            client_cert=self.auth is not None and bool(self.auth.cert_pem),
        )

    @property
    def _user(self) -> str | None:
        return self.auth.user if self.auth is not None else None

    def _error(
        self, endpoint: Endpoint, operation: str, key: str | None, failure: Failure
    ) -> EtcdError:
        if failure.kind is FailureKind.DENIED:
            return EtcdPermissionDenied(
                endpoint.url, operation, key, failure.detail, endpoint.address
            )
        if failure.kind in (FailureKind.REFUSED_AUTH, FailureKind.TLS):
            return EtcdAuthError(endpoint.url, operation, key, failure.detail, endpoint.address)
        return EtcdError(endpoint.url, operation, key, failure.detail)

    def _all_failed(
        self, operation: str, key: str | None, failures: list[tuple[Endpoint, Failure]]
    ) -> EtcdError:
        if len(failures) == 1:
            endpoint, failure = failures[0]
            return self._error(endpoint, operation, key, failure)
        where = ",".join(e.url for e, _ in failures)
        detail = "; ".join(f"{e.address}: {f.detail}" for e, f in failures)
        return EtcdError(where, operation, key, f"no endpoint answered ({detail})")


class _StreamEnded(Exception):
    """aetcd's watch stream task ended without telling its callbacks why."""


_STREAM_ENDED = object()
# gRPC cancels the calls still in flight on a channel it closes, and the caller sees a bare
# CancelledError although nobody cancelled its task. Seen in the cluster-ha test: a call
# failing over closed a connection another loop's call was using, and that loop ended
# silently. Such a call is a failure like a timeout (it may have applied), never a cancel.
_CLOSED_UNDER_CALL = Failure(
    FailureKind.TIMEOUT, "its connection was closed under the call (it may have applied)"
)
_CLOSE_GRACE_CALLS = 3


async def _open_watch(
    conn: Connection, start: bytes, end: bytes, revision: int, events: asyncio.Queue[Any]
) -> Any:
    """A watch stream on [start, end) from `revision`, its events (and its end) put on
    `events`."""
    await conn.connect()
    stream = conn.new_watcher()
    try:
        await stream.add_callback(start, events.put, range_end=end, start_revision=revision)
    except BaseException:  # the caller gets no stream to shut down
        with contextlib.suppress(Exception):
            await stream.shutdown()
        raise
    # aetcd's stream task catches Exception only: when the channel is closed under it
    # (another call failed over) it ends with CancelledError and tells no callback, which
    # would leave this watch waiting for good.
    stream._request_handler.add_done_callback(functools.partial(_ended, events))
    return stream


def _ended(events: asyncio.Queue[Any], _: object) -> None:
    events.put_nowait(_STREAM_ENDED)


def _cancelled() -> bool:
    """Whether the running task was asked to stop (as opposed to gRPC closing a channel)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _seen(failures: list[tuple[Endpoint, Failure]], failure: Failure) -> bool:
    return any(f.kind is failure.kind for _, f in failures)


async def _current_revision(conn: Connection, start: bytes, end: bytes, timeout_s: float) -> int:
    await conn.connect()
    request = rpc.RangeRequest(key=start, range_end=end, count_only=True)
    reply = await conn.kvstub.Range(request, timeout=timeout_s, metadata=conn.metadata)
    return int(reply.header.revision)


def _range(prefix: str) -> tuple[bytes, bytes]:
    return (prefix.encode() or b"\0"), prefix_range_end(prefix)


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _kv(item: Any) -> KeyValue:
    return KeyValue(
        key=bytes(item.key).decode(errors="replace"),
        value=bytes(item.value),
        lease=int(item.lease),
        mod_revision=int(item.mod_revision),
    )


def _event(item: Any) -> WatchEvent:
    return WatchEvent(
        kind="delete" if item.kind == "DELETE" else "put",
        key=bytes(item.kv.key).decode(errors="replace"),
        value=bytes(item.kv.value),
        mod_revision=int(item.kv.mod_revision),
        lease=int(item.kv.lease),
    )


def _compare(compare: Compare) -> Any:
    message = rpc.Compare(key=compare.key.encode(), result=_COMPARE_RESULT[compare.op])
    if compare.target == "value":
        message.target = rpc.Compare.VALUE
        message.value = _bytes(compare.value) if not isinstance(compare.value, int) else b""
    else:
        revision = int(compare.value) if isinstance(compare.value, int) else 0
        if compare.target == "mod":
            message.target, message.mod_revision = rpc.Compare.MOD, revision
        elif compare.target == "version":
            message.target, message.version = rpc.Compare.VERSION, revision
        else:
            message.target, message.create_revision = rpc.Compare.CREATE, revision
    return message


def _request_op(op: TxnOp) -> Any:
    if isinstance(op, TxnPut):
        put = rpc.PutRequest(key=op.key.encode(), value=_bytes(op.value), lease=op.lease)
        return rpc.RequestOp(request_put=put)
    assert isinstance(op, TxnDelete)
    start, end = _range(op.key) if op.prefix else (op.key.encode(), b"")
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=start, range_end=end))
