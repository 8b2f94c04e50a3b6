"""The cluster's secrets directory: `init` makes it (owner-only: directory 0700, files 0600)
with etcd's root and stack-user passwords, NATS client and route credentials, a CA and per
node a server and a client certificate; `load` reads it back, refusing a directory or file
that group or others could read, and names the file at fault. Secrets are read from here by
the processes that need them (and handed to Dynamo in its environment); they are never
rendered into a command line, `status`, a log or a state file."""

from __future__ import annotations

import json
import os
import re
import secrets as random_secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from dynamod.core.errors import DynamodError, shown
from dynamod.rollout.etcd import EtcdAuth

CREDENTIALS = "credentials.json"
CA_CERT = "ca.pem"
CA_KEY = "ca.key"
NODES_DIR = "nodes"
STACK_USER = "dynamod"
NATS_ROUTE_USER = "route"
_NODE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")


class SecretsError(DynamodError):
    """The secrets directory cannot be made, or is missing, malformed or readable by others."""


@dataclass(frozen=True)
class NodeFiles:
    """Where one node's certificates lie inside the secrets directory."""

    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stack_cert: Path  # CN = the stack's etcd user: a login by certificate (Dynamo's)
    stack_key: Path


@dataclass(frozen=True)
class Credentials:
    etcd_root_password: str
    etcd_user: str
    etcd_password: str
    nats_user: str
    nats_password: str
    nats_route_password: str


@dataclass(frozen=True)
class Secrets:
    """A loaded, checked secrets directory."""

    path: Path
    credentials: Credentials
    nodes: dict[str, str]  # the nodes it was made for: name -> address

    @property
    def ca_cert(self) -> Path:
        return self.path / CA_CERT

    def node(self, name: str) -> NodeFiles:
        if name not in self.nodes:
            raise SecretsError(
                f"{self.path}: no certificates for node {shown(name)!r} "
                f"(made for {', '.join(self.nodes)}); run `dynamod secrets init` again"
            )
        base = self.path / NODES_DIR / name
        return NodeFiles(
            base / "server.pem", base / "server.key", base / "client.pem", base / "client.key",
            base / "stack.pem", base / "stack.key",
        )  # fmt: skip


def parse_nodes(spec: str) -> dict[str, str]:
    """'head=10.77.0.1,n1=10.77.0.2' -> {'head': '10.77.0.1', 'n1': '10.77.0.2'} (in order)."""
    nodes: dict[str, str] = {}
    for part in spec.split(","):
        name, sep, address = part.strip().partition("=")
        if not sep or not _NODE_NAME.match(name) or not address.strip():
            raise SecretsError(
                "nodes: expected NAME=ADDRESS[,NAME=ADDRESS...], "
                f"got {shown(part)!r} in {shown(spec)!r}"
            )
        if name in nodes:
            raise SecretsError(f"nodes: node {name!r} named twice in {shown(spec)!r}")
        nodes[name] = address.strip()
    return nodes


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _password() -> str:
    return random_secrets.token_urlsafe(24)


