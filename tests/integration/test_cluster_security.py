"""The cluster's store and bus are replicated and authenticated, on three simulated nodes
(network namespaces): etcd runs as three members with TLS and client certificates from
the first start, then auth limited to the stack's prefixes; NATS runs as three servers
joined by authenticated routes. Wrong credentials are refused with an error naming what
was refused; losing the head's member keeps etcd writable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from dynamod.chaos.netns import Sandbox, can_create_namespaces
from dynamod.cluster import secrets, tls

REASON = can_create_namespaces()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
    pytest.mark.xdist_group("netns"),  # one simulated cluster at a time (make test runs -n 2)
]

NAMES = ["head", "n1", "n2"]
CLIENT, PEER, METRICS = 2379, 2380, 2381
NATS_CLIENT, NATS_ROUTE, NATS_MONITOR = 4222, 6222, 8222
STACK = "sec"
BIN = str(Path(sys.executable).parent)


@dataclass
class Cluster:
    box: Sandbox
    secrets: secrets.Secrets
    nodes: dict[str, str]
    state: Path

    def endpoint(self, node: str) -> str:
        return f"https://{self.nodes[node]}:{CLIENT}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        return env

    def sh(self, node: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
           timeout: float = 30) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return subprocess.run(
            self.box.command(NAMES.index(node), argv), capture_output=True, text=True,
            env=env or self.env(), timeout=timeout,
        )  # fmt: skip

    def auth_tool(
        self, node: str, *extra: str, secrets_dir: Path | None = None,
        endpoints: Sequence[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return self.sh(node, [
            sys.executable, "-m", "dynamod.cluster.etcd_auth",
            "--endpoints", ",".join(endpoints or [self.endpoint(node)]),
            "--secrets", str(secrets_dir or self.secrets.path), "--node", node,
            "--stack", STACK, *extra,
        ])  # fmt: skip

    def etcdctl(self, node: str, *args: str, user: str | None = None,
                endpoint: str | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
        files = self.secrets.node(node)
        env = self.env()
        if user:
            env["ETCDCTL_USER"] = user  # "name:password"; an env var, not argv
        return self.sh(node, [
            "etcdctl", "--endpoints", endpoint or self.endpoint(node),
            "--cacert", str(self.secrets.ca_cert), "--cert", str(files.client_cert),
            "--key", str(files.client_key), "--command-timeout=3s", *args,
        ], env=env)  # fmt: skip

    def stack_user(self) -> str:
        c = self.secrets.credentials
        return f"{c.etcd_user}:{c.etcd_password}"


def _wait(what: str, check: object, deadline: float = 60) -> None:
    end = time.monotonic() + deadline
    last = ""
    while time.monotonic() < end:
        done = check()  # type: ignore[operator]
        if done is True:
            return
        last = str(done)
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {deadline} s; last: {last}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    state = tmp_path_factory.mktemp("cluster")
    box = Sandbox(3, prefix="dmsec")
    try:
        nodes = dict(zip(NAMES, box.addresses, strict=True))
        made = secrets.init(state / "secrets", nodes)
        c = Cluster(box, made, nodes, state)
        spec = ",".join(f"{n}={a}" for n, a in nodes.items())
        for i, name in enumerate(NAMES):
            out = open(state / f"etcd-{name}.log", "wb")  # noqa: SIM115 - the process keeps it
            box.run(i, [
                sys.executable, "-m", "dynamod.cluster.etcd_member", "--name", name,
                "--nodes", spec, "--secrets", str(made.path),
                "--data-dir", str(state / f"etcd-{name}"), "--client-port", str(CLIENT),
                "--peer-port", str(PEER), "--metrics-port", str(METRICS),
            ], env=c.env(), stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
            nout = open(state / f"nats-{name}.log", "wb")  # noqa: SIM115
            box.run(i, [
                sys.executable, "-m", "dynamod.cluster.nats_member", "--name", name,
                "--nodes", spec, "--secrets", str(made.path),
                "--config", str(state / f"nats-{name}" / "nats.conf"),
                "--client-port", str(NATS_CLIENT), "--cluster-port", str(NATS_ROUTE),
                "--monitor-port", str(NATS_MONITOR),
            ], env=c.env(), stdout=nout, stderr=subprocess.STDOUT)  # fmt: skip

        def healthy() -> bool | str:
            for name in NAMES:
                got = c.sh(name, ["curl", "-s", "-m", "2", f"http://127.0.0.1:{METRICS}/health"])
                if '"health":"true"' not in got.stdout:
                    return f"{name}: {got.stdout or got.stderr}"
            return True

        _wait("3 etcd members healthy", healthy)
        enabled = c.auth_tool("head")
        assert enabled.returncode == 0, enabled.stderr
        assert "auth enabled" in enabled.stdout
        yield c
    finally:
        box.close()


def test_etcd_members_listen_with_tls_only_and_metrics_on_loopback(cluster: Cluster) -> None:
    for name in NAMES:
        listening = cluster.sh(name, ["ss", "-Hltn"]).stdout
        local = {line.split()[3] for line in listening.splitlines()}
        assert f"{cluster.nodes[name]}:{CLIENT}" in local and f"127.0.0.1:{METRICS}" in local
        assert f"0.0.0.0:{CLIENT}" not in local and f"*:{CLIENT}" not in local
        # plain HTTP on the client port is refused: TLS from the first start
        plain = cluster.sh(
            name, ["curl", "-s", "-m", "2", f"http://{cluster.nodes[name]}:{CLIENT}/version"]
        )
        assert "etcdserver" not in plain.stdout


def test_auth_oneshot_is_idempotent(cluster: Cluster) -> None:
    again = cluster.auth_tool("n1")
    assert again.returncode == 0, again.stderr
    assert "already enabled" in again.stdout


def test_stack_user_writes_its_prefixes_only(cluster: Cluster) -> None:
    ok = cluster.auth_tool("n2", "--check")
    assert ok.returncode == 0, ok.stderr
    put = cluster.etcdctl("n1", "put", "v1/instances/x", "1", user=cluster.stack_user())
    assert put.returncode == 0, put.stderr
    outside = cluster.etcdctl("n1", "put", "other/key", "1", user=cluster.stack_user())
    assert outside.returncode != 0 and "permission denied" in outside.stderr
    anonymous = cluster.etcdctl("n1", "put", "v1/instances/y", "1")
    # A certificate alone is no login: its common name is not a user.
    assert anonymous.returncode != 0, anonymous.stdout
    assert "etcdserver: " in anonymous.stderr, anonymous.stderr


def _copy_secrets(cluster: Cluster, name: str) -> Path:
    copy = cluster.state / name
    shutil.copytree(cluster.secrets.path, copy)
    return copy


def test_wrong_etcd_password_is_refused_naming_the_user(cluster: Cluster) -> None:
    copy = _copy_secrets(cluster, "wrong-password")
    doc = (copy / secrets.CREDENTIALS).read_text()
    (copy / secrets.CREDENTIALS).write_text(
        doc.replace(cluster.secrets.credentials.etcd_password, "nope")
    )
    refused = cluster.auth_tool("n1", "--check", secrets_dir=copy)
    assert refused.returncode == 1
    assert f"etcd at {cluster.endpoint('n1')} refused user 'dynamod'" in refused.stderr
    assert "authentication failed" in refused.stderr


def test_client_cert_from_another_ca_is_refused(cluster: Cluster) -> None:
    copy = _copy_secrets(cluster, "other-ca")
    stranger = tls.issue(tls.make_ca("another CA"), "dynamod-client-n1", [], server=False)
    (copy / "nodes" / "n1" / "client.pem").write_bytes(stranger.cert)
    (copy / "nodes" / "n1" / "client.key").write_bytes(stranger.key)
    refused = cluster.auth_tool("n1", "--check", secrets_dir=copy)
    assert refused.returncode == 1
    assert f"etcd at {cluster.endpoint('n1')} refused user 'dynamod': TLS handshake refused" in (
        refused.stderr
    )
    assert "bad certificate" in refused.stderr or "unknown certificate" in refused.stderr


NATS_CLIENT_SCRIPT = r"""
import json, socket, sys
host, port, user, password, action, subject = sys.argv[1:7]
s = socket.create_connection((host, int(port)), timeout=3)
f = s.makefile("rb")
f.readline()  # INFO
s.sendall(b"CONNECT " + json.dumps({"user": user, "pass": password, "verbose": False,
          "pedantic": False}).encode() + b"\r\nPING\r\n")
