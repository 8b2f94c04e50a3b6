"""`dynamod` command line. Commands only ask the daemon (over its socket) or read files."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from dynamod.control import render
from dynamod.control.client import Client
from dynamod.control.cliutil import fail, load_stack, state_dir_of
from dynamod.control.commands import register_commands
from dynamod.core import paths
from dynamod.core.errors import DaemonError, DynamodError


@click.group()
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
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


_metrics_option = click.option(
    "--metrics-addr",
    default=None,
    metavar="HOST:PORT",
    help="Serve Prometheus metrics on this address (off by default).",
)

_var_option = click.option(
    "--var",
    "variables",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a stack variable, e.g. --var workers=4.",
)


@main.command()
@click.argument("stack", required=False)
@_var_option
@click.pass_context
def check(ctx: click.Context, stack: str | None, variables: tuple[str, ...]) -> None:
    """Validate STACK (a path or a stock stack name) without starting anything."""
    resolved = load_stack(stack, state_dir_of(ctx), variables)
    click.echo(f"{resolved.path}: stack {resolved.name!r} is valid, {len(resolved.units)} units")
    from dynamod.core import graph

    edges = {n: list(u.depends_on) for n, u in resolved.units.items()}
    for i, wave in enumerate(graph.levels(edges)):
        click.echo(f"  start wave {i}: {', '.join(wave)}")


@main.command()
@click.argument("stack", required=False)
@_var_option
@click.option(
    "--detach",
    is_flag=True,
    help="Run the daemon in the background; return "
    "0 once the whole stack is ready, non-zero with the reason if it cannot be.",
)
@click.option(
    "--timeout",
    type=float,
    default=None,
    help="With --detach: give up (and tear down) after this many seconds.",
)
@_metrics_option
@click.pass_context
def up(
    ctx: click.Context,
    stack: str | None,
    variables: tuple[str, ...],
    detach: bool,
    metrics_addr: str | None,
    timeout: float | None,
) -> None:
    """Start STACK (default: the local CPU rollout stack) and supervise it."""
    state_dir = state_dir_of(ctx)
    if Client(state_dir).running():
        fail(
            f"a dynamod daemon already runs with state dir {state_dir}; "
            "`dynamod status` shows it, `dynamod down` stops it"
        )
    resolved = load_stack(stack, state_dir, variables)
    if detach:
        sys.exit(_up_detached(resolved, state_dir, timeout, metrics_addr))
    sys.exit(_run_daemon(resolved, state_dir, progress=True, metrics_addr=metrics_addr))


def _run_daemon(
    resolved: Any, state_dir: Path, *, progress: bool, metrics_addr: str | None = None
) -> int:
    from dynamod.control.compose import default_extensions
    from dynamod.core import logsetup
    from dynamod.core.daemon import Daemon, StateDir

    logsetup.configure()

    async def main() -> int:
        daemon = Daemon(
            stack=resolved,
            state=StateDir(state_dir),
            extensions=default_extensions(resolved, metrics_addr=metrics_addr),
        )
        printer = asyncio.ensure_future(_print_progress(daemon)) if progress else None
        try:
            code = await daemon.run()
        finally:
            if printer is not None:
                printer.cancel()
        if daemon.error:
            click.echo(f"dynamod: stack {resolved.name} failed: {daemon.error}", err=True)
        return code

    try:
        return asyncio.run(main())
    except DynamodError as exc:
        fail(str(exc))


async def _print_progress(daemon: Any) -> None:
    progress = render.Progress()
    started = time.monotonic()
    announced = False
    while True:
        status = daemon.status()
        for line in progress.update(status, time.monotonic()):
            click.echo(line)
        if status["phase"] == "up" and not announced:
            announced = True
            click.echo(
                f"stack {status['stack']} ready in {time.monotonic() - started:.1f}s "
                f"({len(status['units'])} units); Ctrl-C or `dynamod down` stops it"
            )
        await asyncio.sleep(0.25)


def _up_detached(
    resolved: Any, state_dir: Path, timeout: float | None, metrics_addr: str | None
) -> int:
    """Fork the daemon off this process (it keeps the validated stack and the imports, so
    nothing is loaded twice), then follow its progress over the socket."""
    from dynamod.ops import sdnotify

    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    log_path = state_dir / "daemon.log"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _become_daemon(log_path)
        code = 1
        try:
            code = _run_daemon(resolved, state_dir, progress=False, metrics_addr=metrics_addr)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    sdnotify.notify(f"MAINPID={pid}")
    client = Client(state_dir)
    progress = render.Progress()
    started = time.monotonic()
    click.echo(f"dynamod daemon pid {pid}, state dir {state_dir}, log {log_path}")

    def exited() -> int | None:
        done, status = os.waitpid(pid, os.WNOHANG)
        return os.waitstatus_to_exitcode(status) if done else None

    def wait() -> int:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    while True:
        exit_code = exited()
        if exit_code is not None:
            return _explain_daemon_exit(client, state_dir, log_path, exit_code)
        try:
            status = client.status()
        except DaemonError:
            time.sleep(0.02)
            continue
        for line in progress.update(status, time.monotonic()):
            click.echo(line)
        if status["phase"] in {"up", "degraded"}:  # degraded: it was up, then a unit left
            click.echo(
                f"stack {status['stack']} ready in {time.monotonic() - started:.1f}s "
                f"({len(status['units'])} units)"
            )
            return 0
        if status["phase"] in {"failed", "stopping", "stopped"}:
            return _explain_daemon_exit(client, state_dir, log_path, wait())
        if timeout is not None and time.monotonic() - started > timeout:
            click.echo(f"dynamod: stack not ready after {timeout:g}s; tearing it down", err=True)
            waiting = [u for u in status["units"] if u["state"] not in {"ready", "completed"}]
            for unit in waiting:
                click.echo(f"  {unit['name']}: {unit['state']}: {unit['detail']}", err=True)
            client.down()
            wait()
            return 1
        time.sleep(0.05)


def _become_daemon(log_path: Path) -> None:
    """In the forked child: own session, no terminal, output to the daemon log. The child
    becomes systemd's main pid (MAINPID=), so WATCHDOG_PID, naming the parent, goes."""
    os.setsid()
    os.environ.pop("WATCHDOG_PID", None)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null_fd)
    os.close(log_fd)


