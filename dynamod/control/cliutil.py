"""Helpers shared by the command modules: the state dir and stack loading with
operator-facing errors, and the option types that refuse bad values with one line.

Bad input (a stack, a state dir, an option) ends in exit status 2 with one line that names
what was wrong and what was expected, before anything is written or spawned.
"""

from __future__ import annotations

import ipaddress
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from dynamod.core import limits, paths, statedir
from dynamod.core.errors import DynamodError, SpecErrors, StateDirError

if TYPE_CHECKING:  # the CLI imports this module; pydantic loads only when a stack does
    from dynamod.core.spec import Stack

BAD_INPUT = 2


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"dynamod: {message}", err=True)
    sys.exit(code)


def state_dir_of(ctx: click.Context, *, will_create: bool = False) -> Path:
    """The state dir, refused (exit 2) if it cannot be one; with `will_create`, also if
    this user could not create or write it. Creates nothing."""
    path: Path = ctx.obj["state_dir"]
    try:
        statedir.check(path, will_create=will_create)
    except StateDirError as exc:
        fail(str(exc), BAD_INPUT)
    return path


def create_state_dir(path: Path) -> None:
    try:
        statedir.create(path)
    except StateDirError as exc:
        fail(str(exc), BAD_INPUT)


def load_stack(
    stack: str | None,
    state_dir: Path,
    variables: tuple[str, ...],
    node: str | None = None,
    *,
    claim_ports: bool = False,
) -> Stack:
    """Read, render and validate STACK (NODE's share of it, for a cluster stack), then
    preflight it; exit 2 with the problems. Only a stack that will run (`claim_ports`, for
    `up`) claims its ports in the machine's registry: rendering it writes nothing."""
    from dynamod.control import tables
    from dynamod.core import ports, preflight, spec

    tables.register()  # the rollout layer's [policy] and dynamo tables
    path = paths.resolve_stack_path(stack)
    if stack is not None and path.parent == paths.units_dir() / "stacks" and not path.exists():
        stock = sorted(p.stem for p in path.parent.glob("*.toml"))
        known = f"stock stacks: {', '.join(stock)}" if stock else f"none in {path.parent}"
        fail(f"no stock stack {stack!r} ({known}); or give the path of a stack file", BAD_INPUT)
    try:
        overrides = dict(spec.parse_var(v) for v in variables)
        allocator = ports.PortAllocator(claim=claim_ports)
        resolved = spec.load(
            path,
            state_dir=state_dir.absolute(),
            allocate_port=allocator,
            var_overrides=overrides,
            node=node,
        )
        preflight.check(resolved, allocator.given)
    except SpecErrors as exc:
        head, _, rest = str(exc).partition("\n")
        if rest:
            fail(f"invalid stack, nothing was started: {head}\n{rest}", BAD_INPUT)
        fail(f"{head} (invalid stack, nothing was started)", BAD_INPUT)
    except DynamodError as exc:
        fail(str(exc), BAD_INPUT)
    return resolved


def _check_var(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> Any:
    for text in values:
        key, sep, _ = text.partition("=")
        if not sep:
            raise click.BadParameter(f"expects KEY=VALUE, got {text!r}")
        if not key or not set(key) <= limits.UNIT_NAME_CHARS:
            raise click.BadParameter(
                f"KEY may use letters, digits, '_' and '-' (it is read as {{vars.KEY}}), "
                f"got {key!r}"
            )
    return values


var_option = click.option(
    "--var",
    "variables",
    multiple=True,
    metavar="KEY=VALUE",
    callback=_check_var,
    help="Override a stack variable, e.g. --var workers=4.",
)


def check_unit_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A UNIT argument: `NAME` or `NAME@N` as a stack can define it."""
    if not limits.is_instance_name(value):
        raise click.BadParameter(
            f"expects a unit name (letters, digits, '_', '-', at most "
            f"{limits.MAX_NAME_LENGTH}, then @N for a replica), got {value!r}"
        )
    return value


def check_node_name(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """`--node NAME`: a node name as a [cluster] table can define it."""
    if value is not None and (
        not value or len(value) > limits.MAX_NAME_LENGTH or not set(value) <= limits.UNIT_NAME_CHARS
    ):
        raise click.BadParameter(
            f"expects a node name (letters, digits, '_', '-', at most "
            f"{limits.MAX_NAME_LENGTH}), got {value!r}"
        )
    return value


class Seconds(click.ParamType[float, Any]):
    """A positive, finite duration of at most limits.MAX_SECONDS."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            number = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                self.fail(f"expects a number of seconds, got {value!r}", param, ctx)
        if not math.isfinite(number) or not 0 < number <= limits.MAX_SECONDS:
            self.fail(
                f"expects seconds above 0 and at most {limits.MAX_SECONDS:g}, got {value!r}",
                param,
                ctx,
            )
        return number


def check_metrics_addr(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """`HOST:PORT` where HOST is an IP address or `localhost` (empty: 127.0.0.1)."""
    if value is None:
        return None
    from dynamod.ops.metrics import parse_address

    try:
        host, port = parse_address(value)
    except DynamodError:
        raise click.BadParameter(
            f"expects HOST:PORT (e.g. 127.0.0.1:9464), got {value!r}"
        ) from None
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise click.BadParameter(
                f"expects an IP address or localhost before the port, got {host!r}"
            ) from None
    if not value.rpartition(":")[2].isascii() or port == 0:
        raise click.BadParameter(f"expects a port from 1 to 65535, got {value!r}")
    return value
