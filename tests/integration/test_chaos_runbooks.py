"""Every runbook on the real CPU stack (etcd, NATS, Dynamo frontend and workers), quick
profile, runbooks of one stack sharing it: each verdict must match what the runbook
expects, and checkers also get deliberately broken variants whose verdict must be a
failure: a broken dynamod (admission without replay, via the test-only
DYNAMOD_TEST_ADMIT_WITHOUT_REPLAY), a unit that leaks a process, or a bound that the
recorded history cannot meet."""

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

# Extra invariants judged over the same run, each of which the recorded history must fail
# (the integration broken variants; every checker's must-fail history is also in
# tests/unit/test_chaos_checkers.py).
MUST_FAIL: dict[str, list[dict[str, Any]]] = {
    # no policy moves with trainer_steps = 0. (Not client_errors here: a killed frontend is
    # back in about 0.3 s, when 4 clients at 8 req/s send ~2 requests into the gap, and a
    # CI run saw none.)
    "frontend-crash": [{"check": "trainer_progress", "min_versions": 1}],
    # every client's request sent into the stopped frontend stalls until liveness kills it
    # (three failed probes, 2 s apart), then is reset: 12 of 140 failed in two runs
    "frontend-hang": [{"check": "client_errors", "max_errors": 0}],
    # a hang is only detected after three failed liveness probes (2 s apart)
    "worker-hang": [{"check": "recovery_time", "max_seconds": 2}],
    # its own `up` succeeds: it did not fail, whatever it would have named
    "shutdown-leaves-nothing": [{"check": "up_fails_naming", "names": ["nats"]}],
    # the CPU worker is asked no logprobs here: nothing to line up
    "worker-sigkill": [{"check": "token_alignment"}],
}

# Runbooks whose verdict another engineer's open work decides; their journals are checked
# (written, shaped) but a failing verdict does not fail CI. Remove an entry once it passes.
# (slow-etcd and etcd-restart left this list on 2026-12-01: both pass since the frontend's
# liveness probes `/live`, which does not read etcd.)
OPEN_ELSEWHERE: dict[str, str] = {}


# Every runbook runs in CI, quick profile; runbooks of one stack, vars and env share one
# started stack (dynamod/chaos/runner.py), so each group is one test.
GROUPS = runner.groups(model.load_all())


def written_journal(run_dir: Path, journal: dict[str, Any]) -> dict[str, Any]:
    assert (run_dir / "timeline.png").stat().st_size > 10_000
    assert (run_dir / "history.jsonl").exists()
    written = json.loads((run_dir / "journal.json").read_text())
    assert written["status"] == journal["status"]
    assert {"before", "after", "during"} <= set(written["steady_states"])
    for activity in written["run"] + written["rollbacks"]:
        assert {"start", "end", "duration", "status", "output"} <= set(activity)
    return written


def run(rb: Runbook, tmp_path: Path) -> dict[str, Any]:
    journal = runner.run(rb, Profile.QUICK, tmp_path, echo=lambda _: None)
    (run_dir,) = tmp_path.glob(f"*-{rb.name}")
    return written_journal(run_dir, journal.as_dict())


def with_broken_checks(stock: Runbook) -> Runbook:
    extra = [Invariant.model_validate(i) for i in MUST_FAIL.get(stock.name, [])]
    return stock.model_copy(update={"invariants": [*stock.invariants, *extra]})


def verdict_problems(stock: Runbook, journal: dict[str, Any]) -> list[str]:
    checks = journal["checks"]
    judged, broken = checks[: len(stock.invariants)], checks[len(stock.invariants):]
    problems = [f"{stock.name}: {c['check']} must fail on this history: {c}"
                for c in broken if c["ok"]]
    passed = journal["status"] == "completed" and not journal["deviated"] and all(
        c["ok"] for c in judged)
    if stock.expect == "pass" and not passed and stock.name not in OPEN_ELSEWHERE:
        problems.append(f"{stock.name}: expected to pass")
    if stock.expect != "pass" and passed:
        problems.append(f"{stock.name}: passed, but it expects {stock.expect}: update it")
    return problems


# Each stack group is its own xdist group: `make test` (-n 2) spreads them over both workers.
@pytest.mark.parametrize("group", [
    pytest.param(g, marks=pytest.mark.xdist_group(f"chaos-{g[0].name}"),
                 id=g[0].name + (f"+{len(g) - 1}" if len(g) > 1 else "")) for g in GROUPS])
def test_every_runbook_quick_profile(group: list[Runbook], tmp_path: Path) -> None:
    journals = [j.as_dict() for j in runner.run_group(
        [with_broken_checks(rb) for rb in group], Profile.QUICK, tmp_path, echo=print)]
    assert [j["experiment"]["name"] for j in journals] == [rb.name for rb in group]
    problems = []
    for stock, journal in zip(group, journals, strict=True):
        (run_dir,) = tmp_path.glob(f"*-{stock.name}")
        written_journal(run_dir, journal)
        problems += verdict_problems(stock, journal)
    assert not problems, "\n".join(problems) + "\n\n" + summary(journals)


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