def _explain_daemon_exit(client: Client, state_dir: Path, log_path: Path, code: int) -> int:
    last = state_dir / "last-down.json"
    error = None
    if last.exists():
        try:
            error = json.loads(last.read_text()).get("error")
        except ValueError:
            error = None
    if error:
        click.echo(f"dynamod: the stack did not come up: {error}", err=True)
    else:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        click.echo(
            f"dynamod: the daemon exited with status {code}; last lines of {log_path}:", err=True
        )
        for line in tail:
            click.echo(f"  | {line}", err=True)
    click.echo("nothing was left running.", err=True)
    return code or 1


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def down(ctx: click.Context, as_json: bool) -> None:
    """Stop every unit in reverse dependency order; exit 0 only when nothing is left."""
    state_dir = state_dir_of(ctx)
    client = Client(state_dir)
    try:
        pid = client.status()["daemon_pid"]
        result = client.down()
    except DaemonError as exc:
        fail(str(exc))
    _wait_pid_gone(int(pid), 30)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for unit in result["units"]:
            click.echo(f"  {unit['name']:<16} {unit['state']}  {unit['detail']}")
        verdict = "nothing left running" if result["ok"] else f"SURVIVORS {result['survivors']}"
        click.echo(f"stack down in {result['seconds']:.2f}s: {verdict}")
    sys.exit(0 if result["ok"] else 1)


def _wait_pid_gone(pid: int, timeout: float) -> None:
    """Until the daemon has exited. A zombie counts as gone: the detached daemon's parent
    is whatever reaps orphans here, which may take its time."""
    from dynamod.core.proctable import is_zombie

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not is_zombie(pid):
        time.sleep(0.01)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status object as JSON.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Show the unit tree: state, pid, uptime, restarts, last exit, probe detail."""
    try:
        result = Client(state_dir_of(ctx)).status()
    except DaemonError as exc:
        fail(str(exc))
    click.echo(json.dumps(result, indent=2) if as_json else render.status_table(result))


@main.command()
@click.argument("unit")
@click.pass_context
def restart(ctx: click.Context, unit: str) -> None:
    """Stop UNIT, reset its backoff and start it again."""
    try:
        Client(state_dir_of(ctx)).restart(unit)
    except DaemonError as exc:
        fail(str(exc))
    click.echo(f"{unit} restarted")


@main.command()
@click.argument("unit")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.option("-n", "--lines", default=50, show_default=True, help="Lines of history.")
@click.pass_context
def logs(ctx: click.Context, unit: str, follow: bool, lines: int) -> None:
    """Print UNIT's log (works after the daemon has gone too)."""
    from dynamod.control import logview

    try:
        logview.show(state_dir_of(ctx), unit, lines=lines, follow=follow, out=click.echo)
    except DynamodError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass


register_commands(main)

if __name__ == "__main__":
    main()
