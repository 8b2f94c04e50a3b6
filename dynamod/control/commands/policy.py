"""`dynamod policy push|publish|status|spares`: policy updates and spares via the daemon."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from dynamod.client import Client
from dynamod.control.cliutil import state_dir_of
from dynamod.core.errors import DaemonError


def _client(ctx: click.Context) -> Client:
    return Client(state_dir_of(ctx))


def _report(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    if result.get("already_committed"):
        click.echo(
            f"policy version {result['version']} was already committed from {result['path']}"
            f" (digest {result['digest']}): nothing pushed again"
        )
    else:
        click.echo(f"policy version {result['version']} in {result['seconds']:.2f}s")
    for shard, ack in sorted(result["acks"].items()):
        if ack.get("already"):
            click.echo(f"  {shard:<12} at version {ack['version']} (committed before)")
        elif ack.get("ok"):
            steps = ", ".join(f"{k} {v:.0f}ms" for k, v in ack.get("ms", {}).items())
            click.echo(f"  {shard:<12} ok    {ack.get('total_ms', 0):.0f} ms  ({steps})")
        else:
            click.echo(f"  {shard:<12} STALE {ack['error']}")
    if result.get("stale"):
        click.echo(f"stale shards are held and will be replayed: {', '.join(result['stale'])}")


@click.group("policy")
def policy_group() -> None:
    """Policy (weight) updates for the rollout shards, and the ledger."""


def _update_command(name: str, path_help: str, doc: str) -> None:
    """`push` and `publish` take the same arguments and report the same way."""

    @policy_group.command(name, help=doc)
    @click.option(
        "--step",
        type=click.IntRange(0, 2**63 - 1),
        required=True,
        help="Policy version (trainer step).",
    )
    @click.option("--path", "path", type=click.Path(path_type=Path), required=True, help=path_help)
    @click.option("--json", "as_json", is_flag=True)
    @click.pass_context
    def command(ctx: click.Context, step: int, path: Path, as_json: bool) -> None:
        client = _client(ctx)
        send = client.policy_push if name == "push" else client.policy_publish
        try:
            result = send(step, path.absolute())
        except DaemonError as exc:
            click.echo(f"dynamod: policy {name} failed: {exc}", err=True)
            sys.exit(1)
        _report(result, as_json)


_update_command(
    "push",
    "Checkpoint directory holding the step's *.safetensors.",
    "Load a checkpoint into every admitted shard (pause, load, reset KV, verify, resume).",
)
_update_command(
    "publish",
    "Where the step's weights can be loaded from (for replays).",
    "Record a step the trainer loaded itself; verify the shards, hold mismatches.",
)


@policy_group.command("status")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """The ledger's current version and each shard's applied version."""
    try:
        result = _client(ctx).policy_status()
    except DaemonError as exc:
        click.echo(f"dynamod: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"current policy version: {result['current']}  ({result['store']} ledger)")
    if result["current_path"]:
        click.echo(f"  weights: {result['current_path']}  digest {result['current_digest']}")
    kept = ", ".join(str(v["version"]) for v in result["history"])
    click.echo(f"  kept versions: {kept or '-'}")
    for shard in result["shards"]:
        mark = "admitted" if shard["admitted"] else "OUT"
        if shard.get("role") == "spare":
            mark = "spare (held out of trainer traffic)"
        error = f"  last error: {shard['last_error']}" if shard["last_error"] else ""
        click.echo(
            f"  {shard['name']:<12} {shard['state']:<9} version "
            f"{shard['policy_version']}  {mark}{error}"
        )


@policy_group.command("spares")
@click.option("--sleep/--wake", "asleep", required=True, help="Spares sleep, or wake up.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def spares(ctx: click.Context, asleep: bool, as_json: bool) -> None:
    """Hot spares sleep (weights to host memory, KV cache freed) or stay awake.

    A sleeping spare is woken, then replayed if behind, when it is promoted."""
    try:
        result = _client(ctx).policy_spares(asleep)
    except DaemonError as exc:
        click.echo(f"dynamod: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    names = ", ".join(result["spares"]) or "none"
    click.echo(f"spares ({names}) will {'sleep' if asleep else 'stay awake'}")
