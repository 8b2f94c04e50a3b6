"""Checks that run after the stack validates and before anything spawns."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

from dynamod.core import ports as portlib
from dynamod.core import process
from dynamod.core.errors import PreflightError
from dynamod.core.spec import Stack


def check(stack: Stack, allocated: Iterable[int]) -> None:
    """Every command is installed, every cwd exists, every fixed port is free. Raises
    with all problems."""
    problems: list[str] = []
    given = set(allocated)
    for spec in stack.units.values():
        if spec.remote is not None:  # another node runs it; nothing is spawned here
            continue
        env = process.base_environment("preflight", spec.name, spec.env)
        exe = spec.command[0]
        found = (
            os.path.isfile(exe) and os.access(exe, os.X_OK)
            if os.sep in exe
            else shutil.which(exe, path=env.get("PATH")) is not None
        )
        if not found:
            hint = f"; {spec.install_hint}" if spec.install_hint else ""
            problems.append(
                f"{spec.source}: unit {spec.name!r}: command {exe!r} is not installed "
                f"(not found on PATH){hint}"
            )
        if spec.cwd is not None and not os.path.isdir(spec.cwd):
            problems.append(
                f"{spec.source}: unit {spec.name!r}: cwd {spec.cwd!r} is not an existing "
                "directory"
            )
        for name, port in spec.ports.items():
            if port not in given and portlib.in_use(port):
                problems.append(
                    f"{spec.source}: unit {spec.name!r}: port {name}={port} is already in use "
                    "on 127.0.0.1 (another process listens there; stop it or pick another "
                    "port, 0 allocates a free one)"
                )
    if len(problems) == 1:
        raise PreflightError(f"cannot start the stack: {problems[0]}")
    if problems:
        raise PreflightError("cannot start the stack:\n" + "\n".join(f"  - {p}" for p in problems))
