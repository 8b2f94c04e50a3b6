"""proctable's tree walks against real processes: `children` (the kernel's per-thread
child lists) finds the same children as a full /proc pass, including one forked by
another thread, and leaves out zombies and grandchildren; `descendants` finds the whole
tree and nothing outside it. Every process is started here and ended by pid."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from dynamod.core import proctable


def _me() -> int:
    return os.getpid()


@pytest.fixture
def tree() -> Iterator[dict[str, list[int]]]:
    """Two children of ours (one forked by another thread), each with a grandchild, and
    a zombie child."""
    procs: list[subprocess.Popen[bytes]] = []
    script = "sleep 60 & echo $!; wait"

    def start() -> None:
        procs.append(
            subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        )

    start()
    other = threading.Thread(target=start)
    other.start()
    other.join()
    grandchildren = [int(p.stdout.readline()) for p in procs if p.stdout is not None]
    zombie = subprocess.Popen(["true"])
    while proctable.is_zombie(zombie.pid) is False:
        time.sleep(0.01)
    try:
        yield {
            "children": [p.pid for p in procs],
            "grandchildren": grandchildren,
            "zombie": [zombie.pid],
        }
    finally:
        for pid in grandchildren:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        for proc in procs:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        zombie.wait()


def test_children_are_the_ones_a_full_pass_finds(tree: dict[str, list[int]]) -> None:
    found = proctable.children(_me())
    full = {pid for pid, info in proctable.snapshot().items() if info.ppid == _me()}
    assert set(found) == full
    assert set(tree["children"]) <= set(found)  # also the one another thread forked
    assert not set(tree["grandchildren"]) & set(found)
    assert tree["zombie"][0] not in found
    assert all(info.ppid == _me() for info in found.values())


def test_descendants_are_the_whole_tree_and_nothing_else(tree: dict[str, list[int]]) -> None:
    found = proctable.descendants(_me())
    assert set(tree["children"]) | set(tree["grandchildren"]) <= set(found)
    assert tree["zombie"][0] not in found
    assert 1 not in found and _me() not in found
    assert os.getppid() not in found
    # a child's tree holds its grandchild, not its sibling
    first = proctable.descendants(tree["children"][0])
    assert set(first) == {tree["grandchildren"][0]}


def test_a_gone_process_has_no_children() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert proctable.children(proc.pid) == {}
