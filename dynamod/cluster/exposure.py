"""Which of a stack's ports could be reached from beyond loopback without auth. For
`dynamod check`, from the rendered spec: the bind addresses on each unit's command line
(`--listen-*-urls`, `--host`, `-a`, ...) and in its `*_HOST` variables, and Dynamo modules
that bind every interface unless told otherwise. For `dynamod status`, from /proc: every
socket a unit's processes listen on (TCP) or hold bound (UDP), with its address. A listener
beyond loopback counts as authenticated only where the unit enforces it by construction:
the cluster's etcd and NATS members (they refuse to start without the secrets directory),
an etcd with `--client-cert-auth`, Dynamo's TCP request plane when the stack hands it
mutual TLS (a secrets directory)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from dynamod.core import cgroups, proctable
from dynamod.core.argv import flag_value
from dynamod.core.extensions import Extension
from dynamod.core.spec import Stack, UnitSpec
from dynamod.core.state import UnitState

if TYPE_CHECKING:
    from dynamod.core.engine import Unit
    from dynamod.core.extensions import ExtensionHost

BIND_FLAGS = frozenset({
    "-a", "--addr", "--host", "--bind", "--http-host", "--node-ip-address", "--dashboard-host",
    "--listen", "--listen-client-urls", "--listen-peer-urls", "--listen-metrics-urls",
})  # fmt: skip
# The modules that enforce auth themselves (they exit 2 without a secrets directory).
AUTHENTICATED_MODULES = frozenset({"dynamod.cluster.etcd_member", "dynamod.cluster.nats_member"})
# What Dynamo 1.6.1's runtime binds to every interface unless its variable names a host.
DYNAMO_HOSTS = {
    "DYN_TCP_RPC_HOST": "TCP request plane",
    "DYN_TCP_RESPONSE_STREAM_HOST": "TCP response stream",
    "DYN_HTTP_RPC_HOST": "HTTP request plane",
    "DYN_EVENT_PLANE_HOST": "ZMQ event plane (KV events)",
    "DYN_SYSTEM_HOST": "system port (/health, /engine/* admin routes)",
}
TLS_PLANES = {"DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST"}  # DYN_TCP_TLS_* applies
# Modules that default every DYNAMO_HOSTS variable to 127.0.0.1 themselves.
LOOPBACK_DEFAULT_MODULES = frozenset({"dynamod.workers.cpu"})
# Dynamo's mocker engine (ai-dynamo 1.6.1) binds its ZMQ sockets on every interface
# whatever the DYNAMO_HOSTS variables say: its KV event publisher and four more, each
# engine (our CPU worker's `--engine mocker` starts a new one at every cache flush).
MOCKER_EVERYWHERE = (
    "Dynamo's mocker engine binds its ZMQ sockets (its KV event publisher and 4 more) on "
    "every interface whatever DYN_*_HOST say, without auth"
)


def _runs_the_mocker(module: str | None, command: Sequence[str]) -> bool:
    if module == "dynamo.mocker":
        return True
    return module == "dynamod.workers.cpu" and flag_value(command, "--engine") == "mocker"


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, "", or "*": it may resolve to anything


def _hosts_in(value: str) -> list[str]:
    hosts: list[str] = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        if "://" in part:
            hosts.append(urlsplit(part).hostname or "")
        elif part.count(":") == 1:
            hosts.append(part.split(":", 1)[0])
        else:
            hosts.append(part)
    return hosts


_EXEC_MODULE = re.compile(r"""['"]-m['"],\s*['"]([\w.]+)['"]""")
_ZMQ_EVERYWHERE = re.compile(r"tcp://(\*|0\.0\.0\.0|\[::\]):\d+")


def _module(command: Sequence[str]) -> str | None:
    """The Python module a command runs: `-m NAME`, or a `-c` wrapper that execs `-m NAME`."""
    for i, word in enumerate(command[:-1]):
        if word == "-m":
            return command[i + 1]
        if word == "-c":
            match = _EXEC_MODULE.search(command[i + 1])
            return match.group(1) if match else None
    return None


def _binds(command: Sequence[str]) -> list[tuple[str, str]]:
    """(flag, host) for every bind address on a command line."""
    found: list[tuple[str, str]] = []
    for i, word in enumerate(command):
        flag, sep, inline = word.partition("=")
        if flag not in BIND_FLAGS:
            continue
        value = inline if sep else (command[i + 1] if i + 1 < len(command) else "")
        found += [(flag, host) for host in _hosts_in(value)]
    return found


def spec_warnings(stack: Stack, *, tls_request_plane: bool = False) -> list[str]:
    """One line per port of the rendered stack bound beyond loopback without auth."""
    warnings: list[str] = []
    for name, unit in stack.units.items():
        warnings += [f"{name}: {w}" for w in _unit_warnings(unit, tls_request_plane)]
    return warnings


def _unit_warnings(unit: UnitSpec, tls_request_plane: bool) -> list[str]:
    module = _module(unit.command)
    if module in AUTHENTICATED_MODULES:
        return []
    exe = Path(unit.command[0]).name
    cert_auth = exe == "etcd" and "--client-cert-auth" in unit.command
    out: list[str] = []
    for flag, host in _binds(unit.command):
        if cert_auth and flag == "--listen-client-urls":
            continue
        if not is_loopback(host):
            out.append(f"{flag} binds {host or 'every interface'!s} beyond loopback, without auth")
    for word in unit.command:
        for match in _ZMQ_EVERYWHERE.finditer(word):
            out.append(f"{match.group(0)} binds a ZMQ socket on every interface, without auth")
    for var, value in unit.env.items():
        if var.endswith("_HOST") and not is_loopback(value):
            if tls_request_plane and var in TLS_PLANES:
                continue
            what = DYNAMO_HOSTS.get(var, var)
            out.append(f"{var}={value} puts the {what} beyond loopback, without auth")
    if _runs_the_mocker(module, unit.command):
        out.append(MOCKER_EVERYWHERE)
    if module and module.split(".")[0] == "dynamo" and module not in LOOPBACK_DEFAULT_MODULES:
        for var, what in DYNAMO_HOSTS.items():
            if var not in unit.env:
                out.append(f"{var} is not set: Dynamo binds its {what} on every interface")
    return out


@dataclass(frozen=True)
class Listener:
    """A socket a process listens on (TCP) or holds bound (UDP)."""

    pid: int
    process: str
    proto: str  # tcp, tcp6, udp, udp6
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        return is_loopback(self.address)

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"pid {self.pid} ({self.process}) {self.proto} {host}:{self.port}"


def _address(hex_addr: str, proto: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if proto.endswith("6"):
        # /proc prints the 16 bytes as four host-order 32-bit words
        words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
        return str(ipaddress.IPv6Address(b"".join(words)))
    return str(ipaddress.IPv4Address(raw[::-1]))


def _socket_table(pid: int) -> dict[str, tuple[str, str, int]]:
    """inode -> (proto, address, port) of the listening/bound sockets in pid's namespace."""
    table: dict[str, tuple[str, str, int]] = {}
    for proto, wanted in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        with contextlib.suppress(OSError):
            lines = Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]
            for line in lines:
                # a node of 32 shards has thousands of connections here and a few dozen
                # listeners: look at the state before splitting the rest of the line
                head = line.split(None, 4)
                if len(head) < 5 or head[3] != wanted:
                    continue
                fields = line.split()
                if len(fields) < 10:
                    continue
                hex_addr, hex_port = fields[1].split(":")
                if int(hex_port, 16) == 0:
                    continue
                table[fields[9]] = (proto, _address(hex_addr, proto), int(hex_port, 16))
    return table


def _socket_inodes(pid: int) -> set[str]:
    """The inodes of every socket pid holds open (a readlink per open file)."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def _process_name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in argv if w]
    if len(words) >= 3 and words[1] == "-m":
        return f"{Path(words[0]).name} -m {words[2]}"
    return Path(words[0]).name if words else "?"


SocketTable = dict[str, tuple[str, str, int]]  # inode -> (proto, address, port): _socket_table
SocketTables = dict[str, SocketTable]  # netns -> its table


def _namespace(
    pid: int, tables: SocketTables, beyond_loopback: bool = False
) -> tuple[str, SocketTable] | None:
    """pid's network namespace and its socket table (only the sockets beyond loopback, if
    asked), read once per namespace into `tables`; None if pid is gone."""
    try:
        netns = os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None
    table = tables.get(netns)
    if table is None:
        table = _socket_table(pid)
        if beyond_loopback:
            table = {inode: sock for inode, sock in table.items() if not is_loopback(sock[1])}
        tables[netns] = table
    return netns, table


def listeners(pids: Iterable[int], tables: SocketTables | None = None) -> list[Listener]:
    """Every listening (TCP) or bound (UDP) socket held by `pids`. `tables`: the socket
    tables already read, by network namespace (one scan of many units reads each once)."""
    found: list[Listener] = []
    tables = {} if tables is None else tables
    for pid in sorted(set(pids)):
        inodes = _socket_inodes(pid)
        space = _namespace(pid, tables) if inodes else None
        if space is None:
            continue
        table, name = space[1], _process_name(pid)
        for inode in sorted(inodes & table.keys()):
            proto, address, port = table[inode]
            found.append(Listener(pid, name, proto, address, port))
    return found


MEMO_S = 60.0  # how long a process's sockets read once are trusted before a fresh read


class SocketMemo:
    """Which sockets beyond loopback each process held when its open files were last read.
    Reading a process's open files (a readlink each) is what a scan costs: a shard's
    process holds hundreds (its connections). A scan reads again the processes it has not
    read (or whose pid now names another process) and then, while its namespace has a
    socket beyond loopback that no process read holds, others until every such socket
    has its holder: first the ones that lost a socket since (a shard whose engine binds
    anew on a weight update closes its old sockets and opens new ones), then the rest.
    What no process of the stack holds after every one was read is another's (a member
    left out as authenticated) and is not looked for again. Everything is read afresh at
    least every MEMO_S (a socket handed from one process to another)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._read: dict[int, tuple[int | None, frozenset[str]]] = {}  # pid -> start, held
        self._foreign: dict[str, frozenset[str]] = {}  # netns -> sockets no process held
        self._since = clock()
        self.reads = 0  # processes whose open files were read: what a test counts

    def _walk(self, pid: int, started: int | None, wide: AbstractSet[str]) -> frozenset[str]:
        self.reads += 1
        held = frozenset(_socket_inodes(pid) & wide)
        self._read[pid] = (started, held)
        return held

    def held(
        self, netns: str, pids: Sequence[int], wide: AbstractSet[str]
    ) -> dict[int, frozenset[str]]:
        """For each of `pids` (all in `netns`), the sockets of `wide` (the namespace's
        beyond loopback) that it holds."""
        if self._clock() - self._since >= MEMO_S:
            self._read.clear()
            self._foreign.clear()
            self._since = self._clock()
        found: dict[int, frozenset[str]] = {}
        lost_one: list[tuple[int, int | None]] = []
        others: list[tuple[int, int | None]] = []
        for pid in pids:
            started = proctable.start_time(pid)
            known = self._read.get(pid)
            if known is None or known[0] != started:
                found[pid] = self._walk(pid, started, wide)
                continue
            found[pid] = known[1] & wide
            (lost_one if known[1] - wide else others).append((pid, started))
        unheld = set(wide) - self._foreign.get(netns, frozenset())
        for held in found.values():
            unheld -= held
        for pid, started in (*lost_one, *others):
            if not unheld:
                break
            found[pid] = self._walk(pid, started, wide)
            unheld -= found[pid]
        else:  # every process read: what none holds is another's
            self._foreign[netns] = frozenset(wide).difference(*found.values())
        return found

    def keep_only(self, pids: AbstractSet[int]) -> None:
        """Forget the processes a scan no longer found."""
        for pid in self._read.keys() - pids:
            del self._read[pid]


