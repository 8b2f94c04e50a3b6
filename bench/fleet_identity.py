"""The fleet benchmark's look at another daemon cost: the identity's look for the other
stacks' daemon keys (`dynamod/rollout/identity.py` `live_daemons`, every daemon every
~1.7 s, for the shared-namespace view) over the fleet's own etcd, idle, the two ways side
by side in one run: all of `dynamod/` read and filtered, as every look did before, and the
stack-by-stack scan (each stack's first key, its daemon keys, the rest of its folder
skipped). The looks run in a child process inside the head's namespace, on its etcd
member as its daemon's do (its CPU is the process's, gRPC's threads with it), each way in
turn, ROUNDS rounds of LOOKS looks; etcd's members' CPU is read around each round."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from bench import procs
from bench.fleet_stack import members
from dynamod.chaos.cluster import ClusterRig
from dynamod.core.errors import DynamodError
from dynamod.rollout import identity
from dynamod.rollout.etcd import EtcdClient
from dynamod.rollout.ledger import ROOT

ROUNDS, LOOKS = 5, 20
HEAD_ETCD = "http://127.0.0.1:2379"  # the head's member, inside the head's namespace


class LookError(DynamodError):
    """The child that times the looks failed: the look is not measured."""


async def whole_read(etcd: EtcdClient) -> list[identity.DaemonRecord]:
    """The look as it was: every key under `dynamod/` read, the daemon keys kept."""
    found = []
    for kv in await etcd.get_prefix(ROOT):
        if identity.is_daemon_key(kv.key) and (r := identity.DaemonRecord.decode(kv.value)):
            found.append(replace(r, lease=kv.lease))
    return found


WAYS: dict[str, Callable[[EtcdClient], Awaitable[list[identity.DaemonRecord]]]] = {
    "whole": whole_read,
    "by_stack": identity.live_daemons,
}


async def measure(url: str, etcd_pids: list[int], rounds: int, looks: int) -> dict[str, Any]:
    """Per way: ms of this process's CPU, etcd's members' CPU and the wall a look, each a
    list over the rounds; the keys under `dynamod/`; the daemons each way found."""
    async with EtcdClient(url) as etcd:
        keys = len(await etcd.get_prefix(ROOT))
        found = {w: sorted(r.encode() for r in await look(etcd)) for w, look in WAYS.items()}
        samples: dict[str, dict[str, list[float]]] = {
            w: {"cpu_ms": [], "etcd_ms": [], "wall_ms": []} for w in WAYS
        }
        for _ in range(rounds):
            for way, look in WAYS.items():
                etcd_before = sum(procs.cpu_of(etcd_pids).values())
                cpu, wall = time.process_time(), time.monotonic()
                for _ in range(looks):
                    await look(etcd)
                each = samples[way]
                each["wall_ms"].append((time.monotonic() - wall) * 1000 / looks)
                each["cpu_ms"].append((time.process_time() - cpu) * 1000 / looks)
                etcd_s = sum(procs.cpu_of(etcd_pids).values()) - etcd_before
                each["etcd_ms"].append(etcd_s * 1000 / looks)
    return {"keys": keys, "found": found, "samples": samples}


def identity_look(rig: ClusterRig, rounds: int = ROUNDS, looks: int = LOOKS) -> dict[str, Any]:
    """The two ways' medians a look, and whether they found the same daemons (a look
    that finds fewer is not a cheaper look)."""
    assert rig.sandbox is not None
    etcd_pids = [
        int(u["pid"])
        for node in members(rig.names)
        for u in rig.status(node)["units"]
        if u["name"] == "etcd" and u.get("pid")
    ]
    argv = [sys.executable, "-m", "bench.fleet_identity", HEAD_ETCD, str(rounds), str(looks),
            *map(str, etcd_pids)]  # fmt: skip
    proc = rig.sandbox.run(0, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["(no stderr)"]
        raise LookError(f"the identity look exited {proc.returncode}: {tail[0]}")
    got = json.loads(out)
    result: dict[str, Any] = {
        "keys": got["keys"],
        "daemons": {w: len(f) for w, f in got["found"].items()},
        "same": len({json.dumps(f) for f in got["found"].values()}) == 1,
        "etcd_members": len(etcd_pids),
        "rounds": rounds,
        "looks": looks,
    }
    for way, each in got["samples"].items():
        result[way] = {k: statistics.median(v) for k, v in each.items()}
    return result


if __name__ == "__main__":  # the child: URL ROUNDS LOOKS ETCD_PID...
    url, rounds_arg, looks_arg, *pids = sys.argv[1:]
    print(json.dumps(asyncio.run(measure(url, list(map(int, pids)), int(rounds_arg),
                                         int(looks_arg)))))  # fmt: skip
