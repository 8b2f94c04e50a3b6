"""The supervisors benchmarked side by side: dynamod and supervisord, each started and
always ended by the benchmark."""

from __future__ import annotations

import contextlib
import datetime as dt
import http.client
import json
import os
import signal
import subprocess
import time
import xmlrpc.client
from pathlib import Path
from typing import Any

from bench.procs import (
    BIN,
    bench_mark,
    descendants,
    iso_epoch,
    kill_group,
    reap_when_adopted,
    reap_zombies,
    wait_until,
)
from dynamod.core import runrecord
from dynamod.ops.supervisord import supervisorctl_name

# --------------------------------------------------------------------------- dynamod


class Dynamod:
    """The real `dynamod` CLI against one state dir, plus fast status over its socket."""

    def __init__(self, state: Path, env: dict[str, str] | None = None) -> None:
        bench_mark()
        self.state = state
        # Extra environment for the CLI (and so the daemon it starts). Passed per call,
        # never set in os.environ: other threads spawn processes meanwhile, and a putenv
        # racing their fork+exec hands the child a freed environ (EFAULT from execve).
        self.env = env
        from dynamod.client import Client

        self.client = Client(state)

    def cli(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(BIN / "dynamod"), "--state-dir", str(self.state), *args]
        env = {**os.environ, **self.env} if self.env else None
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} exited {result.returncode}\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result

    def up(self, stack: str | Path, *variables: str, timeout: float = 300) -> float:
        """`dynamod up STACK --detach`; returns the wall time until it returned 0."""
        args = ["up", str(stack), "--detach", "--timeout", str(timeout)]
        for var in variables:
            args += ["--var", var]
        started = time.monotonic()
        self.cli(*args, timeout=timeout + 60)
        took = time.monotonic() - started
        pid = self.daemon_pid()
        if pid:
            reap_when_adopted(pid)
        return took

    def daemon_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.state / "dynamod.pid").read_text().strip())
        return None

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.client.status()
        return result

    def unit(self, name: str) -> dict[str, Any]:
        return next(u for u in self.status()["units"] if u["name"] == name)

    def running(self) -> bool:
        return (self.state / "dynamod.sock").exists() and self.client.running()

    def down(self) -> dict[str, Any]:
        out = self.cli("down", "--json", timeout=300, check=False)
        try:
            result: dict[str, Any] = json.loads(out.stdout)
        except ValueError:
            raise RuntimeError(f"dynamod down: {out.stdout[-2000:]} {out.stderr[-2000:]}") from None
        return result

    def run_id(self) -> str | None:
        run = runrecord.read(self.state)
        return run.run_id if run is not None else None

    def events(self) -> list[dict[str, Any]]:
        """daemon.log JSON lines, each with `t` (epoch seconds) added."""
        found: list[dict[str, Any]] = []
        path = self.state / "daemon.log"
        if not path.exists():
            return found
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if "timestamp" in event:
                event["t"] = iso_epoch(event["timestamp"])
                found.append(event)
        return found

    def transitions(self, unit: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events()
            if e.get("event") == "unit.state" and (unit is None or e.get("unit") == unit)
        ]

    def close(self) -> None:
        """Down if a daemon answers; then SIGKILL anything still carrying its run marker."""
        with contextlib.suppress(Exception):
            if self.running():
                self.down()
        run_id = self.run_id()
        if run_id:
            from dynamod.core.proctable import marked_pids

            for pid in marked_pids(run_id):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        reap_zombies()


# --------------------------------------------------------------------------- supervisord


class Supervisord:
    """The same stack under supervisord, from `dynamod export supervisord`."""

    def __init__(self, state: Path, stack: str | Path, *variables: str) -> None:
        bench_mark()
        self.state = state
        self.conf = state / "supervisord.conf"
        args = [
            str(BIN / "dynamod"),
            "--state-dir",
            str(state),
            "export",
            "supervisord",
            str(stack),
            "--out",
            str(self.conf),
        ]
        for var in variables:
            args += ["--var", var]
        subprocess.run(args, capture_output=True, text=True, check=True, timeout=60)
        # the export only renders (it writes no directory); its config says to make this
        (state / "logs").mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def rpc(self) -> Any:
        """A fresh XML-RPC proxy over the unix socket (a failed call breaks a proxy)."""
        from supervisor.xmlrpc import SupervisorTransport

        return xmlrpc.client.ServerProxy(
            "http://127.0.0.1",
            transport=SupervisorTransport(None, None, f"unix://{self.state}/supervisord.sock"),
        )

    def config_text(self) -> str:
        return self.conf.read_text()

    def start(self) -> float:
        """Start supervisord; returns time.monotonic() at the spawn."""
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [str(BIN / "supervisord"), "-c", str(self.conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return started

    def info(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.rpc.supervisor.getAllProcessInfo()
        return result

    def process_info(self, instance: str) -> dict[str, Any]:
        """supervisord's record of a unit instance (worker@1 is worker:worker-1 to it)."""
        info: dict[str, Any] = self.rpc.supervisor.getProcessInfo(supervisorctl_name(instance))
        return info

    def pid(self, instance: str) -> int:
        return int(self.process_info(instance)["pid"])

    def wait_rpc(self, timeout: float = 30) -> None:
        def answers() -> bool:
            try:
                self.info()
            except (OSError, xmlrpc.client.Fault, http.client.HTTPException):
                return False
            return True

        wait_until(answers, timeout, 0.02, "supervisord's socket")

    def log_events(self) -> list[tuple[float, str]]:
        """(epoch seconds, message) from supervisord.log (millisecond timestamps)."""
        found: list[tuple[float, str]] = []
        path = self.state / "supervisord.log"
        if not path.exists():
            return found
        for line in path.read_text(errors="replace").splitlines():
            try:
                stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            except ValueError:
                continue
            found.append((stamp.timestamp(), line[24:]))
        return found

    def stop(self, timeout: float = 60) -> float:
        """SIGTERM supervisord (it stops every program, then exits); seconds it took."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait(10)
        return time.monotonic() - started

    def close(self) -> None:
        if self.proc is not None:
            tree = descendants(self.proc.pid)
            with contextlib.suppress(Exception):
                self.stop(30)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            kill_group(self.proc.pid)
