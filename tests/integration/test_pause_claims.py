"""Pauses made outside dynamod, on the real stack (etcd, NATS, the Dynamo frontend, CPU
workers under a `[policy]`): a process claims a shard's pause through the control socket,
as verl's ranks and rollout servers do (`dynamod.integrations.verl.engine.claim_pause`),
then pauses the shard itself at its system port (`python -m dynamod.chaos.pauser`).

* `status` names the pauser, and the shard's own liveness answer agrees it is paused.
* The pauser killed -9 with its claim open: dynamod holds the shard, replays the ledger's
  version into it and resumes it (the same process: rejoined, not restarted), and it
  serves again.
* A claim the pauser released, and one that a dynamod push ended by resuming the shard,
  leave nothing to do when the pauser exits: the first shard stays paused (as its pauser
  left it: the must-fail side of the watch), the second serves.
* pid namespaces: a pauser in one of its own (a container's) is watched by its pid in the
  daemon's; a caller the daemon cannot see (the daemon's side in a namespace of its own)
  is refused in one line, and verl's claim then only warns.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from dynamod.chaos import pauser
from dynamod.chaos.stack import engine_call
from dynamod.client import Client
from dynamod.core.errors import DaemonError
from dynamod.core.paths import socket_path
from dynamod.integrations.verl import engine as verl_engine
from dynamod.integrations.verl.stack import Shard
from tests.conftest import Dynamod, unit_by_name
from tests.integration.policystack import checkpoint, frontend, model_dir, push, write_stack
from tests.integration.test_metrics import free_port, scrape, value

pytestmark = pytest.mark.slow

def _system_url(unit: dict[str, Any]) -> str:
    return f"http://127.0.0.1:{unit['ports']['system']}"


def _engine(unit: dict[str, Any], route: str) -> dict[str, Any]:
    answer: dict[str, Any] = engine_call(_system_url(unit), route)
    return answer


def _pauser(dm: Dynamod, shard: str, then: str) -> tuple[subprocess.Popen[str], list[str]]:
    proc, lines = pauser.start(dm.state_dir, shard, _system_url(dm.unit(shard)),
                               release=then == "release")  # fmt: skip
    claimed = json.loads(lines[0])
    assert claimed == {"pid": proc.pid, "claimed": [shard]}, claimed
    assert json.loads(lines[1])["status"] == "ok", lines
    return proc, lines


def _orphaned(dm: Dynamod) -> list[dict[str, Any]]:
    return [json.loads(line) for line in dm.daemon_log().splitlines()
            if '"policy.pause_orphaned"' in line]  # fmt: skip


def _completion(url: str, instance: int) -> int:
    """The instance that answered a completion pinned to `instance`."""
    body = json.dumps({"model": "tiny-cpu", "prompt": "after the pause", "max_tokens": 4,
                       "nvext": {"backend_instance_id": instance,
                                 "extra_fields": ["worker_id"]}}).encode()  # fmt: skip
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as answer:
        reply = json.loads(answer.read())
    return int(reply["nvext"]["worker_id"]["decode_worker_id"])


def test_a_pauser_that_dies_with_its_claim_open_has_its_shard_rejoined(
    dm: Dynamod, tmp_path: Path
) -> None:
    stack = write_stack(tmp_path / "pause-claims.toml", "pauseclaims", workers=2)
    port = free_port()
    dm.run("up", str(stack), "--detach", "--metrics-addr", f"127.0.0.1:{port}", timeout=300,
           check=True)  # fmt: skip
    before = dm.unit("worker@1")
    proc, _ = _pauser(dm, "worker@1", "stay")
    try:
        shown = dm.unit("worker@1")
        claims = shown["policy"]["paused_by"]
        assert [(c["pid"], c["why"]) for c in claims] == [(proc.pid, pauser.WHY)]
        assert dm.status()["policy"]["paused_outside"] == ["worker@1"]
        assert _engine(shown, "liveness_probe")["paused"] is True  # the engine agrees
        human = dm.run("status", check=True).stdout
        assert f"PAUSED by pid {proc.pid} ({pauser.WHY})" in human, human
        assert "paused outside dynamod" in human and "worker@1" in human
        assert value(scrape(port)[0], "dynamod_shards_paused_outside") == 1
        time.sleep(1.0)  # the claim alone changes nothing while its pauser lives
        assert _engine(dm.unit("worker@1"), "liveness_probe")["paused"] is True
        assert _orphaned(dm) == []
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    back = dm.wait_for(
        lambda s: (u := unit_by_name(s, "worker@1"))["state"] == "ready"
        and not u["policy"].get("paused_by") and u["policy"]["admitted"]
        and _engine(u, "liveness_probe")["paused"] is False and u,
        timeout=60, what="worker@1 rejoined after its pauser died",
    )  # fmt: skip
    assert back["pid"] == before["pid"] and back["restarts"] == 0  # rejoined, not restarted
    assert dm.status()["policy"]["paused_outside"] == []
    assert value(scrape(port)[0], "dynamod_shards_paused_outside") == 0
    assert [(o["shard"], o["pid"]) for o in _orphaned(dm)] == [("worker@1", proc.pid)]
    instance = back["dynamo"]["instance_ids"][0]
    assert _completion(frontend(dm.status()), instance) == instance  # it serves again

    # A pauser in a pid namespace of its own, as in a container: pid 1 there, but the
    # kernel names it to the daemon by its pid here, so its claim is watched the same way.
    boxed, lines = pauser.start(dm.state_dir, "worker@0", _system_url(dm.unit("worker@0")),
                                wrap=UNSHARE)  # fmt: skip
    claimer = json.loads(lines[0])["pid"]
    try:
        assert _nspids(claimer) == [claimer, 1]  # pid 1 in its own namespace
        assert [c["pid"] for c in dm.unit("worker@0")["policy"]["paused_by"]] == [claimer]
    finally:
        os.kill(boxed.pid, signal.SIGKILL)  # unshare; --kill-child takes the pauser along
        boxed.wait(timeout=10)
    dm.wait_for(
        lambda s: (u := unit_by_name(s, "worker@0"))["state"] == "ready"
        and not u["policy"].get("paused_by") and u["policy"]["admitted"]
        and _engine(u, "liveness_probe")["paused"] is False,
        timeout=60, what="worker@0 rejoined after its boxed pauser died",
    )  # fmt: skip
    assert ("worker@0", claimer) in [(o["shard"], o["pid"]) for o in _orphaned(dm)]


UNSHARE = ["unshare", "--pid", "--fork", "--kill-child"]


def _nspids(pid: int) -> list[int]:
    """The pid's number in each pid namespace it is in, outermost first (NSpid)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(n) for n in line.split()[1:]]
    raise AssertionError(f"no NSpid line for pid {pid}")