def process_warnings(
    units: Mapping[str, Iterable[int]],
    authenticated: Mapping[str, bool] | None = None,
    memo: SocketMemo | None = None,
) -> list[str]:
    """One line per socket of a unit's processes beyond loopback, unless that unit enforces
    auth (`authenticated[unit]`). Each network namespace's socket table is read once for
    all units: it lists every socket of the namespace (a node of 32 shards: thousands of
    connections), and a read per unit made this scan the daemon's largest CPU cost during
    a push to 64 shards (the fleet benchmark, profiled). A process's open files are read
    only where its namespace has a socket beyond loopback at all (none, on a stack that
    binds loopback only), and with a `memo`, only as SocketMemo says."""
    tables: SocketTables = {}  # netns -> its sockets beyond loopback
    spaces: dict[str, dict[int, None]] = {}  # netns -> the pids in it to read
    looked: list[tuple[str, int, str]] = []  # unit, pid, netns
    for unit, pids in units.items():
        if authenticated and authenticated.get(unit):
            continue
        for pid in sorted(set(pids)):
            space = _namespace(pid, tables, beyond_loopback=True)
            if space is not None and space[1]:
                spaces.setdefault(space[0], {})[pid] = None
                looked.append((unit, pid, space[0]))
    memo = SocketMemo() if memo is None else memo
    held: dict[int, frozenset[str]] = {}
    for netns, in_it in spaces.items():
        held.update(memo.held(netns, list(in_it), tables[netns].keys()))
    memo.keep_only(held.keys())
    warnings: list[str] = []
    for unit, pid, netns in looked:
        if held.get(pid):
            name = _process_name(pid)
            for inode in sorted(held[pid]):
                listener = Listener(pid, name, *tables[netns][inode])
                warnings.append(f"{unit}: {listener} is beyond loopback, without auth")
    return warnings


