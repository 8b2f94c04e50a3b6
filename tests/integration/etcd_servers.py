"""Real etcd servers for the etcd client's tests: one with authentication enabled (through
etcdctl, tokens expiring after 2 s), one speaking TLS with client certificates (a CA, server
and client certificates made here with `cryptography`), and a 3-member cluster on loopback.
Every process runs in its own process group through RawStack, which stops them.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.integration.rawstack import BIN, Proc, RawStack, free_port, http_json

USER, PASSWORD = "dynamod", "s3cret-pw"
ROOT_PASSWORD = "root-pw"
USER_PREFIX = "dynamod/"


def spawn_etcd(stack: RawStack, name: str, client_url: str, extra: list[str]) -> Proc:
    peer = f"http://127.0.0.1:{free_port()}"
    return stack.spawn(
        name,
        [
            str(BIN / "etcd"),
            "--name",
            name,
            "--data-dir",
            str(stack.root / name),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{name}={peer}",
            *extra,
        ],
    )


def wait_healthy(proc: Proc, url: str) -> None:
    def healthy() -> bool:
        body = http_json("GET", f"{url}/health", timeout=2)[1]
        return isinstance(body, dict) and body.get("health") == "true"

    proc.wait_until(f"{proc.name} /health {{health: true}}", healthy, 30)


def etcdctl(url: str, *args: str, user: str | None = None) -> str:
    argv = [str(BIN / "etcdctl"), "--endpoints", url, "--dial-timeout", "5s"]
    if user:
        argv += ["--user", user]
    done = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"etcdctl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def start_auth_etcd(stack: RawStack, token_ttl: int = 2) -> str:
    """etcd with auth on: root, and user dynamod allowed read/write under dynamod/ only; a
    token lapses `token_ttl` seconds after its last use."""
    url = f"http://127.0.0.1:{free_port()}"
    ttl = ["--auth-token-ttl", str(token_ttl)]
    proc = spawn_etcd(stack, f"etcd-auth-{token_ttl}", url, ["--auth-token", "simple", *ttl])
    wait_healthy(proc, url)
    etcdctl(url, "user", "add", f"root:{ROOT_PASSWORD}")
    etcdctl(url, "user", "grant-role", "root", "root")
    etcdctl(url, "user", "add", f"{USER}:{PASSWORD}")
    etcdctl(url, "role", "add", USER)
    etcdctl(url, "role", "grant-permission", USER, "--prefix=true", "readwrite", USER_PREFIX)
    etcdctl(url, "user", "grant-role", USER, USER)
    etcdctl(url, "auth", "enable")
    return url


@dataclass(frozen=True)
class Pki:
    ca_pem: str
    server_cert: Path
    server_key: Path
    ca_file: Path
    client_cert_pem: str
    client_key_pem: str
    other_ca_pem: str  # a CA that signed nothing of this server's


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _ca(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str, server: bool
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = dt.datetime.now(dt.UTC)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(root: Path) -> Pki:
    ca, ca_key = _ca("dynamod test CA")
    server, server_key = _leaf(ca, ca_key, "etcd", server=True)
    client, client_key = _leaf(ca, ca_key, USER, server=False)
    other_ca, _ = _ca("some other CA")
    root.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    (root / "ca.pem").write_bytes(ca.public_bytes(pem))
    (root / "server.pem").write_bytes(server.public_bytes(pem))
    (root / "server-key.pem").write_text(_pem_key(server_key))
    (root / "server-key.pem").chmod(0o600)
    return Pki(
        ca_pem=ca.public_bytes(pem).decode(),
        server_cert=root / "server.pem",
        server_key=root / "server-key.pem",
        ca_file=root / "ca.pem",
        client_cert_pem=client.public_bytes(pem).decode(),
        client_key_pem=_pem_key(client_key),
        other_ca_pem=other_ca.public_bytes(pem).decode(),
    )


def start_tls_etcd(stack: RawStack, pki: Pki) -> str:
    """etcd on https that demands a client certificate signed by the test CA."""
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    metrics = f"http://127.0.0.1:{free_port()}"  # plain /health for the readiness wait
    proc = spawn_etcd(
        stack,
        "etcd-tls",
        url,
        [
            "--cert-file",
            str(pki.server_cert),
            "--key-file",
            str(pki.server_key),
            "--trusted-ca-file",
            str(pki.ca_file),
            "--client-cert-auth",
            "--listen-metrics-urls",
            metrics,
        ],
    )
    wait_healthy(proc, metrics)
    return url


@dataclass
class Member:
    name: str
    url: str
    peer: str
    proc: Proc


def start_cluster(stack: RawStack, size: int = 3) -> list[Member]:
    """`size` etcd members on loopback forming one cluster, all healthy."""
    names = [f"m{i}" for i in range(size)]
    urls = {n: f"http://127.0.0.1:{free_port()}" for n in names}
    peers = {n: f"http://127.0.0.1:{free_port()}" for n in names}
    initial = ",".join(f"{n}={peers[n]}" for n in names)
    members = []
    for name in names:
        proc = stack.spawn(name, _member_argv(stack, name, urls[name], peers[name], initial, "new"))
        members.append(Member(name, urls[name], peers[name], proc))
    for member in members:
        wait_healthy(member.proc, member.url)
    return members


def restart_member(stack: RawStack, members: list[Member], member: Member) -> None:
    """Start a stopped member again on its data dir (it rejoins with its old identity)."""
    initial = ",".join(f"{m.name}={m.peer}" for m in members)
    argv = _member_argv(stack, member.name, member.url, member.peer, initial, "existing")
    member.proc = stack.spawn(member.name, argv)
    wait_healthy(member.proc, member.url)


def _member_argv(
    stack: RawStack, name: str, url: str, peer: str, initial: str, state: str
) -> list[str]:
    return [
        str(BIN / "etcd"),
        "--name",
        name,
        "--data-dir",
        str(stack.root / name),
        "--listen-client-urls",
        url,
        "--advertise-client-urls",
        url,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        initial,
        "--initial-cluster-state",
        state,
        "--initial-cluster-token",
        "dynamod-test",
        "--heartbeat-interval",
        "50",
        "--election-timeout",
        "500",
    ]