def init(path: Path, nodes: dict[str, str], *, stack_user: str = STACK_USER) -> Secrets:
    """Make a new secrets directory for `nodes`. `path` must not exist, or be an empty
    owner-only directory; nothing is overwritten."""
    if not nodes:
        raise SecretsError("nodes: at least one node is needed")
    if path.exists():
        if not path.is_dir():
            raise SecretsError(f"{path}: exists and is not a directory")
        _check_owner_only(path, directory=True)
        if any(path.iterdir()):
            raise SecretsError(
                f"{path}: not empty; secrets are never overwritten (remove it to make new ones)"
            )
    else:
        try:
            path.mkdir(mode=0o700, parents=False)
        except OSError as exc:
            raise SecretsError(f"{path}: cannot create: {exc.strerror or exc}") from exc
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
    credentials = Credentials(
        etcd_root_password=_password(),
        etcd_user=stack_user,
        etcd_password=_password(),
        nats_user=stack_user,
        nats_password=_password(),
        nats_route_password=_password(),
    )
    # here, not at the top: every daemon and `up` imports this module, cryptography's
    # import costs each ~30 ms, and only making the directory needs it
    from dynamod.cluster import tls

    ca = tls.make_ca()
    _write_new(path / CA_CERT, ca.cert)
    _write_new(path / CA_KEY, ca.key)
    nodes_dir = path / NODES_DIR
    nodes_dir.mkdir(mode=0o700)
    for name, address in nodes.items():
        base = nodes_dir / name
        base.mkdir(mode=0o700)
        sans = [address, "127.0.0.1", "localhost"]
        server = tls.issue(ca, f"dynamod-server-{name}", sans, server=True)
        client = tls.issue(ca, f"dynamod-client-{name}", [], server=False)
        _write_new(base / "server.pem", server.cert)
        _write_new(base / "server.key", server.key)
        _write_new(base / "client.pem", client.cert)
        _write_new(base / "client.key", client.key)
        # Dynamo 1.6.1 cannot combine a password with TLS (see secrets_env), so it logs in
        # to etcd by this certificate: etcd takes a client certificate's CN as the user.
        stack = tls.issue(ca, stack_user, [], server=False)
        _write_new(base / "stack.pem", stack.cert)
        _write_new(base / "stack.key", stack.key)
    document = {"nodes": nodes, **credentials.__dict__}
    _write_new(path / CREDENTIALS, json.dumps(document, indent=2).encode() + b"\n")
    return load(path)


def _check_owner_only(path: Path, *, directory: bool) -> None:
    try:
        info = path.lstat()
    except OSError as exc:
        raise SecretsError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind_ok:
        raise SecretsError(f"{path}: expected a {'directory' if directory else 'regular file'}")
    if info.st_uid != os.geteuid():
        raise SecretsError(f"{path}: owned by uid {info.st_uid}, not by this user ({os.geteuid()})")
    if info.st_mode & 0o077:
        raise SecretsError(
            f"{path}: mode {stat.S_IMODE(info.st_mode):04o} lets group or others in; "
            f"secrets must be owner-only (chmod {'700' if directory else '600'} {path})"
        )


def _check_tree(path: Path) -> None:
    _check_owner_only(path, directory=True)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            _check_owner_only(Path(root) / name, directory=True)
        for name in files:
            _check_owner_only(Path(root) / name, directory=False)


def load(path: Path) -> Secrets:
    """Read and check a secrets directory made by `init`."""
    _check_tree(path)
    file = path / CREDENTIALS
    try:
        document = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise SecretsError(
            f"{file}: missing; make the directory with `dynamod secrets init`"
        ) from exc
    except (OSError, ValueError) as exc:
        raise SecretsError(f"{file}: unreadable: {exc}") from exc
    fields = list(Credentials.__dataclass_fields__)
    if not isinstance(document, dict):
        raise SecretsError(f"{file}: expected a JSON object")
    for field in [*fields, "nodes"]:
        if field not in document:
            raise SecretsError(f"{file}: field {field!r} missing")
    for field in fields:
        if not isinstance(document[field], str) or not document[field]:
            raise SecretsError(f"{file}: field {field!r} must be a non-empty string")
    nodes = document["nodes"]
    if not isinstance(nodes, dict) or not all(isinstance(v, str) for v in nodes.values()):
        raise SecretsError(f"{file}: field 'nodes' must map node names to addresses")
    for needed in [path / CA_CERT]:
        if not needed.is_file():
            raise SecretsError(f"{needed}: missing")
    return Secrets(path, Credentials(**{f: document[f] for f in fields}), dict(nodes))


def load_etcd_auth(secrets_dir: str | Path | None, node: str | None = None) -> EtcdAuth | None:
    """dynamod's own etcd credentials: the stack user, its password and, for `node` (or the
    first node), its client certificate. None without a secrets directory."""
    if not secrets_dir:
        return None
    loaded = load(Path(secrets_dir))
    files = loaded.node(node or next(iter(loaded.nodes)))
    return EtcdAuth(
        user=loaded.credentials.etcd_user,
        password=loaded.credentials.etcd_password,
        ca_pem=loaded.ca_cert.read_text(),
        cert_pem=files.client_cert.read_text(),
        key_pem=files.client_key.read_text(),
    )
