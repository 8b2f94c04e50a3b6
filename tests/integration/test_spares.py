"""Hot spare shards on the real stack: etcd, NATS, the Dynamo frontend (kv router) and three
CPU workers, two serving and one spare. Trainer traffic asks for the current version's
taint; every answer says which instance served it at which weight version, so "a spare
never serves before it holds the current version" is checked over the request history."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from dynamod.client import UnitStatus
from tests.conftest import Dynamod, unit_by_name
from tests.integration.policystack import (
    History,
    checkpoint,
    frontend,
    model_dir,
    push,
    write_stack,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(tmp_path: Path) -> Path:
    """The default stack's units with two serving shards and one spare."""
    return write_stack(tmp_path / "spares-stack.toml", "sparestest", spares=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def up(dm: Dynamod, stack: Path, *extra: str) -> dict[str, Any]:
    dm.run("up", str(stack), "--detach", *extra, timeout=300, check=True)
    return dm.status()


def role(unit: UnitStatus) -> str | None:
    spare = unit.get("spare")
    return spare["role"] if spare else None


def settled(dm: Dynamod, version: int, timeout: float = 60) -> dict[str, dict[str, Any]]:
    """Until two shards serve and one spare is ready, all at `version`; returns them by role."""

    def check(status: dict[str, Any]) -> dict[str, Any] | None:
        shards = [u for u in status["units"] if u["name"].startswith("worker@")]
        if any(u["state"] != "ready" or u.get("policy_version") != version for u in shards):
            return None
        serving = [u for u in shards if role(u) == "serving" and u["policy"]["admitted"]]
        spares = [u for u in shards if role(u) == "spare"]
        if len(serving) != 2 or len(spares) != 1:
            return None
        return {"serving": serving, "spare": spares[0], "status": status}

    result: dict[str, Any] = dm.wait_for(
        check, timeout=timeout, what=f"2 serving + 1 spare at v{version}"
    )
    return result


def events(dm: Dynamod, name: str) -> list[dict[str, Any]]:
    out = []
    for line in dm.daemon_log().splitlines():
        if f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                stamp = event["timestamp"].replace("Z", "+00:00")
                event["wall"] = datetime.fromisoformat(stamp).timestamp()
                out.append(event)
    return out


def wait_event(dm: Dynamod, name: str, count: int = 1, timeout: float = 30) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = events(dm, name)
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {count} {name!r} event(s) in daemon.log within {timeout}s")


def first_wall(dm: Dynamod, unit: str, new: str, after: float) -> float:
    for event in events(dm, "unit.state"):
        if event["unit"] == unit and event["new"] == new and event["wall"] >= after:
            return float(event["wall"])
    raise AssertionError(f"{unit} never went {new} after {after}")


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def served_only_when_current(
    dm: Dynamod, history: History, instance: int, unit: str
) -> list[dict[str, Any]]:
    """The promoted spare's answers: each at the version it was asked for, none answered
    before its promotion began (until then its own taints kept it out of routing). The
    bound is the `spares.promoting` line: `spares.promoted` is logged only after the
    canary through the frontend, and the router may send it requests from the taint on.
    Returns them."""
    began = next(e for e in events(dm, "spares.promoting") if e["unit"] == unit)
    to_wall = time.time() - time.monotonic()
    rows = [r for r in history.rows if r["status"] == 200 and r["instance"] == instance]
    assert all(r["version"] == r["required"] for r in rows), rows[:3]
    assert all(r["done"] + to_wall >= began["wall"] - 0.01 for r in rows), (began, rows[:3])
    return rows


def test_kill_promotes_the_spare_at_once_and_the_dead_shard_returns_as_spare(
    dm: Dynamod, stack: Path, tmp_path: Path
) -> None:
    port = free_port()
    up(dm, stack, "--metrics-addr", f"127.0.0.1:{port}")
    first = settled(dm, 0)
    result = push(dm, 1, checkpoint(model_dir(first["status"]), tmp_path / "step-1", 1.01))
    assert set(result["acks"]) == {u["name"] for u in first["serving"]}, "a spare was pushed to"
    roles = settled(dm, 1)
    spare = roles["spare"]
    assert spare["policy"]["admitted"] is False and spare["spare"]["behind"] == 0
    assert dm.status()["policy"]["admitted"] == 2
    tree = dm.run("status", check=True).stdout
    assert re.search(rf"{re.escape(spare['name'])}\s+spare\s", tree), tree
    samples = scrape(port)
    assert samples[("dynamod_spares_available", frozenset())] == 1
    assert samples[("dynamod_spare_promotions_total", frozenset({("reason", "exit")}))] == 0

    history = History(frontend(first["status"]))
    history.run(lambda: 1)
    history.wait_served(12)  # traffic flows before the fault
    victim = roles["serving"][0]
    killed_wall = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    (promoted,) = wait_event(dm, "spares.promoted")
    back = dm.wait_ready_again(victim["name"], victim["pid"], timeout=60, what="victim back")
    again = settled(dm, 1)
    history.wait_served(16, after=time.monotonic())  # traffic after it settled
    history.stop()

    assert promoted["unit"] == spare["name"] and promoted["replaced"] == victim["name"]
    assert promoted["reason"] == "exit" and promoted["version"] == 1
    # Current and awake: one call (the taint), and the canary through the frontend.
    assert set(promoted["steps_ms"]) == {"taint", "route"}
    assert promoted["was_version"] == 1 and promoted["was_asleep"] is False
    # and `dynamod events` has the promotion, with what it replaced
    lines = (dm.state_dir / "events.jsonl").read_text().splitlines()
    recorded = [json.loads(line) for line in lines]
    assert [(e["unit"], e["replaced"], e["version"]) for e in recorded
            if e["kind"] == "spares.promoted"] == [(spare["name"], victim["name"], 1)]  # fmt: skip
    # Seen dying (its threads ending) before the kernel had torn it down and reaped it.
    (dying,) = [e for e in events(dm, "spares.shard_dying") if e["unit"] == victim["name"]]
    assert "dying" in promoted["why"], promoted["why"]
    assert killed_wall <= dying["wall"] <= first_wall(dm, victim["name"], "backoff", killed_wall)
    # In service before the dead shard's new process had even booted (its cold start).
    rebooted = first_wall(dm, victim["name"], "held", killed_wall)
    assert killed_wall <= promoted["wall"] < rebooted
    assert again["spare"]["name"] == victim["name"] and back["restarts"] == 1
    assert {u["name"] for u in again["serving"]} == {
        spare["name"],
        *(u["name"] for u in roles["serving"][1:]),
    }
    failures = [r for r in history.rows if r["status"] != 200]
    assert failures == [], failures[:3]
    served = [r for r in history.rows if r["status"] == 200]
    assert served and {r["version"] for r in served} == {1}
    assert served_only_when_current(dm, history, spare["dynamo"]["instance_ids"][0], spare["name"])
    samples = scrape(port)
    assert samples[("dynamod_spare_promotions_total", frozenset({("reason", "exit")}))] == 1
    assert samples[("dynamod_spares_available", frozenset())] == 1


def test_sleeping_spare_behind_the_push_is_woken_and_replayed_before_it_serves(
    dm: Dynamod, stack: Path, tmp_path: Path
) -> None:
    status = up(dm, stack)
    base = model_dir(status)
    roles = settled(dm, 0)
    spare = roles["spare"]
    asleep = dm.run("policy", "spares", "--sleep", "--json", check=True)
    assert json.loads(asleep.stdout)["spares"] == [spare["name"]]
    dm.wait_for(lambda s: unit_by_name(s, spare["name"])["spare"]["sleeping"], what="spare asleep")
    assert "spare (asleep)" in dm.run("status", check=True).stdout
    # The push serves the trainer from the serving shards; a sleeping spare cannot load
    # weights, so it stays one version behind until it is woken.
    result = push(dm, 1, checkpoint(base, tmp_path / "step-1", 1.01))
    assert result["ok"] and set(result["acks"]) == {u["name"] for u in roles["serving"]}
    behind = dm.wait_for(
        lambda s: (u := unit_by_name(s, spare["name"]))["spare"]["behind"] == 1 and u,
        what="the sleeping spare one version behind",
    )
    assert behind["policy_version"] == 0
    assert "1 behind, asleep" in behind["detail"]

    history = History(frontend(status))
    history.run(lambda: 1)
    history.wait_served(12)  # traffic flows before the fault
    victim = roles["serving"][1]
    os.kill(victim["pid"], signal.SIGKILL)
    (promoted,) = wait_event(dm, "spares.promoted")
    dm.wait_ready_again(victim["name"], victim["pid"], timeout=60, what="victim back")
    again = settled(dm, 1)
    history.wait_served(16, after=time.monotonic())  # traffic after it settled
    history.stop()

    assert promoted["unit"] == spare["name"] and promoted["version"] == 1
    assert {"wake", "pause", "load", "kv_reset", "verify", "taint"} <= set(promoted["steps_ms"])
    assert promoted["replay_ms"] > 0
    assert promoted["was_version"] == 0 and promoted["was_asleep"] is True
    woken = unit_by_name(dm.status(), spare["name"])
    assert woken["spare"]["role"] == "serving" and woken["spare"]["sleeping"] is False
    # The dead shard came back as the new spare, caught up, and went to sleep as asked.
    assert again["spare"]["name"] == victim["name"]
    dm.wait_for(
        lambda s: unit_by_name(s, victim["name"])["spare"]["sleeping"], what="new spare asleep"
    )
    failures = [r for r in history.rows if r["status"] != 200]
    assert failures == [], failures[:3]
    rows = served_only_when_current(dm, history, spare["dynamo"]["instance_ids"][0], spare["name"])
    assert rows, "the promoted spare never served"


def test_push_with_spares_keeps_them_current_off_the_trainers_path(
    dm: Dynamod, stack: Path, tmp_path: Path
) -> None:
    status = up(dm, stack)
    base = model_dir(status)
    roles = settled(dm, 0)
    for step in (1, 2):
        result = push(dm, step, checkpoint(base, tmp_path / f"step-{step}", 1 + step / 100))
        assert result["ok"] and result["stale"] == []
        assert set(result["acks"]) == {u["name"] for u in roles["serving"]}
        current = wait_event(dm, "spares.current", count=step)
        assert current[-1]["version"] == step and current[-1]["since_push_ms"] > 0
        again = settled(dm, step)
        assert again["spare"]["name"] == roles["spare"]["name"]
        assert again["spare"]["policy"]["digest"] == result["digest"]
    ledger = json.loads(dm.run("policy", "status", "--json", check=True).stdout)
    by_name = {s["name"]: s for s in ledger["shards"]}
    assert by_name[roles["spare"]["name"]]["role"] == "spare"
    assert not by_name[roles["spare"]["name"]]["admitted"]


def test_a_spare_that_dies_leaves_the_serving_shards_alone(dm: Dynamod, stack: Path) -> None:
    status = up(dm, stack)
    roles = settled(dm, 0)
    history = History(frontend(status))
    history.run(lambda: 0)
    history.wait_served(12)  # traffic flows before the fault
    spare = roles["spare"]
    os.kill(spare["pid"], signal.SIGKILL)
    dm.wait_ready_again(spare["name"], spare["pid"], timeout=60, what="spare back")
    again = settled(dm, 0)
    history.wait_served(8, after=time.monotonic())  # traffic after it settled
    history.stop()
    assert again["spare"]["name"] == spare["name"], "the spare came back serving"
    assert events(dm, "spares.promoted") == []
    for before in roles["serving"]:
        after = unit_by_name(dm.status(), before["name"])
        assert after["pid"] == before["pid"] and after["restarts"] == 0
    failures = [r for r in history.rows if r["status"] != 200]
    assert failures == [], failures[:3]
    assert history.rows and {r["version"] for r in history.rows} == {0}


def test_two_kills_in_a_row_with_one_spare(dm: Dynamod, stack: Path) -> None:
    status = up(dm, stack)
    roles = settled(dm, 0)
    history = History(frontend(status))
    history.run(lambda: 0)
    history.wait_served(12)  # traffic flows before the fault
    first, second = roles["serving"]
    os.kill(first["pid"], signal.SIGKILL)
    wait_event(dm, "spares.promoted")
    os.kill(second["pid"], signal.SIGKILL)  # no spare left: the first victim is still booting
    (none_left,) = wait_event(dm, "spares.none_available")
    assert none_left["replaced"] == second["name"]
    again = settled(dm, 0)
    history.wait_served(8, after=time.monotonic())  # traffic after it settled
    history.stop()
    # The first shard back took the empty serving place, the second became the spare.
    serving = {u["name"] for u in again["serving"]}
    assert roles["spare"]["name"] in serving and len(events(dm, "spares.promoted")) == 1
    assert {again["spare"]["name"], *serving} == {
        first["name"],
        second["name"],
        roles["spare"]["name"],
    }
    failures = [r for r in history.rows if r["status"] != 200]
    assert failures == [], failures[:3]


def test_a_shard_that_fails_a_push_is_replaced_by_the_spare_and_rejoins_as_spare(
    dm: Dynamod, stack: Path, tmp_path: Path
) -> None:
    status = up(dm, stack)
    roles = settled(dm, 0)
    stuck, fine = roles["serving"]
    ckpt = checkpoint(model_dir(status), tmp_path / "step-1", 1.01)
    os.kill(stuck["pid"], signal.SIGSTOP)  # its update call times out: alive but stale
    try:
        result = push(dm, 1, ckpt)
    finally:
        try:
            os.kill(stuck["pid"], signal.SIGCONT)
        except ProcessLookupError:
            # Its liveness probe (3 x 2 s) killed it before the push returned: a kill, not
            # a failed update. Only on a machine too slow for a 3 s call timeout.
            pytest.skip("the stopped shard was killed by its liveness probe first")
    assert result["ok"] and result["stale"] == [stuck["name"]]
    (promoted,) = wait_event(dm, "spares.promoted")
    assert promoted["replaced"] == stuck["name"]
    assert promoted["reason"] == "verification" and promoted["version"] == 1
    again = settled(dm, 1)
    assert events(dm, "spares.promotion_failed") == []
    assert promoted["unit"] == roles["spare"]["name"]
    assert again["spare"]["name"] == stuck["name"] and again["spare"]["pid"] == stuck["pid"]
    assert {u["name"] for u in again["serving"]} == {fine["name"], roles["spare"]["name"]}


def test_a_hung_serving_shard_is_replaced_as_lost_before_it_is_killed(
    dm: Dynamod, stack: Path
) -> None:
    port = free_port()
    status = up(dm, stack, "--metrics-addr", f"127.0.0.1:{port}")
    roles = settled(dm, 0)
    history = History(frontend(status))
    history.run(lambda: 0)
    history.wait_served(12)  # traffic flows before the fault
    hung, spare = roles["serving"][0], roles["spare"]
    stopped_wall = time.time()
    os.kill(hung["pid"], signal.SIGSTOP)  # alive, but its liveness probe times out
    try:
        (promoted,) = wait_event(dm, "spares.promoted", timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung["pid"], signal.SIGCONT)
    dm.wait_ready_again(hung["name"], hung["pid"], timeout=90, what="the hung shard back")
    again = settled(dm, 0)
    history.wait_served(8, after=time.monotonic())  # traffic after it settled
    history.stop()

    assert promoted["reason"] == "lost" and promoted["replaced"] == hung["name"]
    assert promoted["unit"] == spare["name"] and "liveness failed" in promoted["why"]
    (promoting,) = [e for e in events(dm, "spares.promoting") if e["replaced"] == hung["name"]]
    killed = first_wall(dm, hung["name"], "backoff", stopped_wall)
    assert promoting["wall"] <= killed, "the spare was promoted only after the kill"
    assert [e["reason"] for e in events(dm, "spares.promoted")] == ["lost"], "promoted twice"
    assert again["spare"]["name"] == hung["name"]
    assert {u["name"] for u in again["serving"]} == {spare["name"], roles["serving"][1]["name"]}
    served = [r for r in history.rows if r["status"] == 200]
    assert served_only_when_current(dm, history, spare["dynamo"]["instance_ids"][0], spare["name"])
    failures = [r for r in history.rows if r["status"] != 200]
    assert served and failures == [], failures[:3]
    samples = scrape(port)
    assert samples[("dynamod_spare_promotions_total", frozenset({("reason", "lost")}))] == 1
    assert samples[("dynamod_spare_promotions_total", frozenset({("reason", "exit")}))] == 0


def test_a_promoted_spare_serves_only_once_a_canary_reaches_it_through_the_frontend(
    dm: Dynamod, stack: Path
) -> None:
    status = up(dm, stack)
    roles = settled(dm, 0)
    victim, spare = roles["serving"][0], roles["spare"]
    front = unit_by_name(status, "frontend")
    # A frontend that cannot answer for 0.5 s (less than its liveness allows): the
    # spare's taint is set at once, but nothing is routed until the frontend answers.
    os.kill(front["pid"], signal.SIGSTOP)
    try:
        os.kill(victim["pid"], signal.SIGKILL)
        time.sleep(0.5)
        assert events(dm, "spares.promoted") == [], "promoted with no canary answered"
    finally:
        resumed_wall = time.time()
        os.kill(front["pid"], signal.SIGCONT)
    (promoted,) = wait_event(dm, "spares.promoted")
    assert promoted["unit"] == spare["name"] and promoted["wall"] >= resumed_wall
    # It waited for the canary: not promoted while the frontend was stopped (above), and
    # promoted only after it resumed, by its route step (how long that step took depends
    # on how soon the loaded daemon saw the kill, so it is not held to a number here).
    assert "route" in promoted["steps_ms"], promoted["steps_ms"]
    again = settled(dm, 0)
    assert unit_by_name(again["status"], "frontend")["pid"] == front["pid"], "frontend restarted"
    assert unit_by_name(again["status"], spare["name"])["policy"]["admitted"] is True
