"""A small asyncio etcd v3 client over etcd's JSON gRPC gateway.

The `etcd3` package pins protobuf<4, which clashes with vLLM and Ray, so dynamod speaks the
gateway's JSON directly (`POST /v3/kv/range` and friends). Keys and values travel base64-encoded;
int64 fields come back as JSON strings and fields equal to their default are omitted.

One client talks to one endpoint. `ETCD_ENDPOINTS` may hold a comma-separated list; pass one of
its entries.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import aiohttp

DEFAULT_TIMEOUT_S = 2.0

# gRPC status code etcd answers with when a lease id is unknown (revoked or expired).
_GRPC_NOT_FOUND = 5


class EtcdError(Exception):
    """An etcd request failed: unreachable, timed out, or refused by the server."""

    def __init__(self, endpoint: str, operation: str, key: str | None, detail: str) -> None:
        super().__init__(endpoint, operation, key, detail)
        self.endpoint = endpoint
        self.operation = operation
        self.key = key
        self.detail = detail

    def __str__(self) -> str:
        target = f" {self.key!r}" if self.key is not None else ""
        return f"etcd {self.operation}{target} at {self.endpoint} failed: {self.detail}"


class _ServerError(Exception):
    """The gateway answered with an error body; carries the gRPC code for callers to branch on."""

    def __init__(self, code: int | None, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    lease: int
    mod_revision: int


@dataclass(frozen=True)
class LeaseInfo:
    lease_id: int
    ttl: int
    granted_ttl: int
    keys: list[str]


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def prefix_range_end(prefix: str) -> bytes:
    """The exclusive upper bound that makes a range request cover every key under `prefix`."""
    raw = prefix.encode()
    if not raw:
        return b"\0"  # etcd reads "\0" as "to the end of the keyspace"
    return raw[:-1] + bytes([raw[-1] + 1])  # UTF-8 never holds 0xff, so there is no carry


def _normalise_endpoint(endpoint: str) -> str:
    endpoint = endpoint.strip().rstrip("/")
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    return endpoint


class EtcdClient:
    """Typed etcd v3 client. Use as `async with EtcdClient(url) as etcd:`.

    Pass `session` to share an aiohttp session; the client then leaves closing it to the caller.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.endpoint = _normalise_endpoint(endpoint)
        self.timeout_s = timeout_s
        self._session = session
        self._owns_session = session is None

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
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    # -- kv -------------------------------------------------------------------------------------

    async def get_kv(self, key: str) -> KeyValue | None:
        reply = await self._call("get", "/v3/kv/range", {"key": _b64(key)}, key)
        kvs = _parse_kvs(reply)
        return kvs[0] if kvs else None

    async def get(self, key: str) -> bytes | None:
        kv = await self.get_kv(key)
        return kv.value if kv is not None else None

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        body = {"key": _b64(prefix or "\0"), "range_end": _b64(prefix_range_end(prefix))}
        reply = await self._call("get_prefix", "/v3/kv/range", body, prefix)
        return _parse_kvs(reply)

    async def put(self, key: str, value: str | bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        await self._call("put", "/v3/kv/put", body, key)

    async def delete(self, key: str) -> int:
        """Delete one key; returns how many keys went away (0 or 1)."""
        reply = await self._call("delete", "/v3/kv/deleterange", {"key": _b64(key)}, key)
        return int(reply.get("deleted", 0))

    async def delete_prefix(self, prefix: str) -> int:
        body = {"key": _b64(prefix or "\0"), "range_end": _b64(prefix_range_end(prefix))}
        reply = await self._call("delete_prefix", "/v3/kv/deleterange", body, prefix)
        return int(reply.get("deleted", 0))

    async def put_if(
        self, key: str, value: str | bytes, expected_mod_revision: int, lease: int = 0
    ) -> bool:
        """Compare-and-swap: write only if the key's mod_revision is still the expected one.

        `expected_mod_revision=0` means "only if the key does not exist". Returns whether the
        write happened.
        """
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        body = {
            "compare": [
                {
                    "key": _b64(key),
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": str(expected_mod_revision),
                }
            ],
            "success": [{"request_put": put}],
        }
        reply = await self._call("put_if", "/v3/kv/txn", body, key)
        return bool(reply.get("succeeded", False))

    # -- leases ---------------------------------------------------------------------------------

    async def lease_grant(self, ttl: int) -> int:
        reply = await self._call("lease_grant", "/v3/lease/grant", {"TTL": ttl}, None)
        return int(reply["ID"])

    async def lease_revoke(self, lease_id: int) -> bool:
        """Revoke a lease and delete every key attached to it.

        Idempotent: a lease that is already gone (revoked, expired) is not an error. Returns
        whether this call revoked it.
        """
        body = {"ID": str(lease_id)}
        try:
            await self._call("lease_revoke", "/v3/lease/revoke", body, None, raw_errors=True)
        except _ServerError as err:
            if err.code == _GRPC_NOT_FOUND:
                return False
            detail = f"lease {lease_id}: {err.detail}"
            raise EtcdError(self.endpoint, "lease_revoke", None, detail) from None
        return True

    async def lease_keepalive(self, lease_id: int) -> int | None:
        """Refresh a lease once; its TTL again, or None if it no longer exists (expired or
        revoked). The gateway answers the first message of the keep-alive stream."""
        reply = await self._call(
            "lease_keepalive", "/v3/lease/keepalive", {"ID": str(lease_id)}, None
        )
        ttl = int(reply.get("result", reply).get("TTL", 0))
        return ttl if ttl > 0 else None

    async def lease_time_to_live(self, lease_id: int) -> LeaseInfo | None:
        """The lease's remaining TTL and the keys attached to it; None if it no longer exists."""
        body = {"ID": str(lease_id), "keys": True}
        reply = await self._call("lease_time_to_live", "/v3/lease/timetolive", body, None)
        ttl = int(reply.get("TTL", -1))
        if ttl < 0:
            return None
        return LeaseInfo(
            lease_id=lease_id,
            ttl=ttl,
            granted_ttl=int(reply.get("grantedTTL", 0)),
            keys=sorted(_unb64(k).decode(errors="replace") for k in reply.get("keys", [])),
        )

    # -- transport ------------------------------------------------------------------------------

    async def _call(
        self,
        operation: str,
        path: str,
        body: dict[str, Any],
        key: str | None,
        *,
        raw_errors: bool = False,
    ) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
            self._owns_session = True
        url = f"{self.endpoint}{path}"
        try:
            async with self._session.post(
                url, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                text = await resp.text()
                status = resp.status
        except TimeoutError:
            raise EtcdError(
                self.endpoint, operation, key, f"no answer within {self.timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as err:
            raise EtcdError(self.endpoint, operation, key, f"cannot reach etcd ({err})") from None

        try:
            reply = json.loads(text) if text else {}
        except json.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict):
            raise EtcdError(
                self.endpoint,
                operation,
                key,
                f"HTTP {status} with a non-JSON body: {text[:200]!r} (is this etcd's client URL?)",
            )
        if status != 200 or "error" in reply:
            code = reply.get("code")
            detail = f"HTTP {status}: {reply.get('message') or reply.get('error') or text[:200]}"
            if raw_errors:
                raise _ServerError(code if isinstance(code, int) else None, detail)
            raise EtcdError(self.endpoint, operation, key, detail)
        return reply


def _parse_kvs(reply: dict[str, Any]) -> list[KeyValue]:
    return [
        KeyValue(
            key=_unb64(kv["key"]).decode(errors="replace"),
            value=_unb64(kv.get("value", "")),
            lease=int(kv.get("lease", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
        )
        for kv in reply.get("kvs", [])
    ]
