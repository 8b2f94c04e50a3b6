"""dynamod's etcd v3 client (gRPC, on aetcd): keys, leases, transactions and watches, with auth,
TLS and failover between a cluster's members. Import everything from here; the modules split
the job: `client` (the calls), `connection` (one member, TLS and tokens), `endpoints` (parsing
and failover order), `errors` (what failed, in one line), `records` (the values).
"""

from dynamod.rollout.etcd import nofork  # noqa: F401  (first: before anything imports grpc)
from dynamod.rollout.etcd.client import DEFAULT_TIMEOUT_S, EtcdClient
from dynamod.rollout.etcd.connection import reconnect_all
from dynamod.rollout.etcd.endpoints import Endpoint, EndpointError, parse_endpoints
from dynamod.rollout.etcd.errors import EtcdAuthError, EtcdError, EtcdPermissionDenied
from dynamod.rollout.etcd.records import (
    TXN_OPS,
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

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TXN_OPS",
    "Compare",
    "Endpoint",
    "EndpointError",
    "EtcdAuth",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdError",
    "EtcdPermissionDenied",
    "KeyValue",
    "LeaseInfo",
    "TxnDelete",
    "TxnOp",
    "TxnPut",
    "WatchEvent",
    "parse_endpoints",
    "prefix_range_end",
    "reconnect_all",
]
