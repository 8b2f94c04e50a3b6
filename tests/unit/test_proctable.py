"""proctable's tree walks against real processes: `children` (the kernel's per-thread
child lists) finds the same children as a full /proc pass, including one forked by
another thread, and leaves out zombies and grandchildren; `descendants` finds the whole
tree and nothing outside it. Every process is started here and ended by pid."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
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


GROUP_BELOW = """
import json, os, subprocess, sys, time
from dynamod.core import proctable
from dynamod.core.process import become_subreaper
become_subreaper()
# the group's leader: a child in its group, one that left it (its own session), and a
# grandchild in the group; then the leader exits, and the adopter takes the orphans in
leader = subprocess.Popen(
    ["sh", "-c", "sleep 60 & sh -c 'sleep 60 & wait' & setsid sleep 60 & echo ok; wait"],
    stdout=subprocess.PIPE, start_new_session=True,
)
leader.stdout.readline()
other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # another unit's
deadline = time.monotonic() + 5
while time.monotonic() < deadline:  # the setsid one out of the group, the shell's sleep in
    group = [p for p, i in proctable.snapshot().items() if i.pgid == leader.pid]
    if len(group) == 4 and len(proctable.descendants(leader.pid)) == 4:
        break
    time.sleep(0.01)
before = proctable.group_below(leader.pid, os.getpid())
full_before = {p for p, i in proctable.snapshot().items() if i.pgid == leader.pid}
leader_alive = leader.pid in before
os.kill(leader.pid, 9)
leader.wait()
deadline, kids = time.monotonic() + 5, {}
while time.monotonic() < deadline:  # the orphans re-parented to us
    kids = proctable.children(os.getpid())
    if len(kids) >= 4:
        break
    time.sleep(0.01)
after = proctable.group_below(leader.pid, os.getpid())
full = {p for p, i in proctable.snapshot().items() if i.pgid == leader.pid}
print(json.dumps({"before": sorted(before), "full_before": sorted(full_before),
                  "after": sorted(after), "full": sorted(full),
                  "leader": leader.pid, "other": other.pid, "leader_alive": leader_alive,
                  "adopted": sorted(set(kids) & full)}))
os.killpg(leader.pid, 9)
other.kill()
for pid in proctable.descendants(os.getpid()):
    os.kill(pid, 9)
while True:  # every one reaped here, none left to whoever adopts them next
    try:
        os.wait()
    except ChildProcessError:
        break
"""


def test_a_group_below_its_adopter_is_what_a_full_pass_finds() -> None:
    """A unit's group found through its tree and its adopter's (a child subreaper, as
    dynamod is) equals a full /proc pass: while its leader lives, and once the leader is
    gone and the adopter took its orphans in; the member that left the group (setsid) and
    another session's process are not in it."""
    done = subprocess.run(
        [sys.executable, "-c", GROUP_BELOW], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    # the leader, its sleep, a shell and that shell's sleep (the setsid one left the group)
    assert found["leader_alive"] and len(found["before"]) == 4, found
    assert found["before"] == found["full_before"], found
    assert found["after"] == found["full"], found
    assert len(found["after"]) == 3 and found["leader"] not in found["after"], found
    assert found["adopted"], found  # an orphan the adopter took in, found
    assert found["other"] not in found["after"] + found["before"], found
