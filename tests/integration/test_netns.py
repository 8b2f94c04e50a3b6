"""The netns harness itself: nodes reach each other over the bridge, a cut loses the node's
packets and a heal brings them back, and close leaves no namespace and no process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamod.chaos.netns import Sandbox, SandboxError, can_create_namespaces

REASON = can_create_namespaces()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
    pytest.mark.xdist_group("netns"),  # one simulated cluster at a time (make test runs -n 2)
]


PORT = 7070
LISTEN = (
    "import socket,sys; s=socket.create_server((sys.argv[1], int(sys.argv[2])));"
    " [s.accept()[0].close() for _ in iter(int, 1)]"
)
CONNECT = (
    "import socket,sys;"
    " socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()"
)


def _listen_everywhere(box: Sandbox) -> None:
    """A listener on each node, each listening before this returns (each node reaches
    its own, within 20 s: an interpreter's start on a loaded machine)."""
    for i in range(len(box.nodes)):
        box.run(i, [sys.executable, "-c", LISTEN, box.address(i), str(PORT)])
    deadline = time.monotonic() + 20
    waiting = set(range(len(box.nodes)))
    while waiting and time.monotonic() < deadline:
        waiting = {i for i in waiting if not _reaches(box, i, i)}
        if waiting:
            time.sleep(0.1)
    assert not waiting, f"nodes {sorted(waiting)}: their listener never listened"


def _reaches(box: Sandbox, src: int, dst: int) -> bool:
    argv = [sys.executable, "-c", CONNECT, box.address(dst), str(PORT)]
    return subprocess.run(box.command(src, argv), capture_output=True).returncode == 0


def test_nodes_reach_each_other_a_cut_isolates_one_and_close_removes_everything() -> None:
    box = Sandbox(3, prefix="dmt")
    names = [box.switch, *box.nodes]
    try:
        assert len(set(box.addresses)) == 3
        _listen_everywhere(box)
        assert _reaches(box, 0, 1) and _reaches(box, 2, 0)
        box.cut(2)
        assert not _reaches(box, 0, 2)
        assert _reaches(box, 0, 1), "cutting n2 must not disturb n0 <-> n1"
        box.heal(2)
        assert _reaches(box, 0, 2)
        sleeper = box.run(1, ["sleep", "300"])
        assert sleeper.pid in box.pids()
    finally:
        box.close()
    box.close()  # idempotent
    assert sleeper.poll() is not None
    assert not [n for n in names if (Path("/run/netns") / n).exists()]


def test_a_second_sandbox_gets_its_own_subnet_and_a_bad_node_is_named() -> None:
    with Sandbox(1, prefix="dmt") as one, Sandbox(1, prefix="dmt") as two:
        assert one.subnet_octet != two.subnet_octet
        assert one.switch != two.switch
        with pytest.raises(SandboxError, match="no node 5"):
            one.cut(5)
