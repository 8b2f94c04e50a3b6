"""Policy updates and rejoin on the real stack: etcd, NATS, the Dynamo frontend (kv router)
and CPU workers. Every response says which instance served it at which weight version
(`nvext.engine_data`), so the invariants are checked over the recorded history."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import Dynamod, unit_by_name, wait_dead
from tests.integration.policystack import (
    MODEL,
    History,
    checkpoint,
    frontend,
    ledger_revisions,
    model_dir,
    push,
    write_stack,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(tmp_path: Path) -> Path:
    """The default stack's units, with a short engine-call timeout for stuck shards."""
    return write_stack(tmp_path / "policy-stack.toml", "policytest", keep=2)


def served_by(url: str, instance: int) -> tuple[int, int]:
    """(instance, weight version) that answered a request pinned to `instance`."""

    async def one() -> tuple[int, int]:
        nvext = {"backend_instance_id": instance, "extra_fields": ["engine_data"]}
        body = {"model": MODEL, "prompt": "the policy says", "max_tokens": 4, "nvext": nvext}
        timeout = aiohttp.ClientTimeout(total=20)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(f"{url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
            engine = json.loads(await resp.text())["nvext"]["engine_data"]
        return int(engine["instance_id"]), int(engine["weight_version"])

    return asyncio.run(one())


def up(dm: Dynamod, stack: Path) -> dict[str, Any]:
    dm.run("up", str(stack), "--detach", timeout=300, check=True)
    return dm.status()


def shard_versions(dm: Dynamod) -> dict[str, Any]:
    return {
        u["name"]: u.get("policy_version")
        for u in dm.status()["units"]
        if u["name"].startswith("worker@")
    }


def admitted_at(dm: Dynamod, unit: str, after: float) -> list[float]:
    """Wall-clock times the daemon log shows `unit` going held -> ready after `after`."""
    return moved_at(dm, unit, after, "held", "ready")


def moved_at(dm: Dynamod, unit: str, after: float, old: str, new: str) -> list[float]:
    """Wall-clock times the daemon log shows `unit` going old -> new after `after`."""
    from datetime import datetime

    times = []
    for line in dm.daemon_log().splitlines():
        if '"unit.state"' not in line:
            continue
        event = json.loads(line)
        if event["unit"] == unit and event["old"] == old and event["new"] == new:
            at = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
            if at >= after:
                times.append(at)
    return times


def test_push_advances_ledger_and_restarted_shard_rejoins_before_serving(
    dm: Dynamod, stack: Path, tmp_path: Path
) -> None:
    status = up(dm, stack)
    assert status["policy"]["current"] == 0 and set(shard_versions(dm).values()) == {0}
    base = model_dir(status)
    result = push(dm, 1, checkpoint(base, tmp_path / "step-1", 1.01))
    assert (
        result["ok"] and result["stale"] == [] and set(result["acks"]) == {"worker@0", "worker@1"}
    )
    for ack in result["acks"].values():
        assert ack["ok"] and ack["version"] == 1 and ack["digest"] == result["digest"]
        assert {"pause", "load", "kv_reset", "verify", "taint", "resume"} <= set(ack["ms"])
    assert shard_versions(dm) == {"worker@0": 1, "worker@1": 1}
    assert dm.status()["policy"]["current"] == 1
    ledger = json.loads(dm.run("policy", "status", "--json", check=True).stdout)
    assert ledger["current"] == 1 and ledger["current_digest"] == result["digest"]
    # the commit was one write: the current version and both shards' records at one revision
    written = asyncio.run(ledger_revisions(dm))
    assert written["policy/current"] == written["shards/worker@0"] == written["shards/worker@1"]

    history = History(frontend(status))
    history.run(lambda: 1)
    history.wait_served(16)  # traffic flows before the kill
    victim = dm.unit("worker@1")
    killed_wall = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    back = dm.wait_ready_again("worker@1", victim["pid"], timeout=60, what="rejoin")
    history.wait_served(24, after=time.monotonic())  # traffic with the shard back
    history.stop()
    assert back["policy_version"] == 1 and back["restarts"] == 1
    (admitted_wall,) = admitted_at(dm, "worker@1", killed_wall)
    new_instance = back["dynamo"]["instance_ids"][0]
    served = [r for r in history.rows if r["status"] == 200]
    assert len(served) > 20
    # Invariant: nothing is served below the current version; the restarted shard
    # served nothing before it was admitted, and then it did serve.
    assert {r["version"] for r in served} == {1}
    by_new = [r for r in served if r["instance"] == new_instance]
    mono_to_wall = time.time() - time.monotonic()
    assert by_new, "the rejoined shard never served"
    # The shard is paused until the rejoin's resume step. Counted forward: it went held
    # (registered, paused) and then ran its replay's steps one after another, so it
    # resumed no earlier than that line plus their times. (Counted back from the held ->
    # ready line, the bound needs slack for the ledger read and the ack's record after
    # the route, which a loaded machine stretches; see test_spares' served bound.)
    ms = back["policy"]["last_ack_ms"]
    (held_wall,) = moved_at(dm, "worker@1", killed_wall, "starting", "held")
    before_resume = ("pause", "load", "kv_reset", "verify", "taint")
    resumed_wall = held_wall + sum(ms[step] for step in before_resume) / 1000
    assert resumed_wall <= admitted_wall, (ms, held_wall, admitted_wall)
    early = [r for r in by_new if r["done"] + mono_to_wall < resumed_wall]
    assert early == [], f"answered by the rejoined shard before its resume: {early[:3]}"
    failures = [r for r in history.rows if r["status"] != 200]
    assert failures == [], failures[:3]
    log = dm.daemon_log()
    assert "held: waiting to replay the current policy" in log
    # `dynamod events` records the push and the killed shard's revocation
    events = [json.loads(line) for line in (dm.state_dir / "events.jsonl").read_text().splitlines()]
    pushed = [e for e in events if e["kind"] == "policy.pushed"]
    assert [(e["version"], e["acked"], e["stale"]) for e in pushed] == [
        (1, ["worker@0", "worker@1"], [])
    ]
    assert any(e["kind"] == "dynamo.revoked" and e["unit"] == "worker@1" for e in events)
    assert "not_pushed" not in result  # every shard was reached: none is listed as left out

    # A push while a shard is away names it too, with what happens to it; started again,
    # it is replayed to that version before it serves.
    dm.run("stop", "worker@1", check=True)
    out = dm.run("policy", "push", "--step", "2", "--path",
                 str(checkpoint(base, tmp_path / "step-2", 1.02)), check=True).stdout
    assert "policy version 2" in out, out
    assert any(line.split()[:2] == ["worker@0", "ok"] for line in out.splitlines()), out
    away = [line for line in out.splitlines() if line.split()[:1] == ["worker@1"]]
    assert away and "replayed to version 2" in away[0] and "stopped" in away[0], out
    dm.run("start", "worker@1", check=True)
    rejoined = dm.wait_for(
        lambda s: (u := unit_by_name(s, "worker@1"))["state"] == "ready" and u,
        what="worker@1 ready again after the push")
    assert rejoined["policy_version"] == 2


def test_kill_during_push_completes_on_others_and_killed_shard_catches_up(
    dm: Dynamod, stack: Path, tmp_path: Path
) -> None:
    status = up(dm, stack)
    ckpt = checkpoint(model_dir(status), tmp_path / "step-5", 0.99)
    victim = dm.unit("worker@1")
    os.kill(victim["pid"], signal.SIGSTOP)  # the push reaches it, then it dies mid-call
    answer: dict[str, Any] = {}
    pusher = threading.Thread(target=lambda: answer.update(push(dm, 5, ckpt)))
    pusher.start()
    # The CLI can take over a second to start on a loaded machine: kill the shard only once
    # the daemon has sent the push to it (the stopped shard cannot answer it).
    dm.wait_for(
        lambda _status: any(
            '"policy.push_started"' in line and '"worker@1"' in line
            for line in dm.daemon_log().splitlines()
        ),
        timeout=60,
        what="the push to reach the stopped shard",
    )
    time.sleep(0.3)  # the shard's pause request is on the wire: the fault lands mid-call
    os.kill(victim["pid"], signal.SIGKILL)
    pusher.join(timeout=60)
    assert answer["ok"] and answer["version"] == 5
    assert answer["acks"]["worker@0"]["ok"] and not answer["acks"]["worker@1"]["ok"]
    assert answer["stale"] == ["worker@1"]
    back = dm.wait_ready_again("worker@1", victim["pid"], timeout=60, what="catch-up")
    assert back["policy_version"] == 5
    assert shard_versions(dm) == {"worker@0": 5, "worker@1": 5}


def test_stale_but_alive_shard_is_held_replayed_and_admitted(
    dm: Dynamod, stack: Path, tmp_path: Path
) -> None:
    status = up(dm, stack)
    ckpt = checkpoint(model_dir(status), tmp_path / "step-2", 1.02)
    history = History(frontend(status))
    current = {"v": 0}
    history.run(lambda: current["v"])
    stuck = dm.unit("worker@1")
    os.kill(stuck["pid"], signal.SIGSTOP)  # its update call times out: alive but stale
    try:
        result = push(dm, 2, ckpt)
        current["v"] = 2
        boundary = time.monotonic()  # every request asked from here on asks for 2
        assert result["ok"] and result["stale"] == ["worker@1"]
        assert "timeout" in result["acks"]["worker@1"]["error"].lower() or (
            "no answer" in result["acks"]["worker@1"]["error"]
        )
        held = dm.unit("worker@1")
        # held (and, while it is stopped, possibly degraded too: its liveness probe fails)
        assert held["state"] in {"held", "degraded"} and held["pid"] == stuck["pid"]
        assert held["policy"]["admitted"] is False
        summary = dm.status()["policy"]
        assert summary["held"] == ["worker@1"] and summary["admitted"] == 1
        assert summary["serving"]  # min_ready_shards = 1: worker@0 keeps serving
        ledger = json.loads(dm.run("policy", "status", "--json", check=True).stdout)
        stale = next(s for s in ledger["shards"] if s["name"] == "worker@1")
        assert not stale["admitted"] and stale["last_error"]
    finally:
        os.kill(stuck["pid"], signal.SIGCONT)
    back = dm.wait_for(
        lambda s: (u := unit_by_name(s, "worker@1"))["state"] == "ready" and u,
        timeout=60,
        what="stale shard admitted",
    )
    history.wait_served(16, after=time.monotonic())  # traffic with the shard admitted
    history.stop()
    assert back["pid"] == stuck["pid"] and back["restarts"] == 0  # replayed, not restarted
    assert back["policy_version"] == 2
    served = [r for r in history.rows if r["status"] == 200]
    # A request may be answered by newer weights than it asked for (it waited out the
    # pause), never by older ones; once the push returned, only version 2 serves.
    assert served and all(r["version"] >= r["required"] for r in served)
    # (a request that still asked for version 0 as the push returned may reach the stuck
    # shard, the only one still tainted 0, so look at those asked after the switch)
    assert {r["version"] for r in served if r["asked"] > boundary} == {2}
    assert all(r["version"] == 2 for r in served if r["required"] == 2)
    stuck_instance = stuck["dynamo"]["instance_ids"][0]
    # The rejoined shard serves version 2. Asked directly: the CPU engine answers this
    # short prompt in milliseconds, so at 8 req/s the kv router finds worker@0 idle every
    # time and need not spread the history's requests onto worker@1.
    assert served_by(frontend(status), stuck_instance) == (stuck_instance, 2)


def test_corrupt_or_missing_checkpoint_fails_cleanly(
    dm: Dynamod, stack: Path, tmp_path: Path
) -> None:
    status = up(dm, stack)
    base = model_dir(status)
    good = push(dm, 1, checkpoint(base, tmp_path / "step-1", 1.01))
    missing = dm.run("policy", "push", "--step", "2", "--path", str(tmp_path / "nope"))
    assert missing.returncode == 1 and f"{tmp_path / 'nope'} does not exist" in missing.stderr
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    bad = dm.run("policy", "push", "--step", "2", "--path", str(garbage))
    assert bad.returncode == 1 and str(garbage / "model.safetensors") in bad.stderr
    # A file whose header is fine but whose data is cut short gets past the header check;
    # every shard refuses it, names the file and keeps its weights.
    truncated = checkpoint(base, tmp_path / "truncated", 1.5)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    cut = dm.run("policy", "push", "--step", "2", "--path", str(truncated))
    assert cut.returncode == 1
    assert "failed on every shard" in cut.stderr
    assert str(truncated / "model.safetensors") in cut.stderr
    ledger = json.loads(dm.run("policy", "status", "--json", check=True).stdout)
    assert ledger["current"] == 1 and ledger["current_digest"] == good["digest"]
    status = dm.status()
    for name in ("worker@0", "worker@1"):
        unit = unit_by_name(status, name)
        assert unit["state"] == "ready" and unit["policy_version"] == 1

    async def still_serving() -> dict[str, Any]:
        history = History(frontend(status))
        async with aiohttp.ClientSession() as session:
            await history.one(session, 1)
        return history.rows[0]

    row = asyncio.run(still_serving())
    assert row["status"] == 200 and row["version"] == 1


def test_daemon_killed_and_restarted_keeps_ledger_and_admits_nothing_stale(
    dm: Dynamod, stack: Path, tmp_path: Path
) -> None:
    status = up(dm, stack)
    base = model_dir(status)
    push(dm, 1, checkpoint(base, tmp_path / "step-1", 1.01))
    second = push(dm, 2, checkpoint(base, tmp_path / "step-2", 1.02))
    pids = [u["pid"] for u in status["units"] if u["pid"]]
    os.kill(status["daemon_pid"], signal.SIGKILL)
    assert wait_dead(pids, timeout=15) == []
    log_before = len(dm.daemon_log().splitlines())

    again = up(dm, stack)
    assert again["policy"]["current"] == 2
    assert shard_versions(dm) == {"worker@0": 2, "worker@1": 2}
    ledger = json.loads(dm.run("policy", "status", "--json", check=True).stdout)
    assert ledger["current_digest"] == second["digest"]
    assert [v["version"] for v in ledger["history"]] == [1, 2]
    # In the new run no shard was ever admitted at anything but version 2.
    for line in dm.daemon_log().splitlines()[log_before:]:
        if '"unit.state"' in line:
            event = json.loads(line)
            if event["new"] == "ready" and event["unit"].startswith("worker@"):
                assert "at policy version 2 " in event["detail"], event


def test_max_updating_1_updates_the_shards_one_at_a_time(dm: Dynamod, tmp_path: Path) -> None:
    """`[policy] max_updating = 1` on 3 shards: a push updates them one after another (each
    one's wait for its update slot covers the updates before it), the CLI says who waited;
    `apply` lifts the limit in place and the next push updates them all at once (the
    control)."""
    limited = write_stack(tmp_path / "limited.toml", "updslots", workers=3, max_updating=1)
    status = up(dm, limited)
    assert status["policy"]["update_slots"] == {"max_updating": 1, "updating": [], "waiting": []}
    base = model_dir(status)
    first = push(dm, 1, checkpoint(base, tmp_path / "step-1", 1.01))
    acks = sorted(first["acks"].values(), key=lambda a: a["waited_ms"])
    assert len(acks) == 3 and all(a["ok"] and a["version"] == 1 for a in acks), first
    assert acks[0]["waited_ms"] < 100, acks
    # In line behind every update before it. Slack: 10 %, and 10 ms for the time the first
    # took to reach its first engine call before the next one asked (a loaded machine).
    for k in (1, 2):
        before = sum(a["total_ms"] for a in acks[:k])
        assert acks[k]["waited_ms"] >= 0.9 * before - 10, (k, acks)
    out = dm.run("policy", "push", "--step", "2", "--path",
                 str(checkpoint(base, tmp_path / "step-2", 1.02)), check=True).stdout
    waited = [line for line in out.splitlines() if "waiting for an update slot" in line]
    assert len(waited) == 2, out  # the first in line took its slot at once

    lifted = write_stack(tmp_path / "lifted.toml", "updslots", workers=3)
    applied = dm.run("apply", str(lifted), check=True).stdout
    assert "~ [policy] max_updating: 1 -> (unset)" in applied, applied
    assert dm.status()["policy"]["update_slots"] is None
    third = push(dm, 3, checkpoint(base, tmp_path / "step-3", 1.03))
    assert all(a["ok"] and a["waited_ms"] < 100 for a in third["acks"].values()), third
    assert shard_versions(dm) == {"worker@0": 3, "worker@1": 3, "worker@2": 3}


def test_push_serving_1_answers_after_one_shard_and_the_rest_follow(
    dm: Dynamod, tmp_path: Path
) -> None:
    """`policy push --serving 1` on 3 shards updating one at a time: the answer comes after
    the first shard serves the step, with the ledger already at it and the other two named
    as still updating; trainer traffic for the step is served at the step at once; the two
    follow in the background (`policy.push_finished`), and the next push waits for them.
    Asking for more shards than are admitted is refused, and nothing moves."""
    status = up(dm, write_stack(tmp_path / "serving.toml", "serving", workers=3, max_updating=1))
    base = model_dir(status)
    refused = dm.run("policy", "push", "--step", "1", "--serving", "4", "--path",
                     str(checkpoint(base, tmp_path / "step-1", 1.01)))  # fmt: skip
    assert refused.returncode == 1, refused
    assert "serving=4: the push can answer once 1 to 3 shard(s) serve the step" in refused.stderr
    from dynamod.client import Client
    from dynamod.core.errors import DaemonError

    for bad in ("1", 0, True):  # the route's own check, under the CLI's
        with pytest.raises(DaemonError, match='"serving" must be a whole number of shards'):
            Client(dm.state_dir).request("POST", "/policy/push", {
                "step": 1, "path": str(tmp_path / "step-1"), "serving": bad})  # fmt: skip
    assert dm.status()["policy"]["current"] == 0, "a refused push moved the ledger"

    answer = json.loads(dm.run("policy", "push", "--step", "1", "--serving", "1", "--path",
                               str(tmp_path / "step-1"), "--json", check=True).stdout)  # fmt: skip
    acked = [name for name, ack in answer["acks"].items() if ack["ok"]]
    assert len(acked) == 1 and answer["acks"][acked[0]]["version"] == 1, answer
    assert sorted([*acked, *answer["updating"]]) == ["worker@0", "worker@1", "worker@2"], answer
    assert "nodes" not in answer and "not_pushed" not in answer, answer
    assert dm.status()["policy"]["current"] == 1  # committed before the answer
    # the commit's time, split: the daemon's CPU in it and its loop's wait for a core
    assert answer["commit_ms"] > 0 and answer["commit_cpu_ms"] >= 0, answer
    assert answer["commit_waited_ms"] is None or answer["commit_waited_ms"] >= 0, answer

    async def for_step(version: int) -> dict[str, Any]:
        history = History(frontend(status))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            await history.one(session, version)
        return history.rows[0]

    served = asyncio.run(for_step(1))
    assert served["status"] == 200 and served["version"] == 1, served

    def finished() -> list[dict[str, Any]]:
        return [json.loads(line) for line in dm.daemon_log().splitlines()
                if '"policy.push_finished"' in line]  # fmt: skip

    deadline = time.monotonic() + 60
    while not finished():  # logged once the last of them acknowledged and was recorded
        assert time.monotonic() < deadline, shard_versions(dm)
        time.sleep(0.2)
    assert shard_versions(dm) == {"worker@0": 1, "worker@1": 1, "worker@2": 1}
    assert len(finished()) == 1 and finished()[0]["version"] == 1, finished()
    done = finished()[0]
    assert done["updated"] == sorted(answer["updating"]) and not done["stale"], done
    assert answer["seconds"] <= done["here_s"] <= done["seconds"], done
    assert dm.status()["policy"]["updating"] == []

    # The next push right after an early answer: in line behind the rest of the first.
    early = json.loads(dm.run("policy", "push", "--step", "2", "--serving", "1", "--path",
                              str(checkpoint(base, tmp_path / "step-2", 1.02)), "--json",
                              check=True).stdout)  # fmt: skip
    second = push(dm, 3, checkpoint(base, tmp_path / "step-3", 1.03))
    assert len(early["updating"]) == 2 and all(a["ok"] for a in second["acks"].values())
    assert "updating" not in second, second
    assert shard_versions(dm) == {"worker@0": 3, "worker@1": 3, "worker@2": 3}
    assert asyncio.run(for_step(3))["version"] == 3

    # verl's `push_serving` setting (engine_kwargs.dynamod) takes the same path
    from safetensors.torch import load_file

    from dynamod.integrations.verl.adapter import push_weights

    weights = load_file(str(base / "model.safetensors")).items()
    verl = asyncio.run(push_weights(dm.state_dir, tmp_path / "verl", weights, 4, serving=1))
    assert [a["ok"] for a in verl["acks"].values()] == [True] and len(verl["updating"]) == 2
