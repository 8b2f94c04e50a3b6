"""Simulated nodes for tests and benchmarks: a `Sandbox` of network namespaces, one per
node, each joined by a veth pair to a bridge in a switch namespace of its own, with
addresses `10.X.0.I/24` (X derived from the pid and a counter, so parallel runs never
clash), loopback up everywhere; processes run inside a node with `nsenter --net` (not `ip
netns exec`, which remounts /sys and so hides the cgroup tree dynamod contains units in), a node's
link is cut and healed by setting its switch-side veth down and up, and `close` kills what
runs inside the sandbox and deletes every namespace (idempotent, also after a failed
setup). The host's root namespace is never touched: every link is created inside the
sandbox's own namespaces."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from dynamod.core.errors import DynamodError

log = structlog.get_logger("dynamod.chaos.netns")

_counter = itertools.count()
_NETNS_DIR = Path("/run/netns")
_MAX_NODES = 250
_CLONE_NEWNET = 0x40000000


class SandboxError(DynamodError):
    """A namespace, link or address of the sandbox could not be set up or removed."""


def _ip(*args: str) -> None:
    """Run one `ip` command; a failure raises with the command and ip's own message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise SandboxError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")


def can_create_namespaces() -> str | None:
    """None when this process can make network namespaces, else the reason it cannot."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool, package in (("ip", "iproute2"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"the `{tool}` command ({package}) is not installed"
    probe = f"dmprobe{os.getpid()}x{next(_counter)}"
    try:
        _ip("netns", "add", probe)
    except (SandboxError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _ip("netns", "del", probe)
    except SandboxError as exc:
        return f"created a network namespace but could not delete it: {exc}"
    return None


class Sandbox:
    """`n_nodes` namespaces on one bridge. Node i (0-based) is `self.nodes[i]` with address
    `self.addresses[i]` (10.X.0.(i+1)); methods take a node's index or its namespace name."""

    def __init__(self, n_nodes: int, prefix: str = "dm") -> None:
        if not 1 <= n_nodes <= _MAX_NODES:
            raise SandboxError(f"a sandbox holds 1 to {_MAX_NODES} nodes, asked for {n_nodes}")
        serial = next(_counter)
        tag = f"{prefix}{os.getpid()}x{serial}"
        self.subnet_octet = 16 + (os.getpid() * 7 + serial) % 224
        self.switch = f"{tag}-sw"
        self.nodes = [f"{tag}-n{i}" for i in range(n_nodes)]
        self.addresses = [f"10.{self.subnet_octet}.0.{i + 1}" for i in range(n_nodes)]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closed = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        log.info("netns.sandbox_up", switch=self.switch, nodes=self.nodes, addresses=self.addresses)

    def _build(self) -> None:
        for name in [self.switch, *self.nodes]:
            _ip("netns", "add", name)
            self._created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes):
            port = self._switch_port(i)
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                node,
            )
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", node, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", node, "link", "set", "eth0", "up")

    @staticmethod
    def _switch_port(index: int) -> str:
        return f"p{index}"

    def index(self, node: int | str) -> int:
        if isinstance(node, int):
            if not 0 <= node < len(self.nodes):
                raise SandboxError(f"no node {node} in a sandbox of {len(self.nodes)}")
            return node
        if node not in self.nodes:
            raise SandboxError(f"no node {node!r} in this sandbox (nodes: {', '.join(self.nodes)})")
        return self.nodes.index(node)

    def netns(self, node: int | str) -> str:
        return self.nodes[self.index(node)]

    def address(self, node: int | str) -> str:
        return self.addresses[self.index(node)]

    def command(self, node: int | str, argv: Sequence[str]) -> list[str]:
        """The argv that runs `argv` inside the node's namespace."""
        return ["nsenter", f"--net={_NETNS_DIR / self.netns(node)}", "--", *argv]

    def run(
        self,
        node: int | str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **popen: object,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside the node, in a process group of its own; `close` ends it."""
        if self._closed:
            raise SandboxError("the sandbox is closed")
        proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            self.command(node, argv),
            env=dict(env) if env is not None else None,
            start_new_session=True,
            **popen,
        )
        self._procs.append(proc)
        return proc

    def started_groups(self) -> set[int]:
        """The process groups of what `run` started that still runs (`close` ends them)."""
        return {proc.pid for proc in self._procs if proc.poll() is None}

    def enter(self, node: int | str) -> None:
        """Move the calling thread (never the main thread) into the node's network
        namespace: sockets it opens from then on are the node's. A network namespace is
        per thread on Linux, so a load thread can be a client inside a node."""
        if threading.current_thread() is threading.main_thread():
            raise SandboxError("enter() moves one thread; call it from a worker thread")
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(_NETNS_DIR / self.netns(node), os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise SandboxError(f"setns into {self.netns(node)} failed: {os.strerror(err)}")
        finally:
            os.close(fd)

    def cut(self, node: int | str) -> None:
        """Pull the node's cable: its switch port goes down, packets to and from it are lost."""
        _ip("-n", self.switch, "link", "set", self._switch_port(self.index(node)), "down")
        log.info("netns.cut", node=self.netns(node))

    def heal(self, node: int | str) -> None:
        _ip("-n", self.switch, "link", "set", self._switch_port(self.index(node)), "up")
        log.info("netns.heal", node=self.netns(node))

    def pids(self) -> list[int]:
        """Every process that lives in one of the sandbox's namespaces now."""
        found: list[int] = []
        for name in self._created:
            done = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10
            )
            found.extend(int(p) for p in done.stdout.split() if p.isdigit())
        return found

    def close(self, grace: float = 5.0) -> None:
        """End what runs inside (the processes `run` started first, by their groups, then any
        other process still in the sandbox's namespaces), then delete every namespace."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)
        # Processes that left their group (daemons that detached) still live in our namespaces.
        for _ in range(20):
            stragglers = self.pids()
            if not stragglers:
                break
            for pid in stragglers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        errors: list[str] = []
        for name in reversed(self._created):
            try:
                _ip("netns", "del", name)
            except SandboxError as exc:
                if (_NETNS_DIR / name).exists():
                    errors.append(str(exc))
        self._created.clear()
        log.info("netns.sandbox_closed", switch=self.switch)
        if errors:
            raise SandboxError("; ".join(errors))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
