"""The lifecycle commands: `check`, `up`, `down`: the stack as a whole. They ask the daemon
over its socket or read the state dir; starting the daemon itself is control/launch.py.
What asks the running daemon about one unit is units.py."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from dynamod.client import Client
from dynamod.client.control import BadInputError, NoDaemonError
from dynamod.control import launch, render
from dynamod.control.cliutil import (
    BAD_INPUT,
    Seconds,
    check_metrics_addr,
    check_node_name,
    create_state_dir,
    fail,
    load_stack,
    state_dir_of,
    var_option,
)
from dynamod.control.commands.apply import diff_lines, stack_path
from dynamod.control.launch import describe_daemon
from dynamod.core import leftovers, paths, runrecord
from dynamod.core.errors import DaemonError, DynamodError

if TYPE_CHECKING:
    from dynamod.core.leftovers import Leftovers
    from dynamod.core.spec import Stack
    from dynamod.ops.statuspage import WebSettings


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


@click.command()
@click.argument("stack", required=False)
@var_option
@_node_option
@click.option(
    "--vars", "list_vars", is_flag=True, help="List the stack's variables and their defaults."
)
@click.pass_context
def check(
    ctx: click.Context,
    stack: str | None,
    variables: tuple[str, ...],
    node: str | None,
    list_vars: bool,
) -> None:
    """Validate STACK (a path or a stock stack name) without starting anything."""
    resolved = load_stack(stack, state_dir_of(ctx, will_create=True), variables, node)
    if list_vars and resolved.source is not None:
        from dynamod.control import stackvars
        from dynamod.core.spec import parse_var

        overrides = dict(parse_var(v) for v in variables)
        for line in stackvars.lines(resolved.source.raw, overrides):
            click.echo(line)
        return
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
    outside = [f"{n} at {u.outside}" for n, u in resolved.units.items() if u.outside]
    if outside:
        click.echo(f"  outside the stack (waited for, not started): {', '.join(outside)}")
    click.echo(f"  identity {resolved.identity!r}: keys under dynamod/{resolved.identity}/")
    from dynamod.cluster import exposure

    tls = bool(getattr(getattr(resolved, "cluster", None), "secrets", None))
    for warning in exposure.spec_warnings(resolved, tls_request_plane=tls):
        click.echo(f"warning: {warning}", err=True)


@click.command()
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
@click.option(
    "--web",
    "web_addr",
    default=None,
    metavar="HOST:PORT",
    help="Serve a status page on this address (loopback; beyond it only with --web-token).",
)
@click.option(
    "--web-token",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE",
    help="A file whose first line is a token the status page asks of every request.",
)
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
    web_addr: str | None,
    web_token: Path | None,
) -> None:
    """Start STACK (default: the local CPU rollout stack) and supervise it."""
    web = _web_settings(web_addr, web_token)
    state_dir = state_dir_of(ctx, will_create=True)
    try:
        other = Client(state_dir).status()
    except DaemonError:
        other = None
    if other is not None:
        _refuse_running(other, state_dir, stack, variables)
    if join_address is not None:
        stack, variables, node = _joined(join_address, stack, variables, node, state_dir)
    resolved = load_stack(stack, state_dir, variables, node, claim_ports=True)
    web = web or _stack_web(resolved)
    _check_identity(resolved, state_dir)
    _check_containment_setting()
    create_state_dir(state_dir)
    _sweep_previous(state_dir)
    # The daemon we start carries this id; we only ever report on a daemon that has it.
    run_id = uuid.uuid4().hex[:16]
    if detach:
        sys.exit(launch.run_detached(resolved, state_dir, timeout, metrics_addr, run_id, web))
    code = launch.run_daemon(
        resolved, state_dir, progress=True, metrics_addr=metrics_addr, run_id=run_id, web=web
    )
    sys.exit(code)


def _web_settings(address: str | None, token_file: Path | None) -> WebSettings | None:
    """`--web` and `--web-token`, refused with one line (exit 2) before anything starts."""
    from dynamod.ops import statuspage

    if address is None:
        if token_file is not None:
            fail("up: --web-token needs --web HOST:PORT", BAD_INPUT)
        return None
    try:
        return statuspage.settings(address, token_file)
    except DynamodError as exc:
        fail(f"up --web: {exc}", BAD_INPUT)


def _stack_web(resolved: Stack) -> WebSettings | None:
    """The stack file's `[web]` table (`--web` overrides it); its token file unreadable:
    one line naming the file and field, exit 2."""
    from dynamod.ops import web_table

    try:
        return web_table.settings_of(resolved)
    except DynamodError as exc:
        fail(f"{resolved.path}, field 'web.token_file': {exc}", BAD_INPUT)


def _refuse_running(
    other: dict[str, Any], state_dir: Path, stack: str | None, variables: tuple[str, ...]
) -> NoReturn:
    """`up` while the stack runs: as it is, or, for its own file edited (or other --var
    values), the diff and the way to apply it."""
    running = f"{describe_daemon(other)} already runs with state dir {state_dir}"
    path = stack_path(stack) if stack is not None else paths.resolve_stack_path(None).absolute()
    if path == Path(str(other.get("stack_file"))):
        from dynamod.core.spec import parse_var

        try:
            answer = Client(state_dir).apply(
                path, dict(parse_var(v) for v in variables), dry_run=True
            )
        except BadInputError as exc:
            fail(f"{running}, and {exc}", BAD_INPUT)
        except DaemonError:
            answer = None
        if answer is not None and not answer["diff"]["empty"]:
            shown = " ".join(f"{stack or path}".split()) + "".join(f" --var {v}" for v in variables)
            fail(
                "\n".join([
                    f"{running}; {path} differs from it:",
                    *diff_lines(answer),
                    f"`dynamod apply {shown}` applies the change (--dry-run shows it first)",
                ])
            )  # fmt: skip
    fail(f"{running}; `dynamod status` shows it, `dynamod down` stops it")


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


def _check_identity(resolved: Stack, state_dir: Path) -> None:
    """A live daemon elsewhere holds this stack's identity, or its workers use this stack's
    Dynamo namespace, in the etcd the stack would use: refused, nothing started."""
    from dynamod.cluster.secrets import load_etcd_auth
    from dynamod.rollout import identity

    cluster = resolved.cluster
    secrets = getattr(cluster, "secrets", None)
    auth = load_etcd_auth(secrets, cluster.node) if secrets and cluster else None
    try:
        identity.check_before_up(resolved, str(state_dir.absolute()), auth)
    except identity.IdentityTaken as exc:
        fail(str(exc), BAD_INPUT)


def _check_containment_setting() -> None:
    from dynamod.core import cgroups

    try:
        cgroups.setting()
    except ValueError as exc:
        fail(str(exc), 2)


def _sweep_previous(state_dir: Path) -> Leftovers | None:
    """If the state dir's last daemon died, end what it left and say so."""
    swept = leftovers.sweep_previous(state_dir)
    if swept is not None:
        click.echo(f"dynamod: {swept.describe()}", err=True)
    return swept


