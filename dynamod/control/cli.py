"""`dynamod` command line. Commands only ask the daemon (over its socket) or read files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dynamod.client import Client
from dynamod.control import render
from dynamod.control.cliutil import (
    BAD_INPUT,
    Seconds,
    check_metrics_addr,
    check_node_name,
    check_unit_name,
    create_state_dir,
    fail,
    load_stack,
    state_dir_of,
    var_option,
)
from dynamod.control.commands import register_commands
from dynamod.core import paths
from dynamod.core.errors import DaemonError, DynamodError, StateDirError

_NoArgsIsHelp: type[click.UsageError] = getattr(
    click.exceptions, "NoArgsIsHelpError", click.exceptions.UsageError
)

if TYPE_CHECKING:
    from dynamod.core.leftovers import Leftovers


class _Cli(click.Group):
    """The `dynamod` group, with click's three-line usage errors turned into one line:
    `dynamod up: --timeout expects ..., got '-1' (see dynamod up --help)`, exit 2."""

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


_metrics_option = click.option(
    "--metrics-addr",
    default=None,
    metavar="HOST:PORT",
    callback=check_metrics_addr,
    help="Serve Prometheus metrics on this address (off by default).",
)


_node_option = click.option(
    "--node",
    default=None,
    callback=check_node_name,
    help="A cluster stack: this node's share of it (a name in its [cluster] nodes; "
    "default: the head).",
)


@main.command()
@click.argument("stack", required=False)
@var_option
@_node_option
@click.pass_context
def check(
    ctx: click.Context, stack: str | None, variables: tuple[str, ...], node: str | None
) -> None:
    """Validate STACK (a path or a stock stack name) without starting anything."""
    resolved = load_stack(stack, state_dir_of(ctx, will_create=True), variables, node)
    click.echo(f"{resolved.path}: stack {resolved.name!r} is valid, {len(resolved.units)} units")
    if resolved.cluster is not None:
        cluster = resolved.cluster
        remote = sorted(n for n, u in resolved.units.items() if u.remote)
        click.echo(
            f"  node {cluster.node} ({cluster.address}) of {', '.join(cluster.nodes)}; head "
            f"{cluster.head}; on other nodes: {', '.join(remote) or 'nothing it depends on'}"
        )
    from dynamod.core import graph

    edges = {n: list(u.depends_on) for n, u in resolved.units.items()}
    for i, wave in enumerate(graph.levels(edges)):
        click.echo(f"  start wave {i}: {', '.join(wave)}")
    from dynamod.cluster import exposure

    tls = bool(getattr(getattr(resolved, "cluster", None), "secrets", None))
    for warning in exposure.spec_warnings(resolved, tls_request_plane=tls):
        click.echo(f"warning: {warning}", err=True)


@main.command()
@click.argument("stack", required=False)
@var_option
@click.option(
    "--detach",
    is_flag=True,
    help="Run the daemon in the background; return "
    "0 once the whole stack is ready, non-zero with the reason if it cannot be.",
)
@click.option(
    "--timeout",
    type=Seconds(),
    default=None,
    help="With --detach: give up (and tear down) after this many seconds.",
)
@_metrics_option
@_node_option
@click.option(
    "--join",
    "join_address",
    default=None,
    metavar="ADDR",
    help="Start this node's share of the cluster stack the head published in its etcd at "
    "ADDR (host:port); STACK, if given, is the stack's name.",
)
@click.pass_context
def up(
    ctx: click.Context,
    stack: str | None,
    variables: tuple[str, ...],
    detach: bool,
    metrics_addr: str | None,
    timeout: float | None,
    node: str | None,
    join_address: str | None,
) -> None:
    """Start STACK (default: the local CPU rollout stack) and supervise it."""
    state_dir = state_dir_of(ctx, will_create=True)
    try:
        other = Client(state_dir).status()
    except DaemonError:
        other = None
    if other is not None:
        fail(
            f"{_daemon_named(other)} already runs with state dir {state_dir}; "
            "`dynamod status` shows it, `dynamod down` stops it"
        )
    if join_address is not None:
        stack, variables, node = _joined(join_address, stack, variables, node, state_dir)
    resolved = load_stack(stack, state_dir, variables, node)
    _check_containment_setting()
    create_state_dir(state_dir)
    _sweep_previous(state_dir)
    # The daemon we start carries this id; we only ever report on a daemon that has it.
    run_id = uuid.uuid4().hex[:16]
    if detach:
        sys.exit(_up_detached(resolved, state_dir, timeout, metrics_addr, run_id))
    sys.exit(
        _run_daemon(resolved, state_dir, progress=True, metrics_addr=metrics_addr, run_id=run_id)
    )


def _joined(
    address: str, name: str | None, variables: tuple[str, ...], node: str | None, state_dir: Path
) -> tuple[str, tuple[str, ...], str]:
    """`up --join`: the stack the head published, written into the state dir; its
    variables (this command's --var on top) and this node's name."""
    from dynamod.cluster import join

    try:
        bundle = asyncio.run(join.fetch(address, name))
        path = join.unpack(bundle, state_dir / "joined")
        node = node or join.this_node(bundle)
    except join.JoinError as exc:
        fail(str(exc), BAD_INPUT)
    click.echo(f"joining stack {bundle.stack!r} from {address} as node {node}", err=True)
    published = tuple(f"{k}={v}" for k, v in bundle.variables.items())
    return str(path), (*published, *variables), node


def _daemon_named(status: dict[str, Any]) -> str:
    return (
        f"a dynamod daemon (pid {status.get('daemon_pid')}, stack {status.get('stack')}, "
        f"run {status.get('run_id')})"
    )


def _check_containment_setting() -> None:
    from dynamod.core import cgroups

    try:
        cgroups.setting()
    except ValueError as exc:
        fail(str(exc), 2)


def _sweep_previous(state_dir: Path) -> Leftovers | None:
    """If the state dir's last daemon died, end what it left and say so."""
    from dynamod.core import leftovers

    swept = leftovers.sweep_previous(state_dir)
    if swept is not None:
        click.echo(f"dynamod: {swept.describe()}", err=True)
    return swept


def _run_daemon(
    resolved: Any,
    state_dir: Path,
    *,
    progress: bool,
    run_id: str,
    metrics_addr: str | None = None,
) -> int:
    from dynamod.control.compose import default_extensions
    from dynamod.core import logsetup
    from dynamod.core.daemon import Daemon, StateDir

    logsetup.configure(cache=True)

    async def main() -> int:
        daemon = Daemon(
            stack=resolved,
            state=StateDir(state_dir),
            extensions=default_extensions(resolved, metrics_addr=metrics_addr),
            run_id=run_id,
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
    except StateDirError as exc:
        fail(str(exc), BAD_INPUT)
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
    resolved: Any, state_dir: Path, timeout: float | None, metrics_addr: str | None, run_id: str
) -> int:
    """Fork the daemon off this process (it keeps the validated stack and the imports, so
    nothing is loaded twice), then follow its progress over the socket. Only a daemon
    answering with our run id is ours: another one there means we lost a race for the
    state dir, and ours will fail its lock and exit."""
    from dynamod.ops import sdnotify

    log_path = state_dir / "daemon.log"
    log_start = log_path.stat().st_size if log_path.exists() else 0
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _become_daemon(log_path)
            code = _run_daemon(
                resolved, state_dir, progress=False, metrics_addr=metrics_addr, run_id=run_id
            )
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:  # never return into the parent's code, even if the log cannot be written
            with contextlib.suppress(Exception):
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

    ours = _Ours(client, state_dir, log_path, log_start, pid, run_id)
    while True:
        exit_code = exited()
        if exit_code is not None:
            return ours.explain_exit(exit_code)
        try:
            status = client.status()
        except DaemonError:
            time.sleep(0.02)
            continue
        if status.get("run_id") != run_id:  # another daemon's socket: not ours to report
            ours.other = status
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
            return ours.explain_exit(wait())
        if timeout is not None and time.monotonic() - started > timeout:
            click.echo(f"dynamod: stack not ready after {timeout:g}s; tearing it down", err=True)
            waiting = [u for u in status["units"] if u["state"] not in {"ready", "completed"}]
            for unit in waiting:
                why = unit.get("explain") or unit["detail"]
                click.echo(f"  {unit['name']}: {unit['state']}: {why}", err=True)
            client.down()
            wait()
            return 1
        time.sleep(0.05)


def _become_daemon(log_path: Path) -> None:
    """In the forked child: own session, no terminal, output to the daemon log, no other
    inherited descriptor. The child becomes systemd's main pid (MAINPID=), so
    WATCHDOG_PID, naming the parent, goes."""
    os.setsid()
    os.environ.pop("WATCHDOG_PID", None)
    # Whatever else the caller left open (a wrapper's pipe) would keep it waiting for EOF
    # for as long as the daemon lives; the daemon needs none of it.
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null_fd)
    os.close(log_fd)


