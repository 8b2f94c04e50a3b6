"""The exposure checks: bind addresses beyond loopback in a rendered spec are named (and
must be, for each way of binding), loopback and authenticated members are not; /proc
listeners are found with their address, for this very process's sockets."""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

import pytest

from dynamod.cluster import exposure
from dynamod.core import spec


def stack(tmp_path: Path, units: str) -> spec.Stack:
    path = tmp_path / "stack.toml"
    path.write_text(units)
    counter = itertools.count(40000)
    return spec.load(path, state_dir=tmp_path / "s", allocate_port=lambda: next(counter))


def test_etcd_on_every_interface_without_client_certs_warns(tmp_path: Path) -> None:
    resolved = stack(tmp_path, """
[units.etcd]
command = ["etcd", "--listen-client-urls", "http://0.0.0.0:2379,http://127.0.0.1:2379",
           "--listen-peer-urls", "http://10.1.2.3:2380"]
""")  # fmt: skip
    assert exposure.spec_warnings(resolved) == [
        "etcd: --listen-client-urls binds 0.0.0.0 beyond loopback, without auth",
        "etcd: --listen-peer-urls binds 10.1.2.3 beyond loopback, without auth",
    ]


def test_etcd_with_client_cert_auth_warns_only_for_its_plain_peers(tmp_path: Path) -> None:
    resolved = stack(tmp_path, """
[units.etcd]
command = ["etcd", "--listen-client-urls=https://10.0.0.1:2379", "--client-cert-auth",
           "--listen-peer-urls", "http://10.0.0.1:2380"]
""")  # fmt: skip
    assert exposure.spec_warnings(resolved) == [
        "etcd: --listen-peer-urls binds 10.0.0.1 beyond loopback, without auth"
    ]


def test_nats_host_flag_and_dynamo_host_variables_warn(tmp_path: Path) -> None:
    resolved = stack(tmp_path, """
[units.nats]
command = ["nats-server", "-a", "0.0.0.0", "-p", "4222"]
[units.front]
command = ["python", "-m", "dynamo.frontend", "--http-host", "127.0.0.1"]
[units.front.env]
DYN_TCP_RPC_HOST = "127.0.0.1"
DYN_TCP_RESPONSE_STREAM_HOST = "127.0.0.1"
DYN_HTTP_RPC_HOST = "127.0.0.1"
DYN_EVENT_PLANE_HOST = "127.0.0.1"
DYN_SYSTEM_HOST = "0.0.0.0"
""")  # fmt: skip
    assert exposure.spec_warnings(resolved) == [
        "nats: -a binds 0.0.0.0 beyond loopback, without auth",
        "front: DYN_SYSTEM_HOST=0.0.0.0 puts the system port (/health, /engine/* admin routes) "
        "beyond loopback, without auth",
    ]


def test_a_dynamo_module_without_host_variables_warns_for_each_plane(tmp_path: Path) -> None:
    resolved = stack(tmp_path, '[units.w]\ncommand = ["python", "-m", "dynamo.mocker"]\n')
    warnings = exposure.spec_warnings(resolved)
    assert warnings[0] == f"w: {exposure.MOCKER_EVERYWHERE}"  # the mocker's own ZMQ sockets
    assert len(warnings) == 1 + len(exposure.DYNAMO_HOSTS)
    assert "w: DYN_TCP_RPC_HOST is not set: Dynamo binds its TCP request plane" in warnings[1]


@pytest.mark.parametrize(
    ("engine", "warns"),
    [(["--engine", "mocker"], True), (["--engine=mocker"], True),
     (["--engine", "numpy"], False), ([], False)],
)  # fmt: skip
def test_the_cpu_worker_warns_only_with_the_mocker_engine(
    tmp_path: Path, engine: list[str], warns: bool
) -> None:
    """The CPU worker puts Dynamo's planes on loopback itself, but not the mocker engine's
    ZMQ sockets: `--engine mocker` (the fleet's shards) binds five on every interface."""
    command = ["python", "-m", "dynamod.workers.cpu", "--model-path", "m", *engine]
    resolved = stack(tmp_path, f"[units.w]\ncommand = {command!r}\n".replace("'", '"'))
    expected = [f"w: {exposure.MOCKER_EVERYWHERE}"] if warns else []
    assert exposure.spec_warnings(resolved) == expected


def test_zmq_bind_on_every_interface_warns(tmp_path: Path) -> None:
    resolved = stack(tmp_path, """
[units.w]
command = ["python", "-c", "import os; os.execv('x', ['x', '-m', 'dynamod.workers.cpu'])",
           "--kv-events-config", '{"endpoint": "tcp://*:12000"}']
""")  # fmt: skip
    assert exposure.spec_warnings(resolved) == [
        "w: tcp://*:12000 binds a ZMQ socket on every interface, without auth"
    ]