_BOXED_DAEMON = """
import asyncio, sys
from pathlib import Path
from dynamod.core.api import build_app, serve
from dynamod.rollout.pause_claims import PauseClaims

async def main() -> None:
    app = build_app(None)  # only the claims' routes are called
    claims = PauseClaims(on_orphaned=lambda shard, claim: None)
    app.router.add_routes(claims.routes(lambda: ["worker@0"]))
    await serve(app, Path(sys.argv[1]))
    print("serving", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.parametrize("caller", ["client", "verl"])
def test_a_claimer_the_daemon_cannot_see_is_refused_and_verl_pauses_unwatched(
    tmp_path: Path, caller: str
) -> None:
    """The other way round: the daemon's side in a pid namespace of its own, the claimer
    outside it. The kernel gives the daemon pid 0 for such a peer: no process it can
    watch, so the claim is refused in one line; verl's `claim_pause` logs that and lets
    its pause go ahead, unwatched, as before claims."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    boxed = subprocess.Popen([*UNSHARE, sys.executable, "-c", _BOXED_DAEMON,
                              str(socket_path(state))],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert boxed.stdout is not None and boxed.stdout.readline() == "serving\n"
        if caller == "client":
            with pytest.raises(DaemonError, match="another pid namespace"):
                Client(state).policy_pause(["worker@0"], "outside the daemon's namespace")
        else:
            shard = Shard(name="worker@0", state="ready", system_url=None, policy_version=0,
                          admitted=True, instance_ids=())  # fmt: skip
            with capture_logs() as logs:  # it returns: the pause goes ahead
                asyncio.run(verl_engine.claim_pause(state, [shard], "verl replica 0"))
            [warned] = [e for e in logs if e["event"] == "verl.pause_claim_failed"]
            assert "another pid namespace" in warned["error"], logs
    finally:
        boxed.kill()  # unshare; --kill-child takes the boxed daemon along
        boxed.wait(timeout=10)


