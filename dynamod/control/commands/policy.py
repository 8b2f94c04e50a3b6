"""`dynamod policy push|publish|status|spares`: policy updates and spares via the daemon."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

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
            waited = ack.get("waited_ms") or 0  # in line for an update slot (max_updating)
            queued = f", after {waited:.0f} ms waiting for an update slot" if waited >= 1 else ""
            click.echo(f"  {shard:<12} ok    {ack.get('total_ms', 0):.0f} ms  ({steps}){queued}")
        else:
            click.echo(f"  {shard:<12} STALE {ack['error']}")
    if result.get("stale"):
        click.echo(f"stale shards are held and will be replayed: {', '.join(result['stale'])}")
    if result.get("updating"):  # --serving: answered before these acknowledged
        click.echo(f"still updating (no trainer traffic until they serve it): "
                   f"{', '.join(result['updating'])}")
    for shard, why in sorted(result.get("not_pushed", {}).items()):
        click.echo(f"  {shard:<12} {why}")


@click.group("policy")
def policy_group() -> None:
    """Policy (weight) updates for the rollout shards, and the ledger."""


def _ctx() -> click.Context | None:
    return click.get_current_context(silent=True)


def _acks(pairs: tuple[str, ...], acks_file: Path | None) -> dict[str, str | None] | None:
    """`--ack SHARD=DIGEST` pairs and an `--acks FILE` (a JSON object, shard -> digest or
    null) merged; None when neither is given. Raises click.UsageError with one line."""
    if not pairs and acks_file is None:
        return None
    acks: dict[str, str | None] = {}
    if acks_file is not None:
        try:
            data = json.loads(acks_file.read_text())
        except OSError as exc:
            raise click.UsageError(
                f"--acks {acks_file}: cannot read it: {exc.strerror}", _ctx()
            ) from None
        except ValueError as exc:
            raise click.UsageError(f"--acks {acks_file}: not JSON: {exc}", _ctx()) from None
        if not isinstance(data, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in data.items()
        ):
            raise click.UsageError(
                f"--acks {acks_file}: must be a JSON object of shard name -> digest (or null)",
                _ctx(),
            )
        acks.update(data)
    for pair in pairs:
        shard, sep, digest = pair.partition("=")
        if not sep or not shard or not digest:
            raise click.UsageError(
                f"--ack {pair!r}: expected SHARD=DIGEST, e.g. worker@0=3f2a...", _ctx()
            )
        acks[shard] = digest
    return acks


def _send(ctx: click.Context, name: str, call: Any, as_json: bool) -> None:
    try:
        result = call(_client(ctx))
    except DaemonError as exc:
        click.echo(f"dynamod: policy {name} failed: {exc}", err=True)
        sys.exit(1)
    _report(result, as_json)


_STEP = click.option(
    "--step",
    type=click.IntRange(0, 2**63 - 1),
    required=True,
    help="Policy version (trainer step).",
)


FC = TypeVar("FC", bound=Callable[..., Any])


def _path(help_text: str) -> Callable[[FC], FC]:
    return click.option(
        "--path", "path", type=click.Path(path_type=Path), required=True, help=help_text
    )


@policy_group.command("push")
@_STEP
@_path("Checkpoint directory holding the step's *.safetensors.")
@click.option(
    "--serving",
    type=click.IntRange(1, None),
    default=None,
    metavar="K",
    help="Answer once K of this node's shards serve the step; the rest (and other nodes') "
    "update after the answer, with no trainer traffic until they do. Default: every shard.",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def push(ctx: click.Context, step: int, path: Path, serving: int | None, as_json: bool) -> None:
    """Load a checkpoint into every admitted shard (pause, load, reset KV, verify, resume)."""
    _send(ctx, "push", lambda c: c.policy_push(step, path.absolute(), serving=serving), as_json)


@policy_group.command("publish")
@_STEP
@_path("Where the step's weights can be loaded from (for replays).")
@click.option(
    "--ack",
    "ack_pairs",
    multiple=True,
    metavar="SHARD=DIGEST",
    help="A shard's acknowledgement: the digest it reported loading (repeatable). With any "
    "ack given, an admitted shard without one is stale.",
)
@click.option(
    "--acks",
    "acks_file",
    type=click.Path(path_type=Path),
    help="JSON file of shard -> acknowledged digest (or null), merged with --ack.",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def publish(
    ctx: click.Context,
    step: int,
    path: Path,
    ack_pairs: tuple[str, ...],
    acks_file: Path | None,
    as_json: bool,
) -> None:
    """Record a step the trainer loaded itself; verify the shards, hold mismatches."""
    acks = _acks(ack_pairs, acks_file)
    _send(ctx, "publish", lambda c: c.policy_publish(step, path.absolute(), acks=acks), as_json)


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