def test_tls_request_plane_and_cluster_members_are_authenticated(tmp_path: Path) -> None:
    resolved = stack(tmp_path, """
[units.w]
command = ["python", "-m", "dynamod.workers.cpu"]
env = { DYN_TCP_RPC_HOST = "10.0.0.2", DYN_TCP_RESPONSE_STREAM_HOST = "10.0.0.2" }
[units.etcd]
command = ["python", "-m", "dynamod.cluster.etcd_member", "--listen", "10.0.0.2:2379"]
""")  # fmt: skip
    assert exposure.spec_warnings(resolved, tls_request_plane=True) == []
    assert len(exposure.spec_warnings(resolved, tls_request_plane=False)) == 2


def test_stock_default_stack_has_no_warning() -> None:
    root = Path(__file__).resolve().parents[2]
    counter = itertools.count(40000)
    resolved = spec.load(
        root / "units/stacks/local.toml", state_dir=Path("/tmp/x"),
        allocate_port=lambda: next(counter),
    )  # fmt: skip
    assert exposure.spec_warnings(resolved) == []


def test_listeners_found_in_proc_with_their_addresses() -> None:
    with (
        socket.socket() as everywhere,
        socket.socket() as local,
        socket.socket(socket.AF_INET6) as six,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
    ):
        everywhere.bind(("0.0.0.0", 0))
        everywhere.listen()
        local.bind(("127.0.0.1", 0))
        local.listen()
        six.bind(("::1", 0))
        six.listen()
        udp.bind(("0.0.0.0", 0))
        found = {(x.proto, x.address, x.port) for x in exposure.listeners([os.getpid()])}
        assert ("tcp", "0.0.0.0", everywhere.getsockname()[1]) in found
        assert ("tcp", "127.0.0.1", local.getsockname()[1]) in found
        assert ("tcp6", "::1", six.getsockname()[1]) in found
        assert ("udp", "0.0.0.0", udp.getsockname()[1]) in found
        warnings = exposure.process_warnings({"me": [os.getpid()]})
        port = everywhere.getsockname()[1]
        assert any(f"tcp 0.0.0.0:{port} is beyond loopback" in w for w in warnings)
        assert not any(f":{local.getsockname()[1]} " in w for w in warnings)
        assert exposure.process_warnings({"me": [os.getpid()]}, {"me": True}) == []


def test_one_scan_reads_a_namespace_s_socket_table_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's 32 shards share its network namespace: its socket table (every socket of
    the namespace) is read once per scan, not once per unit."""
    reads: list[int] = []
    real = exposure._socket_table

    def counted(pid: int) -> dict[str, tuple[str, str, int]]:
        reads.append(pid)
        return real(pid)

    monkeypatch.setattr(exposure, "_socket_table", counted)
    with socket.socket() as everywhere:
        everywhere.bind(("0.0.0.0", 0))
        everywhere.listen()
        port = everywhere.getsockname()[1]
        units = {f"worker@{i}": [os.getpid()] for i in range(5)}
        warnings = exposure.process_warnings(units)
    assert len(reads) == 1, f"read {len(reads)} times for 5 units in one namespace"
    assert sum(f"tcp 0.0.0.0:{port} is beyond loopback" in w for w in warnings) == 5


@pytest.mark.parametrize(
    ("old", "new", "looks_again"),
    [
        ("starting", "ready", True),  # its probe passed: its sockets are open now
        ("starting", "held", True),  # a shard past its probe, held to catch up
        ("held", "ready", False),  # a shard admitted again after an update: same sockets
        ("degraded", "ready", False),  # liveness recovered: the same process
        ("ready", "held", False),
        ("starting", "backoff", False),
    ],
)
async def test_the_daemon_looks_again_soon_only_at_a_unit_past_its_probe(
    old: str, new: str, looks_again: bool
) -> None:
    from dynamod.core.state import UnitState

    watch = exposure.ExposureWatch()
    watch._on_change(None, UnitState(old), UnitState(new))  # type: ignore[arg-type]
    assert watch._again.is_set() is looks_again


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_scan_reads_a_process_s_open_files_again_only_when_its_sockets_could_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shard holds hundreds of open files and the same listeners for its life: a scan
    with a memo reads them again only for a socket beyond loopback that no process read
    holds, for a pid that names another process, or after MEMO_S."""
    real = exposure._socket_table

    def mine(pid: int) -> dict[str, tuple[str, str, int]]:  # other processes' sockets
        held = exposure._socket_inodes(os.getpid())  # come and go: leave them out
        return {i: s for i, s in real(pid).items() if i in held}

    monkeypatch.setattr(exposure, "_socket_table", mine)
    clock = Clock()
    memo = exposure.SocketMemo(clock)
    me = {"me": [os.getpid()]}
    with socket.socket() as first:
        first.bind(("0.0.0.0", 0))
        first.listen()
        one = exposure.process_warnings(me, memo=memo)
        assert memo.reads == 1
        assert any(f"0.0.0.0:{first.getsockname()[1]} " in w for w in one), one
        assert exposure.process_warnings(me, memo=memo) == one  # from the memo
        assert memo.reads == 1
        with socket.socket() as second:  # a new socket nobody read holds: read again
            second.bind(("0.0.0.0", 0))
            second.listen()
            two = exposure.process_warnings(me, memo=memo)
            assert memo.reads == 2
            assert any(f"0.0.0.0:{second.getsockname()[1]} " in w for w in two)
        assert exposure.process_warnings(me, memo=memo) == one  # closed: gone from the
        assert memo.reads == 2  # namespace's table, nothing to look for
        clock.now = exposure.MEMO_S  # trusted for MEMO_S at most
        assert exposure.process_warnings(me, memo=memo) == one
        assert memo.reads == 3
        monkeypatch.setattr(exposure.proctable, "start_time", lambda pid: -1)  # a reused pid
        assert exposure.process_warnings(me, memo=memo) == one
        assert memo.reads == 4


