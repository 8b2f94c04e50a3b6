"""Runbooks on the real CPU stack (etcd, NATS, Dynamo frontend and workers), quick profile:
each CI runbook's verdict must match what it expects, and every checker also gets a
deliberately broken variant whose verdict must be a failure: a broken dynamod (admission
without replay, via the test-only DYNAMOD_TEST_ADMIT_WITHOUT_REPLAY), a unit that leaks a
process, or a bound that the recorded history cannot meet."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from dynamod.chaos import model, runner
from dynamod.chaos.journal import summary
from dynamod.chaos.model import Invariant, Profile, Runbook
from tests.conftest import wait_dead

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

# Extra invariants judged over the same run, each of which the recorded history must fail.
MUST_FAIL: dict[str, list[dict[str, Any]]] = {
    # errors are certain while no frontend listens; no policy moves with trainer_steps = 0
    "frontend-crash": [{"check": "client_errors", "max_errors": 0},
                       {"check": "trainer_progress", "min_versions": 1}],
    # a hang is only detected after three failed liveness probes (2 s apart)
    "worker-hang": [{"check": "recovery_time", "max_seconds": 2}],
}

# The CI set (each 27-61 s with a light load on 2 cores, 48-130 s at load ~15); the rest
# run in `make chaos` (see the README for every runbook's duration and verdict).
# Four in CI to keep the whole suite's time down; `make chaos-quick` runs every runbook.
CI_RUNBOOKS = ["worker-sigkill", "stale-shard", "etcd-restart", "shutdown-leaves-nothing"]


def run(rb: Runbook, tmp_path: Path) -> dict[str, Any]:
    journal = runner.run(rb, Profile.QUICK, tmp_path, echo=lambda _: None)
    (run_dir,) = tmp_path.glob(f"*-{rb.name}")
    assert (run_dir / "timeline.png").stat().st_size > 10_000
    assert (run_dir / "history.jsonl").exists()
    written = json.loads((run_dir / "journal.json").read_text())
    assert written["status"] == str(journal.status)
    assert {"before", "after", "during"} <= set(written["steady_states"])
    for activity in written["run"] + written["rollbacks"]:
        assert {"start", "end", "duration", "status", "output"} <= set(activity)
    return written


@pytest.mark.parametrize("name", CI_RUNBOOKS)
def test_runbook_quick_profile(name: str, tmp_path: Path) -> None:
    stock = model.load(model.find(name))
    extra = [Invariant.model_validate(i) for i in MUST_FAIL.get(name, [])]
    rb = stock.model_copy(update={"invariants": [*stock.invariants, *extra]})
    journal = run(rb, tmp_path)
    checks = journal["checks"]
    judged, broken = checks[: len(stock.invariants)], checks[len(stock.invariants):]
    table = summary([journal])
    if stock.expect == "pass":
        assert journal["status"] == "completed" and not journal["deviated"], table
        assert all(c["ok"] for c in judged), table
    else:
        assert not all(c["ok"] for c in judged) or journal["status"] != "completed", table
    for check in broken:
        assert not check["ok"], f"{check['check']} must fail on this history: {check}"


def test_admission_without_replay_is_caught_by_the_stale_serving_checkers(
    tmp_path: Path,
) -> None:
    stock = model.load(model.find("worker-sigkill"))
    rb = stock.model_copy(update={
        "env": {"DYNAMOD_TEST_ADMIT_WITHOUT_REPLAY": "1"},
        # the default prompts are shorter than a KV block: no prefix is ever reused
        "invariants": [*stock.invariants, Invariant(check="cache_hit_recovers")],
    })
    journal = run(rb, tmp_path)
    verdicts = {c["check"]: c for c in journal["checks"]}
    assert not verdicts["no_stale_serving"]["ok"], verdicts["no_stale_serving"]
    assert "stale shard" in verdicts["no_stale_serving"]["detail"]
    assert not verdicts["shards_current"]["ok"], verdicts["shards_current"]
    assert "the shard says" in verdicts["shards_current"]["detail"]
    assert not verdicts["cache_hit_recovers"]["ok"]
    assert verdicts["no_leftovers"]["ok"], verdicts["no_leftovers"]
    assert not journal["passed"]


def test_a_leaked_process_is_ended_by_containment_and_no_leftovers_agrees(tmp_path: Path) -> None:
    pidfile = tmp_path / "leaked.pid"
    stack = tmp_path / "leaky.toml"
    stack.write_text(f"""
[stack]
name = "leaky"

[units.leaky]
command = ["{{python}}", "{FIXTURES / 'leaky.py'}", "{{ports.listen}}", "{pidfile}"]
ports = {{ listen = 0 }}
""")
    rb = Runbook.model_validate({
        "name": "leaky", "description": "a unit leaves an unmarked listener behind",
        "stack": str(stack), "method": [{"action": "wait", "seconds": 1}],
        "invariants": [{"check": "no_leftovers"}],
        "quick": {"load_seconds": 1, "timeout": 60}})
    # The leaked listener leaves its session and drops the marker; the unit's cgroup (or,
    # without one, the subreaper's orphan sweep) still ends it at `down`, so nothing is
    # left and the checker says so. Its failing verdict on a real leftover is in
    # tests/unit/test_chaos_checkers.py.
    leaked = None
    try:
        journal = run(rb, tmp_path / "runs")
        leaked = int(pidfile.read_text())
        assert wait_dead([leaked], timeout=5) == [], "the leaked listener survived down"
    finally:
        if leaked is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leaked, signal.SIGKILL)
    (verdict,) = journal["checks"]
    assert verdict["ok"] and not verdict["measured"]["bound_ports"], verdict