def unit_enforces_auth(unit: UnitSpec) -> bool:
    """What `process_warnings` may skip: the cluster's etcd and NATS members."""
    return _module(unit.command) in AUTHENTICATED_MODULES


def group_pids(pgid: int) -> list[int]:
    """Pids whose process group is `pgid`: a full /proc pass, for tools and tests that look
    at a stack from outside (the daemon itself uses `tree_pids` or the unit's cgroup)."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
                found.append(int(entry.name))
    return found


def tree_pids(pid: int) -> list[int]:
    """A unit's main process and everything below it (a unit's tree without a cgroup),
    from the kernel's child lists: the cost is the tree's size, not the host's."""
    return [pid, *proctable.descendants(pid)]


def _scan(
    running: Mapping[str, tuple[int, Any]], enforced: Mapping[str, bool], memo: SocketMemo
) -> list[str]:
    units: dict[str, list[int]] = {}
    for name, (pid, cgroup) in running.items():
        pids = cgroups.procs(cgroup) if cgroup is not None else tree_pids(pid)
        units[name] = pids or [pid]
    return process_warnings(units, enforced, memo)


REFRESH_S = 5.0  # how often the daemon looks at its units' sockets again
# A unit whose readiness probe just passed is looked at again soon, but not sooner than this
# after the last look: a node's shards start within seconds of each other.
MIN_GAP_S = 1.0


