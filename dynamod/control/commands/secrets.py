"""`dynamod secrets`: make a cluster's owner-only secrets directory (dynamod.cluster.secrets)."""

from __future__ import annotations

from pathlib import Path

import click


@click.group("secrets")
def secrets_group() -> None:
    """Credentials and certificates for a multi-node stack."""


@secrets_group.command("init")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--nodes",
    "nodes_spec",
    required=True,
    help="The cluster's nodes, NAME=ADDRESS,... in order (as in the stack's [cluster] nodes).",
)
@click.option("--user", default="dynamod", show_default=True, help="The stack's etcd/NATS user.")
def init(directory: Path, nodes_spec: str, user: str) -> None:
    """Make DIRECTORY (0700; every file 0600): etcd root and stack-user passwords, NATS user
    and route passwords, a CA, and per node a server certificate (its address, 127.0.0.1 and
    localhost) and a client certificate. An existing non-empty directory, or one that group
    or others can read, is refused. Prints what it made, never a secret."""
    from dynamod.cluster import secrets
    from dynamod.control.cliutil import BAD_INPUT, fail

    try:
        made = secrets.init(directory, secrets.parse_nodes(nodes_spec), stack_user=user)
    except secrets.SecretsError as exc:
        fail(str(exc), BAD_INPUT)
    click.echo(
        f"made {made.path}: CA, server and client certificates for "
        f"{', '.join(f'{n} ({a})' for n, a in made.nodes.items())}; etcd users root and "
        f"{made.credentials.etcd_user}, NATS user {made.credentials.nats_user} (owner-only)"
    )