class Namespace:
    """One network namespace's processes and sockets, for SocketMemo alone."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pids: int) -> None:
        self.held = {pid: {f"{pid}-a", f"{pid}-b"} for pid in range(1, pids + 1)}
        self.read: list[int] = []
        monkeypatch.setattr(exposure, "_socket_inodes", self._inodes)
        monkeypatch.setattr(exposure.proctable, "start_time", lambda pid: 7)

    def _inodes(self, pid: int) -> set[str]:
        self.read.append(pid)
        return {*self.held[pid], f"{pid}-connection"}  # not in the table: a connection

    def wide(self, *others: str) -> set[str]:
        return {i for held in self.held.values() for i in held} | set(others)


def test_a_shard_that_binds_anew_is_the_one_process_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shard's engine that binds new sockets on a weight update closes its old ones: it
    is read first, and the scan stops once every socket has its holder (the fleet's push:
    every shard of a node binding anew in turn)."""
    ns = Namespace(monkeypatch, 32)
    memo = exposure.SocketMemo()
    pids = list(ns.held)
    assert memo.held("ns", pids, ns.wide()) == {p: frozenset(ns.held[p]) for p in pids}
    assert sorted(ns.read) == pids
    ns.read.clear()
    ns.held[20] = {"20-c", "20-d"}  # worker 20 bound anew
    found = memo.held("ns", pids, ns.wide())
    assert ns.read == [20] and found[20] == {"20-c", "20-d"}
    ns.read.clear()
    ns.held[9].add("9-extra")  # a socket added, none closed: read until found
    found = memo.held("ns", pids, ns.wide())
    assert ns.read[-1] == 9 and found[9] == {"9-a", "9-b", "9-extra"}
    assert len(ns.read) == 9  # in pid order, 1 to 9: no further


def test_a_socket_no_process_of_the_stack_holds_is_not_looked_for_at_every_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The head's etcd and NATS members are left out of the scan (they enforce auth), but
    their sockets are in the namespace's table: after every process was read once without
    finding them, they are another's, not a reason to read everything at every scan."""
    ns = Namespace(monkeypatch, 4)
    memo = exposure.SocketMemo()
    pids = list(ns.held)
    wide = ns.wide("etcd-client", "etcd-peer")
    memo.held("ns", pids, wide)
    assert sorted(ns.read) == pids
    ns.read.clear()
    assert memo.held("ns", pids, wide) == {p: frozenset(ns.held[p]) for p in pids}
    assert ns.read == []
    memo.held("ns", pids, wide | {"nats"})  # a new one nobody holds: everyone once more
    assert sorted(ns.read) == pids
    ns.read.clear()
    memo.held("ns", pids, wide | {"nats"})
    assert ns.read == []


def test_nothing_beyond_loopback_in_a_namespace_reads_no_open_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The single-node stacks bind loopback only: a scan there reads each namespace's
    socket table and no process's open files."""
    real = exposure._socket_table

    def loopback_only(pid: int) -> dict[str, tuple[str, str, int]]:
        return {i: s for i, s in real(pid).items() if exposure.is_loopback(s[1])}

    monkeypatch.setattr(exposure, "_socket_table", loopback_only)
    memo = exposure.SocketMemo()
    with socket.socket() as local:
        local.bind(("127.0.0.1", 0))
        local.listen()
        assert exposure.process_warnings({"me": [os.getpid()]}, memo=memo) == []
    assert memo.reads == 0
