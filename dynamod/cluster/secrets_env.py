"""The `SecretsEnv` extension: hands a cluster stack's credentials to Dynamo's processes in
their environment at spawn (Extension.spawn_env), so no secret enters a rendered command
line, `status`, a log or a state file. A unit that talks to etcd (it has ETCD_ENDPOINTS)
gets ETCD_AUTH_CA / _CLIENT_CERT / _CLIENT_KEY as PEM *contents* (what Dynamo 1.6.1 reads;
the certificate's CN is the stack's etcd user, its login: no password, see below), and
the TCP request plane's DYN_TCP_TLS_* paths (server identity, client identity, and the CA
for both directions: mutual TLS); one that talks to NATS (NATS_SERVER) gets
NATS_AUTH_USERNAME / NATS_AUTH_PASSWORD. The node is the unit's DYNAMOD_NODE (the
cluster's first node without one)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dynamod.cluster import secrets
from dynamod.core.extensions import Extension
from dynamod.core.spec import UnitSpec


def dynamo_env(loaded: secrets.Secrets, node: str, unit_env: Mapping[str, str]) -> dict[str, str]:
    """The variables a unit with `unit_env` on `node` gets (pure; files read here)."""
    env: dict[str, str] = {}
    creds = loaded.credentials
    files = loaded.node(node)
    ca = str(loaded.ca_cert)
    if "ETCD_ENDPOINTS" in unit_env:
        env |= {
            # Dynamo 1.6.1 with ETCD_AUTH_USERNAME/PASSWORD *and* TLS fails its handshake
            # ("unknown certificate authority": its login connection drops the CA), while
            # TLS alone works. So it logs in by certificate: the node's stack certificate,
            # whose CN is the stack's etcd user (etcd's client-cert-auth maps CN -> user).
            "ETCD_AUTH_CA": loaded.ca_cert.read_text(),
            "ETCD_AUTH_CLIENT_CERT": files.stack_cert.read_text(),
            "ETCD_AUTH_CLIENT_KEY": files.stack_key.read_text(),
            # The request plane: serve with the node's certificate and require a client
            # certificate from the CA; dial peers presenting this node's client certificate.
            "DYN_TCP_TLS_CERT_PATH": str(files.server_cert),
            "DYN_TCP_TLS_KEY_PATH": str(files.server_key),
            "DYN_TCP_TLS_CLIENT_CA_CERT_PATH": ca,
            "DYN_TCP_TLS_CA_CERT_PATH": ca,
            "DYN_TCP_TLS_CLIENT_CERT_PATH": str(files.client_cert),
            "DYN_TCP_TLS_CLIENT_KEY_PATH": str(files.client_key),
        }
    if "NATS_SERVER" in unit_env:
        env |= {"NATS_AUTH_USERNAME": creds.nats_user, "NATS_AUTH_PASSWORD": creds.nats_password}
    return env


class SecretsEnv(Extension):
    """Credentials from the secrets directory, merged into Dynamo units' environments."""

    def __init__(self, secrets_dir: Path) -> None:
        self.secrets = secrets.load(secrets_dir)  # refused at `up`, before anything starts

    def spawn_env(self, unit: UnitSpec) -> Mapping[str, str]:
        node = unit.env.get("DYNAMOD_NODE") or next(iter(self.secrets.nodes))
        return dynamo_env(self.secrets, node, unit.env)