@click.command()
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
    """Stop every unit in reverse dependency order; exit 0 only when nothing is left
    (also when nothing was running)."""
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
        if not isinstance(exc, NoDaemonError) or leftovers.held_by_daemon(state_dir):
            fail(str(exc))  # a daemon is there (starting, or not answering): not stopped
        _say_nothing_to_stop(state_dir, as_json)
        sys.exit(0)
    if result.get("run_id") != asked["run_id"]:  # the daemon changed between the two calls
        fail(
            f"{describe_daemon(asked)} was asked to stop, but {describe_daemon(result)} answered "
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


def _say_nothing_to_stop(state_dir: Path, as_json: bool) -> None:
    """`down` where no daemon runs, as `systemctl stop` of a stopped service: exit 0, and
    what the state dir says of the last run."""
    run = runrecord.read(state_dir)
    if run is None or not run.ended:
        words = f"no dynamod daemon is running for state dir {state_dir}"
    else:
        words = f"stack {run.stack_name} (run {run.run_id}) is already down"
        if run.ended == "swept":
            words += f": its daemon (pid {run.pid}) died, and what it left was swept"
    socket = paths.socket_path(state_dir)
    if socket.exists():
        words += f"; {socket} is a stale socket its daemon left (nothing listens on it)"
    if as_json:
        click.echo(json.dumps({"ok": True, "running": False, "message": words}, indent=2))
    else:
        click.echo(f"nothing to stop: {words}")


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


lifecycle_commands = [check, up, down]
