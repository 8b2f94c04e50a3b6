"""Spawn the real rollout stack (etcd, NATS, Dynamo frontend, CPU workers) for tests,
without a daemon: for tests of the parts the daemon is made of.

etcd and NATS are the units of units/etcd.toml and units/nats.toml, rendered as the stock
infra stack renders them (command, ports, readiness probe). Every process runs in its own
session (process group) on loopback with allocated ports and the environment dynamod gives
a unit, logs to a file, and is stopped by signalling its whole group: SIGTERM, then
SIGKILL. Readiness waits fail fast when the process exits and quote the end of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamod.core import process, spec
from dynamod.core.paths import units_dir
from dynamod.core.ports import PortAllocator
from dynamod.core.proctable import marked_pids
from dynamod.core.spec import Stack

REPO = Path(__file__).resolve().parents[2]
# Dynamo listens on the host's address unless told otherwise (its ZMQ event-plane
# sockets bind 0.0.0.0 regardless).
LOOPBACK_ENV = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_HTTP_RPC_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1",
}
BIN = Path(sys.executable).parent
INFRA_STACK = units_dir() / "stacks" / "infra.toml"


# Below the ephemeral range: Dynamo parses DYN_SYSTEM_PORT as an i16, and a port from
# the ephemeral range can be taken by an outgoing connection before the server binds it.
free_port = PortAllocator()


def http_json(
    method: str, url: str, body: Mapping[str, Any] | None = None, timeout: float = 10.0
) -> tuple[int, Any]:
    """(status, decoded JSON or raw text) for one request; HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class StackError(Exception):
    pass


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.alive():
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)
        # Whatever is left of the group (the leader or grandchildren) goes now.
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        return self.popen.returncode

    def wait_until(
        self, what: str, check: Callable[[], bool], timeout: float, interval: float = 0.1
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise StackError(
                    f"{self.name} exited with {self.popen.returncode} while waiting for {what}; "
                    f"log {self.log}:\n{self.tail()}"
                )
            with contextlib.suppress(OSError, ValueError):
                if check():
                    return
            time.sleep(interval)
        raise StackError(
            f"{self.name}: {what} not reached within {timeout}s; log {self.log}:\n{self.tail()}"
        )


@dataclass
class Worker:
    proc: Proc
    system_port: int

    @property
    def system_url(self) -> str:
        return f"http://127.0.0.1:{self.system_port}"

    def engine(self, route: str, body: Mapping[str, Any] | None = None) -> tuple[int, Any]:
        return http_json("POST", f"{self.system_url}/engine/{route}", body or {})

    def health(self) -> tuple[int, Any]:
        return http_json("GET", f"{self.system_url}/health", timeout=2)


@dataclass
class RawStack:
    """The processes of one test stack; `close()` stops them in reverse start order."""

    root: Path
    namespace: str = "dynamodtest"
    procs: list[Proc] = field(default_factory=list)
    etcd_port: int = 0
    nats_port: int = 0
    http_port: int = 0
    run_id: str = field(default_factory=lambda: f"rawstack-{uuid.uuid4().hex[:12]}")
    _infra: Stack | None = None

    def spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> Proc:
        """Start argv in a session of its own, logging to logs/NAME.log, with the
        environment dynamod gives a unit (the venv's bin dir first on PATH, a marker)."""
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=process.base_environment(self.run_id, name, env or {}),
                cwd=REPO,
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def dynamo_env(self) -> dict[str, str]:
        return {
            "ETCD_ENDPOINTS": f"http://127.0.0.1:{self.etcd_port}",
            "NATS_SERVER": f"nats://127.0.0.1:{self.nats_port}",
            "DYN_NAMESPACE": self.namespace,
            **LOOPBACK_ENV,
        }

    def infra(self) -> Stack:
        """etcd and NATS as units/etcd.toml and units/nats.toml define them (the stock
        infra stack), rendered once into this stack's root with allocated ports."""
        if self._infra is None:
            self._infra = spec.load(INFRA_STACK, state_dir=self.root, allocate_port=free_port)
        return self._infra

    def start_unit(self, name: str, timeout: float) -> Proc:
        """Start the infra unit NAME with its own command and env; wait for its readiness
        probe (an HTTP check with an expected JSON body) to pass."""
        unit = self.infra().units[name]
        probe: Any = unit.ready
        assert probe is not None and probe.kind == "http", f"{name}: expected an http probe"
        proc = self.spawn(name, list(unit.command), env=unit.env)

        def ready() -> bool:
            status, body = http_json(probe.method, probe.url, timeout=2)
            expected = probe.expect_json or {}
            return status == probe.expect_status and isinstance(body, dict) and all(
                body.get(k) == v for k, v in expected.items()
            )

        proc.wait_until(f"{name} {probe.url} {probe.expect_json}", ready, timeout)
        return proc

    def start_etcd(self, timeout: float = 30) -> Proc:
        proc = self.start_unit("etcd", timeout)
        self.etcd_port = self.infra().units["etcd"].ports["client"]
        return proc

    def start_nats(self, timeout: float = 30) -> Proc:
        proc = self.start_unit("nats", timeout)
        self.nats_port = self.infra().units["nats"].ports["client"]
        return proc

    def start_frontend(
        self, router_mode: str = "kv", extra: list[str] | None = None, timeout: float = 60
    ) -> Proc:
        self.http_port = free_port()
        proc = self.spawn(
            "frontend",
            [
                sys.executable,
                "-m",
                "dynamo.frontend",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(self.http_port),
                "--router-mode",
                router_mode,
                "--discovery-backend",
                "etcd",
                *(extra or []),
            ],
            env=self.dynamo_env(),
        )
        proc.wait_until(
            "frontend /health",
            lambda: http_json("GET", f"{self.frontend_url}/health", timeout=2)[0] == 200,
            timeout,
        )
        return proc

    @property
    def frontend_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start_worker(
        self,
        name: str,
        model_dir: Path,
        model_name: str,
        extra: list[str] | None = None,
        env: Mapping[str, str] | None = None,
        wait_ready: bool = True,
        timeout: float = 60,
    ) -> Worker:
        system_port = free_port()
        proc = self.spawn(
            name,
            [
                sys.executable,
                "-m",
                "dynamod.workers.cpu",
                "--model-path",
                str(model_dir),
                "--model-name",
                model_name,
                "--discovery-backend",
                "etcd",
                *(extra or []),
            ],
            env={**self.dynamo_env(), "DYN_SYSTEM_PORT": str(system_port), **(env or {})},
        )
        worker = Worker(proc, system_port)
        if wait_ready:
            proc.wait_until("worker /health 200", lambda: worker.health()[0] == 200, timeout)
        return worker

    def wait_model(self, model_name: str, timeout: float = 60) -> None:
        """Until the frontend lists the model (a worker registered and was discovered)."""
        frontend = next(p for p in self.procs if p.name == "frontend")

        def listed() -> bool:
            status, body = http_json("GET", f"{self.frontend_url}/v1/models", timeout=2)
            return status == 200 and any(m.get("id") == model_name for m in body.get("data", []))

        frontend.wait_until(f"model {model_name!r} in /v1/models", listed, timeout)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        for pid in marked_pids(self.run_id):  # a descendant that left its session
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def raw_stack(root: Path, namespace: str = "dynamodtest") -> Iterator[RawStack]:
    stack = RawStack(root, namespace)
    try:
        yield stack
    finally:
        stack.close()
