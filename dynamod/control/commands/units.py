"""The commands that ask the running daemon about its units, or act on one: `status`,
`restart`, `stop`, `start`, `logs` (which also reads the log after the daemon has gone).
They import only the socket client and the renderer, so that `dynamod status` starts in a
fraction of the time `up` needs (docs/benchmarks.md, the fleet's status)."""

from __future__ import annotations

import json

import click

from dynamod.client import Client
from dynamod.client.control import UnknownUnitError
from dynamod.control import render
from dynamod.control.cliutil import BAD_INPUT, check_unit_name, fail, state_dir_of
from dynamod.core.errors import DaemonError, DynamodError


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status object as JSON.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Show the unit tree: state, pid, uptime, restarts, last exit, probe detail."""
    try:
        result = Client(state_dir_of(ctx)).status()
    except DaemonError as exc:
        fail(str(exc))
    click.echo(json.dumps(result, indent=2) if as_json else render.status_table(result))


@click.command()
@click.argument("unit", callback=check_unit_name)
@click.pass_context
def restart(ctx: click.Context, unit: str) -> None:
    """Stop UNIT, reset its backoff and start it again."""
    try:
        Client(state_dir_of(ctx)).restart(unit)
    except DaemonError as exc:
        fail(str(exc))
    click.echo(f"{unit} restarted")


@click.command()
@click.argument("unit", callback=check_unit_name)
@click.pass_context
def stop(ctx: click.Context, unit: str) -> None:
    """Stop UNIT (a replica like worker@1, or every replica by its base name) and keep it
    stopped, no restart, until `dynamod start UNIT`. A rollout shard leaves routing and
    finishes its in-flight requests first. The rest of the stack runs on."""
    _operator(ctx, "stop", unit)


@click.command()
@click.argument("unit", callback=check_unit_name)
@click.pass_context
def start(ctx: click.Context, unit: str) -> None:
    """Start UNIT again after `dynamod stop UNIT`."""
    _operator(ctx, "start", unit)


def _operator(ctx: click.Context, action: str, unit: str) -> None:
    client = Client(state_dir_of(ctx))
    try:
        result = client.stop(unit) if action == "stop" else client.start(unit)
    except UnknownUnitError as exc:
        fail(str(exc), BAD_INPUT)
    except DaemonError as exc:
        fail(str(exc))
    done = "stopped; held until `dynamod start`" if action == "stop" else "started"
    for name in result["done"]:
        click.echo(f"{name} {done}")
    for name, why in result["already"].items():
        click.echo(f"{name}: {why}")


@click.command()
@click.argument("unit", callback=check_unit_name)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.option(
    "-n",
    "--lines",
    type=click.IntRange(0, 1_000_000),
    default=50,
    show_default=True,
    help="Lines of history (after the header of the spawn they belong to).",
)
@click.pass_context
def logs(ctx: click.Context, unit: str, follow: bool, lines: int) -> None:
    """Print UNIT's log (works after the daemon has gone too)."""
    from dynamod.control import logview

    try:
        logview.show(state_dir_of(ctx), unit, lines=lines, follow=follow, out=click.echo)
    except DynamodError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot read the log of {unit}: {exc.strerror or exc} ({exc.filename})")
    except KeyboardInterrupt:
        pass
