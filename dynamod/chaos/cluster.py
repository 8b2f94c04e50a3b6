"""A simulated cluster for tests and benchmarks: a netns `Sandbox` with one node per name
(the first is the head), the cluster stack file rewritten with the sandbox's addresses,
the secrets directory a stack with `[cluster] secrets` needs (made for those addresses by
`dynamod secrets init`), one `dynamod up --node NAME --detach` per node with its own state
dir, CLI calls against each node's daemon, load from a thread inside the head's namespace,
a unit held down (killed, its port taken by a socket that resets every connection, so it
cannot come back and its clients fail over at once), and a `close` that stops every daemon
it started and removes the sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from dynamod.chaos.faults import listen_when_free
from dynamod.chaos.load import LoadGenerator
from dynamod.chaos.model import Load
from dynamod.chaos.netns import Sandbox
from dynamod.client import Client
from dynamod.core import paths
from dynamod.core.errors import DaemonError, DynamodError
from dynamod.rollout import dynamo
from dynamod.rollout.etcd import EtcdAuth, EtcdClient

NODE_NAMES = ("head", *(f"n{i}" for i in range(1, 8)))  # up to 8 nodes (bench.fleet)
_NODES_LINE = re.compile(r"^nodes = \{.*\}$", re.MULTILINE)
_SECRETS_LINE = re.compile(r'^secrets = "([^"]+)"', re.MULTILINE)
_BASE_LINE = re.compile(r'^base = "([^"]+)"$', re.MULTILINE)


class ClusterError(DynamodError):
    """A node of the simulated cluster did not do what was asked; carries its output."""


class ClusterRig:
    def __init__(
        self,
        n_nodes: int = 3,
        *,
        stack: Path | None = None,
        variables: dict[str, str] | None = None,
        work_dir: Path | None = None,
    ) -> None:
        self.names = list(NODE_NAMES[:n_nodes])
        self.variables = variables or {}
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix="dmc", dir="/tmp"))
        self.source = stack or paths.units_dir() / "stacks" / "cluster.toml"
        self.sandbox: Sandbox | None = None
        self.stack_file = self.work_dir / "cluster.toml"
        self.started: set[str] = set()
        # set by the user of running_cluster where something failed that did not raise
        # through it (a test of a module that shares the rig): the logs are kept
        self.keep = False

    def state_dir(self, node: str) -> Path:
        return self.work_dir / node

    def address(self, node: str) -> str:
        assert self.sandbox is not None
        return self.sandbox.address(self.names.index(node))

    def open(self) -> ClusterRig:
        """The sandbox and the stack file with its addresses (no daemon yet)."""
        self.sandbox = Sandbox(len(self.names), prefix="dmc")
        nodes = ", ".join(f'{n} = "{self.address(n)}"' for n in self.names)
        texts = _rewritten(self.source, f"nodes = {{ {nodes} }}", self.stack_file)
        if not any(_NODES_LINE.search(text) for text in texts):
            raise ClusterError(f"{self.source}: no `nodes = {{...}}` line to rewrite")
        for text in texts:
            secrets_dir = _SECRETS_LINE.search(text)
            if secrets_dir:  # relative to the stack file, as `up` reads it
                self._init_secrets(self.work_dir / secrets_dir.group(1))
        return self

    def _init_secrets(self, path: Path) -> None:
        nodes = ",".join(f"{n}={self.address(n)}" for n in self.names)
        made = subprocess.run(
            [sys.executable, "-m", "dynamod", "secrets", "init", str(path), "--nodes", nodes],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if made.returncode != 0:
            raise ClusterError(f"dynamod secrets init {path} failed: {made.stderr[-2000:]}")

    def _cli(self, node: str, *args: str) -> list[str]:
        return [sys.executable, "-m", "dynamod", "--state-dir", str(self.state_dir(node)), *args]

    def up(
        self, nodes: Sequence[str] | None = None, timeout: float = 240, join: str | None = None
    ) -> None:
        """Start the nodes' daemons in parallel; raise naming every node that failed. With
        `join` (the head's etcd, host:port), by `up --join` alone: no stack file, no --node."""
        assert self.sandbox is not None
        wanted = list(nodes or self.names)
        var_args = [a for k, v in self.variables.items() for a in ("--var", f"{k}={v}")]
        procs = {}
        for node in wanted:
            what = (
                ["--join", join]
                if join is not None
                else [str(self.stack_file), "--node", node, *var_args]
            )
            argv = self._cli(node, "up", *what, "--detach", "--timeout", str(int(timeout)))
            procs[node] = self.sandbox.run(
                self.names.index(node),
                argv,
                env=dict(os.environ),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            self.started.add(node)
        failed = []
        for node, proc in procs.items():
            out, _ = proc.communicate(timeout=timeout + 30)
            if proc.returncode != 0:
                failed.append(
                    f"{node} (exit {proc.returncode}):\n{out.decode(errors='replace')[-3000:]}"
                )
        if failed:
            raise ClusterError("dynamod up failed on " + "\n".join(failed))

    def run(self, node: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A CLI command against the node's daemon (over its socket; from the host)."""
        return subprocess.run(
            self._cli(node, *args), capture_output=True, text=True, timeout=timeout
        )

    def run_inside(
        self, node: str, state_dir: Path, *args: str, timeout: float = 240
    ) -> subprocess.CompletedProcess[str]:
        """A CLI command run inside the node's network namespace with a state dir of the
        caller's: another stack (or a copy of a node) on that node, reaching the cluster's
        addresses from there. Its daemon, if it starts one, is the caller's to stop."""
        assert self.sandbox is not None
        argv = [sys.executable, "-m", "dynamod", "--state-dir", str(state_dir), *args]
        proc = self.sandbox.run(
            self.names.index(node), argv, env=dict(os.environ),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(
            argv, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
        )

    def status(self, node: str) -> dict[str, Any]:
        """The node daemon's status, over its socket from this process (no CLI start-up)."""
        try:
            return Client(self.state_dir(node)).status()
        except DaemonError as exc:
            raise ClusterError(f"status on {node} failed: {exc}") from None

    def wait(self, what: str, check: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            with contextlib.suppress(ClusterError, ValueError, KeyError):
                last = check()
                if last:
                    return last
            time.sleep(every)
        raise ClusterError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")

    def frontend_url(self) -> str:
        status = self.status(self.names[0])
        port = next(u for u in status["units"] if u["name"] == "frontend")["ports"]["http"]
        return f"http://127.0.0.1:{port}"

    def load(self, spec: Load, model: str, current: Callable[[], int | None]) -> NodeLoad:
        """Completion load from a thread inside the head's namespace (not started yet)."""
        assert self.sandbox is not None
        url = self.frontend_url()
        return NodeLoad(self.sandbox, 0, spec, lambda: url, model, time.monotonic(), current)

    def in_node(self, node: str, work: Callable[[], Any]) -> Any:
        """Run `work` in a thread inside the node's namespace and return its result."""
        assert self.sandbox is not None
        sandbox, index = self.sandbox, self.names.index(node)
        with ThreadPoolExecutor(1, initializer=lambda: sandbox.enter(index)) as pool:
            return pool.submit(work).result()

    def routed(self, namespace: str = "dynamod") -> set[int]:
        """Instance ids in the head's frontend's discovery view (what its router picks)."""
        url = self.frontend_url()

        async def ask() -> set[int]:
            async with aiohttp.ClientSession() as session:
                return await dynamo.frontend_routed_instances(session, url, namespace, timeout_s=2)

        try:
            result: set[int] = self.in_node(self.names[0], lambda: asyncio.run(ask()))
        except (dynamo.DynamoHTTPError, aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise ClusterError(f"the head's frontend did not list its instances: {exc}") from None
        return result

    def dynamo_leases(
        self, node: str, endpoint: str = "http://127.0.0.1:2379", auth: EtcdAuth | None = None
    ) -> set[int]:
        """The leases that hold Dynamo's keys (v1/), read from inside the node at
        `endpoint` (its etcd member, or its relay as the stack's user under `auth`), as
        Dynamo reads them."""

        async def read() -> set[int]:
            async with EtcdClient(endpoint, auth=auth) as etcd:
                return {kv.lease for kv in await etcd.get_prefix("v1/") if kv.lease}

        leases: set[int] = self.in_node(node, lambda: asyncio.run(read()))
        return leases

    def instance_ids(self, node: str) -> set[int]:
        """The Dynamo instance ids of the node's shards, from the head's registry view."""
        view = self.status(self.names[0])["cluster"]
        entry = next(n for n in view["nodes"] if n["name"] == node)
        return {i for u in entry["units"] for i in u["instance_ids"]}

    def hold_down(self, node: str, unit: str, port: str) -> PortHold:
        """SIGKILL the unit's process and take its `port` on the node's address before
        dynamod's restart can: the unit cannot start again (its bind fails), and every
        connection to that port is reset. Take a port the unit binds before the one its
        clients use (etcd's peer port) and they are refused, as by a member that is gone;
        take the clients' port and they meet a half-open one. `release` heals."""
        entry = next(u for u in self.status(node)["units"] if u["name"] == unit)
        if entry["pid"] is None:
            raise ClusterError(f"{unit} on {node} runs no process")
        number = int(entry["ports"][port])
        address = self.address(node)
        os.kill(int(entry["pid"]), signal.SIGKILL)
        listener: socket.socket = self.in_node(node, lambda: _bind_when_free(address, number))
        return PortHold(listener, f"{address}:{number}")

    def logged(self, *events: str) -> list[dict[str, Any]]:
        """Every record of these events in the nodes' daemon logs (JSON lines), by
        timestamp; each log is read once, however many events are asked for."""
        quoted = [f'"{event}"' for event in events]
        found = [r for node in self.names for r in self.records(node, having=quoted)
                 if r.get("event") in events]  # fmt: skip
        return sorted(found, key=lambda r: str(r.get("timestamp")))

    def records(
        self, node: str, name: str = "daemon.log", having: Sequence[str] = ()
    ) -> list[dict[str, Any]]:
        """The JSON records of a log in the node's state dir (`logs/etcd.log` for a unit's),
        in the log's order, each with `logged_by`; with `having`, only lines holding one of
        those strings are parsed. [] while the log does not exist."""
        import json

        path = self.state_dir(node) / name
        rows = []
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if having and not any(h in line for h in having):
                continue
            with contextlib.suppress(ValueError, TypeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    rows.append({"logged_by": node, **record})
        return rows

    def digest(self, last: int = 30) -> str:
        """For a failure report: where the logs are kept, and each node's last `last`
        warnings, errors and cluster events (who leads, who is lost and why), one line
        each."""
        lines = [f"the nodes' logs: {self.work_dir}/<node>/daemon.log"]
        for node in self.names:
            rows = [
                r for r in self.records(node)
                if r.get("level") in ("warning", "error", "critical")
                or str(r.get("event", "")).startswith("cluster.")
            ]  # fmt: skip
            lines.append(f"--- {node}: the last {min(last, len(rows))} of {len(rows)}")
            for r in rows[-last:]:
                said = " ".join(
                    f"{k}={v}" for k, v in r.items()
                    if k not in ("event", "timestamp", "level", "logged_by", "logger")
                )  # fmt: skip
                lines.append(f"{str(r.get('timestamp', ''))[11:23]} {r.get('event')} {said}")
        return "\n".join(lines)

    def cut(self, node: str) -> None:
        assert self.sandbox is not None
        self.sandbox.cut(self.names.index(node))

    def heal(self, node: str) -> None:
        assert self.sandbox is not None
        self.sandbox.heal(self.names.index(node))

    def close(self) -> list[str]:
        """Stop every daemon still running (plain `down` on every node at once), then the
        sandbox. Returns what needed more than that, for the caller to report. One node
        after another, the last node's down found etcd's quorum gone with the other
        members, and its Dynamo worker waited on it 8.4 s to stop (cluster-ha.toml: 15.9 s
        for the three downs)."""
        if self.sandbox is not None:
            for index in range(len(self.names)):
                self.sandbox.heal(index)

        def down(node: str) -> str | None:
            if not (self.state_dir(node) / "dynamod.pid").exists():
                return None
            done = self.run(node, "down", timeout=120)
            if done.returncode not in (0,) and "no dynamod daemon" not in done.stderr:
                return f"down on {node}: exit {done.returncode}: {done.stderr[-500:]}"
            return None

        nodes = sorted(self.started)
        with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
            problems = [p for p in pool.map(down, nodes) if p is not None]
        if self.sandbox is not None:
            stragglers = self._stragglers(self.sandbox)
            if stragglers:
                problems.append(f"processes left in the sandbox: {stragglers}")
            self.sandbox.close()
        return problems

    @staticmethod
    def _stragglers(sandbox: Sandbox, grace: float = 5.0) -> dict[int, str]:
        """What still runs in the sandbox once every `down` returned, by pid with its
        command line, after `grace` seconds for processes already on their way out."""
        own = sandbox.started_groups()  # `run` started them in groups of their own

        def group(pid: int) -> int | None:
            try:
                return os.getpgid(pid)
            except OSError:
                return None

        deadline = time.monotonic() + grace
        while True:
            left = [p for p in sandbox.pids() if group(p) not in own]
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        found = {}
        for pid in left:
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # gone meanwhile
            found[pid] = raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        return found

    def __enter__(self) -> ClusterRig:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rewritten(source: Path, nodes: str, target: Path) -> list[str]:
    """`source` written to `target` with the sandbox's `nodes = {...}` line, the files it
    includes by `../` made absolute (they are relative to the stock stack's folder), and
    its base (`base = "FILE"`) rewritten the same way beside it; the texts written, the
    stack file's first."""
    text = _NODES_LINE.sub(nodes, source.read_text(), count=1)
    text = re.sub(r'"\.\./', f'"{source.parent.parent}/', text)
    bases: list[str] = []
    base = _BASE_LINE.search(text)
    if base:
        copy = target.with_name(f"base-{target.name}")
        bases = _rewritten(source.parent / base.group(1), nodes, copy)
        text = _BASE_LINE.sub(f'base = "{copy}"', text, count=1)
    target.write_text(text)
    return [text, *bases]


@contextlib.contextmanager
def running_cluster(
    n_nodes: int = 3,
    *,
    stack: Path | None = None,
    variables: dict[str, str] | None = None,
    timeout: float = 240,
) -> Iterator[ClusterRig]:
    """A started cluster for a test module or a benchmark: every node up, then, whatever
    happened, every daemon stopped and the sandbox removed; raises ClusterError naming what
    was left behind (a process, a namespace). The daemons' logs stay in `rig.work_dir` when
    something failed (raised through here, or said by `rig.keep`); a clean run leaves
    nothing in /tmp."""
    rig = ClusterRig(n_nodes, stack=stack, variables=variables)
    rig.open()
    assert rig.sandbox is not None
    names = [rig.sandbox.switch, *rig.sandbox.nodes]
    failed = False
    try:
        rig.up(timeout=timeout)
        yield rig
    except BaseException:
        failed = True
        raise
    finally:
        problems = rig.close()
        problems += [f"namespace {n} left" for n in names if Path("/run/netns", n).exists()]
        if problems:
            raise ClusterError(f"cluster in {rig.work_dir} not cleaned up: {problems}")
        if not failed and not rig.keep:
            shutil.rmtree(rig.work_dir, ignore_errors=True)


def _bind_when_free(address: str, port: int, timeout: float = 5.0) -> socket.socket:
    try:
        return listen_when_free(port, timeout, address=address, backlog=64)
    except OSError as exc:
        raise ClusterError(f"could not take {address}:{port}: {exc}") from None


class PortHold:
    """A taken port that resets every connection (SO_LINGER 0), until `release`."""

    def __init__(self, listener: socket.socket, where: str) -> None:
        import threading

        self.listener = listener
        self.where = where
        self.resets = 0
        self._thread = threading.Thread(target=self._reset_all, name="port-hold", daemon=True)
        self._thread.start()

    def _reset_all(self) -> None:
        linger = struct.pack("ii", 1, 0)
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # released
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            conn.close()
            self.resets += 1

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(timeout=5)


class NodeLoad(LoadGenerator):
    """The chaos load generator, its thread inside one node's network namespace."""

    def __init__(self, sandbox: Sandbox, node: int, *args: Any) -> None:
        super().__init__(*args)
        self.sandbox = sandbox
        self.node = node

    def start(self) -> None:
        import threading

        def run() -> None:
            self.sandbox.enter(self.node)
            asyncio.run(self._run())

        self._thread = threading.Thread(target=run, name="cluster-load", daemon=True)
        self._thread.start()