class _Ours:
    """What `up --detach` knows about the daemon it forked, to explain why it exited."""

    def __init__(
        self, client: Client, state_dir: Path, log: Path, log_start: int, pid: int, run_id: str
    ) -> None:
        self.client, self.state_dir, self.log, self.log_start = client, state_dir, log, log_start
        self.pid, self.run_id = pid, run_id
        self.other: dict[str, Any] | None = None  # another daemon seen on the socket

    def explain_exit(self, code: int) -> int:
        try:
            now = self.client.status()
        except DaemonError:
            now = None
        other = now if now is not None and now.get("run_id") != self.run_id else self.other
        other = other or self._winner_from_run_file()
        if other is not None:
            click.echo(
                f"dynamod: {_daemon_named(other)} holds state dir {self.state_dir}; "
                f"the daemon this command started (pid {self.pid}) exited with status {code} "
                "without starting anything",
                err=True,
            )
            return code or 1
        error = self._own_last_down_error()
        if error:
            click.echo(f"dynamod: the stack did not come up: {error}", err=True)
        else:
            click.echo(
                f"dynamod: the daemon exited with status {code}; its lines in {self.log}:",
                err=True,
            )
            for line in self._own_log_lines()[-15:]:
                click.echo(f"  | {line}", err=True)
        click.echo("nothing was left running.", err=True)
        return code or 1

    def _winner_from_run_file(self) -> dict[str, Any] | None:
        """Another live daemon named in run.json (it may not serve its socket yet)."""
        try:
            run = json.loads((self.state_dir / "run.json").read_text())
            pid = int(run["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if run.get("run_id") == self.run_id or not Path(f"/proc/{pid}").exists():
            return None
        return {"daemon_pid": pid, "stack": run.get("stack_name"), "run_id": run.get("run_id")}

    def _own_last_down_error(self) -> str | None:
        try:
            last = json.loads((self.state_dir / "last-down.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(last, dict) or last.get("run_id") != self.run_id:
            return None  # a previous run's, or another daemon's
        error = last.get("error")
        return str(error) if error else None

    def _own_log_lines(self) -> list[str]:
        try:
            with self.log.open("rb") as fh:
                fh.seek(self.log_start)
                return fh.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option(
    "--cluster",
    "whole_cluster",
    is_flag=True,
    help="A cluster stack: stop every node, in reverse dependency order across nodes.",
)
@click.option(
    "--wait",
    "wait_s",
    type=Seconds(),
    default=30.0,
    help="With --cluster: seconds to wait for each node's answer to each step.",
)
@click.pass_context
def down(ctx: click.Context, as_json: bool, whole_cluster: bool, wait_s: float) -> None:
    """Stop every unit in reverse dependency order; exit 0 only when nothing is left."""
    state_dir = state_dir_of(ctx)
    client = Client(state_dir)
    if whole_cluster:
        _down_cluster(client, as_json, wait_s)
        return
    try:
        asked = client.status()
        result = client.down()
    except DaemonError as exc:
        swept = _sweep_previous(state_dir)  # no daemon answers: did the last one die?
        if swept is not None:
            sys.exit(1 if swept.survivors else 0)
        fail(str(exc))
    if result.get("run_id") != asked["run_id"]:  # the daemon changed between the two calls
        fail(
            f"{_daemon_named(asked)} was asked to stop, but {_daemon_named(result)} answered "
            f"and stopped; check `dynamod status`"
        )
    _wait_pid_gone(int(asked["daemon_pid"]), 30)
    guardian = (asked.get("guardian") or {}).get("pid")
    if guardian:  # it exits once it has found nothing left: `down` is done after that
        _wait_pid_gone(int(guardian), 10)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for unit in result["units"]:
            click.echo(f"  {unit['name']:<16} {unit['state']}  {unit['detail']}")
        if result.get("warning"):
            click.echo(f"warning: {result['warning']}", err=True)
        for line in render.down_report(result):
            click.echo(line)
    sys.exit(0 if result["ok"] else 1)


def _down_cluster(client: Client, as_json: bool, wait_s: float) -> None:
    try:
        asked = client.status()
        if not asked.get("cluster"):
            fail(
                f"down --cluster: stack {asked.get('stack')} has no [cluster] table; "
                "use `dynamod down`",
                BAD_INPUT,
            )
        result = client.down_cluster(wait_s)
    except DaemonError as exc:
        fail(str(exc))
    _wait_pid_gone(int(asked["daemon_pid"]), 30)
    own = result.get("this_node_down", {})
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(f"cluster stopped in {result['seconds']:.1f}s, tiers: {result['tiers']}")
        for name, node in result["nodes"].items():
            stopped = ", ".join(node["stopped"]) or "nothing"
            why = f"  ({node['why']})" if node.get("why") else ""
            answered = "answered" if node["answered"] else "NO ANSWER"
            click.echo(f"  {name:<12} {answered}: stopped {stopped}{why}")
        for line in render.down_report(own):
            click.echo(line)
    sys.exit(0 if result["ok"] and own.get("ok") else 1)


def _wait_pid_gone(pid: int, timeout: float) -> None:
    """Until the daemon (or its guardian) has exited. A zombie counts as gone: the detached
    daemon's parent is whatever reaps orphans here, which may take its time."""
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
@click.argument("unit", callback=check_unit_name)
@click.pass_context
def restart(ctx: click.Context, unit: str) -> None:
    """Stop UNIT, reset its backoff and start it again."""
    try:
        Client(state_dir_of(ctx)).restart(unit)
    except DaemonError as exc:
        fail(str(exc))
    click.echo(f"{unit} restarted")


@main.command()
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


register_commands(main)

if __name__ == "__main__":
    main()
