"""`dynamod systemd`: unit files for running a stack under systemd (see dynamod.ops.systemd)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dynamod.control.cliutil import var_option
from dynamod.core.errors import DynamodError

if TYPE_CHECKING:  # the CLI imports this module on every run: keep its imports light
    from dynamod.core.spec import Probe, Stack
    from dynamod.ops.systemd import UnitFile


def _generate(
    ctx: click.Context,
    stack: str | None,
    variables: tuple[str, ...],
    per_unit: bool,
    watchdog_sec: int,
) -> tuple[Stack, list[UnitFile]]:
    from dynamod.control.cliutil import fail, load_stack, state_dir_of
    from dynamod.ops import systemd

    resolved: Stack = load_stack(stack, state_dir_of(ctx), variables)
    dynamod = systemd.dynamod_command()
    try:
        if per_unit:
            files = systemd.per_unit_services(resolved, dynamod=dynamod)
        else:
            service = systemd.stack_service(
                resolved, dynamod=dynamod, variables=variables, watchdog_sec=watchdog_sec
            )
            files = [service]
    except DynamodError as exc:
        fail(str(exc), 2)
    if per_unit:
        click.echo("Not carried over to the per-unit services:", err=True)
        for gap in systemd.per_unit_gaps(resolved):
            click.echo(f"  - {gap}", err=True)
    return resolved, files


def _write(files: Sequence[UnitFile], directory: Path) -> None:
    from dynamod.control.cliutil import BAD_INPUT, fail

    try:
        directory.mkdir(parents=True, exist_ok=True)
        for unit_file in files:
            path = directory / unit_file.name
            path.write_text(unit_file.text)
            click.echo(f"wrote {path}")
    except OSError as exc:
        fail(f"cannot write unit files to {directory}: {exc.strerror or exc}", BAD_INPUT)


_stack_argument = click.argument("stack", required=False)
_per_unit_option = click.option(
    "--per-unit",
    is_flag=True,
    help="One systemd service per unit (plus a target) instead of one dynamod service.",
)
_watchdog_option = click.option(
    "--watchdog-sec",
    type=click.IntRange(1, 86400),
    default=30,
    show_default=True,
    help="WatchdogSec of dynamod@.service (dynamod pets it every half of that).",
)


@click.group("systemd")
def systemd_group() -> None:
    """Run a stack under systemd: dynamod@.service, or one service per unit."""


@systemd_group.command()
@_stack_argument
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Directory to write the unit files to.",
)
@_per_unit_option
@var_option
@_watchdog_option
@click.pass_context
def generate(
    ctx: click.Context,
    stack: str | None,
    out: Path,
    per_unit: bool,
    variables: tuple[str, ...],
    watchdog_sec: int,
) -> None:
    """Write systemd unit files for STACK (nothing is installed or started)."""
    _, files = _generate(ctx, stack, variables, per_unit, watchdog_sec)
    _write(files, out)


@systemd_group.command()
@_stack_argument
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/etc/systemd/system"),
    show_default=True,
    help="Where systemd looks for unit files.",
)
@_per_unit_option
@var_option
@_watchdog_option
@click.pass_context
def install(
    ctx: click.Context,
    stack: str | None,
    directory: Path,
    per_unit: bool,
    variables: tuple[str, ...],
    watchdog_sec: int,
) -> None:
    """Write STACK's unit files into DIR and print the systemctl commands that start it
    (systemctl itself is not run)."""
    from dynamod.ops import systemd

    resolved, files = _generate(ctx, stack, variables, per_unit, watchdog_sec)
    _write(files, directory)
    click.echo("to start it now and at boot, run:")
    for command in systemd.enable_commands(files, resolved):
        click.echo(f"  {command}")


@systemd_group.command("wait-ready", hidden=True)
@click.argument("probe_json")
def wait_ready(probe_json: str) -> None:
    """ExecStartPost of a per-unit service: wait until its readiness probe passes."""
    from pydantic import TypeAdapter, ValidationError

    from dynamod.control import tables
    from dynamod.core.spec import Probe

    tables.register()  # the probe may be of the rollout layer's kind
    try:
        probe: Probe = TypeAdapter(Probe).validate_json(probe_json)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "probe"
        click.echo(
            f"dynamod: not a readiness probe: {where}: {first['msg']} "
            f"({exc.error_count()} problem(s))",
            err=True,
        )
        sys.exit(2)
    ok, detail = asyncio.run(_wait_ready(probe))
    click.echo(detail, err=not ok)
    sys.exit(0 if ok else 1)


async def _wait_ready(probe: Probe) -> tuple[bool, str]:
    """Probe every `interval` until it passes or `deadline` runs out, like the engine does
    for a unit it spawned."""
    import aiohttp

    from dynamod.core import process
    from dynamod.core.logs import LogFile, OutputSink
    from dynamod.core.probes import ProbeContext, make_prober
    from dynamod.rollout import frontend_probe

    frontend_probe.register()

    reaper = process.Reaper()
    reaper.install(asyncio.get_running_loop())
    deadline = time.monotonic() + probe.deadline
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        # the unit's output goes to the journal, not to us: log probes are never generated
        sink = OutputSink(LogFile(Path(os.devnull)))
        ctx = ProbeContext(session=session, reaper=reaper, sink=sink, env=dict(os.environ))
        prober = make_prober(probe, ctx)
        try:
            while True:
                result = await prober.check()
                if result.ok:
                    return True, f"ready: {result.detail}"
                if time.monotonic() >= deadline:
                    return False, f"not ready within {probe.deadline:g}s: {result.detail}"
                await asyncio.sleep(probe.interval)
        finally:
            prober.close()
            sink.close()
