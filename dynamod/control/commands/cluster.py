"""`dynamod cluster`: commands for a cluster stack as a whole (cluster/forget.py)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from dynamod.client import Client
from dynamod.control.cliutil import BAD_INPUT, check_node_name, fail, state_dir_of
from dynamod.core.errors import DaemonError


@click.group("cluster")
def cluster_group() -> None:
    """A cluster stack as a whole (its tree: `dynamod status`; its stop: `down --cluster`)."""


@cluster_group.command("forget")
@click.argument("node", callback=check_node_name)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def forget(ctx: click.Context, node: str, as_json: bool) -> None:
    """Say that NODE, lost, is gone for good: every daemon stops pinging it and waiting for
    it, and shows it `forgotten`; its lost record, lease records and ledger acks leave etcd,
    and its workers' Dynamo leases are revoked. A node that is up is refused. If NODE comes
    back after all, it rejoins as a node that was lost, its shards started again."""
    client = Client(state_dir_of(ctx))
    try:
        cluster = client.status().get("cluster")
        if not cluster:
            fail("cluster forget: this daemon's stack has no [cluster] table", BAD_INPUT)
        names = [n["name"] for n in cluster["nodes"]]
        if node not in names:
            fail(f"cluster forget: no node {node!r} in the cluster ({', '.join(names)})", BAD_INPUT)
        result = client.forget_node(node)
    except DaemonError as exc:
        fail(f"cluster forget {node}: {exc}")
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(_said(result))
    sys.exit(0)


def _said(result: dict[str, Any]) -> str:
    node = result["node"]
    was = "lost" if result["was_lost"] else "not marked lost"
    parts = [
        f"shards {', '.join(result['shards'])}" if result["shards"] else "",
        f"lease records of {', '.join(result['lease_records'])}" if result["lease_records"] else "",
        f"ledger acks of {', '.join(result['ledger_records'])}" if result["ledger_records"] else "",
        "revoked leases "
        + ", ".join(f"{lease} ({keys} keys)" for lease, keys in result["revoked"].items())
        if result["revoked"]
        else "",
    ]
    gone = "; ".join(p for p in parts if p) or "nothing else was recorded of it"
    line = f"{node} forgotten (it was {was}; now {result['state']}): {gone}"
    if result.get("revoke_error"):
        line += f"; not revoked: {result['revoke_error']} (its lease expires on its own)"
    return line
