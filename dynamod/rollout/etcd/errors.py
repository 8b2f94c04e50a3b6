"""What went wrong talking to etcd, in one line for an operator: the error types, and the
translation of a gRPC status (code and etcd's details) into a `Failure` that says what failed
and whether trying another endpoint or a fresh token can help. Pure logic, no I/O.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from dynamod.core.errors import DynamodError


class EtcdError(DynamodError):
    """An etcd request failed: unreachable, timed out, refused by the server."""

    def __init__(self, endpoint: str, operation: str, key: str | None, detail: str) -> None:
        super().__init__(endpoint, operation, key, detail)
        self.endpoint = endpoint
        self.operation = operation
        self.key = key
        self.detail = detail

    def __str__(self) -> str:
        target = f" {self.key!r}" if self.key is not None else ""
        return f"etcd {self.operation}{target} at {self.endpoint} failed: {self.detail}"


class EtcdAuthError(EtcdError):
    """etcd would not let us in: wrong user or password, a TLS handshake it or we refused."""

    def __init__(
        self, endpoint: str, operation: str, key: str | None, detail: str, address: str
    ) -> None:
        super().__init__(endpoint, operation, key, detail)
        self.address = address

    def __str__(self) -> str:
        return f"etcd at {self.address} {self.detail}"


class EtcdPermissionDenied(EtcdAuthError):
    """etcd let us in, but our user's roles do not cover the keys asked for: under etcd's
    auth a stack's user reads and writes its own prefixes only (cluster/etcd_auth.py)."""


class FailureKind(enum.Enum):
    UNREACHABLE = "unreachable"  # nothing answered: another endpoint may
    ELECTION = "election"  # it answered that its cluster has no leader just now: soon will
    TIMEOUT = "timeout"  # asked, no answer in time: the request may or may not have applied
    TOKEN_EXPIRED = "token expired"  # authenticate again, then retry
    REFUSED_AUTH = "refused auth"  # wrong user/password, or TLS trust: no retry helps
    DENIED = "denied"  # logged in, but the user's roles do not cover the key: no retry helps
    TLS = "tls"
    NOT_FOUND = "not found"  # e.g. a lease that is gone
    SERVER = "server"  # any other refusal by etcd


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    detail: str
    # the connection broke under the call (reset, closed): a new one to the same member
    # may well answer (a flaky link, a proxy that resets)
    broken: bool = False

    @property
    def try_another_endpoint(self) -> bool:
        return self.kind in (FailureKind.UNREACHABLE, FailureKind.TIMEOUT, FailureKind.ELECTION)


# etcd's answers while its members elect a leader (the leader died or was cut off): every
# member says so until one is elected, an election timeout or two later.
_ELECTION_MARKERS = ("leader changed", "no leader")
# Markers in gRPC's details text: it reports a failed handshake as UNAVAILABLE, like a refusal.
_TLS_MARKERS = ("ssl", "tls", "handshake", "certificate")
# A handshake the peer broke off by going away (a member killed, stopping, or its port reset)
# is no verdict on our credentials: another member may answer. "tcp handshaker shutdown" is
# gRPC giving up on the connection before any handshake (seen on a plain http:// endpoint
# for a node whose link had just come back: no route yet).
_GONE_MARKERS = (
    "connection reset",
    "endpoint closing",
    "broken pipe",
    "socket closed",
    "tcp handshaker shutdown",
)
_VERDICT_MARKERS = ("certificate", "bad_certificate", "unknown_ca", "wrong_version", "alert")


# gRPC's prefix before the reason a connection failed: "failed to connect to all addresses;
# last error: UNKNOWN: ipv4:127.0.0.1:2379: Connection refused" -> "Connection refused".
_CONNECT_PREFIX = re.compile(
    r"^failed to connect to all addresses; last error: \w+: (ipv[46]:)?\S+: "
)


