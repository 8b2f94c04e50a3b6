"""Helpers shared by the command modules: stack loading with operator-facing errors."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from dynamod.core import paths
from dynamod.core.errors import DynamodError, SpecErrors

if TYPE_CHECKING:  # the CLI imports this module; pydantic loads only when a stack does
    from dynamod.core.spec import Stack


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"dynamod: {message}", err=True)
    sys.exit(code)


def state_dir_of(ctx: click.Context) -> Path:
    path: Path = ctx.obj["state_dir"]
    return path


def load_stack(stack: str | None, state_dir: Path, variables: tuple[str, ...]) -> Stack:
    from dynamod.core import ports, preflight, spec

    path = paths.resolve_stack_path(stack)
    try:
        overrides = dict(spec.parse_var(v) for v in variables)
        allocator = ports.PortAllocator()
        resolved = spec.load(
            path,
            state_dir=state_dir.absolute(),
            allocate_port=allocator,
            var_overrides=overrides,
        )
        preflight.check(resolved, allocator.given)
    except SpecErrors as exc:
        fail(f"invalid stack, nothing was started.\n{exc}", 2)
    except DynamodError as exc:
        fail(str(exc), 2)
    return resolved
