"""Loopback port allocation (machine-wide, so stacks side by side never share a port),
in-use checks, and who owns a listening socket.

Every allocation goes through the machine's port registry (`DYNAMOD_PORT_REGISTRY`,
default /tmp/dynamod-ports): under one exclusive lock, a process's claimed ports are
appended to its own claim file, which it keeps locked for its whole life (the daemon, and
a forked daemon shares the CLI's lock). A claim whose file is no longer locked belongs to
a process that is gone and is dropped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

_CLAIMS: list[int] = []  # open claim-file descriptors: held (and locked) until exit


class PortAllocator:
    """Hands out free loopback ports, never the same one twice in one stack.

    Ports come from below the kernel's ephemeral range (which starts at 32768 here):
    Dynamo refuses a DYN_SYSTEM_PORT above 32767, and a port from the ephemeral range can
    be taken by any outgoing connection between allocation and the unit's bind.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        low: int = 20000,
        high: int = 32767,
        rng: random.Random | None = None,
        registry: Path | None = None,
        claim: bool = True,
    ) -> None:
        self.host = host
        self.low, self.high = low, high
        self.rng = rng or random.Random()
        self.given: set[int] = set()
        self.registry = registry  # None: the machine's (registry_dir())
        # False: a command that only renders (check, export) avoids the claimed ports but
        # claims none, and writes nothing to the registry.
        self.claim = claim
        self._claim_fd: int | None = None

    def __call__(self) -> int:
        root = self.registry or registry_dir()
        if not self.claim:
            return self._pick(_live_claims(root))
        with _registry_lock(root):
            port = self._pick(_claimed_ports(root, own=self._claim_fd))
            self._claim(root, port)
            return port

    def _pick(self, taken: set[int]) -> int:
        for _ in range(500):
            port = self.rng.randint(self.low, self.high)
            if port in self.given or port in taken or not bindable(port, self.host):
                continue
            self.given.add(port)
            return port
        raise OSError(f"no free loopback port in {self.low}-{self.high} after 500 tries")

    def _claim(self, root: Path, port: int) -> None:
        if self._claim_fd is None:
            # A name of its own: id(self) can repeat within one process once an allocator
            # is collected, and flock on a file this process already holds would block
            # forever (with the registry lock held).
            path = root / f"claim-{os.getpid()}-{uuid.uuid4().hex}"
            fd = os.open(
                path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644
            )
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._claim_fd = fd
            _CLAIMS.append(fd)
        os.write(self._claim_fd, f"{port}\n".encode())


def registry_dir() -> Path:
    return Path(os.environ.get("DYNAMOD_PORT_REGISTRY", "/tmp/dynamod-ports"))


@contextlib.contextmanager
def _registry_lock(root: Path) -> Iterator[Path]:
    root.mkdir(parents=True, exist_ok=True, mode=0o1777)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield root
    finally:
        os.close(fd)


def _claimed_ports(root: Path, own: int | None) -> set[int]:
    """Ports in every live claim (its file still locked by its owner); stale claims go."""
    own_inode = os.fstat(own).st_ino if own is not None else None
    taken: set[int] = set()
    for path in root.glob("claim-*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_ino != own_inode:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass  # held: a live process's claim
                else:
                    path.unlink(missing_ok=True)  # its owner is gone
                    continue
            with os.fdopen(os.dup(fd)) as fh:
                taken |= {int(line) for line in fh.read().split() if line.isdigit()}
        finally:
            os.close(fd)
    return taken


def _live_claims(root: Path) -> set[int]:
    """Ports in every live claim, read without the registry's lock and changing nothing."""
    taken: set[int] = set()
    for path in root.glob("claim-*"):
        try:
            with path.open("rb") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # held: a live process's claim
                    taken |= {int(word) for word in fh.read().split() if word.isdigit()}
        except OSError:
            continue
    return taken


def in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if something listens on host:port (binding it fails the way a server's would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """True if a server that does not set SO_REUSEADDR could bind host:port now.

    Stricter than `not in_use(port)`: a port whose earlier connections linger in TIME_WAIT
    (up to 60 s after a server closed them) is refused to such a server. The allocator
    hands out only these, so a unit need not set SO_REUSEADDR: CI once gave a port still
    in TIME_WAIT to a listener that did not, and it failed five starts in a row.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listening(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    """True if a TCP connect to host:port succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def listener_pids(
    port: int, host: str = "127.0.0.1", among: Iterable[int] | None = None
) -> set[int]:
    """Pids holding a TCP socket listening on host:port (or on any address), from
    /proc/net/tcp and each process's fds (of `among` only, when given: a unit's own
    processes); empty if none can be seen. Every process's fds is the costly way: at 4
    nodes x 32 shards on one machine it was half the daemons' own time during the start
    (py-spy), as each shard turning ready had the whole /proc's fds read."""
    wanted = {f"{_hex_addr(host)}:{port:04X}", f"00000000:{port:04X}"}
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] in wanted and fields[3] == "0A":  # 0A = LISTEN
                inodes.add(fields[9])
    if not inodes:
        return set()
    owners: set[int] = set()
    if among is None:
        pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    else:
        pids = sorted(among)
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    owners.add(pid)
                    break
    return owners


def _hex_addr(host: str) -> str:
    return socket.inet_aton(host)[::-1].hex().upper()