def classify(
    code: str,
    details: str,
    *,
    user: str | None,
    timeout_s: float,
    client_cert: bool = False,
) -> Failure:
    """A gRPC status (code name such as "UNAVAILABLE", details text) as a Failure.

    `client_cert` says whether we offered a client certificate, which tells the two TLS
    refusals a server sends apart.
    """
    text = _CONNECT_PREFIX.sub("", details.strip())
    low = text.lower()
    if code == "DEADLINE_EXCEEDED":
        return Failure(FailureKind.TIMEOUT, f"no answer within {timeout_s:g} s")
    if (
        code == "UNAVAILABLE"
        and any(m in low for m in _GONE_MARKERS)
        and not any(m in low for m in _VERDICT_MARKERS)
    ):
        return Failure(FailureKind.UNREACHABLE, f"cannot reach etcd ({_short(text)})", True)
    if code == "UNAVAILABLE" and any(m in low for m in _TLS_MARKERS):
        return Failure(FailureKind.TLS, _tls_detail(low, text, client_cert))
    if code == "UNAVAILABLE" and "timed out" in low:
        # It accepted the connection and never spoke HTTP/2 (gRPC gives up at our deadline).
        return Failure(FailureKind.TIMEOUT, f"no answer within {timeout_s:g} s ({text})")
    if code == "UNAVAILABLE" and any(m in low for m in _ELECTION_MARKERS):
        return Failure(FailureKind.ELECTION, f"its cluster is electing a leader ({_short(text)})")
    if code == "UNAVAILABLE":
        return Failure(FailureKind.UNREACHABLE, f"cannot reach etcd ({_short(text)})")
    if "authentication is not enabled" in low:
        # Our login, refused because this member has auth off: before the cluster's auth
        # is on (all members say so), or a member that has not caught up (seen: one member
        # kept saying so for a minute while the others served logins): try another.
        return Failure(
            FailureKind.UNREACHABLE, "it has authentication off, so our login cannot be used"
        )
    auth = _auth_failure(code, low, text, user)
    if auth is not None:
        return auth
    if code == "NOT_FOUND":
        return Failure(FailureKind.NOT_FOUND, text)
    return Failure(FailureKind.SERVER, f"{code}: {text}")


def _auth_failure(code: str, low: str, text: str, user: str | None) -> Failure | None:
    """etcd's answers about our token and our user; None for any other answer."""
    if code == "UNAUTHENTICATED" and "invalid auth token" in low:
        return Failure(FailureKind.TOKEN_EXPIRED, "the auth token expired")
    if "revision of auth store is old" in low:  # a token kept across a change to users/roles
        return Failure(
            FailureKind.TOKEN_EXPIRED, "the auth token predates a change to etcd's users or roles"
        )
    if "authentication failed" in low:
        return Failure(
            FailureKind.REFUSED_AUTH,
            f"refused user {user!r}: authentication failed (wrong user name or password)",
        )
    if code == "PERMISSION_DENIED":
        return Failure(
            FailureKind.DENIED,
            f"refused user {user!r}: permission denied (its roles do not cover this key)",
        )
    if code in ("UNAUTHENTICATED", "INVALID_ARGUMENT") and "user name is empty" in low:
        return Failure(
            FailureKind.REFUSED_AUTH, "refused an anonymous client: authentication is enabled"
        )
    if code == "UNAUTHENTICATED":
        return Failure(FailureKind.REFUSED_AUTH, f"refused user {user!r}: {text}")
    return None


def _tls_detail(low: str, text: str, client_cert: bool) -> str:
    if "certificate_verify_failed" in low or "certificate verify failed" in low:
        return (
            "failed the TLS handshake: its certificate is not signed by the CA we were given "
            "(or does not name this address)"
        )
    refused_ours = ("bad_certificate", "certificate_required", "unknown_ca", "bad certificate")
    if any(marker in low for marker in refused_ours):
        if not client_cert:
            return "refused the TLS handshake: it requires a client certificate and we sent none"
        return (
            "refused our client certificate in the TLS handshake (is it signed by a CA that "
            "etcd's --trusted-ca-file holds?)"
        )
    if "wrong_version_number" in low or "wrong version number" in low:
        return "failed the TLS handshake: it does not speak TLS on this port (try http://)"
    return f"failed the TLS handshake ({_short(text)})"


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def electing(failures: Sequence[Failure]) -> bool:
    """Whether one round over the members found the cluster between leaders: some member
    said so, and every other one did not answer (the leader that died among them)."""
    kinds = {f.kind for f in failures}
    passing = {FailureKind.ELECTION, FailureKind.UNREACHABLE, FailureKind.TIMEOUT}
    return FailureKind.ELECTION in kinds and kinds <= passing