line = f.readline().decode().strip()
if line != "PONG":
    print(line); sys.exit(1)
if action == "sub":
    s.sendall(f"SUB {subject} 1\r\nPING\r\n".encode()); f.readline()
    print("subscribed", flush=True)
    while True:
        line = f.readline().decode().strip()
        if line.startswith("MSG"):
            print(f.readline().decode().strip(), flush=True); break
        if line == "PING":
            s.sendall(b"PONG\r\n")
else:
    s.sendall(f"PUB {subject} 5\r\nhello\r\nPING\r\n".encode())
    print(f.readline().decode().strip())
"""


def _nats(cluster: Cluster, node: str, password: str, action: str,
          subject: str = "t") -> subprocess.CompletedProcess[str]:  # fmt: skip
    return cluster.sh(node, [
        sys.executable, "-c", NATS_CLIENT_SCRIPT, cluster.nodes[node], str(NATS_CLIENT),
        cluster.secrets.credentials.nats_user, password, action, subject,
    ], timeout=20)  # fmt: skip


def test_wrong_nats_password_is_refused(cluster: Cluster) -> None:
    refused = _nats(cluster, "n2", "not-the-password", "pub")
    assert refused.returncode == 1
    assert "Authorization Violation" in refused.stdout


def test_nats_routes_carry_messages_between_nodes(cluster: Cluster) -> None:
    password = cluster.secrets.credentials.nats_password
    sub = subprocess.Popen(
        cluster.box.command(1, [
            sys.executable, "-c", NATS_CLIENT_SCRIPT, cluster.nodes["n1"], str(NATS_CLIENT),
            cluster.secrets.credentials.nats_user, password, "sub", "routed",
        ]), stdout=subprocess.PIPE, text=True, env=cluster.env(),
    )  # fmt: skip
    try:
        assert sub.stdout is not None
        assert sub.stdout.readline().strip() == "subscribed"

        def delivered() -> bool | str:
            pub = _nats(cluster, "n2", password, "pub", "routed")
            return sub.poll() is not None or pub.stdout

        _wait("a message from n2 reaching n1's subscriber", delivered, deadline=20)
        out, _ = sub.communicate(timeout=5)
        assert out.strip() == "hello"
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()


def test_losing_the_heads_member_keeps_etcd_writable(cluster: Cluster) -> None:
    cluster.box.cut(0)
    try:

        def committed() -> bool | str:
            put = cluster.etcdctl("n1", "put", f"dynamod/{STACK}/policy/current", "after-cut",
                                  user=cluster.stack_user())  # fmt: skip
            return put.returncode == 0 or put.stderr

        _wait("a put through n1 with the head's member cut off", committed, deadline=20)
        got = cluster.etcdctl("n2", "get", f"dynamod/{STACK}/policy/current", "--print-value-only",
                              user=cluster.stack_user())  # fmt: skip
        assert got.stdout.strip() == "after-cut"
    finally:
        cluster.box.heal(0)

    def caught_up() -> bool | str:
        got = cluster.etcdctl("head", "get", f"dynamod/{STACK}/policy/current",
                              "--print-value-only", user=cluster.stack_user())  # fmt: skip
        return got.stdout.strip() == "after-cut" or got.stderr

    _wait("the head's member serving the write made while it was away", caught_up, deadline=30)


MODEL = "tiny-cpu"
MODEL_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dynamod" / "models" / MODEL
)


def _dynamo_env(cluster: Cluster, node: str, **extra: str) -> dict[str, str]:
    from dynamod.cluster.secrets_env import dynamo_env

    address = cluster.nodes[node]
    env = cluster.env() | {
        "ETCD_ENDPOINTS": cluster.endpoint(node),
        "NATS_SERVER": f"nats://{address}:{NATS_CLIENT}",
        "DYN_NAMESPACE": "sec",
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "DYN_HTTP_RPC_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        # the two TCP planes cross nodes: on the node's address, with mutual TLS
        "DYN_TCP_RPC_HOST": address,
        "DYN_TCP_RESPONSE_STREAM_HOST": address,
        **extra,
    }
    return env | dynamo_env(cluster.secrets, node, env)


def _tls_subject(cluster: Cluster, node: str, host: str, port: int) -> str:
    """The subject of the certificate a TLS server at host:port presents (openssl s_client)."""
    done = cluster.sh(node, [
        "openssl", "s_client", "-connect", f"{host}:{port}",
        "-CAfile", str(cluster.secrets.ca_cert),
        "-cert", str(cluster.secrets.node(node).client_cert),
        "-key", str(cluster.secrets.node(node).client_key),
    ], timeout=10)  # fmt: skip
    return done.stdout + done.stderr


@pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason=f"no model at {MODEL_DIR}")
def test_dynamo_serves_across_nodes_over_authenticated_etcd_and_tls(cluster: Cluster) -> None:
    """A CPU worker on n1 and the frontend on the head, both with the credentials SecretsEnv
    gives: they register through etcd's auth (the role's prefixes suffice), and a request is
    served across the nodes over the TCP request plane with DYN_TCP_TLS_*."""
    from dynamod.cluster import exposure

    logs = cluster.state
    worker = cluster.box.run(1, [
        sys.executable, "-m", "dynamod.workers.cpu", "--model-path", str(MODEL_DIR),
        "--model-name", MODEL, "--discovery-backend", "etcd", "--block-size", "16",
        "--engine", "mocker",
    ], env=_dynamo_env(cluster, "n1", DYN_SYSTEM_PORT="9345"),
       stdout=open(logs / "worker.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115  # fmt: skip
    frontend = cluster.box.run(0, [
        sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
        "8000", "--router-mode", "round-robin", "--discovery-backend", "etcd",
    ], env=_dynamo_env(cluster, "head"),
       stdout=open(logs / "frontend.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115  # fmt: skip
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4})

    def served() -> bool | str:
        if worker.poll() is not None or frontend.poll() is not None:
            return True
        for name in NAMES:  # a TLS refusal never heals by itself: fail at once, naming it
            for line in (logs / f"etcd-{name}.log").read_text(errors="replace").splitlines():
                if "unknown certificate authority" in line:
                    raise AssertionError(f"etcd member {name} refused Dynamo's TLS: {line}")
        got = cluster.sh("head", [
            "curl", "-s", "-m", "5", "-H", "Content-Type: application/json", "-d", body,
            "http://127.0.0.1:8000/v1/completions",
        ])  # fmt: skip
        return '"choices"' in got.stdout or got.stdout

    try:
        _wait(
            "a completion served by n1's worker through the head's frontend", served, deadline=150
        )
        assert worker.poll() is None, (logs / "worker.log").read_text()[-3000:]
        assert frontend.poll() is None, (logs / "frontend.log").read_text()[-3000:]
        # Dynamo's keys are all under the role's prefixes, written as the stack's user.
        keys = cluster.etcdctl("n2", "get", "", "--prefix", "--keys-only", user=(
            f"root:{cluster.secrets.credentials.etcd_root_password}")).stdout.split()  # fmt: skip
        assert any(k.startswith("v1/instances/sec/") for k in keys), keys
        assert all(k.startswith(("v1/", f"dynamod/{STACK}/")) for k in keys), keys
        # The worker's request plane on n1's address speaks TLS with n1's server certificate.
        planes = [x for x in exposure.listeners([worker.pid, *_children(worker.pid)])
                  if x.address == cluster.nodes["n1"]]  # fmt: skip
        assert planes, "the worker listens on nothing at n1's address"
        subjects = [_tls_subject(cluster, "head", x.address, x.port) for x in planes]
        assert any(
            "CN = dynamod-server-n1" in s or "CN=dynamod-server-n1" in s for s in subjects
        ), subjects
    finally:
        for proc in (frontend, worker):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in (frontend, worker):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _children(pid: int) -> list[int]:
    from dynamod.cluster.exposure import group_pids

    return group_pids(pid)
