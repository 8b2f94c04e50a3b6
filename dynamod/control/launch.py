"""Starting the daemon from `dynamod up`: in the foreground (progress lines on the terminal),
or forked off into the background and followed over its socket until the stack is ready,
or until it is clear why it will not be."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dynamod.client import Client
from dynamod.control import render
from dynamod.control.cliutil import BAD_INPUT, fail
from dynamod.core import runrecord
from dynamod.core.errors import DaemonError, DynamodError, StateDirError

if TYPE_CHECKING:
    from dynamod.ops.statuspage import WebSettings


def describe_daemon(status: dict[str, Any]) -> str:
    return (
        f"a dynamod daemon (pid {status.get('daemon_pid')}, stack {status.get('stack')}, "
        f"run {status.get('run_id')})"
    )


def run_daemon(
    resolved: Any,
    state_dir: Path,
    *,
    progress: bool,
    run_id: str,
    metrics_addr: str | None = None,
    web: WebSettings | None = None,
) -> int:
    """Run the daemon in this process until it stops; its exit status."""
    from dynamod.control.compose import default_extensions
    from dynamod.core import logsetup
    from dynamod.core.daemon import Daemon, StateDir

    logsetup.configure(cache=True)

    async def main() -> int:
        daemon = Daemon(
            stack=resolved,
            state=StateDir(state_dir),
            extensions=default_extensions(resolved, metrics_addr=metrics_addr, web=web),
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
            if status.get("web"):
                click.echo(f"status page: {status['web']['url']}")
        await asyncio.sleep(0.25)


def run_detached(
    resolved: Any,
    state_dir: Path,
    timeout: float | None,
    metrics_addr: str | None,
    run_id: str,
    web: WebSettings | None = None,
) -> int:
    """Fork the daemon off this process (it keeps the validated stack and the imports, so
    nothing is loaded twice), then follow its progress over the socket; 0 once the stack
    is ready."""
    from dynamod.ops import sdnotify

    log_path = state_dir / "daemon.log"
    log_start = log_path.stat().st_size if log_path.exists() else 0
    pid = _fork_daemon(resolved, state_dir, log_path, metrics_addr, run_id, web)
    sdnotify.notify(f"MAINPID={pid}")
    click.echo(f"dynamod daemon pid {pid}, state dir {state_dir}, log {log_path}")
    forked = ForkedDaemon(Client(state_dir), state_dir, log_path, log_start, pid, run_id)
    return forked.follow(timeout)


def _fork_daemon(
    resolved: Any,
    state_dir: Path,
    log_path: Path,
    metrics_addr: str | None,
    run_id: str,
    web: WebSettings | None,
) -> int:
    """The child's pid; the child runs the daemon and never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        return pid
    code = 1
    try:
        _become_daemon(log_path)
        code = run_daemon(
            resolved, state_dir, progress=False, metrics_addr=metrics_addr, run_id=run_id, web=web
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


# `up` reads the daemon's whole status between its progress lines: every 0.05 s at first,
# then 2 % of the wait so far (a stack ready after 10 s is reported at most 0.2 s late), at
# most every 0.5 s. At 4 nodes x 32 shards, `up` asking every 0.05 s was a fifth of the head
# daemon's samples in the start (each answer ~170 KB with the cluster tree).
FOLLOW_MIN_S, FOLLOW_SHARE, FOLLOW_MAX_S = 0.05, 0.02, 0.5


def follow_pause(waited: float) -> float:
    """The pause before `up` asks the daemon again, `waited` s after it began."""
    return max(FOLLOW_MIN_S, min(FOLLOW_MAX_S, waited * FOLLOW_SHARE))


class ForkedDaemon:
    """The daemon `up --detach` forked: followed until its stack is ready, and if it exits
    first, why. Only a daemon answering with our run id is ours: another one on the socket
    means we lost a race for the state dir, and ours will fail its lock and exit."""

    def __init__(
        self, client: Client, state_dir: Path, log: Path, log_start: int, pid: int, run_id: str
    ) -> None:
        self.client, self.state_dir, self.log, self.log_start = client, state_dir, log, log_start
        self.pid, self.run_id = pid, run_id
        self.other: dict[str, Any] | None = None  # another daemon seen on the socket

    def follow(self, timeout: float | None) -> int:
        progress = render.Progress()
        started = time.monotonic()
        while True:
            exit_code = self._exit_code_now()
            if exit_code is not None:
                return self.explain_exit(exit_code)
            try:
                status = self.client.status()
            except DaemonError:
                time.sleep(0.02)
                continue
            if status.get("run_id") != self.run_id:  # another daemon's socket: not ours
                self.other = status
                time.sleep(0.02)
                continue
            for line in progress.update(status, time.monotonic()):
                click.echo(line)
            if status["phase"] in {"up", "degraded"}:  # degraded: it was up, then a unit left
                click.echo(
                    f"stack {status['stack']} ready in {time.monotonic() - started:.1f}s "
                    f"({len(status['units'])} units)"
                )
                if status.get("web"):
                    click.echo(f"status page: {status['web']['url']}")
                return 0
            if status["phase"] in {"failed", "stopping", "stopped"}:
                return self.explain_exit(self._wait())
            if timeout is not None and time.monotonic() - started > timeout:
                return self._give_up(status, timeout)
            time.sleep(follow_pause(time.monotonic() - started))

    def _exit_code_now(self) -> int | None:
        done, status = os.waitpid(self.pid, os.WNOHANG)
        return os.waitstatus_to_exitcode(status) if done else None

    def _wait(self) -> int:
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])

    def _give_up(self, status: dict[str, Any], timeout: float) -> int:
        click.echo(f"dynamod: stack not ready after {timeout:g}s; tearing it down", err=True)
        waiting = [u for u in status["units"] if u["state"] not in {"ready", "completed"}]
        for unit in waiting:
            why = unit.get("explain") or unit["detail"]
            click.echo(f"  {unit['name']}: {unit['state']}: {why}", err=True)
        self.client.down()
        self._wait()
        return 1

    def explain_exit(self, code: int) -> int:
        try:
            now = self.client.status()
        except DaemonError:
            now = None
        other = now if now is not None and now.get("run_id") != self.run_id else self.other
        other = other or self._winner_from_run_file()
        if other is not None:
            click.echo(
                f"dynamod: {describe_daemon(other)} holds state dir {self.state_dir}; "
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
        run = runrecord.read(self.state_dir)
        if run is None or run.run_id == self.run_id or not run.daemon_alive():
            return None
        return {"daemon_pid": run.pid, "stack": run.stack_name, "run_id": run.run_id}

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
