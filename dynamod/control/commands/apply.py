"""`dynamod apply FILE` and `dynamod scale UNIT=N`: live changes to a running stack. The
daemon resolves the new definition against the running stack (ports and `--var`s kept),
answers the diff and, unless `--dry-run`, applies it (core/live.py says how)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import click

from dynamod.client import Client
from dynamod.client.control import BadInputError, UnknownUnitError
from dynamod.control.cliutil import BAD_INPUT, Seconds, fail, state_dir_of, var_option
from dynamod.core import limits, paths
from dynamod.core.errors import DaemonError

_SCALE = re.compile(r"^([A-Za-z0-9_-]+)=([0-9]{1,6})$")

_dry_run = click.option(
    "--dry-run", is_flag=True, help="Print the diff and change nothing."
)
_json = click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
_timeout = click.option(
    "--timeout",
    type=Seconds(),
    default=300.0,
    show_default=True,
    help="Seconds the whole change may take (each started unit must serve by then).",
)


def diff_lines(answer: dict[str, Any]) -> list[str]:
    """The daemon's diff, indented, for a person."""
    return [f"  {line}" for line in answer["lines"]]


def stack_path(stack: str) -> Path:
    """A stack file path or a stock stack name, absolute."""
    return paths.resolve_stack_path(stack).absolute()


@click.command("apply")
@click.argument("stack")
@var_option
@_dry_run
@_json
@_timeout
@click.pass_context
def apply(
    ctx: click.Context,
    stack: str,
    variables: tuple[str, ...],
    dry_run: bool,
    as_json: bool,
    timeout: float,
) -> None:
    """Change the running stack to STACK (a path or a stock stack name): print the diff
    (units added, removed and changed, replicas, vars, [policy]) and apply it, restarting
    as little as it can. The --var values the stack was started with are kept."""
    from dynamod.core.spec import parse_var

    overrides = dict(parse_var(v) for v in variables)
    _run(ctx, as_json, dry_run, lambda c: c.apply(
        stack_path(stack), overrides, dry_run=dry_run, timeout=timeout))  # fmt: skip


def _scale_arg(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, int]:
    match = _SCALE.match(value)
    if match is None or int(match.group(2)) > limits.MAX_INSTANCES:
        raise click.BadParameter(
            f"expects a replicated unit's name, '=' and its replica count (0 to "
            f"{limits.MAX_INSTANCES}), e.g. worker=3, got {value!r}"
        )
    return match.group(1), int(match.group(2))


@click.command("scale")
@click.argument("target", metavar="UNIT=N", callback=_scale_arg)
@_dry_run
@_json
@_timeout
@click.pass_context
def scale(
    ctx: click.Context, target: tuple[str, int], dry_run: bool, as_json: bool, timeout: float
) -> None:
    """Run N replicas of the replicated UNIT (the short form of `apply`: new replicas
    start, and a rollout shard is replayed and verified before it serves; removed ones
    are drained, then stopped)."""
    _run(ctx, as_json, dry_run, lambda c: c.apply(scale=target, dry_run=dry_run,
                                                  timeout=timeout))  # fmt: skip


def _run(ctx: click.Context, as_json: bool, dry_run: bool, ask: Any) -> None:
    client = Client(state_dir_of(ctx))
    try:
        answer: dict[str, Any] = ask(client)
    except (BadInputError, UnknownUnitError) as exc:
        head, _, rest = str(exc).partition("\n")
        if rest:  # several problems: one per line, as `up` and `check` list them
            fail(f"invalid stack, nothing was changed: {head}\n{rest}", BAD_INPUT)
        fail(f"{head} (nothing was changed)", BAD_INPUT)
    except DaemonError as exc:
        fail(str(exc))
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    click.echo(f"stack {answer['stack']} <- {answer['file']}:")
    for line in diff_lines(answer):
        click.echo(line)
    if answer["diff"]["empty"]:
        return
    if dry_run:
        click.echo("dry run: nothing was changed")
        return
    for step in answer["done"]:
        click.echo(f"done: {step}")
    sys.exit(0)


apply_commands = [apply, scale]
