import pytest

from dynamod.core.state import ALLOWED, IllegalTransition, UnitState, check_transition


def test_every_state_has_a_transition_row() -> None:
    assert set(ALLOWED) == set(UnitState)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("inactive", "starting"),
        ("starting", "ready"),
        ("ready", "degraded"),
        ("degraded", "ready"),
        ("ready", "backoff"),
        ("backoff", "starting"),
        ("backoff", "failed"),
        ("starting", "held"),
        ("held", "ready"),
        ("ready", "stopping"),
        ("stopping", "stopped"),
        ("stopped", "starting"),
        ("failed", "starting"),
        ("starting", "completed"),
        ("ready", "waiting"),  # exited while a dependency was away
        ("backoff", "waiting"),
        ("waiting", "starting"),
        ("waiting", "stopped"),
    ],
)
def test_allowed(old: str, new: str) -> None:
    check_transition("u", UnitState(old), UnitState(new))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("inactive", "ready"),  # must start and pass its probe first
        ("stopped", "ready"),
        ("backoff", "ready"),
        ("stopping", "starting"),  # a stop always finishes
        ("failed", "ready"),
        ("completed", "backoff"),
        ("waiting", "ready"),  # waiting means no process: it must start again first
        ("inactive", "waiting"),  # a unit that never ran is inactive while it waits
    ],
)
def test_refused(old: str, new: str) -> None:
    with pytest.raises(IllegalTransition) as info:
        check_transition("worker@0", UnitState(old), UnitState(new))
    assert "worker@0" in str(info.value) and f"{old} -> {new}" in str(info.value)


def test_running_and_settled() -> None:
    assert UnitState.HELD.running and UnitState.DEGRADED.running
    assert not UnitState.BACKOFF.running
    assert UnitState.FAILED.settled and UnitState.STOPPED.settled
    assert not UnitState.READY.settled
