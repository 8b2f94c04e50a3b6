"""Checks that run after the stack validates and before anything spawns."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable

from dynamod.core import ports as portlib
from dynamod.core import process
from dynamod.core.errors import PreflightError
from dynamod.core.spec import Stack, UnitSpec, quantities


def check(stack: Stack, allocated: Iterable[int]) -> None:
    """Every command is installed, every cwd exists, every fixed port is free, every
    unit's `preflight` command passes. Raises with all problems (a problem every replica
    of a unit shares is named once)."""
    problems: list[str] = []
    given = set(allocated)
    checked: dict[tuple[str, ...], str | None] = {}
    for spec in stack.units.values():
        if spec.remote is not None:  # another node runs it; nothing is spawned here
            continue
        if spec.preflight is not None:
            key = tuple(spec.preflight)
            if key not in checked:
                checked[key] = _run_preflight(spec.preflight, spec.env)
                if checked[key] is not None:
                    problems.append(f"{spec.source}: unit {spec.unit!r}: {checked[key]}")
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
                f"{spec.source}: unit {spec.unit!r}: command {exe!r} is not installed "
                f"(not found on PATH){hint}"
            )
        if spec.cwd is not None and not os.path.isdir(spec.cwd):
            problems.append(
                f"{spec.source}: unit {spec.name!r}: cwd {spec.cwd!r} is not an existing "
                "directory"
            )
        problems += _cpus_not_here(spec)
        for name, port in spec.ports.items():
            if port not in given and portlib.in_use(port):
                problems.append(
                    f"{spec.source}: unit {spec.name!r}: port {name}={port} is already in use "
                    "on 127.0.0.1 (another process listens there; stop it or pick another "
                    "port, 0 allocates a free one)"
                )
    problems = list(dict.fromkeys(problems))
    if len(problems) == 1:
        raise PreflightError(f"cannot start the stack: {problems[0]}")
    if problems:
        raise PreflightError("cannot start the stack:\n" + "\n".join(f"  - {p}" for p in problems))


def _cpus_not_here(spec: UnitSpec) -> list[str]:
    """A cpuset (or a placement's CPUs) that names CPUs this process may not use."""
    cpuset = spec.limits.cpuset if spec.limits is not None else None
    if cpuset is None:
        return []
    here = frozenset(os.sched_getaffinity(0))
    missing = quantities.parse_cpu_list(cpuset) - here
    if not missing:
        return []
    placement = spec.placement
    how = (f" (placement cpus_per_replica={placement.cpus_per_replica}, replica "
           f"{spec.index or 0}: fewer replicas or fewer CPUs each)"
           if placement is not None and placement.cpus_per_replica else "")  # fmt: skip
    return [f"{spec.source}: unit {spec.name!r}: CPUs {quantities.cpu_list_text(missing)} of "
            f"its cpuset {cpuset!r}{how} are not on this machine (it may use "
            f"{quantities.cpu_list_text(here)})"]  # fmt: skip


PREFLIGHT_TIMEOUT_S = 60.0


def _run_preflight(command: list[str], env: dict[str, str]) -> str | None:
    """None when `command` exits 0; else the last line it wrote to stderr (or its exit)."""
    try:
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=PREFLIGHT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"preflight {command[0]!r} could not run: {exc}"
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"preflight {command!r} exited {done.returncode}"
