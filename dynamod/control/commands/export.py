"""`dynamod export`: a stack as another process manager's config (see dynamod.ops.supervisord)."""

from __future__ import annotations

from pathlib import Path

import click

from dynamod.control.cliutil import var_option
from dynamod.core.errors import DynamodError


@click.group("export")
def export_group() -> None:
    """Write a stack as another process manager's configuration."""


@export_group.command()
@click.argument("stack", required=False)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="File to write (default: standard output).",
)
@var_option
@click.pass_context
def supervisord(
    ctx: click.Context, stack: str | None, out: Path | None, variables: tuple[str, ...]
) -> None:
    """A supervisord config for STACK: one [program:x] per unit, with the unit's command,
    environment, restart and stop settings, priorities in dependency order, and its logs in
    STATE_DIR/logs (where `dynamod logs` reads them). Ports are chosen now and fixed in
    the file. What supervisord cannot do is printed to stderr. Writes nothing but --out."""
    from dynamod.control.cliutil import BAD_INPUT, fail, load_stack, state_dir_of
    from dynamod.ops import supervisord as export

    state_dir = state_dir_of(ctx, will_create=True)
    resolved = load_stack(stack, state_dir, variables)
    try:
        text = export.supervisord_config(resolved, state_dir=state_dir)
    except DynamodError as exc:
        fail(str(exc), BAD_INPUT)
    if out is not None:
        try:
            out.write_text(text)
        except OSError as exc:
            fail(f"cannot write {out}: {exc.strerror or exc}", BAD_INPUT)
    if out is None:
        click.echo(text, nl=False)
    else:
        click.echo(f"wrote {out}", err=True)
    click.echo(
        f"supervisord runs the {resolved.name} stack's processes, but NOT what dynamod adds:",
        err=True,
    )
    for gap in export.supervisord_gaps(resolved):
        click.echo(f"  - {gap}", err=True)
    logs = state_dir / "logs"
    if not logs.is_dir():  # an export writes nothing there; supervisord will not create it
        click.echo(f"before starting supervisord: mkdir -p {logs}", err=True)
