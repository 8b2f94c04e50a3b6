"""decide_exit and the premature rule as pure functions: what an exit means for a unit."""

from __future__ import annotations

import pytest

from dynamod.core.exits import (
    ExitFacts,
    OomKill,
    before_ready_hint,
    decide_exit,
    describe_exit,
    oom_kill,
    premature,
)
from dynamod.core.restart import Exit, RestartTracker
from dynamod.core.spec import RestartSpec, UnitSpec
from dynamod.core.state import UnitState

OK, FAIL = Exit(code=0, signal=None), Exit(code=1, signal=None)


def unit(**restart: object) -> UnitSpec:
    return UnitSpec.model_validate(
        {
            "name": "app",
            "unit": "app",
            "source": "stack.toml",
            "command": ["app"],
            "restart": restart,
        }
    )


def tracker(**restart: object) -> RestartTracker:
    return RestartTracker(RestartSpec.model_validate({"jitter": 0, **restart}))


@pytest.mark.parametrize(
    ("kind", "was_ready", "clean_exit_final", "expected"),
    [
        ("service", False, False, True),
        ("service", False, True, True),  # before ready: a failure whatever the spec says
        ("service", True, False, True),  # a service is expected to keep running
        ("service", True, True, False),
        ("oneshot", False, False, False),
        ("oneshot", True, False, False),
    ],
)
def test_premature(kind: str, was_ready: bool, clean_exit_final: bool, expected: bool) -> None:
    spec = unit(clean_exit_final=clean_exit_final).model_copy(update={"type": kind})
    assert premature(spec, was_ready=was_ready) is expected


def test_the_before_ready_hint_names_the_probe_or_min_uptime() -> None:
    assert before_ready_hint(unit(min_uptime=2), "refused") == (
        "exited within min_uptime 2s, before it counted as ready"
    )


def test_an_exit_while_a_dependency_is_away_waits_and_is_not_counted() -> None:
    t = tracker()
    outcome = decide_exit(
        ExitFacts(FAIL, premature=True, uptime=5, now=100, away=["etcd (ready)"]), t
    )
    assert outcome.state is UnitState.WAITING and outcome.decision.restart
    assert outcome.detail == (
        "exited with status 1; waiting for etcd (ready) (not counted as a restart)"
    )
    assert t.total == 0 and not t.history


def test_a_dependency_away_does_not_restart_what_the_policy_would_not() -> None:
    outcome = decide_exit(
        ExitFacts(FAIL, premature=True, uptime=5, now=100, away=["etcd (ready)"]),
        tracker(policy="never"),
    )
    assert outcome.state is UnitState.FAILED
    assert outcome.detail == "exited with status 1; restart policy 'never' does not restart it"


@pytest.mark.parametrize(
    ("exit", "is_premature", "state"),
    [
        (OK, False, UnitState.COMPLETED),
        (OK, True, UnitState.FAILED),
        (FAIL, False, UnitState.FAILED),
    ],
)
def test_no_restart_completes_only_a_clean_timely_exit(
    exit: Exit, is_premature: bool, state: UnitState
) -> None:
    outcome = decide_exit(
        ExitFacts(exit, premature=is_premature, uptime=5, now=100), tracker(policy="never")
    )
    assert outcome.state is state and not outcome.decision.restart


def test_backoff_counts_and_the_limit_fails() -> None:
    t = tracker(first_delay=0.5, backoff_initial=1, limit_burst=2, limit_interval=60)
    facts = [ExitFacts(FAIL, premature=True, uptime=1, now=100 + i, hint="oom") for i in range(3)]
    first, second, third = (decide_exit(f, t) for f in facts)
    assert (first.state, first.decision.delay) == (UnitState.BACKOFF, 0.5)
    assert first.detail == "exited with status 1 (oom); restarting in 0.50s (restart 1)"
    assert (second.state, second.decision.delay) == (UnitState.BACKOFF, 1.0)
    assert third.state is UnitState.FAILED and not third.decision.restart
    assert third.detail == (
        "exited with status 1 (oom); restart limit reached: 2 restarts within 60s (limit_burst=2)"
    )
    assert t.total == 2


# --------------------------------------------------------------------------- OOM kills

KILLED = Exit(code=None, signal=9)


def test_a_sigkill_with_an_oom_kill_counted_is_named_with_its_limit() -> None:
    oom = oom_kill(KILLED, kills=1, limit="memory_max 64M")
    assert oom == OomKill("memory_max 64M")
    outcome = decide_exit(
        ExitFacts(KILLED, premature=True, uptime=5, now=100, oom=oom), tracker(limit_burst=1)
    )
    assert outcome.state is UnitState.BACKOFF
    assert outcome.detail.startswith("killed by the kernel's OOM killer (memory_max 64M); ")
    assert describe_exit(KILLED, OomKill(None)) == "killed by the kernel's OOM killer"


def test_an_operators_kill_9_is_not_an_oom_kill_and_keeps_its_words() -> None:
    t = tracker(limit_burst=1)
    decide_exit(ExitFacts(KILLED, premature=True, uptime=5, now=100), t)
    assert oom_kill(KILLED, kills=0, limit="memory_max 64M") is None  # nothing counted
    outcome = decide_exit(
        ExitFacts(KILLED, premature=True, uptime=5, now=101,
                  oom=oom_kill(KILLED, kills=0, limit="memory_max 64M")),
        t,
    )  # fmt: skip
    assert outcome.state is UnitState.FAILED
    assert outcome.detail.startswith("killed by SIGKILL; restart limit reached")


@pytest.mark.parametrize("exit", [FAIL, OK, Exit(code=None, signal=15)])
def test_only_a_sigkill_is_taken_for_the_oom_killer(exit: Exit) -> None:
    # a child of the unit OOM-killed while the main process exits otherwise: its own words
    assert oom_kill(exit, kills=2, limit="memory_max 64M") is None
