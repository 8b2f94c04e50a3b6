"""`dynamod` command line: the group, its options and its one-line usage errors. The commands
live in control/commands/, one module per family; they only ask the daemon (over its
socket) or read files."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from dynamod.control import commands
from dynamod.control.cliutil import BAD_INPUT
from dynamod.core import paths

_NoArgsIsHelp: type[click.UsageError] = getattr(
    click.exceptions, "NoArgsIsHelpError", click.exceptions.UsageError
)


class _Cli(click.Group):
    """The `dynamod` group, with click's three-line usage errors turned into one line:
    `dynamod up: --timeout expects ..., got '-1' (see dynamod up --help)`, exit 2; and its
    commands loaded when named (control/commands/__init__.py says why)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(commands.COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return commands.load(cmd_name)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            result = super().main(*args, **kwargs)
        except _NoArgsIsHelp as exc:  # a bare group: its help, as click prints it
            click.echo(exc.ctx.get_help() if exc.ctx else exc.message, err=True)
            sys.exit(BAD_INPUT)
        except click.ClickException as exc:
            click.echo(_one_line(exc), err=True)
            sys.exit(BAD_INPUT)
        except click.Abort:
            click.echo("dynamod: aborted", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


def _one_line(exc: click.ClickException) -> str:
    ctx = getattr(exc, "ctx", None)
    words = ctx.command_path.split()[1:] if ctx is not None else []
    where = " ".join(["dynamod", *[w for w in words if w != "-m" and w != "dynamod"]])
    param = getattr(exc, "param", None)
    message = exc.message
    if type(exc) is click.BadParameter and param is not None:
        name = (
            max(param.opts, key=len)
            if isinstance(param, click.Option)
            else param.human_readable_name
        )
        message = f"{name} {message}" if message.startswith("expects") else f"{name}: {message}"
    else:
        message = exc.format_message()
    hint = f" (see {where} --help)" if isinstance(exc, click.UsageError) else ""
    return f"{where}: {' '.join(message.splitlines())}{hint}"


@click.group(cls=_Cli)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    envvar=paths.STATE_DIR_ENV,
    default=None,
    help=f"Where the daemon keeps its socket, logs and state (env {paths.STATE_DIR_ENV}).",
)
@click.version_option(package_name="dynamod")
@click.pass_context
def main(ctx: click.Context, state_dir: Path | None) -> None:
    """Supervisor for the RL rollout stack: etcd, NATS, Dynamo workers, frontend, trainer."""
    ctx.ensure_object(dict)
    ctx.obj["state_dir"] = (state_dir or paths.default_state_dir()).absolute()


if __name__ == "__main__":
    main()
