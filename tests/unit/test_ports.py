"""The machine-wide port registry: allocators in different processes never hand out the
same port while its claimer lives; a dead claimer's ports come back."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

from dynamod.core.ports import PortAllocator, _claimed_ports

# 20 ports: random picks would collide without the registry. Above the kernel's ephemeral
# range and outside dynamod's default 20000-32767, so the stacks other tests run beside this
# one never hold one of them (each test needs all 20 free).
LOW, HIGH = 61100, 61119


def test_two_allocators_never_share_a_port(tmp_path: Path) -> None:
    a = PortAllocator(low=LOW, high=HIGH, rng=random.Random(1), registry=tmp_path)
    b = PortAllocator(low=LOW, high=HIGH, rng=random.Random(1), registry=tmp_path)
    first = {a() for _ in range(10)}
    second = {b() for _ in range(10)}
    assert len(first) == len(second) == 10
    assert not first & second


def test_another_process_claim_holds_until_it_exits(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import random, sys
        from pathlib import Path
        from dynamod.core.ports import PortAllocator
        a = PortAllocator(low={LOW}, high={HIGH}, rng=random.Random(2),
                          registry=Path({str(tmp_path)!r}))
        print(" ".join(str(a()) for _ in range(15)), flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        theirs = {int(p) for p in child.stdout.readline().split()}
        assert len(theirs) == 15
        mine = PortAllocator(low=LOW, high=HIGH, rng=random.Random(3), registry=tmp_path)
        got = {mine() for _ in range(5)}
        assert not got & theirs and len(got) == 5
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)
    # its owner is gone: the claim is stale and dropped, its ports are free again
    assert _claimed_ports(tmp_path, own=None) == got
    assert not list(tmp_path.glob(f"claim-{child.pid}-*"))


def test_listener_pids_reads_the_fds_of_the_given_processes_or_of_all() -> None:
    """A unit's own processes are asked first (a shard turning ready had every process's
    fds read, half the daemons' time at 4 nodes x 32 shards); all of them only to name
    another owner."""
    import os
    import socket

    from dynamod.core.ports import listener_pids

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert os.getpid() in listener_pids(port)
        assert listener_pids(port, among={os.getpid()}) == {os.getpid()}
        assert listener_pids(port, among={os.getppid()}) == set()  # it holds no such socket
        assert listener_pids(port, among=set()) == set()
    assert listener_pids(port, among={os.getpid()}) == set()  # closed: nobody listens


def test_a_port_left_in_time_wait_is_not_handed_out(tmp_path: Path) -> None:
    """A server that closes its side first leaves the port in TIME_WAIT: a listener without
    SO_REUSEADDR cannot bind it for up to 60 s, so the allocator must not give it out
    (CI saw such a unit fail five starts in a row on `Address already in use`)."""
    import socket

    from dynamod.core.ports import bindable, in_use

    port = HIGH + 11  # not one of the 20 the tests above need free
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: it is the one in TIME_WAIT
        client.recv(1)
        client.close()
    assert not in_use(port)  # nothing listens, and SO_REUSEADDR binds through TIME_WAIT
    assert not bindable(port)  # a plain bind does not
    one = PortAllocator(low=port, high=port, registry=tmp_path)
    try:
        got = one()
    except OSError as err:
        assert "no free loopback port" in str(err)
    else:
        raise AssertionError(f"the allocator handed out {got}, still in TIME_WAIT")