def test_a_released_claim_or_one_a_push_ended_leaves_nothing_to_do(
    dm: Dynamod, tmp_path: Path
) -> None:
    stack = write_stack(tmp_path / "pause-claims.toml", "pauseclaims2", workers=2)
    dm.run("up", str(stack), "--detach", timeout=300, check=True)
    pushed, _ = _pauser(dm, "worker@1", "stay")
    try:
        assert dm.status()["policy"]["paused_outside"] == ["worker@1"]
        # a push pauses, loads and resumes every admitted shard: worker@1's claim ends
        status = dm.status()
        assert push(dm, 1, checkpoint(model_dir(status), tmp_path / "step-1", 1.01))["ok"]
        assert dm.status()["policy"]["paused_outside"] == []
        assert "paused_by" not in dm.unit("worker@1")["policy"]
    finally:
        os.kill(pushed.pid, signal.SIGKILL)
        pushed.wait(timeout=10)
    released, _ = _pauser(dm, "worker@0", "release")
    assert released.wait(timeout=30) == 0
    assert dm.status()["policy"]["paused_outside"] == []
    time.sleep(2.0)  # what a dead pauser's open claim would have set off by now
    assert _orphaned(dm) == []
    # the released pause was the pauser's to end: dynamod left worker@0 as it was
    assert _engine(dm.unit("worker@0"), "liveness_probe")["paused"] is True
    assert _engine(dm.unit("worker@1"), "liveness_probe")["paused"] is False


def test_a_spare_whose_pauser_dies_is_resumed_and_stays_a_spare(
    dm: Dynamod, tmp_path: Path
) -> None:
    """A spare is rejoined as any shard (its replay, check and resume), and its replay
    carries no policy taint: it stays a spare, not admitted."""
    stack = write_stack(tmp_path / "pause-claims.toml", "pauseclaims3", spares=1)
    dm.run("up", str(stack), "--detach", timeout=300, check=True)
    spare = dm.wait_for(
        lambda s: next((u for u in s["units"] if (u.get("spare") or {}).get("role") == "spare"
                        and u["state"] == "ready"), None),
        timeout=60, what="a ready spare")  # fmt: skip
    proc, _ = _pauser(dm, spare["name"], "stay")
    assert _engine(dm.unit(spare["name"]), "liveness_probe")["paused"] is True
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    back = dm.wait_for(
        lambda s: s["policy"]["paused_outside"] == []
        and not _engine(u := unit_by_name(s, spare["name"]), "liveness_probe")["paused"] and u,
        timeout=30, what=f"{spare['name']} resumed after its pauser died")  # fmt: skip
    assert back["spare"]["role"] == "spare" and not back["policy"]["admitted"]
    assert back["pid"] == spare["pid"] and back["state"] == "ready"
    assert [(o["shard"], o["pid"]) for o in _orphaned(dm)] == [(spare["name"], proc.pid)]