class ExposureWatch(Extension):
    """`status` gains `exposure`: a line per socket of the stack's processes that is beyond
    loopback without auth (empty when everything listens on loopback). The sockets are read
    every REFRESH_S in a worker thread, never on the event loop at `status` time (reading
    /proc per process costs milliseconds a unit, and `status` is polled)."""

    def __init__(self) -> None:
        self.host: ExtensionHost | None = None
        self._warnings: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._again = asyncio.Event()
        self._memo = SocketMemo()  # used by one scan at a time, in its worker thread

    async def start(self, host: ExtensionHost) -> None:
        self.host = host
        assert host.engine is not None
        host.engine.listeners.append(self._on_change)
        self._task = asyncio.get_running_loop().create_task(self._refresh(), name="exposure")

    def _on_change(self, unit: Unit, old: UnitState, new: UnitState) -> None:
        """A unit past its readiness probe (ready, or held: a shard catching up) has its
        sockets open now: look again soon. A shard admitted again after an update (held ->
        ready) or a unit whose liveness recovered is the same process with the same
        sockets: the next regular look is enough. Looking again at every admission made
        this scan 40-50 % of a node's daemon CPU during a push at 8 x 32 (py-spy)."""
        if old is UnitState.STARTING and new in {UnitState.READY, UnitState.HELD}:
            self._again.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _snapshot(self) -> tuple[dict[str, tuple[int, Any]], dict[str, bool]]:
        engine = self.host.engine if self.host is not None else None
        if engine is None:
            return {}, {}
        running = {
            name: (unit.pid, engine.host.cgroup(name))
            for name, unit in engine.units.items()
            if unit.pid is not None
        }
        enforced = {n: unit_enforces_auth(u.spec) for n, u in engine.units.items()}
        return running, enforced

    async def _refresh(self) -> None:
        while True:
            self._again.clear()  # a unit ready from here on is seen by the next look
            running, enforced = self._snapshot()
            with contextlib.suppress(OSError):
                self._warnings = await asyncio.to_thread(_scan, running, enforced, self._memo)
            await asyncio.sleep(MIN_GAP_S)
            with contextlib.suppress(TimeoutError):  # not wait_for: 3.11's can lose a cancel
                async with asyncio.timeout(REFRESH_S - MIN_GAP_S):
                    await self._again.wait()

    def status(self) -> dict[str, Any]:
        return {"exposure": list(self._warnings)}
