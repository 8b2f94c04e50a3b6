"""Turns on etcd authentication for a cluster stack (`python -m dynamod.cluster.etcd_auth`,
an idempotent oneshot on the head once the members are healthy): the root user, the stack's
user with a role limited to the stack's key prefixes (`v1/` where Dynamo 1.6.1 registers
instances, model cards, event channels and sources; `dynamod/<stack>/` for dynamod's
ledger and registry), then `auth enable`. Talks to etcd's JSON gateway over TLS with the
node's client certificate; passwords travel in request bodies, never on a command line.
Also `authenticate`, which says exactly what etcd refused."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import ssl
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from dynamod.cluster import secrets, tls
from dynamod.core.errors import DynamodError

DYNAMO_PREFIXES = ("v1/",)
ROOT = "root"
_GRPC_ALREADY_EXISTS = 9  # etcd: "user name already exists", "role name already exists"
_TIMEOUT_S = 5.0


class EtcdAuthError(DynamodError):
    """etcd refused a credential, or could not be reached to set auth up."""


def stack_prefixes(stack: str) -> list[str]:
    return [*DYNAMO_PREFIXES, f"dynamod/{stack}/"]


def role_name(stack: str) -> str:
    return f"dynamod-{stack}"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return raw.decode()


@dataclass
class Gateway:
    """Just enough of etcd's JSON gateway for the auth calls, over TLS."""

    endpoint: str
    session: aiohttp.ClientSession
    context: ssl.SSLContext
    token: str | None = None

    async def call(self, path: str, body: dict[str, Any], *, what: str) -> dict[str, Any]:
        headers = {"Authorization": self.token} if self.token else {}
        try:
            async with self.session.post(
                f"{self.endpoint}{path}", json=body, ssl=self.context, headers=headers
            ) as reply:
                data: dict[str, Any] = json.loads(await reply.text() or "{}")
                if reply.status != 200:
                    raise _Refused(int(data.get("code", 0)), str(data.get("message") or data))
                return data
        except (aiohttp.ClientError, TimeoutError, ssl.SSLError, OSError) as exc:
            raise EtcdAuthError(f"etcd at {self.endpoint}: {what} failed: {exc}") from exc

    async def authenticate(self, user: str, password: str) -> str:
        try:
            reply = await self.call(
                "/v3/auth/authenticate", {"name": user, "password": password}, what="authenticate"
            )
        except _Refused as exc:
            raise EtcdAuthError(
                f"etcd at {self.endpoint} refused user {user!r}: {exc.message}"
            ) from exc
        token = str(reply["token"])
        self.token = token
        return token


class _Refused(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message


async def _idempotent(gateway: Gateway, path: str, body: dict[str, Any], what: str) -> None:
    try:
        await gateway.call(path, body, what=what)
    except _Refused as exc:
        if exc.code != _GRPC_ALREADY_EXISTS:
            raise EtcdAuthError(
                f"etcd at {gateway.endpoint}: {what} refused: {exc.message}"
            ) from exc


async def enable(gateway: Gateway, loaded: secrets.Secrets, stack: str) -> str:
    """Users, role and `auth enable`; safe to run again. Returns what it did, in words."""
    creds = loaded.credentials
    status = await _status(gateway)
    if status:
        await gateway.authenticate(ROOT, creds.etcd_root_password)
    role = role_name(stack)
    await _idempotent(gateway, "/v3/auth/role/add", {"name": ROOT}, "role add root")
    await _idempotent(
        gateway,
        "/v3/auth/user/add",
        {"name": ROOT, "password": creds.etcd_root_password},
        "user add root",
    )
    await _idempotent(gateway, "/v3/auth/user/grant", {"user": ROOT, "role": ROOT}, "grant root")
    await _idempotent(gateway, "/v3/auth/role/add", {"name": role}, f"role add {role}")
    for prefix in stack_prefixes(stack):
        perm = {"permType": "READWRITE", "key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        await _idempotent(
            gateway, "/v3/auth/role/grant", {"name": role, "perm": perm}, f"grant {role} {prefix}"
        )
    await _idempotent(
        gateway,
        "/v3/auth/user/add",
        {"name": creds.etcd_user, "password": creds.etcd_password},
        f"user add {creds.etcd_user}",
    )
    await _idempotent(
        gateway, "/v3/auth/user/grant", {"user": creds.etcd_user, "role": role}, "grant user"
    )
    if status:
        return f"auth was already enabled; user {creds.etcd_user!r} has role {role!r}"
    await _idempotent(gateway, "/v3/auth/enable", {}, "auth enable")
    return f"auth enabled; user {creds.etcd_user!r} limited to {', '.join(stack_prefixes(stack))}"


async def _status(gateway: Gateway) -> bool:
    try:
        reply = await gateway.call("/v3/auth/status", {}, what="auth status")
    except _Refused as exc:
        raise EtcdAuthError(
            f"etcd at {gateway.endpoint}: auth status refused: {exc.message}"
        ) from exc
    return bool(reply.get("enabled", False))


def gateway_context(loaded: secrets.Secrets, node: str) -> ssl.SSLContext:
    files = loaded.node(node)
    return tls.client_context(str(loaded.ca_cert), str(files.client_cert), str(files.client_key))


async def run(endpoints: list[str], loaded: secrets.Secrets, node: str, stack: str) -> str:
    context = gateway_context(loaded, node)
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for endpoint in endpoints:
            try:
                return await enable(Gateway(endpoint, session, context), loaded, stack)
            except EtcdAuthError as exc:
                errors.append(str(exc))
    raise EtcdAuthError("; ".join(errors))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynamod.cluster.etcd_auth", description=__doc__)
    parser.add_argument("--endpoints", required=True, help="https://ADDR:PORT,... (any member)")
    parser.add_argument("--secrets", required=True, help="the cluster's secrets directory")
    parser.add_argument("--node", required=True, help="whose client certificate to present")
    parser.add_argument("--stack", required=True, help="the stack's name (its key prefix)")
    args = parser.parse_args(argv)
    try:
        loaded = secrets.load(Path(args.secrets))
        endpoints = [e.strip().rstrip("/") for e in args.endpoints.split(",") if e.strip()]
        print(asyncio.run(run(endpoints, loaded, args.node, args.stack)), flush=True)
    except secrets.SecretsError as exc:
        print(f"dynamod.cluster.etcd_auth: {exc}", file=sys.stderr)
        return 2
    except EtcdAuthError as exc:
        print(f"dynamod.cluster.etcd_auth: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
