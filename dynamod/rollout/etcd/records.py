"""The values dynamod's etcd client takes and returns: keys and leases read back, watch events,
credentials, and the comparisons and operations of a transaction. Plain frozen dataclasses, no
I/O, so callers and tests build them without a server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


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


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix; a delete carries an empty value."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int
    lease: int = 0  # a put's lease (0: none); a delete's is 0


@dataclass(frozen=True)
class EtcdAuth:
    """How to prove who we are: a user and password (etcd auth), and/or TLS material.

    The TLS fields hold PEM contents, not paths (as Dynamo's ETCD_AUTH_CA and siblings do). A
    CA or a client certificate makes the client speak TLS. `repr` never shows the secrets.
    """

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_pem: str | None = field(default=None, repr=False)
    cert_pem: str | None = field(default=None, repr=False)
    key_pem: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return bool(self.ca_pem or self.cert_pem)


CompareTarget = Literal["mod", "version", "create", "value"]
CompareOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction: `Compare("k", "mod", "==", 7)`.

    mod/version/create compare the key's revision numbers (0 for a key that does not exist);
    value compares its bytes.
    """

    key: str
    target: CompareTarget
    op: CompareOp
    value: int | str | bytes


# etcd refuses a transaction of more than --max-txn-ops operations (128 by default): a
# caller with more writes them in transactions of at most this many
TXN_OPS = 100


@dataclass(frozen=True)
class TxnPut:
    key: str
    value: str | bytes
    lease: int = 0


@dataclass(frozen=True)
class TxnDelete:
    """Delete one key, or every key under it with `prefix=True`."""

    key: str
    prefix: bool = False


TxnOp = TxnPut | TxnDelete


def prefix_range_end(prefix: str) -> bytes:
    """The exclusive upper bound that makes a range request cover every key under `prefix`."""
    raw = prefix.encode()
    if not raw:
        return b"\0"  # etcd reads "\0" as "to the end of the keyspace"
    return raw[:-1] + bytes([raw[-1] + 1])  # UTF-8 never holds 0xff, so there is no carry
